//! The `KubeProxyConfiguration` file (`kubeproxy.config.k8s.io/v1alpha1`), as written.
//!
//! Every field of upstream's v1alpha1 type is here with its YAML name; every field is optional
//! so a file may hold any subset. Decoding is strict: an unknown field, or a value of the wrong
//! type, fails with the field's path (`iptables.masqueradeBit: invalid type: …`).
//!
//! [`KubeProxyConfiguration::apply_defaults`] fills what is unset the way upstream's
//! `SetDefaults_KubeProxyConfiguration` does — including its quirk that a zero sync period or
//! zero `configSyncPeriod` in a file means "default" (a zero set by a flag stays zero, since
//! flags are applied after defaulting, as upstream does). The defaulted struct is what
//! `--write-config-to` writes. Because of that quirk, a written config whose zero period or
//! empty `healthzBindAddress`/`metricsBindAddress` came from a flag reads back with the
//! defaults — upstream's files behave the same.
//!
//! kproxy extensions (not in upstream's v1alpha1; user guide: docs/src/configuration.md):
//! - top-level `syncPeriod` / `minSyncPeriod` (as upstream's v1alpha2 has them): the ebpf mode's
//!   sync periods, default 30s / 1s;
//! - `bpf:` — the eBPF datapath's settings ([`Bpf`]);
//! - top-level `serviceCIDRs` (`--service-cidrs`): the cluster's service CIDRs for the nftables
//!   mode's "drop traffic to unallocated ClusterIPs" rule when the API server serves no
//!   `ServiceCIDR` objects (upstream has no such setting: it only watches ServiceCIDRs).
//!
//! Divergence: upstream falls back to lenient decoding (ignoring unknown fields with a log
//! line) when strict decoding of a v1alpha1 file fails. kproxy rejects unknown fields, except
//! the two fields upstream removed from v1alpha1 that old generated configs still carry
//! (`udpIdleTimeout`, `resourceContainer`), which are accepted with a warning.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::duration::GoDuration;

pub(crate) const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub(crate) const KIND: &str = "KubeProxyConfiguration";

/// Upstream defaults (pkg/proxy/apis/config/v1alpha1/defaults.go and the type docs).
pub(crate) mod defaults {
    pub(crate) const BIND_ADDRESS: &str = "0.0.0.0";
    pub(crate) const HEALTHZ_PORT: u16 = 10256;
    pub(crate) const METRICS_PORT: u16 = 10249;
    pub(crate) const OOM_SCORE_ADJ: i32 = -999;
    pub(crate) const MASQUERADE_BIT: i32 = 14;
    pub(crate) const LOCALHOST_NODE_PORTS: bool = true;
    pub(crate) const SYNC_PERIOD_SECS: i64 = 30;
    pub(crate) const MIN_SYNC_PERIOD_SECS: i64 = 1;
    pub(crate) const CONNTRACK_MAX_PER_CORE: i32 = 32 * 1024;
    pub(crate) const CONNTRACK_MIN: i32 = 128 * 1024;
    pub(crate) const CONNTRACK_TCP_ESTABLISHED_SECS: i64 = 24 * 3600;
    pub(crate) const CONNTRACK_TCP_CLOSE_WAIT_SECS: i64 = 3600;
    pub(crate) const CONFIG_SYNC_PERIOD_SECS: i64 = 15 * 60;
    pub(crate) const CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";
    pub(crate) const QPS: f32 = 5.0;
    pub(crate) const BURST: i32 = 10;
    pub(crate) const DETECT_LOCAL_MODE: &str = "ClusterCIDR";
    pub(crate) const LOGGING_FORMAT: &str = "text";
    pub(crate) const LOG_FLUSH_FREQUENCY_SECS: i64 = 5;
    /// kproxy extension: bpffs mount.
    pub(crate) const BPFFS: &str = "/sys/fs/bpf";
    /// kproxy extension: XDP attachment.
    pub(crate) const BPF_XDP: &str = "best-effort";
    /// kproxy extension: backend selection.
    pub(crate) const BPF_LB_ALGORITHM: &str = "random";
    /// kproxy extension: Maglev table size (Cilium's default).
    pub(crate) const BPF_MAGLEV_TABLE_SIZE: u32 = kproxy_common::maglev::DEFAULT_TABLE_SIZE;
    /// kproxy extension: eBPF connection table, fully closed TCP flows (the kernel's
    /// `nf_conntrack_tcp_timeout_time_wait` default).
    pub(crate) const BPF_CT_TCP_TIME_WAIT_SECS: i64 =
        kproxy_common::ct::DEFAULT_CT_TCP_TIME_WAIT_SECS as i64;
    /// kproxy extension: eBPF connection table, reset TCP flows (the kernel's
    /// `nf_conntrack_tcp_timeout_close` default).
    pub(crate) const BPF_CT_TCP_CLOSE_SECS: i64 =
        kproxy_common::ct::DEFAULT_CT_TCP_CLOSE_SECS as i64;
    /// kproxy extension: period of the eBPF connection table's expiry.
    pub(crate) const BPF_CT_EXPIRY_INTERVAL_SECS: i64 =
        kproxy_common::ct::DEFAULT_CT_EXPIRY_INTERVAL_SECS as i64;
}

/// `KubeProxyConfiguration` v1alpha1 (+ kproxy's extensions), every field optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub feature_gates: Option<BTreeMap<String, bool>>,
    #[serde(default)]
    pub client_connection: ClientConnection,
    #[serde(default)]
    pub logging: Logging,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostname_override: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bind_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub healthz_bind_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_bind_address: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bind_address_hard_fail: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_profiling: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show_hidden_metrics_for_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(default)]
    pub iptables: Iptables,
    #[serde(default)]
    pub ipvs: Ipvs,
    #[serde(default)]
    pub nftables: Nftables,
    #[serde(default)]
    pub winkernel: Winkernel,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detect_local_mode: Option<String>,
    #[serde(default)]
    pub detect_local: DetectLocal,
    #[serde(rename = "clusterCIDR", skip_serializing_if = "Option::is_none")]
    pub cluster_cidr: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_port_addresses: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oom_score_adj: Option<i32>,
    #[serde(default)]
    pub conntrack: Conntrack,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_range: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub windows_run_as_service: Option<bool>,
    /// kproxy extension: the ebpf mode's `syncPeriod` (upstream v1alpha2 has it top-level).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    /// kproxy extension: the ebpf mode's `minSyncPeriod`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
    /// kproxy extension: the eBPF datapath's settings.
    #[serde(default)]
    pub bpf: Bpf,
    /// kproxy extension: the service CIDRs when the API server serves no ServiceCIDRs.
    #[serde(rename = "serviceCIDRs", skip_serializing_if = "Option::is_none")]
    pub service_cidrs: Option<Vec<String>>,
    /// Removed upstream (old generated configs still carry it): accepted, ignored, warned.
    #[serde(default, skip_serializing)]
    pub udp_idle_timeout: Option<serde_yaml::Value>,
    /// Removed upstream: accepted, ignored, warned.
    #[serde(default, skip_serializing)]
    pub resource_container: Option<serde_yaml::Value>,
}

/// `clientConnection` (component-base `ClientConnectionConfiguration`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ClientConnection {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accept_content_types: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qps: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<i32>,
}

/// `logging` (component-base `LoggingConfiguration`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Logging {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Nanoseconds as a number, or duration text (upstream's `TimeOrMetaDuration`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flush_frequency: Option<FlushFrequency>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vmodule: Option<Vec<VModuleItem>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub options: Option<LoggingOptions>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct VModuleItem {
    #[serde(default)]
    pub file_pattern: String,
    #[serde(default)]
    pub verbosity: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LoggingOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<FormatOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json: Option<FormatOptions>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FormatOptions {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub split_stream: Option<bool>,
    /// A Kubernetes quantity (`"0"`, `"64Ki"`); kept as written.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub info_buffer_size: Option<serde_yaml::Value>,
}

/// `logging.flushFrequency`: integer nanoseconds or duration text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushFrequency(pub GoDuration);

impl Serialize for FlushFrequency {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for FlushFrequency {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Nanos(i64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Nanos(n) => Ok(FlushFrequency(GoDuration(n))),
            Raw::Text(t) => GoDuration::parse(&t)
                .map(FlushFrequency)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// `iptables`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Iptables {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_bit: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub localhost_node_ports: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
}

/// `ipvs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Ipvs {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs", skip_serializing_if = "Option::is_none")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP", skip_serializing_if = "Option::is_none")]
    pub strict_arp: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_fin_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<GoDuration>,
}

/// `nftables`: the nftables mode's settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Nftables {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_bit: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub masquerade_all: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_period: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_sync_period: Option<GoDuration>,
}

/// `winkernel` (Windows only; accepted and ignored).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Winkernel {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_vip: Option<String>,
    #[serde(rename = "enableDSR", skip_serializing_if = "Option::is_none")]
    pub enable_dsr: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root_hns_endpoint_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_health_check_vip: Option<bool>,
}

/// `detectLocal`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DetectLocal {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge_interface: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interface_name_prefix: Option<String>,
}

/// `conntrack`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Conntrack {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_per_core: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_established_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_close_wait_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_be_liberal: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_timeout: Option<GoDuration>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub udp_stream_timeout: Option<GoDuration>,
}

/// kproxy extension `bpf:` — the eBPF datapath's settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Bpf {
    /// cgroup v2 directory the socket-LB programs attach to (default: the cgroup2 mount root).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// bpffs mount under which kproxy pins its maps (`<bpffs>/kproxy/`), default /sys/fs/bpf.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bpffs: Option<String>,
    /// Devices for the TC/XDP programs (default: detected, see the ebpf datapath).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<String>>,
    /// Map size overrides by map name (see `config::BPF_MAP_NAMES`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub map_sizes: Option<BTreeMap<String, u32>>,
    /// `off`, `best-effort` (default) or `native`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xdp: Option<String>,
    /// `random` (default) or `maglev`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lb_algorithm: Option<String>,
    /// Maglev table size per service (a prime, default 16381).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_table_size: Option<u32>,
    /// Expiry of the eBPF connection table beyond upstream's `conntrack` settings.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<BpfConntrack>,
}

/// kproxy extension `bpf.conntrack:` — timeouts the kernel's conntrack has and upstream does
/// not set (kube-proxy leaves them at the kernel's defaults), for the eBPF datapath's own
/// connection table. Established and half-closed TCP and UDP follow upstream's `conntrack:`
/// fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BpfConntrack {
    /// TCP flows closed by a FIN in both directions (kernel TIME_WAIT), default 2m.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_time_wait_timeout: Option<GoDuration>,
    /// TCP flows closed by a RST (kernel CLOSE), default 10s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_close_timeout: Option<GoDuration>,
    /// How often idle and closed flows are expired, default 15s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expiry_interval: Option<GoDuration>,
}

/// Reading or decoding a config file failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read config file {file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// `path` is the field (`iptables.masqueradeBit`); empty for the document itself.
    #[error("config file {file}: {}{reason}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
    Decode {
        file: String,
        path: String,
        reason: String,
    },
}

impl KubeProxyConfiguration {
    /// Decodes YAML text strictly. `file` names the source in errors.
    pub(crate) fn from_yaml(text: &str, file: &str) -> Result<Self, LoadError> {
        let decode = |path: String, reason: String| LoadError::Decode {
            file: file.to_owned(),
            path,
            reason,
        };
        let de = serde_yaml::Deserializer::from_str(text);
        let cfg: KubeProxyConfiguration = match serde_path_to_error::deserialize(de) {
            Ok(c) => c,
            Err(e) => {
                let path = e.path().to_string();
                let path = if path == "." { String::new() } else { path };
                // serde_yaml prefixes part of the path itself ("iptables: invalid …").
                let msg = e.into_inner().to_string();
                let msg = match msg.split_once(": ") {
                    Some((pre, rest)) if !pre.contains(' ') && path.starts_with(pre) => {
                        rest.to_owned()
                    }
                    _ => msg,
                };
                return Err(decode(path, msg));
            }
        };
        match cfg.api_version.as_deref() {
            Some(API_VERSION) => {}
            None => {
                return Err(decode(
                    "apiVersion".into(),
                    format!("missing (expected {API_VERSION:?})"),
                ));
            }
            Some(other) => {
                return Err(decode(
                    "apiVersion".into(),
                    format!("{other:?} is not supported: kproxy reads {API_VERSION}"),
                ));
            }
        }
        match cfg.kind.as_deref() {
            Some(KIND) => {}
            None => {
                return Err(decode(
                    "kind".into(),
                    format!("missing (expected {KIND:?})"),
                ));
            }
            Some(other) => {
                return Err(decode("kind".into(), format!("{other:?} is not {KIND:?}")));
            }
        }
        Ok(cfg)
    }

    /// Reads and decodes a config file.
    pub(crate) fn load(path: &std::path::Path) -> Result<Self, LoadError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            file: file.clone(),
            source,
        })?;
        Self::from_yaml(&text, &file)
    }

    /// The YAML `--write-config-to` writes.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# cannot encode config: {e}\n"))
    }

    /// Fills unset fields with upstream's defaults (plus kproxy's extension defaults).
    /// Zero durations count as unset where upstream's defaulting treats them so.
    pub(crate) fn apply_defaults(&mut self) {
        use defaults::*;
        let secs = GoDuration::from_secs;
        fn set_if_zero(d: &mut Option<GoDuration>, v: GoDuration) {
            if d.is_none_or(GoDuration::is_zero) {
                *d = Some(v);
            }
        }
        fn set_if_empty(s: &mut Option<String>, v: &str) {
            if s.as_deref().is_none_or(str::is_empty) {
                *s = Some(v.to_owned());
            }
        }
        self.api_version = Some(API_VERSION.into());
        self.kind = Some(KIND.into());
        self.feature_gates.get_or_insert_with(BTreeMap::new);

        let cc = &mut self.client_connection;
        cc.kubeconfig.get_or_insert_with(String::new);
        cc.accept_content_types.get_or_insert_with(String::new);
        set_if_empty(&mut cc.content_type, CONTENT_TYPE);
        if cc.qps.is_none_or(|q| q == 0.0) {
            cc.qps = Some(QPS);
        }
        if cc.burst.is_none_or(|b| b == 0) {
            cc.burst = Some(BURST);
        }

        let lg = &mut self.logging;
        set_if_empty(&mut lg.format, LOGGING_FORMAT);
        if lg.flush_frequency.is_none_or(|f| f.0.is_zero()) {
            lg.flush_frequency = Some(FlushFrequency(secs(LOG_FLUSH_FREQUENCY_SECS)));
        }
        lg.verbosity.get_or_insert(0);

        self.hostname_override.get_or_insert_with(String::new);
        set_if_empty(&mut self.bind_address, BIND_ADDRESS);
        let v6 = self
            .bind_address
            .as_deref()
            .and_then(|a| a.parse::<std::net::IpAddr>().ok())
            .is_some_and(|ip| ip.is_ipv6());
        let (healthz_host, metrics_host) = if v6 {
            ("[::]", "[::1]")
        } else {
            ("0.0.0.0", "127.0.0.1")
        };
        default_host_port(&mut self.healthz_bind_address, healthz_host, HEALTHZ_PORT);
        default_host_port(&mut self.metrics_bind_address, metrics_host, METRICS_PORT);
        self.bind_address_hard_fail.get_or_insert(false);
        self.enable_profiling.get_or_insert(false);
        self.show_hidden_metrics_for_version
            .get_or_insert_with(String::new);
        self.mode.get_or_insert_with(String::new);

        let ipt = &mut self.iptables;
        ipt.masquerade_bit.get_or_insert(MASQUERADE_BIT);
        ipt.masquerade_all.get_or_insert(false);
        ipt.localhost_node_ports.get_or_insert(LOCALHOST_NODE_PORTS);
        set_if_zero(&mut ipt.sync_period, secs(SYNC_PERIOD_SECS));
        set_if_zero(&mut ipt.min_sync_period, secs(MIN_SYNC_PERIOD_SECS));

        let ipvs = &mut self.ipvs;
        set_if_zero(&mut ipvs.sync_period, secs(SYNC_PERIOD_SECS));
        set_if_zero(&mut ipvs.min_sync_period, secs(MIN_SYNC_PERIOD_SECS));
        ipvs.scheduler.get_or_insert_with(String::new);
        ipvs.strict_arp.get_or_insert(false);
        ipvs.tcp_timeout.get_or_insert(GoDuration::ZERO);
        ipvs.tcp_fin_timeout.get_or_insert(GoDuration::ZERO);
        ipvs.udp_timeout.get_or_insert(GoDuration::ZERO);

        let nft = &mut self.nftables;
        nft.masquerade_bit.get_or_insert(MASQUERADE_BIT);
        nft.masquerade_all.get_or_insert(false);
        set_if_zero(&mut nft.sync_period, secs(SYNC_PERIOD_SECS));
        set_if_zero(&mut nft.min_sync_period, secs(MIN_SYNC_PERIOD_SECS));

        let wk = &mut self.winkernel;
        wk.network_name.get_or_insert_with(String::new);
        wk.source_vip.get_or_insert_with(String::new);
        wk.enable_dsr.get_or_insert(false);
        wk.root_hns_endpoint_name.get_or_insert_with(String::new);
        wk.forward_health_check_vip.get_or_insert(false);

        set_if_empty(&mut self.detect_local_mode, DETECT_LOCAL_MODE);
        self.detect_local
            .bridge_interface
            .get_or_insert_with(String::new);
        self.detect_local
            .interface_name_prefix
            .get_or_insert_with(String::new);
        self.cluster_cidr.get_or_insert_with(String::new);
        self.oom_score_adj.get_or_insert(OOM_SCORE_ADJ);

        let ct = &mut self.conntrack;
        ct.max_per_core.get_or_insert(CONNTRACK_MAX_PER_CORE);
        ct.min.get_or_insert(CONNTRACK_MIN);
        ct.tcp_established_timeout
            .get_or_insert(secs(CONNTRACK_TCP_ESTABLISHED_SECS));
        ct.tcp_close_wait_timeout
            .get_or_insert(secs(CONNTRACK_TCP_CLOSE_WAIT_SECS));
        ct.tcp_be_liberal.get_or_insert(false);
        ct.udp_timeout.get_or_insert(GoDuration::ZERO);
        ct.udp_stream_timeout.get_or_insert(GoDuration::ZERO);

        set_if_zero(&mut self.config_sync_period, secs(CONFIG_SYNC_PERIOD_SECS));
        self.port_range.get_or_insert_with(String::new);
        self.windows_run_as_service.get_or_insert(false);

        set_if_zero(&mut self.sync_period, secs(SYNC_PERIOD_SECS));
        set_if_zero(&mut self.min_sync_period, secs(MIN_SYNC_PERIOD_SECS));
        let bpf = &mut self.bpf;
        bpf.cgroup.get_or_insert_with(String::new);
        set_if_empty(&mut bpf.bpffs, BPFFS);
        bpf.devices.get_or_insert_with(Vec::new);
        bpf.map_sizes.get_or_insert_with(BTreeMap::new);
        set_if_empty(&mut bpf.xdp, BPF_XDP);
        set_if_empty(&mut bpf.lb_algorithm, BPF_LB_ALGORITHM);
        bpf.maglev_table_size.get_or_insert(BPF_MAGLEV_TABLE_SIZE);
        let bct = bpf.conntrack.get_or_insert_with(BpfConntrack::default);
        bct.tcp_time_wait_timeout
            .get_or_insert(secs(BPF_CT_TCP_TIME_WAIT_SECS));
        bct.tcp_close_timeout
            .get_or_insert(secs(BPF_CT_TCP_CLOSE_SECS));
        bct.expiry_interval
            .get_or_insert(secs(BPF_CT_EXPIRY_INTERVAL_SECS));
    }
}

/// Empty ⇒ `host:port`; an address without a port gets `:port` (upstream's
/// `AppendPortIfNeeded`: only when the text is a bare IP).
pub(crate) fn default_host_port(addr: &mut Option<String>, host: &str, port: u16) {
    match addr.as_deref() {
        None | Some("") => *addr = Some(format!("{host}:{port}")),
        Some(a) => *addr = Some(append_port_if_needed(a, port)),
    }
}

/// Upstream's `AppendPortIfNeeded`: `1.2.3.4` ⇒ `1.2.3.4:port`, `::1` ⇒ `[::1]:port`; anything
/// else (already host:port, or not an IP) is returned unchanged for validation to judge.
pub(crate) fn append_port_if_needed(addr: &str, port: u16) -> String {
    match addr.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) => format!("{ip}:{port}"),
        Ok(std::net::IpAddr::V6(ip)) => format!("[{ip}]:{port}"),
        Err(_) => addr.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: &str =
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    #[test]
    fn unknown_field_names_its_path() {
        let err = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}iptables:\n  syncPeriodd: 5s\n"),
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("iptables"), "{err}");
        assert!(err.contains("syncPeriodd"), "{err}");
        let err = KubeProxyConfiguration::from_yaml(&format!("{HEAD}bogus: 1\n"), "f")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `bogus`"), "{err}");
    }

    #[test]
    fn wrong_type_names_its_path() {
        let err = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}iptables:\n  masqueradeBit: x\n"),
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("iptables.masqueradeBit:"), "{err}");
        let err = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}conntrack:\n  udpTimeout: 5q\n"),
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("conntrack.udpTimeout:"), "{err}");
        assert!(err.contains("invalid duration"), "{err}");
    }

    #[test]
    fn api_version_and_kind_are_checked() {
        let err = KubeProxyConfiguration::from_yaml("kind: KubeProxyConfiguration\n", "f")
            .unwrap_err()
            .to_string();
        assert!(err.contains("apiVersion: missing"), "{err}");
        let err = KubeProxyConfiguration::from_yaml(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha2\nkind: KubeProxyConfiguration\n",
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("apiVersion: \"kubeproxy.config.k8s.io/v1alpha2\" is not supported"),
            "{err}"
        );
        let err = KubeProxyConfiguration::from_yaml(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
            "f",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("kind:"), "{err}");
    }

    #[test]
    fn flush_frequency_takes_nanos_or_text() {
        let c = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}logging:\n  flushFrequency: 2000000000\n"),
            "f",
        )
        .unwrap();
        assert_eq!(
            c.logging.flush_frequency,
            Some(FlushFrequency(GoDuration::from_secs(2)))
        );
        let c = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}logging:\n  flushFrequency: 3s\n"),
            "f",
        )
        .unwrap();
        assert_eq!(
            c.logging.flush_frequency,
            Some(FlushFrequency(GoDuration::from_secs(3)))
        );
    }

    #[test]
    fn zero_periods_in_a_file_mean_default_but_pointer_fields_keep_zero() {
        let mut c = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}iptables:\n  minSyncPeriod: 0s\nconntrack:\n  tcpEstablishedTimeout: 0s\n  maxPerCore: 0\n"),
            "f",
        )
        .unwrap();
        c.apply_defaults();
        assert_eq!(c.iptables.min_sync_period, Some(GoDuration::from_secs(1)));
        assert_eq!(c.conntrack.tcp_established_timeout, Some(GoDuration::ZERO));
        assert_eq!(c.conntrack.max_per_core, Some(0));
    }

    #[test]
    fn bind_address_family_picks_default_listen_addresses() {
        let mut c = KubeProxyConfiguration::from_yaml(&format!("{HEAD}bindAddress: \"::\"\n"), "f")
            .unwrap();
        c.apply_defaults();
        assert_eq!(c.healthz_bind_address.as_deref(), Some("[::]:10256"));
        assert_eq!(c.metrics_bind_address.as_deref(), Some("[::1]:10249"));
        let mut c = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}healthzBindAddress: 10.0.0.1\n"),
            "f",
        )
        .unwrap();
        c.apply_defaults();
        assert_eq!(c.healthz_bind_address.as_deref(), Some("10.0.0.1:10256"));
    }

    #[test]
    fn removed_fields_are_accepted() {
        let c = KubeProxyConfiguration::from_yaml(
            &format!("{HEAD}udpIdleTimeout: 250ms\nresourceContainer: /kube-proxy\n"),
            "f",
        )
        .unwrap();
        assert!(c.udp_idle_timeout.is_some());
        assert!(!c.to_yaml().contains("udpIdleTimeout"));
    }
}
