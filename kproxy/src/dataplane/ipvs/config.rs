//! [`IpvsConfig`]: what the IPVS proxier needs from kproxy's resolved configuration.

use std::net::IpAddr;

use ipnet::IpNet;

use super::genl::Timeouts;
use crate::model::IpFamily;

/// The dummy interface that carries the service addresses (upstream's name).
pub(crate) const DEFAULT_DUMMY_DEVICE: &str = "kube-ipvs0";
/// Upstream's default scheduler.
pub(crate) const DEFAULT_SCHEDULER: &str = "rr";
/// Upstream's default masquerade bit (`--iptables-masquerade-bit`).
pub(crate) const DEFAULT_MASQUERADE_BIT: u8 = 14;

/// Schedulers the kernel ships (`ip_vs_<name>` modules); anything else is refused up front.
pub(crate) const KNOWN_SCHEDULERS: &[&str] = &[
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh", "fo", "ovf", "twos",
];

/// Configuration of one IPVS dataplane instance (one IP family, like upstream's per-family
/// proxier).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpvsConfig {
    pub family: IpFamily,
    /// `ipvs.scheduler` (empty = `DEFAULT_SCHEDULER`).
    pub scheduler: String,
    /// The node addresses NodePorts are served on: `nodePortAddresses` resolved against the
    /// node's interfaces (upstream's default is every local address except the dummy's).
    pub node_ips: Vec<IpAddr>,
    /// `ipvs.strictARP`: set `arp_ignore=1`/`arp_announce=2` so service addresses on the dummy
    /// device are never announced.
    pub strict_arp: bool,
    /// `ipvs.tcpTimeout` / `tcpFinTimeout` / `udpTimeout` in seconds (0 = leave as is).
    pub timeouts: Timeouts,
    /// `masqueradeAll`.
    pub masquerade_all: bool,
    /// `clusterCIDR` (the local-traffic detector): traffic to a cluster IP from outside it is
    /// masqueraded. `None`: node-originated traffic from a service IP is masqueraded instead.
    pub cluster_cidr: Option<IpNet>,
    /// `iptables.masqueradeBit` (0–31).
    pub masquerade_bit: u8,
    /// `ipvs.excludeCIDRs`: virtual servers in these ranges are never removed by cleanup.
    pub exclude_cidrs: Vec<IpNet>,
    /// The dummy interface name (`DEFAULT_DUMMY_DEVICE`).
    pub dummy_device: String,
    /// Program the iptables rules and ipsets around IPVS (masquerade, NodePort, firewall).
    /// Off only for setups that install their own; upstream always does.
    pub manage_iptables: bool,
    /// The `iptables-restore` binary for this family (`iptables-restore` / `ip6tables-restore`,
    /// or the `-legacy`/`-nft` variant the host uses).
    pub iptables_restore: String,
    /// Apply the sysctls upstream's IPVS mode sets (see `super::sysctl`).
    pub set_sysctls: bool,
}

impl IpvsConfig {
    /// Upstream's defaults for `family` with the given node addresses.
    pub fn new(family: IpFamily, node_ips: Vec<IpAddr>) -> IpvsConfig {
        IpvsConfig {
            family,
            scheduler: DEFAULT_SCHEDULER.into(),
            node_ips,
            strict_arp: false,
            timeouts: Timeouts::default(),
            masquerade_all: false,
            cluster_cidr: None,
            masquerade_bit: DEFAULT_MASQUERADE_BIT,
            exclude_cidrs: vec![],
            dummy_device: DEFAULT_DUMMY_DEVICE.into(),
            manage_iptables: true,
            iptables_restore: match family {
                IpFamily::V4 => "iptables-restore".into(),
                IpFamily::V6 => "ip6tables-restore".into(),
            },
            set_sysctls: true,
        }
    }

    /// The scheduler to use (the default when empty).
    pub(crate) fn scheduler(&self) -> &str {
        if self.scheduler.is_empty() {
            DEFAULT_SCHEDULER
        } else {
            &self.scheduler
        }
    }

    /// `0x4000` for the default bit 14.
    pub(crate) fn masquerade_mark(&self) -> String {
        format!("{:#x}", 1u32 << self.masquerade_bit.min(31))
    }

    /// Checks the fields a kernel would reject later, naming the field.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if !KNOWN_SCHEDULERS.contains(&self.scheduler()) {
            return Err(format!(
                "ipvs.scheduler {:?} is not an IPVS scheduler (one of {})",
                self.scheduler,
                KNOWN_SCHEDULERS.join(", ")
            ));
        }
        if self.masquerade_bit > 31 {
            return Err(format!(
                "iptables.masqueradeBit {} is out of range 0-31",
                self.masquerade_bit
            ));
        }
        if let Some(ip) = self.node_ips.iter().find(|ip| !self.family.matches(ip)) {
            return Err(format!(
                "node address {ip} is not of the dataplane's family {:?}",
                self.family
            ));
        }
        if self.dummy_device.is_empty() || self.dummy_device.len() > 15 {
            return Err(format!(
                "dummy device name {:?} must be 1-15 bytes",
                self.dummy_device
            ));
        }
        Ok(())
    }
}
