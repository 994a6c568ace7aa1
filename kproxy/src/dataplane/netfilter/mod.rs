//! What the netfilter datapaths (iptables, IPVS) share: stale-flow [`conntrack`] cleanup and
//! [`local_detect`]ion of pod traffic, upstream's [`node_ports`] addresses; [`with_conntrack`] runs the cleanup after each sync.

pub mod backend;
pub mod conntrack;
pub(crate) mod exec;
pub mod local_detect;
pub mod node_ports;
pub mod with_conntrack;

/// The four per-service-port chains both netfilter rule writers name (upstream: iptables
/// `KUBE-SVC/SVL/EXT/FW-<hash>`, nftables `service/local/external/firewall-<hash>-<name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceChains {
    /// Endpoints for Cluster traffic policy.
    pub cluster: String,
    /// Endpoints for Local traffic policy.
    pub local: String,
    /// External destinations (NodePort, externalIPs, LB).
    pub external: String,
    /// `loadBalancerSourceRanges`.
    pub firewall: String,
}

impl ServiceChains {
    /// The chains `prefix + base` for the prefixes in order cluster, local, external, firewall.
    pub fn named(prefixes: [&str; 4], base: &str) -> Self {
        let [c, l, e, f] = prefixes.map(|p| format!("{p}{base}"));
        ServiceChains {
            cluster: c,
            local: l,
            external: e,
            firewall: f,
        }
    }
}
