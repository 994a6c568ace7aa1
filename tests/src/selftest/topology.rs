//! The shared traffic topology ([`crate::topology`]) routes like a CNI without any proxy:
//! the client reaches local and remote pods through the node, pods reach each other, both
//! families, and `kp-probe` reports who answered, the peer it saw, and errors by kind.

use crate::netns::require_root;
use crate::topology::{CLIENT_IP, CLIENT_IP6, Probe, TopologySpec, assert_spread, probe};

#[test]
fn client_and_pods_reach_local_and_remote_pods_directly_over_ipv4_and_ipv6() {
    if !require_root() {
        return;
    }
    let mut topo = TopologySpec::new("topo-direct")
        .local_pods(2)
        .remote_pods(1)
        .ipv6(true)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    for v6 in [false, true] {
        for pod in ["pod-l0", "pod-l1", "pod-r0"] {
            let addr = topo.pod(pod).addr(v6);
            for proto in ["tcp", "udp"] {
                let r = probe(&topo.client, None, proto, &addr, 3).unwrap();
                assert_eq!(
                    r.answers.get(pod),
                    Some(&3),
                    "client -> {addr} {proto}: {r:?}"
                );
                // Routed, not translated: the pod sees the client's own address.
                let client = if v6 {
                    CLIENT_IP6.to_string()
                } else {
                    CLIENT_IP.to_string()
                };
                assert_eq!(r.peer_ips(pod), vec![client], "{proto} {addr}");
            }
        }
        // pod -> pod on the same node and across nodes.
        let from = &topo.pod("pod-l0").ns;
        for pod in ["pod-l1", "pod-r0"] {
            let r = probe(from, None, "tcp", &topo.pod(pod).addr(v6), 2).unwrap();
            assert_eq!(r.answers.get(pod), Some(&2), "pod-l0 -> {pod}: {r:?}");
        }
    }
}

#[test]
fn probe_reports_refused_connections_by_kind_and_spread_checks_shares() {
    if !require_root() {
        return;
    }
    let mut topo = TopologySpec::new("topo-refused")
        .local_pods(1)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    let pod_ip = topo.pod("pod-l0").ip;
    let r = Probe::tcp(format!("{pod_ip}:9"), 2)
        .run(&topo.client, None)
        .unwrap();
    assert_eq!(r.errors.get("ConnectionRefused"), Some(&2), "{r:?}");
    assert_eq!(r.total_answers(), 0);

    let ok = probe(
        &topo.client,
        None,
        "tcp",
        &topo.pod("pod-l0").addr(false),
        4,
    )
    .unwrap();
    assert_spread(&ok, &["pod-l0"]);
    let bad = std::panic::catch_unwind(|| assert_spread(&ok, &["pod-l0", "pod-x"]));
    assert!(
        bad.is_err(),
        "a backend with no answers must fail the spread check"
    );

    // A stopped server stops answering (tests use this to take endpoints away for real).
    topo.pod_mut("pod-l0").stop();
    let gone = probe(
        &topo.client,
        None,
        "tcp",
        &topo.pod("pod-l0").addr(false),
        1,
    )
    .unwrap();
    assert_eq!(gone.errors.get("ConnectionRefused"), Some(&1), "{gone:?}");
}

fn answers(counts: &[(&str, u64)]) -> crate::topology::ProbeResult {
    crate::topology::ProbeResult {
        answers: counts.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
        ..Default::default()
    }
}

#[test]
fn spread_check_accepts_a_fair_small_sample_and_rejects_a_starved_backend() {
    let names = ["a", "b", "c"];
    // 14 of 90 is below half the fair share (15) but 3.6 deviations from the mean: a fair
    // chooser does this about once in 8,000 backends, so it must pass.
    assert_spread(&answers(&[("a", 14), ("b", 38), ("c", 38)]), &names);
    // 4 of 30 is below half the fair share (5): 1.2 % of fair draws.
    assert_spread(&answers(&[("a", 4), ("b", 13), ("c", 13)]), &names);
    for starved in [
        answers(&[("a", 0), ("b", 15), ("c", 15)]),
        answers(&[("a", 5), ("b", 40), ("c", 45)]),
        answers(&[("a", 10), ("b", 10), ("c", 280)]),
    ] {
        let r = std::panic::catch_unwind(|| assert_spread(&starved, &names));
        assert!(r.is_err(), "{starved:?} must fail the spread check");
    }
}
