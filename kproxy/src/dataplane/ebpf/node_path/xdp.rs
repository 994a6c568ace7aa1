//! [`XdpPath`]: the XDP program of the node-device service path (`kp_xdp`,
//! `kproxy-ebpf/src/xdp.rs` + `xdp_fwd.rs`), attached beside the TC programs per `--bpf-xdp`
//! ([`XdpPolicy`]).
//!
//! What it does, per packet (details in the BPF modules' docs):
//! - **early drop** of new flows TC would drop anyway (loadBalancerSourceRanges denials,
//!   frontends without endpoints that drop rather than reject);
//! - **forwarding fast path** (IPv4 TCP/UDP) for flows whose backend is on another node:
//!   client → backend (DNAT + SNAT) and the backend's replies (reverse SNAT + reverse DNAT),
//!   with TTL − 1, checksums updated by hand, `bpf_fib_lookup` for the next hop and
//!   `XDP_TX` / `XDP_REDIRECT`. New flows get TC's own backend choice (random, ClientIP
//!   affinity, Maglev) and TC's own CT entries and SNAT port allocation (shared BPF code,
//!   `kproxy-ebpf/src/flow.rs`), so a flow may start in XDP and continue in TC or the other way
//!   round (attaching or detaching XDP never breaks a flow);
//! - everything else is **passed** to the stack and TC unchanged: local backends, ICMP, IP
//!   options, fragments, TTL ≤ 1, frames over the egress MTU, FIB misses (no route, neighbour
//!   not yet resolved: the stack resolves it and later packets take the fast path), devices
//!   not enabled for the fast path. Counters: [`XdpPath::stats`] (`kproxy_common::ct::XdpStat`).
//!
//! **Forwarding cache.** An established flow's FIB answer (egress device, MTU, MACs) and its
//! rewritten source are cached in the flow's first-looked-up CT entry per direction
//! (`kproxy_common::ct::FwdCache`), so its packets skip `bpf_fib_lookup` and a second CT
//! lookup. The cache is valid under one generation (`KP_FWD_GEN`): `FwdGen` draws a random
//! one at the first attach and moves it on every rtnetlink announcement of a link, address,
//! route, rule or neighbour change in the devices' namespace
//! (`crate::kernel::route_events`), so a changed route or neighbour is seen by each flow's
//! next packet (after the few milliseconds the notification takes). Without notifications,
//! or once this is dropped, the generation is 0 and every packet looks its route up.
//!
//! **Per-backend cache of new flows.** A new flow's route (egress device, MTU, MACs) and the
//! egress device's node address are also kept per CPU per backend (`KP_BE_FWD`,
//! `kproxy_common::ct::BackendFwd`), so the next new flow to that backend skips the FIB and
//! node-address lookups under the same generation and checks. That lookup uses the client's
//! address as source; one answer serves every client only while the namespace's routing
//! ignores the source: the kernel's default policy rules only and no multipath or TOS-keyed
//! routes (`crate::kernel::routing_policy`). `FwdGen` reads that on start and after every
//! announcement and allows the cache (`KP_FWD_GEN[FWD_GEN_PER_BACKEND]`) only then; otherwise
//! every new flow looks its route up. Rewriting `KP_NODE_ADDR4`
//! ([`super::TcPath::set_node_addresses`]) moves the generation (`move_generation`), since
//! the address watcher polls and may write after the announcement already moved it.
//!
//! **Redirect choice.** Frames leave through `bpf_redirect(ifindex)` (or `XDP_TX` when the
//! egress device is the ingress one), not a DEVMAP: the egress device comes from the FIB and
//! can be any device, and no per-device map state has to follow devices coming and going.
//! The cost is the per-packet redirect without DEVMAP bulking; a DEVMAP can replace it later
//! without changing the CT side. Which devices the fast path may use (in and out) is the
//! unpinned `KP_XDP_FWD_DEVS` array (by ifindex) this instance writes on [`XdpPath::attach`]; a frame whose
//! ingress or FIB egress device is not in it is passed to TC.
//!
//! **veth.** A device is enabled for the fast path when its driver is not `veth`
//! (`fast_path_by_default`); the early drop works everywhere. Two kernel facts make a veth a
//! poor fast-path device unless its surroundings are prepared: a frame sent into a veth by
//! `XDP_TX` / `XDP_REDIRECT` is only received when the veth's *peer* runs an XDP program (or
//! has GRO on) — otherwise it is dropped; and frames a veth receives from a local sender carry
//! CHECKSUM_PARTIAL (only the pseudo-header sum in the checksum field), which XDP cannot see
//! and would forward incomplete. Physical NICs hand XDP complete frames. Tests that use veth
//! prepare the peers (a passing XDP program, transmit checksum offload off) and opt in with
//! [`XdpPath::set_fast_path`].
//!
//! Differences from upstream kube-proxy: upstream has no XDP path; the fast path translates
//! like the TC path (see `super` for TC's own differences), with one addition: packets it
//! forwards skip the node's netfilter (like Cilium's XDP NodePort acceleration), so host
//! firewall rules on FORWARD/POSTROUTING do not see them.
//!
//! Links are not pinned: they live as long as the agent's object instance. A restarted agent
//! attaches again (between the two, TC alone handles the traffic, with the same result).

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};

use aya::Ebpf;
use aya::maps::{Array, Map, MapData, MapError, PerCpuArray};
use aya::programs::{Xdp, XdpMode, xdp::XdpLinkId};
use aya::sys::SyscallError;
use kproxy_common::ct::{
    FWD_GEN_CURRENT, FWD_GEN_PER_BACKEND, MAP_FWD_GEN, MAP_XDP_FWD_DEVS, MAP_XDP_STATS, PROG_XDP,
    XDP_FWD_DEVS_MAX, XdpStat,
};

use crate::dataplane::ebpf::node_path::TcError;
use crate::kernel::route_events::{Batch, RouteWatch};
use crate::kernel::routing_policy;

pub use crate::dataplane::settings::XdpPolicy;

/// The XDP program of one loaded object and the devices it is attached to.
pub struct XdpPath {
    attached: BTreeMap<String, XdpLinkId>,
    /// The forwarding caches' generation, followed from the first attach on (in that
    /// thread's network namespace, the devices').
    fwd_gen: Option<FwdGen>,
}

/// The XDP program of `ebpf` (`kproxy_common::ct::PROG_XDP`).
pub fn program(ebpf: &mut Ebpf) -> Result<&mut Xdp, TcError> {
    ebpf.program_mut(PROG_XDP)
        .ok_or(TcError::MissingProgram(PROG_XDP))?
        .try_into()
        .map_err(|error| TcError::Program {
            name: PROG_XDP,
            error,
        })
}

impl XdpPath {
    /// Loads `kp_xdp` from `ebpf` (the TC path's object instance, sharing its pinned maps).
    pub fn load(ebpf: &mut Ebpf) -> Result<XdpPath, TcError> {
        let prog = program(ebpf)?;
        if prog.fd().is_err() {
            prog.load().map_err(|error| TcError::Program {
                name: PROG_XDP,
                error,
            })?;
        }
        Ok(XdpPath {
            attached: BTreeMap::new(),
            fwd_gen: None,
        })
    }

    /// Attaches to `device` (in the calling thread's network namespace) as `policy` says.
    /// Returns whether the program is attached there. The first attach turns the fast
    /// path's forwarding caches on and makes them follow that namespace's routing changes
    /// (`FwdGen`).
    pub fn attach(
        &mut self,
        ebpf: &mut Ebpf,
        device: &str,
        policy: XdpPolicy,
    ) -> Result<bool, TcError> {
        if policy == XdpPolicy::Off {
            return Ok(false);
        }
        if self.attached.contains_key(device) {
            return Ok(true);
        }
        match program(ebpf)?.attach(device, XdpMode::Driver) {
            Ok(id) => {
                self.attached.insert(device.to_string(), id);
                self.cache_routes(ebpf)?;
                // A driver that cannot be read is not trusted with the fast path.
                let driver = driver(device).unwrap_or_else(|e| {
                    tracing::warn!(device, error = %e, "reading the device's driver");
                    String::new()
                });
                let fast = !driver.is_empty() && fast_path_by_default(&driver);
                Self::set_fast_path(ebpf, device, fast)?;
                tracing::info!(
                    device,
                    driver,
                    fast_path = fast,
                    "XDP attached (native): early drop{}",
                    if fast {
                        " and forwarding fast path"
                    } else {
                        ""
                    }
                );
                Ok(true)
            }
            Err(e) if policy == XdpPolicy::BestEffort => {
                tracing::warn!(device, error = %e, "no native XDP on this device: TC only");
                Ok(false)
            }
            Err(e) => Err(TcError::Attach {
                name: PROG_XDP,
                device: device.to_string(),
                error: format!("native XDP (bpf.xdp native): {e}"),
            }),
        }
    }

    /// Turns the forwarding caches on and makes them follow the calling thread's network
    /// namespace's routing changes, as the first [`XdpPath::attach`] does (for test runs of
    /// a program that is not attached; a no-op once on).
    pub fn cache_routes(&mut self, ebpf: &Ebpf) -> Result<(), TcError> {
        if self.fwd_gen.is_none() {
            self.fwd_gen = Some(FwdGen::start(ebpf)?);
        }
        Ok(())
    }

    /// Enables (or disables) `device` (in the calling thread's network namespace) as a
    /// fast-path device: frames arriving on it may be forwarded by XDP, and forwarded frames
    /// may leave through it. See the module docs for veth.
    pub fn set_fast_path(ebpf: &mut Ebpf, device: &str, on: bool) -> Result<(), TcError> {
        let ifindex = nix::net::if_::if_nametoindex(device).map_err(|e| TcError::Attach {
            name: PROG_XDP,
            device: device.to_string(),
            error: format!("no such device: {e}"),
        })?;
        if ifindex >= XDP_FWD_DEVS_MAX {
            if on {
                tracing::warn!(
                    device,
                    ifindex,
                    "ifindex beyond the fast-path device table ({XDP_FWD_DEVS_MAX}): XDP \
                     early drop only on this device"
                );
            }
            return Ok(());
        }
        let name = MAP_XDP_FWD_DEVS;
        let map = ebpf.map_mut(name).ok_or(TcError::MissingMap(name))?;
        let mut set = Array::<_, u32>::try_from(map).map_err(TcError::map(name))?;
        set.set(ifindex, u32::from(on), 0)
            .map_err(TcError::map(name))?;
        Ok(())
    }

    /// Detaches from `device`.
    pub fn detach(&mut self, ebpf: &mut Ebpf, device: &str) -> Result<(), TcError> {
        if self.attached.contains_key(device) {
            // Best effort: the device may be gone already.
            let _ = Self::set_fast_path(ebpf, device, false);
        }
        if let Some(id) = self.attached.remove(device) {
            program(ebpf)?
                .detach(id)
                .map_err(|error| TcError::Program {
                    name: PROG_XDP,
                    error,
                })?;
        }
        Ok(())
    }

    /// Devices the program is attached to.
    pub fn attached(&self) -> Vec<String> {
        self.attached.keys().cloned().collect()
    }

    /// The program's counters, summed over CPUs.
    pub fn stats(ebpf: &Ebpf) -> Result<BTreeMap<&'static str, u64>, TcError> {
        let name = MAP_XDP_STATS;
        let map = ebpf.map(name).ok_or(TcError::MissingMap(name))?;
        let array = PerCpuArray::<_, u64>::try_from(map).map_err(TcError::map(name))?;
        let mut out = BTreeMap::new();
        for s in XdpStat::ALL {
            let v = array.get(&s.index(), 0).map_err(TcError::map(name))?;
            out.insert(stat_name(s), v.iter().sum());
        }
        Ok(out)
    }
}

/// The generation of the XDP fast path's forwarding caches (`KP_FWD_GEN`, see
/// `kproxy-ebpf/src/xdp_fwd.rs` and `kproxy_common::ct::FwdCache`): set to a random non-zero
/// value when the program is loaded (a cache filled by an earlier agent's programs, in a
/// `KP_CT` entry that outlived it, never matches), changed on every routing change the kernel
/// announces ([`RouteWatch`]), and set to 0 (caching off) when this is dropped, since nothing
/// would follow routing changes any more.
struct FwdGen {
    map: Arc<Mutex<Array<MapData, u32>>>,
    _watch: Option<RouteWatch>,
}

impl FwdGen {
    /// Takes a handle on `ebpf`'s `KP_FWD_GEN` and starts following routing changes in the
    /// calling thread's network namespace. Without notifications (the socket cannot be
    /// opened) caching stays off, with a warning.
    fn start(ebpf: &Ebpf) -> Result<FwdGen, TcError> {
        let name = MAP_FWD_GEN;
        let fd = match ebpf.map(name).ok_or(TcError::MissingMap(name))? {
            Map::Array(data) => data.fd().as_fd().try_clone_to_owned().map_err(|e| {
                TcError::map(name)(MapError::SyscallError(SyscallError {
                    call: "dup",
                    io_error: e,
                }))
            })?,
            _ => return Err(TcError::MissingMap(name)),
        };
        let data = MapData::from_fd(fd).map_err(TcError::map(name))?;
        let array = Array::<_, u32>::try_from(Map::Array(data)).map_err(TcError::map(name))?;
        let map = Arc::new(Mutex::new(array));
        let watched = map.clone();
        // The policy check dumps every rule and route: only when routes or rules changed.
        let mut allowed = None;
        let watch = match RouteWatch::spawn(move |batch: Batch| {
            if batch.routes_or_rules || allowed.is_none() {
                allowed = Some(per_backend_allowed());
            }
            bump(&watched, allowed == Some(true));
        }) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "no routing change notifications: the XDP fast path \
                               looks every packet's route up (no forwarding cache)");
                None
            }
        };
        if watch.is_some() {
            // After the watch joined its groups: a change from here on moves it again.
            let _w = FWD_GEN_WRITE.lock().expect("poisoned");
            set(&map, FWD_GEN_CURRENT, fresh_gen());
            set(&map, FWD_GEN_PER_BACKEND, u32::from(per_backend_allowed()));
        }
        Ok(FwdGen { map, _watch: watch })
    }
}

impl Drop for FwdGen {
    fn drop(&mut self) {
        // Stop following first, then turn the caches off.
        self._watch.take();
        let _w = FWD_GEN_WRITE.lock().expect("poisoned");
        set(&self.map, FWD_GEN_PER_BACKEND, 0);
        set(&self.map, FWD_GEN_CURRENT, 0);
    }
}

/// Serializes every read-modify-write of a `KP_FWD_GEN` (the route watcher's thread, the
/// node-address updates of [`move_generation`], the start and the end of caching).
static FWD_GEN_WRITE: Mutex<()> = Mutex::new(());

/// Whether new flows may share a per-backend forwarding cache: the calling thread's network
/// namespace routes IPv4 without looking at the source ([`routing_policy`]); an error reading
/// it counts as no.
fn per_backend_allowed() -> bool {
    routing_policy::source_independent().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "reading the routing policy: no per-backend XDP forwarding \
                       cache");
        false
    })
}

/// Moves the forwarding caches' generation in `ebpf`'s `KP_FWD_GEN` unless caching is off:
/// what the fast path cached from state the agent just rewrote (the node addresses of
/// `KP_NODE_ADDR4`, cached per backend as new flows' SNAT source) is stale.
pub(crate) fn move_generation(ebpf: &mut Ebpf) -> Result<(), TcError> {
    let name = MAP_FWD_GEN;
    let Some(map) = ebpf.map_mut(name) else {
        return Ok(());
    };
    let mut array = Array::<_, u32>::try_from(map).map_err(TcError::map(name))?;
    let _w = FWD_GEN_WRITE.lock().expect("poisoned");
    let old = array.get(&FWD_GEN_CURRENT, 0).map_err(TcError::map(name))?;
    if old != 0 {
        array
            .set(FWD_GEN_CURRENT, next_gen(old), 0)
            .map_err(TcError::map(name))?;
    }
    Ok(())
}

/// The generation after `old` (never 0; a value repeats only after 2^32 changes).
fn next_gen(old: u32) -> u32 {
    old.wrapping_add(1).max(1)
}

/// A random non-zero generation (the first of an object instance).
fn fresh_gen() -> u32 {
    let mut b = [0u8; 4];
    if ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b).is_err() {
        // No randomness: the clock's nanoseconds.
        b = (crate::dataplane::ebpf::node_path::flows::monotonic_ns() as u32).to_ne_bytes();
    }
    u32::from_ne_bytes(b).max(1)
}

fn set(map: &Mutex<Array<MapData, u32>>, index: u32, value: u32) {
    if let Err(e) = map.lock().expect("poisoned").set(index, value, 0) {
        tracing::warn!(error = %e, "cannot write the XDP forwarding-cache generation");
    }
}

/// A routing change: every cached forwarding result is stale, and the per-backend cache is
/// allowed as `per_backend` says (turned off before the generation moves, on after, so no
/// entry is filled under a rule set that does not allow it).
fn bump(map: &Mutex<Array<MapData, u32>>, per_backend: bool) {
    let _w = FWD_GEN_WRITE.lock().expect("poisoned");
    if !per_backend {
        set(map, FWD_GEN_PER_BACKEND, 0);
    }
    let old = map
        .lock()
        .expect("poisoned")
        .get(&FWD_GEN_CURRENT, 0)
        .unwrap_or(0);
    set(map, FWD_GEN_CURRENT, next_gen(old));
    if per_backend {
        set(map, FWD_GEN_PER_BACKEND, 1);
    }
}

/// Whether a device driven by `driver` is a fast-path device unless told otherwise: every
/// driver but `veth` (module docs).
pub(crate) fn fast_path_by_default(driver: &str) -> bool {
    driver != "veth"
}

/// The driver of `device` (in the calling thread's network namespace), as `ethtool -i`
/// reports it (`SIOCETHTOOL` / `ETHTOOL_GDRVINFO`).
pub fn driver(device: &str) -> std::io::Result<String> {
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 32 * 4 + 12 + 4 * 5],
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        data: *mut DrvInfo,
        _pad: [u8; 16],
    }
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GDRVINFO: u32 = 0x03;
    if device.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("device name {device:?} is too long"),
        ));
    }
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        rest: [0; 32 * 4 + 12 + 4 * 5],
    };
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        data: &mut info,
        _pad: [0; 16],
    };
    req.name[..device.len()].copy_from_slice(device.as_bytes());
    // SAFETY: a datagram socket for the ioctl, closed by `OwnedFd`; `req` and `info` outlive
    // the call and have the layout the kernel expects.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let _fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        if libc::ioctl(fd, SIOCETHTOOL, &mut req) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let end = info.driver.iter().position(|b| *b == 0).unwrap_or(32);
    Ok(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// The metric-style name of a counter.
pub(crate) fn stat_name(s: XdpStat) -> &'static str {
    match s {
        XdpStat::SourceRangeDrop => "source_range_drop",
        XdpStat::NoEndpointsDrop => "no_endpoints_drop",
        XdpStat::NewFlow => "new_flow",
        XdpStat::Forward => "forward",
        XdpStat::Reply => "reply",
        XdpStat::PassLocal => "pass_local",
        XdpStat::PassFib => "pass_fib",
        XdpStat::PassMtu => "pass_mtu",
        XdpStat::PassHeader => "pass_header",
        XdpStat::PassState => "pass_state",
        XdpStat::PassDevice => "pass_device",
        XdpStat::NewFlowCached => "new_flow_cached",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_has_a_distinct_name() {
        let names: std::collections::BTreeSet<_> =
            XdpStat::ALL.iter().map(|s| stat_name(*s)).collect();
        assert_eq!(names.len(), XdpStat::ALL.len());
    }

    #[test]
    fn veth_is_not_a_fast_path_device_by_default() {
        assert!(!fast_path_by_default("veth"));
        for d in ["mlx5_core", "ixgbe", "virtio_net", "ena"] {
            assert!(fast_path_by_default(d), "{d}");
        }
    }

    #[test]
    fn driver_of_a_missing_device_is_an_error() {
        // (A veth's driver is read in tests/tests/ebpf/ebpf_xdp_fastpath.rs, inside a test netns.)
        assert!(driver("no-such-dev-kp").is_err());
        assert!(driver("a-device-name-longer-than-ifnamsiz").is_err());
    }
}
