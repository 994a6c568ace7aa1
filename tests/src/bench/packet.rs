//! Per-packet cost: `BPF_PROG_TEST_RUN` of a program on crafted packets, ns per run (the
//! kernel's own average over `repeat` runs), beside the counter-only XDP program.
//!
//! The eBPF TC service path ([`super::tc_path`]: new flow, established, miss, reverse NAT, 256
//! flows rotating over N services programmed by the real planner + applier) is measured at every
//! scale of the plan. Established and miss are timed over `repeat` runs per test run like the
//! counter ([`BASELINE`]); new flow and reverse NAT can only be timed one run per test run
//! (see [`super::tc_path`]), which adds the test-run timer's own cost, so their baseline is
//! the counter measured that way too ([`BASELINE_SINGLE`]). The XDP program with its NodePort
//! fast path (`kp_xdp`: new flow, established, reverse, miss; see [`super::tc_path::XDP_CASES`])
//! is timed at every scale too, forwarded cases against [`BASELINE_SINGLE`], `miss` against
//! [`BASELINE`].
//!
//! Samples are interleaved ([`run`]): each round takes one sample of every figure, baselines
//! included, visiting the scales in alternating order.

use std::collections::BTreeMap;

use crate::bpf::PacketCounter;
use anyhow::Context as _;
use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions, Xdp};
use kproxy_common::counter::CounterSlot;

use super::{Figure, Plan, Results, Target};

/// The baseline figure's id: the counter program, `repeat` runs per test run.
pub const BASELINE: &str = "packet/counter-xdp";
/// The counter program, one run per test run (the TC figures' method and baseline).
pub const BASELINE_SINGLE: &str = "packet/counter-xdp-single";
/// The same counter as a TC classifier, `repeat` runs per test run: the floor of any program
/// on the TC hook (for reference; not a baseline of a target).
pub const COUNTER_TC: &str = "packet/counter-tc";

/// An Ethernet + IPv4 + UDP packet (64 bytes of payload) from 192.168.77.2:40000 to
/// 192.168.77.1:30080.
pub fn udp_packet(src_port: u16) -> Vec<u8> {
    let payload = [0u8; 64];
    let mut p = Vec::with_capacity(14 + 20 + 8 + payload.len());
    p.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00]);
    let total = (20 + 8 + payload.len()) as u16;
    let mut ip = [
        0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 192, 168, 77, 2, 192, 168, 77, 1,
    ];
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    let csum = ipv4_checksum(&ip);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    p.extend_from_slice(&ip);
    p.extend_from_slice(&src_port.to_be_bytes());
    p.extend_from_slice(&30080u16.to_be_bytes());
    p.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(&payload);
    p
}

fn ipv4_checksum(header: &[u8]) -> u16 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Average ns per run of `prog` over `packets`, one `BPF_PROG_TEST_RUN` per packet with
/// `repeat` runs each, the runs spread evenly over the packets.
pub fn xdp_ns_per_packet(prog: &Xdp, packets: &[Vec<u8>], repeat: u32) -> anyhow::Result<f64> {
    let per_packet = (repeat / packets.len().max(1) as u32).max(1);
    let mut total_ns = 0.0;
    for p in packets {
        let r = prog.test_run(TestRunOptions {
            data_in: Some(p),
            repeat: per_packet,
            ..Default::default()
        })?;
        total_ns += r.duration.as_nanos() as f64;
    }
    Ok(total_ns / packets.len() as f64)
}

/// Average ns per run of `prog` run once per test run on each packet, `passes` times over
/// all packets.
pub fn xdp_ns_single(prog: &Xdp, packets: &[Vec<u8>], passes: u32) -> anyhow::Result<f64> {
    let mut total_ns = 0.0;
    let mut runs = 0u32;
    for _ in 0..passes.max(1) {
        for p in packets {
            let r = prog.test_run(TestRunOptions {
                data_in: Some(p),
                repeat: 1,
                ..Default::default()
            })?;
            total_ns += r.duration.as_nanos() as f64;
            runs += 1;
        }
    }
    Ok(total_ns / f64::from(runs.max(1)))
}

/// Program runs per sample of the single-run figures: a test run per program run costs a
/// syscall, so a sixteenth of the repeat count (still thousands of runs per sample).
pub fn single_runs(plan: &Plan) -> u32 {
    (plan.packet_repeat / 16).max(256)
}

/// Measures the counter baselines and every registered datapath path, interleaved: every
/// scale's datapath is set up first, then each of the `packet_samples` rounds takes one sample
/// of every figure — the baselines, then the scales in alternating order (ascending in even
/// rounds, descending in odd ones). Drift of the shared machine (another process's load, a
/// CPU's frequency) then spreads over all scales and the baselines alike instead of shifting
/// whole figures, so a difference between scales is growth, not the moment it was measured
/// (before, each scale's samples were taken back to back, and one figure could sit in a busy
/// minute: the 1k `established` outlier).
pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    // The object declares pinned maps: keep them on a private bpffs.
    let counter_fs = crate::netns::Bpffs::new("bench-counter")?;
    let mut counter = PacketCounter::load_with_pins(counter_fs.path())?;
    // 256 flows (source ports): the same rotation the datapath paths use.
    let packets: Vec<Vec<u8>> = (0..256u16).map(|i| udp_packet(40_000 + i)).collect();
    let runs = single_runs(plan);
    let scales = scales(plan)?;
    let (tc, xdp) = paths()?;
    let mut benches = Vec::new();
    for &scale in &scales {
        benches.push((
            scale,
            // The connection table's size: the agent's default. (This used to ask for 524,288
            // entries, but the service maps' loader runs first and pins `KP_CT` at the object's
            // default size, which the TC loader then reuses — as in the agent.)
            super::tc_path::TcBench::new(scale, kproxy_common::ct::DEFAULT_CT_ENTRIES)
                .map_err(|e| format!("{e:#}")),
        ));
    }
    // (id, mode, services, baseline, whether the per-packet target applies)
    let mut ids: Vec<(String, &'static str, u32, Option<&'static str>, bool)> = vec![
        (BASELINE.into(), "baseline", 0, None, false),
        (COUNTER_TC.into(), "baseline", 0, None, false),
        (BASELINE_SINGLE.into(), "baseline", 0, None, false),
    ];
    for &scale in &scales {
        if tc {
            for case in super::tc_path::CASES {
                let base = super::tc_path::baseline(case);
                ids.push((tc_id(case, scale), "ebpf", scale, Some(base), true));
            }
            for case in super::tc_path::FLOOR_CASES {
                let base = super::tc_path::baseline(case);
                ids.push((tc_id(case, scale), "ebpf", scale, Some(base), false));
            }
        }
        if xdp {
            for case in super::tc_path::XDP_CASES {
                let base = super::tc_path::xdp_baseline(case);
                ids.push((xdp_id(case, scale), "ebpf", scale, Some(base), true));
            }
        }
    }
    let mut samples: BTreeMap<String, Result<Vec<f64>, String>> = ids
        .iter()
        .map(|(id, ..)| (id.clone(), Ok(Vec::new())))
        .collect();
    let mut record = |id: String, sample: anyhow::Result<f64>| {
        let entry = samples.get_mut(&id).expect("every id is listed");
        if let Ok(v) = entry {
            match sample {
                Ok(s) => v.push(s),
                Err(e) => *entry = Err(format!("{e:#}")),
            }
        }
    };
    for round in 0..plan.packet_samples {
        {
            let prog: &Xdp = program(&mut counter, CounterSlot::Xdp)?;
            record(
                BASELINE.into(),
                xdp_ns_per_packet(prog, &packets, plan.packet_repeat),
            );
            record(
                BASELINE_SINGLE.into(),
                xdp_ns_single(prog, &packets, runs / packets.len() as u32),
            );
        }
        // The same counter as a TC classifier: the floor of any TC program (skb context).
        let prog: &SchedClassifier = program(&mut counter, CounterSlot::TcIngress)?;
        record(
            COUNTER_TC.into(),
            tc_ns_per_packet(prog, &packets, plan.packet_repeat),
        );
        let order: Vec<usize> = if round % 2 == 0 {
            (0..benches.len()).collect()
        } else {
            (0..benches.len()).rev().collect()
        };
        for i in order {
            let (scale, bench) = &mut benches[i];
            let Ok(bench) = bench else { continue };
            if tc {
                for case in super::tc_path::CASES
                    .iter()
                    .chain(&super::tc_path::FLOOR_CASES)
                {
                    let n = if super::tc_path::single_run(case) {
                        runs
                    } else {
                        plan.packet_repeat
                    };
                    record(tc_id(case, *scale), bench.sample(case, n));
                }
            }
            if xdp {
                for case in super::tc_path::XDP_CASES {
                    let sample = bench.xdp_sample(case, runs, plan.packet_repeat / 32);
                    record(xdp_id(case, *scale), sample);
                }
            }
        }
    }
    let setup_errors: BTreeMap<u32, String> = benches
        .into_iter()
        .filter_map(|(scale, b)| b.err().map(|e| (scale, e)))
        .collect();
    for (id, mode, services, baseline, targeted) in ids {
        if let Some(e) = setup_errors.get(&services).filter(|_| mode != "baseline") {
            results.unavailable(id, e);
            continue;
        }
        match samples.remove(&id).expect("every id is listed") {
            Ok(samples) => results.push(Figure {
                id,
                group: "packet".into(),
                mode: mode.into(),
                services,
                unit: "ns".into(),
                samples,
                baseline: baseline.map(String::from),
                target: targeted.then(target),
            }),
            Err(e) => results.unavailable(id, e),
        }
    }
    Ok(())
}

fn tc_id(case: &str, scale: u32) -> String {
    format!("packet/tc-service/{case}/{scale}")
}

fn xdp_id(case: &str, scale: u32) -> String {
    format!("packet/xdp-nodeport/{case}/{scale}")
}

/// A program of the counter object.
fn program<'a, T>(counter: &'a mut PacketCounter, slot: CounterSlot) -> anyhow::Result<&'a T>
where
    &'a T: TryFrom<&'a aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let name = slot.program();
    let prog = counter
        .ebpf_mut()
        .program(name)
        .ok_or_else(|| anyhow::anyhow!("no program {name}"))?;
    Ok(<&T>::try_from(prog)?)
}

/// [`xdp_ns_per_packet`] for a TC classifier.
fn tc_ns_per_packet(
    prog: &SchedClassifier,
    packets: &[Vec<u8>],
    repeat: u32,
) -> anyhow::Result<f64> {
    let per = (repeat / packets.len().max(1) as u32).max(1);
    let mut total = 0.0;
    for p in packets {
        let r = prog.test_run(TestRunOptions {
            data_in: Some(p),
            repeat: per,
            ..Default::default()
        })?;
        total += r.duration.as_nanos() as f64;
    }
    Ok(total / packets.len() as f64)
}

/// The plan's scales, or `KP_BENCH_PACKET_SCALES` (comma-separated service counts; for
/// investigating, see the knobs in [`super`]).
fn scales(plan: &Plan) -> anyhow::Result<Vec<u32>> {
    match std::env::var("KP_BENCH_PACKET_SCALES") {
        Ok(s) => s
            .split(',')
            .map(|x| {
                x.trim()
                    .parse()
                    .with_context(|| format!("KP_BENCH_PACKET_SCALES: {x:?} is not a count"))
            })
            .collect(),
        Err(_) => Ok(plan.packet_scales.clone()),
    }
}

/// Which datapath programs to time: `(tc, xdp)`, both unless `KP_BENCH_PACKET_PATHS` names
/// them (`tc`, `xdp`, comma-separated).
fn paths() -> anyhow::Result<(bool, bool)> {
    let Ok(v) = std::env::var("KP_BENCH_PACKET_PATHS") else {
        return Ok((true, true));
    };
    let (mut tc, mut xdp) = (false, false);
    for p in v.split(',') {
        match p.trim() {
            "tc" => tc = true,
            "xdp" => xdp = true,
            other => anyhow::bail!("KP_BENCH_PACKET_PATHS: unknown path {other:?} (tc, xdp)"),
        }
    }
    Ok((tc, xdp))
}

/// The per-packet target: ≤ 3× the counter program (measured the same way).
pub fn target() -> Target {
    Target {
        max_ratio: Some(3.0),
        max_value: None,
        text: "≤ 3× the counter-only XDP program (measured the same way)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crafted_packet_has_a_valid_ipv4_header_checksum() {
        let p = udp_packet(40_000);
        assert_eq!(p.len(), 14 + 20 + 8 + 64);
        // A correct header sums (with its checksum) to 0xffff, i.e. checksums to 0.
        assert_eq!(ipv4_checksum(&p[14..34]), 0);
        assert_eq!(u16::from_be_bytes([p[34], p[35]]), 40_000);
    }
}
