//! [`IpvsDataplane`]: the [`Dataplane`] of `--proxy-mode ipvs` for one IP family (the face
//! runs one per family in a [`crate::dataplane::per_family::PerFamily`]); see the module docs
//! of [`super`] for how it syncs.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::config::IpvsConfig;
use super::genl::{DestCmd, Destination, IpvsHandle, ServiceKey};
use super::netfilter::Tools;
use super::plan::{self, IpvsPlan};
use super::rtnl::Rtnl;
use super::{genl, netfilter, sysctl};
use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport};
use crate::model::{ChangedSet, IpFamily, Protocol, Snapshot};

/// Whether this host can run the IPVS proxier: the IPVS generic netlink family resolves
/// (ip_vs is loaded or built in) and ipset ≥ 6.0 is installed. `Err` says why not.
pub fn usable() -> Result<(), String> {
    let mut h = IpvsHandle::open().map_err(|e| e.to_string())?;
    h.version().map_err(|e| e.to_string())?;
    netfilter::check_ipset_version().map(|_| ())
}

/// `kproxy --cleanup` for IPVS mode (upstream's CleanupLeftovers, per family): removes the
/// virtual services of `cfg.family` (outside `exclude_cidrs`), the dummy device, our iptables
/// chains and ipsets, without applying any sysctl or timeout first. Upstream flushes every
/// IPVS service instead; kproxy leaves excluded ranges alone here too.
pub fn cleanup_leftovers(mut cfg: IpvsConfig) -> Result<(), CleanupError> {
    cfg.set_sysctls = false;
    cfg.timeouts = genl::Timeouts::default();
    let mut dp = IpvsDataplane::new(cfg).map_err(|e| CleanupError {
        mode: ProxyMode::Ipvs,
        reason: e.to_string(),
    })?;
    dp.cleanup()
}

/// Creating an [`IpvsDataplane`] failed.
#[derive(Debug, thiserror::Error)]
pub enum IpvsInitError {
    #[error("invalid IPVS configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Ipvs(#[from] genl::IpvsError),
    #[error("IPVS setup: {0}")]
    Setup(String),
}

/// The IPVS datapath (one IP family).
#[derive(Debug)]
pub struct IpvsDataplane {
    cfg: IpvsConfig,
    ipvs: IpvsHandle,
    rtnl: Rtnl,
    tools: Tools,
    /// Set contents last written (name → entries): a sync writes only the entries that
    /// differ (a full reconcile rebuilds every set), and runs no `ipset` when none do.
    applied_sets: BTreeMap<String, BTreeSet<String>>,
    /// The iptables restore input last applied.
    applied_rules: Option<String>,
    /// Per virtual service, the real servers (address, port → weight) last written when the
    /// kernel then held exactly those (nothing draining): its real servers are not listed
    /// again until the plan for it changes or the next full reconcile.
    applied_dests: BTreeMap<ServiceKey, BTreeMap<(IpAddr, u16), u32>>,
    /// When every service's real servers were last listed (`None`: never).
    last_reconcile: Option<Instant>,
    /// Real-server listings (one netlink dump each) done so far.
    dest_listings: u64,
}

/// How often every virtual service's real servers are listed and repaired, whether or not
/// its plan changed.
pub const RECONCILE_EVERY: Duration = Duration::from_secs(60);

impl IpvsDataplane {
    /// Validates `cfg`, opens the IPVS and rtnetlink sockets in the calling thread's network
    /// namespace, applies the sysctls and IPVS timeouts. Nothing else changes until `sync`.
    pub fn new(cfg: IpvsConfig) -> Result<IpvsDataplane, IpvsInitError> {
        cfg.validate().map_err(IpvsInitError::Config)?;
        let mut ipvs = IpvsHandle::open()?;
        let rtnl = Rtnl::open().map_err(|e| IpvsInitError::Setup(format!("rtnetlink: {e}")))?;
        let tools = Tools::here()
            .map_err(|e| IpvsInitError::Setup(format!("opening the network namespace: {e}")))?;
        if cfg.set_sysctls {
            sysctl::apply(&cfg).map_err(IpvsInitError::Setup)?;
        }
        let t = cfg.timeouts;
        if t.tcp != 0 || t.tcp_fin != 0 || t.udp != 0 {
            ipvs.set_timeouts(t)?;
        }
        Ok(IpvsDataplane {
            cfg,
            ipvs,
            rtnl,
            tools,
            applied_sets: BTreeMap::new(),
            applied_rules: None,
            applied_dests: BTreeMap::new(),
            last_reconcile: None,
            dest_listings: 0,
        })
    }

    pub fn config(&self) -> &IpvsConfig {
        &self.cfg
    }

    /// Real-server listings (one netlink dump of one virtual service each) done so far.
    pub fn destination_listings(&self) -> u64 {
        self.dest_listings
    }

    fn ours(&self, key: &ServiceKey) -> bool {
        self.cfg.family.matches(&key.addr)
            && !self.cfg.exclude_cidrs.iter().any(|n| n.contains(&key.addr))
    }

    /// Makes the real servers of `key` match `planned`; removed ones drain (see module docs).
    /// `fresh`: the service was just created (nothing to list). Records in `applied_dests`
    /// whether the kernel now holds exactly `planned`.
    fn sync_destinations(
        &mut self,
        key: &ServiceKey,
        planned: &BTreeMap<(IpAddr, u16), u32>,
        fresh: bool,
    ) -> Result<(), genl::IpvsError> {
        self.applied_dests.remove(key);
        let current = if fresh {
            vec![]
        } else {
            self.dest_listings += 1;
            self.ipvs.destinations(key)?
        };
        let mut leftover = false;
        let by_addr: BTreeMap<(IpAddr, u16), &Destination> =
            current.iter().map(|d| ((d.addr, d.port), d)).collect();
        for (&(addr, port), &weight) in planned {
            let want = Destination {
                addr,
                port,
                weight,
                active_conns: 0,
                inactive_conns: 0,
                persist_conns: 0,
            };
            match by_addr.get(&(addr, port)) {
                None => self.ipvs.dest(key, &want, DestCmd::New)?,
                Some(d) if d.weight != weight => self.ipvs.dest(key, &want, DestCmd::Set)?,
                Some(_) => {}
            }
        }
        for d in current
            .iter()
            .filter(|d| !planned.contains_key(&(d.addr, d.port)))
        {
            if key.protocol != Protocol::Tcp {
                // Like upstream: no draining for UDP/SCTP; expire_nodest_conn ends their flows.
                tracing::debug!(service = %key, dest = %d.addr, "removing real server");
                self.ipvs.dest(key, d, DestCmd::Del)?;
            } else if d.weight != 0 {
                leftover = true;
                tracing::debug!(service = %key, dest = %d.addr, "draining removed real server");
                let zero = Destination {
                    weight: 0,
                    ..d.clone()
                };
                self.ipvs.dest(key, &zero, DestCmd::Set)?;
            } else if d.active_conns + d.inactive_conns == 0 {
                tracing::debug!(service = %key, dest = %d.addr, "removing drained real server");
                self.ipvs.dest(key, d, DestCmd::Del)?;
            } else {
                leftover = true;
            }
        }
        if !leftover {
            self.applied_dests.insert(*key, planned.clone());
        }
        Ok(())
    }

    fn apply(&mut self, plan: &IpvsPlan) -> Result<usize, SyncError> {
        let kernel = |e: String| SyncError::Kernel(e);
        let dev = self.cfg.dummy_device.clone();
        let index = self
            .rtnl
            .ensure_dummy(&dev)
            .map_err(|e| kernel(format!("dummy device {dev}: {e}")))?;
        let bound: BTreeSet<IpAddr> = self
            .rtnl
            .addresses(index)
            .map_err(|e| kernel(format!("listing addresses of {dev}: {e}")))?
            .into_iter()
            .collect();
        for ip in plan.bound.difference(&bound) {
            self.rtnl
                .add_address(index, ip)
                .map_err(|e| kernel(format!("binding {ip} to {dev}: {e}")))?;
        }

        let current: BTreeMap<ServiceKey, genl::VirtualService> = self
            .ipvs
            .services()
            .map_err(|e| kernel(e.to_string()))?
            .into_iter()
            .map(|s| (s.key, s))
            .collect();
        let reconcile = self
            .last_reconcile
            .is_none_or(|t| t.elapsed() >= RECONCILE_EVERY);
        if reconcile {
            self.last_reconcile = Some(Instant::now());
        }
        let mut failed = BTreeSet::new();
        for (key, ps) in &plan.services {
            let result = match current.get(key) {
                None => self
                    .ipvs
                    .add_service(&ps.service)
                    .and_then(|()| self.sync_destinations(key, &ps.real_servers, true)),
                Some(cur) => {
                    let upd = if *cur != ps.service {
                        self.ipvs.update_service(&ps.service)
                    } else {
                        Ok(())
                    };
                    let unchanged =
                        !reconcile && self.applied_dests.get(key) == Some(&ps.real_servers);
                    upd.and_then(|()| {
                        if unchanged {
                            Ok(())
                        } else {
                            self.sync_destinations(key, &ps.real_servers, false)
                        }
                    })
                }
            };
            if let Err(e) = result {
                tracing::error!(service = %ps.origin, "{e}");
                failed.insert(ps.origin.clone());
            }
        }

        if self.cfg.manage_iptables {
            // Until it succeeds, what the sets hold is unknown: a failure rebuilds them whole
            // at the next sync (as does every full reconcile).
            let applied = std::mem::take(&mut self.applied_sets);
            netfilter::apply_sets(
                &self.tools,
                &plan.sets,
                self.cfg.family,
                &applied,
                reconcile,
            )
            .map_err(kernel)?;
            self.applied_sets = plan
                .sets
                .values()
                .map(|s| (s.name.clone(), s.entries.clone()))
                .collect();
            let text = plan::iptables_restore_input(&plan.rules);
            if self.applied_rules.as_deref() != Some(text.as_str()) {
                self.applied_rules = None;
                netfilter::apply_rules(&self.tools, &plan.rules, &self.cfg.iptables_restore)
                    .map_err(kernel)?;
                self.applied_rules = Some(text);
            }
        }

        // Upstream's cleanLegacyService: virtual services of our family nobody plans.
        for key in current.keys() {
            if !plan.services.contains_key(key) && self.ours(key) {
                tracing::debug!(service = %key, "removing stale virtual service");
                self.applied_dests.remove(key);
                self.ipvs
                    .delete_service(key)
                    .map_err(|e| kernel(e.to_string()))?;
            }
        }
        for ip in bound.difference(&plan.bound) {
            if self.cfg.family.matches(ip) {
                self.rtnl
                    .del_address(index, ip)
                    .map_err(|e| kernel(format!("unbinding {ip} from {dev}: {e}")))?;
            }
        }
        Ok(failed.len())
    }
}

impl crate::dataplane::per_family::FamilyPart for IpvsDataplane {
    fn family(&self) -> IpFamily {
        self.cfg.family
    }
    fn sync_family(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, String> {
        Dataplane::sync(self, snap, changed).map_err(|e| e.to_string())
    }
    fn cleanup_family(&mut self) -> Result<(), String> {
        Dataplane::cleanup(self).map_err(|e| e.reason)
    }
}

impl Dataplane for IpvsDataplane {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ipvs
    }

    fn sync(&mut self, snap: &Snapshot, _changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let plan = plan::plan(snap, &self.cfg);
        for (name, reason) in &plan.errors {
            tracing::error!(service = %name, "not programmed: {reason}");
        }
        let kernel_failed = self.apply(&plan)?;
        Ok(SyncReport {
            services: plan.service_ports,
            endpoints: plan.active_endpoints(),
            failed_services: plan.errors.len() + kernel_failed,
        })
    }

    fn cleanup(&mut self) -> Result<(), CleanupError> {
        let err = |reason: String| CleanupError {
            mode: ProxyMode::Ipvs,
            reason,
        };
        let services = self.ipvs.services().map_err(|e| err(e.to_string()))?;
        let ours: Vec<_> = services.into_iter().filter(|s| self.ours(&s.key)).collect();
        for s in &ours {
            self.ipvs
                .delete_service(&s.key)
                .map_err(|e| err(e.to_string()))?;
        }
        if let Some(index) = self
            .rtnl
            .link_index(&self.cfg.dummy_device)
            .map_err(|e| err(e.to_string()))?
        {
            self.rtnl
                .delete_link(index)
                .map_err(|e| err(format!("deleting {}: {e}", self.cfg.dummy_device)))?;
        }
        if self.cfg.manage_iptables {
            netfilter::cleanup(&self.tools, self.cfg.family, &self.cfg.iptables_restore)
                .map_err(err)?;
        }
        self.applied_sets.clear();
        self.applied_rules = None;
        self.applied_dests.clear();
        self.last_reconcile = None;
        Ok(())
    }
}
