//! `kproxy inspect` in nftables mode agrees with the kernel: the real agent programs services
//! from manifests in a network namespace (`--proxy-mode=nftables`), and inspect (mode
//! detected from the `kube-proxy` table) reports, per service port, exactly its endpoints as
//! programmed (their `endpoint-` chains exist), its `service-ips` / `service-nodeports` /
//! `no-endpoint-services` elements and its chains with the rule counts `nft` shows — all
//! read through netlink. `--service ns/name` reports one service's ports.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use kproxy_tests::agentns::kproxy_output;
use kproxy_tests::agentproc::{AgentProcess, ScratchDir, strip_ansi};
use kproxy_tests::netns::{Netns, require_root};

const NODE: &str = "kpt-node";
const SERVICES: usize = 6;
const ENDPOINTS: usize = 3;

fn cluster_ip(i: usize) -> String {
    format!("10.96.0.{}", i + 10)
}

/// `svc-i` → its endpoints; the last service has none.
fn expected() -> BTreeMap<String, BTreeSet<String>> {
    (0..SERVICES)
        .map(|i| {
            let n = if i == SERVICES - 1 { 0 } else { ENDPOINTS };
            let eps = (0..n)
                .map(|e| format!("10.244.{i}.{}:8080", e + 1))
                .collect();
            (format!("nft/svc-{i}:http"), eps)
        })
        .collect()
}

/// Services `svc-0..`; `svc-0` is a NodePort (30080).
fn manifests() -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE}}}\n\
         status:\n  addresses: [{{type: InternalIP, address: 192.0.2.10}}]\n"
    );
    let all = expected();
    for i in 0..SERVICES {
        let ip = cluster_ip(i);
        let (ty, np) = if i == 0 {
            ("NodePort", ", nodePort: 30080")
        } else {
            ("ClusterIP", "")
        };
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}, namespace: nft}}\n\
             spec:\n  type: {ty}\n  clusterIP: {ip}\n  clusterIPs: [\"{ip}\"]\n  ipFamilies: [IPv4]\n  \
             ports: [{{name: http, protocol: TCP, port: 80, targetPort: 8080{np}}}]\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata:\n  name: svc-{i}-1\n  namespace: nft\n  \
             labels: {{kubernetes.io/service-name: svc-{i}}}\naddressType: IPv4\n\
             ports: [{{name: http, protocol: TCP, port: 8080}}]\nendpoints:\n"
        );
        let eps = &all[&format!("nft/svc-{i}:http")];
        if eps.is_empty() {
            y.push_str("  []\n");
        }
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

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// Rules of one chain as `nft -j list chain` shows them.
fn nft_rule_count(ns: &Netns, chain: &str) -> usize {
    let out = ns
        .exec("nft", &["-j", "list", "chain", "ip", "kube-proxy", chain])
        .expect("nft list chain");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o.get("rule").is_some())
        .count()
}

#[test]
fn inspect_agrees_with_the_nftables_table() {
    if !require_root() {
        return;
    }
    let hint = "in-nft";
    let ns = Netns::new(hint).unwrap();
    let scratch = ScratchDir::new(hint).unwrap();
    let path = scratch.0.join("cluster.yaml");
    std::fs::write(&path, manifests()).unwrap();
    let common = vec![
        format!("--manifests={}", path.display()),
        format!("--hostname-override={NODE}"),
    ];
    let mut agent_args = common.clone();
    agent_args.extend([
        "--proxy-mode=nftables".to_string(),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
    ]);
    let mut agent = AgentProcess::start(&ns, &agent_args, scratch.0.join("kproxy.log"));
    let want = expected();
    let total: usize = want.values().map(BTreeSet::len).sum();
    agent.wait_for("every endpoint chain", || {
        let t = ns
            .exec("nft", &["list", "table", "ip", "kube-proxy"])
            .unwrap_or_default();
        (t.matches("chain endpoint-").count() == total).then_some(())
    });

    // No --proxy-mode: detected from the table.
    let v = json(&inspect(&ns, &common, &[]));
    assert_eq!(v["mode"], "nftables");
    let mut seen = 0;
    for s in v["services"].as_array().unwrap() {
        let name = s["name"].as_str().unwrap();
        let i: usize = name["nft/svc-".len()..name.len() - ":http".len()]
            .parse()
            .unwrap();
        let backends: BTreeSet<String> = strings(&s["kernel_backends"]).into_iter().collect();
        assert_eq!(&backends, &want[name], "{name}: programmed endpoints");
        let kernel = strings(&s["kernel"]);
        let ip = cluster_ip(i);
        if want[name].is_empty() {
            let e = format!("ip no-endpoint-services: {ip} . tcp . 80 : goto reject-chain");
            assert!(kernel.contains(&e), "{name}: {kernel:#?}");
            assert!(
                !kernel.iter().any(|l| l.contains("service-ips:")),
                "{kernel:#?}"
            );
        } else {
            let prefix = format!("ip service-ips: {ip} . tcp . 80 : goto service-");
            assert!(
                kernel.iter().any(|l| l.starts_with(&prefix)),
                "{name}: {kernel:#?}"
            );
            assert!(
                kernel.contains(&format!("ip cluster-ips: {ip}")),
                "{kernel:#?}"
            );
            let eps = kernel
                .iter()
                .filter(|l| l.starts_with("ip chain endpoint-"))
                .count();
            assert_eq!(eps, ENDPOINTS, "{name}: {kernel:#?}");
        }
        if i == 0 {
            let np = "ip service-nodeports: tcp . 30080 : goto external-";
            assert!(kernel.iter().any(|l| l.starts_with(np)), "{kernel:#?}");
        }
        // Every chain line: the chain exists with the rules nft shows.
        for l in kernel.iter().filter(|l| l.starts_with("ip chain ")) {
            let rest = &l["ip chain ".len()..];
            let (chain, count) = rest.split_once(" (").unwrap();
            let n: usize = count.trim_end_matches(" rules)").parse().unwrap();
            assert_eq!(n, nft_rule_count(&ns, chain), "{l}");
            assert!(chain.contains(&format!("-nft/svc-{i}/tcp/http")), "{l}");
            seen += 1;
        }
    }
    assert!(seen >= SERVICES * 2, "{seen} chain lines checked");
    assert_eq!(v["services"].as_array().unwrap().len(), SERVICES);

    // One service's ports.
    let one = json(&inspect(&ns, &common, &["--service", "nft/svc-2"]));
    let svcs = one["services"].as_array().unwrap();
    assert_eq!(svcs.len(), 1, "{one:#}");
    assert_eq!(svcs[0]["name"], "nft/svc-2:http");
    let o = inspect(&ns, &common, &["--service", "nft/nope"]);
    assert!(!o.status.success());
    assert!(strip_ansi(&String::from_utf8_lossy(&o.stderr)).contains("nft/nope"));
    agent.kill();
}
