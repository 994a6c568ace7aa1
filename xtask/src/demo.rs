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
//! kproxy (the real binary, mode detected: ebpf on a capable kernel) runs inside `node` on `deploy/examples/` (services `web` ClusterIP 10.96.0.10:80 /
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

/// Prints the body of one GET (python3 is among setup's packages; curl is not).
const GET: &str = r#"
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=3).read().decode())
"#;
/// The agent's metrics server (`--metrics-bind-address`), which answers `GET /proxyMode`.
const METRICS_ADDR: &str = "127.0.0.1:10249";

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

fn requests(ns: &str, url: &str, cgroup: Option<&Path>) -> Result<String> {
    let n = REQUESTS.to_string();
    let out = match cgroup {
        // A pod's process lives in the socket-LB cgroup: enter it, then the pod's netns.
        Some(cg) => {
            let script = format!(
                "echo $$ > {}/cgroup.procs && exec ip netns exec {ns} python3 -c \"$0\" \"$1\" \"$2\"",
                cg.display()
            );
            let o = Command::new("sh")
                .args(["-c", &script, CLIENT, url, &n])
                .output()?;
            if !o.status.success() {
                bail!("client in {ns}: {}", String::from_utf8_lossy(&o.stderr));
            }
            String::from_utf8_lossy(&o.stdout).into_owned()
        }
        None => output_in_ns(ns, &["python3", "-c", CLIENT, url, &n])?,
    };
    Ok(out.trim().to_owned())
}

/// A cgroup (v2) directory for the demo's pods, removed on drop.
struct Cgroup(PathBuf);

impl Cgroup {
    fn new(tag: &str) -> Result<Cgroup> {
        let mounts = std::fs::read_to_string("/proc/self/mounts")?;
        let root = mounts
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
            })
            .context("no cgroup2 mount: the eBPF socket LB needs one")?;
        let dir = root.join(format!("kproxy-demo-{tag}"));
        std::fs::create_dir_all(&dir)?;
        Ok(Cgroup(dir))
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A private bpffs directory (kproxy mounts it), unmounted and removed on drop.
struct Bpffs(PathBuf);

impl Drop for Bpffs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `cargo xtask demo`: setup (the same idempotent step as `cargo xtask test`, so the demo
/// works as the first command on a fresh machine), build, run the demo.
pub fn run() -> Result<ExitCode> {
    if !crate::process::is_root() {
        bail!("the demo builds network namespaces and needs root");
    }
    crate::setup::run()?;
    demo(&crate::workspace_root())?;
    Ok(ExitCode::SUCCESS)
}

fn demo(root: &Path) -> Result<()> {
    // Without `cargo run`'s variables (`crate::process::cargo`): with them, a nested build
    // recompiles crates whose build scripts watch them, and the next plain build again.
    let mut build = crate::process::cargo();
    build
        .args(["build", "--quiet", "-p", "kproxy", "--bin", "kproxy"])
        .current_dir(root);
    crate::process::run_step("demo", &mut build)?;
    let kproxy: PathBuf = crate::target_dir().join("debug/kproxy");
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

    let cgroup = Cgroup::new(&tag)?;
    let bpffs = Bpffs(std::env::temp_dir().join(format!("kproxy-demo-{tag}-bpffs")));
    std::fs::create_dir_all(&bpffs.0)?;
    let common = [
        format!("--manifests={}", manifests.display()),
        "--hostname-override=demo-node".to_string(),
        format!("--bpf-cgroup={}", cgroup.0.display()),
        format!("--bpffs={}", bpffs.0.display()),
    ];
    let nsenter = |ns: &str| {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{ns}"));
        c
    };

    let log_path = std::env::temp_dir().join(format!("kproxy-demo-{tag}.log"));
    let log = std::fs::File::create(&log_path)?;
    // The real agent, in the node's network namespace (nsenter keeps the host's mounts, so
    // the cgroup2 tree is where kproxy looks for it); no --proxy-mode: it detects.
    let agent = nsenter(&node)
        .arg(&kproxy)
        .args(&common)
        .args([
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--metrics-bind-address",
            METRICS_ADDR,
        ])
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .spawn()
        .context("starting kproxy")?;
    topo.children.push(agent);
    let pod1 = format!("kpd{tag}-pod1");
    let client = format!("kpd{tag}-client");
    let cluster_url = format!("http://{CLUSTER_IP}/");
    let ready = wait_for(
        "kproxy to program the ClusterIP",
        Duration::from_secs(30),
        || requests(&pod1, &cluster_url, Some(&cgroup.0)).is_ok_and(|r| r.contains("pod")),
    );
    let proxy_mode = format!("http://{METRICS_ADDR}/proxyMode");
    let mode = output_in_ns(&node, &["python3", "-c", GET, &proxy_mode]).unwrap_or_default();
    println!(
        "\n== kproxy runs in mode {:?} (GET /proxyMode) ==",
        mode.trim()
    );
    if let Err(e) = ready {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        bail!("{e}; kproxy log:\n{log}");
    }
    println!("\n== kproxy inspect (what the kernel holds) ==");
    let out = nsenter(&node)
        .arg(&kproxy)
        .arg("inspect")
        .args(&common)
        .output()?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if !out.status.success() {
        println!("inspect failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    println!(
        "\n== {REQUESTS} requests from pod1 (in the socket-LB cgroup) to ClusterIP {CLUSTER_IP}:80 =="
    );
    let r1 = requests(&pod1, &cluster_url, Some(&cgroup.0))?;
    println!("{r1}");
    println!(
        "\n== {REQUESTS} requests from the external client to NodePort {NODE_IP}:{NODE_PORT} =="
    );
    let r2 = requests(&client, &format!("http://{NODE_IP}:{NODE_PORT}/"), None)?;
    println!("{r2}");
    // Stop the agent, then remove what it programmed.
    if let Some(mut agent) = topo.children.pop() {
        let _ = agent.kill();
        let _ = agent.wait();
    }
    let st = nsenter(&node)
        .arg(&kproxy)
        .arg("cleanup")
        .args(&common)
        .status()?;
    println!("\n== kproxy cleanup: {st} ==");
    drop(topo);
    drop(bpffs);
    drop(cgroup);
    for (what, r) in [("ClusterIP", &r1), ("NodePort", &r2)] {
        if !(r.contains("pod1=") && r.contains("pod2=")) || r.contains("error") {
            bail!("{what} requests did not reach both pods: {r}");
        }
    }
    println!("\ndemo ok: both pods answered through the ClusterIP and the NodePort");
    Ok(())
}
