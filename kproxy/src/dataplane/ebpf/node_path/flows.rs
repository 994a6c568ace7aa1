//! Maintenance of the TC path's connection tables: `KP_CT` (IPv4, `kproxy_common::ct`) and
//! `KP_CT6` (IPv6, `kproxy_common::ct6`), treated alike: [`purge_backends`] and [`expire`]
//! cover both and report the sum.
//!
//! - [`purge_backends`]: after a sync removed backends, delete every entry of every flow to
//!   them (the eBPF applier calls it with the removed backend ids), so the next packet of such
//!   a flow is load-balanced afresh instead of being sent to an address that is gone.
//! - [`expire`]: delete flows idle for longer than their state's timeout (the agent runs it
//!   on its own timer only, every [`Timeouts::interval`]; the LRU map also evicts
//!   under pressure, but eviction picks idle *live* flows as readily as dead ones, so closed
//!   flows must go by expiry before the table fills).
//!
//! TCP flows expire like kernel conntrack (nf_conntrack_proto_tcp) expires them, from the
//! close state the programs record in each entry (`kproxy_common::ct::TcpCloseState`):
//! established → [`Timeouts::tcp`]; FIN one way (half-closed, the kernel's FIN_WAIT /
//! CLOSE_WAIT) → [`Timeouts::tcp_closing`] (`--conntrack-tcp-timeout-close-wait`, which upstream
//! writes to `nf_conntrack_tcp_timeout_close_wait`); FIN both ways (LAST_ACK / TIME_WAIT) →
//! [`Timeouts::tcp_time_wait`] (kernel default 120 s); RST (CLOSE) → [`Timeouts::tcp_close`]
//! (kernel default 10 s). Not modelled: the kernel's shorter SYN_RECV / LAST_ACK timers and
//! its 120 s FIN_WAIT before the FIN is acknowledged (the half-closed timeout covers both).
//!
//! Entries of one flow are recognised by what the programs copy into all of them: service id,
//! backend id, protocol and creation time. A flow's idle time is that of its most recently
//! used entry, so a one-way UDP stream does not lose its reverse entries while it is alive.
//! Planning (`plan_purge`, `plan_expiry`) is pure; the map I/O is a dump and deletes.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aya::Ebpf;
use aya::Pod;
use aya::maps::HashMap as BpfHashMap;
use kproxy_common::ct::{
    CT_F_CLOSE_MASK, CtEntry, CtKey, DEFAULT_TCP_TIMEOUT_SECS, DEFAULT_UDP_TIMEOUT_SECS, MAP_CT,
    TcpCloseState,
};
use kproxy_common::ct6::{CtEntry6, CtKey6, MAP_CT6};
use kproxy_common::service::PROTO_TCP;

use crate::dataplane::ebpf::node_path::TcError;
use kproxy_common::ct::{
    DEFAULT_CT_EXPIRY_INTERVAL_SECS, DEFAULT_CT_TCP_CLOSE_SECS, DEFAULT_CT_TCP_TIME_WAIT_SECS,
};

/// Idle timeouts of [`expire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Established TCP (kube-proxy `--conntrack-tcp-timeout-established`).
    pub tcp: Duration,
    /// Half-closed TCP: a FIN in one direction only (kube-proxy
    /// `--conntrack-tcp-timeout-close-wait`).
    pub tcp_closing: Duration,
    /// Closed TCP: a FIN in both directions (kernel `nf_conntrack_tcp_timeout_time_wait`;
    /// kproxy extension `bpf.conntrack.tcpTimeWaitTimeout`).
    pub tcp_time_wait: Duration,
    /// Reset TCP: a RST seen (kernel `nf_conntrack_tcp_timeout_close`; kproxy extension
    /// `bpf.conntrack.tcpCloseTimeout`).
    pub tcp_close: Duration,
    /// UDP (and everything else).
    pub udp: Duration,
    /// How often the agent runs [`expire`] on its own timer (kproxy extension
    /// `bpf.conntrack.expiryInterval`).
    pub interval: Duration,
}

/// Kernel default of `nf_conntrack_tcp_timeout_close_wait` (upstream kube-proxy raises it to
/// 1 h through `--conntrack-tcp-timeout-close-wait`, which the agent passes on).
pub(crate) const DEFAULT_TCP_CLOSE_WAIT: Duration = Duration::from_secs(60);
/// Kernel default of `nf_conntrack_tcp_timeout_time_wait`.
pub(crate) const DEFAULT_TCP_TIME_WAIT: Duration =
    Duration::from_secs(DEFAULT_CT_TCP_TIME_WAIT_SECS);
/// Kernel default of `nf_conntrack_tcp_timeout_close`.
pub(crate) const DEFAULT_TCP_CLOSE: Duration = Duration::from_secs(DEFAULT_CT_TCP_CLOSE_SECS);
/// Default period of the agent's expiry timer: a closed flow's entries are gone at most this
/// long after its timeout. Each run dumps the tables (≈ 2 syscalls per entry).
pub(crate) const DEFAULT_EXPIRY_INTERVAL: Duration =
    Duration::from_secs(DEFAULT_CT_EXPIRY_INTERVAL_SECS);

impl Timeouts {
    /// The idle timeout of a flow of protocol `proto` whose entries' flags ORed are `flags`.
    pub(crate) fn of(&self, proto: u8, flags: u16) -> Duration {
        if proto != PROTO_TCP {
            return self.udp;
        }
        match TcpCloseState::of(flags) {
            TcpCloseState::Open => self.tcp,
            TcpCloseState::HalfClosed | TcpCloseState::Legacy => self.tcp_closing,
            TcpCloseState::Closed => self.tcp_time_wait,
            TcpCloseState::Reset => self.tcp_close,
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            tcp: Duration::from_secs(DEFAULT_TCP_TIMEOUT_SECS.into()),
            tcp_closing: DEFAULT_TCP_CLOSE_WAIT,
            tcp_time_wait: DEFAULT_TCP_TIME_WAIT,
            tcp_close: DEFAULT_TCP_CLOSE,
            udp: Duration::from_secs(DEFAULT_UDP_TIMEOUT_SECS.into()),
            interval: DEFAULT_EXPIRY_INTERVAL,
        }
    }
}

/// What maintenance reads of a connection-table key ([`CtKey`], [`CtKey6`]).
pub(crate) trait FlowKey: Pod + std::hash::Hash + Eq {
    fn proto(&self) -> u8;
}

/// What maintenance reads of a connection-table entry ([`CtEntry`], [`CtEntry6`]).
pub(crate) trait FlowEntry: Pod {
    fn backend_id(&self) -> u32;
    fn svc_id(&self) -> u32;
    fn flags(&self) -> u16;
    fn created_ns(&self) -> u64;
    fn last_seen_ns(&self) -> u64;
}

impl FlowKey for CtKey {
    fn proto(&self) -> u8 {
        self.proto
    }
}

impl FlowKey for CtKey6 {
    fn proto(&self) -> u8 {
        self.proto
    }
}

macro_rules! flow_entry {
    ($t:ty) => {
        impl FlowEntry for $t {
            fn backend_id(&self) -> u32 {
                self.backend_id
            }
            fn svc_id(&self) -> u32 {
                self.svc_id
            }
            fn flags(&self) -> u16 {
                self.flags
            }
            fn created_ns(&self) -> u64 {
                self.created_ns
            }
            fn last_seen_ns(&self) -> u64 {
                self.last_seen_ns
            }
        }
    };
}
flow_entry!(CtEntry);
flow_entry!(CtEntry6);

/// The key every entry of one flow shares.
type FlowId = (u32, u32, u8, u64);

fn flow_id<K: FlowKey, E: FlowEntry>(k: &K, e: &E) -> FlowId {
    (e.svc_id(), e.backend_id(), k.proto(), e.created_ns())
}

/// The keys of entries whose backend is in `removed`.
pub(crate) fn plan_purge<K: FlowKey, E: FlowEntry>(
    entries: &[(K, E)],
    removed: &HashSet<u32>,
) -> Vec<K> {
    entries
        .iter()
        .filter(|(_, e)| removed.contains(&e.backend_id()))
        .map(|(k, _)| *k)
        .collect()
}

/// The keys of entries whose flow was idle longer than its timeout at `now_ns`
/// (CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`).
pub(crate) fn plan_expiry<K: FlowKey, E: FlowEntry>(
    entries: &[(K, E)],
    now_ns: u64,
    t: &Timeouts,
) -> Vec<K> {
    // Per flow: the most recent use and the close bits of all its entries (each entry sees
    // one direction or both, so only the union tells whether both sides sent a FIN).
    let mut flows: HashMap<FlowId, (u64, u16)> = HashMap::new();
    for (k, e) in entries {
        let f = flows.entry(flow_id(k, e)).or_insert((0, 0));
        f.0 = f.0.max(e.last_seen_ns());
        f.1 |= e.flags() & CT_F_CLOSE_MASK;
    }
    entries
        .iter()
        .filter(|(k, e)| {
            let (last, flags) = flows[&flow_id(k, e)];
            let timeout = t.of(k.proto(), flags);
            now_ns.saturating_sub(last) > timeout.as_nanos() as u64
        })
        .map(|(k, _)| *k)
        .collect()
}

fn entries_of<K: FlowKey, E: FlowEntry>(
    ebpf: &Ebpf,
    name: &'static str,
) -> Result<Vec<(K, E)>, TcError> {
    let map = ebpf.map(name).ok_or(TcError::MissingMap(name))?;
    let table = BpfHashMap::<_, K, E>::try_from(map).map_err(TcError::map(name))?;
    // Entries deleted while iterating end the walk early at worst; callers re-run later.
    Ok(table.iter().filter_map(Result::ok).collect())
}

/// Every entry of the IPv4 table.
pub(crate) fn entries(ebpf: &Ebpf) -> Result<Vec<(CtKey, CtEntry)>, TcError> {
    entries_of(ebpf, MAP_CT)
}

/// Every entry of the IPv6 table.
pub(crate) fn entries6(ebpf: &Ebpf) -> Result<Vec<(CtKey6, CtEntry6)>, TcError> {
    entries_of(ebpf, MAP_CT6)
}

/// Deletes the entries at `keys` of the dump `dumped` (whose entries they were planned from)
/// that still belong to the same flow. The programs may have replaced an entry since the
/// dump — a SYN on a closed flow's tuple ends the flow and records a new one under the same
/// keys (`kproxy-ebpf/src/flow.rs`, `reopens`) —, so each is read again and deleted only if
/// its creation time is the dumped one (a lookup, then the delete: the window left is that
/// of two syscalls, not of the whole dump).
fn delete<K: FlowKey, E: FlowEntry>(
    ebpf: &mut Ebpf,
    name: &'static str,
    keys: &[K],
    dumped: &[(K, E)],
) -> Result<usize, TcError> {
    if keys.is_empty() {
        return Ok(0);
    }
    let created: HashMap<K, u64> = dumped.iter().map(|(k, e)| (*k, e.created_ns())).collect();
    let map = ebpf.map_mut(name).ok_or(TcError::MissingMap(name))?;
    let mut table = BpfHashMap::<_, K, E>::try_from(map).map_err(TcError::map(name))?;
    // An entry the LRU evicted meanwhile is already gone: not an error.
    Ok(keys
        .iter()
        .filter(|k| {
            let same = table
                .get(k, 0)
                .is_ok_and(|e| created.get(k) == Some(&e.created_ns()));
            same && table.remove(k).is_ok()
        })
        .count())
}

/// Deletes every connection-table entry (IPv4 and IPv6) of flows to the backends `removed`;
/// returns how many entries were deleted.
pub fn purge_backends(ebpf: &mut Ebpf, removed: &[u32]) -> Result<usize, TcError> {
    if removed.is_empty() {
        return Ok(0);
    }
    let removed: HashSet<u32> = removed.iter().copied().collect();
    let dump = entries(ebpf)?;
    let keys = plan_purge(&dump, &removed);
    let mut n = delete(ebpf, MAP_CT, &keys, &dump)?;
    let dump6 = entries6(ebpf)?;
    let keys6 = plan_purge(&dump6, &removed);
    n += delete(ebpf, MAP_CT6, &keys6, &dump6)?;
    Ok(n)
}

/// Deletes idle flows (IPv4 and IPv6); returns how many entries were deleted.
pub fn expire(ebpf: &mut Ebpf, timeouts: &Timeouts) -> Result<usize, TcError> {
    let now = monotonic_ns();
    let dump = entries(ebpf)?;
    let keys = plan_expiry(&dump, now, timeouts);
    let mut n = delete(ebpf, MAP_CT, &keys, &dump)?;
    let dump6 = entries6(ebpf)?;
    let keys6 = plan_expiry(&dump6, now, timeouts);
    n += delete(ebpf, MAP_CT6, &keys6, &dump6)?;
    Ok(n)
}

/// [`expire`] on its own thread every [`Timeouts::interval`], so closed flows leave the tables
/// whether or not syncs happen (a quiet cluster may not sync for an hour). Stopped (and
/// joined) on drop. `after` runs after each pass with the table it expired (for metrics).
pub(crate) struct ExpiryTimer {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ExpiryTimer {
    pub(crate) fn spawn<F>(ebpf: Arc<Mutex<Ebpf>>, timeouts: Timeouts, mut after: F) -> Self
    where
        F: FnMut(&Ebpf) + Send + 'static,
    {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let interval = timeouts.interval.max(Duration::from_millis(100));
        let thread = std::thread::Builder::new()
            .name("kp-ct-expiry".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
                    let mut ebpf = ebpf.lock().expect("poisoned");
                    match expire(&mut ebpf, &timeouts) {
                        Ok(0) => {}
                        Ok(n) => tracing::debug!(entries = n, "expired idle CT entries"),
                        Err(e) => tracing::warn!(error = %e, "expiring idle CT entries"),
                    }
                    after(&ebpf);
                }
            })
            .expect("spawning the CT expiry thread");
        ExpiryTimer {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for ExpiryTimer {
    fn drop(&mut self) {
        // Dropping the sender wakes the thread (Disconnected) at once.
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the clock the programs stamp entries with).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_MONOTONIC always exists.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_common::ct::CtKind;
    use kproxy_common::service::PROTO_UDP;

    const S: u64 = 1_000_000_000;

    fn entry(kind: CtKind, proto: u8, backend: u32, created: u64, seen: u64) -> (CtKey, CtEntry) {
        (
            CtKey {
                saddr: backend * 100 + kind as u32,
                proto,
                kind: kind as u8,
                ..CtKey::default()
            },
            CtEntry {
                backend_id: backend,
                svc_id: 1,
                created_ns: created,
                last_seen_ns: seen,
                ..CtEntry::default()
            },
        )
    }

    #[test]
    fn purge_takes_every_entry_of_the_removed_backends_only() {
        let entries = vec![
            entry(CtKind::Service, PROTO_TCP, 1, 0, 0),
            entry(CtKind::RevDnat, PROTO_TCP, 1, 0, 0),
            entry(CtKind::Service, PROTO_TCP, 2, 0, 0),
            entry(CtKind::SnatIn, PROTO_TCP, 3, 0, 0),
        ];
        let purged = plan_purge(&entries, &[1, 3].into_iter().collect());
        assert_eq!(purged, vec![entries[0].0, entries[1].0, entries[3].0]);
    }

    #[test]
    fn a_flow_lives_as_long_as_its_most_recent_entry() {
        let t = Timeouts::default();
        let now = 1000 * S;
        // One UDP flow: the forward entry was used just now, the reverse one 200 s ago.
        let entries = vec![
            entry(CtKind::Service, PROTO_UDP, 1, 5, now - S),
            entry(CtKind::RevDnat, PROTO_UDP, 1, 5, now - 200 * S),
            // Another UDP flow idle 200 s: expired.
            entry(CtKind::Service, PROTO_UDP, 2, 6, now - 200 * S),
            // A TCP flow idle 200 s: alive (24 h), unless closing.
            entry(CtKind::Service, PROTO_TCP, 3, 7, now - 200 * S),
        ];
        assert_eq!(plan_expiry(&entries, now, &t), vec![entries[2].0]);
        let mut closing = entries.clone();
        closing[3].1.flags |= kproxy_common::ct::CT_F_CLOSING;
        assert_eq!(
            plan_expiry(&closing, now, &t),
            vec![closing[2].0, closing[3].0]
        );
    }

    #[test]
    fn tcp_flows_expire_by_their_close_state_like_kernel_conntrack() {
        use kproxy_common::ct::{CT_F_CLOSING, CT_F_FIN_ORIG, CT_F_FIN_REPLY, CT_F_RST};
        let t = Timeouts {
            tcp: Duration::from_secs(1000),
            tcp_closing: Duration::from_secs(300),
            tcp_time_wait: Duration::from_secs(120),
            tcp_close: Duration::from_secs(10),
            ..Timeouts::default()
        };
        let now = 10_000 * S;
        // Flow per backend id, each with a Service and a RevDnat entry, idle `idle` seconds;
        // the FIN bits are split over the entries as the programs write them (orig in the
        // Service entry, reply in the RevDnat one).
        let flow = |backend: u32, idle: u64, svc_flags: u16, rev_flags: u16| {
            let mut a = entry(
                CtKind::Service,
                PROTO_TCP,
                backend,
                u64::from(backend),
                now - idle * S,
            );
            let mut b = entry(
                CtKind::RevDnat,
                PROTO_TCP,
                backend,
                u64::from(backend),
                now - idle * S,
            );
            a.1.flags = svc_flags;
            b.1.flags = rev_flags;
            [a, b]
        };
        let entries: Vec<_> = [
            flow(1, 200, 0, 0),                            // established: alive
            flow(2, 200, CT_F_CLOSING | CT_F_FIN_ORIG, 0), // half-closed: alive
            flow(
                3,
                200,
                CT_F_CLOSING | CT_F_FIN_ORIG,
                CT_F_CLOSING | CT_F_FIN_REPLY,
            ), // closed
            flow(
                4,
                100,
                CT_F_CLOSING | CT_F_FIN_ORIG,
                CT_F_CLOSING | CT_F_FIN_REPLY,
            ), // closed, young
            flow(5, 11, 0, CT_F_CLOSING | CT_F_RST),       // reset: gone after 10 s
            flow(6, 400, 0, CT_F_CLOSING | CT_F_FIN_REPLY), // half-closed too long
            flow(7, 200, CT_F_CLOSING, 0),                 // an earlier build's mark
        ]
        .into_iter()
        .flatten()
        .collect();
        let expired: Vec<u32> = plan_expiry(&entries, now, &t)
            .iter()
            .map(|k| k.saddr / 100)
            .collect();
        assert_eq!(expired, vec![3, 3, 5, 5, 6, 6]);
    }

    #[test]
    fn ipv6_entries_are_planned_like_ipv4_ones() {
        let e6 = |backend: u32, proto: u8, seen: u64| {
            (
                CtKey6 {
                    saddr: [backend, 0, 0, 1],
                    proto,
                    kind: CtKind::Service as u8,
                    ..CtKey6::default()
                },
                CtEntry6 {
                    backend_id: backend,
                    svc_id: 1,
                    created_ns: u64::from(backend),
                    last_seen_ns: seen,
                    ..CtEntry6::default()
                },
            )
        };
        let now = 1000 * S;
        let entries = vec![
            e6(1, PROTO_UDP, now - 200 * S),
            e6(2, PROTO_TCP, now - 200 * S),
        ];
        assert_eq!(
            plan_purge(&entries, &[2].into_iter().collect()),
            vec![entries[1].0]
        );
        assert_eq!(
            plan_expiry(&entries, now, &Timeouts::default()),
            vec![entries[0].0]
        );
    }

    #[test]
    fn monotonic_clock_moves_forward() {
        let a = monotonic_ns();
        let b = monotonic_ns();
        assert!(b >= a && a > 0);
    }
}
