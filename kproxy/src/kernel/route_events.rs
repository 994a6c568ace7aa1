//! Routing-state change notifications (rtnetlink multicast groups): [`RouteWatch`] calls back
//! after the kernel announces a change of links, addresses, routes, rules or neighbours
//! (IPv4), in the network namespace of the thread that started it. Used by the eBPF
//! datapath to invalidate the XDP fast path's cached forwarding results
//! (`dataplane::ebpf::node_path::xdp`).
//!
//! The callback runs on the watcher's own thread, at most once per batch of messages read
//! together (a burst of neighbour updates costs one call), and also when the socket overflowed
//! (`ENOBUFS`: messages were lost, so something may have changed). It is told whether the
//! batch held a route or policy-rule announcement ([`Batch::routes_or_rules`], from the
//! messages' types; lost messages count as one): what the routing policy check
//! (`kernel::routing_policy`) reads can change only then, so neighbour and address updates
//! do not cost a dump of every route.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::kernel::netlink::messages;
use crate::kernel::routing_policy::{RTM_DELROUTE, RTM_DELRULE, RTM_NEWROUTE, RTM_NEWRULE};

/// `RTMGRP_*` (uapi `linux/rtnetlink.h`), the legacy group bit masks `bind(2)` takes.
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_NEIGH: u32 = 0x4;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV4_RULE: u32 = 0x80;
/// Every group whose announcements may change what `bpf_fib_lookup` answers for IPv4.
pub const ROUTING_GROUPS: u32 =
    RTMGRP_LINK | RTMGRP_NEIGH | RTMGRP_IPV4_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV4_RULE;

/// Datagrams read after the first one before calling back.
const DRAIN_MAX: usize = 256;

/// How long one receive blocks before the thread checks whether it should stop.
const POLL: Duration = Duration::from_millis(200);

/// A thread that calls back on routing-state changes; stopped (and joined) on drop.
pub struct RouteWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RouteWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteWatch").finish_non_exhaustive()
    }
}

/// An `AF_NETLINK` route socket joined to `groups`, with a receive timeout of [`POLL`].
fn open(groups: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the fd is owned by `OwnedFd` right away.
    let fd = unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(fd)
    };
    // SAFETY: a zeroed sockaddr_nl is valid (pid 0: the kernel assigns one).
    let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    addr.nl_groups = groups;
    // SAFETY: `addr` is a valid sockaddr_nl of the size passed.
    if unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: POLL.as_micros() as libc::suseconds_t,
    };
    // SAFETY: valid fd and an option value of the size passed.
    if unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            size_of::<libc::timeval>() as libc::socklen_t,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// What a batch of announcements held, as [`RouteWatch`]'s callback is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Batch {
    /// A route or policy-rule announcement (`RTM_{NEW,DEL}{ROUTE,RULE}`), or lost messages.
    pub routes_or_rules: bool,
}

/// Whether the netlink datagram `msgs` holds a route or rule announcement (its messages as
/// [`messages`] splits them; a length that does not fit ends the walk).
pub fn announces_routes_or_rules(msgs: &[u8]) -> bool {
    messages(msgs).map_while(Result::ok).any(|m| {
        matches!(
            m.msg_type,
            RTM_NEWROUTE | RTM_DELROUTE | RTM_NEWRULE | RTM_DELRULE
        )
    })
}

/// What one receive saw.
enum Seen {
    /// At least one announcement, or lost ones (`ENOBUFS`); what the batch then holds.
    Change(Batch),
    /// Nothing within the timeout.
    Quiet,
}

/// One receive (`flags`: 0 blocks up to [`POLL`], `MSG_DONTWAIT` does not block).
fn receive(fd: &OwnedFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<Seen> {
    loop {
        // SAFETY: `buf` is a valid writable buffer of the length passed.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags) };
        if n > 0 {
            let routes_or_rules = announces_routes_or_rules(&buf[..n as usize]);
            return Ok(Seen::Change(Batch { routes_or_rules }));
        }
        if n == 0 {
            return Ok(Seen::Quiet);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Ok(Seen::Quiet),
            Some(libc::ENOBUFS) => {
                return Ok(Seen::Change(Batch {
                    routes_or_rules: true,
                }));
            }
            _ => return Err(e),
        }
    }
}

impl RouteWatch {
    /// Joins the rtnetlink groups of [`ROUTING_GROUPS`] in the calling thread's network
    /// namespace (before returning, so no change made after this call is missed) and calls
    /// `on_change` from a thread of its own after each batch of announcements, with what the
    /// batch held.
    pub fn spawn(mut on_change: impl FnMut(Batch) + Send + 'static) -> io::Result<RouteWatch> {
        let fd = open(ROUTING_GROUPS)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kp-route-watch".into())
            .spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while !flag.load(Ordering::Relaxed) {
                    match receive(&fd, &mut buf, 0) {
                        Ok(Seen::Quiet) => continue,
                        Ok(Seen::Change(mut batch)) => {
                            // Drain what is queued (a bounded number: a steady stream
                            // still calls back), then call back once.
                            for _ in 0..DRAIN_MAX {
                                match receive(&fd, &mut buf, libc::MSG_DONTWAIT) {
                                    Ok(Seen::Change(more)) => {
                                        batch.routes_or_rules |= more.routes_or_rules;
                                    }
                                    _ => break,
                                }
                            }
                            on_change(batch);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "routing change notifications failed");
                            on_change(Batch {
                                routes_or_rules: true,
                            });
                            std::thread::sleep(POLL);
                        }
                    }
                }
            })?;
        Ok(RouteWatch {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for RouteWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::netlink::NLMSG_HDRLEN;

    /// A netlink message of type `ty` with `payload` bytes, padded to 4.
    fn msg(ty: u16, payload: usize) -> Vec<u8> {
        let len = NLMSG_HDRLEN + payload;
        let mut m = Vec::new();
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.resize(len.div_ceil(4) * 4, 0);
        m
    }

    const RTM_NEWNEIGH: u16 = 28;
    const RTM_NEWADDR: u16 = 20;
    const RTM_NEWLINK: u16 = 16;

    #[test]
    fn route_and_rule_messages_are_told_apart_from_the_others() {
        for ty in [RTM_NEWROUTE, RTM_DELROUTE, RTM_NEWRULE, RTM_DELRULE] {
            assert!(announces_routes_or_rules(&msg(ty, 44)), "type {ty}");
        }
        for ty in [RTM_NEWNEIGH, RTM_NEWADDR, RTM_NEWLINK] {
            assert!(!announces_routes_or_rules(&msg(ty, 44)), "type {ty}");
        }
        // Several messages in one datagram (unaligned payload lengths): any route counts.
        let mut d = msg(RTM_NEWNEIGH, 37);
        d.extend(msg(RTM_NEWADDR, 5));
        assert!(!announces_routes_or_rules(&d));
        d.extend(msg(RTM_DELROUTE, 1));
        assert!(announces_routes_or_rules(&d));
        // A zero length ends the walk instead of looping; a truncated header is ignored.
        let mut z = msg(RTM_NEWNEIGH, 0);
        z[..4].copy_from_slice(&0u32.to_ne_bytes());
        z.extend(msg(RTM_NEWROUTE, 0));
        assert!(!announces_routes_or_rules(&z));
        assert!(!announces_routes_or_rules(&msg(RTM_NEWROUTE, 0)[..8]));
    }
}
