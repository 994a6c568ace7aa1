//! Prometheus metrics: upstream kube-proxy's `kubeproxy_*` metrics (same names, types, labels
//! and buckets as the v1.36 metrics reference) plus kproxy's own `kproxy_*` ones, in one
//! [`prometheus_client`] registry served by `server` on `/metrics`.
//!
//! # Who sets what
//! - Generic sync metrics (every mode) are set by [`SyncMetrics`], a
//!   `crate::sync::SyncObserver` the agent attaches to the sync loop: sync duration, last
//!   (queued) timestamps, service/endpoint changes pending and total, no-local-endpoints,
//!   `kproxy_sync_errors_total{mode}`, `kproxy_programmed_{services,endpoints}`.
//! - `kubeproxy_proxy_{healthz,livez}_total` are counted by the health server.
//! - Datapaths report their own through the [`Metrics`] handle they are given at construction:
//!   [`Metrics::iptables`] (iptables and ipvs modes only: rule counts, restore failures,
//!   full/partial sync durations, nfacct packet counters), [`Metrics::conntrack`] (the
//!   conntrack reconciler, every mode), [`Metrics::set_bpf_map`] (eBPF map pressure) and
//!   [`Metrics::set_bpf_skipped_service_ports`] (service ports the eBPF datapath cannot
//!   translate: SCTP, see `kproxy-ebpf/src/sock.rs`).
//!
//! # Differences from upstream, on purpose
//! - None in the exposition format: like upstream, `/metrics` serves Prometheus' text format
//!   0.0.4 unless the client asks for OpenMetrics (`text`). In OpenMetrics a counter's
//!   `# TYPE` line names the family without `_total` (`# TYPE kubeproxy_proxy_healthz counter`)
//!   while its samples keep the `_total` name upstream uses (`kubeproxy_proxy_healthz_total`).
//! - One kproxy sync programs both IP families, so per-family sync metrics
//!   (`ip_family="IPv4"|"IPv6"`) are recorded for every family the agent handles
//!   (`Metrics::families`) with the same value.
//! - `kubeproxy_network_programming_duration_seconds` is observed once per (service, family)
//!   whose EndpointSlices carried an `endpoints.kubernetes.io/last-change-trigger-time`, after
//!   the first successful sync that programmed the change (the earliest pending trigger time
//!   counts; upstream forgets them when a sync fails, kproxy keeps them until one succeeds).
//!   Trigger times from before the agent started are ignored, as upstream does.
//! - `kubeproxy_conntrack_reconciler_sync_duration_seconds` uses the sync-duration buckets
//!   (`0.001 × 2^n`, 15 buckets); the upstream source read did not state its buckets.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets, linear_buckets};
use prometheus_client::registry::Registry;

use crate::dataplane::{ModeMetrics, ProxyMode};
use crate::model::IpFamily;

pub(crate) mod server;
mod sync;
pub(crate) mod text;

pub use sync::{SyncMetrics, no_local_endpoints};

/// `ip_family` label values (upstream's `v1.IPFamily` strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub(crate) enum FamilyLabel {
    IPv4,
    IPv6,
}

impl From<IpFamily> for FamilyLabel {
    fn from(f: IpFamily) -> Self {
        match f {
            IpFamily::V4 => FamilyLabel::IPv4,
            IpFamily::V6 => FamilyLabel::IPv6,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct FamilyLabels {
    pub ip_family: FamilyLabel,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct FamilyTableLabels {
    pub ip_family: FamilyLabel,
    /// `filter` or `nat`.
    pub table: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct FamilyPolicyLabels {
    pub ip_family: FamilyLabel,
    /// `internal` or `external`.
    pub traffic_policy: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct CodeLabels {
    pub code: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct MapLabels {
    pub map: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ProtocolLabels {
    /// `TCP`, `UDP` or `SCTP` (the Service's spelling).
    pub protocol: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub(crate) struct ModeLabels {
    pub mode: String,
}

type FamilyHistogram = Family<FamilyLabels, Histogram, fn() -> Histogram>;
type TimestampGauge = Gauge<f64, AtomicU64>;

/// Upstream's sync-latency buckets: `ExponentialBuckets(0.001, 2, 15)`.
fn sync_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// Upstream's network-programming buckets: 0.25, 0.5, 1..59 step 1, 60..115 step 5,
/// 120..300 step 30.
fn programming_buckets() -> Histogram {
    Histogram::new(
        linear_buckets(0.25, 0.25, 2)
            .chain(linear_buckets(1.0, 1.0, 59))
            .chain(linear_buckets(60.0, 5.0, 12))
            .chain(linear_buckets(120.0, 30.0, 7)),
    )
}

/// The iptables tables upstream counts rules of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IptablesTable {
    Filter,
    Nat,
}

impl IptablesTable {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            IptablesTable::Filter => "filter",
            IptablesTable::Nat => "nat",
        }
    }
}

/// The nfacct counters upstream's iptables rules reference, exported as packet counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NfacctCounter {
    /// `ct_state_invalid_dropped_pkts` → `kubeproxy_iptables_ct_state_invalid_dropped_packets_total`.
    CtStateInvalidDropped,
    /// `localhost_nps_accepted_pkts` → `kubeproxy_iptables_localhost_nodeports_accepted_packets_total`.
    LocalhostNodePortsAccepted,
}

/// Metrics of the iptables datapath (and the parts ipvs mode shares). Obtain with
/// [`Metrics::iptables`].
pub struct IptablesMetrics {
    full_duration: FamilyHistogram,
    partial_duration: FamilyHistogram,
    rules_last: Family<FamilyTableLabels, Gauge>,
    rules_total: Family<FamilyTableLabels, Gauge>,
    partial_restore_failures: Family<FamilyLabels, Counter>,
    restore_failures: Family<FamilyLabels, Counter>,
    ct_invalid_dropped: Counter,
    localhost_nodeports_accepted: Counter,
    /// Last nfacct readings, to turn absolute kernel counters into counter increments.
    nfacct_last: [AtomicU64; 2],
}

impl IptablesMetrics {
    /// `kubeproxy_sync_{full,partial}_proxy_rules_duration_seconds{ip_family}`.
    pub fn observe_sync(&self, family: IpFamily, full: bool, seconds: f64) {
        let h = if full {
            &self.full_duration
        } else {
            &self.partial_duration
        };
        h.get_or_create(&fam(family)).observe(seconds);
    }
    /// `kubeproxy_sync_proxy_rules_iptables_last{ip_family,table}`: rules written by the last sync.
    pub fn set_rules_last(&self, family: IpFamily, table: IptablesTable, rules: i64) {
        self.rules_last
            .get_or_create(&table_labels(family, table))
            .set(rules);
    }
    /// `kubeproxy_sync_proxy_rules_iptables_total{ip_family,table}`: rules kproxy owns.
    pub fn set_rules_total(&self, family: IpFamily, table: IptablesTable, rules: i64) {
        self.rules_total
            .get_or_create(&table_labels(family, table))
            .set(rules);
    }
    /// `kubeproxy_sync_proxy_rules_iptables_restore_failures_total` (and, for a failed partial
    /// restore, `..._partial_restore_failures_total` too, as upstream counts both).
    pub fn restore_failed(&self, family: IpFamily, partial: bool) {
        self.restore_failures.get_or_create(&fam(family)).inc();
        if partial {
            self.partial_restore_failures
                .get_or_create(&fam(family))
                .inc();
        }
    }
    /// Reports the current (absolute) value of an nfacct packet counter; the exported counter
    /// grows by the difference to the previous reading (a counter reset by the kernel starts
    /// counting again from the new value).
    pub fn set_nfacct(&self, counter: NfacctCounter, packets: u64) {
        let (c, i) = match counter {
            NfacctCounter::CtStateInvalidDropped => (&self.ct_invalid_dropped, 0),
            NfacctCounter::LocalhostNodePortsAccepted => (&self.localhost_nodeports_accepted, 1),
        };
        let last = self.nfacct_last[i].swap(packets, Ordering::Relaxed);
        c.inc_by(if packets >= last {
            packets - last
        } else {
            packets
        });
    }
}

/// Metrics of the nftables datapath (upstream's `RegisterMetrics` for nftables mode: the
/// full/partial sync durations and the nftables sync / cleanup failure counters). Obtain with
/// [`Metrics::nftables`].
pub(crate) struct NftablesMetrics {
    full_duration: FamilyHistogram,
    partial_duration: FamilyHistogram,
    sync_failures: Family<FamilyLabels, Counter>,
    cleanup_failures: Family<FamilyLabels, Counter>,
}

impl NftablesMetrics {
    fn new() -> NftablesMetrics {
        NftablesMetrics {
            full_duration: Family::new_with_constructor(sync_buckets as fn() -> Histogram),
            partial_duration: Family::new_with_constructor(sync_buckets as fn() -> Histogram),
            sync_failures: Family::default(),
            cleanup_failures: Family::default(),
        }
    }

    fn register(&self, kp: &mut Registry) {
        kp.register(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            self.full_duration.clone(),
        );
        kp.register(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            self.partial_duration.clone(),
        );
        kp.register(
            "sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            self.sync_failures.clone(),
        );
        kp.register(
            "sync_proxy_rules_nftables_cleanup_failures",
            "Cumulative proxy nftables cleanup failures",
            self.cleanup_failures.clone(),
        );
    }

    fn create_series(&self, f: IpFamily) {
        let l = fam(f);
        drop(self.full_duration.get_or_create(&l));
        drop(self.partial_duration.get_or_create(&l));
        drop(self.sync_failures.get_or_create(&l));
        drop(self.cleanup_failures.get_or_create(&l));
    }

    /// `kubeproxy_sync_{full,partial}_proxy_rules_duration_seconds{ip_family}`.
    pub(crate) fn observe_sync(&self, family: IpFamily, full: bool, seconds: f64) {
        let h = if full {
            &self.full_duration
        } else {
            &self.partial_duration
        };
        h.get_or_create(&fam(family)).observe(seconds);
    }

    /// `kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family}`.
    pub(crate) fn sync_failed(&self, family: IpFamily) {
        self.sync_failures.get_or_create(&fam(family)).inc();
    }

    /// `kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total{ip_family}` (a failed
    /// stale-chain deletion).
    pub(crate) fn cleanup_failed(&self, family: IpFamily) {
        self.cleanup_failures.get_or_create(&fam(family)).inc();
    }
}

/// Metrics of the conntrack reconciler (every mode). Obtain with [`Metrics::conntrack`].
pub struct ConntrackMetrics {
    deleted: Family<FamilyLabels, Counter>,
    duration: FamilyHistogram,
}

impl ConntrackMetrics {
    /// `kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family}` += `entries`.
    pub fn deleted(&self, family: IpFamily, entries: u64) {
        self.deleted.get_or_create(&fam(family)).inc_by(entries);
    }
    /// `kubeproxy_conntrack_reconciler_sync_duration_seconds{ip_family}`.
    pub fn observe(&self, family: IpFamily, seconds: f64) {
        self.duration.get_or_create(&fam(family)).observe(seconds);
    }
}

fn fam(f: IpFamily) -> FamilyLabels {
    FamilyLabels {
        ip_family: f.into(),
    }
}

fn table_labels(f: IpFamily, t: IptablesTable) -> FamilyTableLabels {
    FamilyTableLabels {
        ip_family: f.into(),
        table: t.as_str().into(),
    }
}

/// The generic metrics every mode has (set by [`SyncMetrics`] and the health server).
pub(crate) struct Generic {
    pub sync_duration: FamilyHistogram,
    pub network_programming: FamilyHistogram,
    pub endpoint_changes_pending: Gauge,
    pub endpoint_changes_total: Counter,
    pub service_changes_pending: Gauge,
    pub service_changes_total: Counter,
    pub last_queued: Family<FamilyLabels, TimestampGauge>,
    pub last_synced: Family<FamilyLabels, TimestampGauge>,
    pub no_local_endpoints: Family<FamilyPolicyLabels, Gauge>,
    pub healthz: Family<CodeLabels, Counter>,
    pub livez: Family<CodeLabels, Counter>,
    pub sync_errors: Family<ModeLabels, Counter>,
    pub programmed_services: Gauge,
    pub programmed_endpoints: Gauge,
    pub bpf_map_entries: Family<MapLabels, Gauge>,
    pub bpf_map_capacity: Family<MapLabels, Gauge>,
    pub bpf_skipped_service_ports: Family<ProtocolLabels, Gauge>,
    pub bpf_snat_failures: Counter,
    /// The programs' summed counter at the last [`Metrics::set_bpf_snat_failures`].
    bpf_snat_failures_last: AtomicU64,
}

// Every series that can exist is created up front (prometheus-client leaves out a family
// without series, `# TYPE` line included), so a scrape shows 0, not nothing: the
// `create_series` methods below.

impl Generic {
    fn new() -> Generic {
        Generic {
            sync_duration: Family::new_with_constructor(sync_buckets as fn() -> Histogram),
            network_programming: Family::new_with_constructor(
                programming_buckets as fn() -> Histogram,
            ),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes_total: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            last_queued: Family::default(),
            last_synced: Family::default(),
            no_local_endpoints: Family::default(),
            healthz: Family::default(),
            livez: Family::default(),
            sync_errors: Family::default(),
            programmed_services: Gauge::default(),
            programmed_endpoints: Gauge::default(),
            bpf_skipped_service_ports: Family::default(),
            bpf_snat_failures: Counter::default(),
            bpf_snat_failures_last: AtomicU64::new(0),
            bpf_map_entries: Family::default(),
            bpf_map_capacity: Family::default(),
        }
    }

    /// Upstream's generic sync metrics (`kubeproxy_sync_proxy_rules_*`, network programming).
    fn register_sync(&self, kp: &mut Registry) {
        kp.register(
            "sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            self.sync_duration.clone(),
        );
        kp.register(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            self.network_programming.clone(),
        );
        kp.register(
            "sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            self.endpoint_changes_pending.clone(),
        );
        kp.register(
            "sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            self.endpoint_changes_total.clone(),
        );
        kp.register(
            "sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            self.service_changes_pending.clone(),
        );
        kp.register(
            "sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            self.service_changes_total.clone(),
        );
        kp.register(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            self.last_queued.clone(),
        );
        kp.register(
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            self.last_synced.clone(),
        );
        kp.register(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            self.no_local_endpoints.clone(),
        );
    }

    /// `kubeproxy_proxy_healthz` / `kubeproxy_proxy_livez`.
    fn register_health(&self, kp: &mut Registry) {
        kp.register(
            "proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            self.healthz.clone(),
        );
        kp.register(
            "proxy_livez",
            "Cumulative proxy livez HTTP status",
            self.livez.clone(),
        );
    }

    /// kproxy's own metrics (`kproxy_*`): BPF maps, sync errors, what is programmed.
    fn register_kproxy(&self, own: &mut Registry) {
        own.register(
            "bpf_map_entries",
            "Entries in each kproxy BPF map (eBPF mode)",
            self.bpf_map_entries.clone(),
        );
        own.register(
            "bpf_map_capacity",
            "Maximum entries of each kproxy BPF map (eBPF mode)",
            self.bpf_map_capacity.clone(),
        );
        own.register(
            "bpf_skipped_service_ports",
            "Service ports of the last sync the eBPF datapath does not translate, by protocol \
             (eBPF mode; SCTP has no socket-LB or TC translation)",
            self.bpf_skipped_service_ports.clone(),
        );
        own.register(
            "bpf_snat_failures",
            "New flows the eBPF node-device path dropped because no SNAT port was free for \
             their backend (eBPF mode; every port of the range in use)",
            self.bpf_snat_failures.clone(),
        );
        own.register(
            "sync_errors",
            "Syncs of the datapath that failed, by proxy mode",
            self.sync_errors.clone(),
        );
        own.register(
            "programmed_services",
            "Service ports programmed by the last successful sync",
            self.programmed_services.clone(),
        );
        own.register(
            "programmed_endpoints",
            "Endpoints programmed by the last successful sync",
            self.programmed_endpoints.clone(),
        );
    }

    fn create_series(&self, set: ModeMetrics, families: &[IpFamily]) {
        drop(self.sync_errors.get_or_create(&ModeLabels {
            mode: set.mode.as_str().into(),
        }));
        if set.bpf {
            drop(
                self.bpf_skipped_service_ports
                    .get_or_create(&ProtocolLabels {
                        protocol: "SCTP".into(),
                    }),
            );
        }
        for code in ["200", "503"] {
            let l = CodeLabels { code: code.into() };
            drop(self.healthz.get_or_create(&l));
            drop(self.livez.get_or_create(&l));
        }
        for f in families {
            let l = fam(*f);
            drop(self.sync_duration.get_or_create(&l));
            drop(self.network_programming.get_or_create(&l));
            drop(self.last_queued.get_or_create(&l));
            drop(self.last_synced.get_or_create(&l));
            for policy in ["internal", "external"] {
                drop(self.no_local_endpoints.get_or_create(&FamilyPolicyLabels {
                    ip_family: (*f).into(),
                    traffic_policy: policy.into(),
                }));
            }
        }
    }
}

impl ConntrackMetrics {
    fn new() -> ConntrackMetrics {
        ConntrackMetrics {
            deleted: Family::default(),
            duration: Family::new_with_constructor(sync_buckets as fn() -> Histogram),
        }
    }

    fn register(&self, kp: &mut Registry) {
        kp.register(
            "conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            self.deleted.clone(),
        );
        kp.register(
            "conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            self.duration.clone(),
        );
    }

    fn create_series(&self, f: IpFamily) {
        drop(self.deleted.get_or_create(&fam(f)));
        drop(self.duration.get_or_create(&fam(f)));
    }
}

impl IptablesMetrics {
    fn new() -> IptablesMetrics {
        IptablesMetrics {
            full_duration: Family::new_with_constructor(sync_buckets as fn() -> Histogram),
            partial_duration: Family::new_with_constructor(sync_buckets as fn() -> Histogram),
            rules_last: Family::default(),
            rules_total: Family::default(),
            partial_restore_failures: Family::default(),
            restore_failures: Family::default(),
            ct_invalid_dropped: Counter::default(),
            localhost_nodeports_accepted: Counter::default(),
            nfacct_last: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    /// ipvs mode shares only the restore-failure counter (upstream RegisterMetrics).
    fn register(&self, kp: &mut Registry, sync: bool) {
        kp.register(
            "sync_proxy_rules_iptables_restore_failures",
            "Cumulative proxy iptables restore failures",
            self.restore_failures.clone(),
        );
        if !sync {
            return;
        }
        kp.register(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            self.full_duration.clone(),
        );
        kp.register(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            self.partial_duration.clone(),
        );
        kp.register(
            "sync_proxy_rules_iptables_last",
            "Number of iptables rules written by kube-proxy in last sync",
            self.rules_last.clone(),
        );
        kp.register(
            "sync_proxy_rules_iptables_total",
            "Total number of iptables rules owned by kube-proxy",
            self.rules_total.clone(),
        );
        kp.register(
            "sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures",
            self.partial_restore_failures.clone(),
        );
        kp.register(
            "iptables_ct_state_invalid_dropped_packets",
            "packets dropped by iptables to work around conntrack problems",
            self.ct_invalid_dropped.clone(),
        );
        kp.register(
            "iptables_localhost_nodeports_accepted_packets",
            "Number of packets accepted on nodeports of loopback interface",
            self.localhost_nodeports_accepted.clone(),
        );
    }

    fn create_series(&self, f: IpFamily) {
        let l = fam(f);
        drop(self.full_duration.get_or_create(&l));
        drop(self.partial_duration.get_or_create(&l));
        drop(self.partial_restore_failures.get_or_create(&l));
        drop(self.restore_failures.get_or_create(&l));
        for t in [IptablesTable::Filter, IptablesTable::Nat] {
            drop(self.rules_last.get_or_create(&table_labels(f, t)));
            drop(self.rules_total.get_or_create(&table_labels(f, t)));
        }
    }
}

type TriggerKey = (String, String, IpFamily);

/// EndpointSlice trigger times per (namespace, service, family): the pending ones (earliest,
/// latest) and the latest already observed (a re-list delivers old slices again; their trigger
/// times must not count twice).
#[derive(Default)]
struct TriggerTimes {
    pending: HashMap<TriggerKey, (SystemTime, SystemTime)>,
    observed: HashMap<TriggerKey, SystemTime>,
}

/// The annotation the EndpointSlice controller sets to the time of the change it mirrors.
pub(crate) const TRIGGER_TIME_ANNOTATION: &str = "endpoints.kubernetes.io/last-change-trigger-time";

struct Inner {
    mode: ProxyMode,
    families: Vec<IpFamily>,
    created: SystemTime,
    triggers: Mutex<TriggerTimes>,
    registry: Registry,
    generic: Generic,
    conntrack: ConntrackMetrics,
    iptables: Option<IptablesMetrics>,
    nftables: Option<NftablesMetrics>,
}

/// A cheap-to-clone handle on the registry and every metric in it.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics")
            .field("mode", &self.inner.mode)
            .field("families", &self.inner.families)
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// The metrics of a proxy running `set.mode` for both IP families.
    pub(crate) fn new(set: ModeMetrics) -> Metrics {
        Metrics::with_families(set, &[IpFamily::V4, IpFamily::V6])
    }

    /// The metrics of a proxy running `set.mode` for `families` (the per-family sync metrics
    /// get one series per family).
    pub(crate) fn with_families(set: ModeMetrics, families: &[IpFamily]) -> Metrics {
        let mode = set.mode;
        let mut registry = Registry::default();
        let kp = registry.sub_registry_with_prefix("kubeproxy");
        let generic = Generic::new();
        let conntrack = ConntrackMetrics::new();
        // Registration order is the exposition order.
        generic.register_sync(kp);
        generic.register_health(kp);
        conntrack.register(kp);
        let iptables = set.iptables_restore.then(|| {
            let m = IptablesMetrics::new();
            m.register(kp, set.iptables_sync);
            m
        });
        let nftables = set.nftables_sync.then(|| {
            let m = NftablesMetrics::new();
            m.register(kp);
            m
        });
        generic.register_kproxy(registry.sub_registry_with_prefix("kproxy"));
        generic.create_series(set, families);
        for f in families {
            conntrack.create_series(*f);
            if let Some(m) = &iptables {
                m.create_series(*f);
            }
            if let Some(m) = &nftables {
                m.create_series(*f);
            }
        }
        Metrics {
            inner: Arc::new(Inner {
                mode,
                families: families.to_vec(),
                created: SystemTime::now(),
                triggers: Mutex::default(),
                registry,
                generic,
                conntrack,
                iptables,
                nftables,
            }),
        }
    }

    /// The proxy mode these metrics describe (`/proxyMode`).
    pub(crate) fn mode(&self) -> ProxyMode {
        self.inner.mode
    }

    /// The IP families per-family sync metrics are recorded for.
    pub(crate) fn families(&self) -> &[IpFamily] {
        &self.inner.families
    }

    /// The iptables-mode metrics (`Some` in iptables and ipvs modes; ipvs registers only the
    /// restore-failure counter, as upstream does).
    pub fn iptables(&self) -> Option<&IptablesMetrics> {
        self.inner.iptables.as_ref()
    }

    /// The nftables-mode metrics (`Some` in nftables mode only).
    pub(crate) fn nftables(&self) -> Option<&NftablesMetrics> {
        self.inner.nftables.as_ref()
    }

    /// The conntrack reconciler's metrics.
    pub fn conntrack(&self) -> &ConntrackMetrics {
        &self.inner.conntrack
    }

    /// `kproxy_bpf_map_entries{map}` / `kproxy_bpf_map_capacity{map}`.
    pub fn set_bpf_map(&self, map: &str, entries: i64, capacity: i64) {
        let l = MapLabels { map: map.into() };
        self.inner
            .generic
            .bpf_map_entries
            .get_or_create(&l)
            .set(entries);
        self.inner
            .generic
            .bpf_map_capacity
            .get_or_create(&l)
            .set(capacity);
    }

    /// `kproxy_bpf_snat_failures_total`: reports the programs' current (absolute) count of new
    /// flows dropped for want of a SNAT port; the exported counter grows by the difference to
    /// the previous reading (a reset, e.g. maps recreated, counts again from the new value).
    pub fn set_bpf_snat_failures(&self, total: u64) {
        let g = &self.inner.generic;
        let last = g.bpf_snat_failures_last.swap(total, Ordering::Relaxed);
        g.bpf_snat_failures
            .inc_by(if total >= last { total - last } else { total });
    }

    /// `kproxy_bpf_skipped_service_ports{protocol}`: service ports of the last sync that the
    /// eBPF datapath does not translate (set by the ebpf mode after every sync).
    pub fn set_bpf_skipped_service_ports(&self, protocol: &str, ports: i64) {
        self.inner
            .generic
            .bpf_skipped_service_ports
            .get_or_create(&ProtocolLabels {
                protocol: protocol.into(),
            })
            .set(ports);
    }

    /// Counts one `/healthz` (`livez == false`) or `/livez` answer.
    pub fn count_health_request(&self, livez: bool, code: u16) {
        let f = if livez {
            &self.inner.generic.livez
        } else {
            &self.inner.generic.healthz
        };
        f.get_or_create(&CodeLabels {
            code: code.to_string(),
        })
        .inc();
    }

    /// Notes an EndpointSlice's change trigger time (network programming latency); the
    /// agent calls this for every slice it receives.
    pub(crate) fn endpoint_slice_seen(&self, slice: &EndpointSlice) {
        let Some(t) = slice
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(TRIGGER_TIME_ANNOTATION))
            .and_then(|v| v.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(SystemTime::from)
        else {
            return;
        };
        let family = match slice.address_type.as_str() {
            "IPv4" => IpFamily::V4,
            "IPv6" => IpFamily::V6,
            _ => return,
        };
        let Some(service) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("kubernetes.io/service-name"))
        else {
            return;
        };
        if t < self.inner.created {
            return;
        }
        let ns = slice
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let key = (ns, service.clone(), family);
        let mut triggers = self
            .inner
            .triggers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if triggers.observed.get(&key).is_some_and(|seen| t <= *seen) {
            return;
        }
        let e = triggers.pending.entry(key).or_insert((t, t));
        *e = (e.0.min(t), e.1.max(t));
    }

    /// Takes the pending trigger times of the service `namespace/name`.
    pub(crate) fn take_trigger_times(
        &self,
        namespace: &str,
        name: &str,
    ) -> Vec<(IpFamily, SystemTime)> {
        let mut triggers = self
            .inner
            .triggers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut out = vec![];
        for f in [IpFamily::V4, IpFamily::V6] {
            let key = (namespace.to_owned(), name.to_owned(), f);
            if let Some((earliest, latest)) = triggers.pending.remove(&key) {
                triggers.observed.insert(key, latest);
                out.push((f, earliest));
            }
        }
        out
    }

    pub(crate) fn generic(&self) -> &Generic {
        &self.inner.generic
    }

    /// The OpenMetrics text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.inner.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// The datapaths' reports land in the metrics they name.
impl crate::dataplane::Telemetry for Metrics {
    fn bpf_map(&self, map: &str, entries: i64, capacity: i64) {
        self.set_bpf_map(map, entries, capacity);
    }
    fn skipped_service_ports(&self, protocol: &str, count: i64) {
        self.set_bpf_skipped_service_ports(protocol, count);
    }
    fn snat_failures(&self, total: u64) {
        self.set_bpf_snat_failures(total);
    }
    fn conntrack_cleanup(&self, family: IpFamily, deleted: u64, seconds: f64) {
        self.conntrack().deleted(family, deleted);
        self.conntrack().observe(family, seconds);
    }
    fn proxier_sync(&self, family: IpFamily, full: bool, seconds: f64) {
        if let Some(m) = self.iptables() {
            m.observe_sync(family, full, seconds);
        }
        if let Some(m) = self.nftables() {
            m.observe_sync(family, full, seconds);
        }
    }
    fn proxier_sync_failed(&self, family: IpFamily) {
        if let Some(m) = self.nftables() {
            m.sync_failed(family);
        }
    }
    fn restore_failed(&self, family: IpFamily, partial: bool) {
        if let Some(m) = self.iptables() {
            m.restore_failed(family, partial);
        }
    }
    fn nat_rules_last(&self, family: IpFamily, rules: u64) {
        if let Some(m) = self.iptables() {
            m.set_rules_last(family, IptablesTable::Nat, rules as i64);
        }
    }
    fn stale_chain_cleanup_failed(&self, family: IpFamily) {
        if let Some(m) = self.nftables() {
            m.cleanup_failed(family);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The sets the modes' faces declare (`app::registry`'s tests check the faces say these).
    const EBPF: ModeMetrics = ModeMetrics {
        bpf: true,
        ..ModeMetrics::generic(ProxyMode::Ebpf)
    };
    const IPTABLES: ModeMetrics = ModeMetrics {
        iptables_restore: true,
        iptables_sync: true,
        ..ModeMetrics::generic(ProxyMode::Iptables)
    };
    const IPVS: ModeMetrics = ModeMetrics {
        iptables_restore: true,
        ..ModeMetrics::generic(ProxyMode::Ipvs)
    };
    const NFTABLES: ModeMetrics = ModeMetrics {
        nftables_sync: true,
        ..ModeMetrics::generic(ProxyMode::Nftables)
    };

    fn type_line(text: &str, family: &str) -> Option<String> {
        let prefix = format!("# TYPE {family} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
    }

    #[test]
    fn network_programming_buckets_match_upstream() {
        let m = Metrics::new(EBPF);
        m.generic()
            .network_programming
            .get_or_create(&fam(IpFamily::V4))
            .observe(0.1);
        let text = m.encode();
        let les: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with("kubeproxy_network_programming_duration_seconds_bucket"))
            .filter(|l| l.contains("ip_family=\"IPv4\""))
            .filter_map(|l| {
                let le = l.split("le=\"").nth(1)?.split('"').next()?;
                le.parse().ok()
            })
            .collect();
        let mut want = vec![0.25, 0.5];
        want.extend((1..=59).map(f64::from));
        want.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
        want.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
        want.push(f64::INFINITY);
        assert_eq!(les, want);
    }

    #[test]
    fn iptables_metrics_only_in_iptables_like_modes() {
        let e = Metrics::new(EBPF);
        assert!(e.iptables().is_none());
        assert!(type_line(&e.encode(), "kubeproxy_sync_proxy_rules_iptables_total").is_none());
        let i = Metrics::new(IPTABLES);
        let text = i.encode();
        assert_eq!(
            type_line(&text, "kubeproxy_sync_proxy_rules_iptables_total").as_deref(),
            Some("gauge")
        );
        let v = Metrics::new(IPVS);
        let text = v.encode();
        assert_eq!(
            type_line(
                &text,
                "kubeproxy_sync_proxy_rules_iptables_restore_failures"
            )
            .as_deref(),
            Some("counter")
        );
        assert!(type_line(&text, "kubeproxy_sync_proxy_rules_iptables_total").is_none());
    }

    #[test]
    fn nftables_mode_registers_upstreams_nftables_metrics() {
        let m = Metrics::new(NFTABLES);
        assert!(m.iptables().is_none() && m.nftables().is_some());
        let text = m.encode();
        for (name, kind) in [
            (
                "kubeproxy_sync_proxy_rules_nftables_sync_failures",
                "counter",
            ),
            (
                "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
                "counter",
            ),
            (
                "kubeproxy_sync_full_proxy_rules_duration_seconds",
                "histogram",
            ),
            (
                "kubeproxy_sync_partial_proxy_rules_duration_seconds",
                "histogram",
            ),
            ("kubeproxy_sync_proxy_rules_duration_seconds", "histogram"),
            (
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                "gauge",
            ),
            ("kubeproxy_sync_proxy_rules_last_timestamp_seconds", "gauge"),
            (
                "kubeproxy_network_programming_duration_seconds",
                "histogram",
            ),
        ] {
            assert_eq!(type_line(&text, name).as_deref(), Some(kind), "{name}");
        }
        for absent in [
            "kubeproxy_sync_proxy_rules_iptables_total",
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
        ] {
            assert!(type_line(&text, absent).is_none(), "{absent}");
        }
        let n = m.nftables().unwrap();
        n.sync_failed(IpFamily::V6);
        n.observe_sync(IpFamily::V4, true, 0.01);
        let text = m.encode();
        assert!(
            text.contains(
                "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv6\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1"
            ),
            "{text}"
        );
        assert!(Metrics::new(IPTABLES).nftables().is_none());
    }

    #[test]
    fn iptables_api_sets_labelled_series() {
        let m = Metrics::new(IPTABLES);
        let ipt = m.iptables().unwrap();
        ipt.set_rules_last(IpFamily::V4, IptablesTable::Nat, 42);
        ipt.restore_failed(IpFamily::V6, true);
        ipt.set_nfacct(NfacctCounter::CtStateInvalidDropped, 10);
        ipt.set_nfacct(NfacctCounter::CtStateInvalidDropped, 15);
        let text = m.encode();
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_iptables_last{ip_family=\"IPv4\",table=\"nat\"} 42\n"
        ));
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family=\"IPv6\"} 1\n"
        ));
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family=\"IPv6\"} 1\n"
        ));
        assert!(text.contains("kubeproxy_iptables_ct_state_invalid_dropped_packets_total 15\n"));
    }

    #[test]
    fn bpf_map_pressure_and_health_counts() {
        let m = Metrics::new(EBPF);
        m.set_bpf_map("SERVICES", 3, 65536);
        m.count_health_request(false, 200);
        m.count_health_request(false, 200);
        m.count_health_request(true, 503);
        let text = m.encode();
        assert!(text.contains("kproxy_bpf_map_entries{map=\"SERVICES\"} 3\n"));
        assert!(text.contains("kproxy_bpf_map_capacity{map=\"SERVICES\"} 65536\n"));
        assert!(text.contains("kubeproxy_proxy_healthz_total{code=\"200\"} 2\n"));
        assert!(text.contains("kubeproxy_proxy_livez_total{code=\"503\"} 1\n"));
        assert!(text.contains("kproxy_sync_errors_total{mode=\"ebpf\"} 0\n"));
        // The SCTP series exists (0) before the first sync, then follows each sync's count.
        assert!(text.contains("kproxy_bpf_skipped_service_ports{protocol=\"SCTP\"} 0\n"));
        m.set_bpf_skipped_service_ports("SCTP", 2);
        assert!(
            m.encode()
                .contains("kproxy_bpf_skipped_service_ports{protocol=\"SCTP\"} 2\n")
        );
        let ipt = Metrics::new(IPTABLES).encode();
        assert!(!ipt.contains("kproxy_bpf_skipped_service_ports{"), "{ipt}");
    }

    #[test]
    fn bpf_snat_failures_count_the_programs_counter_growth() {
        let m = Metrics::new(EBPF);
        assert!(m.encode().contains("kproxy_bpf_snat_failures_total 0\n"));
        m.set_bpf_snat_failures(3);
        m.set_bpf_snat_failures(5);
        assert!(m.encode().contains("kproxy_bpf_snat_failures_total 5\n"));
        // The programs' counter restarted (maps recreated): counted from the new value.
        m.set_bpf_snat_failures(2);
        assert!(m.encode().contains("kproxy_bpf_snat_failures_total 7\n"));
    }
}
