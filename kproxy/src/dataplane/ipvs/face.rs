//! The ipvs mode's face ([`ModeFace`]): usable when the IPVS generic-netlink family resolves
//! and ipset ≥ 6 runs; one [`IpvsDataplane`] per family ([`PerFamily`]); its leftovers are
//! virtual services, `kube-ipvs0`, its ipsets and its iptables rules — removed only where
//! `kube-ipvs0` or its ipsets show the mode ran (IPVS may serve something else on the host).

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context;
use ipnet::IpNet;

use crate::config::{DetectLocal, ProxyConfig, SyncPeriods};
use crate::dataplane::face::{BuildContext, ModeFace, cleanup_step, first_of, have, render_header};
use crate::dataplane::inspect::{MapFill, Selected, ServiceReport};
use crate::dataplane::netfilter::backend::{Flavor, detect_backend, tool};
use crate::dataplane::per_family::PerFamily;
use crate::dataplane::{Dataplane, ModeMetrics, ProxyMode};
use crate::model::{IpFamily, Snapshot};

pub use super::IpvsConfig;
use super::IpvsDataplane;
use super::config::DEFAULT_DUMMY_DEVICE;

/// The ipvs mode.
pub(crate) struct Face;

/// Upstream's warning when the ipvs mode is used (kube-proxy ≥ 1.35).
pub(crate) const IPVS_DEPRECATION: &str = "The ipvs proxier is now deprecated and may be removed in a future release. Please use 'nftables' instead.";

fn secs(d: Option<Duration>) -> u32 {
    d.map_or(0, |d| d.as_secs().min(u64::from(u32::MAX)) as u32)
}

/// The IPVS proxiers' configurations; `node_ips` gives the NodePort addresses of a family;
/// the local CIDR is the first `--cluster-cidr` of the family, or with NodeCIDR the first of
/// `node_pod_cidrs`.
pub(crate) fn configs(
    cfg: &ProxyConfig,
    families: &[IpFamily],
    node_ips: impl Fn(IpFamily) -> Vec<IpAddr>,
    flavor: Flavor,
    node_pod_cidrs: &[IpNet],
) -> Vec<IpvsConfig> {
    families
        .iter()
        .map(|&family| {
            let mut c = IpvsConfig::new(family, node_ips(family));
            c.scheduler = cfg.ipvs.scheduler.clone();
            c.strict_arp = cfg.ipvs.strict_arp;
            c.timeouts = super::genl::Timeouts {
                tcp: secs(cfg.ipvs.tcp_timeout),
                tcp_fin: secs(cfg.ipvs.tcp_fin_timeout),
                udp: secs(cfg.ipvs.udp_timeout),
            };
            c.masquerade_all = cfg.masquerade_all;
            c.cluster_cidr = match cfg.detect_local {
                DetectLocal::NodeCidr => first_of(node_pod_cidrs, family),
                _ => first_of(&cfg.cluster_cidrs, family),
            };
            c.masquerade_bit = cfg.masquerade_bit;
            c.exclude_cidrs = cfg.ipvs.exclude_cidrs.clone();
            c.iptables_restore = tool(family, flavor, "restore");
            c
        })
        .collect()
}

/// The node's addresses NodePorts are served on (non-loopback, non-link-local addresses of
/// every device but the IPVS dummy, inside `nodePortAddresses`).
fn node_ips(cfg: &ProxyConfig, family: IpFamily) -> Vec<IpAddr> {
    let cidrs = Face.node_port_cidrs(cfg);
    let ifaces = crate::kernel::addresses::scan().unwrap_or_default();
    let mut ips: Vec<IpAddr> = ifaces
        .iter()
        .filter(|i| !i.loopback && i.name != DEFAULT_DUMMY_DEVICE)
        .flat_map(|i| i.node_addrs())
        .filter(|ip| family.matches(ip))
        .filter(|ip| cidrs.is_empty() || cidrs.iter().any(|c| c.contains(ip)))
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

/// `kube-ipvs0` or one of the mode's ipsets exists.
fn ran_here() -> bool {
    let dummy = super::rtnl::Rtnl::open()
        .and_then(|mut r| r.link_index(DEFAULT_DUMMY_DEVICE))
        .is_ok_and(|i| i.is_some());
    dummy
        || std::process::Command::new("ipset")
            .args(["list", "-n"])
            .output()
            .is_ok_and(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .any(|l| l.starts_with("KUBE-CLUSTER-IP"))
            })
}

/// The `iptables-restore` binaries of every family and backend present.
fn restore_binaries() -> Vec<(IpFamily, String)> {
    let mut out = vec![];
    for family in [IpFamily::V4, IpFamily::V6] {
        for flavor in [Flavor::Nft, Flavor::Legacy] {
            if have(&tool(family, flavor, "")) {
                out.push((family, tool(family, flavor, "restore")));
            }
        }
    }
    out
}

impl ModeFace for Face {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ipvs
    }

    fn probe(&self, _cfg: &ProxyConfig) -> Result<(), String> {
        super::usable()
    }

    fn build(&self, cx: &BuildContext<'_>) -> anyhow::Result<Box<dyn Dataplane>> {
        super::usable().map_err(|e| anyhow::anyhow!("IPVS is not usable: {e}"))?;
        let flavor = if have("iptables-nft") {
            detect_backend(None)
        } else {
            Flavor::Legacy
        };
        let mut parts = vec![];
        let ips = |f| node_ips(cx.cfg, f);
        for c in configs(cx.cfg, cx.families, ips, flavor, cx.node_pod_cidrs) {
            let family = c.family;
            parts.push(
                IpvsDataplane::new(c)
                    .with_context(|| format!("setting up the {family:?} IPVS proxier"))?,
            );
        }
        Ok(Box::new(PerFamily::new(ProxyMode::Ipvs, parts)?))
    }

    fn netfilter_conntrack(&self) -> bool {
        true
    }

    /// Only the restore-failure counter of the iptables metrics, as upstream registers.
    fn metrics(&self) -> ModeMetrics {
        ModeMetrics {
            iptables_restore: true,
            ..ModeMetrics::generic(ProxyMode::Ipvs)
        }
    }

    fn sync_periods(&self, cfg: &ProxyConfig) -> SyncPeriods {
        cfg.ipvs.sync
    }

    fn start_notice(&self) {
        // Upstream logs it at error level (and records an `IPVSDeprecation` event).
        tracing::error!("{IPVS_DEPRECATION}");
    }

    /// NodePorts on the Node object's addresses.
    fn render(&self, cfg: &ProxyConfig, snap: &Snapshot) -> anyhow::Result<String> {
        let node_ips = |f: IpFamily| -> Vec<IpAddr> {
            snap.node
                .addresses
                .iter()
                .copied()
                .filter(|ip| f.matches(ip))
                .collect()
        };
        let families = [IpFamily::V4, IpFamily::V6];
        Ok(
            configs(cfg, &families, node_ips, Flavor::Nft, &snap.node.pod_cidrs)
                .iter()
                .map(|c| format!("{}{}", render_header(c.family), super::render(snap, c)))
                .collect(),
        )
    }

    fn programmed_here(&self, _cfg: &ProxyConfig) -> bool {
        ran_here()
    }

    fn uses_kube_chains(&self) -> bool {
        true
    }

    fn has_leftovers(&self, _cfg: &ProxyConfig, _running: &dyn ModeFace) -> bool {
        ran_here()
    }

    /// Deletes the mode's jumps and flushes its chains in every backend, so the iptables
    /// mode's removal of the chains both share finds nothing referencing them.
    fn unhook(&self) {
        let Ok(tools) = super::netfilter::Tools::here() else {
            return;
        };
        for (_, restore) in restore_binaries() {
            super::netfilter::unhook(&tools, &restore);
        }
    }

    /// Virtual services (upstream flushes IPVS) except those in `ipvs.excludeCIDRs`, the
    /// dummy device, the iptables rules and ipsets.
    fn remove_leftovers(&self, cfg: &ProxyConfig, errors: &mut Vec<String>) {
        if let Ok(mut h) = super::genl::IpvsHandle::open()
            && h.version().is_ok()
        {
            let r = h.services().map_err(|e| e.to_string()).and_then(|svcs| {
                for s in svcs {
                    if cfg
                        .ipvs
                        .exclude_cidrs
                        .iter()
                        .any(|n| n.contains(&s.key.addr))
                    {
                        continue;
                    }
                    h.delete_service(&s.key).map_err(|e| e.to_string())?;
                }
                Ok(())
            });
            cleanup_step(errors, "IPVS virtual services", r);
        }
        match super::rtnl::Rtnl::open() {
            Ok(mut rtnl) => {
                let r = rtnl.link_index(DEFAULT_DUMMY_DEVICE).and_then(|i| match i {
                    Some(i) => rtnl.delete_link(i),
                    None => Ok(()),
                });
                cleanup_step(errors, DEFAULT_DUMMY_DEVICE, r.map_err(|e| e.to_string()));
            }
            Err(e) => cleanup_step(errors, "rtnetlink", Err(e.to_string())),
        }
        let tools = match super::netfilter::Tools::here() {
            Ok(t) => t,
            Err(e) => {
                return cleanup_step(errors, "IPVS iptables rules and ipsets", Err(e.to_string()));
            }
        };
        if !have("ipset") {
            return;
        }
        for (family, restore) in restore_binaries() {
            cleanup_step(
                errors,
                &format!("IPVS iptables rules and ipsets ({restore})"),
                super::netfilter::cleanup(&tools, family, &restore),
            );
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
        super::inspect::view(selected, reports)
    }
}
