//! Minimal netlink plumbing shared by the IPVS generic-netlink client ([`super::genl`]) and the
//! rtnetlink address code ([`super::rtnl`]): message building with nested attributes, attribute
//! parsing, and a blocking socket that sends one request and collects its replies (a dump's
//! messages, or the ACK/error of a change).
//!
//! Layout reminders: every message starts with `nlmsghdr` (len u32, type u16, flags u16, seq
//! u32, pid u32); attributes are `(len u16, type u16, payload)` padded to 4 bytes; nested
//! attributes carry `NLA_F_NESTED`. Everything is host byte order except where the protocol
//! says otherwise (IPVS ports are network order).

use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

pub const NLMSG_HDRLEN: usize = 16;
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_ROOT: u16 = 0x100;
pub const NLM_F_MATCH: u16 = 0x200;
pub const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Builds one netlink message: header, a fixed family header, then attributes.
#[derive(Debug, Clone)]
pub struct MsgBuilder {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl MsgBuilder {
    /// A message of `msg_type` with `flags` (`NLM_F_REQUEST` is added); seq/pid are set on send.
    pub fn new(msg_type: u16, flags: u16) -> Self {
        let mut buf = vec![0u8; NLMSG_HDRLEN];
        buf[4..6].copy_from_slice(&msg_type.to_ne_bytes());
        buf[6..8].copy_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        MsgBuilder { buf, nests: vec![] }
    }
    /// Appends raw bytes (a family header such as `genlmsghdr` or `ifaddrmsg`), padded.
    pub fn header(mut self, bytes: &[u8]) -> Self {
        self.buf.extend_from_slice(bytes);
        self.pad();
        self
    }
    fn pad(&mut self) {
        let len = align4(self.buf.len());
        self.buf.resize(len, 0);
    }
    pub fn attr(&mut self, kind: u16, payload: &[u8]) -> &mut Self {
        let len = u16::try_from(4 + payload.len()).expect("netlink attribute under 64 KiB");
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
        self
    }
    pub fn u16(&mut self, kind: u16, v: u16) -> &mut Self {
        self.attr(kind, &v.to_ne_bytes())
    }
    pub fn u32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.attr(kind, &v.to_ne_bytes())
    }
    /// A NUL-terminated string.
    pub fn str(&mut self, kind: u16, s: &str) -> &mut Self {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        self.attr(kind, &b)
    }
    pub fn begin_nested(&mut self, kind: u16) -> &mut Self {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&[0, 0]);
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }
    pub fn end_nested(&mut self) -> &mut Self {
        let start = self.nests.pop().expect("end_nested without begin_nested");
        let len = u16::try_from(self.buf.len() - start).expect("nested attribute under 64 KiB");
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }
    /// The finished message with `seq` (length filled in).
    pub fn finish(&self, seq: u32) -> Vec<u8> {
        assert!(self.nests.is_empty(), "unclosed nested attribute");
        let mut b = self.buf.clone();
        let len = u32::try_from(b.len()).expect("netlink message under 4 GiB");
        b[0..4].copy_from_slice(&len.to_ne_bytes());
        b[8..12].copy_from_slice(&seq.to_ne_bytes());
        b
    }
}

/// One received message: type, flags and the payload after `nlmsghdr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msg {
    pub msg_type: u16,
    pub flags: u16,
    pub seq: u32,
    pub payload: Vec<u8>,
}

/// Splits a datagram into messages.
pub fn parse_messages(mut data: &[u8]) -> io::Result<Vec<Msg>> {
    let mut out = vec![];
    while data.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes(data[0..4].try_into().expect("4 bytes")) as usize;
        if len < NLMSG_HDRLEN || len > data.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("netlink message length {len} out of range"),
            ));
        }
        out.push(Msg {
            msg_type: u16::from_ne_bytes([data[4], data[5]]),
            flags: u16::from_ne_bytes([data[6], data[7]]),
            seq: u32::from_ne_bytes(data[8..12].try_into().expect("4 bytes")),
            payload: data[NLMSG_HDRLEN..len].to_vec(),
        });
        data = &data[align4(len).min(data.len())..];
    }
    Ok(out)
}

/// Iterates the attributes in `data` as `(type without flags, payload)`.
pub fn attrs(mut data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([data[0], data[1]]) as usize;
        let kind = u16::from_ne_bytes([data[2], data[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > data.len() {
            return None;
        }
        let payload = &data[4..len];
        data = &data[align4(len).min(data.len())..];
        Some((kind, payload))
    })
}

/// The first attribute of `kind` in `data`.
pub fn find_attr(data: &[u8], kind: u16) -> Option<&[u8]> {
    attrs(data).find(|(k, _)| *k == kind).map(|(_, p)| p)
}

pub fn read_u16(p: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(p.get(..2)?.try_into().ok()?))
}
pub fn read_u32(p: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(p.get(..4)?.try_into().ok()?))
}
/// A NUL-terminated (or plain) string attribute.
pub fn read_str(p: &[u8]) -> String {
    let end = p.iter().position(|b| *b == 0).unwrap_or(p.len());
    String::from_utf8_lossy(&p[..end]).into_owned()
}

/// A blocking netlink socket of one protocol (`NETLINK_GENERIC`, `NETLINK_ROUTE`).
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
    seq: u32,
}

impl Socket {
    pub fn open(protocol: i32) -> io::Result<Socket> {
        // SAFETY: plain socket(2); the fd is owned right away.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                protocol,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh, valid descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a zeroed sockaddr_nl is valid (pid 0: the kernel assigns one).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: addr is a valid sockaddr_nl of the size passed.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // Larger receive buffer for big dumps.
        let size: libc::c_int = 1 << 20;
        // SAFETY: setsockopt with a c_int value of the size passed.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            );
        }
        Ok(Socket { fd, seq: 1 })
    }

    /// Sends `msg` and returns the reply messages (without the final ACK/DONE). An error
    /// reply becomes the `io::Error` of its errno. `msg` should carry `NLM_F_ACK` or
    /// `NLM_F_DUMP` so the kernel ends the exchange.
    pub fn request(&mut self, msg: &MsgBuilder) -> io::Result<Vec<Msg>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let bytes = msg.finish(seq);
        // SAFETY: bytes is a valid buffer of the length passed.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut replies = vec![];
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            // SAFETY: buf is a valid writable buffer of the length passed.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            let n = usize::try_from(n).expect("non-negative");
            for m in parse_messages(&buf[..n])? {
                if m.seq != seq {
                    continue;
                }
                match m.msg_type {
                    NLMSG_ERROR => {
                        let errno = m
                            .payload
                            .get(..4)
                            .and_then(|b| b.try_into().ok())
                            .map(i32::from_ne_bytes)
                            .unwrap_or(-libc::EIO);
                        if errno == 0 {
                            return Ok(replies);
                        }
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                    NLMSG_DONE => return Ok(replies),
                    _ => {
                        let multi = m.flags & NLM_F_MULTI != 0;
                        replies.push(m);
                        if !multi && msg.buf_flags() & NLM_F_ACK == 0 {
                            return Ok(replies);
                        }
                    }
                }
            }
        }
    }
}

impl MsgBuilder {
    fn buf_flags(&self) -> u16 {
        u16::from_ne_bytes([self.buf[6], self.buf[7]])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_round_trip() {
        let mut m = MsgBuilder::new(0x20, NLM_F_ACK).header(&[1, 2, 0, 0]);
        m.begin_nested(1).u16(1, 2).str(6, "rr").end_nested();
        m.u32(4, 900);
        let bytes = m.finish(7);
        let msgs = parse_messages(&bytes).unwrap();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].msg_type, 0x20);
        assert_eq!(msgs[0].seq, 7);
        assert_eq!(msgs[0].flags, NLM_F_ACK | NLM_F_REQUEST);
        let body = &msgs[0].payload[4..];
        let nested = find_attr(body, 1).unwrap();
        assert_eq!(read_u16(find_attr(nested, 1).unwrap()), Some(2));
        assert_eq!(read_str(find_attr(nested, 6).unwrap()), "rr");
        assert_eq!(read_u32(find_attr(body, 4).unwrap()), Some(900));
        // "rr\0" is padded to 4 bytes; the nested length covers both attributes.
        let raw_len = u16::from_ne_bytes([body[0], body[1]]) as usize;
        assert_eq!(raw_len, 4 + 8 + 8);
        assert_eq!(
            u16::from_ne_bytes([body[2], body[3]]),
            1 | NLA_F_NESTED,
            "nested flag set"
        );
    }

    #[test]
    fn truncated_input_is_rejected_not_read_past() {
        let bytes = MsgBuilder::new(1, 0).finish(1);
        assert!(parse_messages(&bytes[..10]).unwrap().is_empty());
        let mut bad = bytes.clone();
        bad[0..4].copy_from_slice(&100u32.to_ne_bytes());
        assert!(parse_messages(&bad).is_err());
        assert_eq!(attrs(&[8, 0, 1, 0, 1]).count(), 0);
    }
}
