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
use kproxy::app::logging;
use kproxy::app::registry;
use kproxy::cli::{self, Command, Loaded, RenderOutput, VersionRequest};
use kproxy::config::{LoggingConfig, SourceConfig};
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
            registry::cleanup_all(&l.config)?;
            info!("cleanup done");
            Ok(())
        }
        Command::Agent if l.init_only => {
            info!("--init-only: configuration valid; kproxy needs no separate initialization");
            Ok(())
        }
        Command::Agent => kproxy::app::agent::run(&l.config),
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
                registry::render_plan(mode, &l.config, &snap)?
            }
        }
    );
    Ok(())
}
