//! Direct HTTP tests of the fake API server: list (paging, selectors, versions), watch
//! (events, bookmarks, timeouts, 410 as an ERROR event), failure injection, restarts and
//! the write endpoints.

use std::time::Duration;

use crate::fakeapi::FakeApi;
use axum::body::Body;
use axum::http::{Method, Request};
use futures::StreamExt;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Node, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};

/// Liveness bound for anything the test waits for.
const WAIT: Duration = Duration::from_secs(10);

fn meta(ns: Option<&str>, name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(Into::into),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
        ..Default::default()
    }
}

fn service(ns: &str, name: &str, labels: &[(&str, &str)]) -> Service {
    Service {
        metadata: meta(Some(ns), name, labels),
        spec: Some(ServiceSpec {
            ports: Some(vec![ServicePort {
                port: 80,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(name: &str) -> Node {
    Node {
        metadata: meta(None, name, &[]),
        ..Default::default()
    }
}

/// Sends one request on a fresh connection; returns the status and the body.
async fn send(api: &FakeApi, method: Method, path: &str, body: Option<Value>) -> (u16, Body) {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", api.port()))
        .await
        .expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(
            body.map(|b| Body::from(b.to_string()))
                .unwrap_or_else(Body::empty),
        )
        .expect("request");
    let resp = tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .expect("response in time")
        .expect("response");
    (resp.status().as_u16(), Body::new(resp.into_body()))
}

async fn call(api: &FakeApi, method: Method, path: &str, body: Option<Value>) -> (u16, Value) {
    let (status, body) = send(api, method, path, body).await;
    let bytes = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    (status, serde_json::from_slice(&bytes).expect("JSON body"))
}

async fn get(api: &FakeApi, path: &str) -> (u16, Value) {
    call(api, Method::GET, path, None).await
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap().into())
        .collect()
}

/// The JSON lines of a watch response.
struct WatchLines {
    body: axum::body::BodyDataStream,
    buf: Vec<u8>,
}

#[derive(Debug)]
enum Next {
    Line(Value),
    /// The stream ended cleanly.
    End,
    /// The body failed (connection cut).
    Cut,
}

impl WatchLines {
    async fn open(api: &FakeApi, path: &str) -> WatchLines {
        let (status, body) = send(api, Method::GET, path, None).await;
        assert_eq!(status, 200, "watch {path}");
        WatchLines {
            body: body.into_data_stream(),
            buf: vec![],
        }
    }

    async fn next(&mut self) -> Next {
        tokio::time::timeout(WAIT, async {
            loop {
                if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = self.buf.drain(..=i).collect();
                    return Next::Line(serde_json::from_slice(&line).expect("JSON line"));
                }
                match self.body.next().await {
                    Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                    Some(Err(_)) => return Next::Cut,
                    None => return Next::End,
                }
            }
        })
        .await
        .expect("watch line in time")
    }

    async fn line(&mut self) -> Value {
        match self.next().await {
            Next::Line(v) => v,
            other => panic!("expected a watch line, got {other:?}"),
        }
    }

    /// The next line that is not a BOOKMARK.
    async fn event(&mut self) -> Value {
        loop {
            let v = self.line().await;
            if v["type"] != "BOOKMARK" {
                return v;
            }
        }
    }
}

#[tokio::test]
async fn list_carries_version_and_items_kube_rs_can_decode() {
    let api = FakeApi::start().await.unwrap();
    api.create(&service("a", "web", &[])).unwrap();
    api.create(&service("b", "db", &[])).unwrap();
    let (status, list) = get(&api, "/api/v1/services").await;
    assert_eq!(status, 200);
    assert_eq!(list["kind"], "ServiceList");
    assert_eq!(
        list["metadata"]["resourceVersion"],
        api.resource_version().to_string()
    );
    assert_eq!(names(&list), ["web", "db"]);
    let items: Vec<Service> =
        serde_json::from_value(list["items"].clone()).expect("k8s-openapi decodes items");
    assert!(
        items
            .iter()
            .all(|s| s.metadata.uid.is_some() && s.metadata.creation_timestamp.is_some())
    );

    let (_, list) = get(&api, "/api/v1/namespaces/b/services").await;
    assert_eq!(names(&list), ["db"]);
    let (status, one) = get(&api, "/api/v1/namespaces/a/services/web").await;
    assert_eq!(
        (status, one["metadata"]["name"].as_str()),
        (200, Some("web"))
    );
    let (status, missing) = get(&api, "/api/v1/namespaces/a/services/nope").await;
    assert_eq!(
        (status, missing["kind"].as_str(), missing["reason"].as_str()),
        (404, Some("Status"), Some("NotFound"))
    );
}

#[tokio::test]
async fn paging_with_limit_and_continue_is_consistent() {
    let api = FakeApi::start().await.unwrap();
    for n in ["s1", "s2", "s3", "s4", "s5"] {
        api.create(&service("ns", n, &[])).unwrap();
    }
    let (_, p1) = get(&api, "/api/v1/services?limit=2").await;
    assert_eq!(names(&p1), ["s1", "s2"]);
    assert_eq!(p1["metadata"]["remainingItemCount"], 3);
    // Changes between pages do not show in the continued list.
    api.delete::<Service>("ns", "s5").unwrap();
    let token = p1["metadata"]["continue"]
        .as_str()
        .expect("continue token")
        .to_owned();
    let enc = |t: &str| t.replace('/', "%2F");
    let (_, p2) = get(
        &api,
        &format!("/api/v1/services?limit=2&continue={}", enc(&token)),
    )
    .await;
    assert_eq!(names(&p2), ["s3", "s4"]);
    assert_eq!(
        p2["metadata"]["resourceVersion"],
        p1["metadata"]["resourceVersion"]
    );
    let token = p2["metadata"]["continue"]
        .as_str()
        .expect("continue token")
        .to_owned();
    let (_, p3) = get(
        &api,
        &format!("/api/v1/services?limit=2&continue={}", enc(&token)),
    )
    .await;
    assert_eq!(names(&p3), ["s5"]);
    assert!(p3["metadata"].get("continue").is_none());
}

#[tokio::test]
async fn label_selectors_filter_lists() {
    let api = FakeApi::start().await.unwrap();
    api.create(&service("ns", "plain", &[("app", "web")]))
        .unwrap();
    api.create(&service(
        "ns",
        "other-proxy",
        &[("service.kubernetes.io/service-proxy-name", "x")],
    ))
    .unwrap();
    api.create(&service(
        "ns",
        "headless",
        &[("service.kubernetes.io/headless", ""), ("app", "db")],
    ))
    .unwrap();
    let cases = [
        (
            "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless",
            vec!["plain"],
        ),
        ("app", vec!["headless", "plain"]),
        ("app=web", vec!["plain"]),
        ("app==db", vec!["headless"]),
        ("app!=web", vec!["headless", "other-proxy"]),
        ("app in (web,db)", vec!["headless", "plain"]),
        ("app notin (web)", vec!["headless", "other-proxy"]),
    ];
    for (sel, want) in cases {
        let q: String = sel.bytes().map(|b| format!("%{b:02X}")).collect();
        let (status, list) = get(&api, &format!("/api/v1/services?labelSelector={q}")).await;
        assert_eq!(status, 200, "{sel}");
        assert_eq!(names(&list), want, "{sel}");
    }
    let (status, err) = get(&api, "/api/v1/services?labelSelector=app%20in%20(web").await;
    assert_eq!((status, err["reason"].as_str()), (400, Some("BadRequest")));
}

#[tokio::test]
async fn field_selectors_pick_nodes_by_name() {
    let api = FakeApi::start().await.unwrap();
    api.create(&node("n1")).unwrap();
    api.create(&node("n2")).unwrap();
    let (_, list) = get(&api, "/api/v1/nodes?fieldSelector=metadata.name%3Dn1").await;
    assert_eq!(names(&list), ["n1"]);
    let (_, list) = get(&api, "/api/v1/nodes?fieldSelector=metadata.name%21%3Dn1").await;
    assert_eq!(names(&list), ["n2"]);
    let (_, list) = get(
        &api,
        "/api/v1/services?fieldSelector=metadata.namespace%3D%3Dnone",
    )
    .await;
    assert_eq!(names(&list), Vec::<String>::new());
    let (status, err) = get(
        &api,
        "/api/v1/nodes?fieldSelector=spec.unschedulable%3Dtrue",
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(
        err["message"],
        "field label not supported: spec.unschedulable"
    );
}

#[tokio::test]
async fn too_old_versions_are_410_for_lists() {
    let api = FakeApi::start().await.unwrap();
    api.create(&node("n1")).unwrap();
    api.create(&node("n2")).unwrap();
    let old = api.resource_version() - 1;
    let (status, list) = get(
        &api,
        &format!("/api/v1/nodes?resourceVersion={old}&resourceVersionMatch=Exact"),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(names(&list), ["n1"], "the state at the exact version");
    let (_, p1) = get(&api, "/api/v1/nodes?limit=1").await;
    let token = p1["metadata"]["continue"]
        .as_str()
        .unwrap()
        .replace('/', "%2F");
    api.create(&node("n3")).unwrap();
    api.compact();
    let (status, err) = get(
        &api,
        &format!("/api/v1/nodes?resourceVersion={old}&resourceVersionMatch=Exact"),
    )
    .await;
    assert_eq!(
        (status, err["kind"].as_str(), err["reason"].as_str()),
        (410, Some("Status"), Some("Expired"))
    );
    let (status, err) = get(&api, &format!("/api/v1/nodes?limit=1&continue={token}")).await;
    assert_eq!((status, err["code"].as_u64()), (410, Some(410)));
    // A plain list is always served.
    let (status, list) = get(&api, "/api/v1/nodes").await;
    assert_eq!(
        (status, names(&list)),
        (200, vec!["n1".into(), "n2".into(), "n3".into()])
    );
}

#[tokio::test]
async fn watch_streams_changes_after_the_version() {
    let api = FakeApi::start().await.unwrap();
    api.create(&service("ns", "before", &[])).unwrap();
    let rv = api.resource_version();
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/services?watch=true&resourceVersion={rv}"),
    )
    .await;
    let mut s = api.create(&service("ns", "web", &[])).unwrap();
    s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8080;
    api.update(&s).unwrap();
    api.delete::<Service>("ns", "web").unwrap();
    let mut last_rv = rv;
    for want in ["ADDED", "MODIFIED", "DELETED"] {
        let ev = w.event().await;
        assert_eq!(ev["type"], want);
        assert_eq!(ev["object"]["metadata"]["name"], "web", "{ev}");
        let ev_rv: u64 = ev["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(ev_rv > last_rv, "versions increase: {ev}");
        last_rv = ev_rv;
        if want == "MODIFIED" {
            assert_eq!(ev["object"]["spec"]["ports"][0]["port"], 8080);
        }
    }
}

#[tokio::test]
async fn watch_without_version_starts_with_the_current_objects() {
    let api = FakeApi::start().await.unwrap();
    api.create(&node("n1")).unwrap();
    let mut w = WatchLines::open(&api, "/api/v1/nodes?watch=1&resourceVersion=0").await;
    let ev = w.event().await;
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("n1"))
    );
    api.create(&node("n2")).unwrap();
    let ev = w.event().await;
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("n2"))
    );
}

#[tokio::test]
async fn watch_with_selector_reports_objects_leaving_and_entering_it() {
    let api = FakeApi::start().await.unwrap();
    let s = api.create(&service("ns", "web", &[])).unwrap();
    let rv = api.resource_version();
    let path = format!("/api/v1/services?watch=true&resourceVersion={rv}&labelSelector=%21skip");
    let mut w = WatchLines::open(&api, &path).await;
    let mut skipped = s.clone();
    skipped.metadata.labels = Some([("skip".to_string(), "yes".to_string())].into());
    api.update(&skipped).unwrap();
    api.create(&service("ns", "hidden", &[("skip", "1")]))
        .unwrap();
    api.update(&s).unwrap();
    let ev = w.event().await;
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("DELETED"), Some("web"))
    );
    let ev = w.event().await;
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("web"))
    );
}

#[tokio::test]
async fn bookmarks_only_when_allowed_and_timeout_ends_the_stream() {
    let api = FakeApi::start().await.unwrap();
    api.set_bookmark_interval(Duration::from_millis(100));
    api.create(&node("n1")).unwrap();
    let rv = api.resource_version();
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/nodes?watch=true&resourceVersion={rv}&allowWatchBookmarks=true"),
    )
    .await;
    let bm = w.line().await;
    assert_eq!(bm["type"], "BOOKMARK");
    assert_eq!(bm["object"]["kind"], "Node");
    assert_eq!(bm["object"]["metadata"]["resourceVersion"], rv.to_string());
    // Without allowWatchBookmarks, a 1 s watch (10 bookmark intervals) ends with no line at all.
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/nodes?watch=true&resourceVersion={rv}&timeoutSeconds=1"),
    )
    .await;
    match w.next().await {
        Next::End => {}
        other => panic!("expected the stream to end after timeoutSeconds, got {other:?}"),
    }
}

#[tokio::test]
async fn watch_from_an_expired_version_gets_an_error_event_then_closes() {
    let api = FakeApi::start().await.unwrap();
    let old = api.resource_version();
    api.create(&node("n1")).unwrap();
    api.compact();
    let mut w = WatchLines::open(
        &api,
        &format!("/apis/discovery.k8s.io/v1/endpointslices?watch=true&resourceVersion={old}"),
    )
    .await;
    let ev = w.line().await;
    assert_eq!(ev["type"], "ERROR");
    assert_eq!(ev["object"]["kind"], "Status");
    assert_eq!(ev["object"]["code"], 410);
    assert_eq!(ev["object"]["reason"], "Expired");
    assert!(matches!(w.next().await, Next::End));
    // From the current version the watch works.
    let rv = api.resource_version();
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/nodes?watch=true&resourceVersion={rv}"),
    )
    .await;
    api.create(&node("n2")).unwrap();
    assert_eq!(w.event().await["object"]["metadata"]["name"], "n2");
}

#[tokio::test]
async fn compaction_expires_a_watch_that_is_behind() {
    let api = FakeApi::start().await.unwrap();
    let rv = api.resource_version();
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/nodes?watch=true&resourceVersion={rv}"),
    )
    .await;
    api.set_watch_delay(Duration::from_secs(60));
    api.create(&node("n1")).unwrap();
    api.compact();
    let ev = w.line().await;
    assert_eq!(
        (ev["type"].as_str(), ev["object"]["code"].as_u64()),
        (Some("ERROR"), Some(410)),
        "{ev}"
    );
    assert!(matches!(w.next().await, Next::End));
}

#[tokio::test]
async fn slow_watch_delivers_every_event_in_order() {
    let api = FakeApi::start().await.unwrap();
    api.set_watch_delay(Duration::from_millis(50));
    let rv = api.resource_version();
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/nodes?watch=true&resourceVersion={rv}"),
    )
    .await;
    for n in ["n1", "n2", "n3"] {
        api.create(&node(n)).unwrap();
    }
    for n in ["n1", "n2", "n3"] {
        assert_eq!(w.event().await["object"]["metadata"]["name"], n);
    }
}

#[tokio::test]
async fn disconnect_cuts_open_watches() {
    let api = FakeApi::start().await.unwrap();
    let rv = api.resource_version();
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/services?watch=true&resourceVersion={rv}"),
    )
    .await;
    api.disconnect_watches();
    assert!(matches!(w.next().await, Next::Cut));
}

#[tokio::test]
async fn injected_failures_answer_with_status_and_are_logged() {
    let api = FakeApi::start().await.unwrap();
    api.fail_next(2, 500);
    let (status, err) = get(&api, "/api/v1/services").await;
    assert_eq!(
        (status, err["kind"].as_str(), err["reason"].as_str()),
        (500, Some("Status"), Some("InternalError"))
    );
    let (status, _) = get(&api, "/api/v1/nodes?watch=true").await;
    assert_eq!(status, 500);
    let (status, _) = get(&api, "/api/v1/services?limit=5").await;
    assert_eq!(status, 200);
    let log = api.requests();
    let seen: Vec<_> = log
        .iter()
        .map(|r| (r.method.as_str(), r.path.as_str(), r.status))
        .collect();
    assert_eq!(
        seen,
        [
            ("GET", "/api/v1/services", 500),
            ("GET", "/api/v1/nodes", 500),
            ("GET", "/api/v1/services", 200)
        ]
    );
    assert!(log[1].is_watch() && !log[1].is_list());
    assert!(log[2].is_list());
    assert_eq!(log[2].param("limit").as_deref(), Some("5"));
}

#[tokio::test]
async fn restart_keeps_the_port_and_optionally_the_history() {
    let api = FakeApi::start().await.unwrap();
    let before = api.resource_version();
    api.create(&node("n1")).unwrap();
    api.stop().await;
    assert!(!api.is_running());
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", api.port()))
            .await
            .is_err(),
        "port closed while stopped"
    );
    api.create(&node("n2")).unwrap();
    api.restart().await.unwrap();
    let (_, list) = get(&api, "/api/v1/nodes").await;
    assert_eq!(names(&list), ["n1", "n2"]);
    // History kept: a watch from before still gets the changes.
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/nodes?watch=true&resourceVersion={before}"),
    )
    .await;
    assert_eq!(w.event().await["object"]["metadata"]["name"], "n1");
    assert_eq!(w.event().await["object"]["metadata"]["name"], "n2");
    // History lost: the same watch now gets 410.
    api.restart_losing_history().await.unwrap();
    let mut w = WatchLines::open(
        &api,
        &format!("/api/v1/nodes?watch=true&resourceVersion={before}"),
    )
    .await;
    assert_eq!(w.line().await["object"]["code"], 410);
}

#[tokio::test]
async fn http_writes_create_update_and_delete() {
    let api = FakeApi::start().await.unwrap();
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-abc", "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["10.1.0.1"]}]
    });
    let (status, created) = call(
        &api,
        Method::POST,
        "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices",
        Some(slice),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["metadata"]["namespace"], "ns");
    let typed: EndpointSlice = serde_json::from_value(created.clone()).unwrap();
    assert_eq!(
        api.get::<EndpointSlice>("ns", "web-abc")
            .unwrap()
            .metadata
            .uid,
        typed.metadata.uid
    );
    let item = "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/web-abc";
    let mut changed = created.clone();
    changed["endpoints"][0]["addresses"][0] = json!("10.1.0.2");
    let (status, updated) = call(&api, Method::PUT, item, Some(changed.clone())).await;
    assert_eq!(status, 200, "{updated}");
    assert_ne!(
        updated["metadata"]["resourceVersion"],
        created["metadata"]["resourceVersion"]
    );
    // A PUT with the old resourceVersion conflicts.
    let (status, err) = call(&api, Method::PUT, item, Some(changed)).await;
    assert_eq!((status, err["reason"].as_str()), (409, Some("Conflict")));
    let (status, _) = call(&api, Method::DELETE, item, None).await;
    assert_eq!(status, 200);
    let (status, _) = get(&api, item).await;
    assert_eq!(status, 404);
    let (status, _) = get(&api, "/api/v1/pods").await;
    assert_eq!(status, 404);
}
