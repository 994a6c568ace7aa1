//! The nftables mode's floors and loading variants, and its full resync.
//!
//! The agent under measurement writes every transaction it runs into a dump directory
//! (`KPROXY_NFT_DUMP_DIR`, [`kproxy::dataplane::nftables::kernel::DUMP_DIR_ENV`]; written
//! after the commit, so the figures do not include it), each file headed by how long the
//! agent's own `nft -f -` took and what it was (`full sync part i of k`, `partial sync part 1
//! of 1`, or `transaction` for the stale-chain deletions a sync starts with). After the agent
//! stopped, the same files are replayed with `nft -f FILE`, in the order the agent ran them,
//! into a fresh network namespace (from a thread inside it, as the agent spawns `nft`), so
//! each transaction meets the kernel state it met in the agent:
//!
//! - `cold-floor/nftables/N`: the cold start's full sync, every part (the floor of the
//!   cold-start figure; two samples, each into a fresh namespace);
//! - `change-floor/nftables/N`: each endpoint change's partial sync (the floor of the
//!   one-change figure);
//! - `change-floor-cache/nftables/N`: what of that floor is `nft` building its cache (the
//!   dump of every chain and set of the table that any `add rule` or `add element` makes it
//!   take), measured as `nft -f` of one element the table already holds (the same dump, an
//!   empty commit) on the table the changes left, as many times as there were changes. The
//!   rest of the floor (parsing, the commit and its validation) is what writing the same
//!   transaction as a netlink batch without `nft` would still cost;
//! - `cold-nft/nftables/N`: the agent's own `nft -f` time of the cold start's parts (from the
//!   dump headers): what of the cold start was the kernel and `nft`;
//! - loading variants of the same operations, each into a fresh namespace:
//!   `cold-floor-one-tx/…` (one transaction, as upstream's knftables runs a sync) and
//!   `cold-floor-parts-<ops>/…` (cut at service ports every ≈ `<ops>` operations, as the
//!   agent does with
//!   `kproxy::dataplane::nftables::proxier::FULL_SYNC_BATCH_OPERATIONS` and with other sizes).
//!
//! The resync group ([`resync`]) starts the agent on 40k services × 1 endpoint, stops it,
//! starts a new one over the table it left (an agent restart: its first sync is full) and
//! reports that full sync's duration (the agent's own `sync_full_proxy_rules_duration_seconds`)
//! beside the replay of its transaction onto the table the first agent left.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use kproxy::dataplane::nftables::names::is_service_chain;
use kproxy::dataplane::nftables::proxier::{split, split_points};
use kproxy::dataplane::nftables::transaction::{Object, Verb, parse};
use kproxy_tests::netns::Netns;

use super::agent::{AgentSpec, ScratchDir, Source};
use super::services::ServiceSet;
use super::{Figure, Plan, Results, Target};

/// The dump directory of an agent whose log is `log` (its sibling `nft-dump-<log's stem>`).
pub fn dump_dir(log: &Path) -> PathBuf {
    let stem = log.file_stem().unwrap_or_default().to_string_lossy();
    log.with_file_name(format!("nft-dump-{stem}"))
}

/// What a dumped transaction was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Part `i` (from 1) of `k` of a sync's transaction.
    Sync { full: bool, i: usize, k: usize },
    /// Anything else (the stale-chain deletions).
    Other,
}

/// One transaction the agent ran.
#[derive(Debug, Clone)]
pub struct Dumped {
    pub path: PathBuf,
    /// The agent's own `nft -f -` time, ms.
    pub agent_ms: f64,
    pub ok: bool,
    pub kind: Kind,
}

/// Parses a dump's header line: `# nft -f: 12.345 ms, ok, full sync part 1 of 3`.
pub fn parse_header(line: &str) -> Option<(f64, bool, Kind)> {
    let rest = line.strip_prefix("# nft -f: ")?;
    let mut parts = rest.splitn(3, ", ");
    let ms = parts.next()?.strip_suffix(" ms")?.parse().ok()?;
    let ok = parts.next()? == "ok";
    let what = parts.next()?.trim();
    let kind = match what.split_whitespace().collect::<Vec<_>>().as_slice() {
        [kind @ ("full" | "partial"), "sync", "part", i, "of", k] => Kind::Sync {
            full: *kind == "full",
            i: i.parse().ok()?,
            k: k.parse().ok()?,
        },
        _ => Kind::Other,
    };
    Some((ms, ok, kind))
}

/// The transactions dumped into `dir` (IPv4 and IPv6 tables alike), in the order they ran.
pub fn read_dumps(dir: &Path) -> anyhow::Result<Vec<Dumped>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "nft"))
        .collect();
    paths.sort();
    let mut out = vec![];
    for path in paths {
        let text = std::fs::read_to_string(&path)?;
        let head = text.lines().next().unwrap_or_default();
        let (agent_ms, ok, kind) =
            parse_header(head).with_context(|| format!("{}: header {head:?}", path.display()))?;
        out.push(Dumped {
            path,
            agent_ms,
            ok,
            kind,
        });
    }
    Ok(out)
}

/// Index ranges of `dumps` holding whole syncs' transactions: (full, first..end).
pub fn syncs(dumps: &[Dumped]) -> Vec<(bool, std::ops::Range<usize>)> {
    let mut out = vec![];
    let mut i = 0;
    while i < dumps.len() {
        if let Kind::Sync { full, i: 1, k } = dumps[i].kind {
            let end = (i + k).min(dumps.len());
            out.push((full, i..end));
            i = end;
        } else {
            i += 1;
        }
    }
    out
}

/// Waits (up to `timeout`) until `dir` holds `partial` partial syncs after the first sync:
/// the agent writes a transaction's dump after its `nft` exited, which may be after the
/// change it made was seen, so stopping the agent at once could lose the last one.
pub fn wait_dumps(dir: &Path, partial: usize, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let seen = read_dumps(dir).map_or(0, |d| {
            syncs(&d)
                .iter()
                .skip(1)
                .filter(|(full, r)| !full && r.len() == 1)
                .count()
        });
        if seen >= partial || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One `nft -f FILE` inside `ns` (spawned from a thread in it): its wall time.
pub fn timed_nft(ns: &Netns, file: &Path) -> anyhow::Result<Duration> {
    let file = file.to_path_buf();
    ns.run(move || -> anyhow::Result<Duration> {
        let started = Instant::now();
        let out = Command::new("nft")
            .arg("-f")
            .arg(&file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("spawning nft")?;
        let took = started.elapsed();
        anyhow::ensure!(
            out.status.success(),
            "nft -f {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(took)
    })?
}

/// Replays the successful transactions of `dumps` in order into `ns`: the wall time of each
/// (`None` for a failed one, not replayed).
pub fn replay(ns: &Netns, dumps: &[Dumped]) -> anyhow::Result<Vec<Option<Duration>>> {
    dumps
        .iter()
        .map(|d| {
            if d.ok {
                timed_nft(ns, &d.path).map(Some)
            } else {
                Ok(None)
            }
        })
        .collect()
}

/// The operations of `dumps` (header comments dropped) as one text.
pub fn concatenated(dumps: &[Dumped]) -> anyhow::Result<String> {
    let mut text = String::new();
    for d in dumps {
        let t = std::fs::read_to_string(&d.path)?;
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            text.push_str(l);
            text.push('\n');
        }
    }
    Ok(text)
}

/// Where each service port's operations start in a full sync's transaction text, found from
/// the text alone: at an `add chain` of a service chain (a name with `/`) that does not
/// follow another service chain's `add`/`flush`. A service port that writes no chain (no
/// endpoints) joins the previous one, which is as safe to cut around.
pub fn port_starts(ops: &[kproxy::dataplane::nftables::transaction::Op]) -> Vec<usize> {
    let service_chain_op = |i: usize| -> bool {
        matches!(&ops[i].object, Object::Chain { name, .. } if is_service_chain(name))
            && matches!(ops[i].verb, Verb::Add | Verb::Flush)
    };
    (0..ops.len())
        .filter(|&i| {
            matches!(&ops[i].object, Object::Chain { name, .. } if is_service_chain(name))
                && ops[i].verb == Verb::Add
                && (i == 0 || !service_chain_op(i - 1))
        })
        .collect()
}

/// `text` (one full sync's operations) cut into parts of ≈ `budget` operations at service
/// ports, as the agent cuts ([`split_points`]); written as `<prefix>-NNNN.nft` files.
pub fn write_parts(text: &str, budget: usize, prefix: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let tx = parse(text).map_err(|e| anyhow::anyhow!("parsing the transaction: {e}"))?;
    let cuts = split_points(&port_starts(&tx.ops), budget);
    let mut out = vec![];
    for (i, part) in split(&tx, &cuts).iter().enumerate() {
        let path = PathBuf::from(format!("{}-{i:04}.nft", prefix.display()));
        std::fs::write(&path, part.to_string())?;
        out.push(path);
    }
    Ok(out)
}

/// Loads `files` in order into a fresh namespace: the total wall time, s.
fn load_fresh(files: &[PathBuf]) -> anyhow::Result<f64> {
    let ns = Netns::new("bench-nftload")?;
    let mut total = 0.0;
    for f in files {
        total += timed_nft(&ns, f)?.as_secs_f64();
    }
    Ok(total)
}

/// Operation budgets of the loading variants measured beside the agent's own
/// (`FULL_SYNC_BATCH_OPERATIONS`); `usize::MAX` is one transaction.
pub fn variant_budgets() -> Vec<usize> {
    match std::env::var("KP_BENCH_NFT_VARIANTS") {
        Ok(v) => v
            .split(',')
            .filter_map(|x| match x.trim() {
                "one" => Some(usize::MAX),
                n => n.parse().ok(),
            })
            .collect(),
        Err(_) => vec![usize::MAX, 5_000, 80_000],
    }
}

fn variant_id(budget: usize, n: u32) -> String {
    if budget == usize::MAX {
        format!("cold-floor-one-tx/nftables/{n}")
    } else {
        format!("cold-floor-parts-{budget}/nftables/{n}")
    }
}

fn floor_figure(id: String, n: u32, unit: &str, samples: Vec<f64>) -> Figure {
    nft_figure("nft-floor", id, n, unit, samples)
}

/// A figure of the nftables mode in `group`, without baseline or target.
fn nft_figure(group: &str, id: String, n: u32, unit: &str, samples: Vec<f64>) -> Figure {
    Figure {
        id,
        group: group.into(),
        mode: "nftables".into(),
        services: n,
        unit: unit.into(),
        samples,
        baseline: None,
        target: None,
    }
}

/// How many samples a figure of the `nft-floor` or `resync` group holds under `plan`.
pub fn samples(plan: &Plan, f: &Figure) -> usize {
    match f.id.split('/').next().unwrap_or_default() {
        "cold-floor" => 2,
        "change-floor" | "change-floor-cache" => plan.changes as usize,
        _ => 1,
    }
}

/// The floors of the control group's nftables agent (stopped), from its dumps in `dir`:
/// see the module docs. `changes`: how many endpoint changes the agent made.
pub fn floors(results: &mut Results, dir: &Path, n: u32, changes: usize) -> anyhow::Result<()> {
    let dumps = read_dumps(dir)?;
    let syncs = syncs(&dumps);
    let (full, cold) = syncs.first().cloned().context("no sync dumped")?;
    anyhow::ensure!(full, "the first sync dumped was not a full one");
    results.push(floor_figure(
        format!("cold-nft/nftables/{n}"),
        n,
        "s",
        vec![dumps[cold.clone()].iter().map(|d| d.agent_ms).sum::<f64>() / 1e3],
    ));
    // The whole sequence, so each change meets the table it met in the agent.
    let ns = Netns::new("bench-nftfloor")?;
    let times = replay(&ns, &dumps)?;
    let cache = cache_floor(&ns, &dumps[cold.clone()], changes);
    drop(ns);
    let secs = |r: std::ops::Range<usize>| -> f64 {
        times[r].iter().flatten().map(Duration::as_secs_f64).sum()
    };
    let mut cold_floor = vec![secs(cold.clone())];
    cold_floor.push(load_fresh(
        &dumps[cold.clone()]
            .iter()
            .map(|d| d.path.clone())
            .collect::<Vec<_>>(),
    )?);
    results.push(floor_figure(
        format!("cold-floor/nftables/{n}"),
        n,
        "s",
        cold_floor,
    ));
    let change: Vec<f64> = syncs
        .iter()
        .skip(1)
        .filter(|(full, r)| !full && r.len() == 1)
        .take(changes)
        .map(|(_, r)| secs(r.clone()) * 1e3)
        .collect();
    anyhow::ensure!(
        change.len() == changes,
        "{} partial syncs dumped for {changes} changes",
        change.len()
    );
    results.push(floor_figure(
        format!("change-floor/nftables/{n}"),
        n,
        "ms",
        change,
    ));
    let id = format!("change-floor-cache/nftables/{n}");
    match cache {
        Ok(samples) => {
            let mut f = floor_figure(id, n, "ms", samples);
            f.baseline = Some(format!("change-floor/nftables/{n}"));
            results.push(f);
        }
        Err(e) => results.unavailable(id, format!("{e:#}")),
    }
    // The same cold-start operations loaded other ways.
    let text = concatenated(&dumps[cold])?;
    let scratch = ScratchDir::new("bench-nftvar")?;
    for budget in variant_budgets() {
        let files = if budget == usize::MAX {
            let p = scratch.path().join("one.nft");
            std::fs::write(&p, &text)?;
            vec![p]
        } else {
            write_parts(
                &text,
                budget,
                &scratch.path().join(format!("parts-{budget}")),
            )?
        };
        let id = variant_id(budget, n);
        match load_fresh(&files) {
            Ok(s) => {
                let mut f = floor_figure(id, n, "s", vec![s]);
                f.baseline = Some(format!("cold-floor/nftables/{n}"));
                results.push(f);
            }
            Err(e) => results.unavailable(id, format!("{e:#}")),
        }
    }
    Ok(())
}

/// `samples` timings (ms) of `nft -f` adding one `cluster-ips` element the table in `ns`
/// already holds (the first one the cold start's `dumps` add): nft dumps the table's chains
/// and sets into its cache as for any partial sync, and the commit is empty.
fn cache_floor(ns: &Netns, dumps: &[Dumped], samples: usize) -> anyhow::Result<Vec<f64>> {
    let text = concatenated(dumps)?;
    let line = text
        .lines()
        .find(|l| l.starts_with("add element ") && l.contains(" cluster-ips { "))
        .context("the cold start added no cluster-ips element")?;
    let scratch = ScratchDir::new("bench-nftcache")?;
    let file = scratch.path().join("noop.nft");
    std::fs::write(&file, format!("{line}\n"))?;
    (0..samples)
        .map(|_| Ok(timed_nft(ns, &file)?.as_secs_f64() * 1e3))
        .collect()
}

/// The `resync` group: see the module docs. Runs only when `nftables` is among the modes.
pub fn resync(plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    if !plan.modes.iter().any(|m| m == "nftables") {
        return Ok(());
    }
    let n = plan.resync_services;
    if let Err(e) = measure_resync(results, n) {
        results.unavailable(format!("resync/nftables/{n}"), format!("{e:#}"));
    }
    Ok(())
}

/// The restarted agent's first full sync: (its duration from the agent's metrics, s).
fn full_sync_seconds(node: &Netns) -> Option<f64> {
    let (_, body) = kproxy_tests::agentproc::http_get(node, 10249, "/metrics")?;
    let value = |name: &str| -> Option<f64> {
        body.lines()
            .find(|l| l.starts_with(name) && l.contains("IPv4"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    };
    let count = value("kubeproxy_sync_full_proxy_rules_duration_seconds_count{")?;
    (count >= 1.0)
        .then(|| value("kubeproxy_sync_full_proxy_rules_duration_seconds_sum{"))
        .flatten()
}

fn measure_resync(results: &mut Results, n: u32) -> anyhow::Result<()> {
    let topo = kproxy_tests::topology::TopologySpec::new("bench-resync")
        .local_pods(3)
        .build()?;
    let mut topo = topo;
    topo.pod_mut("pod-l1").serve(&[])?;
    let set = ServiceSet {
        count: n,
        endpoints_per_service: 1,
        target_backends: vec![topo.pod("pod-l1").ip],
        node_ip: kproxy_tests::topology::NODE_IP,
    };
    let scratch = ScratchDir::new("bench-resync")?;
    let manifests = scratch.path().join("services.yaml");
    std::fs::write(&manifests, set.manifests())?;
    let spec = |log: &str| AgentSpec {
        mode: "nftables",
        node: &topo.node,
        source: Source::Manifests(manifests.clone()),
        cgroup: None,
        bpffs: None,
        log: scratch.path().join(log),
    };
    let client = &topo.pod("pod-l0").ns;
    let vip = set.target_addr();
    let first = spec("first.log");
    let mut agent = first.start()?;
    let answered = agent
        .wait_answer(client, None, &vip, None, Duration::from_secs(1800))
        .map_err(anyhow::Error::msg)?;
    let cold = answered.duration_since(agent.started)?.as_secs_f64();
    // Every sync of the first agent is done once its full sync's metric is there.
    let deadline = Instant::now() + Duration::from_secs(600);
    while full_sync_seconds(&topo.node).is_none() {
        anyhow::ensure!(Instant::now() < deadline, "no full sync in the metrics");
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(agent);
    let second = spec("second.log");
    let mut agent = second.start()?;
    let deadline = Instant::now() + Duration::from_secs(3600);
    let resync = loop {
        if let Some(s) = full_sync_seconds(&topo.node) {
            break s;
        }
        agent.check_alive().map_err(anyhow::Error::msg)?;
        anyhow::ensure!(Instant::now() < deadline, "no full sync within an hour");
        std::thread::sleep(Duration::from_millis(200));
    };
    agent.check_alive().map_err(anyhow::Error::msg)?;
    let rss = agent.peak_rss_mb()?;
    drop(agent);
    let fig =
        |id: String, unit: &str, samples: Vec<f64>| nft_figure("resync", id, n, unit, samples);
    results.push(fig(
        format!("resync-cold/nftables/{n}"),
        "min",
        vec![cold / 60.0],
    ));
    let mut f = fig(format!("resync/nftables/{n}"), "min", vec![resync / 60.0]);
    f.baseline = Some(format!("resync-floor/nftables/{n}"));
    f.target = (n >= 40_000).then(|| Target {
        max_ratio: Some(1.2),
        max_value: Some(5.0),
        text: "full resync 40k×1 in minutes (≤ 5 min, ≤ 1.2× floor; upstream 16 min 44 s at 44k)"
            .into(),
    });
    results.push(f);
    results.push(fig(format!("resync-rss/nftables/{n}"), "MB", vec![rss]));
    // The floor: the first agent's transactions replayed, then the second's timed.
    let first_dumps = read_dumps(&dump_dir(&first.log))?;
    let second_dumps = read_dumps(&dump_dir(&second.log))?;
    let (full, resync_range) = syncs(&second_dumps)
        .first()
        .cloned()
        .context("the restarted agent dumped no sync")?;
    anyhow::ensure!(full, "the restarted agent's first sync was not full");
    let ns = Netns::new("bench-resyncfloor")?;
    let cold_times = replay(&ns, &first_dumps)?;
    let times = replay(&ns, &second_dumps[resync_range.clone()])?;
    drop(ns);
    let sum = |t: &[Option<Duration>]| t.iter().flatten().map(Duration::as_secs_f64).sum::<f64>();
    results.push(fig(
        format!("resync-cold-floor/nftables/{n}"),
        "min",
        vec![sum(&cold_times) / 60.0],
    ));
    results.push(fig(
        format!("resync-floor/nftables/{n}"),
        "min",
        vec![sum(&times) / 60.0],
    ));
    if std::env::var_os("KP_BENCH_NFT_RESYNC_ONE_TX").is_some() {
        // Upstream's way: the same resync operations as one transaction.
        let ns = Netns::new("bench-resyncone")?;
        replay(&ns, &first_dumps)?;
        let one = scratch.path().join("resync-one.nft");
        std::fs::write(&one, concatenated(&second_dumps[resync_range])?)?;
        let t = timed_nft(&ns, &one)?.as_secs_f64();
        let mut f = fig(
            format!("resync-floor-one-tx/nftables/{n}"),
            "min",
            vec![t / 60.0],
        );
        f.baseline = Some(format!("resync-floor/nftables/{n}"));
        results.push(f);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_parse() {
        assert_eq!(
            parse_header("# nft -f: 12.5 ms, ok, full sync part 2 of 3"),
            Some((
                12.5,
                true,
                Kind::Sync {
                    full: true,
                    i: 2,
                    k: 3
                }
            ))
        );
        assert_eq!(
            parse_header("# nft -f: 1.000 ms, failed, transaction"),
            Some((1.0, false, Kind::Other))
        );
        assert_eq!(parse_header("add table ip kube-proxy"), None);
    }

    fn dumped(kind: Kind) -> Dumped {
        Dumped {
            path: PathBuf::new(),
            agent_ms: 1.0,
            ok: true,
            kind,
        }
    }

    #[test]
    fn syncs_group_their_parts() {
        let part = |full, i, k| dumped(Kind::Sync { full, i, k });
        let d = vec![
            part(true, 1, 3),
            part(true, 2, 3),
            part(true, 3, 3),
            dumped(Kind::Other),
            part(false, 1, 1),
            part(false, 1, 1),
        ];
        assert_eq!(syncs(&d), vec![(true, 0..3), (false, 4..5), (false, 5..6)]);
    }

    #[test]
    fn a_full_sync_text_is_cut_at_service_ports_only() {
        let text = "\
add table ip kube-proxy
add chain ip kube-proxy services
flush chain ip kube-proxy services
add chain ip kube-proxy endpoint-A-ns/a/tcp/p__1.1.1.1/80
flush chain ip kube-proxy endpoint-A-ns/a/tcp/p__1.1.1.1/80
add chain ip kube-proxy service-A-ns/a/tcp/p
flush chain ip kube-proxy service-A-ns/a/tcp/p
add element ip kube-proxy cluster-ips { 172.30.0.1 }
add rule ip kube-proxy endpoint-A-ns/a/tcp/p__1.1.1.1/80 meta l4proto tcp dnat to 1.1.1.1:80
add chain ip kube-proxy endpoint-B-ns/b/tcp/p__1.1.1.2/80
flush chain ip kube-proxy endpoint-B-ns/b/tcp/p__1.1.1.2/80
add element ip kube-proxy cluster-ips { 172.30.0.2 }
flush chain ip kube-proxy service-C-ns/c/tcp/p
";
        let tx = parse(text).unwrap();
        assert_eq!(port_starts(&tx.ops), vec![3, 9]);
        let dir = ScratchDir::new("nft-parts-test").unwrap();
        let files = write_parts(text, 1, &dir.path().join("p")).unwrap();
        let parts: Vec<String> = files
            .iter()
            .map(|f| std::fs::read_to_string(f).unwrap())
            .collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts.concat(), text);
        assert!(parts[2].starts_with("add chain ip kube-proxy endpoint-B"));
    }
}
