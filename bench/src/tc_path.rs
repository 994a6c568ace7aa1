//! Per-packet cost of the eBPF TC service path (`kp_tc_in` / `kp_tc_eg`) through
//! `BPF_PROG_TEST_RUN`, with N services programmed by the real eBPF planner + applier
//! ([`ServiceMaps`], socket LB off) on a private bpffs.
//!
//! Services: `bench/sI`, ClusterIP `10.96.0.0 + I`, externalIP `100.64.0.0 + I`, two TCP
//! ports whose single (remote) endpoints are each other's frontends: port `a` (80) → the
//! ClusterIP's port 8081, port `b` (8081) → the externalIP's port 80. So a packet of an
//! established flow to `ext:80`, once DNATed (address and port, both checksums), is a packet of
//! the established flow to `cip:8081`, which translates it back: a test run with `repeat = R`
//! then times R established-flow translations. (The kernel runs every repetition of a test run
//! on the *same* skb, so a program that rewrites the packet sees its own output from the
//! second repetition on; with ordinary backends an established ACK would be a miss from then
//! on and the figure would time the miss path.)
//!
//! 256 flows rotate over the services (flow `j` goes to service `j · 7919 mod N`), each frame
//! run in turn. Cases:
//! - `established`: the ACK of an established flow, `repeat` runs per test run (odd, so every
//!   run's output is checked to be DNATed);
//! - `miss`: a packet to a node port that is no service (never rewritten), `repeat` runs per
//!   test run: the connection-table lookup, then the frontend filter, and a frontend lookup
//!   only where the filter has a false positive for this one destination (likelier the more
//!   frontends there are: ≈ 25 % per scope with the 600k frontends of 100k services);
//! - `new-flow`: the SYN of a flow the table has not seen: only the first run of a test run
//!   is a new flow, so one run per test run;
//! - `reverse-nat`: a backend's reply to the SNAT address (reverse SNAT at ingress), one run
//!   per test run (its output is not a translated packet again).
//!
//! One-run-per-test-run figures include the test-run timer's own cost; each figure names the
//! counter-program figure measured the same way as its baseline ([`baseline`]). Every run's
//! output is checked (DNATed, reverse-translated or untouched), so a figure never times a
//! path it does not name.
//!
//! Reading the figures. Every scale gets its own datapath (bpffs, maps, a fresh connection
//! table filled the same way), so the connection table is the same at every scale; what
//! differs is the size of the service maps. A `new-flow` run is dominated by memory: its two
//! connection-table inserts (the `floor-ct-insert` figure: ≈ 0.9–1.2 µs here, flat) and the
//! two service-map reads of a new flow (its external-scope frontend — the frontend filter
//! spares the cluster-scope read, see `kproxy-ebpf/src/frontend.rs` — and the backend slot,
//! which holds the backend itself: `kproxy_common::service::SlotValue`), which
//! get slower as the maps grow (at 100k services the frontend map is preallocated for 1M
//! entries, tens of MB, so — our reading, not measured: no hardware counters in this VM — each
//! read misses the TLB even when the same 256 services repeat) — the growth of `new-flow` from
//! 1 to 100k services, not the connection table's fill (`reverse-nat`, one connection-table
//! lookup per run, is flat). `floor-new-flow` shows how much of that growth one frontend
//! read alone brings. `established` and `miss` repeat one packet
//! `repeat` times per test run, so all but its first run find their entries cached: they are
//! flat by construction and time the instructions and kernel calls, not memory; `established`
//! is one connection-table lookup (`floor-ct-lookup`) plus the rewrite.
//!
//! Kernel calls are the expensive instructions on this machine (see `kproxy-ebpf/src/tc.rs`),
//! and their cost varies with the host: within one run, rounds of every figure that makes
//! calls move together by up to 1.5× while the counter (no calls) stays put.

use std::net::{IpAddr, Ipv4Addr};

use anyhow::{Context as _, bail};
use aya::Ebpf;
use aya::maps::{HashMap as BpfHashMap, MapData};
use aya::programs::{SchedClassifier, Xdp};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::node_path::PROG_TC_EGRESS;
use kproxy::dataplane::ebpf::node_path::PROG_TC_INGRESS;
use kproxy::dataplane::ebpf::node_path::TcConfig;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::tc::load_object;
use kproxy::dataplane::ebpf::node_path::xdp::XdpPath;
use kproxy::dataplane::ebpf::object::LoadOptions;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::model::{ChangedSet, IpFamily, Snapshot, testing};
use kproxy_common::counter::{
    FLOOR_PROGRAMS, MAP_FLOOR_CT, PROG_FLOOR_CT_INSERT, PROG_FLOOR_CT_LOOKUP, PROG_FLOOR_NEW_FLOW,
};
use kproxy_common::ct::{CtEntry, CtKey, MAP_CT};
use kproxy_common::ct6::MAP_CT6;
use kproxy_tests::bpf::testrun::run;
use kproxy_tests::bpf::testrun::run_xdp;
use nix::net::if_::if_nametoindex;

use kproxy_tests::netns::{Bpffs, Netns};

use super::packet::{Paired, Sample, fine_ns};

/// The cases measured, in report order.
pub const CASES: [&str; 4] = ["new-flow", "established", "miss", "reverse-nat"];

/// Floors measured beside [`CASES`] (`kproxy-ebpf/src/floor.rs`, in the same object, with a
/// connection table of the same types and size), no target of their own:
/// - `floor-ct-lookup`: parse + one connection-table lookup that hits, `repeat` runs per test
///   run — what `established` cannot go below (it adds the rewrite, timestamp and counter);
/// - `floor-ct-insert`: parse + the two inserts of a new flow, one run per test run — the part
///   of `new-flow` no choice of backend can avoid;
/// - `floor-new-flow`: parse + the connection-table lookup that misses + one read of the
///   flow's frontend entry in the real, filled service map + the two inserts, one run per test
///   run — the least any new flow costs (a
///   design whose frontend entry held the backend itself), and so the flattest `new-flow`
///   could be from 1 to 100k services on this machine.
pub const FLOOR_CASES: [&str; 3] = ["floor-ct-lookup", "floor-ct-insert", "floor-new-flow"];

/// The cases of the XDP program (`kp_xdp`) with its NodePort fast path, run inside a network
/// namespace whose routes and neighbour entries let `bpf_fib_lookup` succeed (a test run's
/// FIB lookup uses the caller's netns), every forwarded run checked to return
/// `XDP_REDIRECT` with a translated frame and valid checksums:
/// - `new-flow`: the SYN of a flow the table has not seen (backend choice, CT entries, SNAT
///   port, FIB, rewrite), one run per test run;
/// - `established`: an ACK of a flow XDP started (DNAT + SNAT from CT and the flow's
///   forwarding cache, filled by an unrecorded first ACK), one run per test run (its output
///   is no longer a client packet);
/// - `reverse`: the backend's ACK to the SNAT address (reverse SNAT + reverse DNAT, from the
///   reply direction's cache), one run per test run;
/// - `miss`: not a frontend (passed after the frontend filter, and the frontend lookups its
///   false positives let through), `repeat` runs per test run;
/// - `new-flow-one-frontend`: `new-flow` with every flow to one frontend (service 0's), the
///   workload of the kproxy-vs-Katran harness's `new_1` (every new flow to one VIP); `new-flow`
///   spreads its flows over 256 services, whose frontend and slot reads are colder;
/// - `established-one-flow`: `established` on one flow, again and again, the harness's
///   `est_1`; `established` rotates over 256 flows, so a run's connection-table entry and
///   flow state are not the ones the previous run touched.
///
/// The two reference cases ([`xdp_reference`]) have no target: they reproduce the harness's
/// workloads so that its figures and this bench's can be compared (`super::packet::METHOD`).
pub const XDP_CASES: [&str; 6] = [
    "new-flow",
    "established",
    "reverse",
    "miss",
    "new-flow-one-frontend",
    "established-one-flow",
];

/// Whether XDP case `case` is one of the anchor harness's workloads, kept for comparison
/// (no target of its own).
pub fn xdp_reference(case: &str) -> bool {
    matches!(case, "new-flow-one-frontend" | "established-one-flow")
}

const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const NODE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
/// The SNAT address of test runs (TC test runs see ifindex 1; XDP ones leave through
/// [`XDP_EGRESS`], which holds it).
const NODE_INNER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// The XDP bench namespace's egress device (a veth; its peer is `XDP_EGRESS` + "p") and next
/// hop (a permanent neighbour entry).
const XDP_EGRESS: &str = "kpb0";
const NEXT_HOP: &str = "10.0.0.2";
const XDP_REDIRECT: i32 = 4;
const XDP_PASS: i32 = 2;
const FLOWS: u32 = 256;
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

fn ext_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 0)) + i)
}

fn cluster_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i)
}

/// Whether `case` is measured one run per test run (else `repeat` runs per test run).
pub fn single_run(case: &str) -> bool {
    matches!(
        case,
        "new-flow" | "reverse-nat" | "floor-ct-insert" | "floor-new-flow"
    )
}

/// The counter-program figure measured the way XDP case `case` is.
pub fn xdp_baseline(case: &str) -> &'static str {
    if case == "miss" {
        super::packet::BASELINE
    } else {
        super::packet::BASELINE_SINGLE
    }
}

/// The counter-program figure measured the way `case` is.
pub fn baseline(case: &str) -> &'static str {
    if single_run(case) {
        super::packet::BASELINE_SINGLE
    } else {
        super::packet::BASELINE
    }
}

fn snapshot(services: u32) -> Snapshot {
    let mut snap = testing::snapshot("bench-node").node_addresses([NODE]);
    for i in 0..services {
        // Port a (80) → cip:8081, port b (8081) → ext:80: each port's endpoint is the other
        // port's frontend (module docs).
        for (port_name, port, ep_ip, ep_port) in [
            ("a", 80u16, cluster_ip(i), 8081u16),
            ("b", 8081, ext_ip(i), 80),
        ] {
            let sp = testing::service_port("bench", &format!("s{i}"), port_name)
                .cluster_ip(cluster_ip(i))
                .port(port)
                .external_ip(ext_ip(i))
                .build();
            let ep = testing::endpoint(ep_ip, ep_port).node("node2").build();
            snap = snap.service(sp, vec![ep]);
        }
    }
    snap.build()
}

fn csum(data: &[u8]) -> u16 {
    let mut s: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// An Ethernet + IPv4 + TCP frame (no payload) with valid checksums.
pub fn tcp_frame(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), flags: u8) -> Vec<u8> {
    let mut t = Vec::with_capacity(20);
    t.extend_from_slice(&src.1.to_be_bytes());
    t.extend_from_slice(&dst.1.to_be_bytes());
    t.extend_from_slice(&1000u32.to_be_bytes());
    t.extend_from_slice(&(if flags & ACK != 0 { 1u32 } else { 0 }).to_be_bytes());
    t.extend_from_slice(&[5 << 4, flags, 0xfa, 0xf0, 0, 0, 0, 0]);
    let mut pseudo = Vec::new();
    pseudo.extend_from_slice(&src.0.octets());
    pseudo.extend_from_slice(&dst.0.octets());
    pseudo.extend_from_slice(&[0, 6, 0, 20]);
    pseudo.extend_from_slice(&t);
    let c = csum(&pseudo);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    let mut ip = vec![0x45, 0, 0, 40, 0x12, 0x34, 0x40, 0, 64, 6, 0, 0];
    ip.extend_from_slice(&src.0.octets());
    ip.extend_from_slice(&dst.0.octets());
    let c = csum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut f = vec![0x02, 0, 0, 0, 0, 0xbb, 0x02, 0, 0, 0, 0, 0xaa, 0x08, 0x00];
    f.extend_from_slice(&ip);
    f.extend_from_slice(&t);
    f
}

fn addrs(frame: &[u8]) -> ((Ipv4Addr, u16), (Ipv4Addr, u16)) {
    let ip = &frame[14..];
    let l4 = &ip[usize::from(ip[0] & 0x0f) * 4..];
    (
        (
            Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
            u16::from_be_bytes([l4[0], l4[1]]),
        ),
        (
            Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
            u16::from_be_bytes([l4[2], l4[3]]),
        ),
    )
}

/// The TC path with `services` services programmed.
pub struct TcBench {
    // Drop order: the TC object and the floors' instance, the dataplane (its maps), then the
    // bpffs.
    ebpf: Ebpf,
    floor: Ebpf,
    _tc: TcPath,
    /// Kept: its forwarding-cache generation follows [`TcBench::xdp_ns`] (caching on).
    _xdp: XdpPath,
    _dp: ServiceMaps,
    _bpffs: Bpffs,
    /// Where XDP test runs happen (default route via [`NEXT_HOP`] on [`XDP_EGRESS`]).
    xdp_ns: Netns,
    services: u32,
    next_port: u32,
}

/// A namespace where the XDP fast path's FIB lookups succeed: forwarding on, a veth with
/// [`NODE_INNER`], a default route via [`NEXT_HOP`] with a permanent neighbour entry.
fn xdp_netns(services: u32) -> anyhow::Result<Netns> {
    let ns = Netns::new(&format!("bench-xdp-{services}"))?;
    let peer = format!("{XDP_EGRESS}p");
    ns.ip(&[
        "link", "add", XDP_EGRESS, "type", "veth", "peer", "name", &peer,
    ])?;
    ns.ip(&[
        "addr",
        "add",
        &format!("{NODE_INNER}/24"),
        "dev",
        XDP_EGRESS,
    ])?;
    ns.ip(&["link", "set", XDP_EGRESS, "up"])?;
    ns.ip(&["link", "set", &peer, "up"])?;
    ns.ip(&[
        "neigh",
        "replace",
        NEXT_HOP,
        "lladdr",
        "02:00:00:00:00:02",
        "dev",
        XDP_EGRESS,
        "nud",
        "permanent",
    ])?;
    ns.ip(&[
        "route", "add", "default", "via", NEXT_HOP, "dev", XDP_EGRESS,
    ])?;
    ns.sysctl("net.ipv4.ip_forward", "1")?;
    Ok(ns)
}

/// Whether both checksums of an IPv4 + TCP frame (no options) are valid.
fn checksums_ok(frame: &[u8]) -> bool {
    if frame.len() < 54 || csum(&frame[14..34]) != 0 {
        return false;
    }
    let mut pseudo = Vec::with_capacity(12 + frame.len() - 34);
    pseudo.extend_from_slice(&frame[26..34]);
    pseudo.extend_from_slice(&[0, 6]);
    pseudo.extend_from_slice(&((frame.len() - 34) as u16).to_be_bytes());
    pseudo.extend_from_slice(&frame[34..]);
    csum(&pseudo) == 0
}

impl TcBench {
    pub fn new(services: u32, ct_entries: u32) -> anyhow::Result<TcBench> {
        let bpffs = Bpffs::new(&format!("bench-tc-{services}"))?;
        let n = services.max(1);
        let cfg = ServiceMapsConfig {
            bpffs: bpffs.path().to_path_buf(),
            families: vec![IpFamily::V4],
            socket_lb: false,
            node_addresses: vec![IpAddr::V4(NODE)],
            map_sizes: MapSizes {
                // Per service: 2 ports × (ClusterIP + externalIP in two scopes).
                services: (6 * n + 1024).next_power_of_two(),
                backend_slots: (2 * n + 1024).next_power_of_two(),
                backends: (2 * n + 1024).next_power_of_two(),
                affinity: 1024,
                source_ranges: 1024,
                sock_rev_nat: 1024,
                ct: ct_entries,
                ..MapSizes::default()
            },
            ..ServiceMapsConfig::default()
        };
        let mut dp = ServiceMaps::new(cfg).context("loading the eBPF datapath")?;
        let report = dp
            .sync(&snapshot(services), &ChangedSet::default())
            .map_err(|e| anyhow::anyhow!("programming {services} services: {e}"))?;
        if report.failed_services != 0 {
            bail!("{} of {services} services failed", report.failed_services);
        }
        let pins = bpffs.path().join("kproxy");
        let tc_cfg = TcConfig {
            ct_entries,
            // Every reverse-NAT flow of a sample may go to one backend (one service): a
            // range wide enough that port allocation never nears exhaustion. It stays above
            // the frontend ports (80, 8081) as the default range (61000–65535) stays above
            // NodePorts: a packet to a port in the range is first looked up as a reply to a
            // SNATed flow, which would add a lookup to every `established` run that a node
            // with the default range does not pay (it did until 2026-11-23: 1024..=65535).
            snat_ports: 10_000..=65_535,
            ..TcConfig::default()
        };
        let mut ebpf = load_object(&pins, &tc_cfg)?;
        let tc = TcPath::load(&mut ebpf, tc_cfg)?;
        let mut xdp = XdpPath::load(&mut ebpf)?;
        // The floors run from an instance of their own, whose floor table gets the
        // connection table's size (the object declares it small, see `MAP_FLOOR_CT`).
        let mut floor = kproxy::dataplane::ebpf::object::load_tools(&LoadOptions {
            pin_dir: Some(&pins),
            max_entries: vec![
                (MAP_FLOOR_CT, ct_entries),
                (MAP_CT, ct_entries),
                (MAP_CT6, ct_entries),
            ],
        })
        .context("loading the object for the floor programs")?;
        for name in FLOOR_PROGRAMS {
            let prog: &mut SchedClassifier = floor
                .program_mut(name)
                .with_context(|| format!("no program {name}"))?
                .try_into()?;
            prog.load()?;
        }
        let xdp_ns = xdp_netns(services)?;
        let egress = xdp_ns.run(|| -> anyhow::Result<u32> {
            // Test runs arrive on `lo`; both it and the egress device are fast-path devices.
            XdpPath::set_fast_path(&mut ebpf, "lo", true)?;
            XdpPath::set_fast_path(&mut ebpf, XDP_EGRESS, true)?;
            // The forwarding caches, as on an attached node (test runs need no attach).
            xdp.cache_routes(&ebpf)?;
            Ok(if_nametoindex(XDP_EGRESS)?)
        })??;
        TcPath::set_node_addresses(&mut ebpf, &[(1, NODE_INNER), (egress, NODE_INNER)])?;
        Ok(TcBench {
            ebpf,
            floor,
            _tc: tc,
            _xdp: xdp,
            _dp: dp,
            _bpffs: bpffs,
            xdp_ns,
            services,
            next_port: 1024,
        })
    }

    fn flow_frames(&mut self, flags: u8) -> Vec<Vec<u8>> {
        self.flow_frames_to(flags, None)
    }

    /// [`Self::flow_frames`], all to service `only` when given.
    fn flow_frames_to(&mut self, flags: u8, only: Option<u32>) -> Vec<Vec<u8>> {
        let base = self.next_port;
        self.next_port += FLOWS;
        (0..FLOWS)
            .map(|j| {
                let svc = only.unwrap_or((j.wrapping_mul(7919)) % self.services.max(1));
                let sport = 1024 + (base + j) % 64_000;
                let cip = Ipv4Addr::from(u32::from(CLIENT) + (base + j) / 64_000);
                tcp_frame((cip, sport as u16), (ext_ip(svc), 80), flags)
            })
            .collect()
    }

    /// Removes every entry of connection table `map` of `ebpf` (untimed, after a sample that
    /// created flows): like the anchor harness, which deletes each block's flows, every
    /// new-flow sample starts from the same table fill and SNAT-port occupancy (inserts into
    /// a table that only grows touch a never-used element each, and cost up to twice as much
    /// as inserts that reuse freed ones).
    fn clear(ebpf: &mut Ebpf, map: &'static str) -> anyhow::Result<()> {
        let mut ct: BpfHashMap<&mut MapData, CtKey, CtEntry> =
            BpfHashMap::try_from(ebpf.map_mut(map).with_context(|| format!("no map {map}"))?)?;
        let keys: Vec<CtKey> = ct.keys().collect::<Result<_, _>>()?;
        for k in keys {
            ct.remove(&k)?;
        }
        Ok(())
    }

    /// `prog` run once on each frame, `passes` times over all frames, each run paired with a
    /// counter run (`paired`); `check` sees every run's output frame and says whether the run
    /// did what the case names.
    fn single_runs(
        &mut self,
        paired: &mut Paired<'_>,
        prog: &'static str,
        frames: &[Vec<u8>],
        passes: u32,
        check: impl Fn(&[u8]) -> bool,
    ) -> anyhow::Result<()> {
        for _ in 0..passes.max(1) {
            for f in frames {
                paired.run(f, || {
                    let out = run(&mut self.ebpf, prog, f, 1)?;
                    if !check(&out.frame) {
                        bail!("{prog}: unexpected output for {:?}", addrs(f));
                    }
                    Ok(out.duration)
                })?;
            }
        }
        Ok(())
    }

    /// ns per run of `prog` in repeat mode ([`fine_ns`], `repeat` repetitions) on each frame,
    /// averaged over the frames; `check` sees every test run's output.
    fn repeated(
        &mut self,
        prog: &'static str,
        frames: &[Vec<u8>],
        repeat: u32,
        check: impl Fn(&[u8]) -> bool,
    ) -> anyhow::Result<Sample> {
        let mut total = 0.0;
        for f in frames {
            total += fine_ns(repeat, |n| {
                let out = run(&mut self.ebpf, prog, f, n)?;
                if !check(&out.frame) {
                    bail!("{prog}: unexpected output for {:?}", addrs(f));
                }
                Ok(())
            })?;
        }
        Ok(Sample {
            value: total / frames.len() as f64,
            counter: None,
        })
    }

    /// One sample of the XDP program's `case` ([`XDP_CASES`]): about `runs` program runs,
    /// each one run per frame paired with a run of `counter`, or (`miss`) repeat mode with
    /// `repeat` repetitions ([`super::packet::METHOD`]).
    pub fn xdp_sample(
        &mut self,
        case: &str,
        runs: u32,
        repeat: u32,
        counter: &Xdp,
    ) -> anyhow::Result<Sample> {
        let passes = (runs / FLOWS).max(1);
        // Frames of fresh flows (and, per flow, its service), taken before entering the netns.
        let only = (case == "new-flow-one-frontend").then_some(0);
        let new_flow = case == "new-flow" || only.is_some();
        let warm_up: Vec<Vec<u8>> = if new_flow {
            (0..WARM_UP_PASSES)
                .flat_map(|_| self.flow_frames_to(SYN, only))
                .collect()
        } else {
            vec![]
        };
        let fresh: Vec<Vec<u8>> = match case {
            "new-flow" | "new-flow-one-frontend" => (0..passes.min(4))
                .flat_map(|_| self.flow_frames_to(SYN, only))
                .collect(),
            "established" | "reverse" => self.flow_frames(SYN),
            "established-one-flow" => self.flow_frames(SYN).into_iter().take(1).collect(),
            "miss" => (0..4)
                .map(|j| tcp_frame((CLIENT, 1024 + j as u16), (NODE, 22), SYN))
                .collect(),
            other => bail!("unknown XDP case {other}"),
        };
        let (ns, ebpf) = (&self.xdp_ns, &mut self.ebpf);
        let sample = ns.run(move || -> anyhow::Result<Sample> {
            // The SYN's output: DNATed to the backend (port 8081) and SNATed to NODE_INNER.
            let forwarded = |out: &kproxy_tests::bpf::testrun::TestRunOutcome| {
                out.verdict == XDP_REDIRECT
                    && addrs(&out.frame).1.1 == 8081
                    && addrs(&out.frame).0.0 == NODE_INNER
                    && checksums_ok(&out.frame)
            };
            let mut paired = Paired::new(counter);
            match case {
                "new-flow" | "new-flow-one-frontend" => {
                    // Unrecorded first: the first inserts after other work are slower
                    // (the harness's warm-up).
                    for f in &warm_up {
                        run_xdp(ebpf, f, 1)?;
                    }
                    for f in &fresh {
                        paired.run(f, || {
                            let out = run_xdp(ebpf, f, 1)?;
                            if !forwarded(&out) {
                                bail!("kp_xdp did not forward the new flow {:?}", addrs(f));
                            }
                            Ok(out.duration)
                        })?;
                    }
                }
                "established" | "reverse" | "established-one-flow" => {
                    let forward = case != "reverse";
                    // One flow: each pass runs its frame as often as the others run theirs.
                    let reps = if fresh.len() == 1 { FLOWS } else { 1 };
                    let mut frames = vec![];
                    for f in &fresh {
                        let out = run_xdp(ebpf, f, 1)?;
                        if !forwarded(&out) {
                            bail!("kp_xdp did not forward the SYN {:?}", addrs(f));
                        }
                        let (src, dst) = addrs(f);
                        frames.push(if forward {
                            tcp_frame(src, dst, ACK)
                        } else {
                            // An established flow's reply (the harness's `rev_1`): a
                            // SYN-ACK would take the full path (no forwarding cache).
                            let (snat, backend) = addrs(&out.frame);
                            tcp_frame(backend, snat, ACK)
                        });
                    }
                    // Unrecorded first packets: an established flow's first ACK fills its
                    // forwarding cache, a reply its reply cache.
                    for f in &frames {
                        run_xdp(ebpf, f, 1)?;
                    }
                    for _ in 0..passes * reps {
                        for (f, syn) in frames.iter().zip(&fresh) {
                            paired.run(f, || {
                                let out = run_xdp(ebpf, f, 1)?;
                                let ok = if forward {
                                    forwarded(&out)
                                } else {
                                    // Back to the client, from the frontend.
                                    let (client, frontend) = addrs(syn);
                                    out.verdict == XDP_REDIRECT
                                        && addrs(&out.frame) == (frontend, client)
                                        && checksums_ok(&out.frame)
                                };
                                if !ok {
                                    bail!("kp_xdp did not forward {case} {:?}", addrs(f));
                                }
                                Ok(out.duration)
                            })?;
                        }
                    }
                }
                _ => {
                    // miss: never rewritten, so repeat mode (each XDP test run with
                    // repeat > 1 swaps the program into the dispatcher: a few frames).
                    let mut total = 0.0;
                    for f in &fresh {
                        total += fine_ns(repeat, |n| {
                            let out = run_xdp(ebpf, f, n)?;
                            if out.verdict != XDP_PASS || out.frame != *f {
                                bail!("kp_xdp did not pass {:?} unchanged", addrs(f));
                            }
                            Ok(())
                        })?;
                    }
                    return Ok(Sample {
                        value: total / fresh.len() as f64,
                        counter: None,
                    });
                }
            }
            Ok(paired.sample())
        })?;
        if new_flow {
            Self::clear(&mut self.ebpf, MAP_CT)?;
        }
        sample
    }

    /// One sample of `case` (see the module docs): about `runs` program runs, one run per
    /// frame paired with a run of `counter`, or repeat mode with `runs` repetitions
    /// ([`single_run`], [`super::packet::METHOD`]).
    pub fn sample(&mut self, case: &str, runs: u32, counter: &Xdp) -> anyhow::Result<Sample> {
        let passes = (runs / FLOWS).max(1);
        let dnated = |f: &[u8]| addrs(f).1.1 == 8081;
        let mut paired = Paired::new(counter);
        match case {
            "new-flow" => {
                // Each SYN opens a new flow only once: fresh flows for every pass, at most 8
                // passes per sample (keeps the table far from LRU eviction), after an
                // unrecorded warm-up pass (the harness's).
                for _ in 0..WARM_UP_PASSES {
                    for f in &self.flow_frames(SYN) {
                        run(&mut self.ebpf, PROG_TC_INGRESS, f, 1)?;
                    }
                }
                for _ in 0..passes.min(8) {
                    let frames = self.flow_frames(SYN);
                    self.single_runs(&mut paired, PROG_TC_INGRESS, &frames, 1, dnated)?;
                }
                Self::clear(&mut self.ebpf, MAP_CT)?;
            }
            "established" => {
                let syns = self.flow_frames(SYN);
                let mut acks = vec![];
                for f in syns.iter().take(FINE_FRAMES) {
                    // Two runs: the flow to ext:80, then (its output) the flow to cip:8081.
                    let out = run(&mut self.ebpf, PROG_TC_INGRESS, f, 2)?;
                    if addrs(&out.frame).1 != addrs(f).1 {
                        bail!("a SYN was not DNATed there and back");
                    }
                    let (src, dst) = addrs(f);
                    acks.push(tcp_frame(src, dst, ACK));
                }
                return self.repeated(PROG_TC_INGRESS, &acks, runs, dnated);
            }
            "miss" => {
                let frames: Vec<Vec<u8>> = (0..FINE_FRAMES)
                    .map(|j| tcp_frame((CLIENT, 1024 + j as u16), (NODE, 22), SYN))
                    .collect();
                return self.repeated(PROG_TC_INGRESS, &frames, runs, |f| addrs(f).1 == (NODE, 22));
            }
            "reverse-nat" => {
                let syns = self.flow_frames(SYN);
                let mut replies = vec![];
                for f in &syns {
                    let dnat = run(&mut self.ebpf, PROG_TC_INGRESS, f, 1)?.frame;
                    let snat = run(&mut self.ebpf, PROG_TC_EGRESS, &dnat, 1)?.frame;
                    let (src, dst) = addrs(&snat);
                    if src.0 != NODE_INNER {
                        bail!("egress did not SNAT the flow to a remote backend");
                    }
                    replies.push(tcp_frame(dst, src, SYN | ACK));
                }
                self.single_runs(&mut paired, PROG_TC_INGRESS, &replies, passes, |f| {
                    // Back to a client (all in CLIENT's /24), never to the SNAT address.
                    u32::from(addrs(f).1.0) & 0xffff_ff00 == u32::from(CLIENT) & 0xffff_ff00
                })?;
            }
            "floor-ct-insert" | "floor-new-flow" => {
                let prog = if case == "floor-ct-insert" {
                    PROG_FLOOR_CT_INSERT
                } else {
                    PROG_FLOOR_NEW_FLOW
                };
                for f in &self.flow_frames(SYN) {
                    floor_run(&mut self.floor, prog, f, 1)?;
                }
                for _ in 0..passes.min(8) {
                    let frames = self.flow_frames(SYN);
                    for f in &frames {
                        paired.run(f, || floor_run(&mut self.floor, prog, f, 1))?;
                    }
                }
                Self::clear(&mut self.floor, MAP_FLOOR_CT)?;
            }
            "floor-ct-lookup" => {
                let frames: Vec<Vec<u8>> = self.flow_frames(SYN);
                for f in &frames {
                    floor_run(&mut self.floor, PROG_FLOOR_CT_INSERT, f, 1)?;
                }
                let mut total = 0.0;
                for f in frames.iter().take(FINE_FRAMES) {
                    total += fine_ns(runs, |n| {
                        floor_run(&mut self.floor, PROG_FLOOR_CT_LOOKUP, f, n).map(|_| ())
                    })?;
                }
                return Ok(Sample {
                    value: total / FINE_FRAMES as f64,
                    counter: None,
                });
            }
            other => bail!("unknown TC case {other}"),
        }
        Ok(paired.sample())
    }
}

/// Unrecorded passes of new flows (256 each) before a new-flow sample: the first inserts
/// after other work are slower (the anchor harness warms up with 2,000 flows).
const WARM_UP_PASSES: usize = 8;

/// Frames timed in repeat mode per sample (each costs [`fine_ns`]'s trials).
const FINE_FRAMES: usize = 8;

/// One test run of floor program `prog` on `frame` (`repeat` repetitions), which must return
/// `TC_ACT_OK` (inserted / found); its kernel `duration`.
fn floor_run(
    floor: &mut Ebpf,
    prog: &'static str,
    frame: &[u8],
    repeat: u32,
) -> anyhow::Result<std::time::Duration> {
    let out = run(floor, prog, frame, repeat)?;
    if out.verdict != 0 {
        bail!("{prog}: verdict {} for {:?}", out.verdict, addrs(frame));
    }
    Ok(out.duration)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crafted_tcp_frame_has_valid_checksums() {
        let f = tcp_frame((CLIENT, 1234), (NODE, 80), SYN);
        assert_eq!(f.len(), 14 + 20 + 20);
        assert_eq!(csum(&f[14..34]), 0);
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&f[26..34]);
        pseudo.extend_from_slice(&[0, 6, 0, 20]);
        pseudo.extend_from_slice(&f[34..]);
        assert_eq!(csum(&pseudo), 0);
        assert_eq!(addrs(&f), ((CLIENT, 1234), (NODE, 80)));
    }
}
