//! Raw netlink, shared by kproxy's hand-written netlink clients of the families no maintained
//! crate covers here: ctnetlink ([`crate::dataplane::netfilter::conntrack::netlink`]),
//! sock_diag ([`crate::dataplane::ebpf::socket_lb::sock_diag`]), IPVS generic netlink
//! ([`crate::dataplane::ipvs::genl`]) and nf_tables ([`crate::kernel::nftables`]).
//! rtnetlink is not here: [`crate::kernel::rtnl`] uses the `rtnetlink` crates.
//!
//! - [`wire`]: the pure part: [`MsgBuilder`] (header, family header, attributes, nested
//!   attributes), [`messages`] (splits a datagram into [`Msg`]s), [`attrs`] (walks attributes),
//!   small readers. Unit-tested on built and captured bytes.
//! - [`socket`]: [`Socket`], a blocking `AF_NETLINK` socket that sends a request and hands
//!   the answers of that request's sequence number to the caller until the kernel ends the
//!   exchange (`NLMSG_DONE`, or the `NLMSG_ERROR` that is an ack or an error).
//!
//! Layout reminders: every message starts with `nlmsghdr` (len u32, type u16, flags u16, seq
//! u32, pid u32, host byte order), then a protocol's fixed header, then attributes `(len u16,
//! type u16, payload)` padded to 4 bytes; nested attributes carry [`NLA_F_NESTED`]. Payload byte
//! order is the protocol's business (ctnetlink and IPVS ports are big-endian).

pub(crate) mod socket;
pub(crate) mod wire;

pub(crate) use socket::{End, Socket};
pub(crate) use wire::{
    Msg, MsgBuilder, OwnedMsg, ParseError, attrs, find_attr, messages, read_str, read_u16, read_u32,
};

pub(crate) const NLMSG_HDRLEN: usize = 16;
pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;

pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_MULTI: u16 = 0x2;
pub(crate) const NLM_F_ACK: u16 = 0x4;
/// The dump was interrupted (the object set changed while it ran).
pub(crate) const NLM_F_DUMP_INTR: u16 = 0x10;
pub(crate) const NLM_F_ROOT: u16 = 0x100;
pub(crate) const NLM_F_MATCH: u16 = 0x200;
pub(crate) const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;

pub(crate) const NLA_F_NESTED: u16 = 0x8000;
pub(crate) const NLA_TYPE_MASK: u16 = 0x3fff;

/// Bytes from hex (captured kernel answers in unit tests).
#[cfg(test)]
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}
