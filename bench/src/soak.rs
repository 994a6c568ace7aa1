//! The soak (issue #22): a few thousand services × 3 endpoints through the fake API server
//! under sustained endpoint churn for minutes, with real traffic to a sample of them all the
//! while; what the agent holds (RSS, open fds, map fill) at the start, at its peak and at the
//! end, and how long the kernel takes to equal the desired state after the last change.
//!
//! Per mode (`ebpf` and `iptables-nft` of the run's modes; the other modes are not soaked):
//!
//! 1. **Cold start**: N services (`ServiceSet` addresses, 3 endpoints each at addresses no
//!    host holds) in the fake API server; the agent (every min-sync-period 0, like the control
//!    group) starts and the soak waits until the kernel equals the desired state. The *start*
//!    sample is taken then.
//! 2. **Churn** for the plan's duration at 20 API writes/s: 80 % replace one endpoint of a
//!    random service with a never-used address (new backends, old ones released), 10 % give
//!    one of the 6 *sampled* services (NodePorts, backed by the topology's real pods) a new
//!    random non-empty set of pods, 10 % delete or recreate one of the *flapping* services
//!    (2 % of N; Service and EndpointSlice). Meanwhile a prober runs `kp-probe tcp` rounds
//!    to every sampled service, from a pod to its ClusterIP (socket LB in ebpf mode) and from
//!    outside the node to its NodePort (the TC path and `KP_CT`), and every failed connection
//!    is counted. RSS and fds are read every second, the map fill (ebpf: every pinned map,
//!    through `kproxy inspect`; iptables: the nat table's chains and rules, through
//!    `iptables-nft-save`) every 10 s; the peak is the highest sample.
//! 3. **Last change**: the flapping services are recreated and the sampled ones get their
//!    first pods back, so the desired state has the cold start's shape again (same service
//!    and endpoint counts, other addresses). `soak-converge` is the time from that last API
//!    write until `kproxy inspect` (run back to back — 1 s apart in iptables modes, where each
//!    run saves the whole nat table —, each run listing the API and reading the kernel) first
//!    shows every service's kernel backends equal to its endpoints and the
//!    endpoints equal to what the soak wrote: an upper bound, its resolution one inspect run.
//! 4. **Settle**: traffic stops; the soak waits for the connection tables to expire closed
//!    flows (ebpf: the agent runs with `bpf.conntrack` `tcpTimeWaitTimeout: 10s`,
//!    `expiryInterval: 2s` so that takes 14 s instead of 135 s; iptables: 45 s, for the
//!    stale chains that large-cluster mode deletes once per 30 s sync period, like upstream)
//!    and takes the *end* sample.
//!
//! Figures, each with samples `[start, peak, end]` (shown as such in the report's soak table;
//! the generic table's median of the three is `max(start, end)`, which the target bounds):
//! `soak/rss/…` (MB, end ≤ start + max(8 MB, 25 %)), `soak/fds/…` (end ≤ start + 2),
//! `soak/map-<MAP>/…` (entries; end ≤ start for the service maps, ≤ start + 16 for maps of
//! flows: `KP_CT*`, `KP_SOCK_*`, `KP_AFFINITY`), `soak/nat-rules/…`, `soak/nat-chains/…`
//! (end ≤ start); plus `soak/converge/…` (s, ≤ 5 s), `soak/stale-services/…` (services whose
//! kernel backends still differ from the desired state at the end, 0) and
//! `soak/probe-failures/…` (% of the probes' connections, ≤ 0.1 %). A converge that never happens (120 s) is pushed as a
//! failed figure of 120 s. The run sizes: 3,000 services for 4 min, `--quick` 2,000 for 1 min
//! (`KP_BENCH_SOAK_SERVICES` / `KP_BENCH_SOAK_SECONDS` override). The soak runs in a full
//! run and with `--only soak`, not in a plain `--quick` run (the smoke test's).

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy_tests::fakeapi::FakeApi;
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup};
use kproxy_tests::topology::{NODE_IP, POD_PORT, Probe, TopologySpec, kproxy_bin};
use serde_json::Value;

use super::agent::{AgentSpec, RunningAgent, ScratchDir, Source, iptables_backend, proxy_mode};
use super::control::NetnsApi;
use super::services::{NODE_NAME, SERVICE_PORT, ServiceSet};
use super::{Figure, Plan, Results, Target};

/// Services backed by the topology's pods (NodePorts), probed throughout.
const SAMPLED: u32 = 6;
/// NodePort of sampled service `i`.
const NODE_PORT_BASE: u16 = 30100;
const ENDPOINTS: u32 = 3;
const WRITES_PER_SECOND: f64 = 20.0;
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(120);
/// ebpf: the agent's connection-table timeouts during the soak (see the module docs).
const EBPF_CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
    kind: KubeProxyConfiguration\n\
    bpf:\n  conntrack: {tcpTimeWaitTimeout: 10s, expiryInterval: 2s}\n";
const EBPF_SETTLE: Duration = Duration::from_secs(20);
/// iptables: in large-cluster mode (> 1,000 endpoints) stale chains are deleted at most once
/// per sync period (30 s by default, as upstream), so the end sample waits for one.
const IPTABLES_SETTLE: Duration = Duration::from_secs(45);

/// Desired backends (`ip:port`) per service port name (`ns/name:port`).
type Desired = BTreeMap<String, BTreeSet<String>>;

/// Sizes of the soak.
#[derive(Debug, Clone)]
pub struct SoakPlan {
    pub services: u32,
    pub churn: Duration,
}

impl SoakPlan {
    pub fn new(plan: &Plan) -> SoakPlan {
        let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
        let (services, secs) = if plan.quick {
            (2_000, 60)
        } else {
            (3_000, 240)
        };
        SoakPlan {
            services: env("KP_BENCH_SOAK_SERVICES").map_or(services, |v| v as u32),
            churn: Duration::from_secs(env("KP_BENCH_SOAK_SECONDS").unwrap_or(secs)),
        }
    }
}

/// The modes soaked: `ebpf` and `iptables-nft`, where the plan has them.
fn modes(plan: &Plan) -> Vec<&str> {
    plan.modes
        .iter()
        .map(String::as_str)
        .filter(|m| matches!(*m, "ebpf" | "iptables-nft"))
        .collect()
}

pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    let sp = SoakPlan::new(plan);
    anyhow::ensure!(
        sp.services > SAMPLED * 2,
        "KP_BENCH_SOAK_SERVICES must exceed {}",
        SAMPLED * 2
    );
    for mode in modes(plan) {
        if let Err(e) = soak_mode(&sp, results, mode) {
            results.unavailable(format!("soak/{mode}/{}", sp.services), format!("{e:#}"));
        }
    }
    Ok(())
}

/// A small deterministic generator (xorshift64*), so runs churn alike.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
}

/// The desired state the soak writes, and its writes.
struct Model {
    set: ServiceSet,
    pods: [Ipv4Addr; 3],
    flapping: u32,
    present: Vec<bool>,
    backends: Vec<Vec<Ipv4Addr>>,
    next_addr: u32,
    rng: Rng,
}

impl Model {
    fn new(services: u32, pods: [Ipv4Addr; 3]) -> Model {
        let set = ServiceSet {
            count: services,
            endpoints_per_service: ENDPOINTS,
            target_backends: vec![],
            node_ip: NODE_IP,
        };
        let backends = (0..services)
            .map(|i| {
                if i < SAMPLED {
                    pods.to_vec()
                } else {
                    // `endpoints` gives the target (the last service) the (empty) pod list.
                    let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i * ENDPOINTS;
                    (0..ENDPOINTS).map(|j| Ipv4Addr::from(base + j)).collect()
                }
            })
            .collect();
        Model {
            set,
            pods,
            flapping: (services / 50).max(1),
            present: vec![true; services as usize],
            backends,
            next_addr: u32::from(Ipv4Addr::new(10, 160, 0, 0)),
            rng: Rng(0x9E37_79B9_7F4A_7C15),
        }
    }

    fn name(i: u32) -> String {
        format!("svc-{i}")
    }

    fn service(&self, i: u32) -> anyhow::Result<Service> {
        let mut v = self.set.service_json(i);
        if i < SAMPLED {
            v["spec"]["type"] = "NodePort".into();
            v["spec"]["ports"][0]["nodePort"] = (NODE_PORT_BASE + i as u16).into();
        }
        Ok(serde_json::from_value(v)?)
    }

    fn slice(&self, i: u32) -> anyhow::Result<EndpointSlice> {
        self.set.slice(i, &self.backends[i as usize])
    }

    fn create_all(&self, api: &FakeApi) -> anyhow::Result<()> {
        api.create(&self.set.node()?)?;
        for i in 0..self.set.count {
            api.create(&self.service(i)?)?;
            api.create(&self.slice(i)?)?;
        }
        Ok(())
    }

    /// One random write (see the module docs).
    fn step(&mut self, api: &FakeApi) -> anyhow::Result<()> {
        let r = self.rng.below(100);
        if r < 10 {
            let i = self.rng.below(SAMPLED);
            let mask = 1 + self.rng.below(7);
            self.backends[i as usize] = (0..3)
                .filter(|b| mask & (1 << b) != 0)
                .map(|b| self.pods[b])
                .collect();
            api.apply(&self.slice(i)?)?;
        } else if r < 20 {
            let i = SAMPLED + self.rng.below(self.flapping);
            self.toggle(api, i)?;
        } else {
            let first = SAMPLED + self.flapping;
            let i = first + self.rng.below(self.set.count - first);
            let j = self.rng.below(ENDPOINTS) as usize;
            self.backends[i as usize][j] = Ipv4Addr::from(self.next_addr);
            self.next_addr += 1;
            api.apply(&self.slice(i)?)?;
        }
        Ok(())
    }

    fn toggle(&mut self, api: &FakeApi, i: u32) -> anyhow::Result<()> {
        if self.present[i as usize] {
            api.delete::<EndpointSlice>("bench", &format!("{}-1", Self::name(i)))?;
            api.delete::<Service>("bench", &Self::name(i))?;
        } else {
            api.apply(&self.service(i)?)?;
            api.apply(&self.slice(i)?)?;
        }
        self.present[i as usize] = !self.present[i as usize];
        Ok(())
    }

    /// The last change: the cold start's shape again (see the module docs).
    fn restore(&mut self, api: &FakeApi) -> anyhow::Result<()> {
        for i in SAMPLED..SAMPLED + self.flapping {
            if !self.present[i as usize] {
                self.toggle(api, i)?;
            }
        }
        for i in 0..SAMPLED {
            self.backends[i as usize] = self.pods.to_vec();
            api.apply(&self.slice(i)?)?;
        }
        Ok(())
    }

    /// Desired backends (`ip:port`) by service port name as inspect prints it.
    fn desired(&self) -> Desired {
        (0..self.set.count)
            .filter(|&i| self.present[i as usize])
            .map(|i| {
                let eps = self.backends[i as usize]
                    .iter()
                    .map(|ip| format!("{ip}:{POD_PORT}"))
                    .collect();
                (format!("bench/{}:http", Self::name(i)), eps)
            })
            .collect()
    }
}

/// What one `kproxy inspect --output json` run said.
struct Inspected {
    /// Services whose endpoints or kernel backends differ from the desired state (or that
    /// are missing / not desired).
    mismatches: usize,
    first_mismatch: Option<String>,
    /// Entries per pinned map (ebpf).
    maps: BTreeMap<String, f64>,
    /// When the run ended.
    at: Instant,
}

/// Runs `kproxy inspect` in the node namespace against the fake API server and compares it
/// with `desired`.
fn inspect(
    node: &Netns,
    mode: &str,
    kubeconfig: &std::path::Path,
    bpffs: Option<&Bpffs>,
    desired: &Desired,
) -> anyhow::Result<Inspected> {
    let mut cmd = node.command(kproxy_bin()?);
    cmd.args(["inspect", "--output", "json"])
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg(format!("--hostname-override={NODE_NAME}"))
        .arg(format!("--proxy-mode={}", proxy_mode(mode)))
        .env("RUST_LOG", "error")
        .env("NO_COLOR", "1");
    if let Some(fs) = bpffs {
        cmd.arg(format!("--bpffs={}", fs.path().display()));
    }
    let out = kproxy_tests::netns::run_checked(&mut cmd)?;
    let at = Instant::now();
    let v: Value = serde_json::from_str(&out).context("parsing kproxy inspect's JSON")?;
    let strings = |v: &Value| -> BTreeSet<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(String::from))
            .collect()
    };
    let mut mismatches = 0;
    let mut first_mismatch = None;
    let mut seen = 0;
    for s in v["services"].as_array().into_iter().flatten() {
        let name = s["name"].as_str().unwrap_or_default();
        let endpoints: BTreeSet<String> = s["backends"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|b| b["ready"].as_bool() == Some(true))
            .filter_map(|b| b["address"].as_str().map(String::from))
            .collect();
        let kernel = strings(&s["kernel_backends"]);
        let ok = desired
            .get(name)
            .is_some_and(|want| *want == endpoints && *want == kernel);
        seen += usize::from(desired.contains_key(name));
        if !ok {
            mismatches += 1;
            first_mismatch.get_or_insert_with(|| {
                format!(
                    "{name}: desired {:?}, endpoints {endpoints:?}, kernel {kernel:?}",
                    desired.get(name)
                )
            });
        }
    }
    if seen < desired.len() {
        mismatches += desired.len() - seen;
        first_mismatch.get_or_insert_with(|| format!("{} services missing", desired.len() - seen));
    }
    let maps = v["maps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| Some((m["map"].as_str()?.to_string(), m["entries"].as_f64()?)))
        .collect();
    Ok(Inspected {
        mismatches,
        first_mismatch,
        maps,
        at,
    })
}

/// The nat table's chains and rules (iptables modes).
fn nat_counts(node: &Netns, backend: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut save = node.command(format!("iptables-{backend}-save"));
    save.args(["-t", "nat"]);
    let text = kproxy_tests::netns::run_checked(&mut save)?;
    let count = |p: &str| text.lines().filter(|l| l.starts_with(p)).count() as f64;
    Ok(BTreeMap::from([
        ("nat-chains".to_string(), count(":")),
        ("nat-rules".to_string(), count("-A ")),
    ]))
}

/// Start, peak and end of each tracked quantity.
#[derive(Default)]
struct Tracks {
    /// name → (unit, start, peak, end).
    values: BTreeMap<String, (&'static str, f64, f64, f64)>,
}

impl Tracks {
    fn start(&mut self, name: &str, unit: &'static str, v: f64) {
        self.values.insert(name.to_string(), (unit, v, v, v));
    }
    fn see(&mut self, name: &str, v: f64) {
        if let Some(t) = self.values.get_mut(name) {
            t.2 = t.2.max(v);
        }
    }
    fn end(&mut self, name: &str, v: f64) {
        if let Some(t) = self.values.get_mut(name) {
            t.2 = t.2.max(v);
            t.3 = v;
        }
    }
}

/// RSS (MB) and open fds of process `pid`.
fn proc_rss_fds(pid: u32) -> anyhow::Result<(f64, f64)> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    Ok((super::agent::status_mb(pid, "VmRSS")?, fds as f64))
}

/// What the prober counted.
#[derive(Default)]
struct ProbeTally {
    connections: u64,
    failures: u64,
    first_failure: Option<String>,
}

/// Tolerated growth (end − start) of a tracked quantity (see the module docs).
fn allowed(name: &str, start: f64) -> (f64, String) {
    match name {
        "rss" => {
            let tol = (start * 0.25).max(8.0);
            (start + tol, format!("end ≤ start + {tol:.1} MB"))
        }
        "fds" => (start + 2.0, "end ≤ start + 2".into()),
        m if m.starts_with("map-KP_CT")
            || m.starts_with("map-KP_SOCK_")
            || m == "map-KP_AFFINITY" =>
        {
            (start + 16.0, "end ≤ start + 16 (flows)".into())
        }
        _ => (start, "end ≤ start".into()),
    }
}

fn soak_mode(sp: &SoakPlan, results: &mut Results, mode: &str) -> anyhow::Result<()> {
    let n = sp.services;
    let mut topo = TopologySpec::new(&format!("bench-soak-{mode}"))
        .local_pods(4)
        .build()?;
    for p in ["pod-l1", "pod-l2", "pod-l3"] {
        topo.pod_mut(p).serve(&[])?;
    }
    let pods = [
        topo.pod("pod-l1").ip,
        topo.pod("pod-l2").ip,
        topo.pod("pod-l3").ip,
    ];
    let mut model = Model::new(n, pods);
    let server = NetnsApi::start(&topo.node)?;
    let api = &server.api;
    model.create_all(api)?;
    let scratch = ScratchDir::new("bench-soak")?;
    let kubeconfig = scratch.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let ebpf = mode == "ebpf";
    let cgroup = ebpf.then(|| TestCgroup::new("bench-soak")).transpose()?;
    let bpffs = ebpf.then(|| Bpffs::new("bench-soak")).transpose()?;
    let spec = AgentSpec {
        mode,
        node: &topo.node,
        source: Source::Kubeconfig(kubeconfig.clone()),
        cgroup: cgroup.as_ref(),
        bpffs: bpffs.as_ref(),
        log: scratch.path().join("agent.log"),
    };
    let mut args = spec.args();
    if ebpf {
        let cfg = scratch.path().join("soak.yaml");
        std::fs::write(&cfg, EBPF_CONFIG)?;
        args.push(format!("--config={}", cfg.display()));
    }
    let mut agent = spec.start_with(args)?;
    let node = &topo.node;
    let look = |desired: &Desired| inspect(node, mode, &kubeconfig, bpffs.as_ref(), desired);
    let fill = |i: &Inspected| -> anyhow::Result<BTreeMap<String, f64>> {
        match iptables_backend(mode) {
            Some(b) => nat_counts(node, b),
            None => Ok(i
                .maps
                .iter()
                .map(|(m, v)| (format!("map-{m}"), *v))
                .collect()),
        }
    };

    // Between inspect runs: an iptables-save of a 30k-rule table costs the machine (and the
    // agent) seconds of CPU, so iptables modes are polled less often.
    let pause = if ebpf {
        Duration::from_millis(50)
    } else {
        Duration::from_secs(1)
    };

    // 1. Cold start, then the start sample.
    let started = Instant::now();
    let cold = wait_converged(
        &mut agent,
        &look,
        &model.desired(),
        Duration::from_secs(300),
        pause,
    )
    .context("cold start")?;
    eprintln!(
        "kp-bench: soak/{mode}/{n}: cold start converged in {:.1} s",
        cold.at.duration_since(started).as_secs_f64()
    );
    let mut tracks = Tracks::default();
    tracks.start("rss", "MB", agent.rss_mb()?);
    tracks.start("fds", "fds", agent.fds()? as f64);
    for (k, v) in fill(&cold)? {
        tracks.start(&k, "entries", v);
    }
    let tracks = Mutex::new(tracks);
    let pid = agent.pid();

    // 2. Churn with traffic.
    let stop = AtomicBool::new(false);
    let sampling = AtomicBool::new(true);
    let tally = Mutex::new(ProbeTally::default());
    let client_pod = &topo.pod("pod-l0").ns;
    let outside = &topo.client;
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let prober = scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                for i in 0..SAMPLED {
                    let inside =
                        Probe::tcp(format!("{}:{SERVICE_PORT}", ServiceSet::cluster_ip(i)), 5)
                            .timeout(Duration::from_secs(2));
                    let from_outside =
                        Probe::tcp(format!("{NODE_IP}:{}", NODE_PORT_BASE + i as u16), 5)
                            .timeout(Duration::from_secs(2));
                    for (probe, ns, cg) in [
                        (inside, client_pod, cgroup.as_ref()),
                        (from_outside, outside, None),
                    ] {
                        let mut t = tally.lock().expect("poisoned");
                        match probe.run(ns, cg) {
                            Ok(r) => {
                                t.connections += r.total_answers() + r.total_errors();
                                t.failures += r.total_errors();
                                if r.total_errors() > 0 && t.first_failure.is_none() {
                                    t.first_failure =
                                        Some(format!("{}: {:?}", probe.addr, r.first_error));
                                }
                            }
                            Err(e) => {
                                t.failures += 1;
                                t.first_failure.get_or_insert_with(|| format!("{e:#}"));
                            }
                        }
                    }
                }
            }
        });
        // RSS and fds every second, the fill every 10 s, off the writer's thread (an inspect
        // or iptables-save of a busy table takes seconds).
        let sampler = scope.spawn(|| -> anyhow::Result<()> {
            let mut next_fill = Instant::now();
            while sampling.load(Ordering::Relaxed) {
                let (rss, fds) = proc_rss_fds(pid)?;
                let fill_now = (Instant::now() >= next_fill)
                    .then(|| {
                        next_fill = Instant::now() + Duration::from_secs(10);
                        // Only the fill is used: the churn never lets the state settle.
                        look(&Desired::new()).and_then(|i| fill(&i))
                    })
                    .transpose()?;
                let mut t = tracks.lock().expect("poisoned");
                t.see("rss", rss);
                t.see("fds", fds);
                for (k, v) in fill_now.into_iter().flatten() {
                    t.see(&k, v);
                }
                drop(t);
                std::thread::sleep(Duration::from_secs(1));
            }
            Ok(())
        });
        let result = (|| -> anyhow::Result<Instant> {
            let begin = Instant::now();
            let (mut writes, mut next_check) = (0u64, begin);
            while begin.elapsed() < sp.churn {
                let due = begin + Duration::from_secs_f64(writes as f64 / WRITES_PER_SECOND);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                model.step(api)?;
                writes += 1;
                if Instant::now() >= next_check {
                    agent.check_alive().map_err(anyhow::Error::msg)?;
                    next_check = Instant::now() + Duration::from_secs(1);
                }
            }
            sampling.store(false, Ordering::Relaxed);
            sampler
                .join()
                .expect("sampler panicked")
                .context("sampling")?;
            // 3. The last change.
            model.restore(api)?;
            eprintln!(
                "kp-bench: soak/{mode}/{n}: {writes} API writes in {:.0} s",
                begin.elapsed().as_secs_f64()
            );
            Ok(Instant::now())
        })();
        sampling.store(false, Ordering::Relaxed);
        // Traffic goes on until convergence was measured below; stop it on failure here.
        if result.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        let last_write = result?;
        let converged =
            wait_converged(&mut agent, &look, &model.desired(), CONVERGE_TIMEOUT, pause);
        stop.store(true, Ordering::Relaxed);
        prober.join().expect("prober panicked");
        let seconds = match &converged {
            Ok(i) => i.at.duration_since(last_write).as_secs_f64(),
            Err(e) => {
                eprintln!("kp-bench: soak/{mode}/{n}: did not converge: {e:#}");
                CONVERGE_TIMEOUT.as_secs_f64()
            }
        };
        results.push(Figure {
            id: format!("soak/converge/{mode}/{n}"),
            group: "soak".into(),
            mode: mode.into(),
            services: n,
            unit: "s".into(),
            samples: vec![seconds],
            baseline: None,
            target: Some(Target {
                max_ratio: None,
                max_value: Some(5.0),
                text: "kernel = desired ≤ 5 s after the last change".into(),
            }),
        });
        if let Ok(i) = &converged {
            let mut t = tracks.lock().expect("poisoned");
            for (k, v) in fill(i)? {
                t.see(&k, v);
            }
        }
        Ok(())
    })?;

    // 4. Settle, then the end sample.
    std::thread::sleep(if ebpf { EBPF_SETTLE } else { IPTABLES_SETTLE });
    agent.check_alive().map_err(anyhow::Error::msg)?;
    let last = look(&model.desired())?;
    if last.mismatches > 0 {
        eprintln!(
            "kp-bench: soak/{mode}/{n}: after settling, {} services differ from the desired \
             state (first: {})",
            last.mismatches,
            last.first_mismatch.as_deref().unwrap_or_default()
        );
    }
    results.push(Figure {
        id: format!("soak/stale-services/{mode}/{n}"),
        group: "soak".into(),
        mode: mode.into(),
        services: n,
        unit: "services".into(),
        samples: vec![last.mismatches as f64],
        baseline: None,
        target: Some(Target {
            max_ratio: None,
            max_value: Some(0.0),
            text: "none differs from the desired state at the end".into(),
        }),
    });
    let mut tracks = tracks.into_inner().expect("poisoned");
    tracks.end("rss", agent.rss_mb()?);
    tracks.end("fds", agent.fds()? as f64);
    for (k, v) in fill(&last)? {
        tracks.end(&k, v);
    }
    if let Ok(dst) = std::env::var("KP_BENCH_KEEP_LOG") {
        let to = format!("{dst}-soak-{mode}-{n}.log");
        if let Err(e) = std::fs::copy(scratch.path().join("agent.log"), &to) {
            eprintln!("kp-bench: KP_BENCH_KEEP_LOG: copying the agent log to {to}: {e}");
        }
    }
    let t = tally.into_inner().expect("poisoned");
    eprintln!(
        "kp-bench: soak/{mode}/{n}: {} probe connections, {} failed{}",
        t.connections,
        t.failures,
        t.first_failure
            .map(|f| format!(" (first: {f})"))
            .unwrap_or_default()
    );
    results.push(Figure {
        id: format!("soak/probe-failures/{mode}/{n}"),
        group: "soak".into(),
        mode: mode.into(),
        services: n,
        unit: "%".into(),
        samples: vec![100.0 * t.failures as f64 / (t.connections.max(1)) as f64],
        baseline: None,
        target: Some(Target {
            max_ratio: None,
            max_value: Some(0.1),
            text: "≤ 0.1 % of the probes' connections fail".into(),
        }),
    });
    for (name, (unit, start, peak, end)) in &tracks.values {
        let (max, text) = allowed(name, *start);
        results.push(Figure {
            id: format!("soak/{name}/{mode}/{n}"),
            group: "soak".into(),
            mode: mode.into(),
            services: n,
            unit: (*unit).into(),
            samples: vec![*start, *peak, *end],
            baseline: None,
            target: Some(Target {
                max_ratio: None,
                max_value: Some(max),
                text,
            }),
        });
    }
    Ok(())
}

/// Runs inspect back to back until the kernel equals `desired`; fails with the agent's log
/// when it exits, or with the last difference at `timeout`.
fn wait_converged(
    agent: &mut RunningAgent,
    look: &dyn Fn(&Desired) -> anyhow::Result<Inspected>,
    desired: &Desired,
    timeout: Duration,
    pause: Duration,
) -> anyhow::Result<Inspected> {
    let deadline = Instant::now() + timeout;
    loop {
        agent.check_alive().map_err(anyhow::Error::msg)?;
        // Before the agent's first sync inspect may find no datapath yet: retry.
        match look(desired) {
            Ok(i) if i.mismatches == 0 => return Ok(i),
            Ok(i) if Instant::now() >= deadline => anyhow::bail!(
                "{} services still differ after {timeout:?}: {}",
                i.mismatches,
                i.first_mismatch.unwrap_or_default()
            ),
            Err(e) if Instant::now() >= deadline => return Err(e),
            _ => std::thread::sleep(pause),
        }
    }
}

/// The soak's own table: start, peak and end side by side.
pub fn markdown(results: &Results) -> String {
    use std::fmt::Write as _;
    let figs: Vec<&Figure> = results
        .figures
        .iter()
        .filter(|f| f.group == "soak")
        .collect();
    let missing: Vec<_> = results
        .unavailable
        .iter()
        .filter(|u| u.id.starts_with("soak/"))
        .collect();
    if figs.is_empty() && missing.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "## Soak: endpoint churn with traffic, start / peak / end\n\n\
         Services × 3 endpoints through the fake API server, 20 API writes/s of endpoint \
         churn, service deletes and re-creates for minutes, with traffic to 6 of them \
         throughout (see `bench/src/soak.rs`). `converge`: last API write → the kernel equals \
         the desired state for every service (read by `kproxy inspect`).\n\n\
         | figure | start | peak | end | unit | target | met |\n|---|---|---|---|---|---|---|\n",
    );
    for f in figs {
        let met = match super::report::meets_target(results, f) {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "—",
        };
        let t = f.target.as_ref().map_or("—".into(), |t| t.text.clone());
        let cells = match f.samples.as_slice() {
            [s, p, e] => format!("{s:.1} | {p:.1} | {e:.1}"),
            [v] => format!("— | — | {v:.2}"),
            other => format!("{other:?} | | "),
        };
        let _ = writeln!(md, "| `{}` | {cells} | {} | {t} | {met} |", f.id, f.unit);
    }
    md.push('\n');
    for u in missing {
        let _ = writeln!(md, "- `{}` not measured: {}", u.id, u.reason);
    }
    md.push('\n');
    md
}
