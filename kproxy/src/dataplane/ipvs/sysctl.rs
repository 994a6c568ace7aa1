//! The sysctls upstream's IPVS mode sets (in the current network namespace; the `net.ipv4.vs.*`
//! ones exist once `ip_vs` is loaded):
//!
//! | sysctl | value | why |
//! |---|---|---|
//! | `net.ipv4.vs.conntrack` | 1 | keep conntrack entries for IPVS connections (the masquerade rules need them) |
//! | `net.ipv4.vs.conn_reuse_mode` | 0 on kernels < 5.9 | older kernels stall 1 s on port reuse with mode 1 |
//! | `net.ipv4.vs.expire_nodest_conn` | 1 | drop connections to removed real servers at once |
//! | `net.ipv4.vs.expire_quiescent_template` | 1 | expire persistence templates of weight-0 servers |
//! | `net.ipv4.ip_forward` / `net.ipv6.conf.all.forwarding` | 1 | forward to remote endpoints |
//! | `net.ipv4.conf.all.arp_ignore` / `arp_announce` | 1 / 2 with strictARP | never answer ARP for service addresses |

use super::config::IpvsConfig;
use crate::model::IpFamily;

/// `(path under /proc/sys, value)` pairs for `cfg` on a kernel of `kernel_release`.
pub(crate) fn wanted(cfg: &IpvsConfig, kernel_release: &str) -> Vec<(&'static str, &'static str)> {
    let mut v = vec![
        ("net/ipv4/vs/conntrack", "1"),
        ("net/ipv4/vs/expire_nodest_conn", "1"),
        ("net/ipv4/vs/expire_quiescent_template", "1"),
    ];
    if parse_release(kernel_release).is_some_and(|r| r < (5, 9)) {
        v.push(("net/ipv4/vs/conn_reuse_mode", "0"));
    }
    v.push(match cfg.family {
        IpFamily::V4 => ("net/ipv4/ip_forward", "1"),
        IpFamily::V6 => ("net/ipv6/conf/all/forwarding", "1"),
    });
    if cfg.strict_arp {
        v.push(("net/ipv4/conf/all/arp_ignore", "1"));
        v.push(("net/ipv4/conf/all/arp_announce", "2"));
    }
    v
}

/// `6.1.0-56-amd64` → (6, 1).
pub(crate) fn parse_release(r: &str) -> Option<(u32, u32)> {
    let mut it = r.split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Writes the wanted values that differ; errors name the sysctl.
pub(crate) fn apply(cfg: &IpvsConfig) -> Result<(), String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    for (path, value) in wanted(cfg, release.trim()) {
        let full = format!("/proc/sys/{path}");
        let cur = std::fs::read_to_string(&full)
            .map_err(|e| format!("reading sysctl {}: {e}", path.replace('/', ".")))?;
        if cur.trim() != value {
            std::fs::write(&full, value)
                .map_err(|e| format!("setting sysctl {}={value}: {e}", path.replace('/', ".")))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_reuse_mode_only_on_old_kernels_and_strict_arp_on_request() {
        let mut cfg = IpvsConfig::new(IpFamily::V4, vec![]);
        let new = wanted(&cfg, "6.1.0-56-amd64");
        assert!(new.contains(&("net/ipv4/vs/conntrack", "1")));
        assert!(new.contains(&("net/ipv4/vs/expire_nodest_conn", "1")));
        assert!(new.contains(&("net/ipv4/vs/expire_quiescent_template", "1")));
        assert!(!new.iter().any(|(p, _)| p.contains("conn_reuse_mode")));
        assert!(!new.iter().any(|(p, _)| p.contains("arp_")));
        assert!(wanted(&cfg, "5.4.0-100-generic").contains(&("net/ipv4/vs/conn_reuse_mode", "0")));
        cfg.strict_arp = true;
        let strict = wanted(&cfg, "6.1.0");
        assert!(strict.contains(&("net/ipv4/conf/all/arp_ignore", "1")));
        assert!(strict.contains(&("net/ipv4/conf/all/arp_announce", "2")));
        assert_eq!(parse_release("6.18.0"), Some((6, 18)));
    }
}
