//! rtnetlink for the IPVS dummy interface (`kube-ipvs0`): create/delete the link, list, add
//! and remove its addresses. Service addresses are bound as /32 (IPv4) or /128 (IPv6) so the
//! kernel treats them as local and IPVS sees the traffic at LOCAL_IN. Like upstream, the link
//! is left down: the local routes of its addresses exist anyway.

use std::io;
use std::net::IpAddr;

use super::genl::open_socket;
use crate::kernel::netlink::MsgBuilder;
use crate::kernel::netlink::NLM_F_ACK;
use crate::kernel::netlink::NLM_F_CREATE;
use crate::kernel::netlink::NLM_F_DUMP;
use crate::kernel::netlink::NLM_F_EXCL;
use crate::kernel::netlink::Socket;
use crate::kernel::netlink::attrs;
use crate::kernel::netlink::find_attr;
use crate::kernel::netlink::read_str;

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const RTM_GETADDR: u16 = 22;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;

/// `struct ifinfomsg` (16 bytes) for `index`.
fn ifinfomsg(index: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[4..8].copy_from_slice(&index.to_ne_bytes());
    b
}

/// `struct ifaddrmsg` (8 bytes).
fn ifaddrmsg(family: u8, prefix: u8, index: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = family;
    b[1] = prefix;
    b[4..8].copy_from_slice(&index.to_ne_bytes());
    b
}

fn family_prefix(ip: &IpAddr) -> (u8, u8) {
    match ip {
        IpAddr::V4(_) => (libc::AF_INET as u8, 32),
        IpAddr::V6(_) => (libc::AF_INET6 as u8, 128),
    }
}

fn ip_bytes(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// `RTM_NEWLINK` creating a dummy link named `name`.
pub fn encode_new_dummy(name: &str) -> MsgBuilder {
    let mut m =
        MsgBuilder::new(RTM_NEWLINK, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL).header(&ifinfomsg(0));
    m.str(IFLA_IFNAME, name);
    m.begin_nested(IFLA_LINKINFO)
        .str(IFLA_INFO_KIND, "dummy")
        .end_nested();
    m
}

/// `RTM_NEWADDR`/`RTM_DELADDR` of a host address on `index`.
pub fn encode_addr(index: u32, ip: &IpAddr, add: bool) -> MsgBuilder {
    let (family, prefix) = family_prefix(ip);
    let (kind, flags) = if add {
        (RTM_NEWADDR, NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
    } else {
        (RTM_DELADDR, NLM_F_ACK)
    };
    let mut m = MsgBuilder::new(kind, flags).header(&ifaddrmsg(family, prefix, index));
    let b = ip_bytes(ip);
    m.attr(IFA_LOCAL, &b).attr(IFA_ADDRESS, &b);
    m
}

/// The address of one `RTM_NEWADDR` dump reply, if it belongs to `index`.
pub fn decode_addr(payload: &[u8], index: u32) -> Option<IpAddr> {
    let hdr = payload.get(..8)?;
    if u32::from_ne_bytes(hdr[4..8].try_into().ok()?) != index {
        return None;
    }
    let family = hdr[0];
    let p =
        find_attr(&payload[8..], IFA_LOCAL).or_else(|| find_attr(&payload[8..], IFA_ADDRESS))?;
    if family == libc::AF_INET as u8 {
        let o: [u8; 4] = p.get(..4)?.try_into().ok()?;
        Some(IpAddr::from(o))
    } else if family == libc::AF_INET6 as u8 {
        let o: [u8; 16] = p.get(..16)?.try_into().ok()?;
        Some(IpAddr::from(o))
    } else {
        None
    }
}

/// A route-netlink socket in the caller's network namespace.
#[derive(Debug)]
pub struct Rtnl {
    sock: Socket,
}

impl Rtnl {
    pub fn open() -> io::Result<Rtnl> {
        Ok(Rtnl {
            sock: open_socket(libc::NETLINK_ROUTE)?,
        })
    }

    /// The index of link `name`, if it exists.
    pub fn link_index(&mut self, name: &str) -> io::Result<Option<u32>> {
        let mut m = MsgBuilder::new(RTM_GETLINK, NLM_F_ACK).header(&ifinfomsg(0));
        m.str(IFLA_IFNAME, name);
        match self.sock.request(&m) {
            Ok(replies) => Ok(replies.iter().find_map(|r| {
                let p = r.payload.get(..16)?;
                let index = u32::from_ne_bytes(p[4..8].try_into().ok()?);
                let n = attrs(&r.payload[16..])
                    .map_while(Result::ok)
                    .find(|(k, _)| *k == IFLA_IFNAME)?;
                (read_str(n.1) == name).then_some(index)
            })),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates the dummy link `name` unless it exists; returns its index.
    pub fn ensure_dummy(&mut self, name: &str) -> io::Result<u32> {
        if let Some(i) = self.link_index(name)? {
            return Ok(i);
        }
        match self.sock.request(&encode_new_dummy(name)) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("creating dummy link {name}: {e} (is the dummy module loaded?)"),
                ));
            }
        }
        self.link_index(name)?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("link {name} vanished after creation"),
            )
        })
    }

    pub fn delete_link(&mut self, index: u32) -> io::Result<()> {
        let m = MsgBuilder::new(RTM_DELLINK, NLM_F_ACK).header(&ifinfomsg(index));
        self.sock.request(&m).map(|_| ())
    }

    /// The addresses on link `index`.
    pub fn addresses(&mut self, index: u32) -> io::Result<Vec<IpAddr>> {
        let m = MsgBuilder::new(RTM_GETADDR, NLM_F_DUMP).header(&ifaddrmsg(0, 0, 0));
        let replies = self.sock.request(&m)?;
        Ok(replies
            .iter()
            .filter(|r| r.msg_type == RTM_NEWADDR)
            .filter_map(|r| decode_addr(&r.payload, index))
            .collect())
    }

    /// Binds `ip` to `index` (an existing binding is fine).
    pub fn add_address(&mut self, index: u32, ip: &IpAddr) -> io::Result<()> {
        match self.sock.request(&encode_addr(index, ip, true)) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Unbinds `ip` from `index` (a missing one is fine).
    pub fn del_address(&mut self, index: u32, ip: &IpAddr) -> io::Result<()> {
        match self.sock.request(&encode_addr(index, ip, false)) {
            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Ok(()),
            r => r.map(|_| ()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::netlink::parse_messages;

    #[test]
    fn address_messages_round_trip_for_both_families() {
        for (ip, prefix) in [("10.96.0.10", 32u8), ("fd00::a", 128)] {
            let ip: IpAddr = ip.parse().unwrap();
            let bytes = encode_addr(7, &ip, true).finish(1);
            let msgs = parse_messages(&bytes).unwrap();
            assert_eq!(msgs[0].msg_type, RTM_NEWADDR);
            assert_eq!(msgs[0].payload[1], prefix);
            assert_eq!(decode_addr(msgs[0].payload, 7), Some(ip));
            assert_eq!(decode_addr(msgs[0].payload, 8), None, "other link");
        }
        let del = encode_addr(7, &"10.0.0.1".parse().unwrap(), false).finish(1);
        assert_eq!(parse_messages(&del).unwrap()[0].msg_type, RTM_DELADDR);
    }

    #[test]
    fn dummy_link_request_names_kind_and_link() {
        let bytes = encode_new_dummy("kube-ipvs0").finish(1);
        let msgs = parse_messages(&bytes).unwrap();
        let attrs_ = &msgs[0].payload[16..];
        assert_eq!(
            read_str(find_attr(attrs_, IFLA_IFNAME).unwrap()),
            "kube-ipvs0"
        );
        let info = find_attr(attrs_, IFLA_LINKINFO).unwrap();
        assert_eq!(read_str(find_attr(info, IFLA_INFO_KIND).unwrap()), "dummy");
    }
}
