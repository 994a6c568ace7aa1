//! The resolved settings one iptables proxier (one IP family) needs.
//!
//! Everything upstream's `NewProxier` receives or detects at start-up is a field here, so the
//! planner stays pure: the applier fills the detected ones (`conntrack_tcp_liberal`,
//! `random_fully`, `nfacct_counters`, `local_addresses`) from the kernel before planning.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

use crate::dataplane::netfilter::local_detect::LocalDetector;
use crate::dataplane::netfilter::node_ports::NodePortAddresses;
use crate::model::IpFamily;

/// Upstream's `largeClusterEndpointsThreshold`.
pub(crate) const LARGE_CLUSTER_ENDPOINTS_THRESHOLD: usize = 1000;
/// Upstream `proxyutil.FullSyncPeriod`: a partial-sync proxier still does a full sync this often.
pub(crate) const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Names of the nfacct counters upstream's rules reference.
pub(crate) const NFACCT_CT_INVALID: &str = "ct_state_invalid_dropped_pkts";
pub(crate) const NFACCT_LOCALHOST_NODEPORTS: &str = "localhost_nps_accepted_pkts";

/// Which nfacct counters exist (upstream only references a counter it could ensure).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NfacctCounters {
    pub ct_state_invalid_dropped_pkts: bool,
    pub localhost_nps_accepted_pkts: bool,
}

/// Which iptables binaries to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
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
    pub local_detector: LocalDetector,
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
    pub backend: BackendChoice,
    /// Run every iptables command in this network namespace (`nsenter --net=PATH`); `None` =
    /// the agent's own namespace. Used by tests; also usable for a node netns elsewhere.
    pub netns: Option<PathBuf>,
}

impl IptablesConfig {
    /// Upstream's defaults for `family` with the given detector.
    pub fn new(family: IpFamily, local_detector: LocalDetector) -> Self {
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
            backend: BackendChoice::Auto,
            netns: None,
        }
    }

    /// `--nodeport-addresses` of this proxier's family, with the node's addresses.
    pub(crate) fn node_ports(&self) -> NodePortAddresses<'_> {
        NodePortAddresses {
            family: self.family,
            cidrs: &self.node_port_addresses,
            local_addresses: &self.local_addresses,
        }
    }

    /// Whether localhost NodePorts are in effect (IPv4 only, needs route_localnet).
    pub(crate) fn effective_localhost_node_ports(&self) -> bool {
        self.localhost_node_ports && self.node_ports().contains_ipv4_loopback()
    }
}
