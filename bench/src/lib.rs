//! `cargo xtask bench`: kproxy's performance figures, each measured beside its baseline in the
//! same run (absolute times on a shared 2-core machine are noise; ratios are the result).
//!
//! The measuring runs in the `kp-bench` binary of this package (it needs the test topology,
//! the fake API server and root); `xtask bench` builds it and the agent in release mode and
//! runs it. This crate is `bench/` of the repository: the code in `src/`, beside the report a
//! full run writes there and the repository keeps (`REPORT.md`, `results.json`, the SVG plots,
//! `README-section.md`). What it measures:
//!
//! | group | figure | baseline |
//! |---|---|---|
//! | [`packet`] | `BPF_PROG_TEST_RUN` ns/packet of each datapath program path, at 1 → 100k services | the counter-only XDP program |
//! | [`connect`] | TCP connect latency pod → ClusterIP (≥ 2,000 connects), requests/s keep-alive and short, per mode, at 1 and 10k services, in 10 rounds each after the same number of direct connects (`connect-direct/<mode>`) and, for the netfilter modes, of floor connects (`connect-floor/<mode>`: the same pod → a ClusterIP that one nftables DNAT rule translates, no proxier) | the direct connects measured alongside: the same pod directly to the backend pod |
//! | [`maglev`] | Maglev table build and one-change sync at 1k backends (ms) | the same sync in random mode |
//! | [`throughput`] | real packets: the external client floods a UDP NodePort (60-byte frames with complete checksums, 1,024 flows by source port) toward two backends behind the second node. Generator ([`flood`]): in-kernel, `BPF_PROG_TEST_RUN` in live-frames mode (`BPF_F_TEST_XDP_LIVE_FRAMES`) of a small XDP program that writes the headers, picks a flow at random and redirects into the client's veth, so the frames reach the node's device as XDP frames, the way a NIC driver hands them over (`KP_BENCH_THROUGHPUT_GEN=af-packet` sends skbs from an `AF_PACKET` socket instead). Delivered packets/s counted at the backends (an nftables counter-and-drop in each pod, matching the translated address and port) and CPU ns per delivered packet (the generator thread's CPU, which carries the softirq work of the whole veth path, plus `ksoftirqd`'s), and the node's own share of it (its median minus that of the `floor` mode: the same flood started at the node's link to the second node), per datapath: kproxy XDP (`--bpf-xdp=native`, fast path switched on for the veths, proven by its counters: ≥ 90 % of the delivered packets forwarded by XDP), kproxy TC (`--bpf-xdp=off`), iptables-nft, iptables-legacy, nftables; every link end with GRO (a NAPI ring) in every mode; modes sampled in interleaved rounds | packets/s: plain routing to the pod IPs (the ceiling); CPU/packet and the node's share: iptables-nft |
//! | [`control`] | cold start (agent exec → the last service answers) with N services × 5 endpoints through the fake API server; one endpoint change (API write → a connection reaches the new backend), per mode; agent peak RSS and CPU seconds | the project's targets; for iptables and nftables also the floor: the same kernel work alone (`iptables-restore` / `nft -f` of the agent's own input) |
//! | [`nftables`] (in `control`) | the nftables agent's own transactions replayed with `nft -f` into a fresh namespace: cold start and each change (the floors), and the cold start's operations loaded other ways (one transaction as upstream, parts of other sizes) | the agent's figures; the agent's own loading |
//! | `resync` ([`nftables::resync`]) | nftables full resync: the agent restarted over its own table of 40k services × 1 endpoint (its first sync is full), from the agent's full-sync metric, in minutes | the replay of that sync's transactions onto the same table; upstream's 16 min 44 s at 44k |
//! | [`soak`] | a few thousand services under minutes of endpoint churn with traffic (ebpf, iptables-nft): RSS, fds, map fill at start / peak / end, time to converge after the last change, failed probe connections | no growth that does not come back |
//! | [`inspect`] | `kproxy inspect` wall and CPU seconds at 100k services (ebpf) | ≤ 10 s |
//! | [`iptables_foreign`] | iptables cold start and one endpoint change with another program's nat rule in the node, per backend, in interleaved rounds | the same without the rule |
//!
//! `soak`, `inspect` and `iptables-foreign` run in a full run and when `--only` names them (with `--quick`, their
//! shorter variants), not in a plain `--quick` run.
//!
//! A figure derived from two measured ones (the node's share of `throughput`, the repeat-mode
//! ns per run of [`packet`]) is the difference of their medians ([`stats::difference`]), never
//! a difference per sample; where that is not positive the figure is "unavailable", drowned
//! in noise.
//!
//! A mode the agent cannot run (not built yet, or the kernel lacks it) is listed under
//! "unavailable" with the agent's own error, never silently dropped. Output ([`report`]):
//! `REPORT.md`, `results.json` (commit, machine, every sample) and SVG plots.
//!
//! Knobs for investigating (environment variables of `cargo xtask bench` / `kp-bench`; a full
//! run for the report sets none of them):
//!
//! | variable | effect |
//! |---|---|
//! | `KP_BENCH_MODES` | comma-separated datapath modes to measure (e.g. `ebpf` or `ebpf,iptables-nft`) instead of `ebpf,iptables-nft,iptables-legacy`; a figure of a mode left out is simply missing, not "unavailable" |
//! | `KP_BENCH_AGENT_LOG` | the agents' `RUST_LOG` (default `warn`), e.g. `info` to see where the agent's cold start goes (initial list vs first sync) |
//! | `KP_BENCH_PACKET_SCALES` | the [`packet`] group's service counts (comma-separated) instead of the plan's |
//! | `KP_BENCH_PACKET_PATHS` | the [`packet`] group's datapath programs: `tc`, `xdp` or both (default) |
//! | `KP_BENCH_SOAK_SERVICES`, `KP_BENCH_SOAK_SECONDS` | the [`soak`] group's service count and churn duration instead of the plan's |
//! | `KP_BENCH_NFT_VARIANTS` | the cold-start loading variants of [`nftables`]: comma-separated operation budgets per part, `one` for one transaction (default `one,5000,80000`; empty: none) |
//! | `KP_BENCH_NFT_RESYNC_ONE_TX` | set: the `resync` group also loads the resync's operations as one transaction, upstream's way (at 40k this takes many minutes) |
//! | `KP_BENCH_KEEP_LOG` | a path prefix: the [`control`] group copies each agent's log to `<prefix>-<mode>-<services>.log` (nftables: and the transactions it ran to `<prefix>-nftables-<services>-nft-dump/`), the [`soak`] group to `<prefix>-soak-<mode>-<services>.log` (the prefix's directory must exist; the scratch dir holding the log is removed at the end) |
//! | `KP_BENCH_THROUGHPUT_GEN` | the [`throughput`] group's generator: `xdp-live` (default) or `af-packet` |

pub mod agent;
pub mod cli;
pub mod connect;
pub mod control;
pub mod flood;
pub mod inspect;
pub mod iptables_foreign;
pub mod maglev;
pub mod nftables;
pub mod packet;
pub mod report;
pub mod services;
pub mod soak;
pub mod stats;
pub mod tc_path;
pub mod throughput;

use serde::{Deserialize, Serialize};

/// What one run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Results {
    pub commit: String,
    pub started_unix: u64,
    pub duration_s: f64,
    pub quick: bool,
    /// The groups `--only` asked for (`None`: every group of the run's size).
    #[serde(default)]
    pub only: Option<String>,
    pub machine: Machine,
    pub figures: Vec<Figure>,
    pub unavailable: Vec<Unavailable>,
    /// Wall seconds per group of this run (`packet`, `connect`, `control`, `ipvs-guest`).
    #[serde(default)]
    pub group_seconds: std::collections::BTreeMap<String, f64>,
    /// The figures measured in the QEMU guest (`cargo xtask bench --ipvs-guest`), if merged.
    #[serde(default)]
    pub guest: Option<GuestRun>,
    /// How each derived figure of [`Results::figures`] was computed ([`Results::push_difference`]).
    #[serde(default)]
    pub derived: Vec<Derivation>,
}

/// A figure derived from two figures of the same run: `median(of) − median(minus)`
/// ([`stats::difference`]), its one sample. Its spread is that of its two figures' samples
/// (the report shows the per-round differences where they were sampled in the same rounds).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Derivation {
    pub id: String,
    pub of: String,
    pub minus: String,
}

/// A run of the ipvs figures inside the TCG guest (the host kernel has no IPVS), merged into
/// the host run's results: its figures sit beside the host's, compared only with the baseline
/// measured in the same guest.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GuestRun {
    pub commit: String,
    pub kernel: String,
    pub accel: String,
    /// Wall seconds of the whole `--ipvs-guest` run (build excluded, boot included).
    pub duration_s: f64,
    /// Ids of the figures measured in the guest.
    pub figure_ids: Vec<String>,
    /// Service count of the guest's cold start / one change (reduced when TCG is too slow for
    /// 10k in the time budget).
    pub cold_services: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    pub kernel: String,
    pub cpus: usize,
    pub memory_gib: f64,
    pub cpu_model: String,
}

/// One measured figure with every sample.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    /// Unique, e.g. `connect/iptables/10000`.
    pub id: String,
    pub group: String,
    /// Datapath mode, or `baseline`.
    pub mode: String,
    /// Services programmed while measuring (0 where it does not apply).
    pub services: u32,
    /// `ns`, `us`, `ms`, `req/s`, `MB`, `s`.
    pub unit: String,
    pub samples: Vec<f64>,
    /// The id of the figure this one is compared with (same run).
    pub baseline: Option<String>,
    pub target: Option<Target>,
}

/// A project target for a figure: its median must be at most `max_ratio` × the baseline's
/// median, or at most `max_value` in the figure's unit.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Target {
    pub max_ratio: Option<f64>,
    pub max_value: Option<f64>,
    pub text: String,
}

/// A figure that could not be measured, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Unavailable {
    pub id: String,
    pub reason: String,
}

/// Lines around the results JSON a guest run prints on its output port.
pub const GUEST_JSON_BEGIN: &str = "kp-bench-guest-json-begin";
pub const GUEST_JSON_END: &str = "kp-bench-guest-json-end";

/// The JSON between [`GUEST_JSON_BEGIN`] and [`GUEST_JSON_END`] in a guest's output.
pub fn guest_json(output: &str) -> Option<&str> {
    let start = output.find(GUEST_JSON_BEGIN)? + GUEST_JSON_BEGIN.len();
    let end = output[start..].find(GUEST_JSON_END)? + start;
    Some(output[start..end].trim())
}

impl Results {
    /// Adds a guest run's figures (replacing an earlier guest run's, and the host's
    /// "unavailable" entries for the modes the guest measured).
    pub fn merge_guest(&mut self, guest: Results, accel: &str, seconds: f64) {
        if let Some(old) = self.guest.take() {
            self.figures.retain(|f| !old.figure_ids.contains(&f.id));
        }
        let mode_of = |id: &str| id.split('/').nth(1).unwrap_or_default().to_string();
        let guest_modes: Vec<String> = guest
            .figures
            .iter()
            .map(|f| f.mode.clone())
            .filter(|m| m != "baseline")
            .chain(guest.unavailable.iter().map(|u| mode_of(&u.id)))
            .collect();
        self.unavailable
            .retain(|u| !guest_modes.contains(&mode_of(&u.id)));
        let figure_ids = guest.figures.iter().map(|f| f.id.clone()).collect();
        let cold_services = guest
            .figures
            .iter()
            .find(|f| f.group == "cold-start")
            .map_or(0, |f| f.services);
        self.figures.extend(guest.figures);
        self.unavailable.extend(guest.unavailable);
        self.group_seconds.insert("ipvs-guest".into(), seconds);
        self.guest = Some(GuestRun {
            commit: guest.commit,
            kernel: guest.machine.kernel,
            accel: accel.into(),
            duration_s: seconds,
            figure_ids,
            cold_services,
        });
    }

    /// Whether `id` was measured in the guest.
    pub fn in_guest(&self, id: &str) -> bool {
        self.guest
            .as_ref()
            .is_some_and(|g| g.figure_ids.iter().any(|x| x == id))
    }

    pub fn figure(&self, id: &str) -> Option<&Figure> {
        self.figures.iter().find(|f| f.id == id)
    }
    pub fn unavailable(&mut self, id: impl Into<String>, reason: impl std::fmt::Display) {
        let (id, reason) = (id.into(), reason.to_string());
        eprintln!("kp-bench: {id}: unavailable: {reason}");
        self.unavailable.push(Unavailable { id, reason });
    }
    /// Pushes `figure` (its samples ignored) derived from the figures `of` and `minus` of this
    /// run, already pushed: its one sample the difference of their medians
    /// ([`stats::difference`]); "unavailable" when that is drowned in noise or a figure is
    /// missing.
    pub fn push_difference(&mut self, mut figure: Figure, of: &str, minus: &str) {
        let (Some(a), Some(b)) = (self.figure(of), self.figure(minus)) else {
            return self.unavailable(figure.id, format!("{of} or {minus} was not measured"));
        };
        match stats::difference(&a.samples, &b.samples) {
            Ok(d) => {
                figure.samples = vec![d];
                self.derived.push(Derivation {
                    id: figure.id.clone(),
                    of: of.into(),
                    minus: minus.into(),
                });
                self.push(figure);
            }
            Err(e) => self.unavailable(figure.id, format!("{of} − {minus}: {e}")),
        }
    }

    /// How figure `id` was derived, if it was.
    pub fn derivation(&self, id: &str) -> Option<&Derivation> {
        self.derived.iter().find(|d| d.id == id)
    }

    pub fn push(&mut self, figure: Figure) {
        let s = stats::Summary::of(&figure.samples);
        eprintln!(
            "kp-bench: {}: median {:.3} {} (n={})",
            figure.id, s.median, figure.unit, s.n
        );
        self.figures.push(figure);
    }
}

/// Sizes of one run: `--quick` (under 3 minutes) or full (about 15 minutes on 2 cores, plus ≈ 20
/// for the `soak` and `inspect` groups).
#[derive(Debug, Clone)]
pub struct Plan {
    pub quick: bool,
    /// Service counts of the per-packet scale series.
    pub packet_scales: Vec<u32>,
    /// BPF_PROG_TEST_RUN repeat per sample, and samples per figure.
    pub packet_repeat: u32,
    pub packet_samples: usize,
    /// Service counts of the connect series.
    pub connect_scales: Vec<u32>,
    pub connects: u32,
    pub rps_seconds: u32,
    /// Services (× 5 endpoints) of the cold start; endpoint changes measured.
    pub cold_services: u32,
    pub changes: u32,
    /// Services (× 1 endpoint) of the nftables full resync ([`nftables::resync`]).
    pub resync_services: u32,
    /// Modes to run the agent in: `ebpf`, `iptables-nft`, `iptables-legacy` (the iptables
    /// mode on each backend), `nftables`, `ipvs`.
    pub modes: Vec<String>,
    /// [`throughput`]: seconds per sample, samples per mode, UDP flows (source ports) flooded.
    pub throughput_seconds: f64,
    pub throughput_samples: usize,
    pub throughput_flows: u16,
    /// Name of the direct-connect baseline in figure ids: `direct` on the host,
    /// `direct-guest` in the guest.
    pub direct: String,
}

impl Plan {
    pub fn new(quick: bool) -> Plan {
        let modes: Vec<String> = match std::env::var("KP_BENCH_MODES") {
            Ok(m) => m.split(',').map(String::from).collect(),
            Err(_) => ["ebpf", "iptables-nft", "iptables-legacy", "nftables"]
                .map(String::from)
                .to_vec(),
        };
        let direct = "direct".to_string();
        if quick {
            Plan {
                quick,
                packet_scales: vec![1, 1_000],
                packet_repeat: 20_000,
                packet_samples: 5,
                connect_scales: vec![1, 1_000],
                connects: 300,
                rps_seconds: 1,
                cold_services: 1_000,
                changes: 10,
                throughput_seconds: 1.0,
                throughput_samples: 3,
                throughput_flows: 1024,
                resync_services: 2_000,
                modes,
                direct,
            }
        } else {
            Plan {
                quick,
                packet_scales: vec![1, 1_000, 10_000, 100_000],
                packet_repeat: 200_000,
                packet_samples: 10,
                connect_scales: vec![1, 10_000],
                connects: 2_000,
                rps_seconds: 3,
                cold_services: 10_000,
                changes: 50,
                throughput_seconds: 2.0,
                throughput_samples: 7,
                throughput_flows: 1024,
                resync_services: 40_000,
                modes,
                direct,
            }
        }
    }

    /// The ipvs figures inside the QEMU TCG guest (`cargo xtask bench --ipvs-guest`): the
    /// issue's sample counts (2,000 connects, 50 changes) but at 1 and 1k services × 5, not
    /// 10k: under TCG the agent did not finish programming 10k services into IPVS within
    /// 180 s (measured), which does not fit the time budget.
    pub fn ipvs_guest() -> Plan {
        Plan {
            quick: false,
            packet_scales: vec![],
            packet_repeat: 0,
            packet_samples: 0,
            connect_scales: vec![1, 1_000],
            connects: 2_000,
            rps_seconds: 2,
            cold_services: 1_000,
            changes: 50,
            throughput_seconds: 0.0,
            throughput_samples: 0,
            throughput_flows: 0,
            resync_services: 0,
            modes: vec!["ipvs".into()],
            direct: "direct-guest".into(),
        }
    }

    /// How many samples each figure id of this plan holds (checked by the smoke test).
    pub fn expected_samples(&self, figure: &Figure) -> usize {
        match figure.group.as_str() {
            "packet" => self.packet_samples,
            "connect" | "connect-direct" | "connect-floor" => self.connects as usize,
            "rps" => 1,
            "cold-start" => 1,
            "change" => self.changes as usize,
            "resources" => 1,
            // See `control`: partial restores once per change (5–20), two whole-table ones.
            "restore-floor" if figure.id.starts_with("cold-floor/") => 2,
            "restore-floor" => self.changes.clamp(5, 20) as usize,
            "maglev" => maglev::samples(self),
            "throughput" | "throughput-cpu" => self.throughput_samples,
            // Derived: the difference of two figures' medians (`Results::push_difference`).
            "throughput-node" => 1,
            "nft-floor" | "resync" => nftables::samples(self, figure),
            iptables_foreign::GROUP if figure.id.starts_with("cold-start-") => {
                iptables_foreign::ROUNDS
            }
            iptables_foreign::GROUP => {
                iptables_foreign::ROUNDS * iptables_foreign::changes_per_round(self) as usize
            }
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fig(id: &str, group: &str, mode: &str, baseline: Option<&str>, v: f64) -> Figure {
        Figure {
            id: id.into(),
            group: group.into(),
            mode: mode.into(),
            services: id.rsplit('/').next().unwrap().parse().unwrap_or(0),
            unit: "us".into(),
            samples: vec![v, v],
            baseline: baseline.map(String::from),
            target: None,
        }
    }

    fn host() -> Results {
        let mut r = Results {
            commit: "host".into(),
            ..Default::default()
        };
        r.figures
            .push(fig("connect/direct/1", "connect", "baseline", None, 10.0));
        r.figures.push(fig(
            "connect/iptables-nft/1",
            "connect",
            "iptables-nft",
            Some("connect/direct/1"),
            12.0,
        ));
        r.unavailable("connect/ipvs/1", "no IPVS here");
        r.unavailable("cold-start/ipvs/1000", "no IPVS here");
        r.unavailable("connect/ebpf/1", "something else");
        r
    }

    fn guest(v: f64) -> Results {
        let mut g = Results {
            commit: "guest".into(),
            machine: Machine {
                kernel: "6.1.0-guest".into(),
                ..Default::default()
            },
            ..Default::default()
        };
        g.figures.push(fig(
            "connect/direct-guest/1",
            "connect",
            "baseline",
            None,
            100.0,
        ));
        g.figures.push(fig(
            "connect/ipvs/1",
            "connect",
            "ipvs",
            Some("connect/direct-guest/1"),
            v,
        ));
        g.unavailable("cold-start/ipvs/1000", "guest too slow");
        g
    }

    #[test]
    fn guest_figures_replace_the_hosts_ipvs_gaps_and_an_earlier_guest_run() {
        let mut r = host();
        r.merge_guest(guest(110.0), "tcg", 300.0);
        let ids: Vec<&str> = r.figures.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "connect/direct/1",
                "connect/iptables-nft/1",
                "connect/direct-guest/1",
                "connect/ipvs/1"
            ]
        );
        let gaps: Vec<(&str, &str)> = r
            .unavailable
            .iter()
            .map(|u| (u.id.as_str(), u.reason.as_str()))
            .collect();
        assert_eq!(
            gaps,
            [
                ("connect/ebpf/1", "something else"),
                ("cold-start/ipvs/1000", "guest too slow")
            ]
        );
        assert!(r.in_guest("connect/ipvs/1") && !r.in_guest("connect/direct/1"));
        let g = r.guest.clone().unwrap();
        assert_eq!(
            (g.kernel.as_str(), g.accel.as_str()),
            ("6.1.0-guest", "tcg")
        );
        assert_eq!(r.group_seconds["ipvs-guest"], 300.0);
        let ratio = report::ratio(&r, r.figure("connect/ipvs/1").unwrap()).unwrap();
        assert!((ratio - 1.1).abs() < 1e-9, "{ratio}");

        // A second guest run replaces the first one's figures.
        r.merge_guest(guest(150.0), "tcg", 200.0);
        assert_eq!(r.figures.len(), 4);
        assert_eq!(r.figure("connect/ipvs/1").unwrap().samples, [150.0, 150.0]);
        assert_eq!(r.unavailable.len(), 2);

        let md = report::markdown(&r);
        assert!(md.contains("`connect/ipvs/1` †"), "{md}");
        assert!(md.contains("| | iptables-nft | ipvs |"), "{md}");
        assert!(md.contains("QEMU guest (tcg), kernel 6.1.0-guest"), "{md}");
    }

    #[test]
    fn guest_json_is_found_between_the_markers() {
        let out = format!("boot\n{GUEST_JSON_BEGIN}\n{{\"a\":1}}\n{GUEST_JSON_END}\nbye\n");
        assert_eq!(guest_json(&out), Some("{\"a\":1}"));
        assert_eq!(guest_json("no markers"), None);
    }
}
