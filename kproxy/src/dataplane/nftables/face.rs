//! The nftables mode's face ([`ModeFace`]): usable on kernels ≥ 5.13 (upstream's minimum)
//! where `nft` can create a table; one proxier per family; `nodePortAddresses` defaults to
//! `primary` (as upstream's nftables mode); its leftovers are the `ip`/`ip6 kube-proxy`
//! tables (kproxy's or upstream's).
//!
//! The service CIDRs of the "drop traffic to unallocated ClusterIPs" rule come from the
//! `ServiceCIDR` objects when the API server serves them (the snapshot's), else from kproxy's
//! `serviceCIDRs` / `--service-cidrs` (none: no such rule).

use std::fs;
use std::net::IpAddr;

use anyhow::Context;
use ipnet::IpNet;

use crate::config::{NodePortAddresses, ProxyConfig, SyncPeriods};
use crate::dataplane::face::{
    BuildContext, ModeFace, bind_node_ip, cleanup_step, have, local_detector, render_header,
};
use crate::dataplane::inspect::{MapFill, Selected, ServiceReport};
use crate::dataplane::{Dataplane, ModeMetrics, ProxyMode};
use crate::model::{IpFamily, Snapshot};

use super::kernel::NftRunner;
use super::localhost::{FEATURE_GATE, LOOPBACK, LocalhostNodePorts};
use super::{FULL_SYNC_PERIOD, NftablesConfig, NftablesDataplane};

/// The nftables mode.
pub(crate) struct Face;

/// Upstream's minimum kernel for the nftables mode.
pub(crate) const MIN_KERNEL: (u32, u32) = (5, 13);

/// `major.minor` of a kernel release string (`6.1.0-18-amd64` → (6, 1)).
pub(crate) fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.trim().split(['.', '-']);
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// The nftables proxiers' configurations (one per family in `families`); `node_pod_cidrs`
/// as for [`local_detector`].
pub(crate) fn configs(
    cfg: &ProxyConfig,
    families: &[IpFamily],
    node_pod_cidrs: &[IpNet],
) -> Vec<NftablesConfig> {
    families
        .iter()
        .map(|&family| {
            let mut c = NftablesConfig::new(family, local_detector(cfg, family, node_pod_cidrs));
            c.node_ip = bind_node_ip(cfg, family);
            c.masquerade_bit = cfg.nftables.masquerade_bit;
            c.masquerade_all = cfg.nftables.masquerade_all;
            c.node_port_addresses = Face.node_port_cidrs(cfg);
            c.service_cidrs = cfg.service_cidrs.clone();
            c
        })
        .collect()
}

/// Whether NodePorts are served on 127.0.0.1 (feature gate
/// `KubeProxyNFTablesLocalhostNodePorts`): the gate is on, the node runs IPv4, and
/// `nodePortAddresses` does not exclude loopback (an explicit CIDR list must hold 127.0.0.1,
/// e.g. the `localhost` keyword; unset and `primary` do not exclude it — the gate itself asks
/// for localhost).
fn localhost_node_ports(cfg: &ProxyConfig, families: &[IpFamily]) -> bool {
    if !cfg.feature(FEATURE_GATE) {
        return false;
    }
    if !families.contains(&IpFamily::V4) {
        tracing::warn!("{FEATURE_GATE}: localhost NodePorts are IPv4-only; this node runs no IPv4");
        return false;
    }
    let loopback = IpAddr::V4(LOOPBACK);
    match &cfg.node_port_addresses {
        NodePortAddresses::Cidrs(c) if !c.iter().any(|n| n.contains(&loopback)) => {
            tracing::warn!(
                "{FEATURE_GATE}: nodePortAddresses excludes 127.0.0.1; localhost NodePorts off"
            );
            false
        }
        _ => true,
    }
}

impl ModeFace for Face {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    /// The kernel is at least [`MIN_KERNEL`], `nft` runs, and a throwaway table
    /// `ip kproxy-probe-<pid>` can be created and deleted.
    fn probe(&self, _cfg: &ProxyConfig) -> Result<(), String> {
        let release = fs::read_to_string("/proc/sys/kernel/osrelease")
            .map_err(|e| format!("reading the kernel version: {e}"))?;
        let version = kernel_version(&release)
            .ok_or_else(|| format!("cannot parse the kernel version {:?}", release.trim()))?;
        if version < MIN_KERNEL {
            return Err(format!(
                "kernel {} is older than {}.{} (upstream's minimum for nftables mode)",
                release.trim(),
                MIN_KERNEL.0,
                MIN_KERNEL.1
            ));
        }
        let nft = NftRunner::default();
        nft.run(&["--version"], None)
            .map_err(|e| format!("nft is not usable: {e}"))?;
        let table = format!("kproxy-probe-{}", std::process::id());
        nft.run(&["add", "table", "ip", &table], None)
            .map_err(|e| format!("cannot create an nftables table: {e}"))?;
        nft.run(&["delete", "table", "ip", &table], None)
            .map_err(|e| format!("cannot delete the probe nftables table ip {table}: {e}"))?;
        Ok(())
    }

    fn build(&self, cx: &BuildContext<'_>) -> anyhow::Result<Box<dyn Dataplane>> {
        let dp = NftablesDataplane::with_telemetry(
            configs(cx.cfg, cx.families, cx.node_pod_cidrs),
            NftRunner::default(),
            // Upstream's `proxyutil.FullSyncPeriod` (hourly), as the iptables mode; the
            // mode's syncPeriod only paces the (partial) syncs.
            FULL_SYNC_PERIOD,
            cx.telemetry.clone(),
        )
        .context("setting up the nftables proxier")?;
        Ok(Box::new(if localhost_node_ports(cx.cfg, cx.families) {
            dp.with_localhost(
                LocalhostNodePorts::new().context("starting the localhost NodePort proxy")?,
            )
        } else {
            dp
        }))
    }

    fn netfilter_conntrack(&self) -> bool {
        true
    }

    fn metrics(&self) -> ModeMetrics {
        ModeMetrics {
            nftables_sync: true,
            ..ModeMetrics::generic(ProxyMode::Nftables)
        }
    }

    fn sync_periods(&self, cfg: &ProxyConfig) -> SyncPeriods {
        cfg.nftables.sync
    }

    /// An unset list becomes `primary`, as upstream defaults it in nftables mode.
    fn node_port_addresses(&self, cfg: &ProxyConfig) -> NodePortAddresses {
        match &cfg.node_port_addresses {
            NodePortAddresses::Unset => NodePortAddresses::Primary,
            other => other.clone(),
        }
    }

    fn feature_gates(&self) -> &'static [&'static str] {
        &[FEATURE_GATE]
    }

    /// Both tables; the Node object's addresses stand for the interfaces'.
    fn render(&self, cfg: &ProxyConfig, snap: &Snapshot) -> anyhow::Result<String> {
        let mut out = String::new();
        for mut c in configs(cfg, &[IpFamily::V4, IpFamily::V6], &snap.node.pod_cidrs) {
            c.local_addresses = snap.node.addresses.clone();
            out.push_str(render_header(c.family));
            out.push_str(&super::render(snap, &c)?);
        }
        Ok(out)
    }

    fn programmed_here(&self, _cfg: &ProxyConfig) -> bool {
        super::inspect::programmed()
    }

    fn has_leftovers(&self, _cfg: &ProxyConfig, _running: &dyn ModeFace) -> bool {
        have("nft")
    }

    fn remove_leftovers(&self, _cfg: &ProxyConfig, errors: &mut Vec<String>) {
        if !have("nft") {
            return;
        }
        cleanup_step(
            errors,
            "nft tables ip/ip6 kube-proxy",
            super::dataplane::cleanup_tables(&NftRunner::default()),
        );
    }

    fn inspect(
        &self,
        _cfg: &ProxyConfig,
        snap: &Snapshot,
        selected: &Selected<'_>,
        reports: &mut [ServiceReport],
        _maps: &mut Vec<MapFill>,
    ) -> anyhow::Result<()> {
        super::inspect::view(snap, selected, reports)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse_and_compare_with_the_minimum() {
        assert_eq!(kernel_version("6.1.0-18-amd64\n"), Some((6, 1)));
        assert_eq!(kernel_version("5.13"), Some((5, 13)));
        assert_eq!(kernel_version("garbage"), None);
        assert!(kernel_version("5.12.19").unwrap() < MIN_KERNEL);
        assert!(kernel_version("5.13.0").unwrap() >= MIN_KERNEL);
        assert!(kernel_version("6.0.1").unwrap() >= MIN_KERNEL);
    }
}
