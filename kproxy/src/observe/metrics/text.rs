//! The two text expositions `/metrics` serves, chosen by the request's `Accept` header as
//! upstream's handler (client_golang's `expfmt.Negotiate`) chooses: OpenMetrics only when the
//! client lists `application/openmetrics-text` (Prometheus does), otherwise Prometheus' text
//! format 0.0.4 (curl, `promtool check metrics`, older scrapers).
//!
//! The registry writes OpenMetrics; [`to_prometheus_text`] turns that into 0.0.4, where a
//! counter's `# HELP`/`# TYPE` lines name the family with the `_total` of its samples (in
//! OpenMetrics they name it without), `_created` samples do not exist, and there are no
//! `# UNIT` or `# EOF` lines.

/// The OpenMetrics content type.
pub(crate) const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Prometheus' text format 0.0.4.
pub(crate) const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header value asks for OpenMetrics (listed with a non-zero quality).
pub(crate) fn wants_openmetrics(accept: &str) -> bool {
    accept.split(',').any(|range| {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or("");
        let refused = parts.any(|p| {
            p.strip_prefix("q=")
                .and_then(|q| q.parse::<f64>().ok())
                .is_some_and(|q| q <= 0.0)
        });
        media.eq_ignore_ascii_case("application/openmetrics-text") && !refused
    })
}

/// The Prometheus text format 0.0.4 of an OpenMetrics text exposition.
pub(crate) fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    // The counter family the lines being read belong to.
    let mut counter: Option<&str> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut words = rest.splitn(3, ' ');
            let (keyword, family, tail) = (
                words.next().unwrap_or(""),
                words.next().unwrap_or(""),
                words.next(),
            );
            match keyword {
                "EOF" | "UNIT" => continue,
                "TYPE" => {
                    let kind = tail.unwrap_or("");
                    counter = (kind == "counter").then_some(family);
                    let (name, kind) = match kind {
                        "counter" => (format!("{family}_total"), "counter"),
                        "unknown" => (family.to_owned(), "untyped"),
                        other => (family.to_owned(), other),
                    };
                    out.push_str(&format!("# TYPE {name} {kind}\n"));
                    continue;
                }
                "HELP" => {
                    let name = if counters.contains(family) {
                        format!("{family}_total")
                    } else {
                        family.to_owned()
                    };
                    out.push_str(&format!("# HELP {name} {}\n", tail.unwrap_or("")));
                    continue;
                }
                _ => {}
            }
        }
        let sample = line.split(" # ").next().unwrap_or(line);
        let name = sample.split(['{', ' ']).next().unwrap_or("");
        if counter.is_some_and(|f| name.strip_prefix(f) == Some("_created")) {
            continue;
        }
        out.push_str(sample);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENMETRICS_TEXT: &str = "# HELP kubeproxy_proxy_healthz Cumulative proxy healthz HTTP status.\n\
# TYPE kubeproxy_proxy_healthz counter\n\
kubeproxy_proxy_healthz_total{code=\"200\"} 3\n\
kubeproxy_proxy_healthz_created{code=\"200\"} 1700000000.0\n\
# HELP kubeproxy_sync_proxy_rules_duration_seconds SyncProxyRules latency in seconds.\n\
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n\
# UNIT kubeproxy_sync_proxy_rules_duration_seconds seconds\n\
kubeproxy_sync_proxy_rules_duration_seconds_sum{ip_family=\"IPv4\"} 0.5\n\
kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n\
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"+Inf\",ip_family=\"IPv4\"} 1 # {trace=\"x\"} 0.5\n\
# HELP kproxy_programmed_services Service ports programmed.\n\
# TYPE kproxy_programmed_services gauge\n\
kproxy_programmed_services 2\n\
# HELP odd Something.\n\
# TYPE odd unknown\n\
odd 1\n\
# EOF\n";

    #[test]
    fn counters_are_named_with_total_and_openmetrics_only_lines_go() {
        let want = "# HELP kubeproxy_proxy_healthz_total Cumulative proxy healthz HTTP status.\n\
# TYPE kubeproxy_proxy_healthz_total counter\n\
kubeproxy_proxy_healthz_total{code=\"200\"} 3\n\
# HELP kubeproxy_sync_proxy_rules_duration_seconds SyncProxyRules latency in seconds.\n\
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram\n\
kubeproxy_sync_proxy_rules_duration_seconds_sum{ip_family=\"IPv4\"} 0.5\n\
kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"} 1\n\
kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"+Inf\",ip_family=\"IPv4\"} 1\n\
# HELP kproxy_programmed_services Service ports programmed.\n\
# TYPE kproxy_programmed_services gauge\n\
kproxy_programmed_services 2\n\
# HELP odd Something.\n\
# TYPE odd untyped\n\
odd 1\n";
        assert_eq!(to_prometheus_text(OPENMETRICS_TEXT), want);
    }

    #[test]
    fn openmetrics_only_when_listed() {
        // What Prometheus sends.
        assert!(wants_openmetrics(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
             version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        ));
        assert!(wants_openmetrics("Application/OpenMetrics-Text"));
        assert!(!wants_openmetrics("*/*"));
        assert!(!wants_openmetrics("text/plain;version=0.0.4"));
        assert!(!wants_openmetrics("application/openmetrics-text;q=0"));
        assert!(!wants_openmetrics(""));
    }
}
