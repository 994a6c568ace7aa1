//! Settings vocabulary the configuration names in datapaths' own terms: the configuration
//! (`config`) may not import a mode's internals, and a datapath may not import `config`, so
//! the few enums and names a mode's settings are made of live here, beside the trait.

/// Where the XDP program is attached (`bpf.xdp` / `--bpf-xdp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum XdpPolicy {
    /// TC only.
    Off,
    /// Native (driver) XDP where the driver supports it; elsewhere TC alone, with a warning.
    BestEffort,
    /// Native XDP on every device; a device that cannot take it is an error.
    Native,
}

/// Backend selection (`--bpf-lb-algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LbAlgorithm {
    /// A uniformly random slot per new connection (or UDP datagram without affinity).
    #[default]
    Random,
    /// Maglev consistent hashing (`dataplane::ebpf::service_maps::maglev`) for new flows the
    /// TC path handles (traffic from outside the node to NodePort / externalIP / LoadBalancer frontends). Socket LB (traffic
    /// from the node and its pods) keeps the random choice per connect, as Cilium applies
    /// Maglev to north-south traffic only: a connect has no 5-tuple yet, only the socket's
    /// destination, and in-cluster clients gain nothing from consistent hashing.
    Maglev,
}

/// The nftables mode's localhost-NodePorts feature gate (upstream's, alpha, off by default).
pub(crate) const NFTABLES_LOCALHOST_NODEPORTS: &str = "KubeProxyNFTablesLocalhostNodePorts";
