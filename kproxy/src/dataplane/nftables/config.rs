//! The resolved settings one nftables proxier (one IP family) needs: everything upstream's
//! `NewProxier` receives or detects, as plain data, so the planner stays pure.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::dataplane::netfilter::local_detect::LocalDetector;
use crate::dataplane::netfilter::node_ports::NodePortAddresses;
use crate::model::IpFamily;

/// Settings of one per-family nftables proxier.
#[derive(Debug, Clone, PartialEq)]
pub struct NftablesConfig {
    pub family: IpFamily,
    /// This node's primary IP of `family` (LB source ranges: "allow from node").
    pub node_ip: Option<IpAddr>,
    /// `--masquerade-bit` (0..=31, default 14).
    pub masquerade_bit: u8,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// `--detect-local-mode` (the iptables mode's detector, rendered as nft matches here).
    pub local_detector: LocalDetector,
    /// `--nodeport-addresses` (all families; filtered per family). Empty = every local IP.
    pub node_port_addresses: Vec<IpNet>,
    /// The node's interface addresses (all families), for `node_port_addresses` matching.
    pub local_addresses: Vec<IpAddr>,
    /// Service CIDRs (all families; filtered per family): unallocated addresses are dropped.
    /// The configured ones (kproxy's `serviceCIDRs` / `--service-cidrs`); the `ServiceCIDR`
    /// objects' replace them when the API server serves those (`NftablesProxier::sync`).
    pub service_cidrs: Vec<IpNet>,
}

impl NftablesConfig {
    /// Upstream's defaults for `family` with the given detector.
    pub fn new(family: IpFamily, local_detector: LocalDetector) -> Self {
        NftablesConfig {
            family,
            node_ip: None,
            masquerade_bit: 14,
            masquerade_all: false,
            local_detector,
            node_port_addresses: vec![],
            local_addresses: vec![],
            service_cidrs: vec![],
        }
    }

    /// `ip` or `ip6`.
    pub(crate) fn ip_x(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "ip",
            IpFamily::V6 => "ip6",
        }
    }

    /// `ipv4_addr` or `ipv6_addr`.
    pub(crate) fn addr_type(&self) -> &'static str {
        match self.family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        }
    }

    /// The nft table family keyword (`ip` / `ip6`), same as `Self::ip_x`.
    pub fn table_family(&self) -> &'static str {
        self.ip_x()
    }

    /// `--nodeport-addresses` of this proxier's family, with the node's addresses.
    pub(crate) fn node_ports(&self) -> NodePortAddresses<'_> {
        NodePortAddresses {
            family: self.family,
            cidrs: &self.node_port_addresses,
            local_addresses: &self.local_addresses,
        }
    }

    /// Upstream `OnServiceCIDRsChanged`: this family's CIDRs joined by `,`.
    pub fn service_cidrs_text(&self) -> String {
        self.service_cidrs_text_of(&self.service_cidrs)
    }

    /// [`Self::service_cidrs_text`] of `cidrs`.
    pub(crate) fn service_cidrs_text_of(&self, cidrs: &[IpNet]) -> String {
        cidrs
            .iter()
            .filter(|n| self.family.matches(&n.addr()))
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Upstream `IfLocalNFT` of the detector.
    pub(crate) fn if_local(&self) -> Option<String> {
        self.local_detector.if_local_nft()
    }

    /// Upstream `IfNotLocalNFT` of the detector.
    pub(crate) fn if_not_local(&self) -> Option<String> {
        self.local_detector.if_not_local_nft()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_cidrs_are_filtered_per_family() {
        let mut c = NftablesConfig::new(IpFamily::V4, LocalDetector::None);
        c.service_cidrs = ["172.30.0.0/16", "fd00:10:96::/112", "172.50.0.0/16"]
            .map(|s| s.parse().unwrap())
            .to_vec();
        assert_eq!(c.service_cidrs_text(), "172.30.0.0/16,172.50.0.0/16");
        c.family = IpFamily::V6;
        assert_eq!(c.service_cidrs_text(), "fd00:10:96::/112");
    }

    #[test]
    fn local_detector_matches() {
        let c = NftablesConfig::new(
            IpFamily::V6,
            LocalDetector::Cidr("fd00:10::/64".parse().unwrap()),
        );
        assert_eq!(c.if_local().unwrap(), "ip6 saddr fd00:10::/64");
        assert_eq!(c.if_not_local().unwrap(), "ip6 saddr != fd00:10::/64");
        let c = NftablesConfig::new(
            IpFamily::V4,
            LocalDetector::InterfaceNamePrefix("veth".into()),
        );
        assert_eq!(c.if_not_local().unwrap(), "iifname != veth*");
        assert_eq!(
            crate::dataplane::netfilter::node_ports::masquerade_mark(c.masquerade_bit),
            "0x4000"
        );
    }
}
