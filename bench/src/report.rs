//! Writes a run's results: `results.json` (everything, every sample), `REPORT.md` (one table
//! per group: median/p90/p99, ratio to the baseline, the target and whether it is met) and
//! SVG plots (latency vs services per mode; programming time per mode; ns/packet vs services).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;

use super::stats::Summary;
use super::{Figure, Results};

/// Group id → heading, in report order.
const GROUPS: [(&str, &str); 15] = [
    ("packet", "Per packet (BPF_PROG_TEST_RUN)"),
    (
        "connect",
        "TCP connect latency, pod → service (vs the direct connects measured alongside)",
    ),
    (
        "connect-direct",
        "TCP connect latency, pod → backend pod directly, measured alongside each mode",
    ),
    (
        "connect-floor",
        "TCP connect through the kernel's NAT alone (one nftables DNAT rule), alongside each netfilter mode: its floor (vs direct)",
    ),
    ("rps", "Requests per second, pod → service"),
    ("cold-start", "Cold start through the API server"),
    (
        "change",
        "One endpoint change, API write → new backend answers",
    ),
    ("resources", "Agent resources"),
    (
        "restore-floor",
        "iptables restore floors: one chain (`--noflush`), whole nat table",
    ),
    ("inspect", "`kproxy inspect` at scale"),
    (
        "throughput",
        "UDP flood to a NodePort, remote backends: packets/s delivered (vs plain routing)",
    ),
    (
        "throughput-cpu",
        "UDP flood: CPU ns per delivered packet (vs iptables-nft)",
    ),
    (
        "throughput-node",
        "UDP flood: the node's share of the CPU per packet (its median minus `floor`'s; vs iptables-nft)",
    ),
    (
        "nft-floor",
        "nftables floors: the agent's own transactions replayed with `nft -f`, and other ways to load the cold start",
    ),
    (
        "resync",
        "nftables full resync: the agent restarted over its own table",
    ),
];

/// `median(figure) / median(baseline)` when the figure has a baseline in `results`.
pub fn ratio(results: &Results, f: &Figure) -> Option<f64> {
    let base = results.figure(f.baseline.as_deref()?)?;
    let b = Summary::of(&base.samples).median;
    (b > 0.0).then(|| Summary::of(&f.samples).median / b)
}

/// `Some(true|false)` when the figure has a target.
pub fn meets_target(results: &Results, f: &Figure) -> Option<bool> {
    let t = f.target.as_ref()?;
    let median = Summary::of(&f.samples).median;
    let by_ratio = t
        .max_ratio
        .map(|m| ratio(results, f).is_some_and(|r| r <= m));
    let by_value = t.max_value.map(|m| median <= m);
    Some(by_ratio.unwrap_or(true) && by_value.unwrap_or(true))
}

/// How far the figure is from its target: its median over the allowed value (or its ratio to
/// the baseline over the allowed ratio); ≤ 1 meets it.
pub fn of_target(results: &Results, f: &Figure) -> Option<f64> {
    let t = f.target.as_ref()?;
    let median = Summary::of(&f.samples).median;
    let by_value = t.max_value.map(|m| median / m);
    let by_ratio = t.max_ratio.and_then(|m| ratio(results, f).map(|r| r / m));
    match (by_value, by_ratio) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// The figure's id as shown, marked † when it was measured in the guest.
fn shown_id(results: &Results, f: &Figure) -> String {
    if results.in_guest(&f.id) {
        format!("`{}` †", f.id)
    } else {
        format!("`{}`", f.id)
    }
}

const GUEST_NOTE: &str = "† measured inside the QEMU guest (`cargo xtask bench --ipvs-guest`; \
    the host kernel has no IPVS): under TCG emulation absolute times are many times the host's \
    and not comparable with host figures; the ratio to the baseline measured in the same guest \
    (`direct-guest`) is the result.";

/// Agent modes of the run (connect and control figures), in summary order.
fn modes(results: &Results) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for f in &results.figures {
        let agent = matches!(
            f.group.as_str(),
            "connect" | "cold-start" | "change" | "resources"
        );
        if agent && f.mode != "baseline" && !out.contains(&f.mode) {
            out.push(f.mode.clone());
        }
    }
    let order = [
        "ebpf",
        "iptables-nft",
        "iptables-legacy",
        "iptables",
        "nftables",
        "ipvs",
    ];
    out.sort_by_key(|m| order.iter().position(|o| o == m).unwrap_or(order.len()));
    out
}

/// One table, modes side by side: connect latency at each scale (ratio to direct), cold
/// start, one change p50/p99, RSS, CPU.
pub fn summary(results: &Results) -> String {
    let modes = modes(results);
    if modes.is_empty() {
        return String::new();
    }
    let find = |group: &str, mode: &str| -> Vec<&Figure> {
        results
            .figures
            .iter()
            .filter(|f| f.group == group && f.mode == mode)
            .collect()
    };
    let mark = |f: &Figure| if results.in_guest(&f.id) { " †" } else { "" };
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut scales: Vec<u32> = results
        .figures
        .iter()
        .filter(|f| f.group == "connect" && f.mode != "baseline")
        .map(|f| f.services)
        .collect();
    scales.sort_unstable();
    scales.dedup();
    for n in scales {
        for (group, label) in [
            ("connect", "connect median, vs direct"),
            (
                "connect-floor",
                "its floor (one DNAT rule, no proxier), vs direct",
            ),
            ("rps", "req/s keep-alive, vs direct"),
        ] {
            if group == "connect-floor" && !results.figures.iter().any(|f| f.group == group) {
                continue;
            }
            let cells = modes
                .iter()
                .map(|m| {
                    find(group, m)
                        .into_iter()
                        .find(|f| {
                            f.services == n
                                && (group != "rps" || f.id.starts_with("rps-keepalive/"))
                        })
                        .map_or("—".into(), |f| {
                            let med = Summary::of(&f.samples).median;
                            let r =
                                ratio(results, f).map_or(String::new(), |r| format!(" ({r:.2}×)"));
                            format!("{med:.1} {}{r}{}", f.unit, mark(f))
                        })
                })
                .collect();
            rows.push((
                format!("{label}, {n} service{}", if n == 1 { "" } else { "s" }),
                cells,
            ));
        }
    }
    let value = |group: &str, what: &str, m: &str, fmt: &dyn Fn(&Figure) -> String| -> String {
        find(group, m)
            .into_iter()
            .find(|f| what.is_empty() || f.id.starts_with(what))
            .map_or("—".into(), |f| format!("{}{}", fmt(f), mark(f)))
    };
    let with_target = |f: &Figure, v: f64| -> String {
        let t = of_target(results, f).map_or(String::new(), |t| format!(" ({:.2}× target)", t));
        format!("{v:.2} {}{t}", f.unit)
    };
    rows.push((
        "cold start (services × 5)".into(),
        modes
            .iter()
            .map(|m| {
                value("cold-start", "", m, &|f| {
                    format!(
                        "{} @{}",
                        with_target(f, Summary::of(&f.samples).median),
                        f.services
                    )
                })
            })
            .collect(),
    ));
    rows.push((
        "one change p50 / p99".into(),
        modes
            .iter()
            .map(|m| {
                value("change", "", m, &|f| {
                    let s = Summary::of(&f.samples);
                    format!(
                        "{} / {:.1} ms @{}",
                        with_target(f, s.median),
                        s.p99,
                        f.services
                    )
                })
            })
            .collect(),
    ));
    for (what, label) in [("rss/", "agent peak RSS"), ("cpu/", "agent CPU seconds")] {
        rows.push((
            label.into(),
            modes
                .iter()
                .map(|m| {
                    value("resources", what, m, &|f| {
                        with_target(f, Summary::of(&f.samples).median)
                    })
                })
                .collect(),
        ));
    }
    let mut md = format!(
        "| | {} |\n|---|{}\n",
        modes.join(" | "),
        "---|".repeat(modes.len())
    );
    for (label, cells) in rows {
        let _ = writeln!(md, "| {label} | {} |", cells.join(" | "));
    }
    md
}

pub fn markdown(results: &Results) -> String {
    let mut md = String::new();
    let m = &results.machine;
    let _ = writeln!(md, "# kproxy benchmark report\n");
    let _ = writeln!(
        md,
        "- commit `{}`, {} run{}, {:.0} s\n- machine: {} CPUs ({}), {:.1} GiB, kernel {}\n",
        results.commit,
        if results.quick { "quick" } else { "full" },
        only_note(results),
        results.duration_s,
        m.cpus,
        m.cpu_model,
        m.memory_gib,
        m.kernel
    );
    if !results.group_seconds.is_empty() {
        let parts: Vec<String> = results
            .group_seconds
            .iter()
            .map(|(g, s)| format!("{g} {s:.0} s"))
            .collect();
        let _ = writeln!(md, "- wall time per group: {}\n", parts.join(", "));
    }
    if let Some(g) = &results.guest {
        let _ = writeln!(
            md,
            "- ipvs (†): QEMU guest ({}), kernel {}, commit `{}`, {:.0} s including boot; connect, \
             cold start and one change at up to {} services × 5{}\n",
            g.accel,
            g.kernel,
            g.commit,
            g.duration_s,
            g.cold_services,
            if g.cold_services < 10_000 {
                " (reduced from 10k: under TCG the agent did not finish programming 10k services \
                 into IPVS within 180 s)"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(
        md,
        "Each figure is compared with its baseline measured in the same run; ratios are of \
         medians. Absolute numbers on a shared 2-core machine are noise, ratios are the result. \
         The agent runs with every min sync period set to 0 (`--min-sync-period=0s` and the \
         per-mode ones), so one change is programmed as soon as the previous sync ends. \
         iptables runs once per backend (`iptables-nft`, `iptables-legacy`), chosen the way \
         the agent detects it on a real node: kubelet's `KUBE-IPTABLES-HINT` chain in that \
         backend's mangle table, created in the node namespace before the agent starts.\n"
    );
    let table = summary(results);
    if !table.is_empty() {
        let _ = writeln!(md, "## Summary, modes side by side\n\n{table}");
        if results.guest.is_some() {
            let _ = writeln!(md, "{GUEST_NOTE}\n");
        }
    }
    for (group, title) in GROUPS {
        let figs: Vec<&Figure> = results
            .figures
            .iter()
            .filter(|f| f.group == group)
            .collect();
        let missing: Vec<_> = results
            .unavailable
            .iter()
            .filter(|u| {
                u.id.starts_with(&format!("{group}/")) || u.id.starts_with(&format!("{group}-"))
            })
            .collect();
        if figs.is_empty() && missing.is_empty() {
            continue;
        }
        let _ = writeln!(md, "## {title}\n");
        if group == "packet" {
            let _ = writeln!(md, "{}\n", super::packet::METHOD);
        }
        if !figs.is_empty() {
            let _ = writeln!(
                md,
                "| figure | n | median | p90 | p99 | unit | vs baseline | target | vs target | met |\n|---|---|---|---|---|---|---|---|---|---|"
            );
            let mut derived = Vec::new();
            for f in &figs {
                let s = Summary::of(&f.samples);
                let r = ratio(results, f).map_or("—".into(), |r| format!("{r:.2}×"));
                let t = f.target.as_ref().map_or("—".into(), |t| t.text.clone());
                let of = of_target(results, f).map_or("—".into(), |x| format!("{x:.2}×"));
                let met = match meets_target(results, f) {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "—",
                };
                // A derived figure's one value has no percentiles: its spread is below.
                let (n, p90, p99) = match results.derivation(&f.id) {
                    Some(d) => {
                        derived.push(derivation_line(results, d));
                        ("—".into(), "—".into(), "—".into())
                    }
                    None => (
                        s.n.to_string(),
                        format!("{:.2}", s.p90),
                        format!("{:.2}", s.p99),
                    ),
                };
                let _ = writeln!(
                    md,
                    "| {} | {n} | {:.2} | {p90} | {p99} | {} | {r} | {t} | {of} | {met} |",
                    shown_id(results, f),
                    s.median,
                    f.unit
                );
            }
            md.push('\n');
            if !derived.is_empty() {
                let _ = writeln!(
                    md,
                    "Derived figures: the difference of two figures' medians (not per sample, \
                     whose differences can be anything down to negative); their spread is \
                     that of the two figures:\n\n{}\n",
                    derived.join("\n")
                );
            }
            if figs.iter().any(|f| results.in_guest(&f.id)) {
                let _ = writeln!(md, "{GUEST_NOTE}\n");
            }
        }
        for u in missing {
            let _ = writeln!(md, "- `{}` not measured: {}", u.id, u.reason);
        }
        if !md.ends_with("\n\n") {
            md.push('\n');
        }
    }
    md.push_str(&super::soak::markdown(results));
    md
}

/// `- `id` = median(`of`) − median(`minus`); per round: min … max (n)`: the per-round
/// differences when both figures were sampled in the same rounds, else each figure's range.
fn derivation_line(results: &Results, d: &crate::Derivation) -> String {
    let (Some(a), Some(b)) = (results.figure(&d.of), results.figure(&d.minus)) else {
        return format!("- `{}` = median(`{}`) − median(`{}`)", d.id, d.of, d.minus);
    };
    let range = |v: &[f64]| {
        let s = Summary::of(v);
        format!("{:.2} … {:.2}", s.min, s.max)
    };
    let spread = if a.samples.len() == b.samples.len() {
        let rounds: Vec<f64> = a
            .samples
            .iter()
            .zip(&b.samples)
            .map(|(x, y)| x - y)
            .collect();
        format!("per round {} ({} rounds)", range(&rounds), rounds.len())
    } else {
        format!("ranges {} and {}", range(&a.samples), range(&b.samples))
    };
    format!(
        "- `{}` = median(`{}`) − median(`{}`); {spread} {}",
        d.id, d.of, d.minus, a.unit
    )
}

/// One line per mode: (x label, y) points.
type Series = BTreeMap<String, Vec<(String, f64)>>;

/// A small line chart (categorical x, linear y from 0) as SVG.
pub fn line_chart(title: &str, y_unit: &str, series: &Series) -> String {
    const W: f64 = 640.0;
    const H: f64 = 360.0;
    const L: f64 = 70.0;
    const B: f64 = 50.0;
    const T: f64 = 40.0;
    const R: f64 = 140.0;
    let mut xs: Vec<String> = Vec::new();
    for pts in series.values() {
        for (x, _) in pts {
            if !xs.contains(x) {
                xs.push(x.clone());
            }
        }
    }
    xs.sort_by_key(|x| x.parse::<u64>().unwrap_or(u64::MAX));
    let ymax = series
        .values()
        .flatten()
        .map(|(_, y)| *y)
        .fold(0.0_f64, f64::max)
        .max(f64::MIN_POSITIVE)
        * 1.15;
    let px = |i: usize| L + (W - L - R) * (i as f64 + 0.5) / xs.len().max(1) as f64;
    let py = |y: f64| T + (H - T - B) * (1.0 - y / ymax);
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    ];
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        W / 2.0,
        esc(title)
    );
    let _ = writeln!(
        s,
        "<line x1=\"{L}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{L}\" y1=\"{T}\" x2=\"{L}\" y2=\"{}\" stroke=\"black\"/>",
        H - B,
        W - R,
        H - B,
        H - B
    );
    for k in 0..=4 {
        let y = ymax * f64::from(k) / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{y:.1}</text><line x1=\"{L}\" y1=\"{:.1}\" x2=\"{}\" y2=\"{:.1}\" stroke=\"#ddd\"/>",
            L - 6.0,
            py(y) + 4.0,
            py(y),
            W - R,
            py(y)
        );
    }
    for (i, x) in xs.iter().enumerate() {
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            px(i),
            H - B + 18.0,
            esc(x)
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">{}</text>\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">services</text>",
        H / 2.0,
        H / 2.0,
        esc(y_unit),
        (L + W - R) / 2.0,
        H - 10.0
    );
    for (k, (name, pts)) in series.iter().enumerate() {
        let c = colors[k % colors.len()];
        let coords: Vec<String> = pts
            .iter()
            .filter_map(|(x, y)| {
                xs.iter()
                    .position(|v| v == x)
                    .map(|i| format!("{:.1},{:.1}", px(i), py(*y)))
            })
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            coords.join(" ")
        );
        for p in &coords {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(s, "<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{c}\"/>");
        }
        let ly = T + 18.0 * k as f64;
        let _ = writeln!(
            s,
            "<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{c}\"/><text x=\"{}\" y=\"{}\">{}</text>",
            W - R + 12.0,
            ly,
            W - R + 30.0,
            ly + 11.0,
            esc(name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Medians of the figures of `group`, one series per mode, x = services.
fn series_of(results: &Results, group: &str) -> Series {
    let mut out = Series::new();
    for f in results.figures.iter().filter(|f| f.group == group) {
        let mode = if results.in_guest(&f.id) {
            format!("{} (guest)", f.mode)
        } else {
            f.mode.clone()
        };
        out.entry(mode)
            .or_default()
            .push((f.services.to_string(), Summary::of(&f.samples).median));
    }
    out
}

/// ` of the groups X only (…)` when `--only` chose the groups, else nothing.
fn only_note(results: &Results) -> String {
    results.only.as_ref().map_or(String::new(), |g| {
        format!(" of the groups `{g}` only (the other groups were not run)")
    })
}

/// A short summary for README (`cargo xtask bench` splices it between README's
/// `<!-- bench:start -->` / `<!-- bench:end -->` markers): the modes side by side and the run's
/// provenance. Every figure, with its baseline and target, is in REPORT.md.
pub fn readme_section(results: &Results) -> String {
    let mut md = format!(
        "Measured by `cargo xtask bench{}{}` at commit `{}` on {} CPUs, kernel {} \
         (every figure, with its baseline and target: `bench/REPORT.md`).\n\n\
         Modes side by side:\n\n{}",
        if results.quick { " --quick" } else { "" },
        results
            .only
            .as_ref()
            .map_or(String::new(), |g| format!(" --only {g}")),
        &results.commit[..results.commit.len().min(12)],
        results.machine.cpus,
        results.machine.kernel,
        summary(results),
    );
    let thru = throughput_table(results);
    if !thru.is_empty() {
        let _ = write!(
            md,
            "\nReal packets (`throughput`): a UDP flood from the external client to a NodePort \
             with remote backends, per datapath (`bench/src/throughput.rs` says how):\n\n{thru}"
        );
    }
    if results.guest.is_some() {
        let _ = writeln!(md, "\n{GUEST_NOTE}");
    }
    if !results.unavailable.is_empty() {
        let _ = writeln!(
            md,
            "\nNot measured in that run: {}.",
            results
                .unavailable
                .iter()
                .map(|u| format!("`{}`", u.id))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    md
}

/// The [`throughput`](super::throughput) figures, one row per mode: delivered packets/s (vs
/// plain routing), CPU per packet and the node's share of it (vs iptables-nft). Empty when the
/// run has none.
pub fn throughput_table(results: &Results) -> String {
    let cell = |group: &str, mode: &str| -> String {
        results
            .figure(&format!("{group}/{mode}"))
            .map_or("—".into(), |f| {
                let med = Summary::of(&f.samples).median;
                let r = ratio(results, f).map_or(String::new(), |r| format!(" ({r:.2}×)"));
                let t =
                    of_target(results, f).map_or(String::new(), |t| format!(", {t:.2}× target"));
                format!("{med:.0} {}{r}{t}", f.unit)
            })
    };
    let rows: Vec<String> = super::throughput::MODES
        .iter()
        .filter(|m| results.figure(&format!("throughput/{m}")).is_some())
        .map(|m| {
            format!(
                "| {m} | {} | {} | {} |",
                cell("throughput", m),
                cell("throughput-cpu", m),
                cell("throughput-node", m)
            )
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "| mode | delivered (vs route) | CPU per packet (vs iptables-nft) | the node's share (vs iptables-nft) |\n|---|---|---|---|\n{}\n",
        rows.join("\n")
    )
}

/// Writes `results.json`, `REPORT.md` and the plots into `dir`.
pub fn write(results: &Results, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(results)?,
    )?;
    let mut md = markdown(results);
    let plots = [
        (
            "connect-latency.svg",
            "connect",
            "TCP connect latency (median)",
            "µs",
        ),
        (
            "per-packet.svg",
            "packet",
            "BPF_PROG_TEST_RUN (median)",
            "ns/packet",
        ),
        (
            "programming-time.svg",
            "change",
            "One endpoint change (median)",
            "ms",
        ),
        ("cold-start.svg", "cold-start", "Cold start", "s"),
    ];
    let mut listed = Vec::new();
    for (file, group, title, unit) in plots {
        let series = series_of(results, group);
        if series.is_empty() {
            continue;
        }
        std::fs::write(dir.join(file), line_chart(title, unit, &series))?;
        listed.push(format!("![{title}]({file})"));
    }
    if !listed.is_empty() {
        md.push_str("## Plots\n\n");
        md.push_str(&listed.join("\n\n"));
        md.push('\n');
    }
    std::fs::write(dir.join("REPORT.md"), md)?;
    std::fs::write(dir.join("README-section.md"), readme_section(results))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_table_has_a_row_per_measured_mode_with_ratios_and_target() {
        let fig = |id: &str, v: f64, baseline: Option<&str>, target: Option<f64>| Figure {
            id: id.into(),
            group: id.split('/').next().unwrap().into(),
            mode: id.split('/').nth(1).unwrap().into(),
            services: 1,
            unit: if id.starts_with("throughput/") {
                "kpps"
            } else {
                "ns"
            }
            .into(),
            samples: vec![v],
            baseline: baseline.map(String::from),
            target: target.map(|r| crate::Target {
                max_ratio: Some(r),
                max_value: None,
                text: "t".into(),
            }),
        };
        let mut r = Results::default();
        assert_eq!(throughput_table(&r), "");
        r.figures = vec![
            fig("throughput/route", 600.0, None, None),
            fig("throughput/ebpf-xdp", 540.0, Some("throughput/route"), None),
            fig(
                "throughput/iptables-nft",
                300.0,
                Some("throughput/route"),
                None,
            ),
            fig("throughput-node/iptables-nft", 1000.0, None, None),
            fig(
                "throughput-node/ebpf-xdp",
                250.0,
                Some("throughput-node/iptables-nft"),
                Some(1.0 / 3.0),
            ),
        ];
        let t = throughput_table(&r);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert_eq!(lines[2], "| route | 600 kpps | — | — |");
        assert_eq!(
            lines[3],
            "| ebpf-xdp | 540 kpps (0.90×) | — | 250 ns (0.25×), 0.75× target |"
        );
        assert!(
            lines[4].starts_with("| iptables-nft | 300 kpps (0.50×) |"),
            "{t}"
        );
        assert!(
            readme_section(&Results {
                commit: "c".into(),
                ..r
            })
            .contains("Real packets (`throughput`)")
        );
    }

    /// A mode's connect ratio is to the direct connects measured alongside it, and the
    /// netfilter floor gets its own row only when the run measured one.
    #[test]
    fn summary_takes_each_modes_own_direct_and_shows_the_floor_when_measured() {
        let fig = |id: &str, v: f64, baseline: Option<&str>| Figure {
            id: id.into(),
            group: id.split('/').next().unwrap().into(),
            mode: id.split('/').nth(1).unwrap().into(),
            services: 1,
            unit: "us".into(),
            samples: vec![v],
            baseline: baseline.map(String::from),
            target: None,
        };
        let mut r = Results {
            figures: vec![
                fig("connect/direct/1", 10.0, None),
                fig("connect-direct/nftables/1", 8.0, None),
                fig(
                    "connect/nftables/1",
                    12.0,
                    Some("connect-direct/nftables/1"),
                ),
            ],
            ..Default::default()
        };
        r.figures[0].mode = "baseline".into();
        let t = summary(&r);
        assert!(t.contains("| 12.0 us (1.50×) |"), "{t}");
        assert!(!t.contains("floor"), "{t}");
        r.figures.push(fig(
            "connect-floor/nftables/1",
            11.0,
            Some("connect-direct/nftables/1"),
        ));
        let t = summary(&r);
        assert!(
            t.contains(
                "| its floor (one DNAT rule, no proxier), vs direct, 1 service | 11.0 us (1.38×) |"
            ),
            "{t}"
        );
    }

    /// The committed README section is what the committed run's results give (a run writes
    /// both; a change to [`readme_section`] must regenerate the section).
    #[test]
    fn committed_readme_section_is_the_committed_results_summary() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let json = std::fs::read_to_string(dir.join("results.json")).expect("bench/results.json");
        let results: Results = serde_json::from_str(&json).expect("results.json parses");
        let committed =
            std::fs::read_to_string(dir.join("README-section.md")).expect("README-section.md");
        assert_eq!(readme_section(&results), committed);
    }

    #[test]
    fn a_run_of_chosen_groups_says_so_in_the_report_and_the_readme_section() {
        let r = Results {
            commit: "c0ffee".into(),
            only: Some("packet,soak".into()),
            ..Default::default()
        };
        assert!(markdown(&r).contains("full run of the groups `packet,soak` only"));
        assert!(readme_section(&r).contains("`cargo xtask bench --only packet,soak`"));
        let all = Results {
            commit: "c0ffee".into(),
            ..Default::default()
        };
        assert!(markdown(&all).contains("full run, "));
        assert!(readme_section(&all).contains("`cargo xtask bench` at"));
    }
}
