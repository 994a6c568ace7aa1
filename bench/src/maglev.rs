//! Maglev table rebuild time at 1k backends (issue #4 "Speed").
//!
//! | figure | what | baseline |
//! |---|---|---|
//! | `maglev/build/1000` | [`kproxy::dataplane::ebpf::service_maps::maglev::build`] of one table, M = 16381, 1,000 backends (pure) | — |
//! | `maglev/sync-one-change/maglev/1000` | one eBPF sync after one of a NodePort service's 1,000 backends left or came back: plan, table rebuild, writes into the pinned mmapped array | the same sync in random mode |
//! | `maglev/sync-one-change/random/1000` | the same change with `--bpf-lb-algorithm random` (slots only) | — |
//!
//! The syncs run against real pinned maps in a private bpffs (root), without socket LB or TC
//! attachments.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use anyhow::{Context as _, bail};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::service_maps::LbAlgorithm;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::dataplane::ebpf::service_maps::maglev;
use kproxy::model::{ChangedSet, Snapshot};
use kproxy_common::maglev::DEFAULT_TABLE_SIZE;

use super::{Figure, Plan, Results};
use kproxy_tests::maglev::{BACKEND_PORT, config, node_port_snapshot};
use kproxy_tests::netns::Bpffs;

/// Backends of the measured service.
pub const BACKENDS: u32 = 1_000;

/// Samples per figure of `plan`.
pub fn samples(plan: &Plan) -> usize {
    if plan.quick { 5 } else { 20 }
}

fn backend_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i)
}

/// The NodePort service with backends `0..n`.
fn snapshot(n: u32) -> Snapshot {
    node_port_snapshot((0..n).map(backend_ip))
}

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// `samples` syncs alternating between `BACKENDS - 1` and `BACKENDS` backends, in ms.
fn sync_samples(algorithm: LbAlgorithm, samples: usize) -> anyhow::Result<Vec<f64>> {
    let bpffs = Bpffs::new("bench-maglev")?;
    let cfg = config(bpffs.path(), algorithm, DEFAULT_TABLE_SIZE);
    let mut dp = ServiceMaps::new(cfg).context("loading the eBPF datapath")?;
    let (full, less) = (snapshot(BACKENDS), snapshot(BACKENDS - 1));
    let sync = |dp: &mut ServiceMaps, s: &Snapshot| -> anyhow::Result<()> {
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
        .map(|i| ((IpAddr::V4(backend_ip(i)), BACKEND_PORT), i + 1))
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
