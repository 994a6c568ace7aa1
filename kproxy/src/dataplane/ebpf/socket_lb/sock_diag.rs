//! sock_diag netlink (`NETLINK_SOCK_DIAG`, `linux/inet_diag.h`): list the connected UDP sockets
//! of the calling thread's network namespace whose peer is one of a set of addresses, and
//! destroy sockets (`SOCK_DESTROY`).
//!
//! Wire format, written as small pure functions ([`encode_dump`], [`encode_destroy`],
//! [`parse_messages`]) unit-tested without a kernel, on the shared netlink plumbing of
//! [`crate::kernel::netlink`]; [`DiagSocket`] is the thin I/O around them. Every message is a `nlmsghdr` (16 bytes, host order) followed by:
//!
//! - requests: `inet_diag_req_v2` (56 bytes: family, protocol, ext, pad, `idiag_states`, then the
//!   48-byte `inet_diag_sockid`: ports and addresses in network order, interface, cookie);
//! - answers: `inet_diag_msg` (72 bytes: family, state, timer, retrans, the sockid, then five
//!   `u32`s) and attributes we do not ask for.
//!
//! The dump (`SOCK_DIAG_BY_FAMILY`, `NLM_F_DUMP`) asks for UDP sockets in state
//! `TCP_ESTABLISHED` (what a connected UDP socket is in) and carries an
//! `INET_DIAG_REQ_BYTECODE` filter so the kernel returns only sockets whose destination is one
//! of the targets: one `INET_DIAG_BC_D_COND` per target (full-length prefix, exact port), ORed
//! with `INET_DIAG_BC_JMP`s (`cond_i` true → its jump → the end = accept; false → `cond_i+1`;
//! the last one false → 4 bytes past the end = reject). An `AF_INET` condition also matches an
//! `AF_INET6` socket connected to the v4-mapped address (the kernel compares the last word).
//!
//! `SOCK_DESTROY` (`NLM_F_ACK`) names the socket by its full id as the dump reported it,
//! cookie included, so only that very socket is hit. The kernel aborts a UDP socket with
//! `ECONNABORTED` (its next `recv`/`send` fails with it) and disconnects it. Needs
//! `CONFIG_INET_DIAG_DESTROY` (else `EOPNOTSUPP`) and `CAP_NET_ADMIN` over the socket's
//! network namespace.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::kernel::netlink as nl;
use crate::kernel::netlink::MsgBuilder;
use crate::kernel::netlink::NLM_F_ACK;
use crate::kernel::netlink::NLM_F_DUMP;
use crate::kernel::netlink::NLMSG_DONE;
use crate::kernel::netlink::NLMSG_ERROR;

/// `NETLINK_SOCK_DIAG` (`NETLINK_INET_DIAG`).
const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;

const INET_DIAG_REQ_BYTECODE: u16 = 1;
const INET_DIAG_BC_JMP: u8 = 1;
const INET_DIAG_BC_D_COND: u8 = 8;
/// `1 << TCP_ESTABLISHED`: a connected UDP socket.
const STATE_ESTABLISHED: u32 = 1 << 1;
const IPPROTO_UDP: u8 = 17;

const SOCKID_LEN: usize = 48;
const REQ_LEN: usize = 8 + SOCKID_LEN;
const MSG_LEN: usize = 4 + SOCKID_LEN + 20;

/// The kernel answers at once; this only bounds a wedged socket.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);

/// A socket as `inet_diag_sockid` names it (addresses and ports as the kernel reported them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UdpSocket {
    /// `AF_INET` or `AF_INET6` (a v6 socket may hold v4-mapped addresses).
    pub family: u8,
    /// The raw `inet_diag_sockid` (echoed back by [`encode_destroy`]).
    pub id: [u8; SOCKID_LEN],
}

impl UdpSocket {
    fn addr(&self, at: usize) -> IpAddr {
        let b: [u8; 16] = self.id[at..at + 16].try_into().expect("16 bytes");
        if self.family == libc::AF_INET as u8 {
            IpAddr::from([b[0], b[1], b[2], b[3]])
        } else {
            let v6 = std::net::Ipv6Addr::from(b);
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
    }
    /// The local address and port.
    pub(crate) fn local(&self) -> SocketAddr {
        SocketAddr::new(self.addr(4), u16::from_be_bytes([self.id[0], self.id[1]]))
    }
    /// The peer (a v4-mapped peer of a v6 socket is given as IPv4).
    pub(crate) fn peer(&self) -> SocketAddr {
        SocketAddr::new(self.addr(20), u16::from_be_bytes([self.id[2], self.id[3]]))
    }
    /// The socket cookie (what `bpf_get_socket_cookie` returns).
    pub(crate) fn cookie(&self) -> u64 {
        let lo = u32::from_ne_bytes(self.id[40..44].try_into().expect("4 bytes"));
        let hi = u32::from_ne_bytes(self.id[44..48].try_into().expect("4 bytes"));
        u64::from(lo) | (u64::from(hi) << 32)
    }
}

/// What one `recv` held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    Socket(UdpSocket),
    Done,
    /// `NLMSG_ERROR`: `errno` 0 is an ack.
    Error {
        seq: u32,
        errno: i32,
    },
    Other,
}

/// A sock_diag message that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed sock_diag message: {0}")]
pub(crate) struct ParseError(pub String);

impl From<nl::ParseError> for ParseError {
    fn from(e: nl::ParseError) -> Self {
        ParseError(e.0)
    }
}

/// `inet_diag_req_v2` for UDP sockets of `family` in `states`, naming `id`.
fn req(family: u8, states: u32, id: &[u8; SOCKID_LEN]) -> [u8; REQ_LEN] {
    let mut r = [0; REQ_LEN];
    r[..4].copy_from_slice(&[family, IPPROTO_UDP, 0, 0]);
    r[4..8].copy_from_slice(&states.to_ne_bytes());
    r[8..].copy_from_slice(id);
    r
}

/// One `INET_DIAG_BC_D_COND` for `target` with its `yes`/`no` offsets.
fn cond(out: &mut Vec<u8>, target: SocketAddr, yes: u8, no: u16) {
    let (family, plen, addr): (u8, u8, Vec<u8>) = match target.ip() {
        IpAddr::V4(a) => (libc::AF_INET as u8, 32, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, 128, a.octets().to_vec()),
    };
    out.extend_from_slice(&[INET_DIAG_BC_D_COND, yes]);
    out.extend_from_slice(&no.to_ne_bytes());
    // inet_diag_hostcond: family, prefix_len, 2 bytes padding, int port (host order).
    out.extend_from_slice(&[family, plen, 0, 0]);
    out.extend_from_slice(&i32::from(target.port()).to_ne_bytes());
    out.extend_from_slice(&addr);
}

fn cond_len(target: &SocketAddr) -> usize {
    4 + 8 + if target.is_ipv4() { 4 } else { 16 }
}

/// The filter bytecode accepting a socket whose destination is any of `targets` (see the
/// module docs). `None` when it would not fit the 16-bit jump offsets.
pub(crate) fn bytecode(targets: &[SocketAddr]) -> Option<Vec<u8>> {
    if targets.is_empty() {
        return None;
    }
    let total: usize = targets.iter().map(|t| cond_len(t) + 4).sum::<usize>() - 4;
    if total > u16::MAX as usize - 4 {
        return None;
    }
    let mut out = Vec::with_capacity(total);
    for (i, t) in targets.iter().enumerate() {
        let len = cond_len(t);
        let last = i + 1 == targets.len();
        // true: the next op (our jump, or the end for the last one); false: past the jump.
        cond(&mut out, *t, len as u8, (len + 4) as u16);
        if !last {
            // A jump always takes `no`: to the end (accept). `yes` keeps the walk
            // sequential, as the kernel's audit of the program requires.
            let to_end = total - out.len();
            out.extend_from_slice(&[INET_DIAG_BC_JMP, 4]);
            out.extend_from_slice(&(to_end as u16).to_ne_bytes());
        }
    }
    debug_assert_eq!(out.len(), total);
    Some(out)
}

/// A dump request for the connected UDP sockets of `family` (`AF_INET` / `AF_INET6`) whose
/// destination is in `targets` (no filter when `targets` is too long for one program).
pub(crate) fn encode_dump(family: u8, targets: &[SocketAddr], seq: u32) -> Vec<u8> {
    let mut m = MsgBuilder::new(SOCK_DIAG_BY_FAMILY, NLM_F_DUMP).header(&req(
        family,
        STATE_ESTABLISHED,
        &[0; SOCKID_LEN],
    ));
    if let Some(bc) = bytecode(targets) {
        m.attr(INET_DIAG_REQ_BYTECODE, &bc);
    }
    m.finish(seq)
}

/// `SOCK_DESTROY` of exactly `sock`.
pub(crate) fn encode_destroy(sock: &UdpSocket, seq: u32) -> Vec<u8> {
    MsgBuilder::new(SOCK_DESTROY, NLM_F_ACK)
        .header(&req(sock.family, 0, &sock.id))
        .finish(seq)
}

/// Decodes one message.
fn decode(m: nl::Msg<'_>) -> Result<Message, ParseError> {
    Ok(match m.msg_type {
        NLMSG_DONE => Message::Done,
        NLMSG_ERROR => Message::Error {
            seq: m.seq,
            errno: m.errno()?,
        },
        SOCK_DIAG_BY_FAMILY => {
            let p = m.payload;
            if p.len() < MSG_LEN {
                return Err(ParseError(format!(
                    "inet_diag_msg of {} bytes (want {MSG_LEN})",
                    p.len()
                )));
            }
            Message::Socket(UdpSocket {
                family: p[0],
                id: p[4..4 + SOCKID_LEN].try_into().expect("48 bytes"),
            })
        }
        _ => Message::Other,
    })
}

/// Splits what one `recv` returned into messages.
#[cfg(test)]
pub fn parse_messages(buf: &[u8]) -> Result<Vec<Message>, ParseError> {
    nl::messages(buf).map(|m| decode(m?)).collect()
}

fn invalid(e: ParseError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// A `NETLINK_SOCK_DIAG` socket in the calling thread's network namespace.
pub(crate) struct DiagSocket {
    sock: nl::Socket,
}

impl DiagSocket {
    pub(crate) fn open() -> io::Result<DiagSocket> {
        let sock = nl::Socket::open(NETLINK_SOCK_DIAG)?;
        sock.set_recv_timeout(RECV_TIMEOUT)?;
        Ok(DiagSocket { sock })
    }

    /// The connected UDP sockets of `family` whose peer is one of `targets`.
    pub(crate) fn connected_udp(
        &mut self,
        family: u8,
        targets: &[SocketAddr],
    ) -> io::Result<Vec<UdpSocket>> {
        let seq = self.sock.next_seq();
        let mut out = vec![];
        self.sock
            .exchange(&encode_dump(family, targets, seq), |m| {
                // The kernel filtered already; checked again in case the program was left
                // out (too many targets).
                if let Message::Socket(s) = decode(m).map_err(invalid)?
                    && targets.contains(&s.peer())
                {
                    out.push(s);
                }
                Ok(())
            })
            .map(|_| out)
    }

    /// Destroys `sock`. `ENOENT`: it is gone already (closed, or reconnected elsewhere).
    pub(crate) fn destroy(&mut self, sock: &UdpSocket) -> io::Result<()> {
        let seq = self.sock.next_seq();
        self.sock
            .exchange(&encode_destroy(sock, seq), |_| Ok(()))
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::netlink::NLM_F_MULTI;
    use crate::kernel::netlink::NLMSG_HDRLEN;

    /// Runs the kernel's filter interpreter (`inet_diag_bc_run`) for D_COND/JMP programs.
    fn run(bc: &[u8], family: u8, daddr: [u8; 16], dport: u16) -> bool {
        let mut at = 0usize;
        let mut len = bc.len() as isize;
        while len > 0 {
            let code = bc[at];
            let yes_off = bc[at + 1] as usize;
            let no_off = u16::from_ne_bytes([bc[at + 2], bc[at + 3]]) as usize;
            let yes = match code {
                INET_DIAG_BC_JMP => false,
                INET_DIAG_BC_D_COND => {
                    let cfam = bc[at + 4];
                    let port = i32::from_ne_bytes(bc[at + 8..at + 12].try_into().unwrap());
                    let n = if cfam == libc::AF_INET as u8 { 4 } else { 16 };
                    let caddr = &bc[at + 12..at + 12 + n];
                    let port_ok = port == -1 || port == i32::from(dport);
                    let addr_ok = if cfam == family {
                        &daddr[..n] == caddr
                    } else {
                        family == libc::AF_INET6 as u8
                            && cfam == libc::AF_INET as u8
                            && daddr[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]
                            && &daddr[12..16] == caddr
                    };
                    port_ok && addr_ok
                }
                c => panic!("unexpected op {c}"),
            };
            let off = if yes { yes_off } else { no_off };
            at += off;
            len -= off as isize;
        }
        len == 0
    }

    /// The kernel's audit (`inet_diag_bc_audit`): the `yes` chain walks every op in order and
    /// every `no` lands on an op boundary or 4 bytes past the end.
    fn audit(bc: &[u8]) {
        let mut boundaries = vec![];
        let mut at = 0usize;
        while at < bc.len() {
            boundaries.push(at);
            let yes = bc[at + 1] as usize;
            assert!(yes >= 4 && yes.is_multiple_of(4) && at + yes <= bc.len() + 4);
            at += yes;
        }
        assert_eq!(at, bc.len());
        for &b in &boundaries {
            let no = u16::from_ne_bytes([bc[b + 2], bc[b + 3]]) as usize;
            let to = b + no;
            assert!(
                no.is_multiple_of(4)
                    && (to == bc.len() + 4 || to == bc.len() || boundaries.contains(&to))
            );
        }
    }

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut o = [0; 16];
        o[..4].copy_from_slice(&a);
        o
    }
    fn mapped(a: [u8; 4]) -> [u8; 16] {
        let mut o = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 0, 0];
        o[12..].copy_from_slice(&a);
        o
    }

    #[test]
    fn filter_accepts_exactly_the_targets() {
        let targets: Vec<SocketAddr> = vec![
            "10.0.0.1:53".parse().unwrap(),
            "[fd00::2]:53".parse().unwrap(),
            "10.0.0.3:5353".parse().unwrap(),
        ];
        let bc = bytecode(&targets).unwrap();
        audit(&bc);
        let inet = libc::AF_INET as u8;
        let inet6 = libc::AF_INET6 as u8;
        assert!(run(&bc, inet, v4([10, 0, 0, 1]), 53));
        assert!(run(&bc, inet, v4([10, 0, 0, 3]), 5353));
        assert!(run(&bc, inet6, mapped([10, 0, 0, 1]), 53));
        let v6: std::net::Ipv6Addr = "fd00::2".parse().unwrap();
        assert!(run(&bc, inet6, v6.octets(), 53));
        assert!(!run(&bc, inet, v4([10, 0, 0, 1]), 54));
        assert!(!run(&bc, inet, v4([10, 0, 0, 2]), 53));
        assert!(!run(&bc, inet, v4([10, 0, 0, 3]), 53));
        assert!(!run(&bc, inet6, v6.octets(), 5353));
        // One target: a single condition.
        let one = bytecode(&targets[..1]).unwrap();
        audit(&one);
        assert_eq!(one.len(), 16);
        assert!(run(&one, inet, v4([10, 0, 0, 1]), 53));
        assert!(!run(&one, inet, v4([10, 0, 0, 9]), 53));
    }

    #[test]
    fn too_many_targets_leave_the_filter_out() {
        let many: Vec<SocketAddr> = (0..5000u32)
            .map(|i| SocketAddr::new(IpAddr::from(i.to_be_bytes()), 53))
            .collect();
        assert!(bytecode(&many).is_none());
        assert!(bytecode(&[]).is_none());
        let req = encode_dump(libc::AF_INET as u8, &many, 1);
        assert_eq!(req.len(), NLMSG_HDRLEN + REQ_LEN);
    }

    #[test]
    fn dump_request_layout() {
        let t: SocketAddr = "10.1.2.3:53".parse().unwrap();
        let req = encode_dump(libc::AF_INET as u8, &[t], 7);
        assert_eq!(req.len(), NLMSG_HDRLEN + REQ_LEN + 4 + 16);
        assert_eq!(
            u32::from_ne_bytes(req[0..4].try_into().unwrap()) as usize,
            req.len()
        );
        assert_eq!(u16::from_ne_bytes([req[4], req[5]]), SOCK_DIAG_BY_FAMILY);
        assert_eq!(req[16], libc::AF_INET as u8);
        assert_eq!(req[17], IPPROTO_UDP);
        assert_eq!(u32::from_ne_bytes(req[20..24].try_into().unwrap()), 2);
        let attr = &req[NLMSG_HDRLEN + REQ_LEN..];
        assert_eq!(u16::from_ne_bytes([attr[0], attr[1]]), 20);
        assert_eq!(
            u16::from_ne_bytes([attr[2], attr[3]]),
            INET_DIAG_REQ_BYTECODE
        );
        assert_eq!(&attr[4 + 12..4 + 16], &[10, 1, 2, 3]);
    }

    #[test]
    fn answers_decode_and_destroy_echoes_the_id() {
        let mut id = [0u8; SOCKID_LEN];
        id[0..2].copy_from_slice(&40000u16.to_be_bytes());
        id[2..4].copy_from_slice(&53u16.to_be_bytes());
        id[4..20].copy_from_slice(&mapped([10, 0, 0, 9]));
        id[20..36].copy_from_slice(&mapped([10, 0, 0, 1]));
        id[40..44].copy_from_slice(&0x5566_7788u32.to_ne_bytes());
        id[44..48].copy_from_slice(&0x1122_3344u32.to_ne_bytes());
        let mut payload = vec![libc::AF_INET6 as u8, 1, 0, 0];
        payload.extend_from_slice(&id);
        payload.extend_from_slice(&[0; 20]);
        let mut buf = MsgBuilder::new(SOCK_DIAG_BY_FAMILY, NLM_F_MULTI)
            .header(&payload)
            .finish(5);
        let done = MsgBuilder::new(NLMSG_DONE, NLM_F_MULTI).header(&0i32.to_ne_bytes());
        buf.extend_from_slice(&done.finish(5));
        let msgs = parse_messages(&buf).unwrap();
        assert_eq!(msgs.len(), 2);
        let Message::Socket(s) = msgs[0] else {
            panic!("{msgs:?}")
        };
        assert_eq!(s.peer(), "10.0.0.1:53".parse().unwrap());
        assert_eq!(s.local(), "10.0.0.9:40000".parse().unwrap());
        assert_eq!(s.cookie(), 0x1122_3344_5566_7788);
        assert_eq!(msgs[1], Message::Done);
        let d = encode_destroy(&s, 9);
        assert_eq!(u16::from_ne_bytes([d[4], d[5]]), SOCK_DESTROY);
        assert_eq!(d[16], libc::AF_INET6 as u8);
        assert_eq!(&d[NLMSG_HDRLEN + 8..], &id);
        assert!(parse_messages(&buf[..20]).is_err());
    }
}
