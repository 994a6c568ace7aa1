//! Wires one agent together: a source, the tracker, the sync runner and a datapath.
//!
//! `main.rs` turns the command line and config file into [`AgentOptions`]; everything below
//! takes explicit values so tests can run an agent in-process.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tracing::info;

use crate::dataplane::Dataplane;
use crate::model::{ModelWarning, Snapshot, Tracker};
use crate::source::{self, Event};
use crate::sync::{Runner, RunnerConfig, RunnerStatus};

/// Where the cluster state comes from.
#[derive(Debug, Clone)]
pub enum SourceSpec {
    /// `--manifests PATH`: a file or directory of YAML.
    Manifests(PathBuf),
    /// The API server: `--kubeconfig`, `--master`, else in-cluster / default kubeconfig.
    Kube {
        kubeconfig: Option<PathBuf>,
        master: Option<String>,
    },
}

/// Everything an agent needs besides its datapath.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub node_name: String,
    pub source: SourceSpec,
    pub runner: RunnerConfig,
}

/// Capacity of the source → runner event channel (sources wait when the runner is busy).
const EVENT_QUEUE: usize = 1024;

/// Starts the source for `spec`, sending into `tx`.
pub async fn start_source(
    spec: &SourceSpec,
    node_name: &str,
    tx: mpsc::Sender<Event>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    Ok(match spec {
        SourceSpec::Manifests(path) => {
            info!(path = %path.display(), "standalone mode: reading services from manifests");
            source::manifests::spawn(path.clone(), node_name.to_owned(), tx)
        }
        SourceSpec::Kube { kubeconfig, master } => {
            let client = source::kube::client(kubeconfig.as_deref(), master.as_deref()).await?;
            source::kube::spawn(client, node_name.to_owned(), tx)
        }
    })
}

/// A running agent: its status, and the task that returns the datapath when it stops.
pub struct Agent {
    pub status: watch::Receiver<RunnerStatus>,
    pub task: tokio::task::JoinHandle<Box<dyn Dataplane>>,
    source: tokio::task::JoinHandle<()>,
}

impl Agent {
    /// Starts the source and the sync loop; the loop stops when `shutdown` resolves.
    pub async fn start(
        opts: AgentOptions,
        dataplane: Box<dyn Dataplane>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<Agent> {
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        let source = start_source(&opts.source, &opts.node_name, tx).await?;
        let runner = Runner::new(opts.runner, Tracker::new(opts.node_name.clone()), dataplane);
        let status = runner.status();
        let task = tokio::spawn(runner.run(rx, shutdown));
        Ok(Agent {
            status,
            task,
            source,
        })
    }

    /// Waits for the sync loop to stop; stops the source; returns the (still programmed) datapath.
    pub async fn wait(self) -> anyhow::Result<Box<dyn Dataplane>> {
        let dp = self.task.await?;
        self.source.abort();
        Ok(dp)
    }
}

/// Reads manifests once and builds the snapshot they describe (for `kproxy render`).
/// Returns the snapshot and every problem found (manifest documents and model warnings).
pub fn snapshot_from_manifests(
    path: &std::path::Path,
    node_name: &str,
) -> anyhow::Result<(Arc<Snapshot>, Vec<String>)> {
    let (m, errors) = source::manifests::read(path)
        .map_err(|e| anyhow::anyhow!("cannot read manifests {}: {e}", path.display()))?;
    let mut problems: Vec<String> = errors.iter().map(ToString::to_string).collect();
    let mut tracker = Tracker::new(node_name);
    for ev in source::manifests::events(m, node_name) {
        problems.extend(tracker.apply(ev).iter().map(ModelWarning::to_string));
    }
    let (snap, _) = tracker.snapshot();
    Ok((snap, problems))
}
