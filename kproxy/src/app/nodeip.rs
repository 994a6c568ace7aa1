//! The node's own IPs and primary IP family (pure), as upstream kube-proxy determines them
//! (cmd/kube-proxy `detectNodeIPs` over component-helpers `GetNodeHostIPs`):
//!
//! 1. From the Node object: its `status.addresses`, every `InternalIP` first, then every
//!    `ExternalIP` (each group in listed order); the first of those is the primary IP, plus
//!    the first one of the other family, if any ([`node_host_ips`]).
//! 2. `--bind-address`, when set and not unspecified (`0.0.0.0` / `::`), overrides the IP of
//!    its family and makes that family primary.
//! 3. A family left without an IP gets the loopback address (`127.0.0.1` / `::1`); when the
//!    primary IP is loopback the caller logs upstream's warning ("can't determine this node's
//!    IP, assuming loopback; if this is incorrect, please set the --bind-address flag").
//!
//! The primary family is IPv4 unless the first node IP (or the bind address) is IPv6.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::{Node, NodeAddress};

use crate::model::IpFamily;

/// The node's IPs as the proxy uses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeIps {
    pub primary_family: IpFamily,
    /// The node's IPv4 address (loopback when unknown).
    pub v4: IpAddr,
    /// The node's IPv6 address (loopback when unknown).
    pub v6: IpAddr,
}

impl NodeIps {
    /// The IP of `family`.
    pub(crate) fn ip(&self, family: IpFamily) -> IpAddr {
        match family {
            IpFamily::V4 => self.v4,
            IpFamily::V6 => self.v6,
        }
    }

    /// The primary IP.
    pub fn primary(&self) -> IpAddr {
        self.ip(self.primary_family)
    }

    /// The IPs that are known (not the loopback fallback), the primary one first: what
    /// upstream turns `nodePortAddresses: primary` into.
    pub(crate) fn known(&self) -> Vec<IpAddr> {
        let other = match self.primary_family {
            IpFamily::V4 => IpFamily::V6,
            IpFamily::V6 => IpFamily::V4,
        };
        [self.primary(), self.ip(other)]
            .into_iter()
            .filter(|ip| !ip.is_loopback())
            .collect()
    }

    /// Whether the primary IP is only the loopback fallback (the caller should warn).
    pub(crate) fn primary_is_fallback(&self) -> bool {
        self.primary().is_loopback()
    }
}

fn parse(addr: &str) -> Option<IpAddr> {
    crate::model::service::parse_ip_sloppy(addr)
}

/// Upstream `GetNodeHostIPs`: InternalIPs before ExternalIPs; the first one, then the first
/// one of the other family. Empty when the node lists no usable address.
pub(crate) fn node_host_ips(addresses: &[NodeAddress]) -> Vec<IpAddr> {
    let ordered: Vec<IpAddr> = ["InternalIP", "ExternalIP"]
        .iter()
        .flat_map(|ty| {
            addresses
                .iter()
                .filter(move |a| a.type_ == *ty)
                .filter_map(|a| parse(&a.address))
        })
        .collect();
    let Some(first) = ordered.first().copied() else {
        return vec![];
    };
    let mut out = vec![first];
    if let Some(other) = ordered
        .iter()
        .find(|ip| IpFamily::of(ip) != IpFamily::of(&first))
    {
        out.push(*other);
    }
    out
}

/// [`node_host_ips`] of a Node object.
pub(crate) fn node_ips_of(node: &Node) -> Vec<IpAddr> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_deref())
        .map(node_host_ips)
        .unwrap_or_default()
}

/// Upstream `detectNodeIPs(rawNodeIPs, bindAddress)`.
pub(crate) fn detect_node_ips(raw: &[IpAddr], bind_address: Option<IpAddr>) -> NodeIps {
    let mut ips = NodeIps {
        primary_family: IpFamily::V4,
        v4: IpAddr::V4(Ipv4Addr::LOCALHOST),
        v6: IpAddr::V6(Ipv6Addr::LOCALHOST),
    };
    let set = |ip: IpAddr, ips: &mut NodeIps| match IpFamily::of(&ip) {
        IpFamily::V4 => ips.v4 = ip,
        IpFamily::V6 => ips.v6 = ip,
    };
    if let Some(first) = raw.first() {
        ips.primary_family = IpFamily::of(first);
        set(*first, &mut ips);
        if let Some(second) = raw.get(1) {
            set(*second, &mut ips);
        }
    }
    if let Some(bind) = bind_address.filter(|b| !b.is_unspecified()) {
        ips.primary_family = IpFamily::of(&bind);
        set(bind, &mut ips);
    }
    ips
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(ty: &str, a: &str) -> NodeAddress {
        NodeAddress {
            type_: ty.into(),
            address: a.into(),
        }
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn internal_ips_come_before_external_ones() {
        let a = [
            addr("ExternalIP", "203.0.113.5"),
            addr("Hostname", "node-1"),
            addr("InternalIP", "10.0.0.5"),
            addr("InternalIP", "10.0.0.6"),
        ];
        assert_eq!(node_host_ips(&a), vec![ip("10.0.0.5")]);
    }

    #[test]
    fn second_ip_is_the_first_of_the_other_family() {
        let a = [
            addr("InternalIP", "fd00::5"),
            addr("InternalIP", "fd00::6"),
            addr("ExternalIP", "203.0.113.5"),
            addr("InternalIP", "10.0.0.5"),
        ];
        assert_eq!(node_host_ips(&a), vec![ip("fd00::5"), ip("10.0.0.5")]);
        let ips = detect_node_ips(&node_host_ips(&a), None);
        assert_eq!(ips.primary_family, IpFamily::V6);
        assert_eq!((ips.v4, ips.v6), (ip("10.0.0.5"), ip("fd00::5")));
        assert!(!ips.primary_is_fallback());
    }

    #[test]
    fn unparsable_and_hostname_addresses_are_ignored() {
        let a = [
            addr("InternalIP", "not-an-ip"),
            addr("Hostname", "10.1.1.1"),
        ];
        assert!(node_host_ips(&a).is_empty());
    }

    #[test]
    fn bind_address_overrides_its_family_and_becomes_primary() {
        let raw = [ip("10.0.0.5"), ip("fd00::5")];
        let ips = detect_node_ips(&raw, Some(ip("fd00::99")));
        assert_eq!(ips.primary_family, IpFamily::V6);
        assert_eq!((ips.v4, ips.v6), (ip("10.0.0.5"), ip("fd00::99")));
        assert_eq!(ips.known(), vec![ip("fd00::99"), ip("10.0.0.5")]);
    }

    #[test]
    fn unspecified_bind_address_is_ignored() {
        let raw = [ip("10.0.0.5")];
        for b in ["0.0.0.0", "::"] {
            let ips = detect_node_ips(&raw, Some(ip(b)));
            assert_eq!(ips.primary_family, IpFamily::V4, "{b}");
            assert_eq!(ips.v4, ip("10.0.0.5"));
            assert_eq!(ips.v6, ip("::1"), "missing family falls back to loopback");
        }
    }

    #[test]
    fn nothing_known_falls_back_to_loopback() {
        let ips = detect_node_ips(&[], None);
        assert_eq!(ips.primary_family, IpFamily::V4);
        assert_eq!((ips.v4, ips.v6), (ip("127.0.0.1"), ip("::1")));
        assert!(ips.primary_is_fallback());
        assert!(ips.known().is_empty());
    }
}
