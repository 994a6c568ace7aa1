//! healthCheckNodePort servers over real HTTP against an in-process agent (standalone
//! manifests): 200 with upstream's exact body and headers while the eTP=Local service has
//! local endpoints, 503 when they go, and the port closed when the service is removed.
//! The servers listen on 127.0.0.1 only (`--nodeport-addresses 127.0.0.0/8`), on a port the
//! test picked free.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use kproxy::app::agent::Agent;
use kproxy::app::agent::AgentOptions;
use kproxy::config::SourceConfig;
use kproxy::sync::RunnerConfig;
use kproxy_tests::http;
use kproxy_tests::recording::RecordingDataplane;
use tokio::sync::oneshot;

const LIVENESS: Duration = Duration::from_secs(20);

fn temp_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kproxy-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(dir: &Path, name: &str, text: &str) {
    // Write then rename, so the source never reads half a file.
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// A port nothing listens on right now (bound and released).
fn free_port() -> u16 {
    std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An eTP=Local LoadBalancer service with the given healthCheckNodePort, and endpoints on the
/// listed nodes (`node-a` is this node).
fn manifests(hc_port: u16, endpoint_nodes: &[&str]) -> String {
    let endpoints: Vec<String> = endpoint_nodes
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{{addresses: [10.0.0.{}], nodeName: {n}}}", i + 1))
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: lb, namespace: shop}}\n\
         spec: {{type: LoadBalancer, clusterIP: 10.96.0.20, externalTrafficPolicy: Local, \
         healthCheckNodePort: {hc_port}, ports: [{{name: http, port: 80, nodePort: 30080}}, \
         {{name: https, port: 443, nodePort: 30443}}]}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: lb-1, namespace: shop, labels: {{kubernetes.io/service-name: lb}}}}\n\
         addressType: IPv4\nports: [{{name: http, port: 8080}}, {{name: https, port: 8443}}]\n\
         endpoints: [{}]\n",
        endpoints.join(", ")
    )
}

fn expected_body(local: usize, healthy: bool) -> String {
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": \"shop\",\n\t\t\"name\": \"lb\"\n\t}},\n\t\"localEndpoints\": {local},\n\t\"serviceProxyHealthy\": {healthy}\n}}"
    )
}

#[tokio::test]
async fn health_check_node_port_follows_local_endpoints_and_closes_with_the_service() {
    let dir = temp_dir("hcnp");
    let port = free_port();
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    write(&dir, "lb.yaml", &manifests(port, &["node-a", "node-b"]));
    let (dp, rec) = RecordingDataplane::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let opts = AgentOptions {
        node_port_addresses: vec!["127.0.0.0/8".parse().unwrap()],
        ..AgentOptions::new(
            "node-a",
            SourceConfig::Manifests(dir.clone()),
            RunnerConfig::new(Duration::from_millis(10), Duration::from_secs(3600)),
        )
    };
    let agent = Agent::start(opts, Box::new(dp), async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;

    // One local ready endpoint, counted once per service port (upstream LocalReadyEndpoints).
    let r = http::wait_for(addr, "/", LIVENESS, "health check 200", |r| r.status == 200).await;
    assert_eq!(r.body, expected_body(2, true));
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("2"));
    let any_path = http::get(addr, "/some/other/path").await.unwrap();
    assert_eq!(
        (any_path.status, any_path.body),
        (200, expected_body(2, true))
    );

    // The local endpoint goes away: 503 with localEndpoints 0.
    write(&dir, "lb.yaml", &manifests(port, &["node-b", "node-c"]));
    let r = http::wait_for(addr, "/", LIVENESS, "health check 503", |r| r.status == 503).await;
    assert_eq!(r.body, expected_body(0, true));
    assert_eq!(r.header("x-load-balancing-endpoint-weight"), Some("0"));

    // Back again.
    write(&dir, "lb.yaml", &manifests(port, &["node-b", "node-a"]));
    let r = http::wait_for(addr, "/", LIVENESS, "health check 200 again", |r| {
        r.status == 200
    })
    .await;
    assert_eq!(r.body, expected_body(2, true));

    // The service is removed: the port closes.
    write(
        &dir,
        "lb.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: other, namespace: shop}\nspec: {clusterIP: 10.96.0.21, ports: [{port: 80}]}\n",
    );
    http::wait_closed(addr, LIVENESS, "health check port closed").await;

    let _ = stop.send(());
    agent.wait().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn health_check_node_port_moves_when_the_port_changes() {
    let dir = temp_dir("hcnp-move");
    let (p1, p2) = (free_port(), free_port());
    write(&dir, "lb.yaml", &manifests(p1, &["node-a"]));
    let (dp, rec) = RecordingDataplane::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let opts = AgentOptions {
        node_port_addresses: vec!["127.0.0.0/8".parse().unwrap()],
        ..AgentOptions::new(
            "node-a",
            SourceConfig::Manifests(dir.clone()),
            RunnerConfig::new(Duration::from_millis(10), Duration::from_secs(3600)),
        )
    };
    let agent = Agent::start(opts, Box::new(dp), async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;
    let a1 = SocketAddr::from((Ipv4Addr::LOCALHOST, p1));
    let a2 = SocketAddr::from((Ipv4Addr::LOCALHOST, p2));
    http::wait_for(a1, "/", LIVENESS, "first port", |r| r.status == 200).await;
    write(&dir, "lb.yaml", &manifests(p2, &["node-a"]));
    http::wait_for(a2, "/", LIVENESS, "second port", |r| r.status == 200).await;
    http::wait_closed(a1, LIVENESS, "first port closed").await;
    let _ = stop.send(());
    agent.wait().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs an agent in `ns` (its own thread and runtime, so every socket it opens lives there)
/// until `stop` fires.
fn agent_in_netns(
    ns: &kproxy_tests::netns::Netns,
    opts: AgentOptions,
    dp: RecordingDataplane,
    stop: oneshot::Receiver<()>,
) -> std::thread::JoinHandle<anyhow::Result<()>> {
    ns.spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let agent = Agent::start(opts, Box::new(dp), async {
                let _ = stop.await;
            })
            .await
            .unwrap();
            agent.wait().await.unwrap();
        });
    })
    .unwrap()
}

/// `GET /` of `addr` from inside `ns`: the status, or `None` when the connection fails.
fn status_from(ns: &kproxy_tests::netns::Netns, addr: SocketAddr) -> Option<u16> {
    ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async { http::get(addr, "/").await.ok().map(|r| r.status) })
    })
    .unwrap()
}

fn wait_status(ns: &kproxy_tests::netns::Netns, addr: SocketAddr, want: Option<u16>, what: &str) {
    let deadline = std::time::Instant::now() + LIVENESS;
    loop {
        let got = status_from(ns, addr);
        if got == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: {addr} from {} answered {got:?}, want {want:?}",
            ns.name()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// In a node namespace with a veth to a client namespace: with `--nodeport-addresses` unset
/// the health check listens on every address (the node's IP and loopback); restricted to the
/// node's subnet it listens on the node's IP only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_check_node_port_listens_where_nodeport_addresses_say() {
    if !kproxy_tests::netns::require_root() {
        return;
    }
    use kproxy_tests::netns::{Netns, Veth, VethEnd};
    const PORT: u16 = 31000; // inside a fresh namespace: nothing else listens there
    let node = Netns::new("hcnp-node").unwrap();
    let client = Netns::new("hcnp-client").unwrap();
    let _veth = Veth::create(
        VethEnd::new(&node, "eth0").addr("10.77.0.1/24"),
        VethEnd::new(&client, "eth0").addr("10.77.0.2/24"),
    )
    .unwrap();
    let node_ip = SocketAddr::from(([10, 77, 0, 1], PORT));
    let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, PORT));

    for (case, cidrs, loopback_open) in [
        ("all addresses", vec![], true),
        (
            "node subnet only",
            vec!["10.77.0.0/24".parse().unwrap()],
            false,
        ),
    ] {
        let dir = temp_dir(&format!("hcnp-netns-{}", loopback_open));
        write(&dir, "lb.yaml", &manifests(PORT, &["node-a"]));
        let (dp, rec) = RecordingDataplane::new();
        let (stop, stopped) = oneshot::channel::<()>();
        let opts = AgentOptions {
            node_port_addresses: cidrs,
            ..AgentOptions::new(
                "node-a",
                SourceConfig::Manifests(dir.clone()),
                RunnerConfig::new(Duration::from_millis(10), Duration::from_secs(3600)),
            )
        };
        let thread = agent_in_netns(&node, opts, dp, stopped);
        rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
            .await;
        let (c, n) = (&client, &node);
        tokio::task::block_in_place(|| {
            wait_status(c, node_ip, Some(200), &format!("{case}: from the client"));
            let want = loopback_open.then_some(200);
            wait_status(n, loopback, want, &format!("{case}: node loopback"));
        });
        let _ = stop.send(());
        tokio::task::block_in_place(|| thread.join().unwrap().unwrap());
        // The agent is gone: so is its listener.
        tokio::task::block_in_place(|| {
            wait_status(c, node_ip, None, &format!("{case}: closed after stop"));
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
