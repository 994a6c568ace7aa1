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

use crate::kernel::netlink::socket::Socket;
use crate::kernel::netlink::wire::{MsgBuilder, attrs, read_u32};
use crate::kernel::netlink::{NLM_F_DUMP, NLM_F_REQUEST};

/// `RTM_*` (uapi `linux/rtnetlink.h`): the route and rule messages; the announcements of
/// the `NEW`/`DEL` ones are what can change this module's answer
/// ([`crate::kernel::route_events::Batch::routes_or_rules`]).
pub(crate) const RTM_NEWROUTE: u16 = 24;
pub(crate) const RTM_DELROUTE: u16 = 25;
const RTM_GETROUTE: u16 = 26;
pub(crate) const RTM_NEWRULE: u16 = 32;
pub(crate) const RTM_DELRULE: u16 = 33;
const RTM_GETRULE: u16 = 34;
/// `struct rtmsg` and `struct fib_rule_hdr`: both 12 bytes, family first, TOS at byte 3.
const HDR_LEN: usize = 12;
const HDR_TOS: usize = 3;
/// `fib_rule_hdr`: prefix lengths (bytes 1, 2) and action (byte 7).
const RULE_DST_LEN: usize = 1;
const RULE_SRC_LEN: usize = 2;
const RULE_ACTION: usize = 7;
const FR_ACT_TO_TBL: u8 = 1;
/// `FRA_*` attributes a rule without selectors carries.
const FRA_PRIORITY: u16 = 6;
const FRA_TABLE: u16 = 15;
const FRA_PAD: u16 = 18;
const FRA_PROTOCOL: u16 = 21;
/// Reported with -1 ("none") on the default rules.
const FRA_SUPPRESS_IFGROUP: u16 = 13;
const FRA_SUPPRESS_PREFIXLEN: u16 = 14;
/// `fib_rule_hdr.table` (the table id when it fits in a byte).
const RULE_TABLE: usize = 4;
const RTA_MULTIPATH: u16 = 9;
const RTA_NH_ID: u16 = 30;

/// The kernel's default IPv4 rules: (priority, table).
pub const DEFAULT_RULES: [(u32, u32); 3] = [(0, 255), (32_766, 254), (32_767, 253)];

/// One IPv4 policy rule, as far as this module looks at it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub priority: u32,
    pub table: u32,
    /// A selector or an action other than "look up the table".
    pub selective: bool,
}

/// Whether `rules` are exactly the kernel's defaults ([`DEFAULT_RULES`], no selectors).
pub fn rules_are_default(rules: &[Rule]) -> bool {
    let mut seen: Vec<(u32, u32)> = rules
        .iter()
        .filter(|r| !r.selective)
        .map(|r| (r.priority, r.table))
        .collect();
    seen.sort_unstable();
    rules.iter().all(|r| !r.selective) && seen == DEFAULT_RULES
}

/// A rule from an `RTM_NEWRULE` payload; `None` if malformed.
pub fn parse_rule(payload: &[u8]) -> Option<Rule> {
    let hdr = payload.get(..HDR_LEN)?;
    let mut rule = Rule {
        priority: 0,
        table: u32::from(hdr[RULE_TABLE]),
        selective: hdr[RULE_DST_LEN] != 0
            || hdr[RULE_SRC_LEN] != 0
            || hdr[HDR_TOS] != 0
            || hdr[RULE_ACTION] != FR_ACT_TO_TBL,
    };
    for a in attrs(&payload[HDR_LEN..]) {
        let (kind, value) = a.ok()?;
        match kind {
            FRA_PRIORITY => rule.priority = read_u32(value)?,
            FRA_TABLE => rule.table = read_u32(value)?,
            FRA_PAD | FRA_PROTOCOL => {}
            FRA_SUPPRESS_IFGROUP | FRA_SUPPRESS_PREFIXLEN if read_u32(value) == Some(u32::MAX) => {}
            _ => rule.selective = true,
        }
    }
    Some(rule)
}

/// Whether the route in an `RTM_NEWROUTE` payload has one next hop and no TOS key; `None`
/// if malformed.
pub fn route_is_plain(payload: &[u8]) -> Option<bool> {
    let hdr = payload.get(..HDR_LEN)?;
    let mut plain = hdr[HDR_TOS] == 0;
    for a in attrs(&payload[HDR_LEN..]) {
        let (kind, _) = a.ok()?;
        plain &= kind != RTA_MULTIPATH && kind != RTA_NH_ID;
    }
    Some(plain)
}

/// An `AF_INET` dump request of `msg_type`.
fn dump(msg_type: u16) -> MsgBuilder {
    let mut hdr = [0u8; HDR_LEN];
    hdr[0] = libc::AF_INET as u8;
    MsgBuilder::new(msg_type, NLM_F_REQUEST | NLM_F_DUMP).header(&hdr)
}

/// Whether the calling thread's network namespace routes IPv4 without looking at the source
/// (module docs). A malformed answer counts as "no".
pub fn source_independent() -> io::Result<bool> {
    let mut sock = Socket::open(libc::NETLINK_ROUTE)?;
    let mut rules = Vec::new();
    for m in sock.request(&dump(RTM_GETRULE))? {
        if m.msg_type == RTM_NEWRULE {
            match parse_rule(&m.payload) {
                Some(r) => rules.push(r),
                None => return Ok(false),
            }
        }
    }
    if !rules_are_default(&rules) {
        return Ok(false);
    }
    for m in sock.request(&dump(RTM_GETROUTE))? {
        if m.msg_type == RTM_NEWROUTE && route_is_plain(&m.payload) != Some(true) {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut a = ((4 + value.len()) as u16).to_ne_bytes().to_vec();
        a.extend(kind.to_ne_bytes());
        a.extend(value);
        a.resize(crate::kernel::netlink::wire::align4(a.len()), 0);
        a
    }

    fn rule(priority: u32, table: u32, extra: &[Vec<u8>]) -> Vec<u8> {
        let mut p = vec![
            libc::AF_INET as u8,
            0,
            0,
            0,
            0,
            0,
            0,
            FR_ACT_TO_TBL,
            0,
            0,
            0,
            0,
        ];
        p.extend(attr(FRA_TABLE, &table.to_ne_bytes()));
        p.extend(attr(FRA_SUPPRESS_PREFIXLEN, &u32::MAX.to_ne_bytes()));
        if priority != 0 {
            p.extend(attr(FRA_PRIORITY, &priority.to_ne_bytes()));
        }
        p.extend(attr(FRA_PROTOCOL, &[2]));
        for e in extra {
            p.extend(e);
        }
        p
    }

    fn defaults() -> Vec<Rule> {
        DEFAULT_RULES
            .iter()
            .map(|(prio, table)| parse_rule(&rule(*prio, *table, &[])).unwrap())
            .collect()
    }

    #[test]
    fn the_kernels_default_rules_are_default() {
        assert!(rules_are_default(&defaults()));
    }

    #[test]
    fn a_selector_an_extra_or_a_missing_rule_is_not_default() {
        const FRA_SRC: u16 = 2;
        const FRA_FWMARK: u16 = 10;
        let mut with_src = defaults();
        with_src.push(parse_rule(&rule(100, 100, &[attr(FRA_SRC, &[10, 0, 0, 0])])).unwrap());
        assert!(with_src.last().unwrap().selective);
        assert!(!rules_are_default(&with_src));
        let mut fwmark = defaults();
        fwmark[1] =
            parse_rule(&rule(32_766, 254, &[attr(FRA_FWMARK, &1u32.to_ne_bytes())])).unwrap();
        assert!(!rules_are_default(&fwmark));
        let suppress = rule(
            32_766,
            254,
            &[attr(FRA_SUPPRESS_PREFIXLEN, &0u32.to_ne_bytes())],
        );
        assert!(parse_rule(&suppress).unwrap().selective);
        let mut src_len = rule(32_766, 254, &[]);
        src_len[RULE_SRC_LEN] = 8;
        assert!(parse_rule(&src_len).unwrap().selective);
        let mut extra_table = defaults();
        extra_table.push(parse_rule(&rule(1000, 100, &[])).unwrap());
        assert!(!rules_are_default(&extra_table));
        assert!(!rules_are_default(&defaults()[1..]));
        assert!(parse_rule(&[0; 4]).is_none());
    }

    #[test]
    fn multipath_next_hop_objects_and_tos_keys_make_a_route_not_plain() {
        let hdr = vec![libc::AF_INET as u8, 24, 0, 0, 254, 3, 0, 1, 0, 0, 0, 0];
        let gw = attr(5, &[10, 0, 0, 1]);
        let plain: Vec<u8> = [hdr.clone(), gw.clone()].concat();
        assert_eq!(route_is_plain(&plain), Some(true));
        let multi: Vec<u8> = [hdr.clone(), attr(RTA_MULTIPATH, &[0; 8])].concat();
        assert_eq!(route_is_plain(&multi), Some(false));
        let nh: Vec<u8> = [hdr.clone(), attr(RTA_NH_ID, &7u32.to_ne_bytes())].concat();
        assert_eq!(route_is_plain(&nh), Some(false));
        let mut tos = plain.clone();
        tos[HDR_TOS] = 0x10;
        assert_eq!(route_is_plain(&tos), Some(false));
        assert_eq!(route_is_plain(&hdr[..4]), None);
    }
}
