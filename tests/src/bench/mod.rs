//! `cargo xtask bench`: kproxy's performance figures, each measured beside its baseline in the
//! same run (absolute times on a shared 2-core machine are noise; ratios are the result).
//!
//! The measuring runs in the `kp-bench` binary of this package (it needs the test topology,
//! the fake API server and root); `xtask bench` builds it and the agent in release mode and
//! runs it. What it measures:
//!
//! | group | figure | baseline |
//! |---|---|---|
//! | [`packet`] | `BPF_PROG_TEST_RUN` ns/packet of each datapath program path, at 1 → 100k services | the counter-only XDP program |
//! | [`connect`] | TCP connect latency pod → ClusterIP (≥ 2,000 connects), requests/s keep-alive and short, per mode, at 1 and 10k services | the same from the pod directly to the backend pod |
//! | [`maglev`] | Maglev table build and one-change sync at 1k backends (ms) | the same sync in random mode |
//! | [`control`] | cold start (agent exec → the last service answers) with N services × 5 endpoints through the fake API server; one endpoint change (API write → a connection reaches the new backend), per mode; agent peak RSS and CPU seconds | the project's targets |
//!
//! A mode the agent cannot run (not built yet, or the kernel lacks it) is listed under
//! "unavailable" with the agent's own error, never silently dropped. Output ([`report`]):
//! `REPORT.md`, `results.json` (commit, machine, every sample) and SVG plots.

pub mod agent;
pub mod connect;
pub mod control;
pub mod maglev;
pub mod packet;
pub mod report;
pub mod services;
pub mod stats;
pub mod tc_path;

use serde::{Deserialize, Serialize};

/// What one run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Results {
    pub commit: String,
    pub started_unix: u64,
    pub duration_s: f64,
    pub quick: bool,
    pub machine: Machine,
    pub figures: Vec<Figure>,
    pub unavailable: Vec<Unavailable>,
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

impl Results {
    pub fn figure(&self, id: &str) -> Option<&Figure> {
        self.figures.iter().find(|f| f.id == id)
    }
    pub fn unavailable(&mut self, id: impl Into<String>, reason: impl std::fmt::Display) {
        let (id, reason) = (id.into(), reason.to_string());
        eprintln!("kp-bench: {id}: unavailable: {reason}");
        self.unavailable.push(Unavailable { id, reason });
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

/// Sizes of one run: `--quick` (under 3 minutes) or full (under 15 minutes on 2 cores).
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
    /// Modes to run the agent in.
    pub modes: Vec<String>,
}

impl Plan {
    pub fn new(quick: bool) -> Plan {
        let modes = vec!["ebpf".to_string(), "iptables".to_string()];
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
                modes,
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
                modes,
            }
        }
    }

    /// How many samples each figure id of this plan holds (checked by the smoke test).
    pub fn expected_samples(&self, figure: &Figure) -> usize {
        match figure.group.as_str() {
            "packet" => self.packet_samples,
            "connect" => self.connects as usize,
            "rps" => 1,
            "cold-start" => 1,
            "change" => self.changes as usize,
            "resources" => 1,
            "maglev" => maglev::samples(self),
            _ => 0,
        }
    }
}
