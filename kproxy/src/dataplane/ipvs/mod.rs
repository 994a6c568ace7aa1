//! The IPVS proxier: Kubernetes services as IPVS virtual services (NAT forwarding), the
//! service addresses bound to a dummy interface (`kube-ipvs0`), and upstream's ipsets +
//! iptables rules around them for masquerading, NodePorts and source-range firewalls.
//!
//! Layout (pure planner → thin applier, like every datapath):
//! - `config`: [`IpvsConfig`], what this datapath needs from the resolved configuration.
//! - `plan`: snapshot → `plan::IpvsPlan` (virtual services, real servers, bound addresses,
//!   ipsets, iptables rules); [`render`] prints it.
//! - [`genl`]: the IPVS generic-netlink family, hand-written over `crate::kernel::netlink`
//!   (no maintained crate covers it); `rtnl`: the dummy link and its addresses through the
//!   `rtnetlink` crates. No external tools for IPVS itself.
//! - `netfilter`: `ipset restore` / `iptables-restore` application.
//! - `sysctl`: the sysctls upstream's IPVS mode sets.
//! - `dataplane`: [`IpvsDataplane`], the applier. Each sync diffs the plan against what the
//!   kernel holds (upstream's syncService / syncEndpoint / cleanLegacyService): only differences are
//!   written, so a restarted kproxy (a new instance) reconciles without disturbing live
//!   virtual services. Removed TCP endpoints drain gracefully: their weight drops to 0, and
//!   they are deleted on a later sync once IPVS counts no connections for them (upstream does
//!   this from a one-minute timer; here the runner's periodic syncs do it). UDP/SCTP ones go
//!   at once, like upstream (`expire_nodest_conn` ends their flows). Each sync lists the
//!   virtual services (one dump), but the real servers only of services whose planned real
//!   servers differ from what this instance last wrote, that still hold draining ones, or
//!   that failed — and of every service once per [`RECONCILE_EVERY`], which repairs real
//!   servers changed behind kproxy's back. Upstream lists every service's real servers at
//!   every sync (GetRealServers per service): one netlink dump per virtual service, which
//!   made one endpoint change cost seconds at 1,000 services in the (emulated) guest.
//!   Likewise the ipsets: a sync writes only the entries that differ from what it last wrote
//!   (`ipset -exist restore` of `del`/`add` lines; upstream diffs against `ipset list`),
//!   runs no `ipset` when nothing differs, and rebuilds every set whole (swap) only at the
//!   first sync, after a failure and at each [`RECONCILE_EVERY`] — one endpoint change no
//!   longer rewrites `KUBE-LOOP-BACK`, which holds one entry per local endpoint.
//!
//! Kernel objects live in the network namespace of the thread that called
//! [`IpvsDataplane::new`] (the netlink sockets and a namespace handle for the tools are opened
//! there). Needs `ip_vs` (+ the scheduler's module), `dummy`, ipset ≥ 6.0 and iptables.
//! The host machines here lack IPVS; the tests run in a QEMU guest (`cargo xtask guest`).

pub(crate) mod config;
pub(crate) mod dataplane;
pub(crate) mod face;
pub mod genl;
pub(crate) mod inspect;
pub(crate) mod netfilter;
pub(crate) mod plan;
pub(crate) mod rtnl;
pub(crate) mod sysctl;

pub use config::IpvsConfig;
pub use dataplane::{IpvsDataplane, IpvsInitError, RECONCILE_EVERY, cleanup_leftovers, usable};
pub use plan::render;
