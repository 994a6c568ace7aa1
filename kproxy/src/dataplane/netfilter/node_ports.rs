//! Upstream's `NodePortAddresses` (pkg/proxy/util/nodeport_addresses.go) for one IP family, and
//! the masquerade mark both netfilter rule writers (iptables, nftables) print.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::IpFamily;

/// `--nodeport-addresses` of one family and the node's interface addresses.
#[derive(Debug, Clone, Copy)]
pub struct NodePortAddresses<'a> {
    pub family: IpFamily,
    /// `--nodeport-addresses` (all families; only `family`'s count).
    pub cidrs: &'a [IpNet],
    /// The node's interface addresses (all families).
    pub local_addresses: &'a [IpAddr],
}

impl NodePortAddresses<'_> {
    /// The CIDRs of this family.
    pub(crate) fn family_cidrs(&self) -> Vec<IpNet> {
        self.cidrs
            .iter()
            .copied()
            .filter(|n| self.family.matches(&n.addr()))
            .collect()
    }

    /// Upstream `MatchAll()`: no CIDR of this family, or a zero CIDR.
    pub(crate) fn match_all(&self) -> bool {
        let c = self.family_cidrs();
        c.is_empty() || c.iter().any(|n| n.prefix_len() == 0)
    }

    /// Upstream `ContainsIPv4Loopback()`.
    pub(crate) fn contains_ipv4_loopback(&self) -> bool {
        if self.family != IpFamily::V4 {
            return false;
        }
        let lo: IpAddr = std::net::Ipv4Addr::LOCALHOST.into();
        self.match_all() || self.family_cidrs().iter().any(|n| n.contains(&lo))
    }

    /// Upstream `GetNodeIPs()`: local addresses of this family inside the CIDRs, once each.
    pub(crate) fn node_ips(&self) -> Vec<IpAddr> {
        let cidrs = self.family_cidrs();
        let mut out: Vec<IpAddr> = vec![];
        for ip in self.local_addresses {
            if self.family.matches(ip) && cidrs.iter().any(|c| c.contains(ip)) && !out.contains(ip)
            {
                out.push(*ip);
            }
        }
        out
    }
}

/// The masquerade mark of `--masquerade-bit` as hex (`0x4000` for bit 14), as upstream's test
/// proxiers write it; upstream's real proxiers format with `%#08x` (`0x004000`), which iptables
/// and nft read the same.
pub fn masquerade_mark(bit: u8) -> String {
    format!("{:#x}", 1u64 << bit.min(31))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_port_addresses_follow_upstream() {
        let cidrs: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/64".parse().unwrap()];
        let local: Vec<IpAddr> = ["10.1.2.3", "192.168.0.1", "fd00::5", "10.1.2.3"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        let v4 = NodePortAddresses {
            family: IpFamily::V4,
            cidrs: &cidrs,
            local_addresses: &local,
        };
        assert!(!v4.match_all());
        assert!(!v4.contains_ipv4_loopback());
        assert_eq!(v4.node_ips(), vec!["10.1.2.3".parse::<IpAddr>().unwrap()]);
        let all = NodePortAddresses { cidrs: &[], ..v4 };
        assert!(all.match_all() && all.contains_ipv4_loopback());
        let v6 = NodePortAddresses {
            family: IpFamily::V6,
            ..v4
        };
        assert_eq!(v6.node_ips(), vec!["fd00::5".parse::<IpAddr>().unwrap()]);
        assert!(!v6.contains_ipv4_loopback());
        assert_eq!(masquerade_mark(14), "0x4000");
    }
}
