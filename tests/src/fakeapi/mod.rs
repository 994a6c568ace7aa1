//! A fake Kubernetes API server speaking real list/watch over HTTP, for Services,
//! EndpointSlices, Nodes and (events.k8s.io/v1) Events — enough for kube-rs (and so kproxy's
//! kube source and event recorder) to run against.
//!
//! ```no_run
//! # async fn demo() -> anyhow::Result<()> {
//! use kproxy_tests::fakeapi::FakeApi;
//! let api = FakeApi::start().await?;          // http://127.0.0.1:<port>
//! # let svc = k8s_openapi::api::core::v1::Service::default();
//! api.create(&svc)?;                           // assigns resourceVersion, uid, creationTimestamp
//! api.compact();                               // watches from older versions now get 410
//! api.restart().await?;                        // same port, every connection dropped
//! # Ok(()) }
//! ```
//!
//! What it serves (`store` holds the semantics, `server` the HTTP side):
//! - `GET` collections (all namespaces or one): a `<Kind>List` with `metadata.resourceVersion`,
//!   `limit`/`continue` paging consistent at the first page's version, `labelSelector`,
//!   `fieldSelector` (`metadata.name`, `metadata.namespace`), `resourceVersion` (+`Exact`);
//!   a version older than the kept history is a 410 `Status`.
//! - `watch=true`: JSON lines `{"type":…,"object":…}` after `resourceVersion`; objects that start
//!   or stop matching the selectors are ADDED/DELETED; BOOKMARKs with `allowWatchBookmarks`;
//!   `timeoutSeconds`; an expired version is an `ERROR` event with a 410 `Status`, then the end
//!   of the stream — as the real server does.
//! - `GET`/`PUT`/`PATCH` (JSON merge patch)/`DELETE` of one object, `POST` to a collection.
//!
//! The handle's control API drives the rest: typed create/update/delete, [`FakeApi::compact`],
//! [`FakeApi::disconnect_watches`], [`FakeApi::stop`]/[`FakeApi::restart`],
//! [`FakeApi::set_watch_delay`], [`FakeApi::fail_next`] and [`FakeApi::requests`] (a log of
//! every request served).

mod kinds;
mod params;
mod selector;
mod server;
mod status;
mod store;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub use kinds::{FakeResource, Kind};
pub use selector::{FieldSelector, LabelSelector, SelectorError};
pub use server::RequestRecord;
pub use status::ApiError;

use server::Shared;

/// A running (or stopped) fake API server. Clones share the server; it stops when the last
/// clone is dropped.
#[derive(Clone)]
pub struct FakeApi {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    port: u16,
    /// The accept loop while the server runs (it owns every connection).
    server: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self
            .server
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

impl FakeApi {
    /// Starts an empty server on 127.0.0.1 with a free port.
    pub async fn start() -> anyhow::Result<FakeApi> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .context("binding the fake API server")?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared::new());
        let task = server::serve(listener, shared.clone());
        Ok(FakeApi {
            inner: Arc::new(Inner {
                shared,
                port,
                server: Mutex::new(Some(task)),
            }),
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.inner.port)
    }

    pub fn port(&self) -> u16 {
        self.inner.port
    }

    /// Writes a kubeconfig whose current context points at this server (no credentials).
    pub fn write_kubeconfig(&self, path: &Path) -> anyhow::Result<()> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(path, text).with_context(|| format!("writing kubeconfig {}", path.display()))
    }

    // ---- objects ----

    /// Creates an object (namespace `default` if it has none); returns it as stored.
    pub fn create<K: FakeResource>(&self, obj: &K) -> Result<K, ApiError> {
        let v = to_value(obj)?;
        from_value(
            self.inner
                .shared
                .with_store(|s| s.create(K::KIND, v, None))?,
        )
    }

    /// Replaces an existing object (its resourceVersion is not checked); an update that
    /// changes nothing keeps the version and sends no watch event.
    pub fn update<K: FakeResource>(&self, obj: &K) -> Result<K, ApiError> {
        let v = to_value(obj)?;
        from_value(
            self.inner
                .shared
                .with_store(|s| s.update(K::KIND, v, None, false))?,
        )
    }

    /// Creates or updates.
    pub fn apply<K: FakeResource>(&self, obj: &K) -> Result<K, ApiError> {
        let v = to_value(obj)?;
        from_value(
            self.inner
                .shared
                .with_store(|s| match s.create(K::KIND, v.clone(), None) {
                    Err(e) if e.code == 409 => s.update(K::KIND, v, None, false),
                    r => r,
                })?,
        )
    }

    /// Deletes an object (`namespace` is ignored for Nodes); returns its last state.
    pub fn delete<K: FakeResource>(&self, namespace: &str, name: &str) -> Result<K, ApiError> {
        from_value(
            self.inner
                .shared
                .with_store(|s| s.delete(K::KIND, Some(namespace), name))?,
        )
    }

    pub fn get<K: FakeResource>(&self, namespace: &str, name: &str) -> Option<K> {
        let v = self
            .inner
            .shared
            .with_store(|s| s.get(K::KIND, Some(namespace), name).cloned())?;
        from_value(v).ok()
    }

    /// Every object of kind `K`, ordered by namespace and name.
    pub fn list<K: FakeResource>(&self) -> Vec<K> {
        let all = self
            .inner
            .shared
            .with_store(|s| s.matching(K::KIND, &Default::default()));
        all.into_iter().filter_map(|v| from_value(v).ok()).collect()
    }

    /// The latest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.inner.shared.with_store(|s| s.resource_version())
    }

    // ---- history, connections, failures ----

    /// Forgets the history: watches and lists from any earlier version get 410 Expired, and
    /// open watches that have not yet sent everything up to now end with an ERROR 410 event.
    pub fn compact(&self) {
        self.inner.shared.with_store(|s| s.compact());
    }

    /// Cuts every open watch stream mid-body (as a dropped connection would).
    pub fn disconnect_watches(&self) {
        self.inner.shared.disconnect_watches();
    }

    pub fn is_running(&self) -> bool {
        self.inner
            .server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Stops serving: the port is closed and every connection dropped. Objects and history
    /// stay (the control API keeps working while stopped).
    pub async fn stop(&self) {
        let task = self
            .inner
            .server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
        self.inner.shared.disconnect_watches();
    }

    /// Stops (if running) and serves again on the same port, history kept.
    pub async fn restart(&self) -> anyhow::Result<()> {
        self.stop().await;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.inner.port));
        let mut attempt = 0;
        let listener = loop {
            match TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) if attempt < 100 => {
                    attempt += 1;
                    tracing::debug!(error = %e, "fake API: port not free yet");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("re-binding the fake API server on {addr}"));
                }
            }
        };
        let task = server::serve(listener, self.inner.shared.clone());
        *self.inner.server.lock().unwrap_or_else(|e| e.into_inner()) = Some(task);
        Ok(())
    }

    /// Like a restarted API server with a fresh watch cache: stops, forgets the history
    /// ([`FakeApi::compact`]) and serves again on the same port.
    pub async fn restart_losing_history(&self) -> anyhow::Result<()> {
        self.stop().await;
        self.compact();
        self.restart().await
    }

    /// Delays every watch event by `delay` (a slow watch); zero turns it off.
    pub fn set_watch_delay(&self, delay: Duration) {
        self.inner.shared.knobs().watch_delay = delay;
    }

    /// How often idle watches that asked for bookmarks get one (default 5 s; applies to
    /// watches started afterwards).
    pub fn set_bookmark_interval(&self, every: Duration) {
        self.inner.shared.knobs().bookmark_interval = every;
    }

    /// Answers the next `n` requests (any path) with HTTP `code` and a matching `Status`.
    pub fn fail_next(&self, n: usize, code: u16) {
        self.inner
            .shared
            .knobs()
            .fail
            .extend(std::iter::repeat_n(code, n));
    }

    /// Answers every request for `kind` with 404, as an API server that does not serve it.
    pub fn set_unserved(&self, kind: Kind) {
        self.inner.shared.knobs().unserved.push(kind);
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.inner.shared.log().clone()
    }

    pub fn clear_requests(&self) {
        self.inner.shared.log().clear();
    }
}

fn to_value<K: FakeResource>(obj: &K) -> Result<Value, ApiError> {
    serde_json::to_value(obj)
        .map_err(|e| ApiError::bad_request(format!("{} does not serialize: {e}", K::KIND.name())))
}

fn from_value<K: FakeResource>(v: Value) -> Result<K, ApiError> {
    serde_json::from_value(v).map_err(|e| {
        ApiError::new(
            500,
            format!("stored {} does not decode: {e}", K::KIND.name()),
        )
    })
}
