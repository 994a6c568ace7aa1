//! Validation (upstream's `pkg/proxy/apis/config/validation` rules) and conversion of a
//! defaulted [`KubeProxyConfiguration`] into the typed [`ProxyConfig`].
//!
//! Validation and conversion are one pass: each field is parsed once; a bad value records a
//! [`FieldError`] naming the field (and the flag that set it) and the pass goes on, so every
//! problem is reported at once. Rules (upstream's unless noted):
//! - periods: `syncPeriod` > 0, `minSyncPeriod` ≥ 0, `minSyncPeriod` ≤ `syncPeriod` — for
//!   `iptables`, `ipvs`, `nftables` and kproxy's top-level pair; `configSyncPeriod` > 0;
//! - `masqueradeBit` in [0, 31] (iptables and nftables); `oomScoreAdj` in [-1000, 1000];
//! - `bindAddress` an IP; `healthzBindAddress` / `metricsBindAddress` `IP:port`, port 1..65535;
//! - `clusterCIDR`: one CIDR, or a dual-stack pair; `ipvs.excludeCIDRs` CIDRs;
//! - `nodePortAddresses`: CIDRs, or `primary` alone (plus the `localhost`/`all` keywords);
//! - `detectLocalMode` one of ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix, with
//!   a non-empty interface for the latter two;
//! - conntrack values and IPVS timeouts ≥ 0; `clientConnection.burst` ≥ 0;
//!   `ipvs.scheduler` a known scheduler; `portRange` empty or a port range;
//!   `logging.format` `text` or `json`;
//! - `mode` "", ebpf, nftables, ipvs or iptables (kproxy; see [`super`]);
//! - kproxy's `bpf:` values (absolute paths, known map names, xdp / lbAlgorithm values, a
//!   prime maglevTableSize).
//!
//! Fields kproxy accepts but does not act on produce warnings (not errors) when they differ
//! from their defaults.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use ipnet::IpNet;

use super::LogFormat;
use super::duration::GoDuration;
use super::file::{KubeProxyConfiguration, defaults};
use super::*;

/// One invalid field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field's path in the file (`iptables.minSyncPeriod`).
    pub path: String,
    /// The flag that set it, when a flag did (`--iptables-min-sync-period`).
    pub flag: Option<String>,
    pub reason: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.flag {
            Some(flag) => write!(f, "{} ({flag}): {}", self.path, self.reason),
            None => write!(f, "{}: {}", self.path, self.reason),
        }
    }
}

/// Every invalid field of a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<FieldError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid configuration:")?;
        for e in &self.0 {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

/// Inputs that are not part of the v1alpha1 file.
#[derive(Debug, Clone, Default)]
pub struct Extra {
    /// `--master`.
    pub master: Option<String>,
    /// `--manifests`.
    pub manifests: Option<PathBuf>,
    /// Field path → the flag that set it (for error messages).
    pub flag_of: BTreeMap<String, String>,
    /// The machine's hostname (None ⇒ read it from the kernel). Tests set it.
    pub hostname: Option<String>,
}

/// A resolved configuration and the warnings about accepted-but-ignored settings.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub config: ProxyConfig,
    pub warnings: Vec<String>,
}

struct Ctx<'a> {
    errors: Vec<FieldError>,
    warnings: Vec<String>,
    flag_of: &'a BTreeMap<String, String>,
}

impl Ctx<'_> {
    /// The flag that set `path` or the field it is part of (`nodePortAddresses[1]` ⇒
    /// `nodePortAddresses`).
    fn flag_for(&self, path: &str) -> Option<String> {
        let mut p = path;
        loop {
            if let Some(f) = self.flag_of.get(p) {
                return Some(f.clone());
            }
            p = &p[..p.rfind(['.', '['])?];
        }
    }

    fn err(&mut self, path: &str, reason: impl Into<String>) {
        self.errors.push(FieldError {
            path: path.to_owned(),
            flag: self.flag_for(path),
            reason: reason.into(),
        });
    }

    /// A field kproxy does not act on differs from its default. Set by a flag, the flag's own
    /// warning already said so.
    fn ignored(&mut self, path: &str, what: impl fmt::Display) {
        if self.flag_for(path).is_some() {
            return;
        }
        self.warnings.push(format!(
            "config field {path} = {what} is accepted but not implemented by kproxy; ignored"
        ));
    }

    fn periods(
        &mut self,
        section: &str,
        sync: Option<GoDuration>,
        min: Option<GoDuration>,
    ) -> SyncPeriods {
        let sync = sync.unwrap_or(GoDuration::from_secs(defaults::SYNC_PERIOD_SECS));
        let min = min.unwrap_or(GoDuration::from_secs(defaults::MIN_SYNC_PERIOD_SECS));
        let p = |f: &str| {
            if section.is_empty() {
                f.to_owned()
            } else {
                format!("{section}.{f}")
            }
        };
        if sync.0 <= 0 {
            self.err(&p("syncPeriod"), format!("must be > 0 (got {sync})"));
        }
        if min.is_negative() {
            self.err(&p("minSyncPeriod"), format!("must be >= 0 (got {min})"));
        }
        if sync.0 > 0 && min.0 > sync.0 {
            self.err(
                &p("syncPeriod"),
                format!("must be >= {} ({sync} < {min})", p("minSyncPeriod")),
            );
        }
        SyncPeriods {
            sync_period: sync.to_std(),
            min_sync_period: min.to_std(),
        }
    }

    fn non_negative(&mut self, path: &str, d: Option<GoDuration>) -> std::time::Duration {
        let d = d.unwrap_or_default();
        if d.is_negative() {
            self.err(path, format!("must be >= 0 (got {d})"));
        }
        d.to_std()
    }

    fn masquerade_bit(&mut self, path: &str, bit: Option<i32>) -> u8 {
        let bit = bit.unwrap_or(defaults::MASQUERADE_BIT);
        match u8::try_from(bit) {
            Ok(b) if b <= 31 => b,
            _ => {
                self.err(
                    path,
                    format!("must be within the range [0, 31] (got {bit})"),
                );
                defaults::MASQUERADE_BIT as u8
            }
        }
    }

    fn host_port(&mut self, path: &str, addr: Option<&str>) -> Option<SocketAddr> {
        let addr = addr.unwrap_or_default();
        if addr.is_empty() {
            return None;
        }
        if let Ok(sa) = addr.parse::<SocketAddr>() {
            if sa.port() == 0 {
                self.err(path, format!("{addr:?}: must be a valid port (1-65535)"));
            }
            return Some(sa);
        }
        // Say which half is wrong, like upstream's validateHostPort.
        let Some((host, port)) = addr.rsplit_once(':') else {
            self.err(path, format!("{addr:?}: must be IP:port"));
            return None;
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.parse::<IpAddr>().is_err() {
            self.err(path, format!("{addr:?}: {host:?} must be a valid IP"));
        }
        if !port.parse::<u16>().is_ok_and(|p| p > 0) {
            self.err(
                path,
                format!("{addr:?}: {port:?} must be a valid port (1-65535)"),
            );
        }
        None
    }

    fn cidr(&mut self, path: &str, text: &str) -> Option<IpNet> {
        match text.trim().parse::<IpNet>() {
            Ok(n) => Some(n),
            Err(_) => {
                self.err(
                    path,
                    format!(
                        "{text:?} must be a valid CIDR (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)"
                    ),
                );
                None
            }
        }
    }
}

/// Validates `cfg` (defaulted, flags applied) and converts it.
///
/// Each section has its own validator (upstream's `validateKubeProxyIPTablesConfiguration`,
/// `…IPVSConfiguration`, `…ConntrackConfiguration`, `validateKubeProxyNodePortAddress`, …);
/// each records its errors, naming the field, in `cx`. They run in the order the fields are
/// reported.
pub(crate) fn resolve(
    cfg: &KubeProxyConfiguration,
    extra: &Extra,
) -> Result<Resolved, ConfigErrors> {
    let mut cx = Ctx {
        errors: Vec::new(),
        warnings: Vec::new(),
        flag_of: &extra.flag_of,
    };

    let mode = resolve_mode(&mut cx, cfg.mode.as_deref().unwrap_or_default());
    let node_name = resolve_node_name(&mut cx, cfg, extra);
    let source = resolve_source(cfg, extra);
    let client = resolve_client(&mut cx, &cfg.client_connection);
    let addrs = resolve_addresses(&mut cx, cfg);
    let cluster_cidrs = resolve_cluster_cidrs(&mut cx, cfg);
    let detect_local = resolve_detect_local(&mut cx, cfg);
    let node_port_addresses =
        resolve_node_port_addresses(&mut cx, cfg.node_port_addresses.as_deref());
    let service_cidrs = resolve_service_cidrs(&mut cx, cfg.service_cidrs.as_deref());
    let masquerade_bit = cx.masquerade_bit("iptables.masqueradeBit", cfg.iptables.masquerade_bit);
    let masquerade_all = cfg.iptables.masquerade_all.unwrap_or(false);
    let iptables = resolve_iptables(&mut cx, &cfg.iptables);
    let nftables = resolve_nftables(&mut cx, &cfg.nftables, masquerade_all);
    let ipvs = resolve_ipvs(&mut cx, &cfg.ipvs);
    let ebpf_sync = cx.periods("", cfg.sync_period, cfg.min_sync_period);
    let bpf = resolve_bpf(&mut cx, &cfg.bpf);
    let conntrack = resolve_conntrack(&mut cx, &cfg.conntrack);
    let oom_score_adj = resolve_oom_score_adj(&mut cx, cfg);
    let config_sync_period = resolve_config_sync_period(&mut cx, cfg);
    validate_port_range(&mut cx, cfg);
    let logging = resolve_logging(&mut cx, &cfg.logging);
    let feature_gates = resolve_feature_gates(&mut cx, cfg);
    warn_windows_and_removed(&mut cx, cfg);

    if !cx.errors.is_empty() {
        return Err(ConfigErrors(cx.errors));
    }
    Ok(Resolved {
        config: ProxyConfig {
            mode,
            node_name,
            source,
            client,
            bind_address: addrs.bind_address,
            healthz_bind_address: addrs.healthz_bind_address,
            metrics_bind_address: addrs.metrics_bind_address,
            bind_address_hard_fail: addrs.bind_address_hard_fail,
            enable_profiling: addrs.enable_profiling,
            cluster_cidrs,
            detect_local,
            node_port_addresses,
            primary_node_ips: vec![],
            service_cidrs,
            masquerade_all,
            masquerade_bit,
            iptables,
            ipvs,
            nftables,
            ebpf_sync,
            bpf,
            conntrack,
            oom_score_adj,
            config_sync_period,
            logging,
            feature_gates,
        },
        warnings: cx.warnings,
    })
}

/// `hostnameOverride`, else the machine's hostname, lowercased; empty is an error.
fn resolve_node_name(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration, extra: &Extra) -> String {
    match cfg.hostname_override.as_deref().map(str::trim) {
        Some(h) if !h.is_empty() => h.to_lowercase(),
        _ => {
            let h = extra
                .hostname
                .clone()
                .or_else(system_hostname)
                .unwrap_or_default();
            let h = h.trim().to_lowercase();
            if h.is_empty() {
                cx.err(
                    "hostnameOverride",
                    "empty, and the machine's hostname is unknown",
                );
            }
            h
        }
    }
}

/// Where Services come from: `--manifests`, else the API server (`--master`, kubeconfig).
fn resolve_source(cfg: &KubeProxyConfiguration, extra: &Extra) -> SourceConfig {
    let kubeconfig = cfg
        .client_connection
        .kubeconfig
        .as_deref()
        .filter(|k| !k.is_empty())
        .map(PathBuf::from);
    match &extra.manifests {
        Some(p) => SourceConfig::Manifests(p.clone()),
        None => SourceConfig::Kube {
            kubeconfig,
            master: extra.master.clone().filter(|m| !m.is_empty()),
        },
    }
}

/// `clientConnection`: `burst` ≥ 0; the rest accepted but ignored.
fn resolve_client(cx: &mut Ctx<'_>, cc: &super::file::ClientConnection) -> ClientConfig {
    let burst = cc.burst.unwrap_or(defaults::BURST);
    if burst < 0 {
        cx.err(
            "clientConnection.burst",
            format!("must be >= 0 (got {burst})"),
        );
    }
    let client = ClientConfig {
        content_type: cc
            .content_type
            .clone()
            .unwrap_or_else(|| defaults::CONTENT_TYPE.into()),
        accept_content_types: cc.accept_content_types.clone().unwrap_or_default(),
        qps: cc.qps.unwrap_or(defaults::QPS),
        burst,
    };
    if client.content_type != defaults::CONTENT_TYPE {
        cx.ignored("clientConnection.contentType", &client.content_type);
    }
    if !client.accept_content_types.is_empty() {
        cx.ignored(
            "clientConnection.acceptContentTypes",
            &client.accept_content_types,
        );
    }
    if client.qps != defaults::QPS {
        cx.ignored("clientConnection.qps", client.qps);
    }
    if client.burst != defaults::BURST && burst >= 0 {
        cx.ignored("clientConnection.burst", client.burst);
    }
    client
}

/// The listening addresses and their companions.
struct Addresses {
    bind_address: IpAddr,
    healthz_bind_address: Option<SocketAddr>,
    metrics_bind_address: Option<SocketAddr>,
    bind_address_hard_fail: bool,
    enable_profiling: bool,
}

/// `bindAddress`, `healthzBindAddress`, `metricsBindAddress`, `enableProfiling`,
/// `showHiddenMetricsForVersion`.
fn resolve_addresses(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration) -> Addresses {
    let bind_text = cfg
        .bind_address
        .as_deref()
        .unwrap_or(defaults::BIND_ADDRESS);
    let bind_address = match bind_text.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => {
            cx.err(
                "bindAddress",
                format!("{bind_text:?} is not a valid textual representation of an IP address"),
            );
            IpAddr::from([0, 0, 0, 0])
        }
    };
    let healthz_bind_address =
        cx.host_port("healthzBindAddress", cfg.healthz_bind_address.as_deref());
    let metrics_bind_address =
        cx.host_port("metricsBindAddress", cfg.metrics_bind_address.as_deref());
    let bind_address_hard_fail = cfg.bind_address_hard_fail.unwrap_or(false);
    let enable_profiling = cfg.enable_profiling.unwrap_or(false);
    if enable_profiling {
        cx.ignored("enableProfiling", true);
    }
    let hidden = cfg
        .show_hidden_metrics_for_version
        .clone()
        .unwrap_or_default();
    if !hidden.is_empty() {
        let ok = hidden
            .split_once('.')
            .is_some_and(|(a, b)| a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok());
        if ok {
            cx.ignored("showHiddenMetricsForVersion", &hidden);
        } else {
            cx.err(
                "showHiddenMetricsForVersion",
                format!("{hidden:?} must be <major>.<minor>, e.g. 1.16"),
            );
        }
    }
    Addresses {
        bind_address,
        healthz_bind_address,
        metrics_bind_address,
        bind_address_hard_fail,
        enable_profiling,
    }
}

/// `clusterCIDR`: one CIDR or a dual-stack pair.
fn resolve_cluster_cidrs(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration) -> Vec<IpNet> {
    let cluster_cidr_text = cfg.cluster_cidr.clone().unwrap_or_default();
    let mut cluster_cidrs = Vec::new();
    if !cluster_cidr_text.trim().is_empty() {
        let parts: Vec<&str> = cluster_cidr_text.split(',').collect();
        if parts.len() > 2 {
            cx.err(
                "clusterCIDR",
                format!("{cluster_cidr_text:?} must be a single CIDR or a dual-stack pair (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)"),
            );
        } else {
            for p in &parts {
                if let Some(n) = cx.cidr("clusterCIDR", p) {
                    cluster_cidrs.push(n);
                }
            }
            if cluster_cidrs.len() == 2
                && cluster_cidrs[0].addr().is_ipv4() == cluster_cidrs[1].addr().is_ipv4()
            {
                cx.err(
                    "clusterCIDR",
                    format!("{cluster_cidr_text:?} must be a single CIDR or a dual-stack pair (one IPv4, one IPv6)"),
                );
            }
        }
    }
    cluster_cidrs
}

/// `detectLocalMode` and its `detectLocal` interface settings.
fn resolve_detect_local(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration) -> DetectLocal {
    let bridge = cfg
        .detect_local
        .bridge_interface
        .clone()
        .unwrap_or_default();
    let prefix = cfg
        .detect_local
        .interface_name_prefix
        .clone()
        .unwrap_or_default();
    match cfg.detect_local_mode.as_deref().unwrap_or_default() {
        "" | "ClusterCIDR" => DetectLocal::ClusterCidr,
        "NodeCIDR" => DetectLocal::NodeCidr,
        "BridgeInterface" => {
            if bridge.is_empty() {
                cx.err(
                    "detectLocal.bridgeInterface",
                    "must not be empty when detectLocalMode is BridgeInterface",
                );
            }
            DetectLocal::BridgeInterface(bridge)
        }
        "InterfaceNamePrefix" => {
            if prefix.is_empty() {
                cx.err(
                    "detectLocal.interfaceNamePrefix",
                    "must not be empty when detectLocalMode is InterfaceNamePrefix",
                );
            }
            DetectLocal::InterfaceNamePrefix(prefix)
        }
        other => {
            cx.err(
                "detectLocalMode",
                format!("{other:?} is not supported: expected \"ClusterCIDR\", \"NodeCIDR\", \"BridgeInterface\" or \"InterfaceNamePrefix\""),
            );
            DetectLocal::ClusterCidr
        }
    }
}

/// `iptables.*` sync periods and `localhostNodePorts` (the masquerade fields are read by
/// [`resolve`], being mode-independent in [`ProxyConfig`]).
fn resolve_iptables(cx: &mut Ctx<'_>, ipt: &super::file::Iptables) -> IptablesConfig {
    IptablesConfig {
        sync: cx.periods("iptables", ipt.sync_period, ipt.min_sync_period),
        localhost_node_ports: ipt
            .localhost_node_ports
            .unwrap_or(defaults::LOCALHOST_NODE_PORTS),
    }
}

/// `nftables.*` (the nftables mode's settings): masqueradeBit in [0, 31], the sync periods
/// like every mode's; `masqueradeAll` is also set by `--masquerade-all` /
/// `iptables.masqueradeAll` (`masquerade_all`).
fn resolve_nftables(
    cx: &mut Ctx<'_>,
    nft: &super::file::Nftables,
    masquerade_all: bool,
) -> NftablesModeConfig {
    NftablesModeConfig {
        masquerade_bit: cx.masquerade_bit("nftables.masqueradeBit", nft.masquerade_bit),
        sync: cx.periods("nftables", nft.sync_period, nft.min_sync_period),
        masquerade_all: masquerade_all || nft.masquerade_all == Some(true),
    }
}

/// `ipvs.*`: scheduler, excludeCIDRs, sync periods and timeouts.
fn resolve_ipvs(cx: &mut Ctx<'_>, iv: &super::file::Ipvs) -> IpvsConfig {
    let scheduler = iv.scheduler.clone().unwrap_or_default();
    if !IPVS_SCHEDULERS.contains(&scheduler.as_str()) {
        cx.err(
            "ipvs.scheduler",
            format!("{scheduler:?} is not supported: expected one of rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, nq (blank = rr)"),
        );
    }
    let mut exclude_cidrs = Vec::new();
    for (i, c) in iv.exclude_cidrs.iter().flatten().enumerate() {
        if let Some(n) = cx.cidr(&format!("ipvs.excludeCIDRs[{i}]"), c) {
            exclude_cidrs.push(n);
        }
    }
    let leave_if_zero = |d: std::time::Duration| (!d.is_zero()).then_some(d);
    IpvsConfig {
        sync: cx.periods("ipvs", iv.sync_period, iv.min_sync_period),
        scheduler: if scheduler.is_empty() {
            "rr".into()
        } else {
            scheduler
        },
        exclude_cidrs,
        strict_arp: iv.strict_arp.unwrap_or(false),
        tcp_timeout: leave_if_zero(cx.non_negative("ipvs.tcpTimeout", iv.tcp_timeout)),
        tcp_fin_timeout: leave_if_zero(cx.non_negative("ipvs.tcpFinTimeout", iv.tcp_fin_timeout)),
        udp_timeout: leave_if_zero(cx.non_negative("ipvs.udpTimeout", iv.udp_timeout)),
    }
}

/// `conntrack.*`: counts and timeouts ≥ 0.
fn resolve_conntrack(cx: &mut Ctx<'_>, ct: &super::file::Conntrack) -> ConntrackConfig {
    let count = |cx: &mut Ctx<'_>, path: &str, v: i32| -> u32 {
        u32::try_from(v).unwrap_or_else(|_| {
            cx.err(path, format!("must be >= 0 (got {v})"));
            0
        })
    };
    ConntrackConfig {
        max_per_core: count(
            cx,
            "conntrack.maxPerCore",
            ct.max_per_core.unwrap_or(defaults::CONNTRACK_MAX_PER_CORE),
        ),
        min: count(
            cx,
            "conntrack.min",
            ct.min.unwrap_or(defaults::CONNTRACK_MIN),
        ),
        tcp_established_timeout: cx.non_negative(
            "conntrack.tcpEstablishedTimeout",
            Some(ct.tcp_established_timeout.unwrap_or(GoDuration::from_secs(
                defaults::CONNTRACK_TCP_ESTABLISHED_SECS,
            ))),
        ),
        tcp_close_wait_timeout: cx.non_negative(
            "conntrack.tcpCloseWaitTimeout",
            Some(ct.tcp_close_wait_timeout.unwrap_or(GoDuration::from_secs(
                defaults::CONNTRACK_TCP_CLOSE_WAIT_SECS,
            ))),
        ),
        tcp_be_liberal: ct.tcp_be_liberal.unwrap_or(false),
        udp_timeout: cx.non_negative("conntrack.udpTimeout", ct.udp_timeout),
        udp_stream_timeout: cx.non_negative("conntrack.udpStreamTimeout", ct.udp_stream_timeout),
    }
}

/// `oomScoreAdj` in [-1000, 1000].
fn resolve_oom_score_adj(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration) -> i32 {
    let oom_score_adj = cfg.oom_score_adj.unwrap_or(defaults::OOM_SCORE_ADJ);
    if !(-1000..=1000).contains(&oom_score_adj) {
        cx.err(
            "oomScoreAdj",
            format!("must be within the range [-1000, 1000] (got {oom_score_adj})"),
        );
    }
    oom_score_adj
}

/// `configSyncPeriod` > 0 (accepted, ignored when not the default).
fn resolve_config_sync_period(
    cx: &mut Ctx<'_>,
    cfg: &KubeProxyConfiguration,
) -> std::time::Duration {
    let csp = cfg
        .config_sync_period
        .unwrap_or(GoDuration::from_secs(defaults::CONFIG_SYNC_PERIOD_SECS));
    if csp.0 <= 0 {
        cx.err("configSyncPeriod", format!("must be > 0 (got {csp})"));
    } else if csp != GoDuration::from_secs(defaults::CONFIG_SYNC_PERIOD_SECS) {
        cx.ignored("configSyncPeriod", csp);
    }
    csp.to_std()
}

/// `portRange`: empty or a port range (accepted, ignored).
fn validate_port_range(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration) {
    let port_range = cfg.port_range.clone().unwrap_or_default();
    if !port_range.is_empty() {
        if valid_port_range(&port_range) {
            cx.ignored("portRange", &port_range);
        } else {
            cx.err(
                "portRange",
                format!("{port_range:?} must be a valid port range (e.g. 300-2000)"),
            );
        }
    }
}

/// `logging.*`: format `text` or `json`, verbosity; vmodule and flushFrequency ignored.
fn resolve_logging(cx: &mut Ctx<'_>, logging: &super::file::Logging) -> LoggingConfig {
    let format = match logging.format.as_deref().unwrap_or("text") {
        "" | "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => {
            cx.err(
                "logging.format",
                format!("{other:?} is not supported: expected \"text\" or \"json\""),
            );
            LogFormat::Text
        }
    };
    if logging.vmodule.as_ref().is_some_and(|v| !v.is_empty()) {
        cx.ignored("logging.vmodule", "[...]");
    }
    if let Some(f) = logging.flush_frequency
        && f.0 != GoDuration::from_secs(defaults::LOG_FLUSH_FREQUENCY_SECS)
    {
        if f.0.is_negative() {
            cx.err(
                "logging.flushFrequency",
                format!("must be >= 0 (got {})", f.0),
            );
        } else {
            cx.ignored("logging.flushFrequency", f.0);
        }
    }
    LoggingConfig {
        format,
        verbosity: logging.verbosity.unwrap_or(0),
    }
}

/// `featureGates`: kept; a gate kproxy does not implement ([`super::FEATURE_GATES`]) is
/// warned about and ignored. (Upstream refuses unknown gates; kproxy accepts upstream's whole
/// list so an existing ConfigMap keeps loading.)
fn resolve_feature_gates(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration) -> BTreeMap<String, bool> {
    let feature_gates = cfg.feature_gates.clone().unwrap_or_default();
    let source = cx
        .flag_for("featureGates")
        .unwrap_or_else(|| "featureGates".to_owned());
    for (gate, on) in &feature_gates {
        if !super::FEATURE_GATES.iter().any(|g| g.name == gate) {
            cx.warnings.push(format!(
                "{source} sets feature gate {gate}={on}, which kproxy does not implement; ignored"
            ));
        }
    }
    feature_gates
}

/// Windows-only (`winkernel`, `windowsRunAsService`) and removed fields: warnings only.
/// (`bindAddressHardFail` is implemented by the health/metrics servers.)
fn warn_windows_and_removed(cx: &mut Ctx<'_>, cfg: &KubeProxyConfiguration) {
    let wk = &cfg.winkernel;
    if wk.network_name.as_deref().is_some_and(|s| !s.is_empty())
        || wk.source_vip.as_deref().is_some_and(|s| !s.is_empty())
        || wk.enable_dsr == Some(true)
        || wk
            .root_hns_endpoint_name
            .as_deref()
            .is_some_and(|s| !s.is_empty())
        || wk.forward_health_check_vip == Some(true)
    {
        cx.ignored("winkernel", "(Windows only)");
    }
    if cfg.windows_run_as_service == Some(true) {
        cx.ignored("windowsRunAsService", true);
    }
    for (field, v) in [
        ("udpIdleTimeout", &cfg.udp_idle_timeout),
        ("resourceContainer", &cfg.resource_container),
    ] {
        if v.is_some() {
            cx.warnings.push(format!(
                "config field {field} was removed from kube-proxy; ignored"
            ));
        }
    }
}

/// `mode`: "" = detect; ebpf / nftables / ipvs / iptables forced; anything else an error naming the field.
fn resolve_mode(cx: &mut Ctx<'_>, mode: &str) -> ModeChoice {
    if mode.is_empty() {
        return ModeChoice::Detect;
    }
    if mode == "kernelspace" {
        cx.err(
            "mode",
            "\"kernelspace\" is the Windows proxy mode; kproxy runs on Linux only",
        );
        return ModeChoice::Detect;
    }
    match mode.parse::<ProxyMode>() {
        Ok(m) => ModeChoice::Forced(m),
        Err(_) => {
            cx.err(
                "mode",
                format!("{mode:?} is not a proxy mode: expected \"\" (detect), \"ebpf\", \"nftables\", \"ipvs\" or \"iptables\""),
            );
            ModeChoice::Detect
        }
    }
}

/// Upstream `validateKubeProxyNodePortAddress`: `primary` must be the only entry (an error at
/// the index where it appears; entries after it are not looked at), every other entry a CIDR.
/// kproxy extension: the keywords `all` (0.0.0.0/0 and ::/0) and `localhost` (127.0.0.0/8 and
/// ::1/128), which the Kubernetes documentation names and upstream's binary rejects.
fn resolve_node_port_addresses(cx: &mut Ctx<'_>, list: Option<&[String]>) -> NodePortAddresses {
    let list = list.unwrap_or_default();
    if list.is_empty() {
        return NodePortAddresses::Unset;
    }
    let mut cidrs = Vec::new();
    for (i, a) in list.iter().enumerate() {
        let field = format!("nodePortAddresses[{i}]");
        match a.as_str() {
            "primary" => {
                if i != 0 || list.len() != 1 {
                    cx.err(&field, "can't use both 'primary' and CIDRs");
                }
                return NodePortAddresses::Primary;
            }
            "localhost" => cidrs.extend(
                ["127.0.0.0/8", "::1/128"].map(|c| c.parse::<IpNet>().expect("literal CIDR")),
            ),
            "all" => cidrs
                .extend(["0.0.0.0/0", "::/0"].map(|c| c.parse::<IpNet>().expect("literal CIDR"))),
            _ => {
                if let Some(n) = cx.cidr(&field, a) {
                    cidrs.push(n);
                }
            }
        }
    }
    NodePortAddresses::Cidrs(cidrs)
}

/// kproxy extension `serviceCIDRs`: CIDRs, each named by its index when invalid.
fn resolve_service_cidrs(cx: &mut Ctx<'_>, list: Option<&[String]>) -> Vec<IpNet> {
    list.unwrap_or_default()
        .iter()
        .enumerate()
        .filter_map(|(i, t)| cx.cidr(&format!("serviceCIDRs[{i}]"), t))
        .collect()
}

fn resolve_bpf(cx: &mut Ctx<'_>, b: &super::file::Bpf) -> BpfConfig {
    let cgroup = b.cgroup.clone().unwrap_or_default();
    if !cgroup.is_empty() && !cgroup.starts_with('/') {
        cx.err("bpf.cgroup", format!("{cgroup:?} must be an absolute path"));
    }
    let bpffs = b
        .bpffs
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| defaults::BPFFS.into());
    if !bpffs.starts_with('/') {
        cx.err("bpf.bpffs", format!("{bpffs:?} must be an absolute path"));
    }
    let devices = b.devices.clone().unwrap_or_default();
    for (i, d) in devices.iter().enumerate() {
        if d.is_empty()
            || d.len() > 15
            || d.contains(['/', ' ', '\t', '\n', ':'])
            || d == "."
            || d == ".."
        {
            cx.err(
                &format!("bpf.devices[{i}]"),
                format!("{d:?} is not a valid interface name"),
            );
        }
    }
    let map_sizes = b.map_sizes.clone().unwrap_or_default();
    for (name, size) in &map_sizes {
        if !BPF_MAP_NAMES.contains(&name.as_str()) {
            cx.err(
                &format!("bpf.mapSizes.{name}"),
                format!("unknown map: expected one of {}", BPF_MAP_NAMES.join(", ")),
            );
        } else if *size == 0 {
            cx.err(&format!("bpf.mapSizes.{name}"), "must be > 0");
        }
    }
    let xdp = match b.xdp.as_deref().unwrap_or(defaults::BPF_XDP) {
        "off" => XdpPolicy::Off,
        "" | "best-effort" => XdpPolicy::BestEffort,
        "native" => XdpPolicy::Native,
        other => {
            cx.err(
                "bpf.xdp",
                format!(
                    "{other:?} is not supported: expected \"off\", \"best-effort\" or \"native\""
                ),
            );
            XdpPolicy::BestEffort
        }
    };
    let lb_algorithm = match b
        .lb_algorithm
        .as_deref()
        .unwrap_or(defaults::BPF_LB_ALGORITHM)
    {
        "" | "random" => LbAlgorithm::Random,
        "maglev" => LbAlgorithm::Maglev,
        other => {
            cx.err(
                "bpf.lbAlgorithm",
                format!("{other:?} is not supported: expected \"random\" or \"maglev\""),
            );
            LbAlgorithm::Random
        }
    };
    let maglev_table_size = b
        .maglev_table_size
        .unwrap_or(defaults::BPF_MAGLEV_TABLE_SIZE);
    {
        use kproxy_common::maglev::is_prime;
        use kproxy_common::maglev::{MAX_TABLE_SIZE, MIN_TABLE_SIZE};
        if !(MIN_TABLE_SIZE..=MAX_TABLE_SIZE).contains(&maglev_table_size)
            || !is_prime(maglev_table_size)
        {
            cx.err(
                "bpf.maglevTableSize",
                format!(
                    "{maglev_table_size} must be a prime in [{MIN_TABLE_SIZE}, {MAX_TABLE_SIZE}] \
                     (e.g. 251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071)"
                ),
            );
        }
    }
    let bct = b.conntrack.clone().unwrap_or_default();
    let secs = GoDuration::from_secs;
    let ct_tcp_time_wait = cx.non_negative(
        "bpf.conntrack.tcpTimeWaitTimeout",
        Some(
            bct.tcp_time_wait_timeout
                .unwrap_or(secs(defaults::BPF_CT_TCP_TIME_WAIT_SECS)),
        ),
    );
    let ct_tcp_close = cx.non_negative(
        "bpf.conntrack.tcpCloseTimeout",
        Some(
            bct.tcp_close_timeout
                .unwrap_or(secs(defaults::BPF_CT_TCP_CLOSE_SECS)),
        ),
    );
    let ct_expiry_interval = cx.non_negative(
        "bpf.conntrack.expiryInterval",
        Some(
            bct.expiry_interval
                .unwrap_or(secs(defaults::BPF_CT_EXPIRY_INTERVAL_SECS)),
        ),
    );
    if ct_expiry_interval.is_zero() {
        cx.err("bpf.conntrack.expiryInterval", "must be > 0");
    }
    BpfConfig {
        cgroup: (!cgroup.is_empty()).then(|| PathBuf::from(cgroup)),
        bpffs: PathBuf::from(bpffs),
        devices,
        map_sizes,
        xdp,
        lb_algorithm,
        maglev_table_size,
        ct_tcp_time_wait,
        ct_tcp_close,
        ct_expiry_interval,
    }
}

/// Upstream's `ParsePortRange`: `a-b`, `a+n` or a single port, within 0..=65535, a ≤ b.
fn valid_port_range(s: &str) -> bool {
    let s = s.trim();
    let port = |t: &str| t.trim().parse::<u32>().ok().filter(|p| *p <= 65535);
    if let Some((a, b)) = s.split_once('-') {
        matches!((port(a), port(b)), (Some(a), Some(b)) if a <= b)
    } else if let Some((a, n)) = s.split_once('+') {
        matches!((port(a), n.trim().parse::<u32>().ok()), (Some(a), Some(n)) if a + n <= 65535)
    } else {
        port(s).is_some()
    }
}

/// The kernel's hostname.
fn system_hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(yaml: &str) -> KubeProxyConfiguration {
        let mut c = KubeProxyConfiguration::from_yaml(
            &format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{yaml}"
            ),
            "test",
        )
        .unwrap();
        c.apply_defaults();
        c
    }

    fn extra() -> Extra {
        Extra {
            hostname: Some("Node-A".into()),
            ..Extra::default()
        }
    }

    fn errors(yaml: &str) -> Vec<String> {
        match resolve(&cfg(yaml), &extra()) {
            Ok(_) => vec![],
            Err(e) => e.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn defaults_resolve() {
        let r = resolve(&cfg(""), &extra()).unwrap();
        let c = r.config;
        assert_eq!(c.mode, ModeChoice::Detect);
        assert_eq!(c.node_name, "node-a");
        assert_eq!(
            c.healthz_bind_address,
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(
            c.metrics_bind_address,
            Some("127.0.0.1:10249".parse().unwrap())
        );
        assert_eq!(c.masquerade_bit, 14);
        assert_eq!(c.masquerade_mark(), 0x4000);
        assert_eq!(c.detect_local, DetectLocal::ClusterCidr);
        assert_eq!(c.node_port_addresses, NodePortAddresses::Unset);
        assert_eq!(c.oom_score_adj, -999);
        assert_eq!(c.ebpf_sync.sync_period.as_secs(), 30);
        assert_eq!(c.ebpf_sync.min_sync_period.as_secs(), 1);
        assert_eq!(c.ipvs.scheduler, "rr");
        assert_eq!(c.ipvs.tcp_timeout, None);
        assert_eq!(c.bpf.bpffs, PathBuf::from("/sys/fs/bpf"));
        assert_eq!(c.bpf.xdp, XdpPolicy::BestEffort);
        assert_eq!(c.conntrack.max_per_core, 32768);
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        assert_eq!(
            c.source,
            SourceConfig::Kube {
                kubeconfig: None,
                master: None
            }
        );
    }

    #[test]
    fn runner_periods_follow_the_mode() {
        let c = resolve(
            &cfg("syncPeriod: 10s\nminSyncPeriod: 2s\niptables:\n  syncPeriod: 20s\nipvs:\n  syncPeriod: 40s\n  minSyncPeriod: 3s\n"),
            &extra(),
        )
        .unwrap()
        .config;
        assert_eq!(c.ebpf_sync.runner().max_interval.as_secs(), 10);
        assert_eq!(c.ebpf_sync.runner().min_interval.as_secs(), 2);
        assert_eq!(c.iptables.sync.runner().max_interval.as_secs(), 20);
        assert_eq!(c.iptables.sync.runner().min_interval.as_secs(), 1);
        assert_eq!(c.ipvs.sync.runner().max_interval.as_secs(), 40);
        assert_eq!(c.ipvs.sync.runner().min_interval.as_secs(), 3);
    }

    #[test]
    fn nftables_section_sets_the_modes_periods_and_masquerading() {
        let c = resolve(&cfg(""), &extra()).unwrap().config;
        // Upstream's defaults: 30s / 1s, bit 14, no masquerade-all.
        assert_eq!(c.nftables.sync.runner().max_interval.as_secs(), 30);
        assert_eq!(c.nftables.sync.runner().min_interval.as_secs(), 1);
        assert_eq!(c.nftables.masquerade_bit, 14);
        assert!(!c.nftables.masquerade_all);
        let c = resolve(
            &cfg("nftables:\n  syncPeriod: 50s\n  minSyncPeriod: 4s\n  masqueradeBit: 7\n  masqueradeAll: true\n"),
            &extra(),
        )
        .unwrap();
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
        let c = c.config;
        assert_eq!(c.nftables.sync.runner().max_interval.as_secs(), 50);
        assert_eq!(c.nftables.sync.runner().min_interval.as_secs(), 4);
        assert_eq!(
            (c.nftables.masquerade_bit, c.nftables.masquerade_all),
            (7, true)
        );
        // The iptables section's masquerading does not leak into the bit, but masqueradeAll
        // (set by --masquerade-all) applies to every mode.
        let c = resolve(
            &cfg("iptables:\n  masqueradeAll: true\n  masqueradeBit: 3\n"),
            &extra(),
        )
        .unwrap()
        .config;
        assert_eq!(
            (c.nftables.masquerade_bit, c.nftables.masquerade_all),
            (14, true)
        );
        assert_eq!(
            errors("nftables:\n  syncPeriod: 1s\n  minSyncPeriod: 2s\n").len(),
            1,
            "minSyncPeriod > syncPeriod is an error"
        );
    }

    #[test]
    fn modes() {
        let forced = ProxyMode::ALL.map(|m| (m.as_str(), ModeChoice::Forced(m)));
        for (m, want) in forced.into_iter().chain([("\"\"", ModeChoice::Detect)]) {
            assert_eq!(
                resolve(&cfg(&format!("mode: {m}\n")), &extra())
                    .unwrap()
                    .config
                    .mode,
                want
            );
        }
        assert!(errors("mode: kernelspace\n")[0].starts_with("mode: \"kernelspace\""));
        assert!(
            errors("mode: userspace\n")[0].starts_with("mode: \"userspace\" is not a proxy mode")
        );
    }

    #[test]
    fn each_rule_names_its_field() {
        let cases: &[(&str, &str)] = &[
            (
                "iptables:\n  minSyncPeriod: -1s\n",
                "iptables.minSyncPeriod: must be >= 0",
            ),
            (
                "iptables:\n  syncPeriod: -1s\n",
                "iptables.syncPeriod: must be > 0",
            ),
            (
                "iptables:\n  syncPeriod: 1s\n  minSyncPeriod: 2s\n",
                "iptables.syncPeriod: must be >= iptables.minSyncPeriod",
            ),
            (
                "ipvs:\n  syncPeriod: 1s\n  minSyncPeriod: 5s\n",
                "ipvs.syncPeriod: must be >= ipvs.minSyncPeriod",
            ),
            (
                "nftables:\n  minSyncPeriod: -5s\n",
                "nftables.minSyncPeriod: must be >= 0",
            ),
            ("syncPeriod: -1s\n", "syncPeriod: must be > 0"),
            (
                "minSyncPeriod: 1m\n",
                "syncPeriod: must be >= minSyncPeriod",
            ),
            (
                "iptables:\n  masqueradeBit: 32\n",
                "iptables.masqueradeBit: must be within the range [0, 31]",
            ),
            (
                "iptables:\n  masqueradeBit: -1\n",
                "iptables.masqueradeBit: must be within the range [0, 31]",
            ),
            (
                "nftables:\n  masqueradeBit: 40\n",
                "nftables.masqueradeBit: must be within the range [0, 31]",
            ),
            (
                "bindAddress: 1.2.3\n",
                "bindAddress: \"1.2.3\" is not a valid textual representation",
            ),
            (
                "healthzBindAddress: 1.2.3.4:99999\n",
                "healthzBindAddress: \"1.2.3.4:99999\": \"99999\" must be a valid port",
            ),
            (
                "metricsBindAddress: nohost:10249\n",
                "metricsBindAddress: \"nohost:10249\": \"nohost\" must be a valid IP",
            ),
            (
                "metricsBindAddress: 1.2.3.4:0\n",
                "metricsBindAddress: \"1.2.3.4:0\": must be a valid port",
            ),
            (
                "clusterCIDR: 10.0.0.0/33\n",
                "clusterCIDR: \"10.0.0.0/33\" must be a valid CIDR",
            ),
            (
                "clusterCIDR: 10.0.0.0/8,11.0.0.0/8\n",
                "clusterCIDR: \"10.0.0.0/8,11.0.0.0/8\" must be a single CIDR or a dual-stack pair",
            ),
            (
                "clusterCIDR: 10.0.0.0/8,fd00::/8,fd01::/16\n",
                "must be a single CIDR or a dual-stack pair",
            ),
            (
                "nodePortAddresses: [10.0.0.0/8, bogus]\n",
                "nodePortAddresses[1]: \"bogus\" must be a valid CIDR",
            ),
            (
                "nodePortAddresses: [10.0.0.0/8, primary]\n",
                "nodePortAddresses[1]: can't use both 'primary' and CIDRs",
            ),
            (
                "detectLocalMode: Foo\n",
                "detectLocalMode: \"Foo\" is not supported",
            ),
            (
                "detectLocalMode: BridgeInterface\n",
                "detectLocal.bridgeInterface: must not be empty",
            ),
            (
                "detectLocalMode: InterfaceNamePrefix\n",
                "detectLocal.interfaceNamePrefix: must not be empty",
            ),
            (
                "oomScoreAdj: 1001\n",
                "oomScoreAdj: must be within the range [-1000, 1000]",
            ),
            (
                "conntrack:\n  maxPerCore: -1\n",
                "conntrack.maxPerCore: must be >= 0",
            ),
            ("conntrack:\n  min: -1\n", "conntrack.min: must be >= 0"),
            (
                "conntrack:\n  tcpEstablishedTimeout: -1s\n",
                "conntrack.tcpEstablishedTimeout: must be >= 0",
            ),
            (
                "conntrack:\n  tcpCloseWaitTimeout: -1s\n",
                "conntrack.tcpCloseWaitTimeout: must be >= 0",
            ),
            (
                "conntrack:\n  udpTimeout: -1s\n",
                "conntrack.udpTimeout: must be >= 0",
            ),
            (
                "conntrack:\n  udpStreamTimeout: -1s\n",
                "conntrack.udpStreamTimeout: must be >= 0",
            ),
            (
                "ipvs:\n  tcpTimeout: -1s\n",
                "ipvs.tcpTimeout: must be >= 0",
            ),
            (
                "ipvs:\n  tcpFinTimeout: -1s\n",
                "ipvs.tcpFinTimeout: must be >= 0",
            ),
            (
                "ipvs:\n  udpTimeout: -1s\n",
                "ipvs.udpTimeout: must be >= 0",
            ),
            (
                "ipvs:\n  scheduler: fastest\n",
                "ipvs.scheduler: \"fastest\" is not supported",
            ),
            (
                "ipvs:\n  excludeCIDRs: [1.2.3.0/24, x]\n",
                "ipvs.excludeCIDRs[1]: \"x\" must be a valid CIDR",
            ),
            (
                "clientConnection:\n  burst: -1\n",
                "clientConnection.burst: must be >= 0",
            ),
            ("configSyncPeriod: -1s\n", "configSyncPeriod: must be > 0"),
            (
                "portRange: 2000-300\n",
                "portRange: \"2000-300\" must be a valid port range",
            ),
            (
                "logging:\n  format: xml\n",
                "logging.format: \"xml\" is not supported",
            ),
            (
                "showHiddenMetricsForVersion: abc\n",
                "showHiddenMetricsForVersion: \"abc\" must be <major>.<minor>",
            ),
            (
                "bpf:\n  bpffs: relative/path\n",
                "bpf.bpffs: \"relative/path\" must be an absolute path",
            ),
            (
                "bpf:\n  cgroup: cg\n",
                "bpf.cgroup: \"cg\" must be an absolute path",
            ),
            (
                "bpf:\n  xdp: always\n",
                "bpf.xdp: \"always\" is not supported",
            ),
            (
                "bpf:\n  lbAlgorithm: rr\n",
                "bpf.lbAlgorithm: \"rr\" is not supported",
            ),
            (
                "bpf:\n  maglevTableSize: 16383\n",
                "bpf.maglevTableSize: 16383 must be a prime in [251, 131071]",
            ),
            (
                "bpf:\n  maglevTableSize: 131101\n",
                "bpf.maglevTableSize: 131101 must be a prime in [251, 131071]",
            ),
            (
                "bpf:\n  mapSizes: {bogus: 5}\n",
                "bpf.mapSizes.bogus: unknown map",
            ),
            (
                "bpf:\n  mapSizes: {ct: 0}\n",
                "bpf.mapSizes.ct: must be > 0",
            ),
            (
                "bpf:\n  devices: [eth0, \"a/b\"]\n",
                "bpf.devices[1]: \"a/b\" is not a valid interface name",
            ),
            (
                "bpf:\n  conntrack: {expiryInterval: 0s}\n",
                "bpf.conntrack.expiryInterval: must be > 0",
            ),
            (
                "bpf:\n  conntrack: {tcpTimeWaitTimeout: -1s}\n",
                "bpf.conntrack.tcpTimeWaitTimeout: must be >= 0",
            ),
        ];
        for (yaml, want) in cases {
            let errs = errors(yaml);
            assert!(
                errs.iter().any(|e| e.contains(want)),
                "{yaml:?}: want {want:?}, got {errs:?}"
            );
        }
    }

    #[test]
    fn bpf_conntrack_timeouts_default_to_the_kernels_and_can_be_set() {
        let c = resolve(&cfg(""), &extra()).unwrap().config;
        assert_eq!(c.bpf.ct_tcp_time_wait, std::time::Duration::from_secs(120));
        assert_eq!(c.bpf.ct_tcp_close, std::time::Duration::from_secs(10));
        assert_eq!(c.bpf.ct_expiry_interval, std::time::Duration::from_secs(15));
        let c = resolve(
            &cfg("bpf:\n  conntrack:\n    tcpTimeWaitTimeout: 2s\n    tcpCloseTimeout: 500ms\n    expiryInterval: 1s\n"),
            &extra(),
        )
        .unwrap()
        .config;
        assert_eq!(c.bpf.ct_tcp_time_wait, std::time::Duration::from_secs(2));
        assert_eq!(c.bpf.ct_tcp_close, std::time::Duration::from_millis(500));
        assert_eq!(c.bpf.ct_expiry_interval, std::time::Duration::from_secs(1));
    }

    #[test]
    fn all_errors_are_reported_at_once() {
        let errs = errors("oomScoreAdj: 5000\niptables:\n  masqueradeBit: 99\nmode: foo\n");
        assert_eq!(errs.len(), 3, "{errs:?}");
    }

    #[test]
    fn flag_set_fields_name_the_flag() {
        let mut e = extra();
        e.flag_of.insert(
            "iptables.masqueradeBit".into(),
            "--iptables-masquerade-bit".into(),
        );
        let errs = resolve(&cfg("iptables:\n  masqueradeBit: 33\n"), &e).unwrap_err();
        assert_eq!(
            errs.0[0].to_string(),
            "iptables.masqueradeBit (--iptables-masquerade-bit): must be within the range [0, 31] (got 33)"
        );
    }

    #[test]
    fn node_port_addresses_forms() {
        let r = |y: &str| {
            resolve(&cfg(y), &extra())
                .unwrap()
                .config
                .node_port_addresses
        };
        assert_eq!(
            r("nodePortAddresses: [primary]\n"),
            NodePortAddresses::Primary
        );
        assert_eq!(
            r("nodePortAddresses: [10.0.0.0/8, localhost]\n"),
            NodePortAddresses::Cidrs(vec![
                "10.0.0.0/8".parse().unwrap(),
                "127.0.0.0/8".parse().unwrap(),
                "::1/128".parse().unwrap()
            ])
        );
    }

    #[test]
    fn node_port_addresses_validate_as_upstream_naming_the_entry() {
        // Upstream's validateKubeProxyNodePortAddress: `primary` only alone, the error at its
        // index; every other entry a CIDR.
        assert_eq!(
            errors("nodePortAddresses: [10.0.0.0/8, primary]\n"),
            vec!["nodePortAddresses[1]: can't use both 'primary' and CIDRs"]
        );
        assert_eq!(
            errors("nodePortAddresses: [primary, 10.0.0.0/8]\n"),
            vec!["nodePortAddresses[0]: can't use both 'primary' and CIDRs"]
        );
        assert_eq!(
            errors("nodePortAddresses: [primary, primary]\n"),
            vec!["nodePortAddresses[0]: can't use both 'primary' and CIDRs"]
        );
        let e = errors("nodePortAddresses: [10.0.0.0/8, foo, 1.2.3]\n");
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(
            e[0].starts_with("nodePortAddresses[1]: \"foo\" must be a valid CIDR"),
            "{e:?}"
        );
        assert!(e[1].starts_with("nodePortAddresses[2]: \"1.2.3\""), "{e:?}");
        let mut x = extra();
        x.flag_of
            .insert("nodePortAddresses".into(), "--nodeport-addresses".into());
        let errs = resolve(&cfg("nodePortAddresses: [primary, 10.0.0.0/8]\n"), &x).unwrap_err();
        assert_eq!(
            errs.0[0].to_string(),
            "nodePortAddresses[0] (--nodeport-addresses): can't use both 'primary' and CIDRs"
        );
    }

    #[test]
    fn service_cidrs_parse_and_errors_name_the_entry() {
        let c = resolve(
            &cfg("serviceCIDRs: [10.96.0.0/12, \"fd00:10:96::/112\"]\n"),
            &extra(),
        )
        .unwrap()
        .config;
        assert_eq!(
            c.service_cidrs,
            vec![
                "10.96.0.0/12".parse::<IpNet>().unwrap(),
                "fd00:10:96::/112".parse().unwrap()
            ]
        );
        assert!(
            resolve(&cfg(""), &extra())
                .unwrap()
                .config
                .service_cidrs
                .is_empty()
        );
        let e = errors("serviceCIDRs: [10.96.0.0/12, 10.96.0.1]\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with("serviceCIDRs[1]: \"10.96.0.1\" must be a valid CIDR"),
            "{e:?}"
        );
    }

    #[test]
    fn unset_node_port_addresses_stay_unset_for_the_mode_to_default() {
        let unset = resolve(&cfg(""), &extra())
            .unwrap()
            .config
            .node_port_addresses;
        assert_eq!(unset, NodePortAddresses::Unset);
        // Upstream's rewrite: /32 and /128 of the known IPs; loopback (unknown) is left out.
        let ips: Vec<std::net::IpAddr> = ["192.0.2.7", "::1", "fd00::7"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(
            NodePortAddresses::primary_cidrs(&ips),
            vec![
                "192.0.2.7/32".parse::<IpNet>().unwrap(),
                "fd00::7/128".parse().unwrap()
            ]
        );
    }

    #[test]
    fn dual_stack_cluster_cidr_and_detect_local_modes() {
        let c = resolve(
            &cfg("clusterCIDR: 10.244.0.0/16,fd00:10:244::/56\n"),
            &extra(),
        )
        .unwrap()
        .config;
        assert_eq!(c.cluster_cidrs.len(), 2);
        let c = resolve(
            &cfg("detectLocalMode: BridgeInterface\ndetectLocal:\n  bridgeInterface: cbr0\n"),
            &extra(),
        )
        .unwrap()
        .config;
        assert_eq!(c.detect_local, DetectLocal::BridgeInterface("cbr0".into()));
        let c = resolve(&cfg("detectLocalMode: NodeCIDR\n"), &extra())
            .unwrap()
            .config;
        assert_eq!(c.detect_local, DetectLocal::NodeCidr);
    }

    #[test]
    fn ignored_fields_warn() {
        let r = resolve(
            &cfg("featureGates: {Foo: true}\nenableProfiling: true\nclientConnection:\n  qps: 50\nudpIdleTimeout: 250ms\n"),
            &extra(),
        )
        .unwrap();
        let w = r.warnings.join("\n");
        for needle in [
            "Foo=true",
            "enableProfiling",
            "clientConnection.qps",
            "udpIdleTimeout",
        ] {
            assert!(w.contains(needle), "missing {needle} in {w}");
        }
    }

    #[test]
    fn known_feature_gates_resolve_without_a_warning() {
        let gate = crate::dataplane::settings::NFTABLES_LOCALHOST_NODEPORTS;
        let r = resolve(&cfg(&format!("featureGates: {{{gate}: true}}\n")), &extra()).unwrap();
        assert!(
            r.warnings.iter().all(|w| !w.contains(gate)),
            "{:?}",
            r.warnings
        );
        assert!(r.config.feature(gate));
        let off = resolve(&cfg(""), &extra()).unwrap().config;
        assert!(!off.feature(gate), "alpha gates default to off");
    }

    #[test]
    fn hostname_override_is_trimmed_and_lowercased() {
        let c = resolve(&cfg("hostnameOverride: \" Worker-1 \"\n"), &extra())
            .unwrap()
            .config;
        assert_eq!(c.node_name, "worker-1");
    }

    #[test]
    fn port_ranges() {
        for ok in ["300-2000", "300+100", "80", "0-0"] {
            assert!(valid_port_range(ok), "{ok}");
        }
        for bad in ["2000-300", "x", "70000", "1-70000", "65535+1"] {
            assert!(!valid_port_range(bad), "{bad}");
        }
    }
}
