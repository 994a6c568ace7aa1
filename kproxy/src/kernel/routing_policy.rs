//! Whether the node's IPv4 routing answers ignore a packet's source address: read from the
//! kernel (one rtnetlink dump of the policy rules, one of the routes of every table) in the
//! network namespace of the calling thread.
//!
//! A route lookup keyed by destination, ingress device and TOS gives every source the same
//! answer when:
//! - the policy rules are the kernel's defaults only ([`rules_are_default`]): `local` (0),
//!   `main` (32766), `default` (32767), none with a selector (source or destination prefix,
//!   TOS, fwmark, iif/oif, ports, uid, ...); then the kernel itself skips rule matching;
//! - no route has several next hops (`RTA_MULTIPATH`, or a next-hop object, `RTA_NH_ID`,
//!   which may be a group: multipath hashing takes the source, and the ports under
//!   `fib_multipath_hash_policy` 1) or a TOS key ([`route_is_plain`]).
//!
//! The eBPF XDP fast path caches a new flow's route per backend only then
//! (`dataplane::ebpf::node_path::xdp`). Unknown rule attributes count as selectors, so a
//! kernel that reports more about its default rules turns that cache off, never on wrongly.

use std::io;

use rtnetlink::packet_core::Nla;
use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::kernel::rtnl::{RouteSocket, dump_request};

/// `FRA_PAD`: padding a rule may carry (`netlink-packet-route` has no variant for it).
const FRA_PAD: u16 = 18;

/// The kernel's default IPv4 rules: (priority, table).
pub(crate) const DEFAULT_RULES: [(u32, u32); 3] = [(0, 255), (32_766, 254), (32_767, 253)];

/// One IPv4 policy rule, as far as this module looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rule {
    pub priority: u32,
    pub table: u32,
    /// A selector or an action other than "look up the table".
    pub selective: bool,
}

/// Whether `rules` are exactly the kernel's defaults ([`DEFAULT_RULES`], no selectors).
pub(crate) fn rules_are_default(rules: &[Rule]) -> bool {
    let mut seen: Vec<(u32, u32)> = rules
        .iter()
        .filter(|r| !r.selective)
        .map(|r| (r.priority, r.table))
        .collect();
    seen.sort_unstable();
    rules.iter().all(|r| !r.selective) && seen == DEFAULT_RULES
}

/// The rule an `RTM_NEWRULE` describes: prefix lengths, TOS or an action other than
/// "to table" in the header, and every attribute but the priority, the table, the protocol,
/// padding and the "none" (-1) suppressors count as selective.
pub(crate) fn rule_of(msg: &RuleMessage) -> Rule {
    let h = &msg.header;
    let mut rule = Rule {
        priority: 0,
        table: u32::from(h.table),
        selective: h.dst_len != 0
            || h.src_len != 0
            || h.tos != 0
            || h.action != RuleAction::ToTable,
    };
    for a in &msg.attributes {
        match a {
            RuleAttribute::Priority(p) => rule.priority = *p,
            RuleAttribute::Table(t) => rule.table = *t,
            RuleAttribute::Protocol(_) => {}
            RuleAttribute::SuppressIfGroup(u32::MAX)
            | RuleAttribute::SuppressPrefixLen(u32::MAX) => {}
            RuleAttribute::Other(nla) if nla.kind() == FRA_PAD => {}
            _ => rule.selective = true,
        }
    }
    rule
}

/// Whether the route of an `RTM_NEWROUTE` has one next hop (no `RTA_MULTIPATH`, no next-hop
/// object `RTA_NH_ID`) and no TOS key.
pub(crate) fn route_is_plain(msg: &RouteMessage) -> bool {
    msg.header.tos == 0
        && !msg
            .attributes
            .iter()
            .any(|a| matches!(a, RouteAttribute::MultiPath(_) | RouteAttribute::NhId(_)))
}

/// The answers of an `AF_INET` dump of `msg`; `None` when one does not parse.
fn dump_v4(
    sock: &mut RouteSocket,
    msg: RouteNetlinkMessage,
) -> io::Result<Option<Vec<RouteNetlinkMessage>>> {
    match sock.collect(dump_request(msg)) {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            tracing::debug!(error = %e, "an rtnetlink answer did not parse");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Whether the calling thread's network namespace routes IPv4 without looking at the source
/// (module docs). An answer that does not parse counts as "no".
pub(crate) fn source_independent() -> io::Result<bool> {
    let mut sock = RouteSocket::open()?;
    let mut rule = RuleMessage::default();
    rule.header.family = AddressFamily::Inet;
    let Some(answers) = dump_v4(&mut sock, RouteNetlinkMessage::GetRule(rule))? else {
        return Ok(false);
    };
    let rules: Vec<Rule> = answers
        .iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRule(r) => Some(rule_of(r)),
            _ => None,
        })
        .collect();
    if !rules_are_default(&rules) {
        return Ok(false);
    }
    let mut route = RouteMessage::default();
    route.header.address_family = AddressFamily::Inet;
    let Some(answers) = dump_v4(&mut sock, RouteNetlinkMessage::GetRoute(route))? else {
        return Ok(false);
    };
    Ok(answers.iter().all(|m| match m {
        RouteNetlinkMessage::NewRoute(r) => route_is_plain(r),
        _ => true,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtnetlink::packet_core::DefaultNla;
    use rtnetlink::packet_route::route::{RouteAddress, RouteNextHop};

    fn rule(priority: u32, table: u32, extra: Vec<RuleAttribute>) -> RuleMessage {
        let mut m = RuleMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.action = RuleAction::ToTable;
        m.header.table = u8::try_from(table).unwrap_or(0);
        m.attributes.push(RuleAttribute::Table(table));
        m.attributes
            .push(RuleAttribute::SuppressPrefixLen(u32::MAX));
        if priority != 0 {
            m.attributes.push(RuleAttribute::Priority(priority));
        }
        m.attributes.push(RuleAttribute::Protocol(2.into()));
        m.attributes.extend(extra);
        m
    }

    fn defaults() -> Vec<Rule> {
        DEFAULT_RULES
            .iter()
            .map(|(prio, table)| rule_of(&rule(*prio, *table, vec![])))
            .collect()
    }

    #[test]
    fn the_kernels_default_rules_are_default() {
        assert!(rules_are_default(&defaults()));
        let padded = rule(
            32_766,
            254,
            vec![RuleAttribute::Other(DefaultNla::new(FRA_PAD, vec![]))],
        );
        assert!(!rule_of(&padded).selective, "padding is no selector");
    }

    #[test]
    fn a_selector_an_extra_or_a_missing_rule_is_not_default() {
        let mut with_src = defaults();
        with_src.push(rule_of(&rule(
            100,
            100,
            vec![RuleAttribute::Source("10.0.0.0".parse().unwrap())],
        )));
        assert!(with_src.last().unwrap().selective);
        assert!(!rules_are_default(&with_src));
        let mut fwmark = defaults();
        fwmark[1] = rule_of(&rule(32_766, 254, vec![RuleAttribute::FwMark(1)]));
        assert!(!rules_are_default(&fwmark));
        let suppress = rule(32_766, 254, vec![RuleAttribute::SuppressPrefixLen(0)]);
        assert!(rule_of(&suppress).selective);
        let mut src_len = rule(32_766, 254, vec![]);
        src_len.header.src_len = 8;
        assert!(rule_of(&src_len).selective);
        let mut goto = rule(32_766, 254, vec![]);
        goto.header.action = RuleAction::Goto;
        assert!(rule_of(&goto).selective);
        let unknown = rule(
            32_766,
            254,
            vec![RuleAttribute::Other(DefaultNla::new(99, vec![0; 4]))],
        );
        assert!(
            rule_of(&unknown).selective,
            "an attribute this module does not know selects"
        );
        let mut extra_table = defaults();
        extra_table.push(rule_of(&rule(1000, 100, vec![])));
        assert!(!rules_are_default(&extra_table));
        assert!(!rules_are_default(&defaults()[1..]));
    }

    #[test]
    fn multipath_next_hop_objects_and_tos_keys_make_a_route_not_plain() {
        let mut plain = RouteMessage::default();
        plain.header.address_family = AddressFamily::Inet;
        plain.header.destination_prefix_length = 24;
        plain.header.table = 254;
        plain
            .attributes
            .push(RouteAttribute::Gateway(RouteAddress::Inet(
                "10.0.0.1".parse().unwrap(),
            )));
        assert!(route_is_plain(&plain));
        let mut multi = plain.clone();
        multi
            .attributes
            .push(RouteAttribute::MultiPath(vec![RouteNextHop::default()]));
        assert!(!route_is_plain(&multi));
        let mut nh = plain.clone();
        nh.attributes.push(RouteAttribute::NhId(7));
        assert!(!route_is_plain(&nh));
        let mut tos = plain.clone();
        tos.header.tos = 0x10;
        assert!(!route_is_plain(&tos));
    }

    #[test]
    fn a_fresh_namespace_routes_without_looking_at_the_source() {
        let Some(r) = crate::kernel::rtnl::tests::in_new_netns(|| {
            crate::kernel::rtnl::tests::ip(&["link", "set", "lo", "up"]);
            let fresh = source_independent().unwrap();
            crate::kernel::rtnl::tests::ip(&["rule", "add", "from", "10.1.0.0/16", "table", "100"]);
            let with_rule = source_independent().unwrap();
            crate::kernel::rtnl::tests::ip(&["rule", "del", "from", "10.1.0.0/16", "table", "100"]);
            crate::kernel::rtnl::tests::ip(&[
                "link", "add", "kp-d0", "type", "veth", "peer", "name", "kp-d1",
            ]);
            crate::kernel::rtnl::tests::ip(&["link", "set", "kp-d0", "up"]);
            crate::kernel::rtnl::tests::ip(&["addr", "add", "10.9.0.1/24", "dev", "kp-d0"]);
            crate::kernel::rtnl::tests::ip(&[
                "route",
                "add",
                "10.8.0.0/16",
                "nexthop",
                "via",
                "10.9.0.2",
                "nexthop",
                "via",
                "10.9.0.3",
            ]);
            let multipath = source_independent().unwrap();
            (fresh, with_rule, multipath)
        }) else {
            return;
        };
        assert_eq!(
            r,
            (true, false, false),
            "(fresh, a source rule, a multipath route)"
        );
    }
}
