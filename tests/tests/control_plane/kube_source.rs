//! kproxy's Kubernetes source (`kproxy::source::kube::{client, spawn}`) against the fake API
//! server: initial lists (streamed for Services and EndpointSlices, one Replace for the Node),
//! selectors, watch events, re-lists after 410, server restarts, slow watches and injected
//! failures; ServiceCIDRs watched when the server serves them, left alone when it does not.
//!
//! [`Source`] reassembles a streamed list (`ListStart`, `Listed…`, `ListDone`) into one
//! `Replace` so the tests read a list as one event; `lists_of_services_and_slices_stream`
//! checks the raw stream itself.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kproxy::model::input::{Delta, Event};
use kproxy::source::PROXYABLE_LABEL_SELECTOR;
use kproxy::source::kube::{KubeSourceError, client, spawn};
use kproxy_tests::fakeapi::{FakeApi, Kind};
use tokio::sync::mpsc;

/// Liveness bound for each expected event.
const WAIT: Duration = Duration::from_secs(10);
const NODE: &str = "node-1";

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

fn service(name: &str, labels: &[(&str, &str)]) -> Service {
    Service {
        metadata: meta(Some("ns"), name, labels),
        spec: Some(ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            ports: Some(vec![ServicePort {
                port: 80,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slice(name: &str, service: &str, extra_labels: &[(&str, &str)]) -> EndpointSlice {
    let mut labels = vec![("kubernetes.io/service-name", service)];
    labels.extend_from_slice(extra_labels);
    EndpointSlice {
        metadata: meta(Some("ns"), name, &labels),
        address_type: "IPv4".into(),
        endpoints: Some(vec![Endpoint {
            addresses: vec!["10.1.0.1".into()],
            ..Default::default()
        }]),
        ports: None,
    }
}

fn node(name: &str) -> Node {
    Node {
        metadata: meta(None, name, &[]),
        ..Default::default()
    }
}

/// A running source and its events.
struct Source {
    rx: mpsc::Receiver<Event>,
    task: tokio::task::JoinHandle<()>,
    /// Objects of the Service / EndpointSlice list being streamed.
    services: Option<Vec<Service>>,
    slices: Option<Vec<EndpointSlice>>,
    /// ServiceCIDR events seen so far (the other kinds' helpers skip them).
    cidr_events: usize,
}

impl Source {
    async fn start(api: &FakeApi) -> Source {
        let c = client(None, Some(&api.url())).await.expect("client");
        Self::with_client(c)
    }

    fn with_client(c: kube::Client) -> Source {
        let (tx, rx) = mpsc::channel(256);
        Source {
            rx,
            task: spawn(c, NODE.into(), tx),
            services: None,
            slices: None,
            cidr_events: 0,
        }
    }

    /// The next event as the source sent it, within the liveness bound (`None`: none came).
    async fn next_raw(&mut self) -> Option<Event> {
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .ok()
            .map(|ev| ev.expect("source still running"))
    }

    /// The next event, a streamed list reassembled into one `Replace` (`None`: none came
    /// within the liveness bound).
    async fn try_next(&mut self) -> Option<Event> {
        fn fold<K>(buf: &mut Option<Vec<K>>, d: Delta<K>, kind: &str) -> Option<Delta<K>> {
            match d {
                Delta::ListStart => {
                    *buf = Some(vec![]);
                    None
                }
                Delta::Listed(page) => {
                    buf.as_mut()
                        .unwrap_or_else(|| panic!("{kind} Listed outside a list"))
                        .extend(page);
                    None
                }
                Delta::ListDone => {
                    Some(Delta::Replace(buf.take().unwrap_or_else(|| {
                        panic!("{kind} ListDone without ListStart")
                    })))
                }
                d => Some(d),
            }
        }
        loop {
            let ev = match self.next_raw().await? {
                Event::Service(d) => fold(&mut self.services, d, "Service").map(Event::Service),
                Event::EndpointSlice(d) => {
                    fold(&mut self.slices, d, "EndpointSlice").map(Event::EndpointSlice)
                }
                Event::ServiceCidr(d) => {
                    self.cidr_events += 1;
                    Some(Event::ServiceCidr(d))
                }
                ev => Some(ev),
            };
            if let Some(ev) = ev {
                return Some(ev);
            }
        }
    }

    /// The next ServiceCIDR delta (other events meanwhile are dropped); `None`: none came
    /// within the liveness bound.
    async fn next_cidr(&mut self) -> Option<Delta<ServiceCIDR>> {
        loop {
            if let Event::ServiceCidr(d) = self.try_next().await? {
                return Some(d);
            }
        }
    }

    async fn next(&mut self) -> Event {
        self.try_next().await.expect("an event in time")
    }

    /// Skips events until `f` picks one (each event within the liveness bound).
    async fn wait_for<T>(&mut self, what: &str, mut f: impl FnMut(&Event) -> Option<T>) -> T {
        let mut skipped = vec![];
        loop {
            let ev = self
                .try_next()
                .await
                .unwrap_or_else(|| panic!("no {what} in time; skipped {skipped:?}"));
            if let Some(t) = f(&ev) {
                return t;
            }
            skipped.push(summary(&ev));
        }
    }

    /// The first Replace of each kind; panics if any other event of a kind precedes it.
    async fn initial(&mut self) -> (BTreeSet<String>, BTreeSet<String>, BTreeSet<String>) {
        let (mut svcs, mut slices, mut nodes) = (None, None, None);
        while svcs.is_none() || slices.is_none() || nodes.is_none() {
            let ev = self.next().await;
            let s = summary(&ev);
            match ev {
                Event::Service(Delta::Replace(v)) if svcs.is_none() => svcs = Some(names(&v)),
                Event::EndpointSlice(Delta::Replace(v)) if slices.is_none() => {
                    slices = Some(names(&v))
                }
                Event::Node(Delta::Replace(v)) if nodes.is_none() => nodes = Some(names(&v)),
                // Watched beside the others when served (see the service_cidrs_* tests).
                Event::ServiceCidr(_) => {}
                _ => panic!("expected the initial Replace of each kind first, got {s}"),
            }
        }
        (svcs.unwrap(), slices.unwrap(), nodes.unwrap())
    }
}

fn names<K: kube::Resource>(v: &[K]) -> BTreeSet<String> {
    v.iter()
        .map(|o| o.meta().name.clone().unwrap_or_default())
        .collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn summary(ev: &Event) -> String {
    fn d<K: kube::Resource>(kind: &str, d: &Delta<K>) -> String {
        match d {
            Delta::Apply(o) => format!("{kind} Apply({:?})", o.meta().name),
            Delta::Delete(o) => format!("{kind} Delete({:?})", o.meta().name),
            Delta::Replace(v) => format!("{kind} Replace({:?})", names(v)),
            Delta::ListStart => format!("{kind} ListStart"),
            Delta::Listed(v) => format!("{kind} Listed({:?})", names(v)),
            Delta::ListDone => format!("{kind} ListDone"),
        }
    }
    match ev {
        Event::Service(x) => d("Service", x),
        Event::EndpointSlice(x) => d("EndpointSlice", x),
        Event::Node(x) => d("Node", x),
        Event::ServiceCidr(x) => d("ServiceCIDR", x),
    }
}

fn service_applied(name: &'static str) -> impl FnMut(&Event) -> Option<Service> {
    move |ev| match ev {
        Event::Service(Delta::Apply(s)) if s.metadata.name.as_deref() == Some(name) => {
            Some(s.clone())
        }
        _ => None,
    }
}

fn service_deleted(name: &'static str) -> impl FnMut(&Event) -> Option<()> {
    move |ev| match ev {
        Event::Service(Delta::Delete(s)) if s.metadata.name.as_deref() == Some(name) => Some(()),
        _ => None,
    }
}

fn service_replace(ev: &Event) -> Option<BTreeSet<String>> {
    match ev {
        Event::Service(Delta::Replace(v)) => Some(names(v)),
        _ => None,
    }
}

/// The fixture most tests start from: two proxyable services with a slice each, plus objects
/// the selectors must exclude, and two nodes.
fn populate(api: &FakeApi) {
    api.create(&service("a", &[])).unwrap();
    api.create(&service("b", &[])).unwrap();
    api.create(&service(
        "other-proxy",
        &[("service.kubernetes.io/service-proxy-name", "foo")],
    ))
    .unwrap();
    api.create(&slice("a-1", "a", &[])).unwrap();
    api.create(&slice("b-1", "b", &[])).unwrap();
    api.create(&slice(
        "headless-1",
        "headless",
        &[("service.kubernetes.io/headless", "")],
    ))
    .unwrap();
    api.create(&node(NODE)).unwrap();
    api.create(&node("node-2")).unwrap();
}

#[tokio::test]
async fn initial_list_is_one_replace_per_kind_with_only_selected_objects() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    let (svcs, slices, nodes) = src.initial().await;
    assert_eq!(svcs, set(&["a", "b"]));
    assert_eq!(slices, set(&["a-1", "b-1"]));
    assert_eq!(nodes, set(&[NODE]));
    // The selectors were sent to the server (not applied client-side).
    let log = api.requests();
    let list_of = |kind| {
        log.iter()
            .find(|r| r.is_list() && r.kind() == Some(kind))
            .expect("a list request")
    };
    assert_eq!(
        list_of(Kind::Service).param("labelSelector").as_deref(),
        Some(PROXYABLE_LABEL_SELECTOR)
    );
    assert_eq!(
        list_of(Kind::EndpointSlice)
            .param("labelSelector")
            .as_deref(),
        Some(PROXYABLE_LABEL_SELECTOR)
    );
    assert_eq!(
        list_of(Kind::Node).param("fieldSelector").as_deref(),
        Some("metadata.name=node-1")
    );
}

#[tokio::test]
async fn initial_list_is_paged_into_one_replace() {
    let api = FakeApi::start().await.unwrap();
    // More than kube-runtime's page size (500), so the initial list takes two pages.
    let names: Vec<String> = (0..520).map(|i| format!("svc-{i:04}")).collect();
    for n in &names {
        let mut s = service("x", &[]);
        s.metadata.name = Some(n.clone());
        api.create(&s).unwrap();
    }
    let mut src = Source::start(&api).await;
    let (svcs, _, _) = src.initial().await;
    assert_eq!(svcs, names.iter().cloned().collect());
    let pages = api
        .requests()
        .iter()
        .filter(|r| r.is_list() && r.kind() == Some(Kind::Service))
        .count();
    assert_eq!(pages, 2, "two list pages were served");
}

#[tokio::test]
async fn lists_of_services_and_slices_stream() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    // Per kind, in arrival order (the three watches interleave in the channel).
    let (mut svc, mut slc, mut node) = (vec![], vec![], vec![]);
    while !(svc.last().is_some_and(|s: &String| s.ends_with("ListDone"))
        && slc.last().is_some_and(|s: &String| s.ends_with("ListDone"))
        && !node.is_empty())
    {
        let ev = src.next_raw().await.expect("list events in time");
        let s = summary(&ev);
        match ev {
            Event::Service(_) => svc.push(s),
            Event::EndpointSlice(_) => slc.push(s),
            Event::Node(_) => node.push(s),
            Event::ServiceCidr(_) => {}
        }
    }
    assert_eq!(
        svc,
        [
            "Service ListStart".to_string(),
            format!("Service Listed({:?})", set(&["a", "b"])),
            "Service ListDone".to_string(),
        ]
    );
    assert_eq!(
        slc,
        [
            "EndpointSlice ListStart".to_string(),
            format!("EndpointSlice Listed({:?})", set(&["a-1", "b-1"])),
            "EndpointSlice ListDone".to_string(),
        ]
    );
    assert_eq!(node, [format!("Node Replace({:?})", set(&[NODE]))]);
}

#[tokio::test]
async fn missing_node_is_an_empty_replace_and_only_this_node_is_watched() {
    let api = FakeApi::start().await.unwrap();
    let mut src = Source::start(&api).await;
    let (_, _, nodes) = src.initial().await;
    assert!(nodes.is_empty());
    // Another node first: if it leaked through the field selector it would arrive first.
    api.create(&node("node-2")).unwrap();
    api.create(&node(NODE)).unwrap();
    let ev = src
        .wait_for("a Node event", |ev| {
            matches!(ev, Event::Node(_)).then(|| summary(ev))
        })
        .await;
    assert_eq!(ev, format!("Node Apply(Some({NODE:?}))"));
    api.delete::<Node>("", NODE).unwrap();
    let ev = src
        .wait_for("a Node event", |ev| {
            matches!(ev, Event::Node(_)).then(|| summary(ev))
        })
        .await;
    assert_eq!(ev, format!("Node Delete(Some({NODE:?}))"));
}

#[tokio::test]
async fn changes_arrive_as_apply_and_delete() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    src.initial().await;

    api.create(&service("c", &[])).unwrap();
    let c = src.wait_for("Apply(c)", service_applied("c")).await;
    assert_eq!(c.spec.unwrap().ports.unwrap()[0].port, 80);

    let mut c = api.get::<Service>("ns", "c").unwrap();
    c.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8080;
    api.update(&c).unwrap();
    let c = src
        .wait_for("Apply(c) with the new port", service_applied("c"))
        .await;
    assert_eq!(c.spec.unwrap().ports.unwrap()[0].port, 8080);

    api.delete::<Service>("ns", "c").unwrap();
    src.wait_for("Delete(c)", service_deleted("c")).await;

    api.create(&slice("a-2", "a", &[])).unwrap();
    api.delete::<EndpointSlice>("ns", "a-1").unwrap();
    let got = src
        .wait_for("Apply(a-2)", |ev| match ev {
            Event::EndpointSlice(Delta::Apply(s)) => Some(s.metadata.name.clone()),
            _ => None,
        })
        .await;
    assert_eq!(got.as_deref(), Some("a-2"));
    let got = src
        .wait_for("Delete(a-1)", |ev| match ev {
            Event::EndpointSlice(Delta::Delete(s)) => Some(s.metadata.name.clone()),
            _ => None,
        })
        .await;
    assert_eq!(got.as_deref(), Some("a-1"));

    // A service that gets service-proxy-name leaves the selector: it is deleted for us.
    let mut b = api.get::<Service>("ns", "b").unwrap();
    b.metadata.labels = Some(
        [(
            "service.kubernetes.io/service-proxy-name".to_string(),
            "foo".to_string(),
        )]
        .into(),
    );
    api.update(&b).unwrap();
    src.wait_for("Delete(b)", service_deleted("b")).await;
}

#[tokio::test]
async fn expired_watch_relists_into_a_replace_with_the_current_state() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    src.initial().await;

    // Hold watch events back, change things, then drop the history the watch still needs.
    api.set_watch_delay(Duration::from_secs(600));
    api.create(&service("x", &[])).unwrap();
    api.delete::<Service>("ns", "a").unwrap();
    api.clear_requests();
    api.compact();
    api.set_watch_delay(Duration::ZERO);

    let replaced = src
        .wait_for("a Service Replace", |ev| match ev {
            Event::Service(Delta::Apply(_) | Delta::Delete(_)) => {
                panic!(
                    "the held-back watch events must not arrive: {}",
                    summary(ev)
                )
            }
            ev => service_replace(ev),
        })
        .await;
    assert_eq!(replaced, set(&["b", "x"]));
    assert!(
        api.requests()
            .iter()
            .any(|r| r.is_list() && r.kind() == Some(Kind::Service)),
        "the source re-listed services: {:?}",
        api.requests()
    );
    // And keeps watching afterwards.
    api.create(&service("y", &[])).unwrap();
    src.wait_for("Apply(y)", service_applied("y")).await;
}

#[tokio::test]
async fn server_restart_reconnects_and_delivers_changes_made_while_down() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    src.initial().await;

    api.stop().await;
    api.create(&service("while-down", &[])).unwrap();
    api.delete::<Service>("ns", "b").unwrap();
    api.restart().await.unwrap();

    src.wait_for("Apply(while-down)", service_applied("while-down"))
        .await;
    src.wait_for("Delete(b)", service_deleted("b")).await;
    api.create(&service("after", &[])).unwrap();
    src.wait_for("Apply(after)", service_applied("after")).await;
}

#[tokio::test]
async fn server_restart_without_history_relists() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    src.initial().await;

    api.stop().await;
    api.create(&service("while-down", &[])).unwrap();
    api.delete::<Service>("ns", "b").unwrap();
    api.clear_requests();
    api.restart_losing_history().await.unwrap();

    let replaced = src.wait_for("a Service Replace", service_replace).await;
    assert_eq!(replaced, set(&["a", "while-down"]));
    let log = api.requests();
    assert!(
        log.iter()
            .any(|r| r.is_watch() && r.status == 200 && r.kind() == Some(Kind::Service)),
        "a watch was tried first: {log:?}"
    );
    assert!(
        log.iter()
            .any(|r| r.is_list() && r.kind() == Some(Kind::Service)),
        "then a re-list: {log:?}"
    );
}

/// How long the API server is away in the outage tests: long enough that a client-go-like
/// backoff (800 ms doubling to 30 s) has grown past 10 s by the time it returns.
const OUTAGE: Duration = Duration::from_secs(15);
/// Liveness bound for seeing a returning API server and re-listing: the retry cap (5 s) with
/// room for a loaded machine. The old 30 s-capped backoff plus a backoff after the 410 took
/// 30–50 s here.
const RETURN_BOUND: Duration = Duration::from_secs(15);

/// Waits up to [`RETURN_BOUND`] for a Service Replace, skipping anything else.
async fn relisted_within_bound(src: &mut Source) -> Option<BTreeSet<String>> {
    let wait = async {
        loop {
            if let Some(names) = src.try_next().await.as_ref().and_then(service_replace) {
                return names;
            }
        }
    };
    tokio::time::timeout(RETURN_BOUND, wait).await.ok()
}

#[tokio::test]
async fn api_server_returning_after_an_outage_is_relisted_promptly() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    src.initial().await;

    // Outage: the server is gone; the watches fail and the source backs off meanwhile.
    api.stop().await;
    tokio::time::sleep(OUTAGE).await;
    api.create(&service("while-down", &[])).unwrap();
    api.delete::<Service>("ns", "b").unwrap();
    api.clear_requests();
    // It returns with a fresh watch cache: resuming the old watches is 410.
    api.restart_losing_history().await.unwrap();

    let replaced = relisted_within_bound(&mut src).await.unwrap_or_else(|| {
        panic!(
            "no Service re-list within {RETURN_BOUND:?} of the API server's return; requests: {:?}",
            api.requests()
        )
    });
    assert_eq!(replaced, set(&["a", "while-down"]));
    // The 410 came first and was answered by the re-list with nothing in between.
    let svc: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.kind() == Some(Kind::Service))
        .collect();
    let first_list = svc.iter().position(|r| r.is_list()).expect("a list");
    assert!(
        first_list >= 1 && svc[..first_list].iter().all(|r| r.is_watch()),
        "watch (answered 410) then list: {svc:?}"
    );
    // And it keeps watching afterwards.
    api.create(&service("after", &[])).unwrap();
    src.wait_for("Apply(after)", service_applied("after")).await;
}

#[tokio::test]
async fn watch_answered_410_relists_at_once_even_after_backoff_has_grown() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let mut src = Source::start(&api).await;
    src.initial().await;
    // `initial` lets the ServiceCIDR list come late (it is probed first); wait for it here, or
    // a late initial list would pass below for the re-list after a ServiceCIDR 410.
    if src.cidr_events == 0 {
        let first = src.next_cidr().await.expect("the initial ServiceCIDR list");
        assert!(
            matches!(first, Delta::Replace(_)),
            "initial ServiceCIDR list: {first:?}"
        );
    }

    // Grow the backoff: the server is away long enough for several failed attempts.
    api.stop().await;
    tokio::time::sleep(OUTAGE).await;
    api.create(&service("while-down", &[])).unwrap();
    api.clear_requests();
    // Back with its history, but the re-watch request itself is answered 410 (as an HTTP
    // status, not an ERROR event): kube-runtime alone would keep re-watching from the stale
    // version; the source must start over with a list.
    api.fail_next(1, 410);
    api.restart().await.unwrap();

    // Whichever kind's request got the 410 re-lists (the others resume their watches).
    let gone = loop {
        if let Some(r) = api.requests().iter().find(|r| r.status == 410) {
            break r.kind().expect("a kind's request");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let relisted = async {
        loop {
            match src.try_next().await {
                Some(Event::Service(Delta::Replace(v))) if gone == Kind::Service => {
                    return names(&v);
                }
                Some(Event::EndpointSlice(Delta::Replace(v))) if gone == Kind::EndpointSlice => {
                    return names(&v);
                }
                Some(Event::Node(Delta::Replace(v))) if gone == Kind::Node => return names(&v),
                Some(Event::ServiceCidr(Delta::Replace(v))) if gone == Kind::ServiceCidr => {
                    return names(&v);
                }
                _ => {}
            }
        }
    };
    let listed = tokio::time::timeout(RETURN_BOUND, relisted)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "no {gone:?} re-list within {RETURN_BOUND:?} after its watch got 410; requests: {:?}",
                api.requests()
            )
        });
    let expected = match gone {
        Kind::Service => set(&["a", "b", "while-down"]),
        Kind::EndpointSlice => set(&["a-1", "b-1"]),
        Kind::ServiceCidr => set(&[]),
        _ => set(&[NODE]),
    };
    assert_eq!(listed, expected);
    let after_410: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.kind() == Some(gone))
        .skip_while(|r| r.status != 410)
        .collect();
    assert!(
        after_410.get(1).is_some_and(|r| r.is_list()),
        "the 410 was followed by a list: {after_410:?}"
    );
}

#[tokio::test]
async fn slow_watch_still_converges() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    api.set_watch_delay(Duration::from_millis(300));
    let mut src = Source::start(&api).await;
    src.initial().await;
    let new = ["s1", "s2", "s3", "s4"];
    for n in new {
        api.create(&service(n, &[])).unwrap();
    }
    api.delete::<Service>("ns", "a").unwrap();
    let mut seen = BTreeSet::new();
    while seen.len() < new.len() {
        let name = src
            .wait_for("a Service Apply", |ev| match ev {
                Event::Service(Delta::Apply(s)) => s.metadata.name.clone(),
                _ => None,
            })
            .await;
        seen.insert(name);
    }
    assert_eq!(seen, set(&new));
    src.wait_for("Delete(a)", service_deleted("a")).await;
}

#[tokio::test]
async fn injected_failures_are_retried() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    api.fail_next(4, 500);
    let mut src = Source::start(&api).await;
    let (svcs, slices, nodes) = src.initial().await;
    assert_eq!(
        (svcs, slices, nodes),
        (set(&["a", "b"]), set(&["a-1", "b-1"]), set(&[NODE]))
    );
    let failed = api.requests().iter().filter(|r| r.status == 500).count();
    assert_eq!(failed, 4);

    // Failures while re-watching are retried too.
    api.fail_next(3, 500);
    api.disconnect_watches();
    api.create(&service("later", &[])).unwrap();
    src.wait_for("Apply(later)", service_applied("later")).await;
    assert_eq!(api.requests().iter().filter(|r| r.status == 500).count(), 7);
}

#[tokio::test]
async fn source_stops_when_the_channel_closes() {
    let api = FakeApi::start().await.unwrap();
    let src = Source::start(&api).await;
    let Source { rx, task, .. } = src;
    drop(rx);
    tokio::time::timeout(WAIT, task)
        .await
        .expect("source task ends")
        .expect("no panic");
}

#[tokio::test]
async fn client_from_kubeconfig_and_master_override() {
    let api = FakeApi::start().await.unwrap();
    populate(&api);
    let dir = std::env::temp_dir().join(format!("kproxy-kube-source-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _cleanup = RemoveDir(dir.clone());

    // A kubeconfig pointing at the fake.
    let good = dir.join("good.yaml");
    api.write_kubeconfig(&good).unwrap();
    let mut src = Source::with_client(
        client(Some(&good), None)
            .await
            .expect("client from kubeconfig"),
    );
    assert_eq!(src.initial().await.0, set(&["a", "b"]));

    // A kubeconfig pointing at a stopped server, with --master overriding the URL.
    let dead = FakeApi::start().await.unwrap();
    let stale = dir.join("stale.yaml");
    dead.write_kubeconfig(&stale).unwrap();
    dead.stop().await;
    let c = client(Some(&stale), Some(&api.url()))
        .await
        .expect("client with master override");
    let mut src = Source::with_client(c);
    assert_eq!(src.initial().await.0, set(&["a", "b"]));
}

#[tokio::test]
async fn client_errors_name_what_was_tried() {
    let missing = std::path::Path::new("/nonexistent/kproxy/kubeconfig.yaml");
    let err = client(Some(missing), None)
        .await
        .err()
        .expect("missing kubeconfig is an error");
    assert!(matches!(err, KubeSourceError::Kubeconfig { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("/nonexistent/kproxy/kubeconfig.yaml"),
        "{err}"
    );

    let err = client(None, Some("not a url"))
        .await
        .err()
        .expect("bad master URL is an error");
    assert!(matches!(err, KubeSourceError::MasterUrl { .. }), "{err:?}");
    assert!(err.to_string().contains("not a url"), "{err}");
}

struct RemoveDir(std::path::PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn service_cidr(name: &str, cidrs: &[&str]) -> ServiceCIDR {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": cidrs},
    }))
    .unwrap()
}

fn cidr_summary(d: &Delta<ServiceCIDR>) -> String {
    let cidrs = |o: &ServiceCIDR| {
        o.spec
            .as_ref()
            .and_then(|s| s.cidrs.clone())
            .unwrap_or_default()
            .join(",")
    };
    match d {
        Delta::Replace(v) => format!(
            "Replace[{}]",
            v.iter()
                .map(|o| format!(
                    "{}={}",
                    o.metadata.name.clone().unwrap_or_default(),
                    cidrs(o)
                ))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Delta::Apply(o) => format!(
            "Apply {}={}",
            o.metadata.name.clone().unwrap_or_default(),
            cidrs(o)
        ),
        Delta::Delete(o) => format!("Delete {}", o.metadata.name.clone().unwrap_or_default()),
        other => format!("{other:?}"),
    }
}

#[tokio::test]
async fn service_cidrs_are_watched_when_the_server_serves_them() {
    let api = FakeApi::start().await.unwrap();
    api.create(&service_cidr(
        "kubernetes",
        &["10.96.0.0/12", "fd00:10:96::/112"],
    ))
    .unwrap();
    let mut src = Source::start(&api).await;
    let first = src.next_cidr().await.expect("the ServiceCIDR list");
    assert_eq!(
        cidr_summary(&first),
        "Replace[kubernetes=10.96.0.0/12,fd00:10:96::/112]"
    );
    api.create(&service_cidr("extra", &["172.30.0.0/16"]))
        .unwrap();
    let next = src.next_cidr().await.expect("the new ServiceCIDR");
    assert_eq!(cidr_summary(&next), "Apply extra=172.30.0.0/16");
    api.delete::<ServiceCIDR>("", "extra").unwrap();
    let gone = src.next_cidr().await.expect("the deletion");
    assert_eq!(cidr_summary(&gone), "Delete extra");
}

#[tokio::test]
async fn service_cidrs_are_not_watched_when_the_server_does_not_serve_them() {
    let api = FakeApi::start().await.unwrap();
    api.set_unserved(Kind::ServiceCidr);
    populate(&api);
    let mut src = Source::start(&api).await;
    src.initial().await;
    let probed = |api: &FakeApi| {
        api.requests()
            .iter()
            .any(|r| r.kind() == Some(Kind::ServiceCidr))
    };
    let deadline = std::time::Instant::now() + WAIT;
    while !probed(&api) {
        assert!(std::time::Instant::now() < deadline, "no ServiceCIDR probe");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The other kinds keep flowing; no ServiceCIDR event ever comes, and the probe is not
    // retried (a retry would come within the source's longest backoff).
    api.create(&service("later", &[])).unwrap();
    src.wait_for("Apply(later)", service_applied("later")).await;
    tokio::time::sleep(2 * kproxy::source::retry::MAX_DELAY).await;
    assert_eq!(src.cidr_events, 0);
    let cidr_requests: Vec<_> = api
        .requests()
        .into_iter()
        .filter(|r| r.kind() == Some(Kind::ServiceCidr))
        .collect();
    assert_eq!(
        cidr_requests.len(),
        1,
        "one probe, no watch: {cidr_requests:?}"
    );
    assert_eq!(cidr_requests[0].status, 404);
    assert!(!cidr_requests[0].is_watch());
}
