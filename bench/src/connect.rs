//! Connect latency and requests/s from a pod to a ClusterIP, per mode and service count,
//! beside the same measured from the same pod directly to the backend pod.

use std::time::Duration;

use anyhow::Context as _;

use kproxy_tests::netns::{Bpffs, Netns, TestCgroup, run_checked};
use kproxy_tests::topology::{Topology, TopologySpec, target_bin};

use super::agent::{AgentSpec, ScratchDir, Source, check_backend, iptables_backend};
use super::services::ServiceSet;
use super::{Figure, Plan, Results, Target};

/// TCP connect latencies (µs) from `ns` (inside `cgroup` when given) to `addr`.
pub fn latency_us(
    ns: &Netns,
    cgroup: Option<&TestCgroup>,
    addr: &str,
    count: u32,
) -> anyhow::Result<Vec<f64>> {
    let mut cmd = ns.command(target_bin("kp-probe")?);
    cmd.args(["latency", addr, "--count", &count.to_string()]);
    if let Some(cg) = cgroup {
        cg.enter_on_spawn(&mut cmd)?;
    }
    let out = run_checked(&mut cmd)?;
    let v: serde_json::Value = serde_json::from_str(out.trim()).context("kp-probe latency")?;
    let errors = v["errors"].as_u64().unwrap_or(0);
    anyhow::ensure!(errors == 0, "{errors} of {count} connects to {addr} failed");
    Ok(v["samples_ns"]
        .as_array()
        .context("no samples")?
        .iter()
        .filter_map(|s| s.as_f64())
        .map(|ns| ns / 1000.0)
        .collect())
}

/// Requests per second over one keep-alive connection, or one connection per request.
pub fn rps(
    ns: &Netns,
    cgroup: Option<&TestCgroup>,
    addr: &str,
    seconds: u32,
    short: bool,
) -> anyhow::Result<f64> {
    let mut cmd = ns.command(target_bin("kp-probe")?);
    cmd.args(["rps", addr, "--seconds", &seconds.to_string()]);
    if short {
        cmd.arg("--short");
    }
    if let Some(cg) = cgroup {
        cg.enter_on_spawn(&mut cmd)?;
    }
    let out = run_checked(&mut cmd)?;
    let v: serde_json::Value = serde_json::from_str(out.trim()).context("kp-probe rps")?;
    let n = v["requests"]
        .as_f64()
        .with_context(|| format!("rps: {out}"))?;
    Ok(n / v["seconds"].as_f64().unwrap_or(f64::from(seconds)))
}

fn topology(hint: &str) -> anyhow::Result<Topology> {
    // pod-l0 is the client; pod-l1 and pod-l2 the backends.
    let mut topo = TopologySpec::new(hint).local_pods(3).build()?;
    topo.pod_mut("pod-l1").serve(&[])?;
    topo.pod_mut("pod-l2").serve(&[])?;
    Ok(topo)
}

fn figure(
    id: String,
    group: &str,
    mode: &str,
    services: u32,
    unit: &str,
    samples: Vec<f64>,
) -> Figure {
    Figure {
        id,
        group: group.into(),
        mode: mode.into(),
        services,
        unit: unit.into(),
        samples,
        baseline: None,
        target: None,
    }
}

pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    let direct_id = &plan.direct;
    for &n in &plan.connect_scales {
        let topo = topology("bench-conn")?;
        let client = &topo.pod("pod-l0").ns;
        let direct = topo.pod("pod-l1").addr(false);
        results.push(figure(
            format!("connect/{direct_id}/{n}"),
            "connect",
            "baseline",
            n,
            "us",
            latency_us(client, None, &direct, plan.connects)?,
        ));
        for short in [false, true] {
            let kind = if short { "short" } else { "keepalive" };
            let v = rps(client, None, &direct, plan.rps_seconds, short)?;
            results.push(figure(
                format!("rps-{kind}/{direct_id}/{n}"),
                "rps",
                "baseline",
                n,
                "req/s",
                vec![v],
            ));
        }
        drop(topo);
        for mode in &plan.modes {
            if let Err(e) = measure_mode(plan, results, mode, n) {
                results.unavailable(format!("connect/{mode}/{n}"), format!("{e:#}"));
            }
        }
    }
    Ok(())
}

fn measure_mode(plan: &Plan, results: &mut Results, mode: &str, n: u32) -> anyhow::Result<()> {
    let topo = topology(&format!("bench-{mode}"))?;
    let scratch = ScratchDir::new("bench-conn")?;
    let set = ServiceSet {
        count: n,
        endpoints_per_service: 5,
        target_backends: vec![topo.pod("pod-l1").ip, topo.pod("pod-l2").ip],
        node_ip: kproxy_tests::topology::NODE_IP,
    };
    let manifests = scratch.path().join("services.yaml");
    std::fs::write(&manifests, set.manifests())?;
    let ebpf = mode == "ebpf";
    let cgroup = if ebpf {
        Some(TestCgroup::new("bench-conn")?)
    } else {
        None
    };
    let bpffs = if ebpf {
        Some(Bpffs::new("bench-conn")?)
    } else {
        None
    };
    let spec = AgentSpec {
        mode,
        node: &topo.node,
        source: Source::Manifests(manifests),
        cgroup: cgroup.as_ref(),
        bpffs: bpffs.as_ref(),
        log: scratch.path().join("agent.log"),
    };
    let mut agent = spec.start()?;
    let client = &topo.pod("pod-l0").ns;
    let vip = set.target_addr();
    agent
        .wait_answer(
            client,
            cgroup.as_ref(),
            &vip,
            None,
            Duration::from_secs(180),
        )
        .map_err(anyhow::Error::msg)?;
    if let Some(backend) = iptables_backend(mode) {
        check_backend(&topo.node, backend)?;
    }
    let mut f = figure(
        format!("connect/{mode}/{n}"),
        "connect",
        mode,
        n,
        "us",
        latency_us(client, cgroup.as_ref(), &vip, plan.connects)?,
    );
    f.baseline = Some(format!("connect/{}/{n}", plan.direct));
    if ebpf && n >= 10_000 {
        f.target = Some(Target {
            max_ratio: Some(1.05),
            max_value: None,
            text: "ClusterIP connect at 10k services ≤ 1.05× direct (ebpf)".into(),
        });
    }
    if mode == "nftables" && n >= 10_000 {
        f.target = Some(Target {
            max_ratio: Some(1.3),
            max_value: None,
            text: "ClusterIP connect at 10k services ≤ 1.3× direct (nftables)".into(),
        });
    }
    results.push(f);
    for short in [false, true] {
        let kind = if short { "short" } else { "keepalive" };
        let v = rps(client, cgroup.as_ref(), &vip, plan.rps_seconds, short)?;
        let mut f = figure(
            format!("rps-{kind}/{mode}/{n}"),
            "rps",
            mode,
            n,
            "req/s",
            vec![v],
        );
        f.baseline = Some(format!("rps-{kind}/{}/{n}", plan.direct));
        results.push(f);
    }
    agent.check_alive().map_err(anyhow::Error::msg)?;
    Ok(())
}
