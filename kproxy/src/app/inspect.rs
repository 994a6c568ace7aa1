//! `kproxy inspect`: per service port, its frontends, its endpoints with their state, and what
//! the kernel holds for it in the active mode:
//!
//! - ebpf: the frontends' entries of the pinned service map, the backends behind their slots,
//!   session-affinity and TC connection-table entries of the service, and every pinned map's
//!   fill level (entries / capacity);
//! - iptables: the nat-table rules of the service port's chains, found by name (the hashed
//!   `KUBE-SVC-`/`SVL-`/`EXT-`/`FW-` names computed from the port, as the proxier does), the
//!   rules jumping to them and the `KUBE-SEP-` chains they jump to — not by comment, since
//!   upstream's large-cluster mode (> 1000 endpoints) drops the comments;
//! - ipvs: the virtual servers on the service's addresses and their real servers;
//! - nftables: the port's map/set elements and chains in the `ip`/`ip6 kube-proxy` tables,
//!   read through netlink.
//!
//! Each mode's reader is its own (`dataplane/<mode>/inspect.rs`, reached through the mode's
//! face); this module builds the snapshot, selects the ports and prints the report.
//!
//! Each kernel table is read once (one dump per pinned map, one `iptables-save`, one IPVS
//! listing) and joined to the services through hash indexes, so the cost is linear in the
//! number of services and entries. `--service ns/name` reports one service's ports.
//!
//! The services come from `--manifests`, or else from the API server like the agent's
//! (`--kubeconfig` / `--master`, else in-cluster): Services and EndpointSlices listed once,
//! with upstream's label selector, and the Node of `--hostname-override`, built into the same
//! snapshot the agent's tracker builds. The mode is `--proxy-mode`, else the one whose kernel
//! objects exist (pins, then `kube-ipvs0`, then the iptables `KUBE-SERVICES` chain, then a
//! `kube-proxy` nftables table).

use std::fmt::Write as _;

use anyhow::{Context, bail};
use serde::Serialize;

use crate::cli::RenderOutput;
use crate::config::{ModeChoice, ProxyConfig, SourceConfig};
use crate::dataplane::ProxyMode;
pub(crate) use crate::dataplane::inspect::{BackendState, MapFill, ServiceReport};
use crate::dataplane::inspect::{frontends, sock};
use crate::model::{ServicePort, ServicePortName, Snapshot};

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    pub mode: ProxyMode,
    pub services: Vec<ServiceReport>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub maps: Vec<MapFill>,
}

/// Builds the report (see the module docs); `service` (`namespace/name`) limits it to that
/// service's ports.
pub(crate) fn report(cfg: &ProxyConfig, service: Option<&str>) -> anyhow::Result<Report> {
    let (snap, _) = match &cfg.source {
        SourceConfig::Manifests(path) => {
            crate::app::agent::snapshot_from_manifests(path, &cfg.node_name)?
        }
        SourceConfig::Kube { kubeconfig, master } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the tokio runtime")?
            .block_on(crate::app::agent::snapshot_from_api(
                kubeconfig.as_deref(),
                master.as_deref(),
                &cfg.node_name,
            ))
            .context("reading the services from the API server")?,
    };
    let selected: Vec<(&ServicePortName, &ServicePort)> = snap
        .services
        .iter()
        .filter(|(name, _)| service.is_none_or(|s| name.service() == s))
        .map(|(name, sp)| (name, &**sp))
        .collect();
    if let Some(s) = service
        && selected.is_empty()
    {
        bail!("--service {s}: no such service is proxied (none of its ports is in the snapshot)");
    }
    let mode = match cfg.mode {
        ModeChoice::Forced(m) => m,
        ModeChoice::Detect => super::registry::programmed_mode(cfg).ok_or_else(|| {
            anyhow::anyhow!(
                "no datapath of kproxy is programmed here (no pins, no kube-ipvs0 or its \
                     ipsets, no KUBE-SVC/KUBE-SEP chains, no kube-proxy nftables table)"
            )
        })?,
    };
    let mut out = Report {
        mode,
        services: selected
            .iter()
            .map(|(name, sp)| service_report(&snap, name, sp))
            .collect(),
        maps: vec![],
    };
    super::registry::face(mode).inspect(cfg, &snap, &selected, &mut out.services, &mut out.maps)?;
    Ok(out)
}

/// A service port's report before the kernel view.
fn service_report(snap: &Snapshot, name: &ServicePortName, sp: &ServicePort) -> ServiceReport {
    ServiceReport {
        name: name.to_string(),
        protocol: sp.protocol.lower().to_string(),
        frontends: frontends(sp),
        backends: snap
            .endpoints_of(name)
            .iter()
            .map(|e| BackendState {
                address: sock(e.ip, e.port),
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                local: e.is_local,
            })
            .collect(),
        kernel: vec![],
        kernel_backends: vec![],
        affinity_entries: None,
        ct_entries: None,
    }
}

/// The report as a table (one block per service port).
pub(crate) fn table(r: &Report) -> String {
    let mut s = format!("mode: {}\n", r.mode);
    for svc in &r.services {
        let _ = writeln!(s, "\n{} ({})", svc.name, svc.protocol);
        let _ = writeln!(s, "  frontends: {}", svc.frontends.join(", "));
        let _ = writeln!(s, "  backends:");
        for b in &svc.backends {
            let mut state: Vec<&str> = vec![];
            for (on, word) in [
                (b.ready, "ready"),
                (b.serving, "serving"),
                (b.terminating, "terminating"),
                (b.local, "local"),
            ] {
                if on {
                    state.push(word);
                }
            }
            let programmed = if svc.kernel_backends.contains(&b.address) {
                "programmed"
            } else {
                "not programmed"
            };
            let _ = writeln!(
                s,
                "    {:<24} {:<36} {programmed}",
                b.address,
                state.join(",")
            );
        }
        if let (Some(a), Some(c)) = (svc.affinity_entries, svc.ct_entries) {
            let _ = writeln!(s, "  affinity entries: {a}, TC CT entries: {c}");
        }
        let _ = writeln!(s, "  kernel ({}):", svc.kernel.len());
        for l in &svc.kernel {
            let _ = writeln!(s, "    {l}");
        }
    }
    if !r.maps.is_empty() {
        let _ = writeln!(s, "\nmaps:");
        let width = r.maps.iter().map(|m| m.map.len()).max().unwrap_or(0);
        for m in &r.maps {
            let pct = if m.capacity == 0 {
                0.0
            } else {
                100.0 * m.entries as f64 / f64::from(m.capacity)
            };
            let _ = writeln!(
                s,
                "  {:<width$} {:>8} / {:<8} ({pct:.1}%)",
                m.map, m.entries, m.capacity
            );
        }
    }
    s
}

/// `kproxy inspect` output (`service`: `--service namespace/name`).
pub fn run(
    cfg: &ProxyConfig,
    output: RenderOutput,
    service: Option<&str>,
) -> anyhow::Result<String> {
    let r = report(cfg, service)?;
    Ok(match output {
        RenderOutput::Json => serde_json::to_string_pretty(&r)? + "\n",
        _ => table(&r),
    })
}
