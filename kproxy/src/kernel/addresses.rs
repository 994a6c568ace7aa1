//! Node addresses per device: read from the kernel ([`scan`]) and watched for changes
//! ([`AddressWatcher`]), so an address added to a node device starts answering NodePorts and
//! becomes the SNAT source of its device without a restart.
//!
//! [`scan`] is two rtnetlink dumps (`crate::kernel::rtnl`): the links, then the addresses
//! of every family (the kernel's order: IPv4 before IPv6, a device's primary IPv4 address
//! first). The watcher joins the link and address announcement groups and scans again after
//! each batch of announcements (or lost ones), and also every `interval` (default 1 s), so a
//! change is seen within milliseconds and, should notifications fail, within one interval;
//! it calls back only when the set changed. Everything runs in the network namespace of the
//! thread that calls [`scan`] or [`AddressWatcher::spawn`] (tests call them from inside the
//! node's namespace).
//!
//! The callback is where the agent (1) updates `KP_NODE_ADDR4` / `KP_NODE_ADDR6` through
//! [`crate::dataplane::ebpf::node_path::TcPath::set_node_addresses`] / [`crate::dataplane::ebpf::node_path::TcPath::set_node_addresses6`] and (2) hands [`NodeAddresses::all`] to the eBPF
//! planner, which creates one NodePort frontend per node address.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use rtnetlink::packet_core::{Emitable, NlasIterator, ParseableParametrized};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, LinkHeader, LinkMessage};

use crate::kernel::rtnl::{
    MulticastGroup, Received, RouteSocket, Subscription, dump_request, parse,
};

/// One network device and its addresses, as [`scan`] reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub index: u32,
    pub up: bool,
    pub loopback: bool,
    /// In the kernel's order (the first IPv4 one is the device's primary address).
    pub addrs: Vec<IpAddr>,
}

impl Interface {
    /// The addresses that count as node addresses.
    pub(crate) fn node_addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.addrs.iter().copied().filter(|a| is_node_addr(*a))
    }
}

/// Global-scope unicast: what NodePorts answer on and SNAT uses as source.
pub(crate) fn is_node_addr(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => {
            !(a.is_loopback()
                || a.is_link_local()
                || a.is_multicast()
                || a.is_unspecified()
                || a.is_broadcast())
        }
        IpAddr::V6(a) => {
            !(a.is_loopback()
                || a.is_multicast()
                || a.is_unspecified()
                || a.is_unicast_link_local())
        }
    }
}

/// Default interval of [`AddressWatcher`]'s scans between announcements.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// Every device of the calling thread's network namespace with its addresses, by name.
pub fn scan() -> std::io::Result<Vec<Interface>> {
    let mut sock = RouteSocket::open()?;
    let mut by_index: BTreeMap<u32, Interface> = BTreeMap::new();
    let links = dump_request(RouteNetlinkMessage::GetLink(LinkMessage::default()));
    sock.exchange(links, |_, payload| {
        match link_of(payload) {
            Some(iface) => {
                by_index.insert(iface.index, iface);
            }
            None => tracing::warn!("skipping a link the kernel reported without a name"),
        }
        Ok(())
    })?;
    let addrs = dump_request(RouteNetlinkMessage::GetAddress(AddressMessage::default()));
    sock.exchange(addrs, |header, payload| {
        match parse(header, payload) {
            Ok(RouteNetlinkMessage::NewAddress(a)) => {
                // A device that appeared after the link dump is skipped.
                if let (Some(iface), Some(ip)) = (by_index.get_mut(&a.header.index), address_of(&a))
                {
                    iface.addrs.push(ip);
                }
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "skipping an address the kernel reported"),
        }
        Ok(())
    })?;
    let by_name: BTreeMap<String, Interface> = by_index
        .into_values()
        .map(|i| (i.name.clone(), i))
        .collect();
    Ok(by_name.into_values().collect())
}

/// A device (without addresses) from an `RTM_NEWLINK` payload: its header and name. Only the
/// attributes up to the name are parsed, each on its own, so an attribute this crate version
/// cannot parse costs nothing; `None` without a name.
fn link_of(payload: &[u8]) -> Option<Interface> {
    let header = LinkHeader::parse(payload).ok()?;
    let name = NlasIterator::new(payload.get(header.buffer_len()..)?)
        .map_while(Result::ok)
        .find_map(
            |nla| match LinkAttribute::parse_with_param(&nla, header.interface_family) {
                Ok(LinkAttribute::IfName(name)) => Some(name),
                _ => None,
            },
        )?;
    Some(Interface {
        name,
        index: header.index,
        up: header.flags.contains(LinkFlags::Up),
        loopback: header.flags.contains(LinkFlags::Loopback),
        addrs: Vec::new(),
    })
}

/// The address of an `RTM_NEWADDR`: the local one (`IFA_LOCAL`), else `IFA_ADDRESS` (on a
/// point-to-point device that one is the peer's), as `getifaddrs(3)` reports it.
pub(crate) fn address_of(msg: &AddressMessage) -> Option<IpAddr> {
    let local = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    local.or_else(|| {
        msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })
}

/// The node addresses of a set of devices (see `is_node_addr`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeAddresses {
    /// Device name → (ifindex, node addresses in kernel order).
    pub devices: BTreeMap<String, (u32, Vec<IpAddr>)>,
}

impl NodeAddresses {
    /// The node addresses of `devices` (all devices when `None`).
    pub fn from_interfaces(interfaces: &[Interface], devices: Option<&[String]>) -> Self {
        let devices = interfaces
            .iter()
            .filter(|i| devices.is_none_or(|d| d.contains(&i.name)))
            .filter(|i| !i.loopback)
            .map(|i| (i.name.clone(), (i.index, i.node_addrs().collect())))
            .collect();
        NodeAddresses { devices }
    }

    /// Every node address (sorted, unique): where NodePort frontends listen.
    pub fn all(&self) -> Vec<IpAddr> {
        let mut all: Vec<IpAddr> = self
            .devices
            .values()
            .flat_map(|(_, a)| a.iter().copied())
            .collect();
        all.sort();
        all.dedup();
        all
    }

    /// The SNAT source of each device: ifindex → its first IPv4 node address.
    pub fn snat_v4(&self) -> Vec<(u32, Ipv4Addr)> {
        self.devices
            .values()
            .filter_map(|(index, addrs)| {
                addrs.iter().find_map(|a| match a {
                    IpAddr::V4(v4) if is_node_addr(*a) => Some((*index, *v4)),
                    _ => None,
                })
            })
            .collect()
    }
}

impl NodeAddresses {
    /// The IPv6 SNAT source of each device: ifindex → its first global-scope IPv6 node address
    /// (link-local addresses are never node addresses, see
    /// `is_node_addr`).
    pub fn snat_v6(&self) -> Vec<(u32, Ipv6Addr)> {
        self.devices
            .values()
            .filter_map(|(index, addrs)| {
                addrs.iter().find_map(|a| match a {
                    IpAddr::V6(v6) if is_node_addr(*a) => Some((*index, *v6)),
                    _ => None,
                })
            })
            .collect()
    }
}

/// The announcement groups whose messages may change [`scan`]'s answer.
const ADDRESS_GROUPS: [MulticastGroup; 3] = [
    MulticastGroup::Link,
    MulticastGroup::Ipv4Ifaddr,
    MulticastGroup::Ipv6Ifaddr,
];

/// How long the watcher's thread waits at a time before it checks whether to stop.
const STEP: Duration = Duration::from_millis(50);

/// Announcements read after the first one before scanning again.
const DRAIN_MAX: usize = 256;

/// Follows the node's addresses on a background thread and calls back on every change (and
/// once at start). Stops (and joins) on drop.
pub struct AddressWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl AddressWatcher {
    /// Starts watching `devices` (all non-loopback devices when `None`) in the calling thread's
    /// network namespace: a scan after each batch of link or address announcements, and every
    /// `interval`. Without announcements (the groups cannot be joined) it only polls, with a
    /// warning. Scan errors are logged and retried at the next occasion.
    pub fn spawn<F>(devices: Option<Vec<String>>, interval: Duration, mut on_change: F) -> Self
    where
        F: FnMut(&NodeAddresses) + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_thread = Arc::clone(&stop);
        // Joined here, before the first scan: no change made after this call is missed.
        let mut announcements = match Subscription::open(&ADDRESS_GROUPS, STEP) {
            Ok(s) => Some(s),
            Err(error) => {
                tracing::warn!(%error, "no address change notifications: polling node addresses");
                None
            }
        };
        // A thread created by a thread inherits its network namespace.
        let thread = thread::Builder::new()
            .name("kp-node-addrs".into())
            .spawn(move || {
                let mut last: Option<NodeAddresses> = None;
                while !stop_thread.load(Ordering::Relaxed) {
                    match scan() {
                        Ok(ifaces) => {
                            let now = NodeAddresses::from_interfaces(&ifaces, devices.as_deref());
                            if last.as_ref() != Some(&now) {
                                tracing::info!(addresses = ?now.all(), "node addresses changed");
                                on_change(&now);
                                last = Some(now);
                            }
                        }
                        Err(error) => tracing::warn!(%error, "reading node addresses"),
                    }
                    wait(announcements.as_mut(), interval, &stop_thread);
                }
            })
            .expect("spawning the node address watcher thread");
        AddressWatcher {
            stop,
            thread: Some(thread),
        }
    }
}

/// Returns after `interval`, after a batch of announcements (drained), or soon after `stop`
/// is set, whichever comes first; checks `stop` every [`STEP`].
fn wait(mut announcements: Option<&mut Subscription>, interval: Duration, stop: &AtomicBool) {
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let left = interval.saturating_sub(start.elapsed());
        if left.is_zero() {
            return;
        }
        let Some(sub) = announcements.as_deref_mut() else {
            thread::sleep(STEP.min(left));
            continue;
        };
        match sub.recv(true) {
            Ok(Received::Nothing) => {}
            Ok(Received::Messages(_) | Received::Lost) => {
                for _ in 0..DRAIN_MAX {
                    if !matches!(sub.recv(false), Ok(Received::Messages(_) | Received::Lost)) {
                        break;
                    }
                }
                return;
            }
            Err(error) => {
                tracing::warn!(%error, "address change notifications failed");
                thread::sleep(STEP.min(left));
            }
        }
    }
}

impl Drop for AddressWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn node_addresses_exclude_local_scopes() {
        for a in [
            "127.0.0.1",
            "169.254.1.1",
            "224.0.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "ff02::1",
        ] {
            assert!(!is_node_addr(a.parse().unwrap()), "{a}");
        }
        for a in ["10.0.0.1", "192.0.2.1", "2001:db8::1", "fd00::1"] {
            assert!(is_node_addr(a.parse().unwrap()), "{a}");
        }
    }

    /// An up interface named `name` with `addrs` (tests of this module and of device selection).
    pub(crate) fn iface(name: &str, index: u32, addrs: &[&str]) -> Interface {
        Interface {
            name: name.into(),
            index,
            up: true,
            loopback: name == "lo",
            addrs: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn node_addresses_per_device_and_snat_sources() {
        let ifaces = vec![
            iface("lo", 1, &["127.0.0.1"]),
            iface("eth0", 2, &["fe80::1", "192.0.2.10", "192.0.2.11"]),
            iface("eth1", 3, &["2001:db8::1"]),
        ];
        let all = NodeAddresses::from_interfaces(&ifaces, None);
        assert_eq!(
            all.all(),
            ["192.0.2.10", "192.0.2.11", "2001:db8::1"]
                .map(|a| a.parse::<IpAddr>().unwrap())
                .to_vec()
        );
        assert_eq!(all.snat_v4(), vec![(2, "192.0.2.10".parse().unwrap())]);
        let only = NodeAddresses::from_interfaces(&ifaces, Some(&["eth1".to_string()]));
        assert_eq!(only.all(), vec!["2001:db8::1".parse::<IpAddr>().unwrap()]);
        assert!(only.snat_v4().is_empty());
        assert_eq!(only.snat_v6(), vec![(3, "2001:db8::1".parse().unwrap())]);
        assert!(
            all.snat_v6().iter().all(|(i, _)| *i == 3),
            "eth0's link-local address is not a SNAT source"
        );
    }

    #[test]
    fn scan_sees_the_loopback_device() {
        let ifaces = scan().unwrap();
        let lo = ifaces.iter().find(|i| i.name == "lo").expect("lo exists");
        assert!(lo.loopback);
        assert_eq!(lo.index, 1);
    }

    /// What `getifaddrs(3)` reports (the scan before rtnetlink), with the addresses of
    /// alias labels (`kp-n0:1`) under their device, as the scan files them.
    fn getifaddrs_view() -> BTreeMap<String, (u32, bool, bool, Vec<IpAddr>)> {
        use nix::net::if_::InterfaceFlags;
        let mut view: BTreeMap<String, (u32, bool, bool, Vec<IpAddr>)> = BTreeMap::new();
        for ifa in nix::ifaddrs::getifaddrs().unwrap() {
            let name = ifa.interface_name.split(':').next().unwrap().to_string();
            let index = nix::net::if_::if_nametoindex(name.as_str()).unwrap();
            let e = view.entry(name).or_insert((
                index,
                ifa.flags.contains(InterfaceFlags::IFF_UP),
                ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK),
                vec![],
            ));
            let addr = ifa.address.as_ref().and_then(|a| {
                a.as_sockaddr_in()
                    .map(|v4| IpAddr::V4(v4.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
            });
            e.3.extend(addr);
        }
        view
    }

    #[test]
    fn scan_agrees_with_getifaddrs() {
        use crate::kernel::rtnl::tests::{in_new_netns, ip};
        let Some((scanned, libc_view)) = in_new_netns(|| {
            ip(&["link", "set", "lo", "up"]);
            ip(&[
                "link", "add", "kp-n0", "type", "veth", "peer", "name", "kp-n1",
            ]);
            ip(&["link", "set", "kp-n0", "up"]);
            for a in [
                &["10.1.0.1/24", "dev", "kp-n0"][..],
                &["10.1.0.2/24", "dev", "kp-n0"],
                &["10.2.0.3/24", "dev", "kp-n0", "label", "kp-n0:1"],
                &["2001:db8::1/64", "dev", "kp-n0", "nodad"],
                &["10.3.0.1", "peer", "10.3.0.2", "dev", "kp-n1"],
            ] {
                ip(&[&["addr", "add"][..], a].concat());
            }
            (scan().unwrap(), getifaddrs_view())
        }) else {
            return;
        };
        let view: BTreeMap<String, (u32, bool, bool, Vec<IpAddr>)> = scanned
            .iter()
            .map(|i| (i.name.clone(), (i.index, i.up, i.loopback, i.addrs.clone())))
            .collect();
        assert_eq!(view, libc_view);
        let names: Vec<&str> = scanned.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["kp-n0", "kp-n1", "lo"], "by name");
        let n0 = &scanned[0];
        assert!(n0.up && !n0.loopback);
        let v4: Vec<String> = n0.addrs.iter().map(ToString::to_string).collect();
        assert_eq!(
            v4[..3],
            ["10.1.0.1", "10.2.0.3", "10.1.0.2"],
            "the kernel's order: primaries, then the secondary"
        );
        assert!(v4.contains(&"2001:db8::1".to_string()), "{v4:?}");
        let n1 = &scanned[1];
        assert!(!n1.up);
        assert_eq!(
            n1.addrs,
            ["10.3.0.1".parse::<IpAddr>().unwrap()],
            "the local end"
        );
        assert!(scanned[2].loopback);
    }

    /// An address added after the watcher started is reported through the announcements,
    /// long before the (hour-long) poll interval.
    #[test]
    fn the_watcher_follows_announcements() {
        use std::sync::mpsc;

        use crate::kernel::rtnl::tests::{in_new_netns, ip};
        in_new_netns(|| {
            ip(&[
                "link", "add", "kp-w0", "type", "veth", "peer", "name", "kp-w1",
            ]);
            ip(&["link", "set", "kp-w0", "up"]);
            let (tx, rx) = mpsc::channel();
            let _w = AddressWatcher::spawn(
                Some(vec!["kp-w0".into()]),
                Duration::from_secs(3600),
                move |a| {
                    let _ = tx.send(a.all());
                },
            );
            let liveness = Duration::from_secs(20);
            assert_eq!(
                rx.recv_timeout(liveness).unwrap(),
                Vec::<IpAddr>::new(),
                "the start"
            );
            ip(&["addr", "add", "192.0.2.7/24", "dev", "kp-w0"]);
            assert_eq!(
                rx.recv_timeout(liveness)
                    .expect("no callback after the address was added"),
                vec!["192.0.2.7".parse::<IpAddr>().unwrap()]
            );
            ip(&["addr", "del", "192.0.2.7/24", "dev", "kp-w0"]);
            assert_eq!(rx.recv_timeout(liveness).unwrap(), Vec::<IpAddr>::new());
        });
    }
}
