//! Wires one agent together: a source, the tracker, the sync runner and a datapath.
//!
//! `main.rs` turns the command line and config file into [`AgentOptions`]; everything below
//! takes explicit values so tests can run an agent in-process.
//!
//! Besides source → tracker → sync loop → datapath, an agent runs the operational surface:
//! the healthz server (`/healthz`, `/livez`), the metrics server (`/metrics`, `/proxyMode`),
//! the healthCheckNodePort servers, the "Starting" event on the Node, and a watch on its own
//! Node (eligibility for `/healthz`, node IPs). Node events are seen on their way from the
//! source to the sync loop (a pass-through tap), so no second watch is needed.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{error, info, warn};

use super::registry;
use crate::app::nodeip::NodeIps;
use crate::app::nodeip::detect_node_ips;
use crate::app::nodeip::node_ips_of;
use crate::config::{DetectLocal, ProxyConfig, SourceConfig};
use crate::dataplane::Dataplane;
use crate::model::input::{Delta, Event};
use crate::model::{IpFamily, ModelWarning, Snapshot, Tracker};
use crate::observe::events::Events;
use crate::observe::health::HealthHandle;
use crate::observe::health::NodeEligibility;
use crate::observe::metrics::Metrics;
use crate::observe::metrics::SyncMetrics;
use crate::observe::server::Served;
use crate::observe::service_health::ServiceHealthServers;
use crate::source;
use crate::sync::{Runner, RunnerConfig, RunnerStatus, SyncRequester};

/// Everything an agent needs besides its datapath.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub node_name: String,
    pub source: SourceConfig,
    pub runner: RunnerConfig,
    /// `--healthz-bind-address` (default `0.0.0.0:10256`); `None` disables the server.
    pub healthz_bind: Option<SocketAddr>,
    /// `--metrics-bind-address` (default `127.0.0.1:10249`); `None` disables the server.
    pub metrics_bind: Option<SocketAddr>,
    /// `--bind-address` when it names one IP (overrides the node IP of its family).
    pub bind_address: Option<IpAddr>,
    /// `--nodeport-addresses` as CIDRs (empty: all addresses); where healthCheckNodePorts listen.
    pub node_port_addresses: Vec<IpNet>,
    /// `--oom-score-adj` (upstream default -999); `None` leaves the process' score alone.
    pub oom_score_adj: Option<i32>,
    /// The metrics handle the datapath reports into (create it with [`super::registry::metrics`] for the
    /// datapath's mode before building the datapath); `None`: the agent creates one.
    pub metrics: Option<Metrics>,
    /// `detectLocalMode: NodeCIDR`: the pod CIDRs the datapath was built with. When the Node's
    /// `spec.podCIDRs` later differ, the process exits 1 so that it restarts with the new ones
    /// (upstream's `NodePodCIDRHandler`). `None`: not watched.
    pub exit_on_pod_cidr_change: Option<Vec<IpNet>>,
    /// `nodePortAddresses: primary`: the node's IPs the datapath was built with
    /// (`NodeIps::known` at start-up). When the Node lists other IPs, the process exits 1 so
    /// that it restarts with them, as upstream's `NodeManager` does (upstream exits on a node
    /// IP change in every mode; kproxy only where `primary` made the datapath depend on them,
    /// its other uses of the node IPs follow the Node). `None`: not watched.
    pub exit_on_node_ips_change: Option<Vec<IpAddr>>,
    /// The requester the datapath was built with (syncs it asks for on its own, e.g. the
    /// iptables canary monitor's); `None`: only source changes and the period trigger syncs.
    pub resync: Option<SyncRequester>,
}

impl AgentOptions {
    /// Options with upstream's defaults for everything but the essentials; servers disabled
    /// (tests and `main` set the bind addresses they want).
    pub fn new(node_name: impl Into<String>, source: SourceConfig, runner: RunnerConfig) -> Self {
        AgentOptions {
            node_name: node_name.into(),
            source,
            runner,
            healthz_bind: None,
            metrics_bind: None,
            bind_address: None,
            node_port_addresses: vec![],
            oom_score_adj: None,
            metrics: None,
            exit_on_pod_cidr_change: None,
            exit_on_node_ips_change: None,
            resync: None,
        }
    }

    /// The health timeout: 2 × syncPeriod, as kube-proxy passes to its health server.
    pub(crate) fn health_timeout(&self) -> Duration {
        self.runner.max_interval * 2
    }
}

/// Upstream's default `--healthz-bind-address`.
pub const DEFAULT_HEALTHZ_BIND: &str = "0.0.0.0:10256";
/// Upstream's default `--metrics-bind-address`.
pub const DEFAULT_METRICS_BIND: &str = "127.0.0.1:10249";
/// Upstream's default `--oom-score-adj`.
pub const DEFAULT_OOM_SCORE_ADJ: i32 = -999;

/// Capacity of the source → runner event channel (sources wait when the runner is busy).
const EVENT_QUEUE: usize = 1024;

/// Starts the source for `spec`, sending into `tx`.
pub async fn start_source(
    spec: &SourceConfig,
    node_name: &str,
    tx: mpsc::Sender<Event>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    Ok(match spec {
        SourceConfig::Manifests(path) => {
            info!(path = %path.display(), "standalone mode: reading services from manifests");
            source::manifests::spawn(path.clone(), node_name.to_owned(), tx)
        }
        SourceConfig::Kube { kubeconfig, master } => {
            let client = source::kube::client(kubeconfig.as_deref(), master.as_deref()).await?;
            source::kube::spawn(client, node_name.to_owned(), tx)
        }
    })
}

/// The healthz and metrics servers an agent runs (each `None`: disabled).
struct Servers {
    healthz: Option<SocketAddr>,
    metrics: Option<SocketAddr>,
    health: HealthHandle,
    metrics_handle: Metrics,
}

impl Servers {
    async fn start(self) -> (Option<Served>, Option<Served>) {
        let healthz = match self.healthz {
            Some(addr) => Some(
                crate::observe::health::server::start(
                    addr,
                    self.health,
                    self.metrics_handle.clone(),
                )
                .await,
            ),
            None => None,
        };
        let metrics = match self.metrics {
            Some(addr) => {
                Some(crate::observe::metrics::server::start(addr, self.metrics_handle).await)
            }
            None => None,
        };
        (healthz, metrics)
    }
}

/// Tells once that the sync loop started (its datapath arrived).
struct LoopStart(std::sync::Mutex<Option<oneshot::Sender<()>>>);

impl crate::sync::SyncObserver for LoopStart {
    fn loop_started(&self, _now: std::time::SystemTime) {
        let started = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(tx) = started {
            let _ = tx.send(());
        }
    }
}

/// A task aborted when this is dropped (the servers started late, which it owns).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The datapath an agent starts with: built, or still being built.
enum Datapath {
    Ready(Box<dyn Dataplane>),
    Building(oneshot::Receiver<Box<dyn Dataplane>>),
}

/// A running agent: its status, and the task that returns the datapath when it stops.
pub struct Agent {
    pub status: watch::Receiver<RunnerStatus>,
    /// `None` when the loop stopped before a datapath under construction arrived.
    pub task: tokio::task::JoinHandle<Option<Box<dyn Dataplane>>>,
    /// The metrics every part reports into.
    pub metrics: Metrics,
    /// The proxy's health (what `/healthz` and `/livez` answer from).
    pub health: HealthHandle,
    /// The node's IPs, updated when the Node object changes.
    pub node_ips: watch::Receiver<NodeIps>,
    /// The node's own Node object as last seen (`None`: not known).
    pub node: watch::Receiver<Option<Arc<Node>>>,
    source: tokio::task::JoinHandle<()>,
    tap: tokio::task::JoinHandle<()>,
    /// `None` when the datapath was still being built at start: then the servers start (in
    /// `_later_servers`) once it is there.
    healthz: Option<Served>,
    metrics_server: Option<Served>,
    _later_servers: Option<AbortOnDrop>,
    _health_checks: ServiceHealthServers,
}

impl Agent {
    /// Starts the source, the sync loop and the servers; the loop stops when `shutdown`
    /// resolves.
    pub async fn start(
        opts: AgentOptions,
        dataplane: Box<dyn Dataplane>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Agent> {
        let metrics = opts
            .metrics
            .clone()
            .unwrap_or_else(|| super::registry::metrics(dataplane.mode()));
        Self::start_with(opts, metrics, Datapath::Ready(dataplane), shutdown).await
    }

    /// [`Agent::start`] while the datapath is still being built: the source starts listing
    /// at once and the tracker folds what it lists; the datapath arrives on `dataplane`, and
    /// the first sync runs once it is there (and every source listed). `metrics` are those
    /// the datapath reports into (its mode's). When the sender is dropped, [`Agent::wait`]
    /// fails; the builder's error says why.
    pub(crate) async fn start_building(
        opts: AgentOptions,
        metrics: Metrics,
        dataplane: oneshot::Receiver<Box<dyn Dataplane>>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Agent> {
        Self::start_with(opts, metrics, Datapath::Building(dataplane), shutdown).await
    }

    async fn start_with(
        opts: AgentOptions,
        metrics: Metrics,
        dataplane: Datapath,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Agent> {
        if let Some(adj) = opts.oom_score_adj
            && let Err(e) = super::process::apply_oom_score_adj(adj)
        {
            warn!(oom_score_adj = adj, error = %e, "cannot set the OOM score adjustment");
        }
        let families = metrics.families().to_vec();
        let standalone = matches!(opts.source, SourceConfig::Manifests(_));
        let health = HealthHandle::new(
            opts.health_timeout(),
            &families,
            if standalone {
                NodeEligibility::Standalone
            } else {
                NodeEligibility::Unknown
            },
        );

        let (source_tx, source_rx) = mpsc::channel(EVENT_QUEUE);
        let (client, source) = match &opts.source {
            SourceConfig::Manifests(path) => {
                info!(path = %path.display(), "standalone mode: reading services from manifests");
                let task =
                    source::manifests::spawn(path.clone(), opts.node_name.clone(), source_tx);
                (None, task)
            }
            SourceConfig::Kube { kubeconfig, master } => {
                let client = source::kube::client(kubeconfig.as_deref(), master.as_deref()).await?;
                let task = source::kube::spawn(client.clone(), opts.node_name.clone(), source_tx);
                (Some(client), task)
            }
        };
        let events = Events::new(client, &opts.node_name);
        events.starting();

        let initial_ips = detect_node_ips(&[], opts.bind_address);
        let (ips_tx, node_ips) = watch::channel(initial_ips);
        let (node_tx, node) = watch::channel(None);
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        let tap = tokio::spawn(node_tap(
            source_rx,
            tx,
            NodeTap {
                node_name: opts.node_name.clone(),
                bind_address: opts.bind_address,
                health: health.clone(),
                metrics: metrics.clone(),
                ips_tx,
                node_tx,
                pod_cidrs: opts.exit_on_pod_cidr_change.clone(),
                primary_ips: opts.exit_on_node_ips_change.clone(),
            },
        ));

        let health_checks =
            ServiceHealthServers::start(health.clone(), events, opts.node_port_addresses.clone());
        let tracker = Tracker::new(opts.node_name.clone());
        let building = matches!(dataplane, Datapath::Building(_));
        let mut runner = match dataplane {
            Datapath::Ready(dp) => Runner::new(opts.runner, tracker, dp),
            Datapath::Building(rx) => Runner::deferred(opts.runner, tracker, rx),
        };
        if let Some(r) = &opts.resync {
            runner.set_requester(r.clone());
        }
        runner.observe(Arc::new(health.clone()));
        runner.observe(Arc::new(SyncMetrics::new(metrics.clone())));
        runner.observe(Arc::new(health_checks.observer()));
        let status = runner.status();

        let servers = Servers {
            healthz: opts.healthz_bind,
            metrics: opts.metrics_bind,
            health: health.clone(),
            metrics_handle: metrics.clone(),
        };
        // The servers listen once the datapath exists (as they did when it was built first):
        // `/healthz` and `/proxyMode` never answer for a datapath still loading.
        let (healthz, metrics_server, later) = if building {
            let (started, at_start) = oneshot::channel();
            runner.observe(Arc::new(LoopStart(std::sync::Mutex::new(Some(started)))));
            let later = tokio::spawn(async move {
                if at_start.await.is_ok() {
                    let _serving = servers.start().await;
                    std::future::pending::<()>().await;
                }
            });
            (None, None, Some(AbortOnDrop(later)))
        } else {
            let (h, m) = servers.start().await;
            (h, m, None)
        };
        let task = tokio::spawn(runner.run_deferred(rx, shutdown));
        Ok(Agent {
            status,
            task,
            metrics,
            health,
            node_ips,
            node,
            source,
            tap,
            healthz,
            metrics_server,
            _later_servers: later,
            _health_checks: health_checks,
        })
    }

    /// Where the healthz server listens (once bound).
    pub fn healthz_addr(&self) -> Option<SocketAddr> {
        self.healthz.as_ref().and_then(|s| s.local_addr)
    }

    /// Where the metrics server listens (once bound).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server.as_ref().and_then(|s| s.local_addr)
    }

    /// Waits for the sync loop to stop; stops the source and the servers; returns the (still
    /// programmed) datapath.
    pub async fn wait(self) -> anyhow::Result<Box<dyn Dataplane>> {
        self.finish()
            .await?
            .ok_or_else(|| anyhow::anyhow!("the agent stopped before its datapath was built"))
    }

    /// [`Agent::wait`], `None` when the loop stopped (shut down) before a datapath under
    /// construction ([`Agent::start_building`]) arrived.
    pub(crate) async fn finish(self) -> anyhow::Result<Option<Box<dyn Dataplane>>> {
        let dp = self.task.await?;
        self.source.abort();
        self.tap.abort();
        Ok(dp)
    }
}

/// Passes events from the source to the sync loop, watching on the way the node's own Node
/// (its eligibility for `/healthz`, its IPs, the object itself) and EndpointSlices' change
/// trigger times (network programming latency).
struct NodeTap {
    node_name: String,
    bind_address: Option<IpAddr>,
    health: HealthHandle,
    metrics: Metrics,
    ips_tx: watch::Sender<NodeIps>,
    node_tx: watch::Sender<Option<Arc<Node>>>,
    pod_cidrs: Option<Vec<IpNet>>,
    primary_ips: Option<Vec<IpAddr>>,
}

async fn node_tap(mut rx: mpsc::Receiver<Event>, tx: mpsc::Sender<Event>, tap: NodeTap) {
    let NodeTap {
        node_name,
        bind_address,
        health,
        metrics,
        ips_tx,
        node_tx,
        pod_cidrs,
        primary_ips,
    } = tap;
    let mut announced = false;
    while let Some(ev) = rx.recv().await {
        match &ev {
            Event::EndpointSlice(Delta::Apply(s)) => metrics.endpoint_slice_seen(s),
            Event::EndpointSlice(Delta::Replace(all) | Delta::Listed(all)) => {
                for s in all {
                    metrics.endpoint_slice_seen(s);
                }
            }
            _ => {}
        }
        // The kube source delivers Node lists whole (`Lists::Whole`); were one streamed, its
        // objects would arrive in `Listed` and its bounds would carry nothing to look at here.
        if let Event::Node(d) = &ev
            && !matches!(d, Delta::ListStart | Delta::ListDone)
        {
            let node = match d {
                Delta::Apply(n) => Some(n),
                Delta::Delete(_) | Delta::ListStart | Delta::ListDone => None,
                Delta::Replace(all) | Delta::Listed(all) => all
                    .iter()
                    .find(|n| n.metadata.name.as_deref() == Some(node_name.as_str())),
            };
            if node.is_none_or(|n| n.metadata.name.as_deref() == Some(node_name.as_str())) {
                health.node_seen(node);
                if let (Some(fixed), Some(n)) = (&pod_cidrs, node) {
                    let now = crate::model::tracker::node_info(n, &node_name).pod_cidrs;
                    if !now.is_empty() && &now != fixed {
                        error!(
                            previous = ?fixed,
                            current = ?now,
                            "using NodeCIDR local-traffic detection, and the Node's podCIDRs \
                             changed; exiting so that kproxy restarts with the new ones"
                        );
                        std::process::exit(1);
                    }
                }
                let raw = node.map(node_ips_of).unwrap_or_default();
                let ips = detect_node_ips(&raw, bind_address);
                if let Some(fixed) = &primary_ips
                    && !raw.is_empty()
                    && ips.known() != *fixed
                {
                    error!(
                        previous = ?fixed,
                        current = ?ips.known(),
                        "NodeIPs changed for the node, and nodePortAddresses is 'primary'; \
                         exiting so that kproxy restarts with the new ones"
                    );
                    std::process::exit(1);
                }
                let changed = ips_tx.send_if_modified(|old| {
                    let changed = *old != ips;
                    *old = ips;
                    changed
                });
                if changed || !announced {
                    announced = true;
                    info!(
                        primary_family = ?ips.primary_family,
                        ipv4 = %ips.ip(IpFamily::V4),
                        ipv6 = %ips.ip(IpFamily::V6),
                        "node IPs"
                    );
                    if ips.primary_is_fallback() {
                        warn!(
                            "can't determine this node's IP, assuming loopback; if this is \
                             incorrect, please set the --bind-address flag"
                        );
                    }
                }
                node_tx.send_replace(node.cloned().map(Arc::new));
            }
        }
        if tx.send(ev).await.is_err() {
            return;
        }
    }
}

/// Upstream's `timeoutForNodePodCIDR`: how long `detectLocalMode: NodeCIDR` waits for the Node
/// to get pod CIDRs before start-up fails.
pub(crate) const NODE_POD_CIDR_TIMEOUT: Duration = Duration::from_secs(300);

/// `detectLocalMode: NodeCIDR`: waits (polling every second, at most `timeout`) until the Node
/// `node_name` has `spec.podCIDRs` (or the legacy `spec.podCIDR`), as upstream waits before it
/// starts its proxier; returns them. From the API server (`spec`'s client) or, standalone,
/// from the Node object in the manifests.
pub(crate) async fn wait_for_pod_cidrs(
    spec: &SourceConfig,
    node_name: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<IpNet>> {
    use kube::Api;
    info!(
        node = node_name,
        "watching for the Node, awaiting podCIDR allocation"
    );
    let api: Option<Api<Node>> = match spec {
        SourceConfig::Kube { kubeconfig, master } => Some(Api::all(
            source::kube::client(kubeconfig.as_deref(), master.as_deref()).await?,
        )),
        SourceConfig::Manifests(_) => None,
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_error = String::from("the Node has no podCIDRs");
    loop {
        let found = match (&api, spec) {
            (Some(api), _) => match api.get_opt(node_name).await {
                Ok(Some(n)) => Some(crate::model::tracker::node_info(&n, node_name).pod_cidrs),
                Ok(None) => {
                    last_error = format!("Node {node_name:?} does not exist");
                    None
                }
                Err(e) => {
                    last_error = format!("getting Node {node_name:?}: {e}");
                    None
                }
            },
            (None, SourceConfig::Manifests(path)) => match snapshot_from_manifests(path, node_name)
            {
                Ok((snap, _)) => Some(snap.node.pod_cidrs.clone()),
                Err(e) => {
                    last_error = e.to_string();
                    None
                }
            },
            (None, SourceConfig::Kube { .. }) => unreachable!("a kube source has a client"),
        };
        if let Some(cidrs) = found {
            if !cidrs.is_empty() {
                info!(node = node_name, pod_cidrs = ?cidrs, "NodeInfo");
                return Ok(cidrs);
            }
            last_error = format!("Node {node_name:?} has no spec.podCIDRs yet");
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "timeout waiting for PodCIDR allocation to configure detect-local-mode NodeCIDR \
                 ({last_error})"
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// How long [`node_ips_at_start`] waits for the Node to exist and list an IP (upstream's
/// `NodeManager` waits "some amount of time" for the node IPs, then goes on without them).
pub(crate) const NODE_IPS_TIMEOUT: Duration = Duration::from_secs(30);

/// The node's IPs at start-up, for `nodePortAddresses: primary` (upstream `NewProxyServer`:
/// `detectNodeIPs` over the Node object's IPs and `bindAddress`): polls the Node (from the API
/// server, or the manifests) every second until it lists an IP, at most `timeout`; then goes
/// on without it (loopback: [`NodeIps::known`] is empty), warning as upstream does.
pub(crate) async fn node_ips_at_start(
    spec: &SourceConfig,
    node_name: &str,
    bind_address: Option<IpAddr>,
    timeout: Duration,
) -> NodeIps {
    use kube::Api;
    let api: Option<Api<Node>> = match spec {
        SourceConfig::Kube { kubeconfig, master } => {
            match source::kube::client(kubeconfig.as_deref(), master.as_deref()).await {
                Ok(c) => Some(Api::all(c)),
                Err(e) => {
                    warn!(error = %e, "cannot reach the API server for the node's IPs");
                    None
                }
            }
        }
        SourceConfig::Manifests(_) => None,
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let raw = loop {
        let raw = match (&api, spec) {
            // A list by name, not a get: the agent's role lists and watches Nodes only.
            (Some(api), _) => api
                .list(
                    &kube::api::ListParams::default().fields(&format!("metadata.name={node_name}")),
                )
                .await
                .ok()
                .and_then(|l| l.items.into_iter().next())
                .map(|n| node_ips_of(&n))
                .unwrap_or_default(),
            (None, SourceConfig::Manifests(path)) => source::manifests::read(path)
                .ok()
                .and_then(|(m, _)| {
                    m.nodes
                        .into_iter()
                        .find(|n| n.metadata.name.as_deref() == Some(node_name))
                })
                .map(|n| node_ips_of(&n))
                .unwrap_or_default(),
            (None, SourceConfig::Kube { .. }) => vec![],
        };
        if !raw.is_empty() || api.is_none() || tokio::time::Instant::now() >= deadline {
            break raw;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let ips = detect_node_ips(&raw, bind_address);
    if ips.primary_is_fallback() {
        warn!(
            node = node_name,
            "can't determine this node's IP, assuming loopback; if this is incorrect, please \
             set the --bind-address flag"
        );
    }
    ips
}

/// Lists Services and EndpointSlices (all namespaces, upstream's label selector
/// [`source::PROXYABLE_LABEL_SELECTOR`]) and the Node `node_name` once from the API server,
/// and builds the snapshot the agent's tracker would (for `kproxy inspect`). Returns the
/// snapshot and the model's warnings.
pub(crate) async fn snapshot_from_api(
    kubeconfig: Option<&std::path::Path>,
    master: Option<&str>,
    node_name: &str,
) -> anyhow::Result<(Arc<Snapshot>, Vec<String>)> {
    use k8s_openapi::api::core::v1::Service;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use kube::Api;
    use kube::api::ListParams;
    let client = source::kube::client(kubeconfig, master).await?;
    let proxyable = ListParams::default().labels(source::PROXYABLE_LABEL_SELECTOR);
    let services = Api::<Service>::all(client.clone())
        .list(&proxyable)
        .await
        .map_err(|e| anyhow::anyhow!("listing Services: {e}"))?
        .items;
    let slices = Api::<EndpointSlice>::all(client.clone())
        .list(&proxyable)
        .await
        .map_err(|e| anyhow::anyhow!("listing EndpointSlices: {e}"))?
        .items;
    let node = Api::<Node>::all(client)
        .get_opt(node_name)
        .await
        .map_err(|e| anyhow::anyhow!("getting Node {node_name:?}: {e}"))?;
    let mut tracker = Tracker::new(node_name);
    let mut problems = vec![];
    for ev in [
        Event::Node(Delta::Replace(node.into_iter().collect())),
        Event::Service(Delta::Replace(services)),
        Event::EndpointSlice(Delta::Replace(slices)),
    ] {
        problems.extend(tracker.apply(ev).iter().map(ModelWarning::to_string));
    }
    let (snap, _) = tracker.snapshot();
    Ok((snap, problems))
}

/// Reads manifests once and builds the snapshot they describe (for `kproxy render`).
/// Returns the snapshot and every problem found (manifest documents and model warnings).
pub fn snapshot_from_manifests(
    path: &std::path::Path,
    node_name: &str,
) -> anyhow::Result<(Arc<Snapshot>, Vec<String>)> {
    let (m, errors) = source::manifests::read(path)
        .map_err(|e| anyhow::anyhow!("cannot read manifests {}: {e}", path.display()))?;
    let mut problems: Vec<String> = errors.iter().map(ToString::to_string).collect();
    let mut tracker = Tracker::new(node_name);
    for ev in source::manifests::events(m, node_name) {
        problems.extend(tracker.apply(ev).iter().map(ModelWarning::to_string));
    }
    let (snap, _) = tracker.snapshot();
    Ok((snap, problems))
}

/// Runs the agent as `kproxy` without a subcommand does, until SIGTERM / SIGINT: waits for
/// what the datapath needs from the Node (its pod CIDRs with `detectLocalMode: NodeCIDR`, its
/// primary IPs with `nodePortAddresses: primary`), chooses and builds the mode (a forced one
/// while the first lists run, `start_while_building`), serves, syncs.
pub fn run(cfg: &ProxyConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    rt.block_on(async {
        // NodeCIDR local-traffic detection needs the Node's podCIDRs before the datapath is
        // built (upstream waits for them too).
        let pod_cidrs = if cfg.detect_local == DetectLocal::NodeCidr {
            Some(
                wait_for_pod_cidrs(&cfg.source.clone(), &cfg.node_name, NODE_POD_CIDR_TIMEOUT)
                    .await?,
            )
        } else {
            None
        };
        // Signal handlers from here on (while waiting above, SIGTERM simply ends the process).
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        let shutdown = async move {
            let sig = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            info!(signal = sig, "stopping; the datapath stays programmed");
        };
        let resync = crate::sync::SyncRequester::default();
        let bind = (!cfg.bind_address.is_unspecified()).then_some(cfg.bind_address);
        let mut cfg = cfg.clone();
        if registry::may_run_primary(&cfg) {
            let ips = node_ips_at_start(&cfg.source, &cfg.node_name, bind, NODE_IPS_TIMEOUT).await;
            cfg.primary_node_ips = ips.known();
        }
        let cfg = &cfg;
        // A forced mode is built while the agent lists (see `start`); detection builds first,
        // since a mode that fails to build falls back to the next one (other metrics).
        let (built, mode, metrics) = match cfg.mode {
            crate::config::ModeChoice::Forced(mode) => (None, mode, registry::metrics(mode)),
            crate::config::ModeChoice::Detect => {
                let (dp, metrics) =
                    registry::select(cfg, pod_cidrs.as_deref().unwrap_or_default(), &resync)?;
                let mode = dp.mode();
                (Some(dp), mode, metrics)
            }
        };
        let mut opts = AgentOptions::new(
            cfg.node_name.clone(),
            cfg.source.clone(),
            registry::runner_config(cfg, mode),
        );
        opts.healthz_bind = cfg.healthz_bind_address;
        opts.metrics_bind = cfg.metrics_bind_address;
        opts.bind_address = (!cfg.bind_address.is_unspecified()).then_some(cfg.bind_address);
        opts.node_port_addresses = registry::node_port_cidrs(cfg, mode);
        if registry::runs_primary(cfg, mode) {
            opts.exit_on_node_ips_change = Some(cfg.primary_node_ips.clone());
        }
        info!(
            %mode,
            node_port_addresses = ?opts.node_port_addresses,
            "NodePorts accepted on the node's addresses inside these CIDRs (none: every address)"
        );
        opts.oom_score_adj = Some(cfg.oom_score_adj);
        opts.metrics = Some(metrics.clone());
        opts.exit_on_pod_cidr_change = pod_cidrs.clone();
        opts.resync = Some(resync.clone());
        info!(%mode, node = %opts.node_name, "kproxy starting");
        let agent = match built {
            Some(dp) => Agent::start(opts, dp, shutdown).await?,
            None => {
                start_while_building(opts, mode, cfg, pod_cidrs, metrics, resync, shutdown).await?
            }
        };
        // Stopped while the datapath was being built: nothing was programmed, nothing to keep.
        agent.finish().await?;
        info!("stopped");
        Ok(())
    })
}

/// Starts the agent while `mode`'s datapath is built on a blocking thread (after the other
/// modes' leftovers are removed, [`registry::build_cleaned`]): the Service, EndpointSlice and
/// Node lists run meanwhile, and the first sync waits for both. A failed build ends the agent
/// with its error.
async fn start_while_building(
    opts: AgentOptions,
    mode: crate::dataplane::ProxyMode,
    cfg: &ProxyConfig,
    pod_cidrs: Option<Vec<IpNet>>,
    metrics: Metrics,
    resync: crate::sync::SyncRequester,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Agent> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let agent = Agent::start_building(opts, metrics.clone(), rx, shutdown).await?;
    let cfg = cfg.clone();
    let built = tokio::task::spawn_blocking(move || {
        registry::build_cleaned(
            mode,
            &cfg,
            pod_cidrs.as_deref().unwrap_or_default(),
            &metrics,
            &resync,
        )
    })
    .await
    .context("building the datapath panicked")?
    .with_context(|| format!("--proxy-mode={mode}"))?;
    // The loop only stops before taking it on shutdown.
    let _ = tx.send(built);
    Ok(agent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(dir: &std::path::Path, spec: &str) -> std::path::PathBuf {
        let path = dir.join("node.yaml");
        std::fs::write(
            &path,
            format!("apiVersion: v1\nkind: Node\nmetadata: {{name: n1}}\nspec: {spec}\n"),
        )
        .unwrap();
        path
    }

    #[tokio::test]
    async fn waiting_for_pod_cidrs_returns_them_or_times_out_naming_why() {
        let dir = std::env::temp_dir().join(format!("kproxy-podcidr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let with = manifest(&dir, "{podCIDRs: [10.244.1.0/24, \"fd00:244:1::/64\"]}");
        let got = wait_for_pod_cidrs(&SourceConfig::Manifests(with), "n1", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            got,
            vec![
                "10.244.1.0/24".parse::<IpNet>().unwrap(),
                "fd00:244:1::/64".parse().unwrap()
            ]
        );
        let without = manifest(&dir, "{}");
        let err = wait_for_pod_cidrs(
            &SourceConfig::Manifests(without),
            "n1",
            Duration::from_millis(1500),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("timeout waiting for PodCIDR allocation")
                && err.contains("\"n1\" has no spec.podCIDRs"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
