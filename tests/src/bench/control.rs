//! Control-plane figures through the fake API server: cold start (agent exec → the last
//! service answers) with N services × 5 endpoints, and one endpoint change (API write → a
//! connection reaches the new backend), per mode; plus the agent's peak RSS and CPU seconds.
//!
//! The agent runs with every min-sync-period set to 0 (no rate limit between syncs), so a
//! change is programmed as soon as the previous sync finished. The change's poller
//! (`kp-probe wait`, every millisecond) is running before the API write, so process start-up
//! is not in the figure; the changes follow each other (the next write once the previous one
//! was seen), alternating the target service's single backend between two pods.

use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;

use crate::fakeapi::FakeApi;
use crate::netns::{Bpffs, Netns, TestCgroup};
use crate::topology::TopologySpec;

use super::agent::{AgentSpec, ScratchDir, Source, Waiter, check_backend, iptables_backend};
use super::services::ServiceSet;
use super::{Figure, Plan, Results, Target};

/// A fake API server listening inside `ns` (the agent's namespace) on a thread of its own;
/// stopped when dropped.
pub struct NetnsApi {
    pub api: FakeApi,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<anyhow::Result<()>>>>,
}

impl NetnsApi {
    pub fn start(ns: &Netns) -> anyhow::Result<NetnsApi> {
        let (tx, rx) = mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = ns.spawn(move || -> anyhow::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let api = FakeApi::start().await;
                let ok = api.is_ok();
                let _ = tx.send(api);
                if ok {
                    let _ = stopped.await;
                }
            });
            Ok(())
        })?;
        let api = rx.recv().context("fake API thread died")??;
        Ok(NetnsApi {
            api,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for NetnsApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    for mode in &plan.modes {
        if let Err(e) = measure_mode(plan, results, mode) {
            results.unavailable(
                format!("cold-start/{mode}/{}", plan.cold_services),
                format!("{e:#}"),
            );
        }
    }
    Ok(())
}

fn measure_mode(plan: &Plan, results: &mut Results, mode: &str) -> anyhow::Result<()> {
    let n = plan.cold_services;
    let mut topo = TopologySpec::new(&format!("bench-cp-{mode}"))
        .local_pods(3)
        .build()?;
    topo.pod_mut("pod-l1").serve(&[])?;
    topo.pod_mut("pod-l2").serve(&[])?;
    let (l1, l2) = (topo.pod("pod-l1").ip, topo.pod("pod-l2").ip);
    let set = ServiceSet {
        count: n,
        endpoints_per_service: 5,
        target_backends: vec![l1],
        node_ip: crate::topology::NODE_IP,
    };
    let server = NetnsApi::start(&topo.node)?;
    let api = &server.api;
    api.create(&set.node()?)?;
    for i in 0..n {
        api.create(&set.service(i)?)?;
        api.create(&set.slice(i, &set.endpoints(i))?)?;
    }
    let scratch = ScratchDir::new("bench-cp")?;
    let kubeconfig = scratch.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let ebpf = mode == "ebpf";
    let cgroup = if ebpf {
        Some(TestCgroup::new("bench-cp")?)
    } else {
        None
    };
    let bpffs = if ebpf {
        Some(Bpffs::new("bench-cp")?)
    } else {
        None
    };
    let spec = AgentSpec {
        mode,
        node: &topo.node,
        source: Source::Kubeconfig(kubeconfig),
        cgroup: cgroup.as_ref(),
        bpffs: bpffs.as_ref(),
        log: scratch.path().join("agent.log"),
    };
    let client = &topo.pod("pod-l0").ns;
    let vip = set.target_addr();
    let mut agent = spec.start()?;
    let answered = agent
        .wait_answer(
            client,
            cgroup.as_ref(),
            &vip,
            Some("pod-l1"),
            Duration::from_secs(300),
        )
        .map_err(anyhow::Error::msg)?;
    let cold = answered.duration_since(agent.started)?.as_secs_f64();
    if let Some(backend) = iptables_backend(mode) {
        check_backend(&topo.node, backend)?;
    }
    // The targets: ebpf and iptables (either backend); none for ipvs.
    let targets = match mode {
        "ebpf" => Some((1.0, 10.0)),
        m if iptables_backend(m).is_some() => Some((5.0, 150.0)),
        _ => None,
    };
    results.push(Figure {
        id: format!("cold-start/{mode}/{n}"),
        group: "cold-start".into(),
        mode: mode.into(),
        services: n,
        unit: "s".into(),
        samples: vec![cold],
        baseline: None,
        target: targets.filter(|_| n >= 10_000).map(|(max_cold, _)| Target {
            max_ratio: None,
            max_value: Some(max_cold),
            text: format!("cold 10k×5 ≤ {max_cold} s ({mode})"),
        }),
    });

    // A failing change series is reported as such; the cold start and resources stay.
    match changes(
        plan,
        &set,
        api,
        &mut agent,
        client,
        cgroup.as_ref(),
        &vip,
        (l1, l2),
    ) {
        Ok(changes) => results.push(Figure {
            id: format!("change/{mode}/{n}"),
            group: "change".into(),
            mode: mode.into(),
            services: n,
            unit: "ms".into(),
            samples: changes,
            baseline: None,
            target: targets
                .filter(|_| n >= 10_000)
                .map(|(_, max_change)| Target {
                    max_ratio: None,
                    max_value: Some(max_change),
                    text: format!("one change ≤ {max_change} ms ({mode})"),
                }),
        }),
        Err(e) => results.unavailable(format!("change/{mode}/{n}"), format!("{e:#}")),
    }
    if let Ok(dst) = std::env::var("KP_BENCH_KEEP_LOG") {
        let to = format!("{dst}-{mode}-{n}.log");
        if let Err(e) = std::fs::copy(scratch.path().join("agent.log"), &to) {
            eprintln!("kp-bench: KP_BENCH_KEEP_LOG: copying the agent log to {to}: {e}");
        }
    }
    for (what, unit, value, target) in [
        ("rss", "MB", agent.peak_rss_mb()?, Some(60.0)),
        ("cpu", "s", agent.cpu_seconds()?, None),
    ] {
        results.push(Figure {
            id: format!("{what}/{mode}/{n}"),
            group: "resources".into(),
            mode: mode.into(),
            services: n,
            unit: unit.into(),
            samples: vec![value],
            baseline: None,
            target: target.map(|max| Target {
                max_ratio: None,
                max_value: Some(max),
                text: format!("peak RSS ≤ {max} MB"),
            }),
        });
    }
    Ok(())
}

/// `plan.changes` endpoint changes of the target service, one after the other, alternating
/// its single backend between the two pods: API write → the new backend answers, in ms.
#[allow(clippy::too_many_arguments)]
fn changes(
    plan: &Plan,
    set: &ServiceSet,
    api: &FakeApi,
    agent: &mut super::agent::RunningAgent,
    client: &Netns,
    cgroup: Option<&TestCgroup>,
    vip: &str,
    (l1, l2): (std::net::Ipv4Addr, std::net::Ipv4Addr),
) -> anyhow::Result<Vec<f64>> {
    let mut changes = Vec::new();
    for k in 0..plan.changes {
        let (to, name) = if k % 2 == 0 {
            (l2, "pod-l2")
        } else {
            (l1, "pod-l1")
        };
        let slice = set.slice(set.target_index(), &[to])?;
        // The poller runs before the write: the delay measured is the agent's, not the time
        // to start a process in the client namespace.
        let waiter = Waiter::start(client, cgroup, vip, name, Duration::from_secs(30))?;
        let written = SystemTime::now();
        api.apply(&slice)?;
        let at = waiter.finish().map_err(|e| {
            let log = agent
                .check_alive()
                .err()
                .unwrap_or_else(|| agent.log_tail());
            anyhow::anyhow!("change {k}: {e:#}; agent: {log}")
        })?;
        changes.push(at.duration_since(written)?.as_secs_f64() * 1000.0);
    }
    Ok(changes)
}
