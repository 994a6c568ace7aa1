//! The HTTP side of the fake: request handling (list, get, watch, create, update, delete),
//! the watch stream, failure injection, the request log, and a connection-owning accept loop
//! (so [`super::FakeApi::stop`] really drops every connection, like a dead server).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep, sleep_until};
use tracing::debug;

use super::kinds::{Kind, Target, route};
use super::params::{Filter, Params};
use super::status::ApiError;
use super::store::{Store, WatchEvent, parse_rv};

/// Watches without `timeoutSeconds` end after this long (the real server picks 30–60 min).
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);

/// One request the fake answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    /// The raw query string.
    pub query: String,
    /// The HTTP status answered (200 for a watch stream that started).
    pub status: u16,
}

impl RequestRecord {
    /// A decoded query parameter.
    pub fn param(&self, name: &str) -> Option<String> {
        decode_query(&self.query)
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    pub fn is_watch(&self) -> bool {
        self.method == "GET" && matches!(self.param("watch").as_deref(), Some("true" | "1"))
    }

    /// A GET of a collection without `watch`.
    pub fn is_list(&self) -> bool {
        self.method == "GET"
            && !self.is_watch()
            && route(&self.path).is_some_and(|t| t.name.is_none())
    }

    /// The kind the path addresses, if it is one the fake serves.
    pub fn kind(&self) -> Option<Kind> {
        route(&self.path).map(|t| t.kind)
    }

    /// The Kubernetes authorization verb of this request (`get`, `list`, `watch`, `create`,
    /// `update`, `patch`, `delete`), as RBAC rules name it; `None` for other methods.
    pub fn verb(&self) -> Option<&'static str> {
        let item = route(&self.path).is_some_and(|t| t.name.is_some());
        Some(match self.method.as_str() {
            "GET" if self.is_watch() => "watch",
            "GET" if item => "get",
            "GET" => "list",
            "POST" => "create",
            "PUT" => "update",
            "PATCH" => "patch",
            "DELETE" if item => "delete",
            "DELETE" => "deletecollection",
            _ => return None,
        })
    }
}

fn decode_query(q: &str) -> Vec<(String, String)> {
    let uri: Uri = format!("/?{q}").parse().unwrap_or_default();
    Query::<Vec<(String, String)>>::try_from_uri(&uri)
        .map(|Query(v)| v)
        .unwrap_or_default()
}

/// What watch streams react to.
#[derive(Debug, Clone, Copy, Default)]
pub struct Signal {
    pub rv: u64,
    pub oldest_rv: u64,
    /// Bumped to cut every open watch stream.
    pub disconnects: u64,
}

/// Test-controlled behaviour.
#[derive(Debug, Clone)]
pub struct Knobs {
    pub watch_delay: Duration,
    pub bookmark_interval: Duration,
    /// Requests still to fail, and with which status.
    pub fail: VecDeque<u16>,
    /// Kinds answered 404 as by an API server without them (e.g. ServiceCIDRs before 1.33).
    pub unserved: Vec<Kind>,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            watch_delay: Duration::ZERO,
            bookmark_interval: Duration::from_secs(5),
            fail: VecDeque::new(),
            unserved: vec![],
        }
    }
}

/// State shared by the handle, the handlers and the watch streams.
pub struct Shared {
    store: Mutex<Store>,
    pub signal: watch::Sender<Signal>,
    knobs: Mutex<Knobs>,
    log: Mutex<Vec<RequestRecord>>,
}

impl Shared {
    pub fn new() -> Shared {
        let store = Store::new();
        let signal = Signal {
            rv: store.resource_version(),
            oldest_rv: store.oldest_resource_version(),
            disconnects: 0,
        };
        Shared {
            store: Mutex::new(store),
            signal: watch::Sender::new(signal),
            knobs: Mutex::new(Knobs::default()),
            log: Mutex::new(vec![]),
        }
    }

    /// Runs `f` on the store and wakes the watches if it changed anything.
    pub fn with_store<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let mut store = lock(&self.store);
        let out = f(&mut store);
        let (rv, oldest_rv) = (store.resource_version(), store.oldest_resource_version());
        self.signal.send_if_modified(|s| {
            let changed = (s.rv, s.oldest_rv) != (rv, oldest_rv);
            (s.rv, s.oldest_rv) = (rv, oldest_rv);
            changed
        });
        out
    }

    pub fn knobs(&self) -> MutexGuard<'_, Knobs> {
        lock(&self.knobs)
    }

    pub fn log(&self) -> MutexGuard<'_, Vec<RequestRecord>> {
        lock(&self.log)
    }

    pub fn disconnect_watches(&self) {
        self.signal.send_modify(|s| s.disconnects += 1);
    }
}

impl Default for Shared {
    fn default() -> Self {
        Shared::new()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Accepts connections on `listener` until the returned task is aborted; aborting it drops
/// (and so closes) every connection.
pub fn serve(listener: TcpListener, shared: Arc<Shared>) -> tokio::task::JoinHandle<()> {
    let router = Router::new().fallback(handle).with_state(shared);
    tokio::spawn(async move {
        let mut conns = JoinSet::new();
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    debug!(error = %e, "fake API: accept failed");
                    sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            while conns.try_join_next().is_some() {}
            let service = TowerToHyperService::new(router.clone());
            conns.spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                if let Err(e) = conn.await {
                    debug!(error = %e, "fake API: connection ended with an error");
                }
            });
        }
    })
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let query = uri.query().unwrap_or("").to_owned();
    let unserved = route(&path).is_some_and(|t| shared.knobs().unserved.contains(&t.kind));
    let failure = shared.knobs().fail.pop_front().or(unserved.then_some(404));
    let response = match failure {
        Some(code) => error_response(&ApiError::new(code, format!("injected failure ({code})"))),
        None => match answer(&shared, &method, &path, &query, body) {
            Ok(r) => r,
            Err(e) => error_response(&e),
        },
    };
    shared.log().push(RequestRecord {
        method: method.to_string(),
        path,
        query,
        status: response.status().as_u16(),
    });
    response
}

fn answer(
    shared: &Arc<Shared>,
    method: &Method,
    path: &str,
    query: &str,
    body: Bytes,
) -> Result<Response, ApiError> {
    let Some(Target {
        kind,
        namespace,
        name,
    }) = route(path)
    else {
        return Err(ApiError::new(
            404,
            format!("the server could not find the requested resource ({path})"),
        ));
    };
    let params = Params::parse(&decode_query(query))?;
    let ns = namespace.as_deref();
    match (method.clone(), name) {
        (Method::GET, None) if params.watch => {
            Ok(start_watch(shared.clone(), kind, params.filter(ns), params))
        }
        (Method::GET, None) => Ok(json_response(
            200,
            &shared
                .with_store(|s| s.list(kind, ns, &params))?
                .to_json(kind),
        )),
        (Method::GET, Some(name)) => shared
            .with_store(|s| s.get(kind, ns, &name).cloned())
            .map(|o| json_response(200, &o))
            .ok_or_else(|| ApiError::not_found(kind.plural(), &name)),
        (Method::POST, None) => {
            let obj = parse_body(&body)?;
            Ok(json_response(
                201,
                &shared.with_store(|s| s.create(kind, obj, ns))?,
            ))
        }
        (Method::PUT, Some(name)) => {
            let obj = parse_body(&body)?;
            if obj.pointer("/metadata/name").and_then(Value::as_str) != Some(name.as_str()) {
                return Err(ApiError::bad_request(
                    "the name of the object does not match the name on the URL",
                ));
            }
            Ok(json_response(
                200,
                &shared.with_store(|s| s.update(kind, obj, ns, true))?,
            ))
        }
        (Method::PATCH, Some(name)) => {
            // JSON merge patch (RFC 7386), what kube-rs' event Recorder sends for a series.
            let patch = parse_body(&body)?;
            let updated = shared.with_store(|s| {
                let mut obj = s
                    .get(kind, ns, &name)
                    .cloned()
                    .ok_or_else(|| ApiError::not_found(kind.plural(), &name))?;
                merge_patch(&mut obj, &patch);
                s.update(kind, obj, ns, false)
            })?;
            Ok(json_response(200, &updated))
        }
        (Method::DELETE, Some(name)) => Ok(json_response(
            200,
            &shared.with_store(|s| s.delete(kind, ns, &name))?,
        )),
        (m, _) => Err(ApiError::new(
            405,
            format!("method {m} is not supported on {path}"),
        )),
    }
}

/// RFC 7386: objects merge recursively, `null` removes, anything else replaces.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(p) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let t = target.as_object_mut().expect("made an object above");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

fn parse_body(body: &Bytes) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}")))
}

fn json_response(code: u16, v: &Value) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn error_response(e: &ApiError) -> Response {
    json_response(e.code, &e.to_status())
}

type Chunk = Result<Bytes, std::io::Error>;

/// Answers a watch: 200 with a chunked stream of JSON lines fed by [`run_watch`].
fn start_watch(shared: Arc<Shared>, kind: Kind, filter: Filter, params: Params) -> Response {
    let (tx, rx) = mpsc::channel::<Chunk>(64);
    tokio::spawn(run_watch(shared, kind, filter, params, tx));
    let body = futures::stream::unfold(rx, |mut rx| async { rx.recv().await.map(|c| (c, rx)) });
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(body))
        .expect("static response parts")
}

fn line(v: &Value) -> Chunk {
    let mut s = v.to_string();
    s.push('\n');
    Ok(Bytes::from(s))
}

fn bookmark(kind: Kind, rv: u64, initial_events_end: bool) -> Value {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_events_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"type": "BOOKMARK", "object": {"kind": kind.name(), "apiVersion": kind.api_version(), "metadata": metadata}})
}

fn error_event(e: &ApiError) -> Value {
    json!({"type": "ERROR", "object": e.to_status()})
}

/// Why a watch stream stops.
enum End {
    /// Finished or the client went away: close normally.
    Close,
    /// Cut by the test: end the body with an error (the connection is dropped mid-stream).
    Cut,
    /// The history the stream needs is gone: ERROR 410, then close.
    Expired(ApiError),
}

/// Where a watch stream is.
struct Cursor {
    /// Every change up to this version has been looked at.
    seen: u64,
    /// Every event up to this version has been sent.
    sent: u64,
    pending: VecDeque<WatchEvent>,
    /// When the next pending event may go out (with a watch delay).
    release_at: Option<Instant>,
}

/// Feeds one watch stream until it times out, is cut, expires or the client goes away.
async fn run_watch(
    shared: Arc<Shared>,
    kind: Kind,
    filter: Filter,
    params: Params,
    tx: mpsc::Sender<Chunk>,
) {
    let end = watch_loop(&shared, kind, &filter, &params, &tx).await;
    match end {
        End::Close => {}
        End::Cut => {
            let _ = tx
                .send(Err(std::io::Error::other(
                    "watch cut by the fake API server",
                )))
                .await;
        }
        End::Expired(e) => {
            let _ = tx.send(line(&error_event(&e))).await;
        }
    }
}

async fn watch_loop(
    shared: &Shared,
    kind: Kind,
    filter: &Filter,
    params: &Params,
    tx: &mpsc::Sender<Chunk>,
) -> End {
    let mut signal = shared.signal.subscribe();
    let disconnects = signal.borrow_and_update().disconnects;
    let bookmarks = params.allow_watch_bookmarks;
    let deadline = Instant::now() + params.timeout.unwrap_or(DEFAULT_WATCH_TIMEOUT);
    let bookmark_every = shared.knobs().bookmark_interval;
    let mut next_bookmark = Instant::now() + bookmark_every;

    // Start: from a version (events after it), or from "now" with the current objects as
    // synthetic ADDED events ("" / "0", or sendInitialEvents).
    let start = match params.resource_version.as_deref() {
        None | Some("") | Some("0") => None,
        Some(s) => match parse_rv(s) {
            Ok(rv) => Some(rv),
            Err(e) => return End::Expired(e),
        },
    };
    let mut cursor = match start {
        Some(rv) if !params.send_initial_events => {
            let oldest = shared.with_store(|s| s.oldest_resource_version());
            if rv < oldest {
                return End::Expired(ApiError::expired(format!(
                    "too old resource version: {rv} ({oldest})"
                )));
            }
            Cursor {
                seen: rv,
                sent: rv,
                pending: VecDeque::new(),
                release_at: None,
            }
        }
        _ => {
            let (objects, rv) =
                shared.with_store(|s| (s.matching(kind, filter), s.resource_version()));
            let pending: VecDeque<WatchEvent> = objects
                .into_iter()
                .map(|object| WatchEvent {
                    rv,
                    kind: "ADDED",
                    object,
                })
                .collect();
            if params.send_initial_events {
                for ev in &pending {
                    if tx.send(line(&ev.to_json())).await.is_err() {
                        return End::Close;
                    }
                }
                if bookmarks && tx.send(line(&bookmark(kind, rv, true))).await.is_err() {
                    return End::Close;
                }
                Cursor {
                    seen: rv,
                    sent: rv,
                    pending: VecDeque::new(),
                    release_at: None,
                }
            } else {
                Cursor {
                    seen: rv,
                    sent: rv,
                    pending,
                    release_at: None,
                }
            }
        }
    };

    loop {
        if let Some(ev) = cursor.pending.pop_front() {
            let delay = shared.knobs().watch_delay;
            if !delay.is_zero() {
                let release_at = *cursor
                    .release_at
                    .get_or_insert_with(|| Instant::now() + delay);
                tokio::select! {
                    _ = sleep_until(release_at) => {}
                    _ = tx.closed() => return End::Close,
                    _ = sleep_until(deadline) => return End::Close,
                    changed = signal.changed() => {
                        cursor.pending.push_front(ev);
                        if changed.is_err() {
                            return End::Close;
                        }
                        let s = *signal.borrow_and_update();
                        if s.disconnects != disconnects {
                            return End::Cut;
                        }
                        if cursor.sent < s.oldest_rv {
                            return End::Expired(ApiError::expired(format!(
                                "too old resource version: {} ({})", cursor.sent, s.oldest_rv
                            )));
                        }
                        continue;
                    }
                }
            }
            if tx.send(line(&ev.to_json())).await.is_err() {
                return End::Close;
            }
            cursor.sent = ev.rv;
            cursor.release_at = None;
            continue;
        }
        cursor.sent = cursor.seen;
        match shared.with_store(|s| s.events_since(kind, cursor.seen, filter)) {
            Err(e) => return End::Expired(e),
            Ok((events, seen)) => {
                cursor.seen = seen;
                if !events.is_empty() {
                    cursor.pending.extend(events);
                    continue;
                }
            }
        }
        tokio::select! {
            changed = signal.changed() => {
                if changed.is_err() {
                    return End::Close;
                }
                if signal.borrow_and_update().disconnects != disconnects {
                    return End::Cut;
                }
            }
            _ = sleep_until(next_bookmark), if bookmarks => {
                if tx.send(line(&bookmark(kind, cursor.seen, false))).await.is_err() {
                    return End::Close;
                }
                next_bookmark = Instant::now() + bookmark_every;
            }
            _ = sleep_until(deadline) => return End::Close,
            _ = tx.closed() => return End::Close,
        }
    }
}
