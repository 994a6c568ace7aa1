//! `cargo xtask demo`: kproxy on a network-namespace node with two pods and an external client.
//!
//! Topology (names carry the pid so a stale run never collides):
//!
//! ```text
//!   pod1 10.244.1.2 ──veth── node ──veth── pod2 10.244.1.3
//!                             │ 192.168.77.1
//!                           veth
//!                             │ 192.168.77.2
//!                           client
//! ```
//!
//! kproxy runs inside `node` on `deploy/examples/` (services `web` ClusterIP 10.96.0.10:80 /
//! NodePort 30080 → both pods :8080). The demo prints the service table, then sends requests
//! through the ClusterIP from pod1 and through the NodePort from the client, and counts which
//! pod answered each.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

const NODE_IP: &str = "192.168.77.1";
const CLIENT_IP: &str = "192.168.77.2";
const CLUSTER_IP: &str = "10.96.0.10";
const NODE_PORT: u16 = 30080;
const REQUESTS: usize = 20;

/// A tiny HTTP server answering with the pod's name.
const POD_SERVER: &str = r#"
import http.server, socketserver, sys
name = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (name + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
socketserver.TCPServer.allow_reuse_address = True
with socketserver.TCPServer(("0.0.0.0", 8080), H) as s:
    s.serve_forever()
"#;

/// Sends N requests to a URL, one connection each, and prints who answered.
const CLIENT: &str = r#"
import sys, urllib.request, collections
url, n = sys.argv[1], int(sys.argv[2])
seen = collections.Counter()
for _ in range(n):
    try:
        seen[urllib.request.urlopen(url, timeout=3).read().decode().strip()] += 1
    except Exception as e:
        seen["error: " + type(e).__name__] += 1
print(" ".join(f"{k}={v}" for k, v in sorted(seen.items())))
"#;

struct Topology {
    ns: Vec<String>,
    children: Vec<Child>,
}

impl Drop for Topology {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn sh(args: &[&str]) -> Result<()> {
    let st = Command::new(args[0])
        .args(&args[1..])
        .status()
        .with_context(|| format!("running {args:?}"))?;
    if !st.success() {
        bail!("{args:?} failed: {st}");
    }
    Ok(())
}

fn in_ns(ns: &str, args: &[&str]) -> Result<()> {
    let mut v = vec!["ip", "netns", "exec", ns];
    v.extend_from_slice(args);
    sh(&v)
}

fn output_in_ns(ns: &str, args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(args)
        .output()?;
    if !out.status.success() {
        bail!("{args:?} in {ns}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Topology {
    fn build(tag: &str) -> Result<Topology> {
        let name = |n: &str| format!("kpd{tag}-{n}");
        let mut t = Topology {
            ns: vec![],
            children: vec![],
        };
        for n in ["node", "pod1", "pod2", "client"] {
            sh(&["ip", "netns", "add", &name(n)])?;
            t.ns.push(name(n));
            in_ns(&name(n), &["ip", "link", "set", "lo", "up"])?;
        }
        let node = name("node");
        in_ns(&node, &["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
        // pods: a /32 address, a route to the node-side gateway, default via it (a ptp CNI)
        for (pod, ip) in [("pod1", "10.244.1.2"), ("pod2", "10.244.1.3")] {
            let host_if = format!("v{pod}");
            sh(&[
                "ip",
                "link",
                "add",
                &host_if,
                "netns",
                &node,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &name(pod),
            ])?;
            in_ns(
                &node,
                &["ip", "addr", "add", "10.244.1.1/32", "dev", &host_if],
            )?;
            in_ns(&node, &["ip", "link", "set", &host_if, "up"])?;
            in_ns(
                &node,
                &["ip", "route", "add", &format!("{ip}/32"), "dev", &host_if],
            )?;
            in_ns(
                &name(pod),
                &["ip", "addr", "add", &format!("{ip}/32"), "dev", "eth0"],
            )?;
            in_ns(&name(pod), &["ip", "link", "set", "eth0", "up"])?;
            in_ns(
                &name(pod),
                &["ip", "route", "add", "10.244.1.1", "dev", "eth0"],
            )?;
            in_ns(
                &name(pod),
                &["ip", "route", "add", "default", "via", "10.244.1.1"],
            )?;
        }
        sh(&[
            "ip",
            "link",
            "add",
            "eth0",
            "netns",
            &node,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &name("client"),
        ])?;
        in_ns(
            &node,
            &["ip", "addr", "add", &format!("{NODE_IP}/24"), "dev", "eth0"],
        )?;
        in_ns(&node, &["ip", "link", "set", "eth0", "up"])?;
        in_ns(
            &name("client"),
            &[
                "ip",
                "addr",
                "add",
                &format!("{CLIENT_IP}/24"),
                "dev",
                "eth0",
            ],
        )?;
        in_ns(&name("client"), &["ip", "link", "set", "eth0", "up"])?;
        in_ns(
            &name("client"),
            &["ip", "route", "add", "default", "via", NODE_IP],
        )?;
        for pod in ["pod1", "pod2"] {
            let child = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &name(pod),
                    "python3",
                    "-c",
                    POD_SERVER,
                    pod,
                ])
                .spawn()
                .context("starting a pod's HTTP server")?;
            t.children.push(child);
        }
        Ok(t)
    }
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("timed out after {timeout:?} waiting for {what}")
}

fn requests(ns: &str, url: &str) -> Result<String> {
    Ok(
        output_in_ns(ns, &["python3", "-c", CLIENT, url, &REQUESTS.to_string()])?
            .trim()
            .to_owned(),
    )
}

/// `cargo xtask demo`: setup, build, run the demo.
pub fn run(args: &[String]) -> Result<ExitCode> {
    if !args.is_empty() {
        bail!("`demo` takes no arguments, got {args:?}");
    }
    if !crate::process::is_root() {
        bail!("the demo builds network namespaces and needs root");
    }
    crate::setup::run()?;
    demo(&crate::workspace_root())?;
    Ok(ExitCode::SUCCESS)
}

fn demo(root: &Path) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args(["build", "--quiet", "-p", "kproxy"])
        .current_dir(root);
    crate::process::run_step("demo", &mut build)?;
    let kproxy: PathBuf = root.join("target/debug/kproxy");
    let manifests = root.join("deploy/examples");
    let tag = std::process::id().to_string();
    let mut topo = Topology::build(&tag)?;
    let node = format!("kpd{tag}-node");

    println!("== services (kproxy render --output table) ==");
    sh(&[
        kproxy.to_str().unwrap(),
        "render",
        "--manifests",
        manifests.to_str().unwrap(),
        "--hostname-override",
        "demo-node",
        "--output",
        "table",
    ])?;

    let log = std::fs::File::create(std::env::temp_dir().join(format!("kproxy-demo-{tag}.log")))?;
    let agent = Command::new("ip")
        .args(["netns", "exec", &node])
        .arg(&kproxy)
        .args([
            "--manifests",
            manifests.to_str().unwrap(),
            "--hostname-override",
            "demo-node",
        ])
        .args([
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--metrics-bind-address",
            "127.0.0.1:10249",
        ])
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()
        .context("starting kproxy")?;
    topo.children.push(agent);
    let pod1 = format!("kpd{tag}-pod1");
    let client = format!("kpd{tag}-client");
    let cluster_url = format!("http://{CLUSTER_IP}/");
    wait_for(
        "kproxy to program the ClusterIP",
        Duration::from_secs(20),
        || requests(&pod1, &cluster_url).is_ok_and(|r| r.contains("pod")),
    )?;
    println!("\n== {REQUESTS} requests from pod1 to ClusterIP {CLUSTER_IP}:80 ==");
    println!("{}", requests(&pod1, &cluster_url)?);
    println!(
        "\n== {REQUESTS} requests from the external client to NodePort {NODE_IP}:{NODE_PORT} =="
    );
    println!(
        "{}",
        requests(&client, &format!("http://{NODE_IP}:{NODE_PORT}/"))?
    );
    drop(topo);
    Ok(())
}
