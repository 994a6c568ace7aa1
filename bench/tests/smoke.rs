//! `kp-bench --quick` (what `cargo xtask bench --quick` runs) completes and writes a report
//! whose JSON holds the commit and, per figure, the number of samples the quick plan asks
//! for; every figure it could not measure is listed with a reason. No timing is asserted.
//! kp-bench runs `kproxy` and `kp-probe` of the same profile: `cargo build -p kproxy -p
//! kproxy-tests --bins` first (`cargo xtask test` builds them).

use kproxy_bench::{Plan, Results};
use kproxy_tests::netns::{require_root, run_checked};
use kproxy_tests::topology::target_bin;

#[test]
fn quick_bench_writes_report_json_with_commit_and_expected_samples() {
    if !require_root() {
        return;
    }
    let out = std::env::temp_dir().join(kproxy_tests::netns::unique_name("bench-smoke"));
    let mut cmd = std::process::Command::new(target_bin("kp-bench").unwrap());
    cmd.args(["--quick", "--out"])
        .arg(&out)
        .args(["--commit", "0123abc"]);
    run_checked(&mut cmd).unwrap();

    let json = std::fs::read_to_string(out.join("results.json")).unwrap();
    let results: Results = serde_json::from_str(&json).unwrap();
    assert_eq!(results.commit, "0123abc");
    assert!(results.quick);
    assert!(!results.machine.kernel.is_empty());
    let plan = Plan::new(true);
    // The baselines never depend on a datapath: they are always measured.
    for id in [
        "packet/counter-xdp",
        "connect/direct/1",
        "rps-keepalive/direct/1",
    ] {
        assert!(results.figure(id).is_some(), "no figure {id}: {json}");
    }
    for f in &results.figures {
        assert_eq!(f.samples.len(), plan.expected_samples(f), "{}", f.id);
        assert!(
            f.samples.iter().all(|s| s.is_finite() && *s > 0.0),
            "{}: {:?}",
            f.id,
            f.samples
        );
        if let Some(b) = &f.baseline {
            assert!(
                results.figure(b).is_some(),
                "{} names a missing baseline {b}",
                f.id
            );
        }
    }
    // The datapaths this kernel runs are measured: ebpf, iptables on each backend, nftables.
    let n = plan.cold_services;
    let mut measured = vec![
        "packet/tc-service/new-flow/1".to_string(),
        "packet/tc-service/established/1".to_string(),
        "packet/tc-service/miss/1".to_string(),
        "packet/tc-service/reverse-nat/1".to_string(),
        "packet/tc-service/floor-ct-lookup/1".to_string(),
        "packet/tc-service/floor-ct-insert/1".to_string(),
        "packet/tc-service/floor-new-flow/1".to_string(),
        "packet/xdp-nodeport/new-flow/1".to_string(),
        "packet/xdp-nodeport/new-flow-one-frontend/1".to_string(),
        "packet/xdp-nodeport/established-one-flow/1".to_string(),
        format!("packet/tc-service/established/{}", plan.packet_scales[1]),
    ];
    for mode in ["ebpf", "iptables-nft", "iptables-legacy", "nftables"] {
        for &scale in &plan.connect_scales {
            measured.push(format!("connect/{mode}/{scale}"));
            measured.push(format!("connect-direct/{mode}/{scale}"));
            if mode != "ebpf" {
                measured.push(format!("connect-floor/{mode}/{scale}"));
            }
            measured.push(format!("rps-keepalive/{mode}/{scale}"));
            measured.push(format!("rps-short/{mode}/{scale}"));
        }
        for what in ["cold-start", "change", "rss", "cpu"] {
            measured.push(format!("{what}/{mode}/{n}"));
        }
    }
    for id in &measured {
        let f = results.figure(id);
        assert!(f.is_some(), "{id} not measured: {:?}", results.unavailable);
        assert_eq!(
            f.unwrap().samples.len(),
            plan.expected_samples(f.unwrap()),
            "{id}"
        );
    }
    assert_eq!(
        results
            .figure(&format!("connect/iptables-legacy/{n}"))
            .map(|f| f.samples.len()),
        Some(plan.connects as usize)
    );
    assert_eq!(
        results
            .figure(&format!("change/iptables-nft/{n}"))
            .map(|f| f.samples.len()),
        Some(plan.changes as usize)
    );
    // Every mode × figure is either measured or explained (ipvs needs a kernel with IPVS;
    // without it, `--ipvs-guest` measures it in a QEMU guest).
    for mode in plan.modes.iter().map(String::as_str).chain(["ipvs"]) {
        for id in [
            format!("connect/{mode}/1"),
            format!("cold-start/{mode}/{n}"),
        ] {
            let measured = results.figure(&id).is_some();
            let explained = results
                .unavailable
                .iter()
                .any(|u| u.id == id && !u.reason.is_empty());
            assert!(measured || explained, "{id} neither measured nor explained");
        }
    }
    for group in ["packet", "connect", "control"] {
        assert!(
            results.group_seconds.get(group).is_some_and(|s| *s > 0.0),
            "no wall time for {group}: {:?}",
            results.group_seconds
        );
    }
    let report = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
    assert!(
        report.contains("0123abc")
            && report.contains("packet/counter-xdp")
            && report.contains("| | ebpf | iptables-nft | iptables-legacy"),
        "{report}"
    );
    assert!(out.join("connect-latency.svg").is_file());
    let _ = std::fs::remove_dir_all(&out);
}
