//! rtnetlink for the IPVS dummy interface (`kube-ipvs0`): create/delete the link, list, add
//! and remove its addresses. Service addresses are bound as /32 (IPv4) or /128 (IPv6) so the
//! kernel treats them as local and IPVS sees the traffic at LOCAL_IN. Like upstream, the link
//! is left down: the local routes of its addresses exist anyway.
//!
//! The messages are `rtnetlink`'s (`LinkDummy`, `LinkUnspec`, `AddressMessageBuilder`), sent
//! over [`crate::kernel::rtnl::RouteSocket`]; the request builders below are pure, for the
//! unit tests.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use rtnetlink::packet_core::{NLM_F_CREATE, NLM_F_EXCL, NetlinkMessage};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::address::AddressMessage;
use rtnetlink::packet_route::link::LinkAttribute;
use rtnetlink::{AddressMessageBuilder, LinkDummy, LinkUnspec};

use crate::kernel::addresses::address_of;
use crate::kernel::rtnl::{RouteSocket, dump_request, request};

type Request = NetlinkMessage<RouteNetlinkMessage>;

/// `RTM_GETLINK` of the link named `name`.
pub(crate) fn get_link(name: &str) -> Request {
    request(
        RouteNetlinkMessage::GetLink(LinkUnspec::new_with_name(name).build()),
        0,
    )
}

/// `RTM_NEWLINK` creating a dummy link named `name` (an existing one is an error).
pub(crate) fn new_dummy(name: &str) -> Request {
    request(
        RouteNetlinkMessage::NewLink(LinkDummy::new(name).build()),
        NLM_F_CREATE | NLM_F_EXCL,
    )
}

/// `RTM_DELLINK` of link `index`.
pub(crate) fn del_link(index: u32) -> Request {
    request(
        RouteNetlinkMessage::DelLink(LinkUnspec::new_with_index(index).build()),
        0,
    )
}

/// The host address `ip` (/32 or /128) on link `index`.
fn host_address(index: u32, ip: &IpAddr) -> AddressMessage {
    match ip {
        IpAddr::V4(a) => AddressMessageBuilder::<Ipv4Addr>::new()
            .index(index)
            .address(*a, 32)
            .build(),
        IpAddr::V6(a) => AddressMessageBuilder::<Ipv6Addr>::new()
            .index(index)
            .address(*a, 128)
            .build(),
    }
}

/// `RTM_NEWADDR` (an existing address is an error) or `RTM_DELADDR` of the host address `ip`
/// on link `index`.
pub(crate) fn address_request(index: u32, ip: &IpAddr, add: bool) -> Request {
    let msg = host_address(index, ip);
    if add {
        request(
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_CREATE | NLM_F_EXCL,
        )
    } else {
        request(RouteNetlinkMessage::DelAddress(msg), 0)
    }
}

/// The address of one `RTM_NEWADDR` dump answer, if it belongs to link `index`.
pub(crate) fn address_on(msg: &AddressMessage, index: u32) -> Option<IpAddr> {
    (msg.header.index == index)
        .then(|| address_of(msg))
        .flatten()
}

/// A route-netlink socket in the caller's network namespace.
#[derive(Debug)]
pub(crate) struct Rtnl {
    sock: RouteSocket,
}

impl Rtnl {
    pub(crate) fn open() -> io::Result<Rtnl> {
        Ok(Rtnl {
            sock: RouteSocket::open()?,
        })
    }

    /// The index of link `name`, if it exists.
    pub(crate) fn link_index(&mut self, name: &str) -> io::Result<Option<u32>> {
        match self.sock.collect(get_link(name)) {
            Ok(answers) => Ok(answers.iter().find_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => l
                    .attributes
                    .iter()
                    .any(|a| matches!(a, LinkAttribute::IfName(n) if n == name))
                    .then_some(l.header.index),
                _ => None,
            })),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates the dummy link `name` unless it exists; returns its index.
    pub(crate) fn ensure_dummy(&mut self, name: &str) -> io::Result<u32> {
        if let Some(i) = self.link_index(name)? {
            return Ok(i);
        }
        match self.sock.collect(new_dummy(name)) {
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

    pub(crate) fn delete_link(&mut self, index: u32) -> io::Result<()> {
        self.sock.collect(del_link(index)).map(|_| ())
    }

    /// The addresses on link `index`.
    pub(crate) fn addresses(&mut self, index: u32) -> io::Result<Vec<IpAddr>> {
        let answers = self
            .sock
            .collect(dump_request(RouteNetlinkMessage::GetAddress(
                AddressMessage::default(),
            )))?;
        Ok(answers
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) => address_on(a, index),
                _ => None,
            })
            .collect())
    }

    /// Binds `ip` to `index` (an existing binding is fine).
    pub(crate) fn add_address(&mut self, index: u32, ip: &IpAddr) -> io::Result<()> {
        match self.sock.collect(address_request(index, ip, true)) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            r => r.map(|_| ()),
        }
    }

    /// Unbinds `ip` from `index` (a missing one is fine).
    pub(crate) fn del_address(&mut self, index: u32, ip: &IpAddr) -> io::Result<()> {
        match self.sock.collect(address_request(index, ip, false)) {
            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => Ok(()),
            r => r.map(|_| ()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
    use rtnetlink::packet_route::AddressFamily;
    use rtnetlink::packet_route::address::AddressAttribute;
    use rtnetlink::packet_route::link::{InfoKind, LinkInfo};

    use crate::kernel::rtnl::tests::{in_new_netns, ip};
    use crate::kernel::rtnl::{messages, parse};

    /// `req` as the kernel receives it (before [`RouteSocket::exchange`] adds the ack flag),
    /// parsed back: its flags and message.
    fn on_the_wire(mut req: Request) -> (u16, RouteNetlinkMessage) {
        req.finalize();
        let mut b = vec![0; req.buffer_len()];
        req.serialize(&mut b);
        let (h, p) = messages(&b).next().unwrap().unwrap();
        (h.flags, parse(&h, p).unwrap())
    }

    #[test]
    fn address_requests_carry_a_host_prefix_for_both_families() {
        for (ip, family, prefix) in [
            ("10.96.0.10", AddressFamily::Inet, 32u8),
            ("fd00::a", AddressFamily::Inet6, 128),
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            let (flags, m) = on_the_wire(address_request(7, &ip, true));
            assert_eq!(flags, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL);
            let RouteNetlinkMessage::NewAddress(a) = m else {
                panic!("{m:?}")
            };
            assert_eq!(
                (a.header.family, a.header.prefix_len, a.header.index),
                (family, prefix, 7)
            );
            assert_eq!(u8::from(a.header.scope), 0, "universe");
            let mut attrs = a.attributes.clone();
            attrs.sort_by_key(|a| format!("{a:?}"));
            assert_eq!(
                attrs,
                [AddressAttribute::Address(ip), AddressAttribute::Local(ip)],
                "IFA_LOCAL and IFA_ADDRESS, no broadcast"
            );
            assert_eq!(address_on(&a, 7), Some(ip));
            assert_eq!(address_on(&a, 8), None, "other link");
            let (flags, m) = on_the_wire(address_request(7, &ip, false));
            assert_eq!(flags, NLM_F_REQUEST);
            assert!(matches!(m, RouteNetlinkMessage::DelAddress(d) if d == a));
        }
    }

    #[test]
    fn link_requests_name_kind_and_link() {
        let (flags, m) = on_the_wire(new_dummy("kube-ipvs0"));
        assert_eq!(flags, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL);
        let RouteNetlinkMessage::NewLink(l) = m else {
            panic!("{m:?}")
        };
        assert_eq!(l.header.index, 0);
        assert_eq!(
            l.attributes,
            [
                LinkAttribute::IfName("kube-ipvs0".into()),
                LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Dummy)]),
            ]
        );
        let (flags, m) = on_the_wire(get_link("kube-ipvs0"));
        assert_eq!(flags, NLM_F_REQUEST, "one link, not a dump");
        assert!(matches!(m, RouteNetlinkMessage::GetLink(l)
            if l.attributes == [LinkAttribute::IfName("kube-ipvs0".into())]));
        let (_, m) = on_the_wire(del_link(9));
        assert!(matches!(m, RouteNetlinkMessage::DelLink(l) if l.header.index == 9));
        assert_eq!(NLM_F_ACK & flags, 0, "the socket adds the ack");
        let (flags, _) = on_the_wire(dump_request(RouteNetlinkMessage::GetAddress(
            AddressMessage::default(),
        )));
        assert_eq!(flags, NLM_F_REQUEST | NLM_F_DUMP);
    }

    /// The IPVS proxier's use of its link, against the kernel (in a namespace of its own):
    /// find, bind and unbind addresses (twice each), list, delete; then the dummy link where
    /// this kernel has the dummy driver (this development host's has not: a veth stands in).
    #[test]
    fn the_link_and_its_addresses_in_a_namespace() {
        in_new_netns(|| {
            let mut r = Rtnl::open().unwrap();
            assert_eq!(r.link_index("kp-v0").unwrap(), None);
            ip(&[
                "link", "add", "kp-v0", "type", "veth", "peer", "name", "kp-v1",
            ]);
            let index = r.link_index("kp-v0").unwrap().expect("kp-v0 exists");
            assert_eq!(r.ensure_dummy("kp-v0").unwrap(), index, "exists already");
            let v4: IpAddr = "10.96.0.10".parse().unwrap();
            let v6: IpAddr = "fd00::a".parse().unwrap();
            for ip in [v4, v6, v4] {
                r.add_address(index, &ip).unwrap();
            }
            let mut got = r.addresses(index).unwrap();
            got.sort();
            assert_eq!(got, [v4, v6]);
            assert_eq!(r.addresses(1).unwrap(), Vec::<IpAddr>::new(), "lo is down");
            for ip in [v4, v4] {
                r.del_address(index, &ip).unwrap();
            }
            assert_eq!(r.addresses(index).unwrap(), [v6]);
            r.delete_link(index).unwrap();
            assert_eq!(r.link_index("kp-v0").unwrap(), None);
            let e = r.delete_link(index).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENODEV), "{e}");
            match r.ensure_dummy("kp-ipvs0") {
                Ok(i) => {
                    assert_eq!(r.link_index("kp-ipvs0").unwrap(), Some(i));
                    r.delete_link(i).unwrap();
                }
                Err(e) => {
                    assert!(e.to_string().contains("dummy module"), "{e}");
                    eprintln!("skipped: the dummy link itself: {e}");
                }
            }
        });
    }
}
