//! [`IptablesDataplane`]: the [`Dataplane`] of `--proxy-mode iptables`. One [`IptablesProxier`] per IP
//! family over the real iptables binaries, the start-up checks upstream does (backend choice,
//! sysctls, `--random-fully`), and the canary monitor.
//!
//! ## Canary monitor
//! Upstream creates `KUBE-PROXY-CANARY` in mangle, nat and filter and forces a full sync when
//! the mangle one disappears (a firewall reload deleting all chains). A plain
//! `iptables -t nat -F` deletes no chain, so upstream would not notice it; this monitor also
//! checks that the nat `PREROUTING → KUBE-SERVICES` jump still exists and the canary exists in
//! every table. When either check fails it marks the next sync full and calls the
//! `on_resync` callback (the agent wires it to the sync runner's `request()`), once per
//! incident. It checks every `sync_period` but at least every [`MONITOR_INTERVAL_MAX`]
//! (upstream: every `syncPeriod`): the checks are four cheap commands (the jump is looked for
//! in a listing of PREROUTING, not with `-C`, which on nf_tables fetches the whole nat table),
//! and the repair should not wait for a long sync period.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::dataplane::per_family::{FamilyError, FamilyPart, PerFamily};
use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport, Telemetry};
use crate::model::{ChangedSet, IpFamily, Snapshot};

use super::cleanup::cleanup_leftovers;
use super::config::IptablesConfig;
use super::exec::{CommandRunner, ExecIptables, Flavor, detect_flavor, has_random_fully};
use super::kernel::{IptablesBackend, IptablesError};
use super::names::{KUBE_PROXY_CANARY, KUBE_SERVICES};
use super::plan::jump_rules;
use super::proxier::IptablesProxier;

/// Start-up of the iptables dataplane failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(transparent)]
    Families(#[from] FamilyError),
    #[error("setting sysctl {key}: {reason}")]
    Sysctl { key: String, reason: String },
}

/// A failed `route_localnet` write, with what to do when `/proc/sys` is read-only (an
/// unprivileged container, which is how the DaemonSet runs kproxy).
fn route_localnet_hint(reason: String) -> String {
    if reason.contains("Read-only file system") {
        format!(
            "{reason}: /proc/sys is read-only here (an unprivileged container); localhost \
             NodePorts need route_localnet=1: set iptables.localhostNodePorts: false \
             (--iptables-localhost-nodeports=false), or run the container privileged"
        )
    } else {
        reason
    }
}

/// The canary monitor checks at least this often.
pub(crate) const MONITOR_INTERVAL_MAX: Duration = Duration::from_secs(5);

/// Called by the monitor when the rules need a full resync.
pub(crate) type ResyncCallback = Arc<dyn Fn() + Send + Sync>;

struct Monitor {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The iptables datapath (one proxier per family).
pub struct IptablesDataplane {
    families: PerFamily<FamilyProxier>,
    monitors: Vec<Monitor>,
    on_resync: Arc<Mutex<Option<ResyncCallback>>>,
}

/// One family's proxier, reporting its syncs (upstream's iptables metrics: full or partial
/// duration, restore failures, nat rules written) to the telemetry sink.
struct FamilyProxier {
    proxier: IptablesProxier<ExecIptables>,
    telemetry: Option<Arc<dyn Telemetry>>,
}

impl FamilyPart for FamilyProxier {
    fn family(&self) -> IpFamily {
        self.proxier.cfg.family
    }

    fn sync_family(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, String> {
        let p = &mut self.proxier;
        if !p.cfg.node_port_addresses.is_empty() {
            let runner = p.backend.runner.clone();
            p.cfg.local_addresses = detect_local_addresses(&runner);
        }
        let (family, before, start) = (p.cfg.family, p.stats, std::time::Instant::now());
        let result = p.sync(snap, changed);
        if let Some(t) = &self.telemetry {
            let (a, b, seconds) = (p.stats, before, start.elapsed().as_secs_f64());
            let synced = a.full_syncs + a.partial_syncs > b.full_syncs + b.partial_syncs;
            if synced {
                t.proxier_sync(family, a.full_syncs > b.full_syncs, seconds);
                t.nat_rules_last(family, a.nat_rules_last as u64);
            }
            let partial = a.partial_restore_failures > b.partial_restore_failures;
            for _ in b.restore_failures..a.restore_failures {
                t.restore_failed(family, partial);
            }
        }
        let out = result.map_err(|e| e.to_string())?;
        Ok(SyncReport {
            endpoints: out.total_endpoints,
            ..SyncReport::default()
        })
    }

    fn cleanup_family(&mut self) -> Result<(), String> {
        cleanup_leftovers(&mut self.proxier.backend).map_err(|e| e.to_string())?;
        self.proxier.force_full_sync();
        Ok(())
    }
}

const TABLES: [&str; 3] = ["mangle", "nat", "filter"];

/// Every address of every interface in the runner's network namespace (what `ip addr show`
/// lists), read in process through rtnetlink (the kproxy image ships no iproute2).
fn detect_local_addresses(runner: &CommandRunner) -> Vec<std::net::IpAddr> {
    match runner.in_netns(crate::kernel::addresses::scan) {
        Ok(Ok(interfaces)) => interfaces.into_iter().flat_map(|i| i.addrs).collect(),
        Ok(Err(e)) | Err(e) => {
            tracing::warn!(error = %e, "cannot list interface addresses; --nodeport-addresses matches none");
            vec![]
        }
    }
}

impl IptablesDataplane {
    /// Sets up one proxier per config (one per family): picks the backend, reads
    /// `nf_conntrack_tcp_be_liberal`, sets `route_localnet` when localhost NodePorts are in
    /// effect, checks `bridge-nf-call-iptables`, and starts the canary monitors (checking
    /// every `sync_period`, at most `MONITOR_INTERVAL_MAX` apart).
    pub fn new(cfgs: impl IntoIterator<Item = IptablesConfig>) -> Result<Self, SetupError> {
        Self::with_telemetry(cfgs, None)
    }

    /// [`Self::new`], each proxier reporting its syncs to `telemetry`.
    pub(crate) fn with_telemetry(
        cfgs: impl IntoIterator<Item = IptablesConfig>,
        telemetry: Option<Arc<dyn Telemetry>>,
    ) -> Result<Self, SetupError> {
        let mut proxiers = vec![];
        let mut seen = vec![];
        for mut cfg in cfgs {
            if seen.contains(&cfg.family) {
                return Err(FamilyError::Duplicate(ProxyMode::Iptables, cfg.family).into());
            }
            seen.push(cfg.family);
            let runner = CommandRunner {
                netns: cfg.netns.clone(),
            };
            let flavor: Flavor = detect_flavor(cfg.backend, &runner);
            cfg.random_fully = has_random_fully(&runner, cfg.family, flavor);
            if let Some(v) = runner.sysctl_get("net.netfilter.nf_conntrack_tcp_be_liberal")
                && v != "0"
            {
                tracing::info!(
                    "nf_conntrack_tcp_be_liberal set, not installing DROP rules for INVALID packets"
                );
                cfg.conntrack_tcp_liberal = true;
            }
            if cfg.family == IpFamily::V4 && cfg.effective_localhost_node_ports() {
                tracing::info!(
                    "setting net.ipv4.conf.all.route_localnet=1 to allow NodePorts on localhost; disable --iptables-localhost-nodeports or set --nodeport-addresses to avoid it"
                );
                runner
                    .sysctl_set("net.ipv4.conf.all.route_localnet", "1")
                    .map_err(|reason| SetupError::Sysctl {
                        key: "net.ipv4.conf.all.route_localnet".into(),
                        reason: route_localnet_hint(reason),
                    })?;
            }
            match runner
                .sysctl_get("net.bridge.bridge-nf-call-iptables")
                .as_deref()
            {
                Some("1") => {}
                other => {
                    tracing::warn!(value = ?other, "missing br_netfilter module or net.bridge.bridge-nf-call-iptables unset: the proxy may not work for traffic between pods on one bridge")
                }
            }
            // The nfacct counters need netlink nfacct support, which kproxy does not have:
            // their metric rules are left out (as upstream does when it cannot create them).
            cfg.nfacct_counters = Default::default();
            if !cfg.node_port_addresses.is_empty() {
                cfg.local_addresses = detect_local_addresses(&runner);
            }
            tracing::info!(family = ?cfg.family, ?flavor, random_fully = cfg.random_fully, "iptables proxier ready");
            let backend = ExecIptables::new(cfg.family, flavor, runner);
            proxiers.push(FamilyProxier {
                proxier: IptablesProxier::new(cfg, backend),
                telemetry: telemetry.clone(),
            });
        }
        let mut dp = IptablesDataplane {
            families: PerFamily::new(ProxyMode::Iptables, proxiers)?,
            monitors: vec![],
            on_resync: Arc::new(Mutex::new(None)),
        };
        dp.start_monitors();
        Ok(dp)
    }

    /// Sets the callback the canary monitor calls when a full resync is needed.
    pub fn set_resync_callback(&self, cb: ResyncCallback) {
        *self.on_resync.lock().expect("poisoned") = Some(cb);
    }

    /// The proxiers (one per family), e.g. to read their stats.
    pub fn proxiers(&self) -> Vec<&IptablesProxier<ExecIptables>> {
        self.families.parts().iter().map(|f| &f.proxier).collect()
    }

    fn start_monitors(&mut self) {
        let mut monitors = vec![];
        for p in self.proxiers() {
            let mut backend = p.backend.clone();
            let force = p.force_full_flag();
            let interval = p
                .cfg
                .sync_period
                .clamp(Duration::from_millis(100), MONITOR_INTERVAL_MAX);
            let stop = Arc::new(AtomicBool::new(false));
            let stop2 = stop.clone();
            let cb = self.on_resync.clone();
            let family = p.cfg.family;
            let nat_jump = jump_rules()
                .into_iter()
                .find(|j| j.table == "nat" && j.from == "PREROUTING" && j.to == KUBE_SERVICES)
                .expect("nat PREROUTING jump");
            // The canaries exist before the monitor's first check.
            for t in TABLES {
                if let Err(e) = backend.ensure_chain(t, KUBE_PROXY_CANARY) {
                    tracing::warn!(table = t, error = %e, "cannot create canary chain");
                }
            }
            let handle = std::thread::Builder::new()
                .name(format!("iptables-canary-{family:?}"))
                .spawn(move || {
                    let ensure = |b: &mut ExecIptables| {
                        for t in TABLES {
                            if let Err(e) = b.ensure_chain(t, KUBE_PROXY_CANARY) {
                                tracing::warn!(table = t, error = %e, "cannot create canary chain");
                            }
                        }
                    };
                    let mut fired = false;
                    let mut waited = Duration::ZERO;
                    while !stop2.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(50));
                        waited += Duration::from_millis(50);
                        if waited < interval {
                            continue;
                        }
                        waited = Duration::ZERO;
                        // Cheap checks only: the canaries are empty chains, and the jump is
                        // looked for in a listing of PREROUTING alone (a `-C` would make
                        // iptables-nft fetch the whole nat table; see `rule_listed`). The
                        // jump is gone as well when KUBE-SERVICES itself was deleted.
                        let healthy = (|| -> Result<bool, IptablesError> {
                            for t in TABLES {
                                if !backend.chain_exists(t, KUBE_PROXY_CANARY)? {
                                    return Ok(false);
                                }
                            }
                            if force.load(Ordering::Relaxed) {
                                return Ok(true); // a full sync is already due
                            }
                            // `-C` confirms a miss (never a false alarm from a listing that
                            // prints the rule differently).
                            Ok(backend.rule_listed("nat", nat_jump.from, &nat_jump.args)?
                                || backend.rule_exists("nat", nat_jump.from, &nat_jump.args)?)
                        })();
                        match healthy {
                            Ok(true) => fired = false,
                            Ok(false) if !fired => {
                                fired = true;
                                tracing::info!(
                                    ?family,
                                    "iptables rules were flushed; forcing a full resync"
                                );
                                force.store(true, Ordering::Relaxed);
                                ensure(&mut backend);
                                let cb = cb.lock().expect("poisoned").clone();
                                if let Some(cb) = cb {
                                    cb();
                                }
                            }
                            Ok(false) => {}
                            Err(e) => tracing::debug!(error = %e, "canary check failed"),
                        }
                    }
                })
                .expect("spawn canary monitor");
            monitors.push(Monitor {
                stop,
                handle: Some(handle),
            });
        }
        self.monitors = monitors;
    }
}

impl Dataplane for IptablesDataplane {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        self.families.sync(snap, changed)
    }

    fn cleanup(&mut self) -> Result<(), CleanupError> {
        self.monitors.clear();
        self.families.cleanup()
    }
}
