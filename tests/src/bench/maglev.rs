//! Maglev table rebuild time at 1k backends (issue #4 "Speed").
//!
//! | figure | what | baseline |
//! |---|---|---|
//! | `maglev/build/1000` | [`kproxy::dataplane::ebpf::maglev::build`] of one table, M = 16381, 1,000 backends (pure) | — |
//! | `maglev/sync-one-change/maglev/1000` | one eBPF sync after one of a NodePort service's 1,000 backends left or came back: plan, table rebuild, writes into the pinned mmapped array | the same sync in random mode |
//! | `maglev/sync-one-change/random/1000` | the same change with `--bpf-lb-algorithm random` (slots only) | — |
//!
//! The syncs run against real pinned maps in a private bpffs (root), without socket LB or TC
//! attachments.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::{EbpfConfig, EbpfDataplane, LbAlgorithm, MapSizes, maglev};
use kproxy::model::{
    ChangedSet, Endpoint, IpFamily, NodeInfo, Protocol, ServicePort, ServicePortName, ServiceType,
    Snapshot,
};
use kproxy_common::maglev::DEFAULT_TABLE_SIZE;

use super::{Figure, Plan, Results};
use crate::netns::Bpffs;

/// Backends of the measured service.
pub const BACKENDS: u32 = 1_000;
const NODE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

/// Samples per figure of `plan`.
pub fn samples(plan: &Plan) -> usize {
    if plan.quick { 5 } else { 20 }
}

fn backend_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i)
}

/// One NodePort service with backends `0..n`.
fn snapshot(n: u32) -> Snapshot {
    let name = ServicePortName {
        namespace: "bench".into(),
        name: "maglev".into(),
        port: "p".into(),
        protocol: Protocol::Tcp,
    };
    let sp = ServicePort {
        name: name.clone(),
        service_type: ServiceType::NodePort,
        cluster_ips: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1))],
        port: 80,
        protocol: Protocol::Tcp,
        node_port: 30_080,
        external_ips: vec![],
        load_balancer_ingress: vec![],
        load_balancer_source_ranges: vec![],
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: 0,
        session_affinity_timeout: None,
    };
    let eps = (0..n)
        .map(|i| Endpoint {
            ip: IpAddr::V4(backend_ip(i)),
            port: 8080,
            ready: true,
            serving: true,
            terminating: false,
            is_local: false,
            node_name: Some("node2".into()),
            zone: None,
            zone_hints: BTreeSet::new(),
            node_hints: BTreeSet::new(),
        })
        .collect();
    let mut snap = Snapshot {
        generation: 1,
        node: NodeInfo {
            name: "bench-node".into(),
            addresses: vec![IpAddr::V4(NODE)],
            ..NodeInfo::default()
        },
        ..Snapshot::default()
    };
    snap.endpoints.insert(name.clone(), Arc::new(eps));
    snap.services.insert(name, Arc::new(sp));
    snap
}

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// `samples` syncs alternating between `BACKENDS - 1` and `BACKENDS` backends, in ms.
fn sync_samples(algorithm: LbAlgorithm, samples: usize) -> anyhow::Result<Vec<f64>> {
    let bpffs = Bpffs::new("bench-maglev")?;
    let cfg = EbpfConfig {
        bpffs: bpffs.path().to_path_buf(),
        families: vec![IpFamily::V4],
        socket_lb: false,
        node_addresses: vec![IpAddr::V4(NODE)],
        lb_algorithm: algorithm,
        maglev_table_size: DEFAULT_TABLE_SIZE,
        map_sizes: MapSizes {
            maglev: 4,
            ..MapSizes::default()
        },
        ..EbpfConfig::default()
    };
    let mut dp = EbpfDataplane::new(cfg).context("loading the eBPF datapath")?;
    let (full, less) = (snapshot(BACKENDS), snapshot(BACKENDS - 1));
    let sync = |dp: &mut EbpfDataplane, s: &Snapshot| -> anyhow::Result<()> {
        let r = dp
            .sync(s, &ChangedSet::default())
            .map_err(|e| anyhow::anyhow!("sync: {e}"))?;
        if r.failed_services != 0 {
            bail!("the service failed to program");
        }
        Ok(())
    };
    sync(&mut dp, &full)?;
    let mut out = Vec::with_capacity(samples);
    for i in 0..samples {
        let s = if i % 2 == 0 { &less } else { &full };
        let t = Instant::now();
        sync(&mut dp, s)?;
        out.push(ms(t));
    }
    Ok(out)
}

/// Runs the group (see the module docs).
pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    let n = samples(plan);
    let inputs: Vec<_> = (0..BACKENDS)
        .map(|i| ((IpAddr::V4(backend_ip(i)), 8080u16), i + 1))
        .collect();
    let build: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            let table = maglev::build(&inputs, DEFAULT_TABLE_SIZE);
            std::hint::black_box(table);
            ms(t)
        })
        .collect();
    let figure = |id: String, samples: Vec<f64>, baseline: Option<String>| Figure {
        id,
        group: "maglev".into(),
        mode: "ebpf".into(),
        services: 1,
        unit: "ms".into(),
        samples,
        baseline,
        target: None,
    };
    results.push(figure(format!("maglev/build/{BACKENDS}"), build, None));
    let random = format!("maglev/sync-one-change/random/{BACKENDS}");
    let mut have_random = false;
    for (alg, name) in [
        (LbAlgorithm::Random, "random"),
        (LbAlgorithm::Maglev, "maglev"),
    ] {
        let id = format!("maglev/sync-one-change/{name}/{BACKENDS}");
        match sync_samples(alg, n) {
            Ok(s) => {
                let baseline = (alg == LbAlgorithm::Maglev && have_random).then(|| random.clone());
                have_random |= alg == LbAlgorithm::Random;
                results.push(figure(id, s, baseline));
            }
            Err(e) => results.unavailable(id, format!("{e:#}")),
        }
    }
    Ok(())
}
