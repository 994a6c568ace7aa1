//! Socket-level load balancing (`kproxy_common::sock`): cgroup `sock_addr` programs that
//! rewrite the destination of `connect()` / `sendto()` from a service frontend to a backend, so
//! traffic from the node and its pods never needs per-packet NAT.
//!
//! - `connect4/6` (TCP, connected UDP): look up `{dst, port, proto, SCOPE_CLUSTER}` in
//!   `KP_SERVICES`; pick a backend (affinity by netns cookie, else a random slot, which holds
//!   the backend itself); rewrite the destination; remember `{socket cookie, backend} →
//!   frontend` in `KP_SOCK_RNAT`.
//! - `sendmsg4/6` (unconnected UDP): the same per datagram, except that a socket keeps the
//!   backend it got for a frontend (`KP_SOCK_FWD`) while that backend still holds the same slot
//!   of the frontend's set: one socket's datagrams stay on one backend, as upstream's conntrack
//!   entry for the 5-tuple would keep them.
//! - `recvmsg4/6`, `getpeername4/6`: a source/peer that is a backend this socket was sent to
//!   is reported as the frontend.
//! - `sock_release`: the socket's last file reference closed (kernel ≥ 5.9); its entries go:
//!   the `KP_SOCK_RNAT` entry of its peer (a connected socket's peer is the backend its
//!   connect was rewritten to) and the `KP_SOCK_FWD`/`KP_SOCK_RNAT` entries its sendmsg
//!   created, listed in `KP_SOCK_SENT` (an unconnected socket has no peer to derive them
//!   from). Without this, every socket-LB connect left one entry behind until the LRU evicted
//!   it, and a flood of short connections evicted the entries of long-lived UDP sockets,
//!   whose replies then came from the backend's address (issue #22). Not deleted: the entry
//!   of a connected UDP socket whose peer changed afterwards (`connect(AF_UNSPEC)` or a
//!   reconnect), a TCP connect that failed synchronously (the kernel clears the peer), and
//!   sendmsg pairs beyond `SOCK_SENT_PAIRS` per socket; the LRU still bounds those.
//! - No endpoint at all (`count == 0` with `SVC_F_REJECT`): the syscall fails with
//!   ECONNREFUSED (`bpf_set_retval`). `count == 0` without it (eTP/iTP=Local, no local
//!   endpoint): the address is left alone, so the packet goes to the VIP and is dropped like
//!   upstream's "has no local endpoints" rule (unless something else routes it).
//!
//! Only TCP and UDP sockets are translated. SCTP sockets pass untouched: an SCTP association
//! can use several peer addresses and the kernel has no sock_addr hook for each of them, so SCTP
//! from the node relies on the packet-level (TC) path.
//!
//! No logging here: these run on every connect/sendmsg.

use core::ptr::read_volatile;

use aya_ebpf::{
    EbpfContext,
    helpers::generated::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_ktime_get_ns,
        bpf_set_retval,
    },
    macros::{cgroup_sock, cgroup_sock_addr},
    programs::{SockAddrContext, SockContext},
};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, PROTO_TCP, PROTO_UDP, SCOPE_CLUSTER,
    SVC_F_AFFINITY, SVC_F_REJECT, ServiceKey, SlotValue, SockFwdKey, SockFwdValue, SockRevNatKey,
    SockRevNatValue, SockSentPair, SockSentValue, v4_mapped,
};
use kproxy_common::sock::ERRNO_NO_ENDPOINTS;

use crate::maps::{
    KP_AFFINITY, KP_BACKENDS, KP_BE_SLOTS, KP_SERVICES, KP_SOCK_FWD, KP_SOCK_RNAT, KP_SOCK_SENT,
};

/// Allow the syscall (for connect/sendmsg with the possibly rewritten address).
const ALLOW: i32 = 1;
/// Fail the syscall (with the errno set by `bpf_set_retval`).
const DENY: i32 = 0;

const NSEC_PER_SEC: u64 = 1_000_000_000;

/// `bpf_sock.family` values (include/linux/socket.h).
const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

enum Verdict {
    /// Not a frontend (or nothing to do): leave the address alone.
    Untouched,
    /// Rewritten to this backend.
    Backend([u32; 4], u16),
    /// The service has no endpoints: fail with ECONNREFUSED.
    Reject,
}

#[inline(always)]
fn proto_of(ctx: &SockAddrContext) -> Option<u8> {
    // SAFETY: `ctx.sock_addr` is the kernel's context pointer, valid for the program's run.
    let proto = unsafe { (*ctx.sock_addr).protocol } as u8;
    if proto == PROTO_TCP || proto == PROTO_UDP {
        Some(proto)
    } else {
        None
    }
}

/// The frontend lookup and backend choice shared by connect and sendmsg.
#[inline(always)]
fn translate(
    ctx: &SockAddrContext,
    addr: [u32; 4],
    port: u16,
    proto: u8,
    sendmsg: bool,
) -> Verdict {
    let key = ServiceKey {
        addr,
        port,
        proto,
        scope: SCOPE_CLUSTER,
    };
    let Some(svc) = KP_SERVICES.get_ptr(key) else {
        return Verdict::Untouched;
    };
    // SAFETY: a pointer from a successful lookup; the value is plain data copied out at once.
    let svc = unsafe { *svc };
    if svc.count == 0 {
        return if svc.flags & SVC_F_REJECT != 0 {
            Verdict::Reject
        } else {
            Verdict::Untouched
        };
    }

    let affinity = svc.flags & SVC_F_AFFINITY != 0;
    let mut aff_key = AffinityKey::default();
    // SAFETY: helpers called with the program's own context and no arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if affinity {
        // SAFETY: the context pointer is valid for this helper in sock_addr programs.
        let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
        aff_key = AffinityKey::netns(svc.svc_id, cookie);
        if let Some(entry) = KP_AFFINITY.get_ptr_mut(aff_key) {
            // SAFETY: a pointer from a successful lookup; only this client's connects write it,
            // a racing update at worst loses one refresh.
            let entry = unsafe { &mut *entry };
            let timeout = u64::from(svc.affinity_timeout) * NSEC_PER_SEC;
            if now.wrapping_sub(entry.last_used_ns) <= timeout
                && let Some(be) = KP_BACKENDS.get_ptr(entry.backend_id)
            {
                entry.last_used_ns = now;
                // SAFETY: pointer from a successful lookup.
                let be = unsafe { *be };
                return Verdict::Backend(be.addr, be.port);
            }
        }
    }

    // Unconnected UDP: this socket's earlier choice for this frontend, while still valid.
    let mut fwd_key = SockFwdKey::default();
    if sendmsg {
        fwd_key = SockFwdKey {
            // SAFETY: the context pointer is valid for this helper in sock_addr programs.
            cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
            addr,
            port,
            _pad: [0; 6],
        };
        if let Some(prev) = KP_SOCK_FWD.get_ptr(fwd_key) {
            // SAFETY: pointer from a successful lookup, copied out at once.
            let prev = unsafe { *prev };
            if prev.svc_id == svc.svc_id
                && prev.slot < svc.count
                && let Some(s) = KP_BE_SLOTS.get_ptr(BackendSlotKey {
                    svc_id: svc.svc_id,
                    slot: prev.slot,
                })
                // SAFETY: pointer from a successful lookup.
                && unsafe { (*s).backend_id } == prev.backend_id
            {
                // SAFETY: pointer from a successful lookup.
                let be = unsafe { (*s).backend };
                return Verdict::Backend(be.addr, be.port);
            }
        }
    }

    // SAFETY: no arguments.
    let slot = unsafe { bpf_get_prandom_u32() } % svc.count;
    // The slot holds the backend itself (one lookup).
    let Some(s) = KP_BE_SLOTS.get_ptr(BackendSlotKey {
        svc_id: svc.svc_id,
        slot,
    }) else {
        return Verdict::Untouched;
    };
    // SAFETY: pointer from a successful lookup, copied out at once.
    let SlotValue {
        backend_id,
        backend: be,
    } = unsafe { *s };
    if affinity {
        let value = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns: now,
        };
        // A full LRU map evicts; nothing to do on failure.
        let _ = KP_AFFINITY.insert(aff_key, value, 0);
    }
    if sendmsg {
        let value = SockFwdValue {
            backend_id,
            svc_id: svc.svc_id,
            slot,
            _pad: 0,
        };
        // A full LRU map evicts; at worst the socket's next datagram picks again.
        let _ = KP_SOCK_FWD.insert(fwd_key, value, 0);
        record_sent(
            fwd_key.cookie,
            SockSentPair {
                frontend: addr,
                backend: be.addr,
                frontend_port: port,
                backend_port: be.port,
            },
        );
    }
    Verdict::Backend(be.addr, be.port)
}

/// Remembers which frontend a socket reached through `backend`, for recvmsg/getpeername.
#[inline(always)]
fn remember(ctx: &SockAddrContext, backend: [u32; 4], backend_port: u16, vip: [u32; 4], port: u16) {
    // SAFETY: the context pointer is valid for this helper in sock_addr programs.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevNatKey {
        cookie,
        addr: backend,
        port: backend_port,
        _pad: [0; 6],
    };
    let value = SockRevNatValue {
        addr: vip,
        port,
        _pad: 0,
        svc_id: 0,
    };
    let _ = KP_SOCK_RNAT.insert(key, value, 0);
}

/// The frontend a socket reached through `backend`, if it did.
#[inline(always)]
fn recall(ctx: &SockAddrContext, backend: [u32; 4], port: u16) -> Option<SockRevNatValue> {
    // SAFETY: the context pointer is valid for this helper in sock_addr programs.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = SockRevNatKey {
        cookie,
        addr: backend,
        port,
        _pad: [0; 6],
    };
    // SAFETY: pointer from a successful lookup, copied out at once.
    KP_SOCK_RNAT.get_ptr(key).map(|v| unsafe { *v })
}

/// Lists a new (frontend, backend) pair of an unconnected socket in `KP_SOCK_SENT`, so that
/// its release finds the `KP_SOCK_FWD` and `KP_SOCK_RNAT` keys (see the module docs). A pair
/// already listed is not added twice; a full list stays as it is.
#[inline(always)]
fn record_sent(cookie: u64, pair: SockSentPair) {
    let Some(sent) = KP_SOCK_SENT.get_ptr_mut(cookie) else {
        let mut value = SockSentValue::default();
        value.pairs[0] = pair;
        // A full LRU map evicts; the socket's entries are then left to their maps' LRU.
        let _ = KP_SOCK_SENT.insert(cookie, value, 0);
        return;
    };
    // SAFETY: a pointer from a successful lookup; only this socket's sendmsg writes it (two
    // threads sending on one socket at once may lose a pair: its entries stay to the LRU).
    let sent = unsafe { &mut *sent };
    for slot in sent.pairs.iter_mut() {
        if slot.frontend_port == 0 {
            *slot = pair;
            return;
        }
        if *slot == pair {
            return;
        }
    }
}

/// Deletes the entries of a socket that is being released (see the module docs).
#[inline(always)]
fn forget(ctx: &SockContext) {
    let sk = ctx.sock;
    // SAFETY: `sk` is the kernel's context pointer; these fields are readable in
    // sock_release (dst_port with a 2-byte load).
    let (family, proto, peer_port) = unsafe { ((*sk).family, (*sk).protocol, (*sk).dst_port) };
    if proto != u32::from(PROTO_TCP) && proto != u32::from(PROTO_UDP) {
        return;
    }
    // SAFETY: valid for this helper in cgroup sock programs.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if peer_port != 0 {
        forget_peer(ctx, cookie, family, peer_port);
    }
    if proto == u32::from(PROTO_UDP) {
        forget_sent(cookie);
    }
}

/// Deletes the `KP_SOCK_RNAT` entry of a connected socket's peer (the backend its connect was
/// rewritten to; nothing if the peer is no backend).
#[inline(always)]
fn forget_peer(ctx: &SockContext, cookie: u64, family: u32, peer_port: u16) {
    let sk = ctx.sock;
    // Both families' fields are loaded (volatile, each at a constant offset of the context)
    // before choosing: the verifier rejects a load through a context pointer the compiler
    // moved, e.g. to share one load between the families.
    // SAFETY: `sk` is the kernel's context pointer; dst_ip4 / dst_ip6 are readable (4-byte
    // loads) in every family.
    let (ip4, ip6) = unsafe {
        (
            read_volatile(&raw const (*sk).dst_ip4),
            [
                read_volatile(&raw const (*sk).dst_ip6[0]),
                read_volatile(&raw const (*sk).dst_ip6[1]),
                read_volatile(&raw const (*sk).dst_ip6[2]),
                read_volatile(&raw const (*sk).dst_ip6[3]),
            ],
        )
    };
    let addr = match family {
        AF_INET => v4_mapped(ip4),
        // A dual-stack socket connected to a v4-mapped address holds it v4-mapped, as
        // connect6 recorded it.
        AF_INET6 => ip6,
        _ => return,
    };
    let _ = KP_SOCK_RNAT.remove(SockRevNatKey {
        cookie,
        addr,
        port: peer_port,
        _pad: [0; 6],
    });
}

/// Deletes the `KP_SOCK_FWD` and `KP_SOCK_RNAT` entries an unconnected UDP socket's sendmsg
/// created, as `KP_SOCK_SENT` lists them, and the list.
#[inline(always)]
fn forget_sent(cookie: u64) {
    let Some(sent) = KP_SOCK_SENT.get_ptr(cookie) else {
        return;
    };
    // SAFETY: pointer from a successful lookup, copied out at once.
    let sent = unsafe { *sent };
    for pair in sent.pairs.iter() {
        if pair.frontend_port == 0 {
            break;
        }
        let _ = KP_SOCK_RNAT.remove(SockRevNatKey {
            cookie,
            addr: pair.backend,
            port: pair.backend_port,
            _pad: [0; 6],
        });
        let _ = KP_SOCK_FWD.remove(SockFwdKey {
            cookie,
            addr: pair.frontend,
            port: pair.frontend_port,
            _pad: [0; 6],
        });
    }
    let _ = KP_SOCK_SENT.remove(cookie);
}

#[inline(always)]
fn reject() -> i32 {
    // SAFETY: plain helper call; allowed in connect/sendmsg programs.
    unsafe { bpf_set_retval(-ERRNO_NO_ENDPOINTS) };
    DENY
}

#[inline(always)]
fn forward4(ctx: &SockAddrContext, sendmsg: bool) -> i32 {
    let Some(proto) = proto_of(ctx) else {
        return ALLOW;
    };
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is the kernel's context pointer; these fields are readable in
    // connect4/sendmsg4 (4-byte loads).
    let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16) };
    let vip = v4_mapped(ip);
    match translate(ctx, vip, port, proto, sendmsg) {
        Verdict::Untouched => ALLOW,
        Verdict::Reject => reject(),
        Verdict::Backend(addr, be_port) => {
            // SAFETY: user_ip4/user_port are writable in connect4/sendmsg4 (4-byte stores).
            unsafe {
                (*sa).user_ip4 = addr[3];
                (*sa).user_port = u32::from(be_port);
            }
            remember(ctx, addr, be_port, vip, port);
            ALLOW
        }
    }
}

#[inline(always)]
fn forward6(ctx: &SockAddrContext, sendmsg: bool) -> i32 {
    let Some(proto) = proto_of(ctx) else {
        return ALLOW;
    };
    let sa = ctx.sock_addr;
    // SAFETY: as in `forward4`; user_ip6 is read word by word (4-byte loads).
    let (vip, port) = unsafe {
        (
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ],
            (*sa).user_port as u16,
        )
    };
    match translate(ctx, vip, port, proto, sendmsg) {
        Verdict::Untouched => ALLOW,
        Verdict::Reject => reject(),
        Verdict::Backend(addr, be_port) => {
            // SAFETY: user_ip6/user_port are writable in connect6/sendmsg6 (4-byte stores).
            // A v4 frontend reached through a v4-mapped address on a dual-stack socket has
            // v4 backends, written back v4-mapped.
            unsafe {
                (*sa).user_ip6[0] = addr[0];
                (*sa).user_ip6[1] = addr[1];
                (*sa).user_ip6[2] = addr[2];
                (*sa).user_ip6[3] = addr[3];
                (*sa).user_port = u32::from(be_port);
            }
            remember(ctx, addr, be_port, vip, port);
            ALLOW
        }
    }
}

#[inline(always)]
fn reverse4(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: readable in recvmsg4/getpeername4.
    let (ip, port) = unsafe { ((*sa).user_ip4, (*sa).user_port as u16) };
    if let Some(front) = recall(ctx, v4_mapped(ip), port) {
        // SAFETY: writable in recvmsg4/getpeername4.
        unsafe {
            (*sa).user_ip4 = front.addr[3];
            (*sa).user_port = u32::from(front.port);
        }
    }
    ALLOW
}

#[inline(always)]
fn reverse6(ctx: &SockAddrContext) -> i32 {
    let sa = ctx.sock_addr;
    // SAFETY: readable in recvmsg6/getpeername6.
    let (addr, port) = unsafe {
        (
            [
                (*sa).user_ip6[0],
                (*sa).user_ip6[1],
                (*sa).user_ip6[2],
                (*sa).user_ip6[3],
            ],
            (*sa).user_port as u16,
        )
    };
    if let Some(front) = recall(ctx, addr, port) {
        // SAFETY: writable in recvmsg6/getpeername6.
        unsafe {
            (*sa).user_ip6[0] = front.addr[0];
            (*sa).user_ip6[1] = front.addr[1];
            (*sa).user_ip6[2] = front.addr[2];
            (*sa).user_ip6[3] = front.addr[3];
            (*sa).user_port = u32::from(front.port);
        }
    }
    ALLOW
}

/// `kproxy_common::sock::PROG_SOCK_CONNECT4`.
#[cgroup_sock_addr(connect4)]
pub fn kp_sk_conn4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx, false)
}

/// `kproxy_common::sock::PROG_SOCK_CONNECT6`.
#[cgroup_sock_addr(connect6)]
pub fn kp_sk_conn6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, false)
}

/// `kproxy_common::sock::PROG_SOCK_SENDMSG4`.
#[cgroup_sock_addr(sendmsg4)]
pub fn kp_sk_send4(ctx: SockAddrContext) -> i32 {
    forward4(&ctx, true)
}

/// `kproxy_common::sock::PROG_SOCK_SENDMSG6`.
#[cgroup_sock_addr(sendmsg6)]
pub fn kp_sk_send6(ctx: SockAddrContext) -> i32 {
    forward6(&ctx, true)
}

/// `kproxy_common::sock::PROG_SOCK_RECVMSG4`.
#[cgroup_sock_addr(recvmsg4)]
pub fn kp_sk_recv4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx)
}

/// `kproxy_common::sock::PROG_SOCK_RECVMSG6`.
#[cgroup_sock_addr(recvmsg6)]
pub fn kp_sk_recv6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx)
}

/// `kproxy_common::sock::PROG_SOCK_GETPEERNAME4`.
#[cgroup_sock_addr(getpeername4)]
pub fn kp_sk_peer4(ctx: SockAddrContext) -> i32 {
    reverse4(&ctx)
}

/// `kproxy_common::sock::PROG_SOCK_GETPEERNAME6`.
#[cgroup_sock_addr(getpeername6)]
pub fn kp_sk_peer6(ctx: SockAddrContext) -> i32 {
    reverse6(&ctx)
}

/// `kproxy_common::sock::PROG_SOCK_RELEASE`. The return value is ignored for this hook.
#[cgroup_sock(sock_release)]
pub fn kp_sk_release(ctx: SockContext) -> i32 {
    forget(&ctx);
    ALLOW
}
