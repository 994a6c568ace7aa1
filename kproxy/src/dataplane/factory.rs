//! Builds a datapath from the resolved configuration, and cleans up after every mode.
//!
//! This is the one place that knows every [`ProxyMode`]'s constructor: `main.rs` calls
//! [`select`] for the agent and [`cleanup_all`] for `kproxy cleanup` / `--cleanup`.
//!
//! In this build no datapath is wired in yet: [`build`] returns "proxy mode X is not available
//! in this build" for every mode, and [`cleanup_all`] removes nothing. Each datapath, when it
//! lands, gets one arm in [`build`] (constructing its own config from [`ProxyConfig`]) and one
//! call in [`cleanup_all`].

use anyhow::{Context, bail};
use tracing::info;

use super::{Dataplane, ProxyMode};
use crate::config::{ModeChoice, ProxyConfig};

/// Constructs the datapath of `mode`. Fails with a clear message when the mode cannot run
/// here (not built in, kernel lacks a feature, …).
pub fn build(mode: ProxyMode, cfg: &ProxyConfig) -> anyhow::Result<Box<dyn Dataplane>> {
    let _ = cfg;
    match mode {
        ProxyMode::Ebpf | ProxyMode::Ipvs | ProxyMode::Iptables => {
            bail!("proxy mode {mode} is not available in this build")
        }
    }
}

/// The order `mode: ""` tries the modes in (upstream's empty mode means iptables; kproxy
/// prefers its eBPF datapath).
pub const DETECT_ORDER: [ProxyMode; 3] = [ProxyMode::Ebpf, ProxyMode::Ipvs, ProxyMode::Iptables];

/// Builds the forced mode, or the first mode of [`DETECT_ORDER`] that builds.
pub fn select(choice: ModeChoice, cfg: &ProxyConfig) -> anyhow::Result<Box<dyn Dataplane>> {
    match choice {
        ModeChoice::Forced(mode) => {
            build(mode, cfg).with_context(|| format!("--proxy-mode={mode}"))
        }
        ModeChoice::Detect => {
            let mut reasons = Vec::new();
            for mode in DETECT_ORDER {
                match build(mode, cfg) {
                    Ok(dp) => {
                        info!(%mode, "proxy mode detected");
                        return Ok(dp);
                    }
                    Err(e) => reasons.push(format!("{mode}: {e:#}")),
                }
            }
            bail!("no proxy mode can run here ({})", reasons.join("; "))
        }
    }
}

/// Removes everything any mode (and upstream kube-proxy) left in the kernel.
/// Currently removes nothing: no datapath is wired into this build yet.
pub fn cleanup_all(cfg: &ProxyConfig) -> anyhow::Result<()> {
    let _ = cfg;
    info!("cleanup: no datapath is built in, nothing to remove");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli;

    fn cfg() -> ProxyConfig {
        let inv = cli::parse(["kproxy"].map(std::ffi::OsString::from)).unwrap();
        cli::load(&inv, Some("n".into())).unwrap().config
    }

    #[test]
    fn unavailable_modes_say_so() {
        let c = cfg();
        for mode in ProxyMode::ALL {
            let e = build(mode, &c).err().expect("no datapath in this build");
            assert_eq!(
                e.to_string(),
                format!("proxy mode {mode} is not available in this build")
            );
        }
        let e = select(ModeChoice::Detect, &c).err().unwrap().to_string();
        assert!(e.starts_with("no proxy mode can run here (ebpf: "), "{e}");
    }
}
