//! `kproxy inspect` at scale (issue #22: it must answer in seconds at 100k services): an
//! ebpf-mode agent with 100k ClusterIP services × 2 endpoints from the fake API server (map
//! sizes raised to hold them: `services=131072,backends=262144`), then `kproxy inspect` run
//! in the node namespace the way an operator runs it (services listed from the API server,
//! every pinned map dumped once), three times each:
//!
//! - `inspect/ebpf/N`: the whole report as a table (stdout to a file), wall seconds;
//! - `inspect-cpu/ebpf/N`: its user + system CPU seconds;
//! - `inspect-service/ebpf/N`, `inspect-service-cpu/ebpf/N`: `--service bench/svc-0`, wall
//!   and CPU seconds (the API listing and the map dumps are the same; only the output
//!   shrinks).
//!
//! - `inspect-list-floor/ebpf/N` (the baseline of `inspect/…`): the two lists inspect makes
//!   (Services and EndpointSlices with upstream's label selector), fetched over one plain
//!   HTTP/1.1 connection each and read to the end, nothing parsed — what serving 100k
//!   objects costs the fake API server (in this process, on a shared 2-core machine), which
//!   inspect waits for too.
//!
//! Target: the whole report within 10 s. `--quick` (with `--only inspect`) uses 20k
//! services; like the soak, a plain `--quick` run skips the group.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use kproxy_tests::netns::{Bpffs, TestCgroup};
use kproxy_tests::topology::{NODE_IP, TopologySpec, kproxy_bin};

use super::agent::{AgentSpec, ScratchDir, Source};
use super::control::NetnsApi;
use super::services::{NODE_NAME, ServiceSet};
use super::{Figure, Plan, Results, Target};

const ENDPOINTS: u32 = 2;
const RUNS: usize = 3;

pub fn services(plan: &Plan) -> u32 {
    if plan.quick { 20_000 } else { 100_000 }
}

pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    let n = services(plan);
    if !plan.modes.iter().any(|m| m == "ebpf") {
        return Ok(());
    }
    if let Err(e) = measure(n, results) {
        results.unavailable(format!("inspect/ebpf/{n}"), format!("{e:#}"));
    }
    Ok(())
}

/// User + system CPU seconds of this process's waited-for children so far.
fn children_cpu() -> f64 {
    // SAFETY: getrusage with a valid out-pointer.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn measure(n: u32, results: &mut Results) -> anyhow::Result<()> {
    let mut topo = TopologySpec::new("bench-inspect").local_pods(2).build()?;
    topo.pod_mut("pod-l1").serve(&[])?;
    let set = ServiceSet {
        count: n,
        endpoints_per_service: ENDPOINTS,
        target_backends: vec![topo.pod("pod-l1").ip],
        node_ip: NODE_IP,
    };
    let server = NetnsApi::start(&topo.node)?;
    let api = &server.api;
    set.create_all(api)?;
    let scratch = ScratchDir::new("bench-inspect")?;
    let kubeconfig = scratch.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let cgroup = TestCgroup::new("bench-inspect")?;
    let bpffs = Bpffs::new("bench-inspect")?;
    let spec = AgentSpec {
        mode: "ebpf",
        node: &topo.node,
        source: Source::Kubeconfig(kubeconfig.clone()),
        cgroup: Some(&cgroup),
        bpffs: Some(&bpffs),
        log: scratch.path().join("agent.log"),
    };
    let mut args = spec.args();
    args.push("--bpf-map-sizes=services=131072,backends=262144".to_string());
    let mut agent = spec.start_with(args)?;
    agent
        .wait_answer(
            &topo.pod("pod-l0").ns,
            Some(&cgroup),
            &set.target_addr(),
            Some("pod-l1"),
            Duration::from_secs(600),
        )
        .map_err(anyhow::Error::msg)?;
    eprintln!(
        "kp-bench: inspect: agent programmed {n} services in {:.1} s",
        agent.started.elapsed()?.as_secs_f64()
    );
    let out_file = scratch.path().join("inspect.out");
    let one = |service: Option<&str>| -> anyhow::Result<(f64, f64, u64)> {
        let mut cmd = topo.node.command(kproxy_bin()?);
        cmd.arg("inspect")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--hostname-override={NODE_NAME}"))
            .arg(format!("--bpffs={}", bpffs.path().display()))
            .env("RUST_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdout(std::fs::File::create(&out_file)?)
            .stderr(std::process::Stdio::piped());
        if let Some(s) = service {
            cmd.arg(format!("--service={s}"));
        }
        let cpu = children_cpu();
        let t = Instant::now();
        let out = cmd.output().context("running kproxy inspect")?;
        let wall = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            out.status.success(),
            "kproxy inspect failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = std::fs::metadata(&out_file)?.len();
        Ok((wall, children_cpu() - cpu, bytes))
    };
    let (mut wall, mut cpu, mut single) = (vec![], vec![], vec![]);
    for _ in 0..RUNS {
        let (w, c, bytes) = one(None)?;
        eprintln!("kp-bench: inspect/ebpf/{n}: {w:.2} s wall, {c:.2} s CPU, {bytes} bytes");
        wall.push(w);
        cpu.push(c);
    }
    let mut single_cpu = vec![];
    for _ in 0..RUNS {
        let (w, c, bytes) = one(Some("bench/svc-0"))?;
        anyhow::ensure!(bytes > 0, "inspect --service printed nothing");
        eprintln!("kp-bench: inspect-service/ebpf/{n}: {w:.2} s wall, {c:.2} s CPU");
        single.push(w);
        single_cpu.push(c);
    }
    let port = api.port();
    let mut floor = vec![];
    for _ in 0..RUNS {
        floor.push(topo.node.run(move || list_floor(port))??);
    }
    agent.check_alive().map_err(anyhow::Error::msg)?;
    let target = Target {
        max_ratio: None,
        max_value: Some(10.0),
        text: "whole report ≤ 10 s".into(),
    };
    let floor_id = format!("inspect-list-floor/ebpf/{n}");
    for (id, samples, baseline, target) in [
        (floor_id.clone(), floor, None, None),
        (
            format!("inspect/ebpf/{n}"),
            wall,
            Some(floor_id.clone()),
            Some(target),
        ),
        (format!("inspect-cpu/ebpf/{n}"), cpu, None, None),
        (
            format!("inspect-service-cpu/ebpf/{n}"),
            single_cpu,
            None,
            None,
        ),
        (
            format!("inspect-service/ebpf/{n}"),
            single,
            Some(floor_id.clone()),
            None,
        ),
    ] {
        results.push(Figure {
            id,
            group: "inspect".into(),
            mode: "ebpf".into(),
            services: n,
            unit: "s".into(),
            samples,
            baseline,
            target,
        });
    }
    Ok(())
}

/// Seconds to fetch the Services and EndpointSlices lists inspect makes from the fake API
/// server on 127.0.0.1:`port` (run inside its namespace), bodies read to the end.
fn list_floor(port: u16) -> anyhow::Result<f64> {
    use std::io::{Read as _, Write as _};
    let selector = kproxy::source::PROXYABLE_LABEL_SELECTOR
        .replace('!', "%21")
        .replace(',', "%2C")
        .replace(' ', "%20");
    let t = Instant::now();
    for path in [
        "/api/v1/services",
        "/apis/discovery.k8s.io/v1/endpointslices",
    ] {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port))?;
        write!(
            conn,
            "GET {path}?labelSelector={selector} HTTP/1.1\r\nHost: 127.0.0.1\r\n\
             Accept: application/json\r\nConnection: close\r\n\r\n"
        )?;
        let mut body = Vec::new();
        conn.read_to_end(&mut body)?;
        anyhow::ensure!(
            body.starts_with(b"HTTP/1.1 200"),
            "GET {path}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        );
    }
    Ok(t.elapsed().as_secs_f64())
}
