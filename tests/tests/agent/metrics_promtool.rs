//! `/metrics` checked by the real tool: the `kproxy` binary runs in a node namespace of the
//! shared topology in each mode this host can run (ebpf, iptables; IPVS needs the QEMU guest),
//! programs a Service, and its `/metrics` scrape (as Prometheus' text format, what a client
//! that does not ask for OpenMetrics gets) goes through `promtool check metrics` (Debian's
//! `prometheus` package): no lint problem, with the mode's own metrics in the scrape — apart
//! from the one promtool raises about upstream's own names (two gauges upstream named
//! `…_total`; kproxy keeps upstream's names), accepted only for names upstream's metric list
//! gives as gauges. Every metric the Grafana dashboard queries (apart from the other modes'
//! rows) is in the scrape.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use kproxy_tests::agentproc::{AgentProcess, ScratchDir, http_get};
use kproxy_tests::fixtures;
use kproxy_tests::manifests::{self as yaml, Port};
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup, require_root};
use kproxy_tests::tools::require_tool;
use kproxy_tests::topology::{
    NODE_IP, NODE_POD_CIDR, POD_PORT, Topology, TopologySpec, kproxy_bin,
};

const NODE: &str = "kpt-node";

/// A Node, a ClusterIP + NodePort Service whose EndpointSlice (the topology's local pods)
/// carries a change trigger time, so the network-programming histogram has a sample.
fn manifests(topo: &Topology, dir: &Path) -> String {
    let http = [Port::tcp("http", 80, POD_PORT).node_port(30080)];
    let eps: Vec<_> = topo.local_pods().map(|p| (p.ip, NODE)).collect();
    let now = k8s_openapi::jiff::Timestamp::now();
    let path = yaml::write(
        dir,
        &[
            yaml::node(NODE, NODE_IP, NODE_POD_CIDR),
            yaml::service("web", "10.96.0.10", &http),
            yaml::slice("web", &http, &eps).trigger_time(now).yaml(),
        ],
    );
    format!("--manifests={}", path.display())
}

/// `promtool check metrics` of `text`: (success, what it printed).
fn promtool_check(promtool: &Path, text: &str) -> (bool, String) {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), said)
}

/// Runs the agent with `mode_args` until its Service is programmed and returns its scrape.
fn scrape(hint: &str, mode: &str, mode_args: &[String]) -> String {
    let mut topo = TopologySpec::new(hint)
        .local_pods(2)
        .remote_pods(0)
        .ipv6(false)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    let scratch = ScratchDir::new(hint).unwrap();
    let mut args = vec![
        manifests(&topo, scratch.path()),
        format!("--hostname-override={NODE}"),
        "--metrics-bind-address=127.0.0.1:10249".to_owned(),
    ];
    args.extend_from_slice(mode_args);
    let mut cmd = topo.node.command(kproxy_bin().unwrap());
    cmd.args(&args);
    let mut agent = AgentProcess::spawn(cmd, scratch.path().join("kproxy.log"));
    let node: &Netns = &topo.node;
    agent.wait_for("the Service programmed in /metrics", || {
        let (_, body) = http_get(node, 10249, "/metrics")?;
        body.lines()
            .any(|l| l == "kproxy_programmed_services 1")
            .then_some(())
    });
    let (_, proxy_mode) = http_get(node, 10249, "/proxyMode").unwrap();
    assert_eq!(proxy_mode.trim(), mode, "{}", agent.log());
    let (status, body) = http_get(node, 10249, "/metrics").unwrap();
    assert_eq!(status, 200);
    body
}

/// Upstream's gauges whose names end in `_total` (tests/fixtures/upstream/metrics/
/// metrics.yaml): promtool's "non-counter metrics should not have "_total" suffix" about them
/// is about upstream's names, which kproxy keeps (upstream's own /metrics draws the same).
fn upstream_total_gauges() -> BTreeSet<String> {
    let text = std::fs::read_to_string(fixtures::upstream("metrics/metrics.yaml")).unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    doc["metrics"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|m| m["type"].as_str() == Some("Gauge"))
        .map(|m| m["name"].as_str().unwrap().to_owned())
        .filter(|n| n.ends_with("_total"))
        .collect()
}

fn check_mode(mode: &str, body: &str, own_metric: &str) {
    let promtool = require_tool("promtool", "prometheus").unwrap();
    assert!(
        body.lines().any(|l| l.starts_with(own_metric)),
        "{mode}: the scrape has the mode's own {own_metric}:\n{body}"
    );
    let families = body.lines().filter(|l| l.starts_with("# TYPE ")).count();
    assert!(families >= 15, "{mode}: {families} families in\n{body}");
    let (_, said) = promtool_check(&promtool, body);
    let upstream_names = upstream_total_gauges();
    let problems: Vec<&str> = said
        .lines()
        .filter(|l| {
            let upstream_name = l
                .strip_suffix(" non-counter metrics should not have \"_total\" suffix")
                .is_some_and(|name| upstream_names.contains(name));
            !upstream_name
        })
        .collect();
    assert!(
        problems.is_empty(),
        "{mode}: promtool check metrics found problems:\n{}\nin the scrape:\n{body}",
        problems.join("\n")
    );
    check_dashboard(mode, body);
    eprintln!(
        "{mode}: promtool check metrics clean ({families} families; upstream's names kept: {})",
        said.lines().count()
    );
}

/// Every metric the Grafana dashboard (deploy/grafana/kproxy.json) queries outside the rows
/// of other modes has samples in this mode's real scrape.
fn check_dashboard(mode: &str, body: &str) {
    let scraped: BTreeSet<&str> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let mut checked = 0;
    for (row, panel, names) in crate::deploy_grafana::metrics_by_row() {
        let other_mode = match row.as_str() {
            "eBPF mode" => mode != "ebpf",
            "iptables mode" => mode != "iptables",
            _ => false,
        };
        if other_mode {
            continue;
        }
        for n in &names {
            assert!(
                scraped.contains(n.as_str()),
                "{mode}: dashboard panel {panel:?} (row {row:?}) queries {n}, not in the scrape:\n{body}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 15, "{mode}: {checked} dashboard metrics checked");
}

#[test]
fn promtool_finds_no_problem_in_ebpf_mode() {
    if !require_root() || require_tool("promtool", "prometheus").is_none() {
        return;
    }
    let bpffs = Bpffs::new("mp-ebpf-fs").unwrap();
    let cg = TestCgroup::new("mp-ebpf-cg").unwrap();
    let body = scrape(
        "mp-ebpf",
        "ebpf",
        &[
            "--proxy-mode=ebpf".to_owned(),
            format!("--bpffs={}", bpffs.path().display()),
            format!("--bpf-cgroup={}", cg.path().display()),
        ],
    );
    check_mode("ebpf", &body, "kproxy_bpf_map_entries{");
}

#[test]
fn promtool_finds_no_problem_in_iptables_mode() {
    if !require_root() || require_tool("promtool", "prometheus").is_none() {
        return;
    }
    let body = scrape("mp-ipt", "iptables", &["--proxy-mode=iptables".to_owned()]);
    check_mode(
        "iptables",
        &body,
        "kubeproxy_sync_proxy_rules_iptables_total{",
    );
}

#[test]
fn promtool_reports_what_it_should() {
    // The check itself can fail: an OpenMetrics counter (its TYPE line names the family
    // without `_total`) is a lint problem in Prometheus' text format.
    let Some(promtool) = require_tool("promtool", "prometheus") else {
        return;
    };
    let (ok, said) = promtool_check(
        &promtool,
        "# HELP x_changes Changes.\n# TYPE x_changes counter\nx_changes_total 1\n",
    );
    assert!(!ok && said.contains("x_changes_total"), "{said}");
}
