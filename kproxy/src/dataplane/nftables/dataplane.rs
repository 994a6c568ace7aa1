//! [`NftablesDataplane`]: the [`Dataplane`] of `--proxy-mode nftables`. One [`Proxier`] per
//! IP family (`ip kube-proxy`, `ip6 kube-proxy`) over the kernel backend ([`KernelTable`]),
//! like the iptables mode's per-family proxiers.
//!
//! Each sync re-reads the node's interface addresses when `nodePortAddresses` restricts
//! NodePorts (a change makes the next sync full, [`Proxier::set_config`]); a full sync is
//! forced every `full_sync_period` (the agent passes [`FULL_SYNC_PERIOD`], upstream's hourly
//! full resync; the mode's `syncPeriod` only paces the partial syncs). A sync that fails
//! leaves the next one full.
//!
//! Not done (known gaps against upstream): ServiceCIDR objects are not watched (the
//! "unallocated ClusterIPs" drop rule is written only for CIDRs given in the config, which
//! kproxy does not have yet, so it is never written); the `nodePortAddresses` default is kproxy's
//! (every local address), not upstream's nftables `primary`.
//!
//! With the feature gate `KubeProxyNFTablesLocalhostNodePorts`, TCP NodePorts are also served
//! on 127.0.0.1 by [`LocalhostNodePorts`], updated after each sync ([`Self::with_localhost`]).

use std::time::{Duration, Instant};

use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport};
use crate::model::{ChangedSet, IpFamily, Snapshot};

use super::config::NftablesConfig;
use super::kernel::{KernelTable, NftRunner};
use super::localhost::LocalhostNodePorts;
use super::proxier::{NftSyncStats, Proxier};

/// How often a full sync is forced: upstream's `proxyutil.FullSyncPeriod` (one hour, the
/// iptables mode's [`crate::dataplane::iptables::config::FULL_SYNC_PERIOD`] too). The mode's
/// `syncPeriod` (30 s) only paces the syncs, which are partial: a full sync at 10k services
/// costs seconds of kernel time (see the module docs of [`super`]).
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Start-up of the nftables dataplane failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("nftables dataplane needs at least one IP family")]
    NoFamily,
    #[error("nftables dataplane: two proxiers for {0:?}")]
    DuplicateFamily(IpFamily),
}

/// One family's proxier and its table.
pub struct FamilyProxier {
    pub proxier: Proxier,
    pub table: KernelTable,
    /// Successful and failed syncs so far.
    pub syncs: u64,
    pub failures: u64,
}

/// The nftables datapath (one proxier per family).
pub struct NftablesDataplane {
    families: Vec<FamilyProxier>,
    start: Instant,
    full_sync_period: Duration,
    last_full: Option<Duration>,
    localhost: Option<LocalhostNodePorts>,
}

impl NftablesDataplane {
    /// One proxier per config (one per family), running `nft` through `runner`. A full sync
    /// is forced every `full_sync_period` (zero: never forced).
    pub fn new(
        cfgs: impl IntoIterator<Item = NftablesConfig>,
        runner: NftRunner,
        full_sync_period: Duration,
    ) -> Result<Self, SetupError> {
        let mut families: Vec<FamilyProxier> = vec![];
        for cfg in cfgs {
            if families.iter().any(|f| f.proxier.cfg.family == cfg.family) {
                return Err(SetupError::DuplicateFamily(cfg.family));
            }
            tracing::info!(family = ?cfg.family, "nftables proxier ready");
            // Which source the service CIDRs of `cluster-ips-check` come from (the proxier
            // logs again when ServiceCIDR objects from the API server replace these).
            match cfg.service_cidrs_text() {
                t if t.is_empty() => tracing::info!(
                    family = ?cfg.family,
                    "no service CIDRs configured (serviceCIDRs / --service-cidrs): unallocated \
                     ClusterIPs are dropped once the API server delivers ServiceCIDR objects"
                ),
                t => tracing::info!(
                    family = ?cfg.family,
                    service_cidrs = %t,
                    "service CIDRs from the configuration (serviceCIDRs / --service-cidrs), \
                     until the API server delivers ServiceCIDR objects"
                ),
            }
            families.push(FamilyProxier {
                table: KernelTable::new(cfg.table_family(), runner.clone()),
                proxier: Proxier::new(cfg),
                syncs: 0,
                failures: 0,
            });
        }
        if families.is_empty() {
            return Err(SetupError::NoFamily);
        }
        Ok(NftablesDataplane {
            families,
            start: Instant::now(),
            full_sync_period,
            last_full: None,
            localhost: None,
        })
    }

    /// Also serves TCP NodePorts on 127.0.0.1 (the feature gate
    /// `KubeProxyNFTablesLocalhostNodePorts`), following every sync's snapshot.
    pub fn with_localhost(mut self, proxy: LocalhostNodePorts) -> Self {
        self.localhost = Some(proxy);
        self
    }

    /// The localhost NodePort proxy, when enabled.
    pub fn localhost(&self) -> Option<&LocalhostNodePorts> {
        self.localhost.as_ref()
    }

    /// The per-family proxiers, e.g. to read their stats.
    pub fn families(&self) -> &[FamilyProxier] {
        &self.families
    }

    fn refresh_addresses(p: &mut Proxier) {
        if p.cfg.node_port_addresses.is_empty() {
            return;
        }
        let mut cfg = p.cfg.clone();
        cfg.local_addresses = crate::kernel::addresses::scan()
            .unwrap_or_default()
            .iter()
            .flat_map(|i| i.node_addrs())
            .collect();
        p.set_config(cfg);
    }
}

impl Dataplane for NftablesDataplane {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let now = self.start.elapsed();
        let force_full = !self.full_sync_period.is_zero()
            && self
                .last_full
                .is_some_and(|t| now.saturating_sub(t) >= self.full_sync_period);
        let mut errors = vec![];
        let mut endpoints = 0;
        for f in &mut self.families {
            Self::refresh_addresses(&mut f.proxier);
            if force_full {
                f.proxier.force_full_sync();
            }
            match f.proxier.sync(snap, changed, now, &mut f.table) {
                Ok(NftSyncStats { full, .. }) => {
                    f.syncs += 1;
                    if full {
                        self.last_full = Some(now);
                    }
                }
                Err(e) => {
                    f.failures += 1;
                    errors.push(format!("{:?}: {e}", f.proxier.cfg.family));
                }
            }
            endpoints += snap
                .services
                .values()
                .filter(|s| s.cluster_ip(f.proxier.cfg.family).is_some())
                .map(|s| snap.endpoints_of(&s.name).len())
                .sum::<usize>();
        }
        if let Some(lh) = &mut self.localhost {
            lh.update(snap);
        }
        if !errors.is_empty() {
            return Err(SyncError::Kernel(errors.join("; ")));
        }
        let families: Vec<IpFamily> = self.families.iter().map(|f| f.proxier.cfg.family).collect();
        Ok(SyncReport::of_families(snap, &families, endpoints))
    }

    /// Deletes both families' `kube-proxy` tables (upstream's nftables `CleanupLeftovers`).
    fn cleanup(&mut self) -> Result<(), CleanupError> {
        if let Some(lh) = &mut self.localhost {
            lh.stop();
        }
        for f in &mut self.families {
            f.table.delete_table().map_err(|reason| CleanupError {
                mode: ProxyMode::Nftables,
                reason,
            })?;
            f.proxier = Proxier::new(f.proxier.cfg.clone());
        }
        Ok(())
    }
}

/// Deletes the `ip` and `ip6` `kube-proxy` tables wherever `runner` runs `nft` (start-up
/// cleanup of other modes, `kproxy cleanup`).
pub fn cleanup_tables(runner: &NftRunner) -> Result<(), String> {
    let mut errors = vec![];
    for fam in ["ip", "ip6"] {
        if let Err(e) = KernelTable::new(fam, runner.clone()).delete_table() {
            errors.push(e);
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}
