//! The netlink wire format, without I/O: building a request ([`MsgBuilder`]), splitting a
//! received datagram into messages ([`messages`]), walking attributes ([`attrs`]).

use crate::kernel::netlink::NLA_F_NESTED;
use crate::kernel::netlink::NLA_TYPE_MASK;
use crate::kernel::netlink::NLM_F_REQUEST;
use crate::kernel::netlink::NLMSG_ERROR;
use crate::kernel::netlink::NLMSG_HDRLEN;

/// A netlink message or attribute that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed netlink message: {0}")]
pub(crate) struct ParseError(pub String);

/// `n` rounded up to the 4-byte netlink alignment (`NLMSG_ALIGN`, `NLA_ALIGN`).
pub(crate) const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Builds one netlink message: header, a fixed protocol header, then attributes.
#[derive(Debug, Clone)]
pub(crate) struct MsgBuilder {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl MsgBuilder {
    /// A message of `msg_type` with `flags` (`NLM_F_REQUEST` is added); the length and the
    /// sequence number are set by [`MsgBuilder::finish`], the port id stays 0 (the kernel).
    pub(crate) fn new(msg_type: u16, flags: u16) -> Self {
        let mut buf = Vec::with_capacity(128);
        buf.resize(NLMSG_HDRLEN, 0);
        buf[4..6].copy_from_slice(&msg_type.to_ne_bytes());
        buf[6..8].copy_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        MsgBuilder { buf, nests: vec![] }
    }

    /// Appends raw bytes (a protocol header such as `genlmsghdr`, `nfgenmsg`, `ifaddrmsg` or
    /// `inet_diag_req_v2`), padded to 4 bytes.
    pub(crate) fn header(mut self, bytes: &[u8]) -> Self {
        self.buf.extend_from_slice(bytes);
        self.pad();
        self
    }

    fn pad(&mut self) {
        self.buf.resize(align4(self.buf.len()), 0);
    }

    /// One attribute, padded to 4 bytes. Panics when it does not fit the 16-bit length.
    pub(crate) fn attr(&mut self, kind: u16, payload: &[u8]) -> &mut Self {
        let len = u16::try_from(4 + payload.len()).expect("netlink attribute under 64 KiB");
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
        self
    }

    /// A host-order `u16` attribute.
    pub(crate) fn u16(&mut self, kind: u16, v: u16) -> &mut Self {
        self.attr(kind, &v.to_ne_bytes())
    }

    /// A host-order `u32` attribute.
    pub(crate) fn u32(&mut self, kind: u16, v: u32) -> &mut Self {
        self.attr(kind, &v.to_ne_bytes())
    }

    /// A NUL-terminated string attribute.
    pub(crate) fn str(&mut self, kind: u16, s: &str) -> &mut Self {
        let mut b = Vec::with_capacity(s.len() + 1);
        b.extend_from_slice(s.as_bytes());
        b.push(0);
        self.attr(kind, &b)
    }

    /// Opens a nested attribute (`NLA_F_NESTED` set); close it with [`MsgBuilder::end_nested`].
    pub(crate) fn begin_nested(&mut self, kind: u16) -> &mut Self {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&[0, 0]);
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    /// Closes the innermost open nested attribute (its length is filled in).
    pub(crate) fn end_nested(&mut self) -> &mut Self {
        let start = self.nests.pop().expect("end_nested without begin_nested");
        let len = u16::try_from(self.buf.len() - start).expect("nested attribute under 64 KiB");
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self
    }

    /// The finished message with `seq` (length filled in).
    pub(crate) fn finish(&self, seq: u32) -> Vec<u8> {
        assert!(self.nests.is_empty(), "unclosed nested attribute");
        let mut b = self.buf.clone();
        let len = u32::try_from(b.len()).expect("netlink message under 4 GiB");
        b[0..4].copy_from_slice(&len.to_ne_bytes());
        b[8..12].copy_from_slice(&seq.to_ne_bytes());
        b
    }
}

/// One received message: the `nlmsghdr` fields and the payload after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Msg<'a> {
    pub msg_type: u16,
    pub flags: u16,
    pub seq: u32,
    pub payload: &'a [u8],
}

impl Msg<'_> {
    /// For an `NLMSG_ERROR`: the positive error number, 0 for an ack.
    pub(crate) fn errno(&self) -> Result<i32, ParseError> {
        debug_assert_eq!(self.msg_type, NLMSG_ERROR);
        match self.payload.get(..4) {
            Some(b) => Ok(-i32::from_ne_bytes(b.try_into().expect("4 bytes"))),
            None => Err(ParseError("NLMSG_ERROR shorter than its error code".into())),
        }
    }

    pub(crate) fn to_owned(self) -> OwnedMsg {
        OwnedMsg {
            msg_type: self.msg_type,
            flags: self.flags,
            seq: self.seq,
            payload: self.payload.to_vec(),
        }
    }
}

/// A [`Msg`] that owns its payload (kept past the receive buffer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnedMsg {
    pub msg_type: u16,
    pub flags: u16,
    pub seq: u32,
    pub payload: Vec<u8>,
}

fn rd_u16(b: &[u8], at: usize) -> u16 {
    u16::from_ne_bytes([b[at], b[at + 1]])
}

fn rd_u32(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The messages in `buf` (what one `recv` returned). A length that does not fit is an error
/// (and ends the walk); trailing bytes shorter than a header are ignored.
pub(crate) fn messages(buf: &[u8]) -> impl Iterator<Item = Result<Msg<'_>, ParseError>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at + NLMSG_HDRLEN > buf.len() {
            return None;
        }
        let len = rd_u32(buf, at) as usize;
        if len < NLMSG_HDRLEN || at + len > buf.len() {
            let e = ParseError(format!(
                "message length {len} at offset {at} of {}",
                buf.len()
            ));
            at = buf.len();
            return Some(Err(e));
        }
        let m = Msg {
            msg_type: rd_u16(buf, at + 4),
            flags: rd_u16(buf, at + 6),
            seq: rd_u32(buf, at + 8),
            payload: &buf[at + NLMSG_HDRLEN..at + len],
        };
        at += align4(len);
        Some(Ok(m))
    })
}

/// All of [`messages`], or the first error.
#[cfg(test)]
pub fn parse_messages(buf: &[u8]) -> Result<Vec<Msg<'_>>, ParseError> {
    messages(buf).collect()
}

/// The attributes in `data` as `(type without flags, payload)`. A length that does not fit is
/// an error (and ends the walk); trailing bytes shorter than an attribute header are ignored.
pub(crate) fn attrs(mut data: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), ParseError>> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = rd_u16(data, 0) as usize;
        let kind = rd_u16(data, 2) & NLA_TYPE_MASK;
        if len < 4 || len > data.len() {
            let e = ParseError(format!("attribute {kind} length {len} of {}", data.len()));
            data = &[];
            return Some(Err(e));
        }
        let payload = &data[4..len];
        data = &data[align4(len).min(data.len())..];
        Some(Ok((kind, payload)))
    })
}

/// The first attribute of `kind` in `data` (the walk stops quietly at a malformed one).
pub(crate) fn find_attr(data: &[u8], kind: u16) -> Option<&[u8]> {
    attrs(data)
        .map_while(Result::ok)
        .find(|(k, _)| *k == kind)
        .map(|(_, p)| p)
}

/// A host-order `u16` payload.
pub(crate) fn read_u16(p: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(p.get(..2)?.try_into().ok()?))
}

/// A host-order `u32` payload.
pub(crate) fn read_u32(p: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(p.get(..4)?.try_into().ok()?))
}

/// A NUL-terminated (or plain) string payload.
pub(crate) fn read_str(p: &[u8]) -> String {
    let end = p.iter().position(|b| *b == 0).unwrap_or(p.len());
    String::from_utf8_lossy(&p[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::netlink::NLM_F_ACK;
    use crate::kernel::netlink::NLM_F_DUMP;
    use crate::kernel::netlink::NLM_F_MULTI;
    use crate::kernel::netlink::NLMSG_DONE;
    use crate::kernel::netlink::unhex;

    #[cfg(target_endian = "little")]
    #[test]
    fn builds_the_exact_bytes() {
        let mut m = MsgBuilder::new(0x20, NLM_F_ACK).header(&[1, 2, 0]);
        m.begin_nested(1).u16(1, 0x0102).str(6, "rr").end_nested();
        m.u32(4, 900).attr(9, &[0xab]);
        #[rustfmt::skip]
        let want: &[u8] = &[
            56, 0, 0, 0, 0x20, 0, 5, 0, 7, 0, 0, 0, 0, 0, 0, 0, // nlmsghdr: REQUEST|ACK, seq 7
            1, 2, 0, 0,                                         // 3-byte header, padded
            20, 0, 1, 0x80,                                     // nested 1, 20 bytes
              6, 0, 1, 0, 2, 1, 0, 0,                           // u16 0x0102, padded
              7, 0, 6, 0, b'r', b'r', 0, 0,                     // "rr\0", padded
            8, 0, 4, 0, 0x84, 3, 0, 0,                          // u32 900
            5, 0, 9, 0, 0xab, 0, 0, 0,                          // one byte, padded
        ];
        assert_eq!(m.finish(7), want);
        // A builder can be finished again with another sequence number.
        assert_eq!(&m.finish(8)[8..12], &8u32.to_ne_bytes());
    }

    #[test]
    fn nested_attributes_round_trip() {
        let mut m = MsgBuilder::new(0x20, NLM_F_DUMP).header(&[1, 2, 0, 0]);
        m.begin_nested(1).u16(1, 2).str(6, "rr").end_nested();
        m.u32(4, 900);
        let bytes = m.finish(7);
        let msgs = parse_messages(&bytes).unwrap();
        assert_eq!(msgs.len(), 1);
        assert_eq!(msgs[0].msg_type, 0x20);
        assert_eq!(msgs[0].seq, 7);
        assert_eq!(msgs[0].flags, NLM_F_DUMP | NLM_F_REQUEST);
        let body = &msgs[0].payload[4..];
        let nested = find_attr(body, 1).unwrap();
        assert_eq!(read_u16(find_attr(nested, 1).unwrap()), Some(2));
        assert_eq!(read_str(find_attr(nested, 6).unwrap()), "rr");
        assert_eq!(read_u32(find_attr(body, 4).unwrap()), Some(900));
        let kinds: Vec<u16> = attrs(body).map(|a| a.unwrap().0).collect();
        assert_eq!(kinds, [1, 4], "the nested flag is masked off");
    }

    /// Kernel 6.18 (x86_64) answers captured in a fresh network namespace with `lo` up, on an
    /// `NETLINK_ROUTE` socket with `NETLINK_CAP_ACK`: an `RTM_GETADDR` dump of `AF_INET` (seq
    /// 5; one `RTM_NEWADDR` with `NLM_F_MULTI`, then `NLMSG_DONE` in a second datagram), and
    /// `RTM_NEWADDR` of 127.0.0.1/8 on `lo` again with `NLM_F_ACK` (seq 6: `EEXIST`, the
    /// request header echoed without its payload, `NLM_F_CAPPED`).
    #[cfg(target_endian = "little")]
    #[test]
    fn parses_captured_kernel_answers() {
        let dump = unhex(concat!(
            "4c00000014000200050000000b2f0000020880fe01000000080001007f000001080002007f000001",
            "070003006c6f0000080008008000000014000600fffffffffffffffff88c0000f88c0000",
        ));
        let done = unhex("1400000003000200050000000b2f000000000000");
        let eexist =
            unhex("2400000002000001060000000b2f0000efffffff20000000140005060600000000000000");
        let m = parse_messages(&dump).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!((m[0].msg_type, m[0].flags, m[0].seq), (20, NLM_F_MULTI, 5));
        // ifaddrmsg: AF_INET, /8, index 1; then IFA_ADDRESS, IFA_LOCAL, IFA_LABEL, ...
        assert_eq!(&m[0].payload[..2], &[2, 8]);
        let ifa = &m[0].payload[8..];
        assert_eq!(find_attr(ifa, 2).unwrap(), &[127, 0, 0, 1]);
        assert_eq!(read_str(find_attr(ifa, 3).unwrap()), "lo");
        let kinds: Vec<u16> = attrs(ifa).map(|a| a.unwrap().0).collect();
        assert_eq!(kinds, [1, 2, 3, 8, 6]);
        let m = parse_messages(&done).unwrap();
        assert_eq!(
            (m[0].msg_type, m[0].flags, m[0].seq),
            (NLMSG_DONE, NLM_F_MULTI, 5)
        );
        let m = parse_messages(&eexist).unwrap();
        assert_eq!((m.len(), m[0].msg_type, m[0].seq), (1, NLMSG_ERROR, 6));
        assert_eq!(m[0].errno(), Ok(libc::EEXIST));
        // Two messages in one datagram (as a batch of acks arrives).
        let both = [eexist.clone(), done.clone()].concat();
        let seqs: Vec<u32> = messages(&both).map(|m| m.unwrap().seq).collect();
        assert_eq!(seqs, [6, 5]);
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let bytes = MsgBuilder::new(1, 0).finish(1);
        assert!(
            parse_messages(&bytes[..10]).unwrap().is_empty(),
            "short tail"
        );
        let mut bad = bytes.clone();
        bad[0..4].copy_from_slice(&100u32.to_ne_bytes());
        let e = parse_messages(&bad).unwrap_err();
        assert!(e.0.contains("length 100"), "{e}");
        bad[0..4].copy_from_slice(&8u32.to_ne_bytes());
        assert!(parse_messages(&bad).is_err(), "shorter than a header");
        let attr_too_long = [8u8, 0, 1, 0, 1];
        assert!(attrs(&attr_too_long).next().unwrap().is_err());
        assert_eq!(
            attrs(&attr_too_long).count(),
            1,
            "the walk stops at the error"
        );
        assert_eq!(find_attr(&attr_too_long, 1), None);
        let short_error = Msg {
            msg_type: NLMSG_ERROR,
            flags: 0,
            seq: 1,
            payload: &[0, 0],
        };
        assert!(short_error.errno().is_err());
    }
}
