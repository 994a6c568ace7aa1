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

use aya::programs::{SchedClassifier, TestRun as _, TestRunOptions, Xdp};
use kproxy::bpf::{CounterSlot, PacketCounter};

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

/// Measures the counter baseline and every registered datapath path.
pub fn run(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    // The object declares pinned maps: keep them on a private bpffs.
    let counter_fs = crate::netns::Bpffs::new("bench-counter")?;
    let mut counter = PacketCounter::load_with_pins(counter_fs.path())?;
    let name = CounterSlot::Xdp.program();
    let prog: &Xdp = counter
        .ebpf_mut()
        .program(name)
        .ok_or_else(|| anyhow::anyhow!("no program {name}"))?
        .try_into()?;
    // 256 flows (source ports): the same rotation the datapath paths use.
    let packets: Vec<Vec<u8>> = (0..256u16).map(|i| udp_packet(40_000 + i)).collect();
    let samples = (0..plan.packet_samples)
        .map(|_| xdp_ns_per_packet(prog, &packets, plan.packet_repeat))
        .collect::<anyhow::Result<Vec<f64>>>()?;
    results.push(Figure {
        id: BASELINE.into(),
        group: "packet".into(),
        mode: "baseline".into(),
        services: 0,
        unit: "ns".into(),
        samples,
        baseline: None,
        target: None,
    });
    // The same counter as a TC classifier: the floor of any TC program (skb context).
    let name = CounterSlot::TcIngress.program();
    let tc: &SchedClassifier = counter
        .ebpf_mut()
        .program(name)
        .ok_or_else(|| anyhow::anyhow!("no program {name}"))?
        .try_into()?;
    let samples = (0..plan.packet_samples)
        .map(|_| {
            let per = (plan.packet_repeat / packets.len() as u32).max(1);
            let mut total = 0.0;
            for p in &packets {
                let r = tc.test_run(TestRunOptions {
                    data_in: Some(p),
                    repeat: per,
                    ..Default::default()
                })?;
                total += r.duration.as_nanos() as f64;
            }
            Ok(total / packets.len() as f64)
        })
        .collect::<anyhow::Result<Vec<f64>>>()?;
    results.push(Figure {
        id: COUNTER_TC.into(),
        group: "packet".into(),
        mode: "baseline".into(),
        services: 0,
        unit: "ns".into(),
        samples,
        baseline: None,
        target: None,
    });
    let prog: &Xdp = counter
        .ebpf_mut()
        .program(CounterSlot::Xdp.program())
        .ok_or_else(|| anyhow::anyhow!("no XDP counter program"))?
        .try_into()?;
    let runs = single_runs(plan);
    let samples = (0..plan.packet_samples)
        .map(|_| xdp_ns_single(prog, &packets, runs / packets.len() as u32))
        .collect::<anyhow::Result<Vec<f64>>>()?;
    results.push(Figure {
        id: BASELINE_SINGLE.into(),
        group: "packet".into(),
        mode: "baseline".into(),
        services: 0,
        unit: "ns".into(),
        samples,
        baseline: None,
        target: None,
    });
    for &scale in &plan.packet_scales {
        let mut bench = match super::tc_path::TcBench::new(scale, 524_288) {
            Ok(b) => b,
            Err(e) => {
                for case in super::tc_path::CASES {
                    results.unavailable(
                        format!("packet/tc-service/{case}/{scale}"),
                        format!("{e:#}"),
                    );
                }
                for case in super::tc_path::XDP_CASES {
                    results.unavailable(
                        format!("packet/xdp-nodeport/{case}/{scale}"),
                        format!("{e:#}"),
                    );
                }
                continue;
            }
        };
        for case in super::tc_path::CASES {
            let id = format!("packet/tc-service/{case}/{scale}");
            let samples = (0..plan.packet_samples)
                .map(|_| {
                    let n = if super::tc_path::single_run(case) {
                        runs
                    } else {
                        plan.packet_repeat
                    };
                    bench.sample(case, n)
                })
                .collect::<anyhow::Result<Vec<f64>>>();
            match samples {
                Ok(samples) => results.push(Figure {
                    id,
                    group: "packet".into(),
                    mode: "ebpf".into(),
                    services: scale,
                    unit: "ns".into(),
                    samples,
                    baseline: Some(super::tc_path::baseline(case).into()),
                    target: Some(target()),
                }),
                Err(e) => results.unavailable(id, format!("{e:#}")),
            }
        }
        for case in super::tc_path::XDP_CASES {
            let id = format!("packet/xdp-nodeport/{case}/{scale}");
            let samples = (0..plan.packet_samples)
                .map(|_| bench.xdp_sample(case, runs, plan.packet_repeat / 32))
                .collect::<anyhow::Result<Vec<f64>>>();
            match samples {
                Ok(samples) => results.push(Figure {
                    id,
                    group: "packet".into(),
                    mode: "ebpf".into(),
                    services: scale,
                    unit: "ns".into(),
                    samples,
                    baseline: Some(super::tc_path::xdp_baseline(case).into()),
                    target: Some(target()),
                }),
                Err(e) => results.unavailable(id, format!("{e:#}")),
            }
        }
    }
    Ok(())
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
