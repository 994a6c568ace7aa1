//! Connect latency and requests/s from a pod to a ClusterIP, per mode and service count,
//! beside the same measured from the same pod directly to the backend pod.

use std::time::Duration;

use anyhow::Context as _;

use kproxy_tests::netns::{Bpffs, Netns, TestCgroup, run_checked};
use kproxy_tests::topology::{Topology, TopologySpec, target_bin};

use super::agent::{AgentSpec, ScratchDir, Source, check_backend, iptables_backend};
use super::services::{SERVICE_PORT, ServiceSet};
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

/// Rounds a mode's connects are split into. Each round measures the direct connect and (for
/// the netfilter modes) the DNAT floor right before the mode, the same number of connects
/// each, so a mode and the references it is divided by meet the same load: on this shared
/// 2-core machine a reference measured minutes before the mode moved its ratio by ±0.15.
const ROUNDS: u32 = 10;

/// What each mode's connects are measured beside, each in its own topology without an agent:
/// the direct connect (pod → backend pod, no rules at all) and the floor of the netfilter
/// modes (the same pod → a ClusterIP one nftables DNAT rule translates; [`floor_topology`]).
struct References {
    direct: Topology,
    floor: Option<Topology>,
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
        let floor = floor_topology()
            .inspect_err(|e| {
                results.unavailable(format!("connect-floor/dnat/{n}"), format!("{e:#}"))
            })
            .ok();
        // A fresh topology: the short-connection requests/s above leave thousands of the
        // client's ports in TIME_WAIT, which made its next connects wait ≈ 1.3 ms each for
        // a free port.
        drop(topo);
        let refs = References {
            direct: topology("bench-direct")?,
            floor,
        };
        for mode in &plan.modes {
            if let Err(e) = measure_mode(plan, results, mode, n, &refs) {
                results.unavailable(format!("connect/{mode}/{n}"), format!("{e:#}"));
            }
        }
    }
    Ok(())
}

/// The floor's ClusterIP: `svc-0`'s address (no agent runs in the floor's topology).
fn floor_vip() -> String {
    format!("{}:{SERVICE_PORT}", ServiceSet::cluster_ip(0))
}

/// The floor of every netfilter mode's connect (issue #19: "where an aim sits below the
/// floor, show the floor"): a topology like the modes' whose node has one nftables rule that
/// DNATs [`floor_vip`] to the two backends the services' target has (`numgen random mod 2`),
/// and an empty `postrouting` NAT chain beside it as every kube-proxy ruleset has one. A
/// connection through it pays conntrack, NAT on both hooks and one rule — nothing of a
/// proxier's ruleset.
fn floor_topology() -> anyhow::Result<Topology> {
    let topo = topology("bench-floor")?;
    let vip = ServiceSet::cluster_ip(0);
    let (b1, b2) = (topo.pod("pod-l1").ip, topo.pod("pod-l2").ip);
    let port = kproxy_tests::topology::POD_PORT;
    let rules = format!(
        "table ip kproxy-bench-dnat-floor {{\n  chain pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n    ip daddr {vip} tcp dport {SERVICE_PORT} dnat to numgen random mod 2 map {{ 0 : {b1}, 1 : {b2} }} : {port}\n  }}\n  chain post {{\n    type nat hook postrouting priority srcnat; policy accept;\n  }}\n}}\n"
    );
    let path = std::env::temp_dir().join(format!("kp-dnat-floor-{}.nft", std::process::id()));
    std::fs::write(&path, rules)?;
    let mut cmd = topo.node.command("nft");
    cmd.arg("-f").arg(&path);
    let loaded = run_checked(&mut cmd).context("loading the DNAT floor's table");
    let _ = std::fs::remove_file(&path);
    loaded?;
    Ok(topo)
}

/// Connect latencies (µs) of a mode's client to `vip`, measured in [`ROUNDS`] rounds, each
/// after the same number of direct connects and (netfilter modes) floor connects; pushes the
/// mode's `connect-direct/` and `connect-floor/` figures and returns the mode's samples.
fn paired(
    plan: &Plan,
    results: &mut Results,
    (mode, n): (&str, u32),
    refs: &References,
    (client, cgroup): (&Netns, Option<&TestCgroup>),
    vip: &str,
) -> anyhow::Result<Vec<f64>> {
    let direct_client = &refs.direct.pod("pod-l0").ns;
    let direct_addr = refs.direct.pod("pod-l1").addr(false);
    let floor = refs.floor.as_ref().filter(|_| mode != "ebpf");
    let (mut own, mut direct, mut floor_samples) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..ROUNDS {
        // `connects` split into ROUNDS shares that add up to it.
        let k = plan.connects * (r + 1) / ROUNDS - plan.connects * r / ROUNDS;
        direct.extend(latency_us(direct_client, None, &direct_addr, k)?);
        if let Some(f) = floor {
            floor_samples.extend(latency_us(&f.pod("pod-l0").ns, None, &floor_vip(), k)?);
        }
        own.extend(latency_us(client, cgroup, vip, k)?);
    }
    let base = format!("connect-direct/{mode}/{n}");
    results.push(figure(
        base.clone(),
        "connect-direct",
        mode,
        n,
        "us",
        direct,
    ));
    if floor.is_some() {
        let mut f = figure(
            format!("connect-floor/{mode}/{n}"),
            "connect-floor",
            mode,
            n,
            "us",
            floor_samples,
        );
        f.baseline = Some(base);
        results.push(f);
    }
    Ok(own)
}

fn measure_mode(
    plan: &Plan,
    results: &mut Results,
    mode: &str,
    n: u32,
    refs: &References,
) -> anyhow::Result<()> {
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
    if !agent.wait_settled(Duration::from_secs(60))? {
        eprintln!(
            "kp-bench: connect/{mode}/{n}: the agent still used CPU 60 s after the service answered"
        );
    }
    let samples = paired(
        plan,
        results,
        (mode, n),
        refs,
        (client, cgroup.as_ref()),
        &vip,
    )?;
    let mut f = figure(
        format!("connect/{mode}/{n}"),
        "connect",
        mode,
        n,
        "us",
        samples,
    );
    f.baseline = Some(format!("connect-direct/{mode}/{n}"));
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
