//! Kubernetes API source: Services and EndpointSlices (all namespaces, filtered by
//! [`PROXYABLE_LABEL_SELECTOR`]), the node's own Node (field selector `metadata.name`) and,
//! when the API server serves them, `ServiceCIDR`s (networking.k8s.io/v1; upstream watches them
//! while its `MultiCIDRServiceAllocator` gate is on, the default since they went GA), watched
//! with kube-runtime's [`watcher()`] and turned into [`Event`]s.
//!
//! Each kind runs its own list+watch loop. kube-runtime reports a (re-)list as
//! `Init, InitApply…, InitDone`; `Relist` buffers that sequence and emits it as ONE
//! [`Delta::Replace`], so the tracker swaps the whole state at once — after the initial list
//! and after every re-list (410 Gone, a watch that cannot be resumed). Watch events become
//! [`Delta::Apply`] / [`Delta::Delete`]. Errors are logged and retried (none is fatal) by
//! [`super::retry`]'s policy: a jittered backoff capped at 5 s, and a 410 Gone answered by an
//! immediate re-list — so a returning API server is relisted within seconds (client-go's
//! reflector and kube-runtime's default backoff wait up to 30 s, plus a backoff after the 410).
//! The loops stop when the event channel is closed.

use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ::kube::api::Api;
use ::kube::config::{Config, KubeConfigOptions, Kubeconfig, KubeconfigError};
use ::kube::runtime::watcher::{self, watcher};
use ::kube::{Client, Resource};
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::PROXYABLE_LABEL_SELECTOR;
use super::retry::{Next, Retry};
use crate::model::input::{Delta, Event};

/// Why no API client could be built.
#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error("invalid --master URL {url:?}: {reason}")]
    MasterUrl { url: String, reason: String },
    #[error("cannot load kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error(
        "no API server configured (no --kubeconfig or --master given): in-cluster config: {in_cluster}; \
         default kubeconfig ($KUBECONFIG or ~/.kube/config): {kubeconfig}"
    )]
    NoConfig {
        in_cluster: String,
        kubeconfig: String,
    },
    #[error("cannot create a client for API server {url}: {source}")]
    Client {
        url: String,
        #[source]
        source: ::kube::Error,
    },
}

/// Client from (in order): `master` overriding the server URL, a kubeconfig file, in-cluster
/// config, the default kubeconfig. Errors name what was tried.
///
/// As upstream's `BuildConfigFromFlags`: with `master` and no kubeconfig the client talks to
/// `master` without credentials; with both, the kubeconfig's credentials are used against
/// `master`; with neither, in-cluster config is tried first, then `$KUBECONFIG` /
/// `~/.kube/config`.
pub async fn client(
    kubeconfig: Option<&Path>,
    master: Option<&str>,
) -> Result<Client, KubeSourceError> {
    let master = master
        .filter(|m| !m.is_empty())
        .map(master_config)
        .transpose()?;
    let config = match (kubeconfig, master) {
        (Some(path), master) => {
            let err = |source| KubeSourceError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let kc = Kubeconfig::read_from(path).map_err(err)?;
            let mut config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(err)?;
            if let Some(m) = master {
                config.cluster_url = m.cluster_url;
            }
            config
        }
        (None, Some(m)) => m,
        (None, None) => match Config::incluster() {
            Ok(c) => c,
            Err(in_cluster) => Config::from_kubeconfig(&KubeConfigOptions::default())
                .await
                .map_err(|kubeconfig| KubeSourceError::NoConfig {
                    in_cluster: in_cluster.to_string(),
                    kubeconfig: kubeconfig.to_string(),
                })?,
        },
    };
    let url = config.cluster_url.to_string();
    info!(server = %url, "connecting to the API server");
    Client::try_from(config).map_err(|source| KubeSourceError::Client { url, source })
}

/// A credential-less config for the server at `master`.
fn master_config(master: &str) -> Result<Config, KubeSourceError> {
    match master.parse() {
        Ok(uri) => Ok(Config::new(uri)),
        Err(e) => Err(KubeSourceError::MasterUrl {
            url: master.to_owned(),
            reason: e.to_string(),
        }),
    }
}

/// Watches Services and EndpointSlices (all namespaces, label selector
/// [`PROXYABLE_LABEL_SELECTOR`]) and the Node named `node_name` (field selector
/// `metadata.name=<node>`), sending Events into `tx` until tx is closed.
pub fn spawn(
    client: Client,
    node_name: String,
    tx: mpsc::Sender<Event>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let proxyable = watcher::Config::default().labels(PROXYABLE_LABEL_SELECTOR);
        let this_node = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let services = run::<Service>(
            Api::all(client.clone()),
            proxyable.clone(),
            Lists::Streamed,
            Event::Service,
            &tx,
        );
        let slices = run::<EndpointSlice>(
            Api::all(client.clone()),
            proxyable,
            Lists::Streamed,
            Event::EndpointSlice,
            &tx,
        );
        let node = run::<Node>(
            Api::all(client.clone()),
            this_node,
            Lists::Whole,
            Event::Node,
            &tx,
        );
        let cidrs = service_cidrs(Api::all(client), &tx);
        tokio::select! {
            _ = futures::future::join4(services, slices, node, cidrs) => {}
            _ = tx.closed() => {}
        }
        debug!("kube source stopped: event channel closed");
    })
}

/// What a probe list of ServiceCIDRs (`limit=1`) says about the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Served {
    /// It serves them: watch them.
    Yes,
    /// It does not (404: an older API server, or the API disabled) or kproxy may not read them
    /// (403: RBAC without `servicecidrs`); the reason, for the log.
    No(String),
    /// No answer (the server is unreachable, 5xx): ask again.
    Unknown,
}

/// Classifies a probe's outcome (pure).
pub(crate) fn served<T>(r: &Result<T, ::kube::Error>) -> Served {
    match r {
        Ok(_) => Served::Yes,
        Err(::kube::Error::Api(s)) if s.code == 404 => {
            Served::No("the API server does not serve networking.k8s.io/v1 ServiceCIDRs".into())
        }
        Err(::kube::Error::Api(s)) if s.code == 403 => Served::No(format!(
            "not allowed to list networking.k8s.io/v1 ServiceCIDRs ({}); grant list/watch on \
             servicecidrs as upstream's system:node-proxier role does",
            s.message
        )),
        Err(_) => Served::Unknown,
    }
}

/// Probes whether the API server serves ServiceCIDRs (retrying until it answers); if so,
/// watches them (one [`Delta::Replace`] per list, they are few). If not, sends nothing: the
/// datapaths keep their configured service CIDRs, and a log line says so.
async fn service_cidrs(api: Api<ServiceCIDR>, tx: &mpsc::Sender<Event>) {
    let mut retry = Retry::new();
    loop {
        let probe = api.list(&::kube::api::ListParams::default().limit(1)).await;
        match served(&probe) {
            Served::Yes => break,
            Served::No(why) => {
                info!(
                    "{why}: the service CIDRs come from the configuration (serviceCIDRs / \
                     --service-cidrs)"
                );
                return;
            }
            Served::Unknown => {
                let wait = match retry.failed(false) {
                    Next::Wait(d) => d,
                    Next::RelistNow => Duration::ZERO,
                };
                if let Err(e) = &probe {
                    debug!(error = %e, retry_in = ?wait, "probing ServiceCIDRs failed; retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = tx.closed() => return,
                }
            }
        }
    }
    info!("watching ServiceCIDRs (networking.k8s.io/v1): they give the service CIDRs");
    run::<ServiceCIDR>(
        api,
        watcher::Config::default(),
        Lists::Whole,
        Event::ServiceCidr,
        tx,
    )
    .await
}

/// How a kind's (re-)lists are delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lists {
    /// One [`Delta::Replace`] holding the whole list (the Node watch: one object).
    Whole,
    /// [`Delta::ListStart`], a [`Delta::Listed`] per object as pages arrive, [`Delta::ListDone`]:
    /// the raw objects of a big list are never all in memory at once.
    Streamed,
}

/// One kind's list+watch loop; returns when `tx` is closed.
async fn run<K>(
    api: Api<K>,
    config: watcher::Config,
    lists: Lists,
    wrap: fn(Delta<K>) -> Event,
    tx: &mpsc::Sender<Event>,
) where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + 'static,
{
    let kind = K::kind(&());
    let start = || -> BoxStream<'static, watcher::Result<watcher::Event<K>>> {
        watcher(api.clone(), config.clone()).boxed()
    };
    let mut stream = start();
    let mut relist = Relist::new(lists);
    let mut retry = Retry::new();
    while let Some(item) = stream.next().await {
        let deltas = match item {
            Ok(ev) => {
                // `Init` comes before the list request: only data shows the server answered.
                if !matches!(ev, watcher::Event::Init) {
                    retry.succeeded();
                }
                relist.push(ev)
            }
            Err(e) => {
                match retry.failed(is_gone(&e)) {
                    Next::RelistNow => {
                        info!(%kind, error = %e, "resource version gone (410), re-listing now");
                        // A fresh watcher starts with a list (kube-runtime keeps re-watching
                        // from the stale version when the watch request itself is answered 410).
                        stream = start();
                    }
                    Next::Wait(d) => {
                        warn!(%kind, error = %e, retry_in = ?d, "list/watch failed; retrying");
                        tokio::time::sleep(d).await;
                    }
                }
                continue;
            }
        };
        for delta in deltas {
            match &delta {
                Delta::Replace(all) => info!(%kind, objects = all.len(), "listed"),
                Delta::ListDone => info!(%kind, objects = relist.listed, "listed"),
                Delta::Apply(o) => debug!(%kind, name = %display_name(o), "applied"),
                Delta::Delete(o) => debug!(%kind, name = %display_name(o), "deleted"),
                Delta::ListStart | Delta::Listed(_) => {}
            }
            if tx.send(wrap(delta)).await.is_err() {
                return;
            }
        }
    }
}

/// A 410 Gone in any form: a watch `ERROR` event, or a list/watch request answered 410.
fn is_gone(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::InitialListFailed(err)
        | watcher::Error::WatchStartFailed(err)
        | watcher::Error::WatchFailed(err) => {
            matches!(err, ::kube::Error::Api(status) if status.code == 410)
        }
        watcher::Error::NoResourceVersion => false,
    }
}

fn display_name<K: Resource>(o: &K) -> String {
    let m = o.meta();
    match &m.namespace {
        Some(ns) => format!("{ns}/{}", m.name.as_deref().unwrap_or("")),
        None => m.name.clone().unwrap_or_default(),
    }
}

/// Objects per [`Delta::Listed`]: kube-runtime's list page size, so a streamed list holds at
/// most about one page of raw objects, and the sync loop handles one event per page rather
/// than per object.
pub(crate) const LIST_BATCH: usize = 500;

/// Folds kube-runtime's watcher events into [`Delta`]s. A re-list (`Init`, `InitApply…`,
/// `InitDone`) becomes one [`Delta::Replace`] ([`Lists::Whole`]) or `ListStart`, a `Listed`
/// per [`LIST_BATCH`] objects, `ListDone` ([`Lists::Streamed`]); `Apply`/`Delete` pass
/// through.
#[derive(Debug)]
pub(crate) struct Relist<K> {
    lists: Lists,
    /// Objects of a re-list in progress not yet passed on; `None` outside one.
    buffer: Option<Vec<K>>,
    /// Objects of the current (or last) streamed list so far.
    pub listed: usize,
}

impl<K> Relist<K> {
    pub(crate) fn new(lists: Lists) -> Self {
        Relist {
            lists,
            buffer: None,
            listed: 0,
        }
    }

    /// The deltas to emit for `ev`, in order (often none).
    pub(crate) fn push(&mut self, ev: watcher::Event<K>) -> Vec<Delta<K>> {
        match (self.lists, ev) {
            // A new Init drops a re-list that failed half-way (streamed: restarts it in the
            // tracker too).
            (lists, watcher::Event::Init) => {
                self.buffer = Some(Vec::new());
                self.listed = 0;
                match lists {
                    Lists::Whole => vec![],
                    Lists::Streamed => vec![Delta::ListStart],
                }
            }
            (lists, watcher::Event::InitApply(obj)) => {
                let buffer = self.buffer.get_or_insert_with(Vec::new);
                buffer.push(obj);
                self.listed += 1;
                if lists == Lists::Streamed && buffer.len() >= LIST_BATCH {
                    vec![Delta::Listed(std::mem::take(buffer))]
                } else {
                    vec![]
                }
            }
            (Lists::Whole, watcher::Event::InitDone) => {
                vec![Delta::Replace(self.buffer.take().unwrap_or_default())]
            }
            (Lists::Streamed, watcher::Event::InitDone) => {
                let rest = self.buffer.take().unwrap_or_default();
                let mut out = Vec::with_capacity(2);
                if !rest.is_empty() {
                    out.push(Delta::Listed(rest));
                }
                out.push(Delta::ListDone);
                out
            }
            (_, watcher::Event::Apply(obj)) => vec![Delta::Apply(obj)],
            (_, watcher::Event::Delete(obj)) => vec![Delta::Delete(obj)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn svc(name: &str) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn names(d: &Delta<Service>) -> (String, Vec<String>) {
        let n = |s: &Service| s.metadata.name.clone().unwrap();
        match d {
            Delta::Apply(s) => ("apply".into(), vec![n(s)]),
            Delta::Delete(s) => ("delete".into(), vec![n(s)]),
            Delta::Replace(v) => ("replace".into(), v.iter().map(n).collect()),
            Delta::ListStart => ("start".into(), vec![]),
            Delta::Listed(v) => ("listed".into(), v.iter().map(n).collect()),
            Delta::ListDone => ("done".into(), vec![]),
        }
    }

    /// The deltas `events` produce, summarized.
    fn run(
        r: &mut Relist<Service>,
        events: Vec<watcher::Event<Service>>,
    ) -> Vec<(String, Vec<String>)> {
        events
            .into_iter()
            .flat_map(|ev| r.push(ev))
            .map(|d| names(&d))
            .collect()
    }

    fn s(kind: &str, objs: &[&str]) -> (String, Vec<String>) {
        (kind.into(), objs.iter().map(|o| o.to_string()).collect())
    }

    #[test]
    fn relist_sequence_becomes_one_replace() {
        let mut r = Relist::new(Lists::Whole);
        let out = run(
            &mut r,
            vec![
                watcher::Event::Init,
                watcher::Event::InitApply(svc("a")),
                watcher::Event::InitApply(svc("b")),
                watcher::Event::InitDone,
            ],
        );
        assert_eq!(out, [s("replace", &["a", "b"])]);
    }

    #[test]
    fn empty_relist_is_an_empty_replace() {
        let mut r = Relist::new(Lists::Whole);
        let out = run(&mut r, vec![watcher::Event::Init, watcher::Event::InitDone]);
        assert_eq!(out, [s("replace", &[])]);
    }

    #[test]
    fn interrupted_relist_is_dropped_on_the_next_init() {
        let mut r = Relist::new(Lists::Whole);
        let out = run(
            &mut r,
            vec![
                watcher::Event::Init,
                watcher::Event::InitApply(svc("stale")),
                watcher::Event::Init,
                watcher::Event::InitApply(svc("fresh")),
                watcher::Event::InitDone,
            ],
        );
        assert_eq!(out, [s("replace", &["fresh"])]);
    }

    #[test]
    fn watch_events_pass_through() {
        for lists in [Lists::Whole, Lists::Streamed] {
            let mut r = Relist::new(lists);
            let out = run(
                &mut r,
                vec![
                    watcher::Event::Apply(svc("a")),
                    watcher::Event::Delete(svc("a")),
                ],
            );
            assert_eq!(out, [s("apply", &["a"]), s("delete", &["a"])]);
        }
    }

    #[test]
    fn streamed_list_is_passed_on_in_pages_and_counted() {
        let mut r = Relist::new(Lists::Streamed);
        let mut events = vec![
            watcher::Event::Init,
            watcher::Event::InitApply(svc("stale")),
            watcher::Event::Init,
        ];
        let names: Vec<String> = (0..LIST_BATCH + 2).map(|i| format!("s{i:04}")).collect();
        events.extend(names.iter().map(|n| watcher::Event::InitApply(svc(n))));
        events.push(watcher::Event::InitDone);
        let out = run(&mut r, events);
        let first: Vec<&str> = names[..LIST_BATCH].iter().map(String::as_str).collect();
        let rest: Vec<&str> = names[LIST_BATCH..].iter().map(String::as_str).collect();
        assert_eq!(
            out,
            [
                s("start", &[]),
                // The interrupted list's object was never passed on.
                s("start", &[]),
                s("listed", &first),
                s("listed", &rest),
                s("done", &[]),
            ]
        );
        assert_eq!(
            r.listed,
            LIST_BATCH + 2,
            "the restarted list's objects only"
        );
    }

    #[test]
    fn service_cidr_probe_answers_are_classified() {
        let status = |code: u16| -> Result<(), ::kube::Error> {
            let s: ::kube::core::Status = serde_json::from_value(serde_json::json!({
                "code": code, "message": "servicecidrs is forbidden"
            }))
            .unwrap();
            Err(::kube::Error::Api(Box::new(s)))
        };
        assert_eq!(served(&Ok::<(), ::kube::Error>(())), Served::Yes);
        assert!(matches!(served(&status(404)), Served::No(why) if why.contains("does not serve")),);
        assert!(
            matches!(served(&status(403)), Served::No(why) if why.contains("servicecidrs is forbidden")),
        );
        assert_eq!(served(&status(503)), Served::Unknown);
        assert_eq!(served(&status(410)), Served::Unknown);
    }

    #[test]
    fn empty_streamed_list_is_start_and_done() {
        let mut r = Relist::new(Lists::Streamed);
        let out = run(&mut r, vec![watcher::Event::Init, watcher::Event::InitDone]);
        assert_eq!(out, [s("start", &[]), s("done", &[])]);
    }
}
