//! `--proxy-mode ebpf` as the agent runs it: the eBPF service maps + socket LB
//! ([`crate::dataplane::ebpf::service_maps::ServiceMaps`]) and the TC service path ([`crate::dataplane::ebpf::node_path`]) on the node's
//! devices, as one [`Dataplane`].
//!
//! - At construction: the socket-LB cgroup is checked ([`crate::dataplane::ebpf::socket_lb::cgroup`]: on cgroup2, and
//!   showing the host's hierarchy rather than a private cgroup namespace's own), then the
//!   socket-LB datapath loads (pinned maps under `<bpffs>/kproxy/`,
//!   links on the cgroup), then a second object instance sharing those pinned maps loads the
//!   TC programs and attaches them (pinned TCX links) to the devices `--bpf-devices` names or
//!   the default rule picks ([`crate::dataplane::ebpf::node_path::devices::select`]); with `bpf.xdp` not off,
//!   the XDP program (early drop, NodePort fast path) goes on the same devices
//!   ([`crate::dataplane::ebpf::node_path::xdp`]).
//! - A background watcher follows the node's addresses: it rewrites the per-device SNAT
//!   sources (`KP_NODE_ADDR4`, `KP_NODE_ADDR6`) at once, and the NodePort frontends at the next sync
//!   (NodePorts are programmed on every node address, or on those inside
//!   `nodePortAddresses`).
//! - After each sync: connection-table entries of removed backends are purged (the tables
//!   are dumped only when the sync removed backends), and map fill levels reported to the
//!   metrics (`kproxy_bpf_map_*`).
//! - A background timer ([`ct::ExpiryTimer`]) alone expires idle and closed flows, every
//!   `bpf.conntrack.expiryInterval` (syncs do not: each pass dumps both tables), and reports
//!   the tables' fill.
//! - SCTP service ports are not translated (neither socket LB nor the TC programs handle
//!   SCTP; see `kproxy-ebpf/src/sock.rs`): each sync counts them in
//!   `kproxy_bpf_skipped_service_ports{protocol="SCTP"}` and logs a warning when the count
//!   changes to a non-zero value. Upstream's iptables/ipvs modes do serve SCTP; run one of
//!   them where SCTP services matter.
//!
//! Everything runs in the network namespace of the thread that calls [`EbpfDataplane::new`].

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aya::Ebpf;
use ipnet::IpNet;

use crate::dataplane::ebpf::node_path::TcConfig;
use crate::dataplane::ebpf::node_path::TcPath;
use crate::dataplane::ebpf::node_path::devices;
use crate::dataplane::ebpf::node_path::flows as ct;
use crate::dataplane::ebpf::node_path::tc::{load_object, stat_name};
use crate::dataplane::ebpf::node_path::xdp::XdpPath;
use crate::dataplane::ebpf::node_path::xdp::XdpPolicy;
use crate::dataplane::ebpf::service_maps::ServiceMaps;
use crate::dataplane::ebpf::service_maps::ServiceMapsConfig;
use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport, Telemetry};
use crate::kernel::addresses::AddressWatcher;
use crate::kernel::addresses::NodeAddresses;
use crate::kernel::addresses::scan;
use crate::model::{ChangedSet, Protocol, Snapshot};
use kproxy_common::ct::TcStat;

/// How often the node's addresses are re-read.
const ADDRESS_POLL: Duration = Duration::from_secs(2);

/// What the ebpf mode needs beyond [`ServiceMapsConfig`].
#[derive(Debug, Clone)]
pub struct EbpfConfig {
    pub ebpf: ServiceMapsConfig,
    /// `--bpf-devices`; `None`: the default device rule.
    pub devices: Option<Vec<String>>,
    /// Attach the TC service path (NodePort/ExternalIP/LB from outside the node).
    pub tc: bool,
    /// `bpf.xdp`: where the XDP early-drop program goes beside TC (TC path only).
    pub xdp: XdpPolicy,
    /// Idle timeouts of the TC connection table.
    pub ct_timeouts: ct::Timeouts,
    /// `nodePortAddresses` as CIDRs; empty: every node address.
    pub node_port_cidrs: Vec<IpNet>,
}

/// The errors of [`EbpfDataplane::new`].
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("eBPF socket LB: {0}")]
    Sock(#[from] crate::dataplane::ebpf::service_maps::loader::LoaderError),
    #[error("eBPF socket LB: {0}")]
    Cgroup(#[from] crate::dataplane::ebpf::socket_lb::cgroup::CgroupCheckError),
    #[error("eBPF TC path: {0}")]
    Tc(#[from] crate::dataplane::ebpf::node_path::TcError),
    #[error("eBPF TC path: {0}")]
    Devices(#[from] crate::dataplane::ebpf::node_path::devices::DeviceError),
    #[error("eBPF TC path: reading the node's interfaces: {0}")]
    Interfaces(std::io::Error),
}

struct Tc {
    // Drop order: watcher and expiry timer first (they hold clones of `ebpf`).
    _watcher: AddressWatcher,
    _expiry: ct::ExpiryTimer,
    path: TcPath,
    xdp: XdpPath,
    ebpf: Arc<Mutex<Ebpf>>,
}

/// The ebpf proxy mode (see the module docs).
pub struct EbpfDataplane {
    tc: Option<Tc>,
    sock: ServiceMaps,
    /// The node addresses the watcher saw last (`None` before the first scan).
    addresses: Arc<Mutex<Option<NodeAddresses>>>,
    node_port_cidrs: Vec<IpNet>,
    ct_entries: u32,
    /// Whether a sync reported the connection tables' fill yet (the first one does; later
    /// ones only after purging, the expiry timer every period).
    ct_fill_reported: bool,
    telemetry: Option<Arc<dyn Telemetry>>,
    /// SCTP service ports counted by the last sync (to warn once per change).
    skipped_sctp: usize,
}

/// Service ports of `snap` the eBPF datapath does not translate (SCTP ones).
pub(crate) fn skipped_sctp_ports(snap: &Snapshot) -> usize {
    snap.services
        .values()
        .filter(|s| s.protocol == Protocol::Sctp)
        .count()
}

impl EbpfDataplane {
    pub fn new(cfg: EbpfConfig, telemetry: Option<Arc<dyn Telemetry>>) -> Result<Self, EbpfError> {
        if cfg.ebpf.socket_lb {
            // Refuse a cgroup where socket LB would silently cover nothing (a private cgroup
            // namespace's own mount); see `crate::dataplane::ebpf::socket_lb::cgroup`.
            if let Some(cg) = cfg
                .ebpf
                .cgroup
                .clone()
                .or_else(crate::dataplane::ebpf::socket_lb::cgroup::cgroup2_root)
            {
                crate::dataplane::ebpf::socket_lb::cgroup::check(&cg)?;
            }
        }
        let sock = ServiceMaps::new(cfg.ebpf.clone())?;
        let addresses = Arc::new(Mutex::new(None));
        let tc = if cfg.tc {
            let pins = crate::dataplane::ebpf::pins::pin_dir(&cfg.ebpf.bpffs);
            let tc_cfg = TcConfig {
                pin_dir: Some(pins.join("links")),
                ct_entries: cfg.ebpf.map_sizes.ct,
                ..TcConfig::default()
            };
            let mut ebpf = load_object(&pins, &tc_cfg)?;
            let mut path = TcPath::load(&mut ebpf, tc_cfg)?;
            let ifaces = scan().map_err(EbpfError::Interfaces)?;
            let selected = devices::select(cfg.devices.as_deref(), &ifaces)?;
            for dev in &selected {
                path.attach(&mut ebpf, dev)?;
            }
            let mut xdp = XdpPath::load(&mut ebpf)?;
            for dev in &selected {
                xdp.attach(&mut ebpf, dev, cfg.xdp)?;
            }
            let now = NodeAddresses::from_interfaces(&ifaces, Some(&selected));
            TcPath::set_node_addresses(&mut ebpf, &now.snat_v4())?;
            TcPath::set_node_addresses6(&mut ebpf, &now.snat_v6())?;
            *addresses.lock().expect("poisoned") = Some(now);
            tracing::info!(devices = ?selected, "eBPF TC service path attached");
            let ebpf = Arc::new(Mutex::new(ebpf));
            let (ebpf2, addrs2) = (ebpf.clone(), addresses.clone());
            let watcher = AddressWatcher::spawn(Some(selected), ADDRESS_POLL, move |a| {
                let mut ebpf = ebpf2.lock().expect("poisoned");
                if let Err(e) = TcPath::set_node_addresses(&mut ebpf, &a.snat_v4())
                    .and_then(|()| TcPath::set_node_addresses6(&mut ebpf, &a.snat_v6()))
                {
                    tracing::warn!(error = %e, "cannot update the TC path's SNAT addresses");
                }
                drop(ebpf);
                *addrs2.lock().expect("poisoned") = Some(a.clone());
            });
            let (m, ct_entries) = (telemetry.clone(), cfg.ebpf.map_sizes.ct);
            let expiry = ct::ExpiryTimer::spawn(ebpf.clone(), cfg.ct_timeouts, move |ebpf| {
                if let Some(m) = &m {
                    report_ct_fill(m.as_ref(), ebpf, ct_entries);
                }
            });
            Some(Tc {
                _watcher: watcher,
                _expiry: expiry,
                path,
                xdp,
                ebpf,
            })
        } else {
            None
        };
        Ok(EbpfDataplane {
            tc,
            sock,
            addresses,
            node_port_cidrs: cfg.node_port_cidrs,
            ct_entries: cfg.ebpf.map_sizes.ct,
            ct_fill_reported: false,
            telemetry,
            skipped_sctp: 0,
        })
    }

    /// The socket-LB / service-map datapath.
    pub fn service_maps(&self) -> &ServiceMaps {
        &self.sock
    }

    /// Devices the XDP early-drop program is attached to.
    pub fn xdp_devices(&self) -> Vec<String> {
        self.tc
            .as_ref()
            .map(|t| t.xdp.attached())
            .unwrap_or_default()
    }

    /// Enables or disables the XDP forwarding fast path on `device` (one the XDP program is
    /// attached to), overriding the driver default (`node_path::xdp`, off for veth): for veth
    /// setups prepared as that module describes, e.g. tests. `device` is resolved in the calling
    /// thread's network namespace.
    pub fn set_xdp_fast_path(&self, device: &str, on: bool) -> Result<(), EbpfError> {
        if let Some(tc) = &self.tc {
            let mut ebpf = tc.ebpf.lock().expect("poisoned");
            XdpPath::set_fast_path(&mut ebpf, device, on)?;
        }
        Ok(())
    }

    /// Devices the TC path is attached to.
    pub fn tc_devices(&self) -> Vec<String> {
        self.tc
            .as_ref()
            .map(|t| t.path.attached())
            .unwrap_or_default()
    }

    fn node_port_addresses(&self) -> Option<Vec<IpAddr>> {
        let a = self.addresses.lock().expect("poisoned");
        let all = a.as_ref()?.all();
        Some(
            all.into_iter()
                .filter(|ip| {
                    self.node_port_cidrs.is_empty()
                        || self.node_port_cidrs.iter().any(|c| c.contains(ip))
                })
                .collect(),
        )
    }

    fn after_sync(&mut self) {
        let removed = self.sock.removed_backends();
        if let Some(tc) = &self.tc {
            let mut ebpf = tc.ebpf.lock().expect("poisoned");
            // Idle and closed flows are the expiry timer's alone (each pass dumps both tables,
            // ≈ 2 syscalls per entry); after a sync only the flows of removed backends go, and
            // the tables are dumped only when there are some.
            let purged = match ct::purge_backends(&mut ebpf, removed) {
                Ok(n) => {
                    if n > 0 {
                        tracing::debug!(entries = n, "purged CT entries of removed backends");
                    }
                    n
                }
                Err(e) => {
                    tracing::warn!(error = %e, "purging CT entries of removed backends");
                    0
                }
            };
            if let Some(m) = &self.telemetry {
                if purged > 0 || !self.ct_fill_reported {
                    report_ct_fill(m.as_ref(), &ebpf, self.ct_entries);
                    self.ct_fill_reported = true;
                } else {
                    report_snat_failures(m.as_ref(), &ebpf);
                }
            }
        }
        if let Some(m) = &self.telemetry {
            for p in self.sock.map_pressure() {
                m.bpf_map(p.map, p.entries as i64, i64::from(p.capacity));
            }
        }
    }
}

/// Reports the new flows dropped for want of a SNAT port (`kproxy_bpf_snat_failures_total`).
fn report_snat_failures(m: &dyn Telemetry, ebpf: &Ebpf) {
    if let Ok(stats) = TcPath::stats(ebpf)
        && let Some(n) = stats.get(stat_name(TcStat::SnatExhausted))
    {
        m.snat_failures(*n);
    }
}

/// Reports the connection tables' fill (`kproxy_bpf_map_*{map="ct"|"ct6"}`) and the new
/// flows dropped for want of a SNAT port (`kproxy_bpf_snat_failures_total`).
fn report_ct_fill(m: &dyn Telemetry, ebpf: &Ebpf, capacity: u32) {
    report_snat_failures(m, ebpf);
    if let Ok(entries) = ct::entries(ebpf) {
        m.bpf_map("ct", entries.len() as i64, i64::from(capacity));
    }
    if let Ok(entries) = ct::entries6(ebpf) {
        m.bpf_map("ct6", entries.len() as i64, i64::from(capacity));
    }
}

impl Dataplane for EbpfDataplane {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        if let Some(addrs) = self.node_port_addresses() {
            self.sock.set_node_addresses(addrs);
        }
        let report = self.sock.sync(snap, changed)?;
        self.after_sync();
        let sctp = skipped_sctp_ports(snap);
        if sctp != self.skipped_sctp && sctp > 0 {
            tracing::warn!(
                service_ports = sctp,
                "SCTP service ports are not translated by the eBPF datapath (no socket-LB or TC \
                 translation for SCTP); use --proxy-mode iptables or ipvs for SCTP services"
            );
        }
        self.skipped_sctp = sctp;
        if let Some(m) = &self.telemetry {
            m.skipped_service_ports("SCTP", sctp as i64);
        }
        Ok(report)
    }

    fn cleanup(&mut self) -> Result<(), CleanupError> {
        // Removing the pin directory unpins the TC and socket-LB links (detaching them) and
        // the maps.
        self.tc = None;
        self.sock.cleanup()
    }
}
