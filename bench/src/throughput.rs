//! Real packets, real throughput: the external client floods a UDP NodePort with small frames
//! of many flows, toward two backends behind the second node (`pod-r0`, `pod-r1`), and the
//! packets delivered to the backends are counted there (`flood` has the
//! generator, the sink and how CPU is accounted).
//!
//! Modes, each in its own topology (`TopologySpec` with two remote pods) with its own agent,
//! all set up first and then sampled in rounds (one sample of every mode per round), so that
//! load from the rest of the shared machine falls on every mode alike:
//! - `route`: no agent, the frames addressed to the pods themselves: plain routing through the
//!   node, the ceiling (the baseline of the packets/s figures);
//! - `floor`: no agent; the flood starts at the node's link to the second node, addressed as
//!   the node forwards it after SNAT (node link address → pods): what the generator, the
//!   second node and the pods cost, which every other mode pays too. `throughput-node/<mode>`
//!   is the median of a mode's CPU per packet minus the median of `floor`'s (a difference of
//!   medians, never per round: [`Results::push_difference`]): the node's own share, what a
//!   load-balancing node spends (vs iptables-nft, the aim's form);
//! - `ebpf-xdp`: `--proxy-mode=ebpf --bpf-xdp=native` on both node devices, with the XDP
//!   forwarding fast path switched on for them (veths are no fast-path devices by default, see
//!   `kproxy::dataplane::ebpf::node_path::xdp`; here the receiving ends have NAPI rings and
//!   the senders complete checksums, so the bench sets both devices in the agent's
//!   `KP_XDP_FWD_DEVS`, found through the program attached to the node's device). The XDP
//!   counters prove the path: a sample counts only if XDP forwarded ≥ 90 % of what was
//!   delivered;
//! - `ebpf-tc`: `--proxy-mode=ebpf --bpf-xdp=off` (the TC programs alone);
//! - `iptables-nft`, `iptables-legacy`, `nftables`: the agent in that mode (`ipvs` too where
//!   the host kernel has IPVS; this one has not).
//!
//! Every topology gets the same link preparation (`prepare_links`: GRO, i.e. a NAPI ring, on
//! every link end; complete checksums from the client and the second node), so only the
//! node's datapath differs. Before measuring, a `kp-probe` UDP exchange through the NodePort
//! must reach both backends (the path works both ways), then the sinks go in and a warm-up
//! flood creates the flows' state. Figures per mode: delivered packets/s (`throughput/<mode>`,
//! vs `route`) and CPU ns per delivered packet (`throughput-cpu/<mode>`, vs `iptables-nft`;
//! the aim "XDP ≥ 3× iptables packets/s" as CPU: ≤ ⅓ of iptables-nft's CPU per packet).
//!
//! What the figures include besides the node's datapath, alike in every mode: the generator,
//! the second node's forwarding (plain routing) and the pod's receive up to the sink. They
//! bound the ratios: a datapath costing nothing at all would still pay them.
//!
//! Bounds: only the test namespaces' addresses (the node's client-side address, the pods'),
//! [`Plan::throughput_seconds`] per sample and at most [`MAX_PACKETS_PER_SAMPLE`] frames.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use aya::maps::{Array, Map, MapData, PerCpuArray};
use kproxy_common::ct::{MAP_XDP_FWD_DEVS, MAP_XDP_STATS, XdpStat};
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup};
use kproxy_tests::topology::{
    CLIENT_IP, NODE_CLIENT_IF, NODE_IP, NODE_LINK_IP, NODE_PEER_IF, POD_PORT, Probe, Topology,
    TopologySpec,
};
use serde_json::json;

use super::agent::{AgentSpec, RunningAgent, ScratchDir, Source};
use super::flood::{self, Generator, Sent, Sink, SoftirqThreads};
use super::services::NODE_NAME;
use super::{Figure, Plan, Results, Target};

/// The NodePort flooded.
pub const NODE_PORT: u16 = 30_090;
/// First source port of the flows (flow i uses `FIRST_SPORT + i`).
pub const FIRST_SPORT: u16 = 20_000;
/// Upper bound of frames per sample (the time bound normally ends it first).
pub const MAX_PACKETS_PER_SAMPLE: u64 = 50_000_000;
/// Warm-up flood before the first sample of a mode (creates the flows' CT entries).
const WARM_UP: Duration = Duration::from_millis(500);
/// The modes, in report order (`route` is the baseline).
pub const MODES: [&str; 8] = [
    "route",
    "floor",
    "ebpf-xdp",
    "ebpf-tc",
    "iptables-nft",
    "iptables-legacy",
    "nftables",
    "ipvs",
];

/// The agent's benchmark mode of a throughput mode (`None` for `route`).
fn agent_mode(mode: &str) -> Option<&str> {
    match mode {
        "route" | "floor" => None,
        "ebpf-xdp" | "ebpf-tc" => Some("ebpf"),
        m => Some(m),
    }
}

/// The modes this run measures: all but ipvs by default; with `KP_BENCH_MODES` set, those
/// whose agent mode it lists (ipvs only where the host has it, i.e. in `plan.modes`).
fn modes(plan: &Plan) -> Vec<&'static str> {
    let listed = std::env::var("KP_BENCH_MODES").is_ok();
    MODES
        .into_iter()
        .filter(|m| match agent_mode(m) {
            None => true,
            Some("ipvs") => plan.modes.iter().any(|x| x == "ipvs"),
            Some(a) if listed => plan.modes.iter().any(|x| x == a),
            Some(_) => true,
        })
        .collect()
}

/// The cluster state: the node, one NodePort service (UDP 80, nodePort [`NODE_PORT`]) whose
/// endpoints are `backends` on the second node.
fn manifests(backends: &[Ipv4Addr]) -> String {
    let node = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME}},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP.to_string()}]}
    });
    let service = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "thru", "namespace": "bench"},
        "spec": {"type": "NodePort", "clusterIP": "10.96.0.50", "clusterIPs": ["10.96.0.50"],
                 "ipFamilies": ["IPv4"], "externalTrafficPolicy": "Cluster",
                 "ports": [{"name": "udp", "protocol": "UDP", "port": 80,
                            "targetPort": POD_PORT, "nodePort": NODE_PORT}]}
    });
    let endpoints: Vec<serde_json::Value> = backends
        .iter()
        .map(|ip| {
            json!({"addresses": [ip.to_string()], "conditions": {"ready": true},
                   "nodeName": "bench-node2"})
        })
        .collect();
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "thru-1", "namespace": "bench",
                     "labels": {"kubernetes.io/service-name": "thru"}},
        "addressType": "IPv4",
        "ports": [{"name": "udp", "protocol": "UDP", "port": POD_PORT}],
        "endpoints": endpoints
    });
    format!("{node}\n---\n{service}\n---\n{slice}\n")
}

/// One mode's topology, agent and counters, ready to flood.
struct Rig {
    mode: &'static str,
    frames: Vec<Vec<u8>>,
    flows: u16,
    xdp_stats: Option<PerCpuArray<MapData, u64>>,
    generator: Generator,
    // Drop order: the agent before its namespaces and pins.
    agent: Option<RunningAgent>,
    topo: Topology,
    _cgroup: Option<TestCgroup>,
    _bpffs: Bpffs,
    _scratch: ScratchDir,
}

impl Rig {
    fn new(plan: &Plan, mode: &'static str) -> anyhow::Result<Rig> {
        let mut topo = TopologySpec::new(&format!("thru-{mode}"))
            .local_pods(0)
            .remote_pods(2)
            .build()?;
        topo.serve_all()?;
        let scratch = ScratchDir::new("bench-thru")?;
        let bpffs = Bpffs::new(&format!("thru-{mode}"))?;
        prepare_links(&topo)?;
        let backends: Vec<Ipv4Addr> = topo.remote_pods().map(|p| p.ip).collect();
        let cgroup = if agent_mode(mode) == Some("ebpf") {
            Some(TestCgroup::new("bench-thru")?)
        } else {
            None
        };
        let agent = match agent_mode(mode) {
            None => None,
            Some(am) => {
                let path = scratch.path().join("services.yaml");
                std::fs::write(&path, manifests(&backends))?;
                let spec = AgentSpec {
                    mode: am,
                    node: &topo.node,
                    source: Source::Manifests(path),
                    cgroup: cgroup.as_ref(),
                    bpffs: (am == "ebpf").then_some(&bpffs),
                    log: scratch.path().join("agent.log"),
                };
                let mut args = spec.args();
                if am == "ebpf" {
                    args.retain(|a| !a.starts_with("--bpf-devices="));
                    args.push(format!("--bpf-devices={NODE_CLIENT_IF},{NODE_PEER_IF}"));
                    let xdp = if mode == "ebpf-xdp" { "native" } else { "off" };
                    args.push(format!("--bpf-xdp={xdp}"));
                }
                Some(spec.start_with(args)?)
            }
        };
        let mut rig = Rig {
            mode,
            frames: Vec::new(),
            flows: plan.throughput_flows,
            xdp_stats: None,
            generator: Generator::from_env()?,
            agent,
            topo,
            _cgroup: cgroup,
            _bpffs: bpffs,
            _scratch: scratch,
        };
        let target = if agent_mode(mode).is_none() {
            None
        } else {
            Some(format!("{NODE_IP}:{NODE_PORT}"))
        };
        rig.wait_both_backends(target.as_deref())?;
        if mode == "ebpf-xdp" {
            rig.xdp_stats = Some(enable_xdp_fast_path(&rig.topo.node)?);
            // Through XDP now (and the node's neighbours are resolved for the FIB lookups).
            rig.wait_both_backends(target.as_deref())?;
        }
        rig.frames = rig.frames(plan)?;
        Ok(rig)
    }

    /// Waits (≤ 120 s) until a UDP exchange through `target` (the NodePort; `None`: each pod
    /// directly) got answers from both backends.
    fn wait_both_backends(&mut self, target: Option<&str>) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let names: Vec<String> = self.topo.remote_pods().map(|p| p.name.clone()).collect();
        let addrs: Vec<String> = match target {
            Some(t) => vec![t.to_string()],
            None => self.topo.remote_pods().map(|p| p.addr(false)).collect(),
        };
        loop {
            if let Some(agent) = &mut self.agent {
                agent.check_alive().map_err(anyhow::Error::msg)?;
            }
            let mut seen = std::collections::BTreeSet::new();
            for addr in &addrs {
                let r = Probe::udp(addr, 20)
                    .timeout(Duration::from_millis(300))
                    .run(&self.topo.client, None)?;
                seen.extend(r.answers.keys().cloned());
            }
            if names.iter().all(|n| seen.contains(n)) {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{}: UDP through {addrs:?} did not reach both backends within 120 s (answers \
                 from {seen:?}){}",
                self.mode,
                self.agent
                    .as_ref()
                    .map(|a| format!("; agent log: {}", a.log_tail()))
                    .unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The flood's frames: `plan.throughput_flows` flows (source ports), to the NodePort, or
    /// for `route` to the pods themselves (flows alternating between them).
    ///
    /// `floor` sends from the node's link to the second node instead, what the node forwards
    /// after SNAT (source the node's link address, destination the pods).
    fn frames(&self, plan: &Plan) -> anyhow::Result<Vec<Vec<u8>>> {
        let (src_ns, src_if, src_ip) = self.sender();
        let src_mac = flood::mac(src_ns, src_if)?;
        let dst_mac = if self.mode == "floor" {
            flood::mac(self.topo.node2.as_ref().context("no second node")?, "eth0")?
        } else {
            flood::mac(&self.topo.node, NODE_CLIENT_IF)?
        };
        let pods: Vec<Ipv4Addr> = self.topo.remote_pods().map(|p| p.ip).collect();
        Ok((0..plan.throughput_flows)
            .map(|i| {
                let dst = if agent_mode(self.mode).is_none() {
                    (pods[i as usize % pods.len()], POD_PORT)
                } else {
                    (NODE_IP, NODE_PORT)
                };
                flood::udp_frame(src_mac, dst_mac, (src_ip, FIRST_SPORT + i), dst)
            })
            .collect())
    }

    /// Where the flood starts: namespace, device, source address.
    fn sender(&self) -> (&Netns, &str, Ipv4Addr) {
        if self.mode == "floor" {
            (&self.topo.node, NODE_PEER_IF, NODE_LINK_IP)
        } else {
            (&self.topo.client, "eth0", CLIENT_IP)
        }
    }

    fn sinks(&self) -> anyhow::Result<Vec<Sink<'_>>> {
        self.topo
            .remote_pods()
            .map(|p| Sink::install(&p.ns, p.ip, POD_PORT))
            .collect()
    }

    fn xdp_forwarded(&self) -> anyhow::Result<u64> {
        let Some(stats) = &self.xdp_stats else {
            return Ok(0);
        };
        let per_cpu = stats.get(&XdpStat::Forward.index(), 0)?;
        Ok(per_cpu.iter().sum())
    }
}

/// Every end of the node's links (the client's `eth0`, the node's two devices, the second
/// node's `eth0`) gets GRO, i.e. a NAPI receive ring, so frames redirected by XDP into the link
/// (the generator's, the fast path's) are received without an XDP program on the receiving
/// end, which builds their skbs as a NIC driver does; the client and the second node send
/// complete checksums (transmit checksum offload off), as XDP needs. The same in every mode.
fn prepare_links(topo: &Topology) -> anyhow::Result<()> {
    let node2 = topo.node2.as_ref().context("no second node")?;
    for ns in [&topo.client, node2] {
        ns.set_tx_checksum(false)?;
        ns.run(|| flood::set_gro("eth0", true))??;
    }
    topo.node.run(|| -> anyhow::Result<()> {
        flood::set_gro(NODE_CLIENT_IF, true)?;
        flood::set_gro(NODE_PEER_IF, true)
    })??;
    Ok(())
}

/// The agent's XDP program on the node's client-side device, by its id (`ip -j link`).
fn xdp_program_id(node: &Netns, dev: &str) -> anyhow::Result<u32> {
    let out = node.ip(&["-j", "-d", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_str(out.trim())?;
    let id = v[0]["xdp"]["prog"]["id"]
        .as_u64()
        .with_context(|| format!("no XDP program on {dev}: {out}"))?;
    Ok(u32::try_from(id)?)
}

/// Switches the XDP forwarding fast path on for both node devices in the agent's
/// `KP_XDP_FWD_DEVS` (what `XdpPath::set_fast_path` does in-process) and returns the agent's
/// XDP counters.
fn enable_xdp_fast_path(node: &Netns) -> anyhow::Result<PerCpuArray<MapData, u64>> {
    let prog = xdp_program_id(node, NODE_CLIENT_IF)?;
    anyhow::ensure!(
        xdp_program_id(node, NODE_PEER_IF)? == prog,
        "the agent's XDP program is not the same on {NODE_CLIENT_IF} and {NODE_PEER_IF}"
    );
    let info = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == prog)
        .with_context(|| format!("XDP program {prog} not found"))?;
    let map_ids = info.map_ids()?.context("no map ids (kernel too old)")?;
    let find = |name: &str| -> anyhow::Result<MapData> {
        let id = map_ids
            .iter()
            .copied()
            .find(|id| {
                aya::maps::MapInfo::from_id(*id).is_ok_and(|m| m.name_as_str() == Some(name))
            })
            .with_context(|| format!("XDP program {prog} uses no map {name}"))?;
        Ok(MapData::from_id(id)?)
    };
    let mut devs: Array<MapData, u32> = Array::try_from(Map::Array(find(MAP_XDP_FWD_DEVS)?))?;
    for dev in [NODE_CLIENT_IF, NODE_PEER_IF] {
        let out = node.ip(&["-j", "link", "show", "dev", dev])?;
        let v: serde_json::Value = serde_json::from_str(out.trim())?;
        let ifindex = v[0]["ifindex"].as_u64().context("no ifindex")?;
        devs.set(u32::try_from(ifindex)?, 1, 0)?;
    }
    Ok(PerCpuArray::try_from(Map::PerCpuArray(find(
        MAP_XDP_STATS,
    )?))?)
}

/// One sample of one rig: delivered packets/s and CPU ns per delivered packet.
struct Sample {
    pps: f64,
    cpu_ns: f64,
    sent: Sent,
    delivered: u64,
    xdp_forwarded: u64,
}

fn sample(
    rig: &Rig,
    sinks: &[Sink<'_>],
    softirq: &SoftirqThreads,
    time: Duration,
) -> anyhow::Result<Sample> {
    let count = || -> anyhow::Result<u64> { sinks.iter().map(|s| s.delivered()).sum() };
    let (d0, x0, k0) = (count()?, rig.xdp_forwarded()?, softirq.cpu());
    // The live generator varies the flows itself: one template per destination.
    let frames = match rig.generator {
        Generator::AfPacket => &rig.frames[..],
        Generator::XdpLive if agent_mode(rig.mode).is_none() => &rig.frames[..2],
        Generator::XdpLive => &rig.frames[..1],
    };
    let (ns, ifname, _) = rig.sender();
    let sent = flood::flood_with(
        rig.generator,
        ns,
        ifname,
        frames,
        (FIRST_SPORT, rig.flows),
        time,
        MAX_PACKETS_PER_SAMPLE,
    )?;
    // What is still queued reaches the sinks within a moment.
    std::thread::sleep(Duration::from_millis(50));
    let delivered = count()? - d0;
    let cpu = sent.thread_cpu + softirq.cpu().saturating_sub(k0);
    anyhow::ensure!(delivered > 0, "{}: nothing delivered ({sent:?})", rig.mode);
    Ok(Sample {
        pps: delivered as f64 / sent.wall.as_secs_f64(),
        cpu_ns: cpu.as_nanos() as f64 / delivered as f64,
        sent,
        delivered,
        xdp_forwarded: rig.xdp_forwarded()? - x0,
    })
}

pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    let softirq = SoftirqThreads::find()?;
    let mut rigs = Vec::new();
    for mode in modes(plan) {
        match Rig::new(plan, mode) {
            Ok(rig) => rigs.push(rig),
            Err(e) => results.unavailable(format!("throughput/{mode}"), format!("{e:#}")),
        }
    }
    let sinks: Vec<Vec<Sink<'_>>> = rigs.iter().map(Rig::sinks).collect::<Result<_, _>>()?;
    for (rig, sinks) in rigs.iter().zip(&sinks) {
        sample(rig, sinks, &softirq, WARM_UP).with_context(|| format!("{}: warm-up", rig.mode))?;
    }
    let mut pps = vec![Vec::new(); rigs.len()];
    let mut cpu = vec![Vec::new(); rigs.len()];
    let mut failed = vec![None; rigs.len()];
    let time = Duration::from_secs_f64(plan.throughput_seconds);
    for round in 0..plan.throughput_samples {
        for (i, (rig, sinks)) in rigs.iter().zip(&sinks).enumerate() {
            if failed[i].is_some() {
                continue;
            }
            let s = match sample(rig, sinks, &softirq, time) {
                Ok(s) => s,
                Err(e) => {
                    failed[i] = Some(format!("{e:#}"));
                    continue;
                }
            };
            eprintln!(
                "kp-bench: throughput/{} round {round}: sent {} ({} send errors), delivered {} \
                 ({:.0} kpps), {:.0} CPU ns/packet{}",
                rig.mode,
                s.sent.packets,
                s.sent.errors,
                s.delivered,
                s.pps / 1e3,
                s.cpu_ns,
                if rig.mode == "ebpf-xdp" {
                    format!(", XDP forwarded {}", s.xdp_forwarded)
                } else {
                    String::new()
                }
            );
            if rig.mode == "ebpf-xdp" && (s.xdp_forwarded as f64) < 0.9 * s.delivered as f64 {
                failed[i] = Some(format!(
                    "the XDP fast path forwarded {} of {} packets delivered (< 90 %): not \
                     the path under measurement",
                    s.xdp_forwarded, s.delivered
                ));
                continue;
            }
            pps[i].push(s.pps / 1e3);
            cpu[i].push(s.cpu_ns);
        }
    }
    let mut measured = Vec::new();
    for (i, rig) in rigs.iter().enumerate() {
        let mode = rig.mode;
        if let Some(why) = &failed[i] {
            results.unavailable(format!("throughput/{mode}"), why);
            continue;
        }
        measured.push(mode);
        results.push(Figure {
            id: format!("throughput/{mode}"),
            group: "throughput".into(),
            mode: mode_label(mode).into(),
            services: 1,
            unit: "kpps".into(),
            samples: std::mem::take(&mut pps[i]),
            baseline: (mode != "route").then(|| "throughput/route".into()),
            target: None,
        });
        results.push(Figure {
            id: format!("throughput-cpu/{mode}"),
            group: "throughput-cpu".into(),
            mode: mode_label(mode).into(),
            services: 1,
            unit: "ns".into(),
            samples: std::mem::take(&mut cpu[i]),
            baseline: (mode != "iptables-nft").then(|| "throughput-cpu/iptables-nft".into()),
            target: (mode == "ebpf-xdp").then(|| Target {
                max_ratio: Some(1.0 / 3.0),
                max_value: None,
                text: "XDP CPU per delivered packet ≤ ⅓ × iptables-nft's (≥ 3× its packets \
                       per CPU second)"
                    .into(),
            }),
        });
    }
    node_shares(results, &measured);
    Ok(())
}

/// The node's share of the CPU per packet of each measured mode but `floor`: the median of
/// its CPU per packet minus the median of `floor`'s (what the generator, the second node and
/// the pods cost is in both), a derived figure ([`Results::push_difference`]).
fn node_shares(results: &mut Results, measured: &[&str]) {
    const FLOOR: &str = "throughput-cpu/floor";
    if !measured.contains(&"floor") {
        return;
    }
    for &mode in measured.iter().filter(|m| **m != "floor") {
        let figure = Figure {
            id: format!("throughput-node/{mode}"),
            group: "throughput-node".into(),
            mode: mode_label(mode).into(),
            services: 1,
            unit: "ns".into(),
            samples: Vec::new(),
            baseline: (mode != "iptables-nft").then(|| "throughput-node/iptables-nft".into()),
            target: (mode == "ebpf-xdp").then(|| Target {
                max_ratio: Some(1.0 / 3.0),
                max_value: None,
                text: "the node's CPU per packet with XDP ≤ ⅓ × with iptables-nft".into(),
            }),
        };
        results.push_difference(figure, &format!("throughput-cpu/{mode}"), FLOOR);
    }
}

/// The figure's `mode` field: `baseline` for `route` and `floor`.
fn mode_label(mode: &str) -> &str {
    if agent_mode(mode).is_none() {
        "baseline"
    } else {
        mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_hold_one_udp_nodeport_service_with_the_backends() {
        let m = manifests(&[Ipv4Addr::new(10, 244, 2, 2), Ipv4Addr::new(10, 244, 2, 3)]);
        let docs: Vec<serde_json::Value> = m
            .split("\n---\n")
            .map(|d| serde_json::from_str(d.trim()).unwrap())
            .collect();
        assert_eq!(docs.len(), 3);
        assert_eq!(docs[1]["spec"]["type"], "NodePort");
        assert_eq!(docs[1]["spec"]["ports"][0]["nodePort"], NODE_PORT);
        assert_eq!(docs[1]["spec"]["ports"][0]["protocol"], "UDP");
        assert_eq!(docs[2]["endpoints"].as_array().unwrap().len(), 2);
    }

    /// The quick bench's failure (issue #29): a round whose `floor` came out high made the
    /// old per-round difference negative. The node's share is the difference of the medians.
    #[test]
    fn node_share_is_the_difference_of_the_medians_never_a_negative_sample() {
        let cpu = |mode: &str, samples: &[f64]| Figure {
            id: format!("throughput-cpu/{mode}"),
            group: "throughput-cpu".into(),
            mode: mode_label(mode).into(),
            services: 1,
            unit: "ns".into(),
            samples: samples.to_vec(),
            baseline: None,
            target: None,
        };
        let floor = [430.0, 700.0, 440.0];
        let xdp = [610.0, 620.0, 630.0];
        let mut r = Results::default();
        r.push(cpu("floor", &floor));
        r.push(cpu("ebpf-xdp", &xdp));
        r.push(cpu("iptables-nft", &[1400.0, 1500.0, 1450.0]));
        // Within the noise: its median is below the floor's.
        r.push(cpu("ebpf-tc", &[435.0, 900.0, 420.0]));
        node_shares(&mut r, &["floor", "ebpf-xdp", "iptables-nft", "ebpf-tc"]);
        let node = |m: &str| {
            r.figure(&format!("throughput-node/{m}"))
                .map(|f| f.samples.clone())
        };
        assert_eq!(node("ebpf-xdp"), Some(vec![180.0]));
        assert_eq!(node("iptables-nft"), Some(vec![1010.0]));
        assert_eq!(node("floor"), None);
        assert_eq!(node("ebpf-tc"), None);
        let why = &r
            .unavailable
            .iter()
            .find(|u| u.id == "throughput-node/ebpf-tc");
        assert!(
            why.is_some_and(|u| u.reason.contains("drowned in noise")),
            "{why:?}"
        );
        let d = r.derivation("throughput-node/ebpf-xdp").unwrap();
        assert_eq!(
            (d.of.as_str(), d.minus.as_str()),
            ("throughput-cpu/ebpf-xdp", "throughput-cpu/floor")
        );
        let xdp_node = r.figure("throughput-node/ebpf-xdp").unwrap();
        let ratio = crate::report::ratio(&r, xdp_node).unwrap();
        assert!((ratio - 180.0 / 1010.0).abs() < 1e-9, "{ratio}");
        // The report shows the value and, as its spread, the per-round differences.
        let md = crate::report::markdown(&r);
        assert!(
            md.contains("| `throughput-node/ebpf-xdp` | — | 180.00 | — | — | ns |")
                && md.contains(
                    "- `throughput-node/ebpf-xdp` = median(`throughput-cpu/ebpf-xdp`) − \
                     median(`throughput-cpu/floor`); per round -80.00 … 190.00 (3 rounds) ns"
                ),
            "{md}"
        );
        // What the smoke test asserts of every figure (the old per-round samples held −80).
        for f in &r.figures {
            assert!(
                f.samples.iter().all(|s| *s > 0.0),
                "{}: {:?}",
                f.id,
                f.samples
            );
        }
    }

    #[test]
    fn ebpf_modes_run_the_ebpf_agent_and_route_none() {
        assert_eq!(agent_mode("route"), None);
        assert_eq!(agent_mode("ebpf-xdp"), Some("ebpf"));
        assert_eq!(agent_mode("ebpf-tc"), Some("ebpf"));
        assert_eq!(agent_mode("nftables"), Some("nftables"));
    }
}
