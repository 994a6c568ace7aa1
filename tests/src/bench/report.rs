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
const GROUPS: [(&str, &str); 6] = [
    ("packet", "Per packet (BPF_PROG_TEST_RUN)"),
    ("connect", "TCP connect latency, pod → service"),
    ("rps", "Requests per second, pod → service"),
    ("cold-start", "Cold start through the API server"),
    (
        "change",
        "One endpoint change, API write → new backend answers",
    ),
    ("resources", "Agent resources"),
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

pub fn markdown(results: &Results) -> String {
    let mut md = String::new();
    let m = &results.machine;
    let _ = writeln!(md, "# kproxy benchmark report\n");
    let _ = writeln!(
        md,
        "- commit `{}`, {} run, {:.0} s\n- machine: {} CPUs ({}), {:.1} GiB, kernel {}\n",
        results.commit,
        if results.quick { "quick" } else { "full" },
        results.duration_s,
        m.cpus,
        m.cpu_model,
        m.memory_gib,
        m.kernel
    );
    let _ = writeln!(
        md,
        "Each figure is compared with its baseline measured in the same run; ratios are of \
         medians. Absolute numbers on a shared 2-core machine are noise, ratios are the result.\n"
    );
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
        if !figs.is_empty() {
            let _ = writeln!(
                md,
                "| figure | n | median | p90 | p99 | unit | vs baseline | target | met |\n|---|---|---|---|---|---|---|---|---|"
            );
            for f in figs {
                let s = Summary::of(&f.samples);
                let r = ratio(results, f).map_or("—".into(), |r| format!("{r:.2}×"));
                let t = f.target.as_ref().map_or("—".into(), |t| t.text.clone());
                let met = match meets_target(results, f) {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "—",
                };
                let _ = writeln!(
                    md,
                    "| `{}` | {} | {:.2} | {:.2} | {:.2} | {} | {r} | {t} | {met} |",
                    f.id, s.n, s.median, s.p90, s.p99, f.unit
                );
            }
            md.push('\n');
        }
        for u in missing {
            let _ = writeln!(md, "- `{}` not measured: {}", u.id, u.reason);
        }
        if !md.ends_with("\n\n") {
            md.push('\n');
        }
    }
    md
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
        out.entry(f.mode.clone())
            .or_default()
            .push((f.services.to_string(), Summary::of(&f.samples).median));
    }
    out
}

/// A short summary for README (`cargo xtask bench` splices it between README's
/// `<!-- bench:start -->` / `<!-- bench:end -->` markers): every figure that has a baseline
/// or a target, with its ratio and whether the target is met, plus the run's provenance.
pub fn readme_section(results: &Results) -> String {
    let mut md = format!(
        "Measured by `cargo xtask bench{}` at commit `{}` on {} CPUs, kernel {} \
         (full report: `bench/REPORT.md`).\n\n\
         | figure | median | vs baseline | target | met |\n|---|---|---|---|---|\n",
        if results.quick { " --quick" } else { "" },
        &results.commit[..results.commit.len().min(12)],
        results.machine.cpus,
        results.machine.kernel
    );
    for f in &results.figures {
        if f.baseline.is_none() && f.target.is_none() {
            continue;
        }
        let median = Summary::of(&f.samples).median;
        let r = ratio(results, f).map_or("—".into(), |r| format!("{r:.2}×"));
        let t = f.target.as_ref().map_or("—".into(), |t| t.text.clone());
        let met = match meets_target(results, f) {
            Some(true) => "yes",
            Some(false) => "no",
            None => "—",
        };
        let _ = writeln!(
            md,
            "| `{}` | {median:.2} {} | {r} | {t} | {met} |",
            f.id, f.unit
        );
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
