//! Routing-state change notifications (rtnetlink multicast groups): [`RouteWatch`] calls back
//! after the kernel announces a change of links, addresses, routes, rules or neighbours
//! (IPv4), in the network namespace of the thread that started it. Used by the eBPF
//! datapath to invalidate the XDP fast path's cached forwarding results
//! (`dataplane::ebpf::node_path::xdp`).
//!
//! The callback runs on the watcher's own thread, at most once per batch of messages read
//! together (a burst of neighbour updates costs one call), and also when the socket overflowed
//! (`ENOBUFS`: messages were lost, so something may have changed). Message contents are not
//! parsed: any announcement counts.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

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

/// What one receive saw.
enum Seen {
    /// At least one announcement, or lost ones (`ENOBUFS`).
    Change,
    /// Nothing within the timeout.
    Quiet,
}

/// One receive (`flags`: 0 blocks up to [`POLL`], `MSG_DONTWAIT` does not block).
fn receive(fd: &OwnedFd, buf: &mut [u8], flags: libc::c_int) -> io::Result<Seen> {
    loop {
        // SAFETY: `buf` is a valid writable buffer of the length passed.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), flags) };
        if n > 0 {
            return Ok(Seen::Change);
        }
        if n == 0 {
            return Ok(Seen::Quiet);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Ok(Seen::Quiet),
            Some(libc::ENOBUFS) => return Ok(Seen::Change),
            _ => return Err(e),
        }
    }
}

impl RouteWatch {
    /// Joins the rtnetlink groups of [`ROUTING_GROUPS`] in the calling thread's network
    /// namespace (before returning, so no change made after this call is missed) and calls
    /// `on_change` from a thread of its own after each batch of announcements.
    pub fn spawn(mut on_change: impl FnMut() + Send + 'static) -> io::Result<RouteWatch> {
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
                        Ok(Seen::Change) => {
                            // Drain what is queued (a bounded number: a steady stream
                            // still calls back), then call back once.
                            for _ in 0..DRAIN_MAX {
                                if !matches!(
                                    receive(&fd, &mut buf, libc::MSG_DONTWAIT),
                                    Ok(Seen::Change)
                                ) {
                                    break;
                                }
                            }
                            on_change();
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "routing change notifications failed");
                            on_change();
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
