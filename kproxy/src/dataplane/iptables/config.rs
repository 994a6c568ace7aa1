//! The resolved settings one iptables proxier (one IP family) needs.
//!
//! Everything upstream's `NewProxier` receives or detects at start-up is a field here, so the
//! planner stays pure: the applier fills the detected ones (`conntrack_tcp_liberal`,
//! `random_fully`, `nfacct_counters`, `local_addresses`) from the kernel before planning.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

use crate::model::IpFamily;

/// Upstream's `largeClusterEndpointsThreshold`.
pub const LARGE_CLUSTER_ENDPOINTS_THRESHOLD: usize = 1000;
/// Upstream `proxyutil.FullSyncPeriod`: a partial-sync proxier still does a full sync this often.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// How traffic from this node's pods is told apart from other traffic (upstream
/// `LocalTrafficDetector`; `--detect-local-mode`). Minimal local copy until the shared one lands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalTrafficDetector {
    /// No detection (`IsImplemented() == false`): no pod-vs-external rules are written.
    NoOp,
    /// ClusterCIDR / NodeCIDR modes: `-s <cidr>` / `! -s <cidr>`.
    Cidr(IpNet),
    /// BridgeInterface mode: `-i <bridge>` / `! -i <bridge>`.
    BridgeInterface(String),
    /// InterfaceNamePrefix mode: `-i <prefix>+` / `! -i <prefix>+`.
    InterfaceNamePrefix(String),
}

impl LocalTrafficDetector {
    pub fn is_implemented(&self) -> bool {
        !matches!(self, LocalTrafficDetector::NoOp)
    }
    /// Match args for "from a local pod" (upstream `IfLocal`).
    pub fn if_local(&self) -> Option<String> {
        match self {
            LocalTrafficDetector::NoOp => None,
            LocalTrafficDetector::Cidr(c) => Some(format!("-s {c}")),
            LocalTrafficDetector::BridgeInterface(b) => Some(format!("-i {b}")),
            LocalTrafficDetector::InterfaceNamePrefix(p) => Some(format!("-i {p}+")),
        }
    }
    /// Match args for "not from a local pod" (upstream `IfNotLocal`).
    pub fn if_not_local(&self) -> Option<String> {
        self.if_local().map(|s| format!("! {s}"))
    }
}

/// Names of the nfacct counters upstream's rules reference.
pub const NFACCT_CT_INVALID: &str = "ct_state_invalid_dropped_pkts";
pub const NFACCT_LOCALHOST_NODEPORTS: &str = "localhost_nps_accepted_pkts";

/// Which nfacct counters exist (upstream only references a counter it could ensure).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NfacctCounters {
    pub ct_state_invalid_dropped_pkts: bool,
    pub localhost_nps_accepted_pkts: bool,
}

/// Which iptables binaries to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IptablesBackend {
    /// Like upstream's iptables-wrapper: the backend whose `*-save` shows more rules, nft on a
    /// tie (also when neither has any).
    #[default]
    Auto,
    Nft,
    Legacy,
}

/// Settings of one per-family iptables proxier.
#[derive(Debug, Clone, PartialEq)]
pub struct IptablesConfig {
    pub family: IpFamily,
    /// This node's primary IP of `family` (upstream `nodeIP`; used for the LB source-range
    /// "allow from node" rule). `None` = unknown.
    pub node_ip: Option<IpAddr>,
    /// `--iptables-masquerade-bit` (0..=31, default 14).
    pub masquerade_bit: u8,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    pub local_detector: LocalTrafficDetector,
    /// `--iptables-localhost-nodeports` (default true). Forced off for IPv6 rules and when
    /// `node_port_addresses` excludes 127.0.0.1, like upstream.
    pub localhost_node_ports: bool,
    /// `--nodeport-addresses` as CIDRs (all families; filtered per family here). Empty = all
    /// local addresses (`-m addrtype --dst-type LOCAL`).
    pub node_port_addresses: Vec<IpNet>,
    /// The node's interface addresses (all families), for `node_port_addresses` matching.
    /// Filled by the applier from the kernel; tests set them.
    pub local_addresses: Vec<IpAddr>,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal != 0`: no INVALID drop rule.
    pub conntrack_tcp_liberal: bool,
    /// iptables supports `MASQUERADE --random-fully` (≥ 1.6.2).
    pub random_fully: bool,
    pub nfacct_counters: NfacctCounters,
    /// More endpoints than this in total: large-cluster mode (no per-endpoint comments, stale
    /// chains deleted at most once per `sync_period`).
    pub large_cluster_threshold: usize,
    /// `--iptables-sync-period`: how often stale chains are cleaned up in large-cluster mode.
    pub sync_period: Duration,
    /// Partial syncs (upstream always does them; off = every sync writes every chain).
    pub partial_sync: bool,
    /// Which iptables binaries the applier runs.
    pub backend: IptablesBackend,
    /// Run every iptables command in this network namespace (`nsenter --net=PATH`); `None` =
    /// the agent's own namespace. Used by tests; also usable for a node netns elsewhere.
    pub netns: Option<PathBuf>,
}

impl IptablesConfig {
    /// Upstream's defaults for `family` with the given detector.
    pub fn new(family: IpFamily, local_detector: LocalTrafficDetector) -> Self {
        IptablesConfig {
            family,
            node_ip: None,
            masquerade_bit: 14,
            masquerade_all: false,
            local_detector,
            localhost_node_ports: true,
            node_port_addresses: vec![],
            local_addresses: vec![],
            conntrack_tcp_liberal: false,
            random_fully: false,
            nfacct_counters: NfacctCounters::default(),
            large_cluster_threshold: LARGE_CLUSTER_ENDPOINTS_THRESHOLD,
            sync_period: Duration::from_secs(30),
            partial_sync: true,
            backend: IptablesBackend::Auto,
            netns: None,
        }
    }

    /// The masquerade mark as hex (`0x4000` for bit 14), as upstream's test proxier writes it.
    /// (Upstream's real proxier formats with `%#08x`; iptables parses both the same.)
    pub fn masquerade_mark(&self) -> String {
        format!("{:#x}", 1u64 << self.masquerade_bit.min(31))
    }

    fn family_cidrs(&self) -> Vec<IpNet> {
        self.node_port_addresses
            .iter()
            .copied()
            .filter(|n| self.family.matches(&n.addr()))
            .collect()
    }

    /// Upstream `NodePortAddresses.MatchAll()`: no CIDR of this family, or a zero CIDR.
    pub fn node_ports_match_all(&self) -> bool {
        let c = self.family_cidrs();
        c.is_empty() || c.iter().any(|n| n.prefix_len() == 0)
    }

    /// Upstream `NodePortAddresses.ContainsIPv4Loopback()`.
    fn contains_ipv4_loopback(&self) -> bool {
        if self.family != IpFamily::V4 {
            return false;
        }
        let lo: IpAddr = std::net::Ipv4Addr::LOCALHOST.into();
        self.node_ports_match_all() || self.family_cidrs().iter().any(|n| n.contains(&lo))
    }

    /// Whether localhost NodePorts are in effect (IPv4 only, needs route_localnet).
    pub fn effective_localhost_node_ports(&self) -> bool {
        self.localhost_node_ports && self.contains_ipv4_loopback()
    }

    /// Upstream `NodePortAddresses.GetNodeIPs()`: local addresses inside the CIDRs.
    pub fn node_port_ips(&self) -> Vec<IpAddr> {
        let cidrs = self.family_cidrs();
        let mut out: Vec<IpAddr> = vec![];
        for ip in &self.local_addresses {
            if self.family.matches(ip) && cidrs.iter().any(|c| c.contains(ip)) && !out.contains(ip)
            {
                out.push(*ip);
            }
        }
        out
    }
}

impl From<&crate::dataplane::netfilter::local_detect::LocalDetector> for LocalTrafficDetector {
    /// The shared detector (`kproxy::dataplane::netfilter::local_detect`) as this module's copy.
    fn from(d: &crate::dataplane::netfilter::local_detect::LocalDetector) -> Self {
        use crate::dataplane::netfilter::local_detect::LocalDetector as D;
        match d {
            D::None => LocalTrafficDetector::NoOp,
            D::Cidr(c) => LocalTrafficDetector::Cidr(*c),
            D::BridgeInterface(b) => LocalTrafficDetector::BridgeInterface(b.clone()),
            D::InterfaceNamePrefix(p) => LocalTrafficDetector::InterfaceNamePrefix(p.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detector_args_match_the_shared_detector() {
        use crate::dataplane::netfilter::local_detect::LocalDetector as D;
        for d in [
            D::None,
            D::Cidr("10.0.0.0/8".parse().unwrap()),
            D::BridgeInterface("cbr0".into()),
            D::InterfaceNamePrefix("veth".into()),
        ] {
            let mine = LocalTrafficDetector::from(&d);
            assert_eq!(mine.is_implemented(), d.is_implemented());
            assert_eq!(mine.if_local().unwrap_or_default(), d.if_local().join(" "));
            assert_eq!(
                mine.if_not_local().unwrap_or_default(),
                d.if_not_local().join(" ")
            );
        }
    }

    #[test]
    fn node_port_addresses_per_family() {
        let mut c = IptablesConfig::new(IpFamily::V4, LocalTrafficDetector::NoOp);
        assert!(c.node_ports_match_all() && c.effective_localhost_node_ports());
        c.node_port_addresses = vec![
            "192.168.0.0/24".parse().unwrap(),
            "2001:db8::/64".parse().unwrap(),
        ];
        c.local_addresses = ["127.0.0.1", "192.168.0.2", "192.168.1.2", "2001:db8::1"]
            .map(|s| s.parse().unwrap())
            .to_vec();
        assert!(!c.node_ports_match_all());
        assert!(
            !c.effective_localhost_node_ports(),
            "127.0.0.1 not selected"
        );
        assert_eq!(
            c.node_port_ips(),
            vec!["192.168.0.2".parse::<IpAddr>().unwrap()]
        );
        c.family = IpFamily::V6;
        assert_eq!(
            c.node_port_ips(),
            vec!["2001:db8::1".parse::<IpAddr>().unwrap()]
        );
    }
}
