//! `kproxy inspect` in iptables mode agrees with iptables-save below and above upstream's
//! large-cluster threshold (> 1000 endpoints: the endpoint chains' rules lose their
//! comments): the real agent programs N services from manifests in a network namespace, and
//! every service's `kernel_backends` must be its ready endpoints, each DNATed by a
//! `KUBE-SEP-` chain of the service's `KUBE-SVC-` chain. `--service ns/name` reports one
//! service's ports; a malformed or unknown one is an error naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use kproxy_tests::agentns::{kproxy_output, nat_rules};
use kproxy_tests::agentproc::{AgentProcess, ScratchDir, strip_ansi};
use kproxy_tests::netns::{Netns, require_root};

const NODE: &str = "kpt-node";
const ENDPOINTS_PER_SERVICE: usize = 4;

/// `svc-i` → its endpoints (`ip:8080`).
fn expected(services: usize) -> BTreeMap<String, BTreeSet<String>> {
    (0..services)
        .map(|i| {
            let eps = (0..ENDPOINTS_PER_SERVICE)
                .map(|e| format!("10.244.{}.{}:8080", i / 50, (i % 50) * 5 + e + 1))
                .collect();
            (format!("scale/svc-{i}:http"), eps)
        })
        .collect()
}

fn manifests(services: usize) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE}}}\n\
         status:\n  addresses: [{{type: InternalIP, address: 192.0.2.10}}]\n"
    );
    let all = expected(services);
    for i in 0..services {
        let eps = &all[&format!("scale/svc-{i}:http")];
        let ip = format!("10.96.{}.{}", i / 200, i % 200 + 10);
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}, namespace: scale}}\n\
             spec:\n  clusterIP: {ip}\n  clusterIPs: [\"{ip}\"]\n  ipFamilies: [IPv4]\n  \
             ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080}}]\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata:\n  name: svc-{i}-1\n  namespace: scale\n  \
             labels: {{kubernetes.io/service-name: svc-{i}}}\naddressType: IPv4\n\
             ports: [{{name: http, protocol: TCP, port: 8080}}]\nendpoints:\n"
        );
        for ep in eps {
            let addr = ep.trim_end_matches(":8080");
            let _ = writeln!(
                y,
                "  - addresses: [\"{addr}\"]\n    conditions: {{ready: true}}\n    nodeName: other"
            );
        }
    }
    y
}

fn inspect(ns: &Netns, common: &[String], extra: &[&str]) -> std::process::Output {
    let mut args = common.to_vec();
    args.extend(["inspect", "--output", "json"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    kproxy_output(ns, &args)
}

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// name → kernel_backends of every service in an inspect report.
fn kernel_backends(v: &serde_json::Value) -> BTreeMap<String, BTreeSet<String>> {
    v["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let b = s["kernel_backends"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_str().unwrap().to_string())
                .collect();
            (s["name"].as_str().unwrap().to_string(), b)
        })
        .collect()
}

fn run(hint: &str, services: usize, large: bool) {
    if !require_root() {
        return;
    }
    let ns = Netns::new(hint).unwrap();
    let scratch = ScratchDir::new(hint).unwrap();
    let path = scratch.0.join("cluster.yaml");
    std::fs::write(&path, manifests(services)).unwrap();
    let common = vec![
        format!("--manifests={}", path.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=iptables".to_string(),
    ];
    let mut agent_args = common.clone();
    agent_args.extend([
        "--metrics-bind-address=127.0.0.1:10249".to_string(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
    ]);
    let mut agent = AgentProcess::start(&ns, &agent_args, scratch.0.join("kproxy.log"));
    let want = expected(services);
    let total_eps = services * ENDPOINTS_PER_SERVICE;
    let nat = agent.wait_for("every endpoint's DNAT rule", || {
        let nat = nat_rules(&ns);
        (nat.lines()
            .filter(|l| l.starts_with("-A KUBE-SEP-") && l.contains("DNAT"))
            .count()
            == total_eps)
            .then_some(nat)
    });
    // Which side of the threshold the rules are on: upstream drops the endpoint rules'
    // comments above 1000 endpoints.
    let dnat_comments = nat
        .lines()
        .filter(|l| l.starts_with("-A KUBE-SEP-") && l.contains("DNAT"))
        .filter(|l| l.contains("--comment"))
        .count();
    if large {
        assert!(total_eps > 1000);
        assert_eq!(dnat_comments, 0, "large-cluster mode: no endpoint comments");
    } else {
        assert_eq!(dnat_comments, total_eps, "endpoint rules carry comments");
    }

    let v = json(&inspect(&ns, &common, &[]));
    assert_eq!(v["mode"], "iptables");
    assert_eq!(kernel_backends(&v), want, "inspect's kernel backends");
    for s in v["services"].as_array().unwrap() {
        let lines: Vec<&str> = s["kernel"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap())
            .collect();
        // The rules themselves, as iptables-save shows them.
        for l in &lines {
            assert!(nat.lines().any(|n| n == *l), "{l} is not in iptables-save");
        }
        assert!(
            lines.iter().any(|l| l.starts_with("-A KUBE-SERVICES ")),
            "{s:#}"
        );
        assert!(lines.iter().any(|l| l.starts_with("-A KUBE-SVC-")), "{s:#}");
    }

    // One service's ports.
    let one = json(&inspect(&ns, &common, &["--service", "scale/svc-7"]));
    let got = kernel_backends(&one);
    assert_eq!(got.len(), 1, "{one:#}");
    assert_eq!(got.get("scale/svc-7:http"), want.get("scale/svc-7:http"));

    for (bad, says) in [("svc-7", "--service"), ("scale/nope", "scale/nope")] {
        let o = inspect(&ns, &common, &["--service", bad]);
        let err = strip_ansi(&String::from_utf8_lossy(&o.stderr));
        assert!(!o.status.success(), "--service {bad} must fail");
        assert!(err.contains(says), "--service {bad}: {err}");
    }
    agent.kill();
}

#[test]
fn inspect_agrees_with_iptables_save_below_the_large_cluster_threshold() {
    run("ii-small", 20, false);
}

#[test]
fn inspect_agrees_with_iptables_save_above_the_large_cluster_threshold() {
    run("ii-large", 260, true);
}
