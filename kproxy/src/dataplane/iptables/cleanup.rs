//! Removing everything the iptables proxier (or upstream kube-proxy in iptables mode) left:
//! the jump rules from built-in chains, the top-level chains, every per-service chain
//! (including upstream's old `KUBE-XLB-` ones) and the canary chains. Kubelet's
//! `KUBE-FIREWALL` chain and its jumps are kubelet's and stay (as upstream's
//! `CleanupLeftovers` leaves them).

use super::kernel::{IptablesBackend, IptablesError, RestoreMode};
use super::names::*;
use super::plan::jump_rules;
use super::render::{TableInput, render_tables};

/// Chains upstream's cleanup removes, per table (plus the per-service ones found by save).
const NAT_CHAINS: [&str; 4] = [
    KUBE_SERVICES,
    KUBE_NODEPORTS,
    KUBE_POSTROUTING,
    KUBE_MARK_MASQ,
];
const FILTER_CHAINS: [&str; 5] = [
    KUBE_SERVICES,
    KUBE_EXTERNAL_SERVICES,
    KUBE_FORWARD,
    KUBE_NODEPORTS,
    KUBE_PROXY_FIREWALL,
];

fn existing_chains(b: &mut dyn IptablesBackend, table: &str) -> Result<Vec<String>, IptablesError> {
    Ok(b.save(table)?
        .lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|c| c.split_whitespace().next())
        .map(String::from)
        .collect())
}

/// Removes our (and upstream kube-proxy's) iptables objects through `b`.
///
/// The tables are read first (one save each): where none declares a chain of ours, there is
/// nothing to remove — a jump rule needs its target chain — and no rule is touched. This is
/// what every start in another mode pays for each backend and family, so the common case
/// (nothing left) costs three saves instead of a delete attempt per jump rule.
pub(crate) fn cleanup_leftovers(b: &mut dyn IptablesBackend) -> Result<(), IptablesError> {
    let mut tables = vec![];
    for (table, fixed) in [
        ("nat", &NAT_CHAINS[..]),
        ("filter", &FILTER_CHAINS[..]),
        ("mangle", &[][..]),
    ] {
        let existing = match existing_chains(b, table) {
            Ok(e) => e,
            // A table the kernel lacks (e.g. no iptable_mangle module) holds nothing of ours.
            Err(e) if e.to_string().contains("Table does not exist") => continue,
            Err(e) => return Err(e),
        };
        let mut t = TableInput::new(table);
        for c in &existing {
            let ours = fixed.contains(&c.as_str())
                || c == KUBE_PROXY_CANARY
                || (table == "nat" && (is_service_chain(c) || c.starts_with("KUBE-XLB-")));
            if ours {
                t.delete(c);
            }
        }
        if !t.deletes.is_empty() {
            tables.push(t);
        }
    }
    if tables.is_empty() {
        return Ok(());
    }
    // The jumps into our chains first: a chain still referenced cannot be deleted.
    for j in jump_rules() {
        if j.to == KUBE_FIREWALL {
            continue;
        }
        b.delete_rule(j.table, j.from, &j.args)?;
    }
    b.restore(&render_tables(&tables), RestoreMode::NoFlush)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::iptables::kernel::FakeIptables;

    #[test]
    fn removes_ours_and_keeps_others() {
        let mut f = FakeIptables::new();
        for j in jump_rules() {
            f.ensure_chain(j.table, j.to).unwrap();
            f.ensure_rule_prepend(j.table, j.from, &j.args).unwrap();
        }
        f.inject("nat", "KUBE-SVC-AAAA", "-j KUBE-SEP-BBBB");
        f.inject(
            "nat",
            "KUBE-SEP-BBBB",
            "-j DNAT --to-destination 10.0.0.1:80",
        );
        f.inject("nat", "KUBE-XLB-CCCC", "-j KUBE-SVC-AAAA");
        f.inject("nat", "KUBE-SERVICES", "-j KUBE-SVC-AAAA");
        f.inject("nat", "DOCKER", "-j RETURN");
        f.inject("nat", "PREROUTING", "-j DOCKER");
        f.ensure_chain("mangle", KUBE_PROXY_CANARY).unwrap();
        cleanup_leftovers(&mut f).unwrap();
        let nat = f.save("nat").unwrap();
        assert!(!nat.contains("KUBE-"), "{nat}");
        assert!(
            nat.contains(":DOCKER") && nat.contains("-A PREROUTING -j DOCKER"),
            "{nat}"
        );
        let filter = f.save("filter").unwrap();
        assert!(
            filter.contains(":KUBE-FIREWALL"),
            "kubelet's chain stays: {filter}"
        );
        assert!(!filter.contains("KUBE-SERVICES"), "{filter}");
        assert!(!f.save("mangle").unwrap().contains(KUBE_PROXY_CANARY));
    }

    #[test]
    fn tables_without_our_chains_are_only_read() {
        let mut f = FakeIptables::new();
        f.ensure_chain("filter", KUBE_FIREWALL).unwrap();
        f.inject("nat", "DOCKER", "-j RETURN");
        f.inject("nat", "PREROUTING", "-j DOCKER");
        cleanup_leftovers(&mut f).unwrap();
        assert_eq!(f.rule_deletes, vec![], "no rule deleted");
        assert!(f.restores.is_empty(), "no restore");
        assert!(f.save("nat").unwrap().contains("-A PREROUTING -j DOCKER"));
    }

    /// Skipping the jump deletions is sound only if every jump rule's target is a chain the
    /// cleanup looks for in that table.
    #[test]
    fn every_jump_rule_targets_a_chain_the_cleanup_removes() {
        for j in jump_rules() {
            if j.to == KUBE_FIREWALL {
                continue;
            }
            let fixed: &[&str] = match j.table {
                "nat" => &NAT_CHAINS,
                "filter" => &FILTER_CHAINS,
                _ => &[],
            };
            assert!(
                fixed.contains(&j.to) || j.to == KUBE_PROXY_CANARY,
                "{} -> {} in {}",
                j.from,
                j.to,
                j.table
            );
        }
    }
}
