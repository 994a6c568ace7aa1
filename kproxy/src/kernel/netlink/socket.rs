//! A blocking `AF_NETLINK` socket talking to the kernel, in the network namespace of the
//! thread that opened it.
//!
//! The choices the clients used to make each on their own, now made once:
//! - the socket is bound (port id assigned by the kernel) when opened;
//! - sequence numbers start at 1 and skip 0 when they wrap;
//! - a short send is an error (a netlink datagram goes whole or not at all);
//! - `recv` is retried on `EINTR`; every other error (`ENOBUFS` after an overrun, `EAGAIN`
//!   after [`Socket::set_recv_timeout`]) is returned to the caller, who fails the operation;
//! - [`Socket::exchange`] only hands over answers carrying the request's sequence number
//!   (what an earlier, abandoned exchange left in the queue is skipped; the sock_diag dump
//!   used to take any `NLMSG_DONE`);
//! - an exchange ends at `NLMSG_DONE` or `NLMSG_ERROR`; only a request that asked for neither
//!   an ack nor a dump ends at its first answer without `NLM_F_MULTI` (the IPVS client also
//!   ended a dump there; the kernel flags every dump answer `NLM_F_MULTI`, so a dump now
//!   always runs to its `NLMSG_DONE`);
//! - `NLMSG_DONE`'s own error code (a dump that failed half-way) is not read, as before.
//!
//! Per client: the receive timeout, the kernel receive buffer, `NETLINK_CAP_ACK` and the size
//! of the user-space receive buffer ([`Socket::with_recv_len`]).

use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::Duration;

use crate::kernel::netlink::NLM_F_ACK;
use crate::kernel::netlink::NLM_F_DUMP;
use crate::kernel::netlink::NLM_F_MULTI;
use crate::kernel::netlink::NLMSG_DONE;
use crate::kernel::netlink::NLMSG_ERROR;
use crate::kernel::netlink::wire::Msg;
use crate::kernel::netlink::wire::MsgBuilder;
use crate::kernel::netlink::wire::OwnedMsg;
use crate::kernel::netlink::wire::ParseError;
use crate::kernel::netlink::wire::messages;

/// `NETLINK_CAP_ACK` (`SOL_NETLINK` option).
const NETLINK_CAP_ACK: libc::c_int = 10;
/// The default user-space receive buffer: larger than any datagram the kernel builds for a
/// dump (it caps those at 32 KiB).
const DEFAULT_RECV_LEN: usize = 1 << 16;

/// How the kernel ended an [`Socket::exchange`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// `NLMSG_DONE` (the end of a dump), with its flags (`NLM_F_DUMP_INTR`).
    Done { flags: u16 },
    /// `NLMSG_ERROR` with error 0.
    Ack,
    /// The single answer to a request that asked for neither an ack nor a dump.
    Reply,
}

/// A bound netlink socket of one protocol (`NETLINK_GENERIC`, `NETLINK_ROUTE`,
/// `NETLINK_NETFILTER`, `NETLINK_SOCK_DIAG`, ...).
pub(crate) struct Socket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket")
            .field("fd", &self.fd)
            .field("seq", &self.seq)
            .field("recv_len", &self.buf.len())
            .finish()
    }
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn invalid(e: ParseError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl Socket {
    /// Opens and binds a socket of `protocol`.
    pub(crate) fn open(protocol: libc::c_int) -> io::Result<Socket> {
        // SAFETY: plain socket(2); the fd is owned by `OwnedFd` right away.
        let fd = unsafe {
            let fd = cvt(libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            ))?;
            OwnedFd::from_raw_fd(fd)
        };
        // SAFETY: a zeroed sockaddr_nl is valid (pid 0: the kernel assigns one).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `addr` is a valid sockaddr_nl of the size passed.
        cvt(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        })?;
        Ok(Socket {
            fd,
            seq: 0,
            buf: vec![0; DEFAULT_RECV_LEN],
        })
    }

    /// Uses a user-space receive buffer of `len` bytes (a larger datagram is cut and then
    /// fails to parse).
    pub(crate) fn with_recv_len(mut self, len: usize) -> Self {
        self.buf = vec![0; len];
        self
    }

    fn setsockopt<T>(&self, level: libc::c_int, name: libc::c_int, v: &T) -> io::Result<()> {
        // SAFETY: valid fd and an option value of the size passed.
        cvt(unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                (v as *const T).cast(),
                size_of::<T>() as libc::socklen_t,
            )
        })
        .map(|_| ())
    }

    /// Bounds how long one receive may block (`SO_RCVTIMEO`; then it fails with `EAGAIN`).
    /// The kernel answers at once: this only bounds a wedged socket.
    pub(crate) fn set_recv_timeout(&self, timeout: Duration) -> io::Result<()> {
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        self.setsockopt(libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv)
    }

    /// Asks for a kernel receive buffer of `bytes` (`SO_RCVBUF`, best effort: capped by
    /// `net.core.rmem_max`).
    pub(crate) fn set_rcvbuf(&self, bytes: libc::c_int) {
        let _ = self.setsockopt(libc::SOL_SOCKET, libc::SO_RCVBUF, &bytes);
    }

    /// Acks without the echoed request (`NETLINK_CAP_ACK`, best effort: older kernels lack
    /// it).
    pub(crate) fn set_cap_ack(&self) {
        let _ = self.setsockopt(libc::SOL_NETLINK, NETLINK_CAP_ACK, &1 as &libc::c_int);
    }

    /// The next sequence number (never 0).
    pub(crate) fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    /// Sends one datagram (one message, or several concatenated) to the kernel.
    pub(crate) fn send(&self, data: &[u8]) -> io::Result<()> {
        // SAFETY: a zeroed sockaddr_nl is the kernel (pid 0).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `data` and `addr` are valid for the lengths passed.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != data.len() {
            return Err(io::Error::other(format!(
                "netlink send: {n} of {} bytes sent",
                data.len()
            )));
        }
        Ok(())
    }

    /// Receives one datagram (retried on `EINTR`); split it with [`messages`].
    pub(crate) fn recv(&mut self) -> io::Result<&[u8]> {
        loop {
            // SAFETY: `buf` is a valid writable buffer of the length passed.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    self.buf.as_mut_ptr().cast(),
                    self.buf.len(),
                    0,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            return Ok(&self.buf[..n as usize]);
        }
    }

    /// Sends the request `req` (one finished message; its sequence number and flags are read
    /// from its header) and hands every other answer of that sequence number to `each`, until
    /// the kernel ends the exchange:
    /// - `NLMSG_DONE` → [`End::Done`] (a dump, `NLM_F_DUMP`, ends so);
    /// - `NLMSG_ERROR` 0 → [`End::Ack`] (what `NLM_F_ACK` asks for after the answers);
    /// - `NLMSG_ERROR` n → the `io::Error` of errno n;
    /// - a request with neither `NLM_F_ACK` nor `NLM_F_DUMP`: its first answer without
    ///   `NLM_F_MULTI` → [`End::Reply`].
    ///
    /// An error of `each`, the socket or a malformed datagram (`InvalidData`) ends it early.
    pub(crate) fn exchange(
        &mut self,
        req: &[u8],
        mut each: impl FnMut(Msg<'_>) -> io::Result<()>,
    ) -> io::Result<End> {
        let (flags, seq) = match req {
            [_, _, _, _, _, _, f0, f1, s0, s1, s2, s3, ..] => (
                u16::from_ne_bytes([*f0, *f1]),
                u32::from_ne_bytes([*s0, *s1, *s2, *s3]),
            ),
            _ => return Err(io::Error::other("netlink request shorter than its header")),
        };
        let single = flags & NLM_F_ACK == 0 && flags & NLM_F_DUMP != NLM_F_DUMP;
        self.send(req)?;
        loop {
            for m in messages(self.recv()?) {
                let m = m.map_err(invalid)?;
                if m.seq != seq {
                    continue;
                }
                match m.msg_type {
                    NLMSG_DONE => return Ok(End::Done { flags: m.flags }),
                    NLMSG_ERROR => {
                        return match m.errno().map_err(invalid)? {
                            0 => Ok(End::Ack),
                            e => Err(io::Error::from_raw_os_error(e)),
                        };
                    }
                    _ => {
                        let multi = m.flags & NLM_F_MULTI != 0;
                        each(m)?;
                        if single && !multi {
                            return Ok(End::Reply);
                        }
                    }
                }
            }
        }
    }

    /// [`Socket::exchange`] of `msg` with the next sequence number, keeping every answer.
    pub(crate) fn request(&mut self, msg: &MsgBuilder) -> io::Result<Vec<OwnedMsg>> {
        let seq = self.next_seq();
        let mut replies = vec![];
        self.exchange(&msg.finish(seq), |m| {
            replies.push(m.to_owned());
            Ok(())
        })?;
        Ok(replies)
    }
}
