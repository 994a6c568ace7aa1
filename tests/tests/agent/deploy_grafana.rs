//! deploy/grafana/kproxy.json: every PromQL expression of the dashboard (panel targets and
//! template-variable queries) parses with Prometheus' own parser (`promtool check rules` on a
//! rule file holding them), and every metric its queries name is one the agent exports — the
//! series names of kproxy's registry in each mode (a counter family's samples end in
//! `_total`, a histogram's in `_bucket`/`_sum`/`_count`). The panels cover what the dashboard
//! is for: sync latency, network programming latency, programmed services/endpoints, BPF map
//! pressure, sync errors, per mode.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use kproxy::dataplane::ProxyMode;
use kproxy::model::IpFamily;
use kproxy::observe::metrics::{IptablesTable, NfacctCounter};
use kproxy_tests::agentproc::ScratchDir;
use kproxy_tests::tools::require_tool;
use serde_json::Value;

fn dashboard() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/kproxy.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// (where, PromQL) of every query: panel targets (rows' nested panels too) and template
/// variables (`label_values(selector, label)` → the selector).
fn queries(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    fn panels(list: &Value, out: &mut Vec<(String, String)>) {
        for p in list.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("?");
            for t in p["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{title}: no expr"));
                out.push((format!("panel {title:?}"), expr.to_owned()));
            }
            panels(&p["panels"], out);
        }
    }
    panels(&d["panels"], &mut out);
    for v in d["templating"]["list"].as_array().unwrap() {
        if v["type"] != "query" {
            continue;
        }
        let q = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .unwrap();
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .and_then(|r| r.rsplit_once(','))
            .map(|(sel, _label)| sel.trim())
            .unwrap_or_else(|| panic!("variable {}: {q:?} is not label_values(…)", v["name"]));
        out.push((format!("variable {}", v["name"]), inner.to_owned()));
    }
    out
}

/// The metrics each panel queries, with the title of the row the panel is in (rows are
/// separator panels of type `row` in the flat panel list).
pub(crate) fn metrics_by_row() -> Vec<(String, String, BTreeSet<String>)> {
    let d = dashboard();
    let mut row = String::new();
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap_or("?").to_owned();
        if p["type"] == "row" {
            row = title;
            continue;
        }
        let mut names = BTreeSet::new();
        for t in p["targets"].as_array().into_iter().flatten() {
            names.extend(metric_names(&expand(t["expr"].as_str().unwrap())));
        }
        out.push((row.clone(), title, names));
    }
    out
}

/// Grafana's variables replaced by values Prometheus accepts.
fn expand(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$mode", ".*")
        .replace("$instance", ".*")
}

/// PromQL words that are not metric names.
const KEYWORDS: [&str; 14] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "atan2",
];
/// Aggregation operators: `sum by (le) (…)` puts a grouping between the name and `(`.
const AGGREGATIONS: [&str; 12] = [
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];
/// Keywords followed by a parenthesized list of label names.
const LABEL_LISTS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names a PromQL expression selects: identifiers outside strings, label matchers
/// (`{…}`) and ranges (`[…]`), not called as functions, not keywords, not label lists.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let b: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    let skip_to = |from: usize, open: char, close: char| -> usize {
        // From an opening bracket to just after its match, skipping strings inside.
        let (mut depth, mut j) = (0, from);
        while j < b.len() {
            match b[j] {
                '"' | '\'' | '`' => j = skip_string(&b, j) - 1,
                c if c == open => depth += 1,
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return j + 1;
                    }
                }
                _ => {}
            }
            j += 1;
        }
        panic!("unbalanced {open} in {expr:?}");
    };
    while i < b.len() {
        let c = b[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&b, i);
        } else if c == '{' {
            i = skip_to(i, '{', '}');
        } else if c == '[' {
            i = skip_to(i, '[', ']');
        } else if c.is_ascii_digit() || c == '.' {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_' || b[i] == ':') {
                i += 1;
            }
            let word: String = b[start..i].iter().collect();
            let mut j = i;
            while j < b.len() && b[j].is_whitespace() {
                j += 1;
            }
            let called = j < b.len() && b[j] == '(';
            if LABEL_LISTS.contains(&word.as_str()) && called {
                i = skip_to(j, '(', ')');
            } else if !called
                && !KEYWORDS.contains(&word.to_ascii_lowercase().as_str())
                && !AGGREGATIONS.contains(&word.as_str())
            {
                out.insert(word);
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Index just after the string literal starting at `at`.
fn skip_string(b: &[char], at: usize) -> usize {
    let quote = b[at];
    let mut j = at + 1;
    while j < b.len() && b[j] != quote {
        if b[j] == '\\' && quote != '`' {
            j += 1;
        }
        j += 1;
    }
    j + 1
}

/// The series names kproxy's registry exports in `mode` once the mode's datapath and the
/// health server have reported (a labelled family shows no `# TYPE` before its first series).
fn exported(mode: ProxyMode) -> BTreeSet<String> {
    let m = kproxy::app::registry::metrics(mode);
    m.count_health_request(false, 200);
    m.count_health_request(true, 200);
    m.conntrack().deleted(IpFamily::V4, 0);
    m.conntrack().observe(IpFamily::V4, 0.0);
    if mode == ProxyMode::Ebpf {
        m.set_bpf_map("KP_SERVICES", 1, 2);
        m.set_bpf_skipped_service_ports("SCTP", 0);
        m.set_bpf_snat_failures(0);
    }
    if let Some(ipt) = m.iptables() {
        ipt.observe_sync(IpFamily::V4, true, 0.1);
        ipt.observe_sync(IpFamily::V4, false, 0.1);
        ipt.set_rules_last(IpFamily::V4, IptablesTable::Nat, 1);
        ipt.set_rules_total(IpFamily::V4, IptablesTable::Nat, 1);
        ipt.restore_failed(IpFamily::V4, false);
        ipt.restore_failed(IpFamily::V4, true);
        ipt.set_nfacct(NfacctCounter::CtStateInvalidDropped, 0);
        ipt.set_nfacct(NfacctCounter::LocalhostNodePortsAccepted, 0);
    }
    let text = m.encode();
    let mut out = BTreeSet::new();
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let (family, kind) = rest.split_once(' ').unwrap();
        match kind {
            "counter" => {
                out.insert(format!("{family}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    out.insert(format!("{family}{s}"));
                }
            }
            _ => {
                out.insert(family.to_owned());
            }
        }
    }
    out
}

#[test]
fn metric_names_are_extracted_from_promql() {
    let names = metric_names(
        r#"histogram_quantile(0.99, sum by (le, instance) (rate(a_bucket{x=~"b{c}", y!="z"}[5m]))) / on(instance) group_left(mode) max without (d) (e_total offset 1h) > bool 2e3 or time() - f"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["a_bucket", "e_total", "f"]
    );
}

#[test]
fn every_dashboard_metric_is_exported() {
    let d = dashboard();
    let queries = queries(&d);
    assert!(queries.len() >= 20, "{} queries", queries.len());
    let mut all = BTreeSet::new();
    for m in [ProxyMode::Ebpf, ProxyMode::Iptables, ProxyMode::Ipvs] {
        all.extend(exported(m));
    }
    let mut used = BTreeSet::new();
    for (what, expr) in &queries {
        let names = metric_names(&expand(expr));
        assert!(!names.is_empty(), "{what}: no metric in {expr:?}");
        for n in names {
            assert!(
                all.contains(&n),
                "{what}: {n} is not exported by the agent in any mode (query {expr:?})"
            );
            used.insert(n);
        }
    }
    // What the dashboard is for, each present.
    for need in [
        "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
        "kubeproxy_network_programming_duration_seconds_bucket",
        "kproxy_programmed_services",
        "kproxy_programmed_endpoints",
        "kproxy_bpf_map_entries",
        "kproxy_bpf_map_capacity",
        "kproxy_sync_errors_total",
    ] {
        assert!(used.contains(need), "the dashboard shows no {need}");
    }
    eprintln!(
        "{} queries, {} metrics, all exported",
        queries.len(),
        used.len()
    );
}

#[test]
fn every_dashboard_query_parses_with_prometheus() {
    let Some(promtool) = require_tool("promtool", "prometheus") else {
        return;
    };
    let queries = queries(&dashboard());
    let rules: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (_, expr))| serde_json::json!({"record": format!("kproxy:dashboard:{i}"), "expr": expand(expr)}))
        .collect();
    let file = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    let scratch = ScratchDir::new("grafana-rules").unwrap();
    let path = scratch.path().join("rules.yaml");
    std::fs::write(&path, serde_yaml::to_string(&file).unwrap()).unwrap();
    let o = Command::new(promtool)
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "promtool check rules:\n{said}");
    assert!(
        said.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{said}"
    );
}
