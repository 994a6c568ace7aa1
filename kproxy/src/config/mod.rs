//! Configuration: the `KubeProxyConfiguration` file, flags merged over it, and the resolved
//! [`ProxyConfig`] everything else reads.
//!
//! ```text
//!  --config FILE ──> file::KubeProxyConfiguration ─┐ (strict YAML, field paths in errors)
//!                          apply_defaults()         │ (upstream's defaulting)
//!  command line  ──> cli::apply_flags() ───────────┤ (only flags actually given override)
//!                          resolve::resolve() ──────┴─> ProxyConfig (validated, typed)
//! ```
//!
//! - `duration`: Go duration text (`30s`, `1m0s`), used by flags and the file.
//! - `file`: the v1alpha1 file as written, its defaults and kproxy's extensions
//!   (top-level `syncPeriod`/`minSyncPeriod` for the ebpf mode, and `bpf:`).
//! - `resolve`](mod@resolve): upstream's validation rules, and the conversion to [`ProxyConfig`. Every
//!   problem is reported at once, each naming its field (and the flag that set it, if any).
//!
//! Divergences from upstream, on purpose:
//! - `mode: ""` means *detect* (ebpf, else nftables, else ipvs, else iptables); upstream's
//!   empty mode means iptables. `kernelspace` is rejected.
//! - Flags override the file. Upstream ignores most flags when `--config` is given; kproxy
//!   applies every flag actually given on top of the file.
//! - The periods of every section are validated, not only those of the chosen mode (the mode
//!   may be detected at run time).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use serde::Serialize;

use crate::dataplane::ProxyMode;
pub(crate) use crate::dataplane::netfilter::local_detect::DetectLocal;
pub(crate) use crate::dataplane::settings::{LbAlgorithm, XdpPolicy};
use crate::sync::RunnerConfig;

pub(crate) mod duration;
pub(crate) mod fields;
pub(crate) mod file;
pub(crate) mod resolve;

pub use duration::GoDuration;
pub(crate) use file::KubeProxyConfiguration;
pub(crate) use resolve::resolve;
pub use resolve::{ConfigErrors, FieldError};

/// Names accepted in `bpf.mapSizes` / `--bpf-map-sizes` (the eBPF datapath's maps).
pub(crate) const BPF_MAP_NAMES: &[&str] = &[
    "services",
    "backendSlots",
    "backends",
    "ct",
    "revNat",
    "affinity",
    "sourceRanges",
    "maglev",
];

/// IPVS schedulers upstream accepts (`""` = the default, `rr`).
pub(crate) const IPVS_SCHEDULERS: &[&str] = &[
    "", "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq",
];

/// The validated, defaulted, flag-merged configuration: everything the agent and the
/// datapaths need. Built by `resolve()`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProxyConfig {
    /// `mode` / `--proxy-mode`.
    pub mode: ModeChoice,
    /// The node kproxy runs on: `--hostname-override`, else `hostnameOverride`, else the
    /// hostname; trimmed and lowercased (upstream's `GetHostname`).
    pub node_name: String,
    /// Where Services and EndpointSlices come from.
    pub source: SourceConfig,
    /// `clientConnection` apart from the kubeconfig (which is in `source`).
    pub client: ClientConfig,
    /// `bindAddress`: overrides the idea of the node's primary IP (no socket is bound to it);
    /// `0.0.0.0` / `::` = unspecified (take it from the Node object).
    pub bind_address: IpAddr,
    /// `healthzBindAddress`; `None` = health server disabled (`--healthz-bind-address=""` or
    /// `--healthz-port=0`).
    pub healthz_bind_address: Option<SocketAddr>,
    /// `metricsBindAddress`; `None` = metrics server disabled (`--metrics-bind-address=""`
    /// or `--metrics-port=0`).
    pub metrics_bind_address: Option<SocketAddr>,
    /// `bindAddressHardFail`: failing to bind healthz/metrics is fatal.
    pub bind_address_hard_fail: bool,
    /// `enableProfiling` (accepted; kproxy serves no pprof).
    pub enable_profiling: bool,
    /// `clusterCIDR` split: at most one CIDR per family.
    pub cluster_cidrs: Vec<IpNet>,
    /// `detectLocalMode` + `detectLocal`: how traffic from local pods is recognised.
    pub detect_local: DetectLocal,
    /// `nodePortAddresses`.
    pub node_port_addresses: NodePortAddresses,
    /// The node's primary IP of each family (non-loopback), for `nodePortAddresses: primary`:
    /// not configuration but what the agent found at start-up (`app::agent::node_ips_at_start`)
    /// before it builds the datapath, as upstream rewrites its config there. Empty until then
    /// (`primary` then means every local address).
    #[serde(skip)]
    pub primary_node_ips: Vec<IpAddr>,
    /// kproxy extension `serviceCIDRs` / `--service-cidrs`: the cluster's service CIDRs, for
    /// the nftables mode's drop of unallocated ClusterIPs while the API server serves no
    /// `ServiceCIDR` objects (when it does, those replace these).
    pub service_cidrs: Vec<IpNet>,
    /// `iptables.masqueradeAll` / `--masquerade-all`: SNAT all traffic to service IPs.
    pub masquerade_all: bool,
    /// `iptables.masqueradeBit` (0..=31): the fwmark bit marking packets to SNAT (iptables and
    /// ipvs modes; mark = `1 << bit`).
    pub masquerade_bit: u8,
    /// The iptables mode's settings.
    pub iptables: IptablesConfig,
    /// The ipvs mode's settings.
    pub ipvs: IpvsConfig,
    /// The nftables mode's settings (`nftables.*`).
    pub nftables: NftablesModeConfig,
    /// The ebpf mode's sync periods (kproxy extension: top-level `syncPeriod`/`minSyncPeriod`,
    /// `--sync-period`/`--min-sync-period`).
    pub ebpf_sync: SyncPeriods,
    /// The eBPF datapath's settings (kproxy extension `bpf:` / `--bpf-*`).
    pub bpf: BpfConfig,
    /// `conntrack`: sysctls to set and conntrack timeouts.
    pub conntrack: ConntrackConfig,
    /// `oomScoreAdj` (-1000..=1000), written to /proc/self/oom_score_adj by the agent.
    pub oom_score_adj: i32,
    /// `configSyncPeriod` (accepted; kproxy's watchers do not resync periodically).
    pub config_sync_period: Duration,
    /// `logging`.
    pub logging: LoggingConfig,
    /// `featureGates`: every gate given; those kproxy knows are in `FEATURE_GATES`, the
    /// others are warned about and ignored. Read with `ProxyConfig::feature`.
    pub feature_gates: BTreeMap<String, bool>,
}

/// A feature gate kproxy implements: its upstream name and default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FeatureGate {
    pub name: &'static str,
    pub default: bool,
    pub what: &'static str,
}

/// The feature gates kproxy implements (upstream's names and defaults).
pub(crate) const FEATURE_GATES: &[FeatureGate] = &[FeatureGate {
    name: crate::dataplane::settings::NFTABLES_LOCALHOST_NODEPORTS,
    default: false,
    what: "nftables mode: serve TCP NodePorts on 127.0.0.1 through a userspace proxy (alpha)",
}];

impl ProxyConfig {
    /// Whether feature gate `name` (one of [`FEATURE_GATES`]) is on: as given, else its default.
    pub(crate) fn feature(&self, name: &str) -> bool {
        let default = FEATURE_GATES
            .iter()
            .find(|g| g.name == name)
            .map(|g| g.default);
        debug_assert!(default.is_some(), "unknown feature gate {name}");
        self.feature_gates
            .get(name)
            .copied()
            .or(default)
            .unwrap_or(false)
    }
}

/// Which datapath to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeChoice {
    /// `""`: probe ebpf, then ipvs, then iptables (upstream: `""` = iptables).
    Detect,
    /// A mode given explicitly; fails if unavailable.
    Forced(ProxyMode),
}

/// Log line format (`--logging-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Where the cluster state comes from (the agent builds its source from this).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceConfig {
    /// `--manifests PATH` (standalone, no API server).
    Manifests(PathBuf),
    /// The API server: `clientConnection.kubeconfig` / `--kubeconfig`, `--master`; neither ⇒
    /// in-cluster config or the default kubeconfig.
    Kube {
        kubeconfig: Option<PathBuf>,
        master: Option<String>,
    },
}

/// `clientConnection` settings other than the kubeconfig (accepted; kube-rs has no
/// client-side rate limiting and always speaks JSON).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientConfig {
    pub content_type: String,
    pub accept_content_types: String,
    pub qps: f32,
    pub burst: i32,
}

/// `nodePortAddresses` / `--nodeport-addresses`.
///
/// Upstream (cmd/kube-proxy `validateKubeProxyNodePortAddress`, `options.go`) accepts a list of
/// CIDRs or the single string `primary`. kproxy also accepts the keywords `all` and `localhost`
/// that the Kubernetes documentation (concepts/services-networking/service.md) names but
/// upstream's binary rejects ("must be a valid CIDR"): a kproxy extension, see
/// `resolve`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum NodePortAddresses {
    /// Unset: the mode's default (each mode's face says it): `primary` in nftables mode
    /// (upstream's nftables `Backend.Init` / `platformApplyDefaults`), every local address in
    /// iptables and ipvs mode (upstream) and in kproxy's ebpf mode.
    Unset,
    /// `primary`: only the node's primary IP of each family (the Node object's, or
    /// `bindAddress`), resolved once at start-up as upstream's `NewProxyServer` does.
    Primary,
    /// Only local addresses inside these CIDRs (`localhost` ⇒ 127.0.0.0/8 and ::1/128,
    /// `all` ⇒ 0.0.0.0/0 and ::/0).
    Cidrs(Vec<IpNet>),
}

impl NodePortAddresses {
    /// Upstream's rewrite of `primary` (`NewProxyServer`): each family's node IP that is not
    /// loopback as a /32 or /128. Empty (= every local address, as upstream when the node's
    /// IPs are unknown and only loopback is assumed) when none is known.
    pub(crate) fn primary_cidrs(node_ips: &[IpAddr]) -> Vec<IpNet> {
        node_ips
            .iter()
            .filter(|ip| !ip.is_loopback() && !ip.is_unspecified())
            .map(|ip| IpNet::from(*ip))
            .collect()
    }
}

/// A mode's `syncPeriod` / `minSyncPeriod`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SyncPeriods {
    pub sync_period: Duration,
    pub min_sync_period: Duration,
}

impl SyncPeriods {
    /// The bounded-frequency runner's timing for these periods.
    pub(crate) fn runner(self) -> RunnerConfig {
        RunnerConfig::new(self.min_sync_period, self.sync_period)
    }
}

/// The iptables mode's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IptablesConfig {
    /// `iptables.syncPeriod` / `minSyncPeriod`.
    pub sync: SyncPeriods,
    /// `iptables.localhostNodePorts`: NodePorts reachable on 127.0.0.1 (IPv4 only; sets
    /// route_localnet).
    pub localhost_node_ports: bool,
}

/// The nftables mode's settings (upstream's `nftables.*` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct NftablesModeConfig {
    /// `nftables.syncPeriod` / `minSyncPeriod` (30s / 1s).
    pub sync: SyncPeriods,
    /// `nftables.masqueradeBit` (0..=31, default 14).
    pub masquerade_bit: u8,
    /// `nftables.masqueradeAll`, or `--masquerade-all` / `iptables.masqueradeAll` (upstream's
    /// flag sets every mode's field).
    pub masquerade_all: bool,
}

/// The ipvs mode's settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IpvsConfig {
    /// `ipvs.syncPeriod` / `minSyncPeriod`.
    pub sync: SyncPeriods,
    /// `ipvs.scheduler`; one of `IPVS_SCHEDULERS`, `""` resolved to `rr`.
    pub scheduler: String,
    /// `ipvs.excludeCIDRs`: IPVS virtual servers in these ranges are never removed.
    pub exclude_cidrs: Vec<IpNet>,
    /// `ipvs.strictARP`: arp_ignore=1, arp_announce=2.
    pub strict_arp: bool,
    /// `ipvs.tcpTimeout`; `None` = leave the kernel's value.
    pub tcp_timeout: Option<Duration>,
    /// `ipvs.tcpFinTimeout`; `None` = leave.
    pub tcp_fin_timeout: Option<Duration>,
    /// `ipvs.udpTimeout`; `None` = leave.
    pub udp_timeout: Option<Duration>,
}

/// The eBPF datapath's settings (kproxy extension).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BpfConfig {
    /// `bpf.cgroup` / `--bpf-cgroup`: cgroup v2 directory for socket LB; `None` = the root of
    /// the cgroup2 mount.
    pub cgroup: Option<PathBuf>,
    /// `bpf.bpffs` / `--bpffs`: bpffs mount; maps are pinned under `<bpffs>/kproxy/`.
    pub bpffs: PathBuf,
    /// `bpf.devices` / `--bpf-devices`: devices for TC/XDP; empty = detect.
    pub devices: Vec<String>,
    /// `bpf.mapSizes` / `--bpf-map-sizes`: size overrides by map name (`BPF_MAP_NAMES`);
    /// maps not named keep the datapath's default.
    pub map_sizes: BTreeMap<String, u32>,
    /// `bpf.xdp` / `--bpf-xdp`.
    pub xdp: XdpPolicy,
    /// `bpf.lbAlgorithm` / `--bpf-lb-algorithm`.
    pub lb_algorithm: LbAlgorithm,
    /// `bpf.maglevTableSize` / `--bpf-lb-maglev-table-size`: entries per Maglev table, a
    /// prime in `[MIN_TABLE_SIZE, MAX_TABLE_SIZE]` (`kproxy_common::maglev`).
    pub maglev_table_size: u32,
    /// `bpf.conntrack.tcpTimeWaitTimeout`: connection-table timeout of TCP flows closed by FIN
    /// both ways.
    pub ct_tcp_time_wait: Duration,
    /// `bpf.conntrack.tcpCloseTimeout`: … of TCP flows closed by RST.
    pub ct_tcp_close: Duration,
    /// `bpf.conntrack.expiryInterval`: period of the connection table's expiry (> 0).
    pub ct_expiry_interval: Duration,
}

/// `conntrack` (upstream semantics: a zero means "leave the kernel's value").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConntrackConfig {
    /// `maxPerCore`: nf_conntrack_max = max(maxPerCore × CPUs, min); 0 = leave the limit.
    pub max_per_core: u32,
    /// `min`.
    pub min: u32,
    /// `tcpEstablishedTimeout`; zero = leave.
    pub tcp_established_timeout: Duration,
    /// `tcpCloseWaitTimeout`; zero = leave.
    pub tcp_close_wait_timeout: Duration,
    /// `tcpBeLiberal`: nf_conntrack_tcp_be_liberal=1.
    pub tcp_be_liberal: bool,
    /// `udpTimeout` (UNREPLIED UDP); zero = leave.
    pub udp_timeout: Duration,
    /// `udpStreamTimeout` (ASSURED UDP); zero = leave.
    pub udp_stream_timeout: Duration,
}

/// `logging`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LoggingConfig {
    #[serde(serialize_with = "ser_log_format")]
    pub format: LogFormat,
    /// klog verbosity (`-v`); kproxy maps ≥4 to debug and ≥6 to trace when `RUST_LOG` is unset.
    pub verbosity: u32,
}

fn ser_log_format<S: serde::Serializer>(f: &LogFormat, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match f {
        LogFormat::Text => "text",
        LogFormat::Json => "json",
    })
}

impl ProxyConfig {
    /// The fwmark used to mark packets for SNAT (`1 << masquerade_bit`).
    pub fn masquerade_mark(&self) -> u32 {
        1u32 << self.masquerade_bit
    }
}
