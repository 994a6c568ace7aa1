//! Stale UDP sockets: after a sync, UDP sockets that socket LB connected to a backend which is
//! no longer in any UDP service are destroyed, so their owners (DNS clients above all) notice at
//! once and open a new socket, which socket LB sends to a live backend. Without this a
//! connected UDP socket keeps sending to the removed address until the application gives up on
//! its own (upstream kube-proxy clears the conntrack entries of removed UDP endpoints for the
//! same reason; with socket LB there is no conntrack entry, the socket itself holds the
//! backend).
//!
//! - [`udp_backends`] (pure): the `(address, port)` of every backend some UDP frontend's set
//!   references, from the service maps' content. A sync's removed backends are the difference
//!   of this before and after the apply (computed from what the applier knows is in the maps,
//!   so the first sync after a restart also catches backends removed while the agent was down).
//! - [`SockDestroyer::destroy`]: for every network namespace on the host ([`network_namespaces`]:
//!   `/proc/*/ns/net` deduplicated by inode, the agent's own first), a dedicated thread enters
//!   it (`setns`) and asks sock_diag ([`crate::dataplane::ebpf::socket_lb::sock_diag`]) for connected UDP sockets whose peer
//!   is a removed backend, then destroys those that socket LB connected: the socket's cookie
//!   and the backend are a key of `KP_SOCK_RNAT` (written by `connect4/6`). A socket the
//!   application connected to the pod address itself is left alone. The kernel aborts a
//!   destroyed socket with `ECONNABORTED` (the next `recv`/`send` fails) and disconnects it.
//!
//! # Kernel requirements
//!
//! `CONFIG_INET_DIAG`, `CONFIG_INET_UDP_DIAG` and `CONFIG_INET_DIAG_DESTROY` (all set on
//! common distribution kernels; checked here on 6.18), `CAP_SYS_ADMIN` (setns) and
//! `CAP_NET_ADMIN`. Without them the first attempt fails, a warning says which and why, and no
//! further attempt is made by this agent: sockets then stay connected to the removed backend
//! (their datagrams are lost) until the application closes them, i.e. the behaviour without
//! this feature. Sockets are found through processes: a socket held only by a process of
//! another network namespace than the socket's (rare) or whose `KP_SOCK_RNAT` entry was
//! evicted (the map is an LRU sized by `--bpf-map-sizes`) is not found.
//!
//! The `bpf_sock_destroy` kfunc from a UDP socket iterator (kernel >= 6.5) would avoid the
//! namespace walk, but aya 0.14 cannot load programs calling kfuncs (no `.ksyms` relocation)
//! and aya-ebpf 0.2 has no iterator program macro, so this uses sock_diag.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use kproxy_common::service::{
    BackendSlotKey, BackendValue, PROTO_UDP, ServiceKey, ServiceValue, SlotValue, SockRevNatKey,
    SockRevNatValue,
};

use crate::dataplane::ebpf::addr::{decode_addr, encode_addr};
use crate::dataplane::ebpf::socket_lb::sock_diag::DiagSocket;
use crate::dataplane::ebpf::socket_lb::sock_diag::UdpSocket;

/// Every backend that a UDP frontend's endpoint set references.
pub(crate) fn udp_backends(
    services: &BTreeMap<ServiceKey, ServiceValue>,
    slots: &BTreeMap<BackendSlotKey, SlotValue>,
    backends: &BTreeMap<u32, BackendValue>,
) -> BTreeSet<SocketAddr> {
    let udp_sets: BTreeSet<u32> = services
        .iter()
        .filter(|(k, _)| k.proto == PROTO_UDP)
        .map(|(_, v)| v.svc_id)
        .collect();
    slots
        .iter()
        .filter(|(k, _)| udp_sets.contains(&k.svc_id))
        .filter_map(|(_, s)| backends.get(&s.backend_id))
        .map(|b| SocketAddr::new(decode_addr(b.addr), u16::from_be(b.port)))
        .collect()
}

/// Every network namespace reachable through `/proc/<pid>/ns/net`, one path per namespace
/// (deduplicated by device and inode), the calling thread's own first.
pub(crate) fn network_namespaces() -> Vec<PathBuf> {
    let mut seen = BTreeSet::new();
    let mut out = vec![];
    let mut add = |path: PathBuf| {
        if let Ok(meta) = std::fs::metadata(&path)
            && seen.insert((meta.dev(), meta.ino()))
        {
            out.push(path);
        }
    };
    add(PathBuf::from("/proc/thread-self/ns/net"));
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let name = entry.file_name();
            if name
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
            {
                add(entry.path().join("ns/net"));
            }
        }
    }
    out
}

/// What one [`SockDestroyer::destroy`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct DestroyOutcome {
    /// Network namespaces searched.
    pub namespaces: usize,
    /// Sockets destroyed.
    pub destroyed: usize,
    /// Connected to a removed backend, but not through socket LB: left alone.
    pub not_balanced: usize,
    /// Per-namespace or per-socket failures (a namespace whose process exited meanwhile is not
    /// one).
    pub errors: Vec<String>,
}

/// Destroys UDP sockets connected through socket LB to removed backends (see the module docs).
pub(crate) struct SockDestroyer {
    rnat: Result<BpfHashMap<MapData, SockRevNatKey, SockRevNatValue>, String>,
    /// Set once the kernel showed it cannot do this (reason logged once).
    disabled: Option<String>,
}

/// An errno that means "this kernel cannot", not "this socket/namespace failed".
fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EPROTONOSUPPORT | libc::EAFNOSUPPORT | libc::EPERM)
    )
}

impl SockDestroyer {
    /// Opens the pinned `KP_SOCK_RNAT` at `rnat_pin`.
    pub(crate) fn new(rnat_pin: &Path) -> Self {
        let rnat = MapData::from_pin(rnat_pin)
            .and_then(Map::from_map_data)
            .and_then(BpfHashMap::try_from)
            .map_err(|e| format!("opening {}: {e}", rnat_pin.display()));
        SockDestroyer {
            rnat,
            disabled: None,
        }
    }

    /// Why destroying is off (the kernel cannot), if it is.
    #[cfg(test)]
    pub fn disabled(&self) -> Option<&str> {
        self.disabled.as_deref()
    }

    fn disable(&mut self, reason: String) {
        tracing::warn!(
            "cannot destroy UDP sockets connected to removed backends: {reason}; they stay \
             connected until their applications close them"
        );
        self.disabled = Some(reason);
    }

    /// Destroys the socket-LB-connected UDP sockets of every network namespace whose peer is
    /// one of `targets`.
    pub(crate) fn destroy(&mut self, targets: &[SocketAddr]) -> DestroyOutcome {
        let mut out = DestroyOutcome::default();
        if targets.is_empty() || self.disabled.is_some() {
            return out;
        }
        let rnat = match &self.rnat {
            Ok(m) => m,
            Err(e) => {
                let reason = e.clone();
                self.disable(reason);
                return out;
            }
        };
        let namespaces = network_namespaces();
        let result = std::thread::scope(|s| {
            s.spawn(|| walk(&namespaces, targets, rnat, &mut out))
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the worker thread panicked")))
        });
        if let Err(e) = result {
            self.disable(format!("sock_diag: {e}"));
        }
        if out.destroyed > 0 || !out.errors.is_empty() {
            tracing::info!(
                destroyed = out.destroyed,
                namespaces = out.namespaces,
                not_balanced = out.not_balanced,
                errors = ?out.errors,
                "destroyed UDP sockets connected to removed backends"
            );
        }
        out
    }
}

/// Runs on a thread of its own (it changes the thread's network namespace). An `Err` means the
/// kernel cannot do this at all.
fn walk(
    namespaces: &[PathBuf],
    targets: &[SocketAddr],
    rnat: &BpfHashMap<MapData, SockRevNatKey, SockRevNatValue>,
    out: &mut DestroyOutcome,
) -> io::Result<()> {
    let families: Vec<u8> = if targets.iter().any(SocketAddr::is_ipv4) {
        vec![libc::AF_INET as u8, libc::AF_INET6 as u8]
    } else {
        vec![libc::AF_INET6 as u8]
    };
    for path in namespaces {
        // The process may have exited since the listing.
        let Ok(ns) = File::open(path) else { continue };
        if let Err(e) = nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET) {
            if e == nix::errno::Errno::EPERM {
                return Err(io::Error::other(format!(
                    "entering {}: {e} (needs CAP_SYS_ADMIN)",
                    path.display()
                )));
            }
            out.errors.push(format!("entering {}: {e}", path.display()));
            continue;
        }
        out.namespaces += 1;
        let mut sock = match DiagSocket::open() {
            Ok(s) => s,
            Err(e) if unsupported(&e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("opening a sock_diag socket: {e} (needs CONFIG_INET_DIAG)"),
                ));
            }
            Err(e) => {
                out.errors.push(format!(
                    "opening a sock_diag socket in {}: {e}",
                    path.display()
                ));
                continue;
            }
        };
        for family in &families {
            let found = match sock.connected_udp(*family, targets) {
                Ok(f) => f,
                // No UDP diag handler (CONFIG_INET_UDP_DIAG unset) answers ENOENT.
                Err(e) if unsupported(&e) || e.raw_os_error() == Some(libc::ENOENT) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("listing UDP sockets: {e} (needs CONFIG_INET_UDP_DIAG)"),
                    ));
                }
                Err(e) => {
                    out.errors
                        .push(format!("listing UDP sockets in {}: {e}", path.display()));
                    continue;
                }
            };
            for s in found {
                destroy_one(&mut sock, &s, rnat, out, path)?;
            }
        }
    }
    Ok(())
}

fn rnat_key(s: &UdpSocket) -> SockRevNatKey {
    let peer = s.peer();
    SockRevNatKey {
        cookie: s.cookie(),
        addr: encode_addr(peer.ip()),
        port: peer.port().to_be(),
        _pad: [0; 6],
    }
}

fn destroy_one(
    sock: &mut DiagSocket,
    s: &UdpSocket,
    rnat: &BpfHashMap<MapData, SockRevNatKey, SockRevNatValue>,
    out: &mut DestroyOutcome,
    ns: &Path,
) -> io::Result<()> {
    if rnat.get(&rnat_key(s), 0).is_err() {
        out.not_balanced += 1;
        return Ok(());
    }
    match sock.destroy(s) {
        Ok(()) => {
            out.destroyed += 1;
            tracing::debug!(local = %s.local(), peer = %s.peer(), ns = %ns.display(),
                "destroyed a UDP socket connected to a removed backend");
            Ok(())
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        Err(e) if unsupported(&e) => Err(io::Error::new(
            e.kind(),
            format!("SOCK_DESTROY: {e} (needs CONFIG_INET_DIAG_DESTROY and CAP_NET_ADMIN)"),
        )),
        Err(e) => {
            out.errors.push(format!(
                "destroying {} -> {} in {}: {e}",
                s.local(),
                s.peer(),
                ns.display()
            ));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_common::service::PROTO_TCP;

    fn key(vip: &str, proto: u8) -> ServiceKey {
        ServiceKey {
            addr: encode_addr(vip.parse().unwrap()),
            port: 53u16.to_be(),
            proto,
            scope: 0,
        }
    }

    fn backend(ip: &str, port: u16) -> BackendValue {
        BackendValue {
            addr: encode_addr(ip.parse().unwrap()),
            port: port.to_be(),
            flags: 0,
            _pad: 0,
        }
    }

    #[test]
    fn only_backends_of_udp_frontends_count() {
        let services = BTreeMap::from([
            (
                key("10.96.0.10", PROTO_UDP),
                ServiceValue {
                    svc_id: 1,
                    count: 2,
                    ..Default::default()
                },
            ),
            (
                key("10.96.0.10", PROTO_TCP),
                ServiceValue {
                    svc_id: 2,
                    count: 1,
                    ..Default::default()
                },
            ),
        ]);
        let backends = BTreeMap::from([
            (10, backend("10.0.0.1", 53)),
            (11, backend("fd00::1", 53)),
            (12, backend("10.0.0.2", 53)),
        ]);
        let slot = |id: u32| SlotValue {
            backend_id: id,
            backend: backends[&id],
        };
        let slots = BTreeMap::from([
            (BackendSlotKey { svc_id: 1, slot: 0 }, slot(10)),
            (BackendSlotKey { svc_id: 1, slot: 1 }, slot(11)),
            (BackendSlotKey { svc_id: 2, slot: 0 }, slot(12)),
        ]);
        let got = udp_backends(&services, &slots, &backends);
        let want: BTreeSet<SocketAddr> = ["10.0.0.1:53", "[fd00::1]:53"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_destroyer_that_cannot_work_says_why_once_and_stops() {
        let mut d = SockDestroyer::new(Path::new("/nonexistent/kproxy/KP_SOCK_RNAT"));
        assert_eq!(d.destroy(&[]), DestroyOutcome::default());
        assert!(d.disabled().is_none(), "nothing to do is not a failure");
        let target: SocketAddr = "10.0.0.1:53".parse().unwrap();
        assert_eq!(d.destroy(&[target]), DestroyOutcome::default());
        let reason = d.disabled().expect("disabled").to_string();
        assert!(
            reason.contains("/nonexistent/kproxy/KP_SOCK_RNAT"),
            "{reason}"
        );
        // Later calls return at once.
        assert_eq!(d.destroy(&[target]), DestroyOutcome::default());
        assert_eq!(d.disabled(), Some(reason.as_str()));
    }

    #[test]
    fn the_own_namespace_comes_first_and_once() {
        let all = network_namespaces();
        assert_eq!(all[0], PathBuf::from("/proc/thread-self/ns/net"));
        let own = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
        let count = all
            .iter()
            .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == own))
            .count();
        assert_eq!(count, 1);
    }
}
