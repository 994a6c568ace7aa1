//! The iptables mode's face ([`ModeFace`]): usable when an iptables binary lists the nat
//! table; one proxier per family from the resolved configuration; its leftovers are the
//! `KUBE-*` chains of either backend and family (kproxy's or upstream's, same names).

use std::process::Command;
use std::sync::Arc;

use anyhow::Context;
use ipnet::IpNet;

use crate::config::{ProxyConfig, SyncPeriods};
use crate::dataplane::face::{
    BuildContext, ModeFace, bind_node_ip, cleanup_step, have, local_detector, render_header,
};
use crate::dataplane::inspect::{MapFill, Selected, ServiceReport};
use crate::dataplane::{Dataplane, ModeMetrics, ProxyMode};
use crate::model::{IpFamily, Snapshot};

use super::exec::{CommandRunner, ExecIptables, Flavor, nat_tables_everywhere};
use super::{IptablesConfig, IptablesDataplane};

/// The iptables mode.
pub(crate) struct Face;

/// The iptables proxiers' configurations (one per family in `families`); `node_pod_cidrs`
/// as for [`local_detector`].
pub(crate) fn configs(
    cfg: &ProxyConfig,
    families: &[IpFamily],
    node_pod_cidrs: &[IpNet],
) -> Vec<IptablesConfig> {
    families
        .iter()
        .map(|&family| {
            let mut c = IptablesConfig::new(family, local_detector(cfg, family, node_pod_cidrs));
            c.node_ip = bind_node_ip(cfg, family);
            c.masquerade_bit = cfg.masquerade_bit;
            c.masquerade_all = cfg.masquerade_all;
            c.localhost_node_ports = cfg.iptables.localhost_node_ports;
            c.node_port_addresses = Face.node_port_cidrs(cfg);
            c.sync_period = cfg.iptables.sync.sync_period;
            c
        })
        .collect()
}

/// Whether any backend's nat table declares a chain starting with one of `prefixes`.
fn nat_declares(prefixes: &[&str]) -> bool {
    nat_tables_everywhere()
        .iter()
        .any(|t| t.lines().any(|l| prefixes.iter().any(|p| l.starts_with(p))))
}

/// Per-service chains (`KUBE-SVC-*`, `KUBE-SEP-*`) of the iptables mode (kproxy's or
/// upstream's) in either backend or family: the ipvs mode shares `KUBE-SERVICES`, not these.
fn service_chains_here() -> bool {
    nat_declares(&[":KUBE-SVC-", ":KUBE-SEP-"])
}

impl ModeFace for Face {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    /// `iptables -t nat -S` works with one of the nft / legacy binaries (needs CAP_NET_ADMIN).
    fn probe(&self, _cfg: &ProxyConfig) -> Result<(), String> {
        let mut reasons = vec![];
        for bin in ["iptables-nft", "iptables-legacy", "iptables"] {
            match Command::new(bin)
                .args(["-w", "5", "-t", "nat", "-S"])
                .output()
            {
                Ok(o) if o.status.success() => return Ok(()),
                Ok(o) => reasons.push(format!(
                    "{bin}: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => reasons.push(format!("{bin}: {e}")),
            }
        }
        Err(format!("no usable iptables ({})", reasons.join("; ")))
    }

    fn build(&self, cx: &BuildContext<'_>) -> anyhow::Result<Box<dyn Dataplane>> {
        let dp = IptablesDataplane::with_telemetry(
            configs(cx.cfg, cx.families, cx.node_pod_cidrs),
            cx.telemetry.clone(),
        )
        .context("setting up the iptables proxier")?;
        if let Some(hook) = &cx.resync {
            dp.set_resync_callback(Arc::clone(hook));
        }
        Ok(Box::new(dp))
    }

    fn netfilter_conntrack(&self) -> bool {
        true
    }

    fn metrics(&self) -> ModeMetrics {
        ModeMetrics {
            iptables_restore: true,
            iptables_sync: true,
            ..ModeMetrics::generic(ProxyMode::Iptables)
        }
    }

    fn sync_periods(&self, cfg: &ProxyConfig) -> SyncPeriods {
        cfg.iptables.sync
    }

    fn render(&self, cfg: &ProxyConfig, snap: &Snapshot) -> anyhow::Result<String> {
        Ok(
            configs(cfg, &[IpFamily::V4, IpFamily::V6], &snap.node.pod_cidrs)
                .iter()
                .map(|c| format!("{}{}", render_header(c.family), super::render(snap, c)))
                .collect(),
        )
    }

    /// Its per-service chains, or a `KUBE-SERVICES` nat chain also without them.
    fn programmed_here(&self, _cfg: &ProxyConfig) -> bool {
        nat_declares(&[":KUBE-SVC-", ":KUBE-SEP-", ":KUBE-SERVICES "])
    }

    fn uses_kube_chains(&self) -> bool {
        true
    }

    /// Beside a mode that shares its chain names (ipvs), only when its own per-service chains
    /// show it ran, so a restart never flushes live rules; beside any other mode always (the
    /// removal is a no-op where nothing is left).
    fn has_leftovers(&self, _cfg: &ProxyConfig, running: &dyn ModeFace) -> bool {
        !running.uses_kube_chains() || service_chains_here()
    }

    fn remove_leftovers(&self, _cfg: &ProxyConfig, errors: &mut Vec<String>) {
        for family in [IpFamily::V4, IpFamily::V6] {
            for flavor in [Flavor::Nft, Flavor::Legacy] {
                let mut b = ExecIptables::new(family, flavor, CommandRunner { netns: None });
                let bin = b.binary();
                if !have(&bin) {
                    continue;
                }
                cleanup_step(
                    errors,
                    &format!("iptables rules ({bin})"),
                    super::cleanup::cleanup_leftovers(&mut b).map_err(|e| e.to_string()),
                );
            }
        }
    }

    fn inspect(
        &self,
        _cfg: &ProxyConfig,
        _snap: &Snapshot,
        selected: &Selected<'_>,
        reports: &mut [ServiceReport],
        _maps: &mut Vec<MapFill>,
    ) -> anyhow::Result<()> {
        super::inspect::view(selected, reports);
        Ok(())
    }
}
