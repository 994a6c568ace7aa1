//! [`NftablesDataplane`]: the [`Dataplane`] of `--proxy-mode nftables`. One [`NftablesProxier`] per
//! IP family (`ip kube-proxy`, `ip6 kube-proxy`) over the kernel backend ([`KernelTable`]),
//! like the iptables mode's per-family proxiers.
//!
//! Each sync re-reads the node's interface addresses when `nodePortAddresses` restricts
//! NodePorts (a change makes the next sync full, [`NftablesProxier::set_config`]); a full sync is
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

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dataplane::per_family::{FamilyError, FamilyPart, PerFamily};
use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport, Telemetry};
use crate::model::{ChangedSet, IpFamily, Snapshot};

use super::config::NftablesConfig;
use super::kernel::{KernelTable, NftRunner};
use super::localhost::LocalhostNodePorts;
use super::proxier::NftablesProxier;

/// How often a full sync is forced: upstream's `proxyutil.FullSyncPeriod` (one hour, the
/// iptables mode's `crate::dataplane::iptables::config::FULL_SYNC_PERIOD` too). The mode's
/// `syncPeriod` (30 s) only paces the syncs, which are partial: a full sync at 10k services
/// costs seconds of kernel time (see the module docs of [`super`]).
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Start-up of the nftables dataplane failed.
pub(crate) type SetupError = FamilyError;

/// One family's proxier and its table.
pub struct FamilyProxier {
    pub proxier: NftablesProxier,
    pub table: KernelTable,
    /// Successful and failed syncs so far.
    pub syncs: u64,
    pub failures: u64,
    /// Time since the dataplane started, for the proxier's stale-chain bookkeeping (set
    /// before each sync).
    now: Duration,
    /// When the last full sync succeeded (in `now`'s time).
    full_at: Option<Duration>,
    telemetry: Option<Arc<dyn Telemetry>>,
}

impl FamilyPart for FamilyProxier {
    fn family(&self) -> IpFamily {
        self.proxier.cfg.family
    }

    fn sync_family(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, String> {
        NftablesDataplane::refresh_addresses(&mut self.proxier);
        let family = self.proxier.cfg.family;
        let (cleanups, start) = (self.proxier.cleanup_failures, Instant::now());
        let result = self.proxier.sync(snap, changed, self.now, &mut self.table);
        let seconds = start.elapsed().as_secs_f64();
        match &result {
            Ok(stats) => {
                self.syncs += 1;
                if stats.full {
                    self.full_at = Some(self.now);
                }
            }
            Err(_) => self.failures += 1,
        }
        if let Some(t) = &self.telemetry {
            match &result {
                Ok(stats) => t.proxier_sync(family, stats.full, seconds),
                Err(_) => t.proxier_sync_failed(family),
            }
            for _ in cleanups..self.proxier.cleanup_failures {
                t.stale_chain_cleanup_failed(family);
            }
        }
        result.map_err(|e| e.to_string())?;
        let endpoints = snap
            .services
            .values()
            .filter(|s| s.cluster_ip(family).is_some())
            .map(|s| snap.endpoints_of(&s.name).len())
            .sum();
        Ok(SyncReport {
            endpoints,
            ..SyncReport::default()
        })
    }

    fn cleanup_family(&mut self) -> Result<(), String> {
        self.table.delete_table()?;
        self.proxier = NftablesProxier::new(self.proxier.cfg.clone());
        Ok(())
    }
}

/// The nftables datapath (one proxier per family).
pub struct NftablesDataplane {
    families: PerFamily<FamilyProxier>,
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
        Self::with_telemetry(cfgs, runner, full_sync_period, None)
    }

    /// [`Self::new`], each proxier reporting its syncs to `telemetry`.
    pub(crate) fn with_telemetry(
        cfgs: impl IntoIterator<Item = NftablesConfig>,
        runner: NftRunner,
        full_sync_period: Duration,
        telemetry: Option<Arc<dyn Telemetry>>,
    ) -> Result<Self, SetupError> {
        let mut families: Vec<FamilyProxier> = vec![];
        for cfg in cfgs {
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
                proxier: NftablesProxier::new(cfg),
                syncs: 0,
                failures: 0,
                now: Duration::ZERO,
                full_at: None,
                telemetry: telemetry.clone(),
            });
        }
        Ok(NftablesDataplane {
            families: PerFamily::new(ProxyMode::Nftables, families)?,
            start: Instant::now(),
            full_sync_period,
            last_full: None,
            localhost: None,
        })
    }

    /// Also serves TCP NodePorts on 127.0.0.1 (the feature gate
    /// `KubeProxyNFTablesLocalhostNodePorts`), following every sync's snapshot.
    pub(crate) fn with_localhost(mut self, proxy: LocalhostNodePorts) -> Self {
        self.localhost = Some(proxy);
        self
    }

    /// The per-family proxiers, e.g. to read their stats.
    pub fn families(&self) -> &[FamilyProxier] {
        self.families.parts()
    }

    fn refresh_addresses(p: &mut NftablesProxier) {
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
        for f in self.families.parts_mut() {
            f.now = now;
            if force_full {
                f.proxier.force_full_sync();
            }
        }
        let result = self.families.sync(snap, changed);
        if self.families.parts().iter().any(|f| f.full_at == Some(now)) {
            self.last_full = Some(now);
        }
        if let Some(lh) = &mut self.localhost {
            lh.update(snap);
        }
        result
    }

    /// Deletes both families' `kube-proxy` tables (upstream's nftables `CleanupLeftovers`).
    fn cleanup(&mut self) -> Result<(), CleanupError> {
        if let Some(lh) = &mut self.localhost {
            lh.stop();
        }
        self.families.cleanup()
    }
}

/// Deletes the `ip` and `ip6` `kube-proxy` tables wherever `runner` runs `nft` (start-up
/// cleanup of other modes, `kproxy cleanup`).
pub(crate) fn cleanup_tables(runner: &NftRunner) -> Result<(), String> {
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
