//! The table of every flag kproxy accepts: upstream kube-proxy's flags (from
//! `cmd/kube-proxy/app/options.go` and component-base's logging flags), the klog flags older
//! kube-proxy releases registered, flags upstream removed that old manifests still pass, and
//! kproxy's own flags.
//!
//! Each entry says whether kproxy implements the flag; an accepted-but-unimplemented flag
//! logs one warning naming it (a drop-in replacement must never fail on its command line).
//! `field` is the `KubeProxyConfiguration` path the flag sets, if any — errors about that field
//! then name the flag too.

/// How a flag takes its value (Go pflag syntax).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `--flag`, `--flag=true|false` (never `--flag false`).
    Bool,
    /// `--flag=value` or `--flag value`; the text is the value's placeholder in help.
    Value(&'static str),
}

/// What kproxy does with a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// The flag works.
    Implemented,
    /// Accepted (and, where it maps to a config field, recorded there) but without effect:
    /// one warning naming the flag.
    Ignored,
    /// Removed from upstream kube-proxy (or a klog flag older releases had); accepted so old
    /// command lines keep working, one warning naming the flag.
    Removed,
}

/// Where a flag comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Upstream kube-proxy (Linux build) today.
    Upstream,
    /// Upstream's Windows build.
    UpstreamWindows,
    /// Older upstream releases only.
    Legacy,
    /// kproxy's own.
    Kproxy,
}

/// One flag.
#[derive(Debug, Clone, Copy)]
pub struct FlagSpec {
    /// Long name without `--` (dashes; `_` on the command line is normalized to `-`, as
    /// upstream's `WordSepNormalizeFunc` does).
    pub name: &'static str,
    pub short: Option<char>,
    pub kind: Kind,
    pub support: Support,
    pub origin: Origin,
    /// The `KubeProxyConfiguration` field the flag sets, if any.
    pub field: Option<&'static str>,
    pub help: &'static str,
    /// How the flag's value is applied to the configuration.
    pub apply: Apply,
}

/// Where a flag's value goes (and how it is parsed), applied by `super::apply_flags`.
/// Accessors return the `KubeProxyConfiguration` field the value is stored in.
#[derive(Debug, Clone, Copy)]
pub enum Apply {
    /// Read elsewhere (`load` / `main`: config, write-config-to, cleanup, init-only,
    /// version, output), or ignored without a config field. A boolean flag's value is still
    /// checked to be a boolean.
    Nothing,
    /// The last value, as given.
    Str(fn(&mut KubeProxyConfiguration) -> &mut Option<String>),
    /// The last value, a Go boolean.
    Bool(fn(&mut KubeProxyConfiguration) -> &mut Option<bool>),
    /// The last value, a Go 32-bit integer (`0x…`, `0…` accepted).
    I32(fn(&mut KubeProxyConfiguration) -> &mut Option<i32>),
    /// The last value, a Go duration.
    Duration(fn(&mut KubeProxyConfiguration) -> &mut Option<GoDuration>),
    /// Every value, comma-separated lists appended.
    List(fn(&mut KubeProxyConfiguration) -> &mut Option<Vec<String>>),
    /// A flag with its own parsing, or one that sets something outside the file.
    Custom(fn(&mut KubeProxyConfiguration, &mut Extra, &Given) -> Result<(), CliError>),
}

impl FlagSpec {
    /// This flag, applied by `apply`.
    const fn sets(self, apply: Apply) -> FlagSpec {
        FlagSpec { apply, ..self }
    }
}

use super::{CliError, Given};
use crate::config::resolve::Extra;
use crate::config::{GoDuration, KubeProxyConfiguration};
use Apply::{Custom, Duration, I32, List, Str};
use Kind::{Bool, Value};
use Origin::{Kproxy, Legacy, Upstream, UpstreamWindows};
use Support::{Ignored, Implemented, Removed};

const fn f(
    name: &'static str,
    kind: Kind,
    support: Support,
    origin: Origin,
    field: Option<&'static str>,
    help: &'static str,
) -> FlagSpec {
    FlagSpec {
        name,
        short: None,
        kind,
        support,
        origin,
        field,
        help,
        apply: Apply::Nothing,
    }
}

/// Every accepted flag, in help order.
pub(crate) const FLAGS: &[FlagSpec] = &[
    // --- kube-proxy: general ---
    f(
        "config",
        Value("FILE"),
        Implemented,
        Upstream,
        None,
        "The path to the KubeProxyConfiguration (v1alpha1) file. Flags given on the command line override its values.",
    ),
    f(
        "write-config-to",
        Value("FILE"),
        Implemented,
        Upstream,
        None,
        "Write the effective configuration (file + flags + defaults) to this file as YAML and exit.",
    ),
    f(
        "cleanup",
        Bool,
        Implemented,
        Upstream,
        None,
        "Remove everything any proxy mode (and upstream kube-proxy) left in the kernel, then exit.",
    ),
    f(
        "init-only",
        Bool,
        Implemented,
        Upstream,
        None,
        "Validate the configuration and exit (kproxy needs no separate privileged initialization).",
    ),
    f(
        "version",
        Value("true|false|raw"),
        Implemented,
        Upstream,
        None,
        "Print version information and exit (--version or --version=raw).",
    ),
    f(
        "kubeconfig",
        Value("FILE"),
        Implemented,
        Upstream,
        Some("clientConnection.kubeconfig"),
        "Path to a kubeconfig file with authorization information.",
    )
    .sets(Str(|c| &mut c.client_connection.kubeconfig)),
    f(
        "master",
        Value("URL"),
        Implemented,
        Upstream,
        None,
        "The address of the Kubernetes API server (overrides any value in kubeconfig).",
    )
    .sets(Custom(super::set_master)),
    f(
        "hostname-override",
        Value("NAME"),
        Implemented,
        Upstream,
        Some("hostnameOverride"),
        "The name of the Node kproxy runs on (default: the hostname).",
    )
    .sets(Custom(super::set_hostname_override)),
    f(
        "bind-address",
        Value("IP"),
        Implemented,
        Upstream,
        Some("bindAddress"),
        "Overrides the idea of the node's primary IP (no socket is bound to it).",
    )
    .sets(Str(|c| &mut c.bind_address)),
    f(
        "healthz-bind-address",
        Value("IP[:PORT]"),
        Implemented,
        Upstream,
        Some("healthzBindAddress"),
        "Address of the health server (default 0.0.0.0:10256); empty disables it.",
    )
    .sets(Custom(super::set_healthz_bind_address)),
    f(
        "metrics-bind-address",
        Value("IP[:PORT]"),
        Implemented,
        Upstream,
        Some("metricsBindAddress"),
        "Address of the metrics server (default 127.0.0.1:10249); empty disables it.",
    )
    .sets(Custom(super::set_metrics_bind_address)),
    f(
        "healthz-port",
        Value("PORT"),
        Implemented,
        Upstream,
        Some("healthzBindAddress"),
        "Deprecated: the health server's port; 0 disables it. Use --healthz-bind-address.",
    )
    .sets(Custom(super::set_healthz_port)),
    f(
        "metrics-port",
        Value("PORT"),
        Implemented,
        Upstream,
        Some("metricsBindAddress"),
        "Deprecated: the metrics server's port; 0 disables it. Use --metrics-bind-address.",
    )
    .sets(Custom(super::set_metrics_port)),
    f(
        "proxy-mode",
        Value("MODE"),
        Implemented,
        Upstream,
        Some("mode"),
        "ebpf, nftables, ipvs or iptables; empty (default) detects: ebpf, else nftables, else ipvs, else iptables.",
    )
    .sets(Str(|c| &mut c.mode)),
    f(
        "bind-address-hard-fail",
        Bool,
        Ignored,
        Upstream,
        Some("bindAddressHardFail"),
        "Treat failure to bind the health or metrics port as fatal.",
    )
    .sets(Apply::Bool(|c| &mut c.bind_address_hard_fail)),
    f(
        "profiling",
        Bool,
        Ignored,
        Upstream,
        Some("enableProfiling"),
        "Serve /debug/pprof (kproxy has no pprof).",
    )
    .sets(Apply::Bool(|c| &mut c.enable_profiling)),
    f(
        "show-hidden-metrics-for-version",
        Value("VERSION"),
        Ignored,
        Upstream,
        Some("showHiddenMetricsForVersion"),
        "Show metrics hidden since this version.",
    )
    .sets(Str(|c| &mut c.show_hidden_metrics_for_version)),
    f(
        "feature-gates",
        Value("KEY=BOOL,..."),
        Implemented,
        Upstream,
        Some("featureGates"),
        "Upstream feature gates; kproxy knows KubeProxyNFTablesLocalhostNodePorts (others are warned about and ignored).",
    )
    .sets(Custom(super::set_feature_gates)),
    f(
        "kube-api-content-type",
        Value("TYPE"),
        Ignored,
        Upstream,
        Some("clientConnection.contentType"),
        "Content type of requests sent to the API server.",
    )
    .sets(Str(|c| &mut c.client_connection.content_type)),
    f(
        "kube-api-qps",
        Value("QPS"),
        Ignored,
        Upstream,
        Some("clientConnection.qps"),
        "QPS to use while talking with the API server.",
    )
    .sets(Custom(super::set_kube_api_qps)),
    f(
        "kube-api-burst",
        Value("N"),
        Ignored,
        Upstream,
        Some("clientConnection.burst"),
        "Burst to use while talking with the API server.",
    )
    .sets(I32(|c| &mut c.client_connection.burst)),
    f(
        "config-sync-period",
        Value("DURATION"),
        Ignored,
        Upstream,
        Some("configSyncPeriod"),
        "How often configuration from the API server is refreshed.",
    )
    .sets(Duration(|c| &mut c.config_sync_period)),
    // --- local traffic, NodePorts, masquerading ---
    f(
        "cluster-cidr",
        Value("CIDR[,CIDR]"),
        Implemented,
        Upstream,
        Some("clusterCIDR"),
        "The pods' CIDR range(s) (one, or a dual-stack pair); used by --detect-local-mode=ClusterCIDR.",
    )
    .sets(Str(|c| &mut c.cluster_cidr)),
    f(
        "detect-local-mode",
        Value("MODE"),
        Implemented,
        Upstream,
        Some("detectLocalMode"),
        "ClusterCIDR (default), NodeCIDR, BridgeInterface or InterfaceNamePrefix.",
    )
    .sets(Str(|c| &mut c.detect_local_mode)),
    f(
        "pod-bridge-interface",
        Value("IFACE"),
        Implemented,
        Upstream,
        Some("detectLocal.bridgeInterface"),
        "The bridge whose traffic is local (--detect-local-mode=BridgeInterface).",
    )
    .sets(Str(|c| &mut c.detect_local.bridge_interface)),
    f(
        "pod-interface-name-prefix",
        Value("PREFIX"),
        Implemented,
        Upstream,
        Some("detectLocal.interfaceNamePrefix"),
        "Interfaces with this prefix carry local traffic (--detect-local-mode=InterfaceNamePrefix).",
    )
    .sets(Str(|c| &mut c.detect_local.interface_name_prefix)),
    f(
        "nodeport-addresses",
        Value("CIDR,..."),
        Implemented,
        Upstream,
        Some("nodePortAddresses"),
        "Node IP ranges that accept NodePort traffic, or 'primary' (the node's primary IPs); default 'primary' in nftables mode, all local IPs otherwise. kproxy also accepts 'all' and 'localhost'.",
    )
    .sets(List(|c| &mut c.node_port_addresses)),
    f(
        "masquerade-all",
        Bool,
        Implemented,
        Upstream,
        Some("iptables.masqueradeAll"),
        "SNAT all traffic sent to service cluster IPs.",
    )
    .sets(Apply::Bool(|c| &mut c.iptables.masquerade_all)),
    f(
        "iptables-masquerade-bit",
        Value("BIT"),
        Implemented,
        Upstream,
        Some("iptables.masqueradeBit"),
        "The fwmark bit marking packets to SNAT (0..31, default 14).",
    )
    .sets(I32(|c| &mut c.iptables.masquerade_bit)),
    f(
        "iptables-localhost-nodeports",
        Bool,
        Implemented,
        Upstream,
        Some("iptables.localhostNodePorts"),
        "Allow NodePorts on localhost (iptables mode, IPv4; default true).",
    )
    .sets(Apply::Bool(|c| &mut c.iptables.localhost_node_ports)),
    f(
        "iptables-sync-period",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("iptables.syncPeriod"),
        "iptables mode: full resync at least this often (default 30s).",
    )
    .sets(Duration(|c| &mut c.iptables.sync_period)),
    f(
        "iptables-min-sync-period",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("iptables.minSyncPeriod"),
        "iptables mode: minimum interval between syncs (default 1s).",
    )
    .sets(Duration(|c| &mut c.iptables.min_sync_period)),
    f(
        "ipvs-sync-period",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("ipvs.syncPeriod"),
        "ipvs mode: full resync at least this often (default 30s).",
    )
    .sets(Duration(|c| &mut c.ipvs.sync_period)),
    f(
        "ipvs-min-sync-period",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("ipvs.minSyncPeriod"),
        "ipvs mode: minimum interval between syncs (default 1s).",
    )
    .sets(Duration(|c| &mut c.ipvs.min_sync_period)),
    f(
        "ipvs-scheduler",
        Value("NAME"),
        Implemented,
        Upstream,
        Some("ipvs.scheduler"),
        "ipvs mode: the IPVS scheduler (default rr).",
    )
    .sets(Str(|c| &mut c.ipvs.scheduler)),
    f(
        "ipvs-exclude-cidrs",
        Value("CIDR,..."),
        Implemented,
        Upstream,
        Some("ipvs.excludeCIDRs"),
        "ipvs mode: IPVS virtual servers in these ranges are left alone.",
    )
    .sets(List(|c| &mut c.ipvs.exclude_cidrs)),
    f(
        "ipvs-strict-arp",
        Bool,
        Implemented,
        Upstream,
        Some("ipvs.strictARP"),
        "ipvs mode: set arp_ignore=1 and arp_announce=2.",
    )
    .sets(Apply::Bool(|c| &mut c.ipvs.strict_arp)),
    f(
        "ipvs-tcp-timeout",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("ipvs.tcpTimeout"),
        "ipvs mode: idle TCP timeout; 0 leaves the kernel's value.",
    )
    .sets(Duration(|c| &mut c.ipvs.tcp_timeout)),
    f(
        "ipvs-tcpfin-timeout",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("ipvs.tcpFinTimeout"),
        "ipvs mode: TCP timeout after FIN; 0 leaves the kernel's value.",
    )
    .sets(Duration(|c| &mut c.ipvs.tcp_fin_timeout)),
    f(
        "ipvs-udp-timeout",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("ipvs.udpTimeout"),
        "ipvs mode: UDP timeout; 0 leaves the kernel's value.",
    )
    .sets(Duration(|c| &mut c.ipvs.udp_timeout)),
    // --- conntrack, process ---
    f(
        "conntrack-max-per-core",
        Value("N"),
        Implemented,
        Upstream,
        Some("conntrack.maxPerCore"),
        "Conntrack entries per CPU (0 leaves the limit and ignores --conntrack-min).",
    )
    .sets(I32(|c| &mut c.conntrack.max_per_core)),
    f(
        "conntrack-min",
        Value("N"),
        Implemented,
        Upstream,
        Some("conntrack.min"),
        "Minimum conntrack limit regardless of --conntrack-max-per-core.",
    )
    .sets(I32(|c| &mut c.conntrack.min)),
    f(
        "conntrack-tcp-timeout-established",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("conntrack.tcpEstablishedTimeout"),
        "Idle timeout of established TCP connections (0 leaves it).",
    )
    .sets(Duration(|c| &mut c.conntrack.tcp_established_timeout)),
    f(
        "conntrack-tcp-timeout-close-wait",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("conntrack.tcpCloseWaitTimeout"),
        "Timeout of TCP connections in CLOSE_WAIT (0 leaves it).",
    )
    .sets(Duration(|c| &mut c.conntrack.tcp_close_wait_timeout)),
    f(
        "conntrack-tcp-be-liberal",
        Bool,
        Implemented,
        Upstream,
        Some("conntrack.tcpBeLiberal"),
        "Set nf_conntrack_tcp_be_liberal=1.",
    )
    .sets(Apply::Bool(|c| &mut c.conntrack.tcp_be_liberal)),
    f(
        "conntrack-udp-timeout",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("conntrack.udpTimeout"),
        "Idle timeout of UNREPLIED UDP entries (0 leaves it).",
    )
    .sets(Duration(|c| &mut c.conntrack.udp_timeout)),
    f(
        "conntrack-udp-timeout-stream",
        Value("DURATION"),
        Implemented,
        Upstream,
        Some("conntrack.udpStreamTimeout"),
        "Idle timeout of ASSURED UDP entries (0 leaves it).",
    )
    .sets(Duration(|c| &mut c.conntrack.udp_stream_timeout)),
    f(
        "oom-score-adj",
        Value("N"),
        Implemented,
        Upstream,
        Some("oomScoreAdj"),
        "The process's oom_score_adj (-1000..1000, default -999).",
    )
    .sets(I32(|c| &mut c.oom_score_adj)),
    // --- logging (component-base) ---
    f(
        "logging-format",
        Value("FORMAT"),
        Implemented,
        Upstream,
        Some("logging.format"),
        "Log format: text (default) or json.",
    )
    .sets(Str(|c| &mut c.logging.format)),
    FlagSpec {
        name: "v",
        short: Some('v'),
        kind: Value("LEVEL"),
        support: Implemented,
        origin: Upstream,
        field: Some("logging.verbosity"),
        help: "Log verbosity: >=4 logs debug, >=6 trace (when RUST_LOG is unset).",
        apply: Custom(super::set_verbosity),
    },
    f(
        "vmodule",
        Value("PATTERN=N,..."),
        Ignored,
        Upstream,
        Some("logging.vmodule"),
        "Per-file verbosity (klog).",
    ),
    f(
        "log-flush-frequency",
        Value("DURATION"),
        Ignored,
        Upstream,
        Some("logging.flushFrequency"),
        "Maximum time between log flushes.",
    ),
    f(
        "log-text-split-stream",
        Bool,
        Ignored,
        Upstream,
        None,
        "Text logs: info to stdout, errors to stderr.",
    ),
    f(
        "log-text-info-buffer-size",
        Value("QUANTITY"),
        Ignored,
        Upstream,
        None,
        "Text logs: info buffer size.",
    ),
    f(
        "log-json-split-stream",
        Bool,
        Ignored,
        Upstream,
        None,
        "JSON logs: info to stdout, errors to stderr.",
    ),
    f(
        "log-json-info-buffer-size",
        Value("QUANTITY"),
        Ignored,
        Upstream,
        None,
        "JSON logs: info buffer size.",
    ),
    // --- Windows build only ---
    f(
        "windows-service",
        Bool,
        Ignored,
        UpstreamWindows,
        Some("windowsRunAsService"),
        "Windows: run as a service.",
    )
    .sets(Apply::Bool(|c| &mut c.windows_run_as_service)),
    // --- klog flags of older releases, and removed kube-proxy flags ---
    f(
        "add-dir-header",
        Bool,
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "alsologtostderr",
        Bool,
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "log-backtrace-at",
        Value("FILE:N"),
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "log-dir",
        Value("DIR"),
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "log-file",
        Value("FILE"),
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "log-file-max-size",
        Value("MB"),
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "logtostderr",
        Bool,
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "one-output",
        Bool,
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "skip-headers",
        Bool,
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "skip-log-headers",
        Bool,
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "stderrthreshold",
        Value("SEVERITY"),
        Removed,
        Legacy,
        None,
        "klog (removed upstream).",
    ),
    f(
        "proxy-port-range",
        Value("RANGE"),
        Removed,
        Legacy,
        Some("portRange"),
        "Userspace proxy port range (removed upstream).",
    )
    .sets(Str(|c| &mut c.port_range)),
    f(
        "udp-timeout",
        Value("DURATION"),
        Removed,
        Legacy,
        None,
        "Userspace proxy UDP timeout (removed upstream).",
    ),
    f(
        "resource-container",
        Value("NAME"),
        Removed,
        Legacy,
        None,
        "Removed upstream.",
    ),
    f(
        "cleanup-ipvs",
        Bool,
        Removed,
        Legacy,
        None,
        "Removed upstream (--cleanup cleans every mode).",
    ),
    f(
        "azure-container-registry-config",
        Value("FILE"),
        Removed,
        Legacy,
        None,
        "Removed upstream.",
    ),
    // --- kproxy's own ---
    f(
        "manifests",
        Value("PATH"),
        Implemented,
        Kproxy,
        None,
        "Standalone mode: read Services/EndpointSlices (and the Node) from a YAML file or directory instead of the API server.",
    )
    .sets(Custom(super::set_manifests)),
    f(
        "sync-period",
        Value("DURATION"),
        Implemented,
        Kproxy,
        Some("syncPeriod"),
        "ebpf mode: full resync at least this often (default 30s).",
    )
    .sets(Duration(|c| &mut c.sync_period)),
    f(
        "min-sync-period",
        Value("DURATION"),
        Implemented,
        Kproxy,
        Some("minSyncPeriod"),
        "ebpf mode: minimum interval between syncs (default 1s).",
    )
    .sets(Duration(|c| &mut c.min_sync_period)),
    f(
        "service-cidrs",
        Value("CIDR,..."),
        Implemented,
        Kproxy,
        Some("serviceCIDRs"),
        "nftables mode: the cluster's service CIDRs, whose unallocated addresses are dropped, while the API server serves no networking.k8s.io/v1 ServiceCIDRs (those win when it does).",
    )
    .sets(List(|c| &mut c.service_cidrs)),
    f(
        "bpf-cgroup",
        Value("PATH"),
        Implemented,
        Kproxy,
        Some("bpf.cgroup"),
        "cgroup v2 directory for socket load balancing (default: the cgroup2 mount root).",
    )
    .sets(Str(|c| &mut c.bpf.cgroup)),
    f(
        "bpffs",
        Value("PATH"),
        Implemented,
        Kproxy,
        Some("bpf.bpffs"),
        "bpffs mount; maps are pinned under PATH/kproxy (default /sys/fs/bpf).",
    )
    .sets(Str(|c| &mut c.bpf.bpffs)),
    f(
        "bpf-devices",
        Value("IFACE,..."),
        Implemented,
        Kproxy,
        Some("bpf.devices"),
        "Devices for the TC/XDP programs (default: detected).",
    )
    .sets(List(|c| &mut c.bpf.devices)),
    f(
        "bpf-map-sizes",
        Value("MAP=N,..."),
        Implemented,
        Kproxy,
        Some("bpf.mapSizes"),
        "BPF map size overrides (services, backendSlots, backends, ct, revNat, affinity, sourceRanges, maglev = number of Maglev tables).",
    )
    .sets(Custom(super::set_bpf_map_sizes)),
    f(
        "bpf-xdp",
        Value("MODE"),
        Implemented,
        Kproxy,
        Some("bpf.xdp"),
        "off, best-effort (default) or native.",
    )
    .sets(Str(|c| &mut c.bpf.xdp)),
    f(
        "bpf-lb-algorithm",
        Value("ALG"),
        Implemented,
        Kproxy,
        Some("bpf.lbAlgorithm"),
        "random (default) or maglev (TC path: Maglev consistent hashing for traffic from outside the node).",
    )
    .sets(Str(|c| &mut c.bpf.lb_algorithm)),
    f(
        "bpf-lb-maglev-table-size",
        Value("M"),
        Implemented,
        Kproxy,
        Some("bpf.maglevTableSize"),
        "Maglev lookup table size per service, a prime in [251, 131071] (default 16381; use M > 100 × backends).",
    )
    .sets(Custom(super::set_maglev_table_size)),
    f(
        "output",
        Value("FORMAT"),
        Implemented,
        Kproxy,
        None,
        "render only: json (default) or table.",
    ),
    f(
        "service",
        Value("NAMESPACE/NAME"),
        Implemented,
        Kproxy,
        None,
        "inspect only: report only this service's ports.",
    ),
];

/// The spec of `name` (dashes).
pub fn lookup(name: &str) -> Option<&'static FlagSpec> {
    FLAGS.iter().find(|f| f.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_normalized() {
        let mut seen = std::collections::BTreeSet::new();
        for f in FLAGS {
            assert!(seen.insert(f.name), "duplicate flag {}", f.name);
            assert!(!f.name.contains('_'), "{} must use dashes", f.name);
        }
    }
}
