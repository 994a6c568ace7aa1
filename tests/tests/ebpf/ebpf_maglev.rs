//! Maglev (`--bpf-lb-algorithm maglev`) through the real TC program (`BPF_PROG_TEST_RUN` of
//! `kp_tc_in`): the eBPF datapath programs a NodePort service with N backends (tables in the
//! pinned, mmapped `KP_MAGLEV` array), then a few hundred synthetic flows (SYNs from distinct
//! client address/port pairs) are DNATed. Checks that each flow goes to the backend the
//! userspace table (`kproxy::dataplane::ebpf::service_maps::maglev::build` + `flow_hash`) names, that the
//! same 5-tuple maps to the same backend again once its connection-table entry is gone, and
//! that removing 1 of N backends moves that backend's flows and at most half as many others.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use aya::Ebpf;
use aya::maps::HashMap as BpfHashMap;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::node_path::CtEntry;
use kproxy::dataplane::ebpf::node_path::CtKey;
use kproxy::dataplane::ebpf::node_path::MAP_CT;
use kproxy::dataplane::ebpf::node_path::PROG_TC_INGRESS;
use kproxy::dataplane::ebpf::node_path::TcConfig;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::tc::load_object;
use kproxy::dataplane::ebpf::service_maps::LbAlgorithm;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::dataplane::ebpf::service_maps::maglev;
use kproxy::model::{ChangedSet, Snapshot};
use kproxy_common::maglev::flow_hash;
use kproxy_tests::bpf::testrun::run;
use kproxy_tests::maglev::{BACKEND_PORT as BPORT, NODE, NODE_PORT, node_port_snapshot};
use kproxy_tests::netns::{Bpffs, require_root};
use kproxy_tests::tc::*;

const NODE_INNER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const M: u32 = 16_381;
const FLOWS: u32 = 400;
const SYN: u8 = 0x02;

fn backend_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 1, 0, 10 + i as u8)
}

/// The NodePort service with backends `backend_ip(i)` for `i` in `backends`.
fn snapshot(backends: &[usize]) -> Snapshot {
    node_port_snapshot(backends.iter().map(|i| backend_ip(*i)))
}

fn client(i: u32) -> (Ipv4Addr, u16) {
    (
        Ipv4Addr::new(198, 51, 100 + (i / 200) as u8, (i % 200) as u8 + 1),
        (20_000 + i * 7) as u16,
    )
}

/// The backend address the userspace table names for flow `i` (the plan's backends of the
/// Maglev set, built with `maglev::build`, indexed by the shared flow hash).
fn expected(dp: &ServiceMaps, i: u32) -> Ipv4Addr {
    expected_m(dp, i, M)
}

fn expected_m(dp: &ServiceMaps, i: u32, m: u32) -> Ipv4Addr {
    let plan = dp.last_plan();
    let set = plan
        .services
        .values()
        .flat_map(|sp| sp.sets.iter())
        .find(|s| s.maglev)
        .expect("a Maglev set");
    let inputs: Vec<_> = set
        .backends
        .iter()
        .map(|id| (plan.backend_addr(*id).expect("planned"), *id))
        .collect();
    let table = maglev::build(&inputs, m);
    let (cip, cport) = client(i);
    let h = flow_hash(ip4(cip), ip4(NODE), cport.to_be(), NODE_PORT.to_be(), TCP);
    match plan
        .backend_addr(table[(h % m) as usize])
        .expect("planned")
        .0
    {
        IpAddr::V4(a) => a,
        other => panic!("unexpected backend {other}"),
    }
}

fn clear_ct(ebpf: &mut Ebpf) {
    let mut m: BpfHashMap<_, CtKey, CtEntry> =
        BpfHashMap::try_from(ebpf.map_mut(MAP_CT).unwrap()).unwrap();
    let keys: Vec<CtKey> = m.keys().map(Result::unwrap).collect();
    for k in keys {
        m.remove(&k).unwrap();
    }
}

/// Runs every flow's SYN through `kp_tc_in`: the backend each was DNATed to.
fn run_flows(ebpf: &mut Ebpf) -> Vec<Ipv4Addr> {
    clear_ct(ebpf);
    (0..FLOWS)
        .map(|i| {
            let frame = tcp_frame(client(i), (NODE, NODE_PORT), 1000, 0, SYN, &[], &[]);
            let out = run(ebpf, PROG_TC_INGRESS, &frame, 1).unwrap();
            assert_eq!(out.verdict, -1, "flow {i}: TC_ACT_UNSPEC");
            let p = parse_checked(&out.frame);
            assert_eq!(p.dport, BPORT, "flow {i} DNATed");
            p.dst
        })
        .collect()
}

#[test]
fn tc_picks_the_userspace_table_backend_and_a_removal_moves_only_its_share() {
    if !require_root() {
        return;
    }
    const N: usize = 10;
    let bpffs = Bpffs::new("mglv-tc").unwrap();
    let mut dp = ServiceMaps::new(config(&bpffs, LbAlgorithm::Maglev, M)).unwrap();
    let all: Vec<usize> = (0..N).collect();
    let report = dp.sync(&snapshot(&all), &ChangedSet::default()).unwrap();
    assert_eq!(report.failed_services, 0);
    let (mut ebpf, _tc) = tc_object(&bpffs);

    let before = run_flows(&mut ebpf);
    for (i, got) in before.iter().enumerate() {
        assert_eq!(*got, expected(&dp, i as u32), "flow {i}");
    }
    let used: BTreeMap<Ipv4Addr, usize> = before.iter().fold(BTreeMap::new(), |mut m, a| {
        *m.entry(*a).or_default() += 1;
        m
    });
    assert_eq!(used.len(), N, "every backend gets flows: {used:?}");
    // The same 5-tuples again (connection table emptied): the same backends.
    assert_eq!(
        run_flows(&mut ebpf),
        before,
        "the choice is a function of the 5-tuple"
    );

    // Remove the 4th backend.
    let removed = backend_ip(3);
    let rest: Vec<usize> = all.iter().copied().filter(|i| *i != 3).collect();
    let report = dp.sync(&snapshot(&rest), &ChangedSet::default()).unwrap();
    assert_eq!(report.failed_services, 0);
    let after = run_flows(&mut ebpf);
    for (i, got) in after.iter().enumerate() {
        assert_eq!(*got, expected(&dp, i as u32), "flow {i} after the removal");
    }
    let of_removed = before.iter().filter(|a| **a == removed).count();
    let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
    assert!(after.iter().all(|a| *a != removed));
    println!(
        "maglev through kp_tc_in: N={N}, {FLOWS} flows, {of_removed} on the removed backend, \
         {moved} moved ({:.4}; 1/N = {:.4})",
        moved as f64 / f64::from(FLOWS),
        1.0 / N as f64
    );
    assert!(of_removed > 0);
    assert!(
        moved * 2 <= of_removed * 3,
        "{moved} flows moved, {of_removed} were on the removed backend"
    );
}

fn config(bpffs: &Bpffs, algorithm: LbAlgorithm, m: u32) -> ServiceMapsConfig {
    kproxy_tests::maglev::config(bpffs.path(), algorithm, m)
}

/// The TC programs, loaded as a second object over the pinned maps (as the ebpf mode does).
fn tc_object(bpffs: &Bpffs) -> (Ebpf, TcPath) {
    let tc_cfg = TcConfig {
        ct_entries: 8192,
        ..TcConfig::default()
    };
    let mut ebpf = load_object(&bpffs.path().join("kproxy"), &tc_cfg).unwrap();
    let tc = TcPath::load(&mut ebpf, tc_cfg).unwrap();
    TcPath::set_node_addresses(&mut ebpf, &[(1, NODE_INNER)]).unwrap();
    (ebpf, tc)
}

fn maglev_map_id(bpffs: &Bpffs) -> (u32, u32) {
    let info = aya::maps::MapData::from_pin(
        bpffs
            .path()
            .join("kproxy")
            .join(kproxy_common::maglev::MAP_MAGLEV),
    )
    .unwrap()
    .info()
    .unwrap();
    (info.id(), info.max_entries())
}

/// A restarted agent keeps the pinned tables (same map, same choices); another table size or
/// random mode recreates the Maglev maps at the right size.
#[test]
fn a_restart_keeps_the_tables_and_a_new_size_recreates_them() {
    if !require_root() {
        return;
    }
    let bpffs = Bpffs::new("mglv-restart").unwrap();
    let backends: Vec<usize> = (0..5).collect();
    let snap = snapshot(&backends);

    let mut dp = ServiceMaps::new(config(&bpffs, LbAlgorithm::Maglev, 1021)).unwrap();
    dp.sync(&snap, &ChangedSet::default()).unwrap();
    let (id1, max1) = maglev_map_id(&bpffs);
    assert_eq!(max1, (4 * 1021u32).div_ceil(2));
    let (mut ebpf, tc) = tc_object(&bpffs);
    let before = run_flows(&mut ebpf);
    for (i, got) in before.iter().enumerate() {
        assert_eq!(*got, expected_m(&dp, i as u32, 1021), "flow {i}");
    }
    drop((ebpf, tc, dp));

    // Restart, same configuration: the same pinned array, the same choices.
    let mut dp = ServiceMaps::new(config(&bpffs, LbAlgorithm::Maglev, 1021)).unwrap();
    assert_eq!(maglev_map_id(&bpffs).0, id1, "the pinned tables are reused");
    dp.sync(&snap, &ChangedSet::default()).unwrap();
    let pressure = dp.map_pressure();
    let mg = pressure
        .iter()
        .find(|p| p.map == kproxy_common::maglev::MAP_MAGLEV)
        .unwrap();
    assert_eq!((mg.entries, mg.capacity), (1021, 4 * 1021));
    let (mut ebpf, tc) = tc_object(&bpffs);
    assert_eq!(run_flows(&mut ebpf), before);
    drop((ebpf, tc, dp));

    // Another table size: new maps, tables of the new size.
    let mut dp = ServiceMaps::new(config(&bpffs, LbAlgorithm::Maglev, 251)).unwrap();
    let (id2, max2) = maglev_map_id(&bpffs);
    assert_ne!(id2, id1);
    assert_eq!(max2, (4 * 251u32).div_ceil(2));
    dp.sync(&snap, &ChangedSet::default()).unwrap();
    let (mut ebpf, tc) = tc_object(&bpffs);
    for (i, got) in run_flows(&mut ebpf).iter().enumerate() {
        assert_eq!(*got, expected_m(&dp, i as u32, 251), "flow {i} with M=251");
    }
    drop((ebpf, tc, dp));

    // Random mode: the array shrinks to its compiled single element.
    let mut dp = ServiceMaps::new(config(&bpffs, LbAlgorithm::Random, 251)).unwrap();
    assert_eq!(maglev_map_id(&bpffs).1, 1);
    dp.sync(&snap, &ChangedSet::default()).unwrap();
    assert!(
        dp.last_plan()
            .services
            .values()
            .flat_map(|sp| sp.frontends.values())
            .all(|v| v.flags & kproxy_common::service::SVC_F_MAGLEV == 0)
    );
}
