//! rtnetlink (`NETLINK_ROUTE`: links, addresses, routes, rules, neighbours) through the
//! `rtnetlink` crates, blocking: [`RouteSocket`] sends one request and hands its answers over
//! (dumps and acked requests), [`Subscription`] receives the kernel's change announcements
//! (multicast groups, [`MulticastGroup`]). Both work in the network namespace of the thread
//! that opened them (a netlink socket belongs to the namespace it was created in; tests open
//! them from inside a node's namespace).
//!
//! Messages are `netlink-packet-route`'s [`RouteNetlinkMessage`]s (built with `rtnetlink`'s
//! builders where it has one: `LinkDummy`, `AddressMessageBuilder`), framed by
//! `netlink-packet-core` and carried by `netlink-sys`'s blocking [`Socket`]. What is kproxy's
//! own is only the exchange loop: sequence numbers, and where the kernel ends an exchange.
//!
//! Why not `rtnetlink`'s `Handle`: its requests are futures driven by a `netlink-proto`
//! connection task. kproxy's callers are plain threads (the sync loop, per-namespace helper
//! threads, the watchers' threads), some of them inside the agent's tokio runtime, where
//! blocking on a second runtime panics; a runtime per call would add a thread-context rule
//! to every caller for what is one `send` and a few `recv`s. The same crates' types do the
//! encoding and decoding either way.
//!
//! The exchange (as `kernel::netlink::Socket`'s, which the other netlink families keep):
//! - sequence numbers start at 1 and skip 0 when they wrap; answers with another sequence
//!   number (left over from an abandoned exchange) are skipped;
//! - a dump ([`NLM_F_DUMP`]) ends at `NLMSG_DONE` (its `NLM_F_DUMP_INTR` is not looked at), any
//!   other request is sent with [`NLM_F_ACK`] and ends at the ack;
//! - `NLMSG_ERROR` n is the `io::Error` of errno n; a malformed datagram is `InvalidData`;
//! - `recv` is retried on `EINTR`.

use std::io;
use std::os::fd::AsFd;
use std::time::Duration;

use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeVal;
pub(crate) use rtnetlink::MulticastGroup;
use rtnetlink::packet_core::{
    DecodeError, Emitable, ErrorBuffer, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_ALIGNTO,
    NLMSG_DONE, NLMSG_ERROR, NetlinkBuffer, NetlinkDeserializable, NetlinkHeader, NetlinkMessage,
    Parseable,
};
pub(crate) use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// The user-space receive buffer: larger than any datagram the kernel builds for a dump (it
/// caps those at 32 KiB) or an announcement.
const RECV_LEN: usize = 1 << 16;

/// The messages of one datagram as `(header, payload)`; a length that does not fit is an
/// error and ends the walk; trailing bytes shorter than a header are ignored.
pub(crate) fn messages(
    datagram: &[u8],
) -> impl Iterator<Item = Result<(NetlinkHeader, &[u8]), DecodeError>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let rest = datagram
            .get(at..)
            .filter(|r| r.len() >= NetlinkHeader::default().buffer_len())?;
        let parsed = NetlinkBuffer::new_checked(rest).and_then(|b| {
            let header = NetlinkHeader::parse(&b)?;
            Ok((header, b.payload()))
        });
        match parsed {
            Ok((header, payload)) => {
                let align = NLMSG_ALIGNTO as usize;
                at += (header.length as usize).div_ceil(align) * align;
                Some(Ok((header, payload)))
            }
            Err(e) => {
                at = datagram.len();
                Some(Err(e))
            }
        }
    })
}

/// Every message of one datagram, parsed (a framing error ends the list with that error).
pub(crate) fn parse_datagram(datagram: &[u8]) -> Vec<Result<RouteNetlinkMessage, DecodeError>> {
    messages(datagram)
        .map(|m| m.and_then(|(h, p)| parse(&h, p)))
        .collect()
}

/// The rtnetlink message of `payload` (`header` says which).
pub(crate) fn parse(
    header: &NetlinkHeader,
    payload: &[u8],
) -> Result<RouteNetlinkMessage, DecodeError> {
    RouteNetlinkMessage::deserialize(header, payload)
}

/// `msg` as a request with `flags` ([`NLM_F_REQUEST`] added; [`RouteSocket::exchange`] adds
/// [`NLM_F_ACK`] to what is not a dump and sets the sequence number).
pub(crate) fn request(msg: RouteNetlinkMessage, flags: u16) -> NetlinkMessage<RouteNetlinkMessage> {
    let mut m = NetlinkMessage::from(msg);
    m.header.flags = NLM_F_REQUEST | flags;
    m
}

/// `msg` as a dump request ([`NLM_F_DUMP`]).
pub(crate) fn dump_request(msg: RouteNetlinkMessage) -> NetlinkMessage<RouteNetlinkMessage> {
    request(msg, NLM_F_DUMP)
}

fn invalid(e: DecodeError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Receives one datagram into `buf` (cleared first), retrying on `EINTR`.
fn recv(sock: &Socket, buf: &mut Vec<u8>, flags: libc::c_int) -> io::Result<()> {
    loop {
        buf.clear();
        match sock.recv(buf, flags) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r.map(|_| ()),
        }
    }
}

/// A bound rtnetlink socket for requests and dumps.
pub(crate) struct RouteSocket {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl std::fmt::Debug for RouteSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteSocket")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl RouteSocket {
    /// Opens and binds a socket in the calling thread's network namespace.
    pub(crate) fn open() -> io::Result<RouteSocket> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind_auto()?;
        Ok(RouteSocket {
            sock,
            seq: 0,
            buf: Vec::with_capacity(RECV_LEN),
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    /// Sends `req` (from [`request`] or [`dump_request`]) and hands every answer of it to
    /// `each` as `(header, payload)` until the kernel ends the exchange (module docs).
    pub(crate) fn exchange(
        &mut self,
        mut req: NetlinkMessage<RouteNetlinkMessage>,
        mut each: impl FnMut(&NetlinkHeader, &[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        if req.header.flags & NLM_F_DUMP != NLM_F_DUMP {
            req.header.flags |= NLM_F_ACK;
        }
        let seq = self.next_seq();
        req.header.sequence_number = seq;
        req.finalize();
        let mut out = vec![0; req.buffer_len()];
        req.serialize(&mut out);
        let sent = self.sock.send(&out, 0)?;
        if sent != out.len() {
            return Err(io::Error::other(format!(
                "rtnetlink send: {sent} of {} bytes sent",
                out.len()
            )));
        }
        loop {
            recv(&self.sock, &mut self.buf, 0)?;
            for m in messages(&self.buf) {
                let (header, payload) = m.map_err(invalid)?;
                if header.sequence_number != seq {
                    continue;
                }
                match header.message_type {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let error = ErrorBuffer::new_checked(&payload).map_err(invalid)?;
                        return match error.code() {
                            None => Ok(()),
                            Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                        };
                    }
                    _ => each(&header, payload)?,
                }
            }
        }
    }

    /// [`RouteSocket::exchange`], keeping every answer parsed (one that does not parse is
    /// `InvalidData`).
    pub(crate) fn collect(
        &mut self,
        req: NetlinkMessage<RouteNetlinkMessage>,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        let mut out = Vec::new();
        self.exchange(req, |h, p| {
            out.push(parse(h, p).map_err(invalid)?);
            Ok(())
        })?;
        Ok(out)
    }
}

/// What one [`Subscription::recv`] saw.
#[derive(Debug)]
pub(crate) enum Received {
    /// One datagram of announcements, each parsed (or why not).
    Messages(Vec<Result<RouteNetlinkMessage, DecodeError>>),
    /// The socket overflowed (`ENOBUFS`): announcements were lost.
    Lost,
    /// Nothing within the receive timeout (or nothing queued, when not waiting).
    Nothing,
}

/// A socket joined to rtnetlink multicast groups: the kernel's announcements of changes.
pub(crate) struct Subscription {
    sock: Socket,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

impl Subscription {
    /// Joins `groups` in the calling thread's network namespace; announcements of changes
    /// made from here on are queued. A receive blocks up to `timeout`.
    pub(crate) fn open(groups: &[MulticastGroup], timeout: Duration) -> io::Result<Subscription> {
        let mut sock = Socket::new(NETLINK_ROUTE)?;
        sock.bind(&SocketAddr::new(0, 0))?;
        for g in groups {
            sock.add_membership(*g as u32)?;
        }
        setsockopt(
            &sock.as_fd(),
            sockopt::ReceiveTimeout,
            &TimeVal::new(
                timeout.as_secs() as libc::time_t,
                timeout.subsec_micros() as libc::suseconds_t,
            ),
        )?;
        Ok(Subscription {
            sock,
            buf: Vec::with_capacity(RECV_LEN),
        })
    }

    /// One datagram: waits up to the timeout when `wait`, else takes only what is queued.
    /// Other socket errors are returned.
    pub(crate) fn recv(&mut self, wait: bool) -> io::Result<Received> {
        let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
        match recv(&self.sock, &mut self.buf, flags) {
            Ok(()) if self.buf.is_empty() => Ok(Received::Nothing),
            Ok(()) => Ok(Received::Messages(parse_datagram(&self.buf))),
            Err(e) => match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(Received::Nothing),
                Some(libc::ENOBUFS) => Ok(Received::Lost),
                _ => Err(e),
            },
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rtnetlink::LinkUnspec;
    use rtnetlink::packet_route::address::AddressMessage;
    use rtnetlink::packet_route::link::LinkMessage;

    /// Runs `f` on a thread of its own in a new network namespace (gone with the thread);
    /// `None`, after printing `skipped`, when not root.
    pub(crate) fn in_new_netns<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: {:?}: needs root", std::thread::current().name());
            return None;
        }
        let t = std::thread::spawn(move || {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("unshare(CLONE_NEWNET)");
            f()
        });
        Some(t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
    }

    /// `ip ARGS` in the calling thread's network namespace; panics unless it succeeds.
    pub(crate) fn ip(args: &[&str]) {
        let out = std::process::Command::new("ip")
            .args(args)
            .output()
            .expect("running ip");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn bytes(mut m: NetlinkMessage<RouteNetlinkMessage>, seq: u32) -> Vec<u8> {
        m.header.sequence_number = seq;
        m.finalize();
        let mut b = vec![0; m.buffer_len()];
        m.serialize(&mut b);
        b
    }

    #[test]
    fn datagrams_split_into_parsed_messages() {
        let link = bytes(
            request(RouteNetlinkMessage::NewLink(LinkMessage::default()), 0),
            4,
        );
        let addr = bytes(
            dump_request(RouteNetlinkMessage::GetAddress(AddressMessage::default())),
            5,
        );
        let both = [link.clone(), addr.clone()].concat();
        let got: Vec<_> = messages(&both).map(|m| m.unwrap()).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0.sequence_number, 4);
        assert_eq!(got[1].0.flags, NLM_F_REQUEST | NLM_F_DUMP);
        assert!(matches!(
            parse(&got[1].0, got[1].1).unwrap(),
            RouteNetlinkMessage::GetAddress(_)
        ));
        // A length that does not fit ends the walk with an error; a short tail is ignored.
        let mut bad = both.clone();
        bad[..4].copy_from_slice(&1000u32.to_ne_bytes());
        let r: Vec<_> = messages(&bad).collect();
        assert_eq!(r.len(), 1);
        assert!(r[0].is_err());
        assert_eq!(messages(&link[..10]).count(), 0);
    }

    #[test]
    fn a_dump_and_a_request_of_the_real_kernel() {
        let mut s = RouteSocket::open().unwrap();
        let links = s
            .collect(dump_request(RouteNetlinkMessage::GetLink(
                LinkMessage::default(),
            )))
            .unwrap();
        assert!(
            links
                .iter()
                .any(|m| matches!(m, RouteNetlinkMessage::NewLink(l) if l.header.index == 1))
        );
        // A link that does not exist: the kernel's errno, and the socket goes on.
        let gone = LinkUnspec::new_with_name("kp-no-such-link").build();
        let e = s
            .collect(request(RouteNetlinkMessage::GetLink(gone), 0))
            .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENODEV), "{e}");
        assert!(
            !s.collect(dump_request(RouteNetlinkMessage::GetLink(
                LinkMessage::default()
            )))
            .unwrap()
            .is_empty()
        );
    }
}
