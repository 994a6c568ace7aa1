//! The `kproxy` binary: parse the command line (kube-proxy's flags), load the configuration,
//! then run the agent, `render`, `cleanup`, `--write-config-to` or `--version`.
//!
//! Exit codes: 0 on success (and after SIGTERM/SIGINT), 1 for a bad configuration or a runtime
//! failure (message on stderr), 2 for a malformed command line (clap's usage error).
//!
//! SIGTERM / SIGINT stop the sync loop and exit 0, leaving the datapath programmed so service
//! traffic keeps flowing until the next kproxy (or `kproxy cleanup`) takes over — as upstream
//! kube-proxy does.

use std::process::ExitCode;

use anyhow::Context;
use kproxy::app::agent::Agent;
use kproxy::app::agent::AgentOptions;
use kproxy::app::logging;
use kproxy::app::{build, modes};
use kproxy::cli::{self, Command, Loaded, RenderOutput, VersionRequest};
use kproxy::config::{DetectLocal, LoggingConfig, ProxyConfig, SourceConfig};
use tracing::{info, warn};

fn main() -> ExitCode {
    limit_malloc_arenas();
    kproxy::app::process::fix_mmap_threshold();
    // Hidden: the user guide's configuration reference (`cargo xtask docs` writes it).
    if std::env::args_os().nth(1).is_some_and(|a| a == "reference") {
        print!("{}", cli::reference::markdown());
        return ExitCode::SUCCESS;
    }
    let inv = match cli::parse(std::env::args_os()) {
        Ok(inv) => inv,
        Err(e) => e.exit(),
    };
    match inv.version() {
        Ok(Some(v)) => {
            print_version(v);
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => return fail(&e),
    }
    let loaded = match cli::load(&inv, None) {
        Ok(l) => l,
        Err(e) => return fail(&e),
    };
    init_logging(loaded.config.logging);
    for w in &loaded.warnings {
        warn!("{w}");
    }
    let result = run(&loaded);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// One glibc malloc arena instead of up to 8 per core, before any thread starts.
///
/// The agent builds its state on tokio workers and frees it on the blocking sync thread (and
/// back); with an arena per thread, memory freed in one arena cannot serve allocations in
/// another, and a 10k-service agent held ≈ 150 MB in three arenas for ≈ 90 MB of live heap.
/// With one arena the same run peaks ≈ 35 MB lower (`cargo xtask bench --only control`,
/// `rss/ebpf/10000`). The agent allocates little on its hot paths, so the lost parallelism of
/// malloc costs nothing measurable. `MALLOC_ARENA_MAX` in the environment still wins.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets a malloc tunable; no threads exist yet.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

fn fail(e: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::FAILURE
}

fn print_version(v: VersionRequest) {
    let version = env!("CARGO_PKG_VERSION");
    match v {
        VersionRequest::Print => println!("kproxy v{version}"),
        VersionRequest::Raw => println!(
            "{}",
            serde_json::json!({"name": "kproxy", "gitVersion": format!("v{version}"), "platform": format!("{}/{}", std::env::consts::OS, std::env::consts::ARCH)})
        ),
    }
}

/// `--logging-format` selects the format; `-v` raises the level when `RUST_LOG` is unset
/// (klog verbosity ≥ 4 ⇒ debug, ≥ 6 ⇒ trace).
fn init_logging(cfg: LoggingConfig) {
    if std::env::var_os("RUST_LOG").is_none() && cfg.verbosity >= 4 {
        let level = if cfg.verbosity >= 6 { "trace" } else { "debug" };
        // SAFETY: called once at start-up, before the runtime or any other thread exists.
        unsafe { std::env::set_var("RUST_LOG", level) };
    }
    logging::init(cfg.format);
}

fn run(l: &Loaded) -> anyhow::Result<()> {
    if let Some(path) = &l.write_config_to {
        std::fs::write(path, l.effective.to_yaml())
            .with_context(|| format!("cannot write config to {}", path.display()))?;
        info!(file = %path.display(), "wrote configuration");
        return Ok(());
    }
    match l.command {
        Command::Render => render(l),
        Command::Inspect => {
            print!(
                "{}",
                kproxy::app::inspect::run(&l.config, l.output, l.service.as_deref())?
            );
            Ok(())
        }
        Command::Cleanup => {
            modes::cleanup_all(&l.config)?;
            info!("cleanup done");
            Ok(())
        }
        Command::Agent if l.init_only => {
            info!("--init-only: configuration valid; kproxy needs no separate initialization");
            Ok(())
        }
        Command::Agent => run_agent(&l.config),
    }
}

fn render(l: &Loaded) -> anyhow::Result<()> {
    let SourceConfig::Manifests(path) = &l.config.source else {
        anyhow::bail!("render needs --manifests PATH (a YAML file or directory)");
    };
    let (snap, problems) = kproxy::app::agent::snapshot_from_manifests(path, &l.config.node_name)?;
    for p in &problems {
        eprintln!("warning: {p}");
    }
    print!(
        "{}",
        match l.output {
            RenderOutput::Json => cli::render::json(&snap) + "\n",
            RenderOutput::Table => cli::render::table(&snap),
            RenderOutput::Plan => {
                let kproxy::config::ModeChoice::Forced(mode) = l.config.mode else {
                    unreachable!("the plan output is chosen only with --proxy-mode")
                };
                build::render_plan(mode, &l.config, &snap)?
            }
        }
    );
    Ok(())
}

fn run_agent(cfg: &ProxyConfig) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    rt.block_on(async {
        // NodeCIDR local-traffic detection needs the Node's podCIDRs before the datapath is
        // built (upstream waits for them too).
        let pod_cidrs = if cfg.detect_local == DetectLocal::NodeCidr {
            Some(
                kproxy::app::agent::wait_for_pod_cidrs(
                    &cfg.source.clone(),
                    &cfg.node_name,
                    kproxy::app::agent::NODE_POD_CIDR_TIMEOUT,
                )
                .await?,
            )
        } else {
            None
        };
        // Signal handlers from here on (while waiting above, SIGTERM simply ends the process).
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        let shutdown = async move {
            let sig = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            info!(signal = sig, "stopping; the datapath stays programmed");
        };
        let resync = kproxy::sync::SyncRequester::default();
        let bind = (!cfg.bind_address.is_unspecified()).then_some(cfg.bind_address);
        let mut cfg = cfg.clone();
        if cfg.node_port_addresses.may_be_primary(cfg.mode) {
            let ips = kproxy::app::agent::node_ips_at_start(
                &cfg.source,
                &cfg.node_name,
                bind,
                kproxy::app::agent::NODE_IPS_TIMEOUT,
            )
            .await;
            cfg.primary_node_ips = ips.known();
        }
        let cfg = &cfg;
        // A forced mode is built while the agent lists (see `start`); detection builds first,
        // since a mode that fails to build falls back to the next one (other metrics).
        let (built, mode, metrics) = match cfg.mode {
            kproxy::config::ModeChoice::Forced(mode) => {
                (None, mode, kproxy::observe::metrics::Metrics::new(mode))
            }
            kproxy::config::ModeChoice::Detect => {
                let (dp, metrics) = modes::select(
                    cfg.mode,
                    cfg,
                    pod_cidrs.as_deref().unwrap_or_default(),
                    &resync,
                )?;
                let mode = dp.mode();
                (Some(dp), mode, metrics)
            }
        };
        let mut opts = AgentOptions::new(
            cfg.node_name.clone(),
            cfg.source.clone(),
            cfg.runner_config(mode),
        );
        opts.healthz_bind = cfg.healthz_bind_address;
        opts.metrics_bind = cfg.metrics_bind_address;
        opts.bind_address = (!cfg.bind_address.is_unspecified()).then_some(cfg.bind_address);
        opts.node_port_addresses = build::node_port_cidrs(cfg, mode);
        if cfg.node_port_addresses.for_mode(mode) == kproxy::config::NodePortAddresses::Primary {
            opts.exit_on_node_ips_change = Some(cfg.primary_node_ips.clone());
        }
        info!(
            %mode,
            node_port_addresses = ?opts.node_port_addresses,
            "NodePorts accepted on the node's addresses inside these CIDRs (none: every address)"
        );
        opts.oom_score_adj = Some(cfg.oom_score_adj);
        opts.metrics = Some(metrics.clone());
        opts.exit_on_pod_cidr_change = pod_cidrs.clone();
        opts.resync = Some(resync.clone());
        info!(%mode, node = %opts.node_name, "kproxy starting");
        let agent = match built {
            Some(dp) => Agent::start(opts, dp, shutdown).await?,
            None => start(opts, mode, cfg, pod_cidrs, metrics, resync, shutdown).await?,
        };
        // Stopped while the datapath was being built: nothing was programmed, nothing to keep.
        agent.finish().await?;
        info!("stopped");
        Ok(())
    })
}

/// Starts the agent while `mode`'s datapath is built on a blocking thread (after the other
/// modes' leftovers are removed, [`modes::build_cleaned`]): the Service, EndpointSlice and
/// Node lists run meanwhile, and the first sync waits for both. A failed build ends the agent
/// with its error.
async fn start(
    opts: AgentOptions,
    mode: kproxy::dataplane::ProxyMode,
    cfg: &ProxyConfig,
    pod_cidrs: Option<Vec<ipnet::IpNet>>,
    metrics: kproxy::observe::metrics::Metrics,
    resync: kproxy::sync::SyncRequester,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<Agent> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let agent = Agent::start_building(opts, metrics.clone(), rx, shutdown).await?;
    let cfg = cfg.clone();
    let built = tokio::task::spawn_blocking(move || {
        modes::build_cleaned(
            mode,
            &cfg,
            pod_cidrs.as_deref().unwrap_or_default(),
            &metrics,
            &resync,
        )
    })
    .await
    .context("building the datapath panicked")?
    .with_context(|| format!("--proxy-mode={mode}"))?;
    // The loop only stops before taking it on shutdown.
    let _ = tx.send(built);
    Ok(agent)
}
