//! Node addresses per device: read from the kernel ([`scan`]) and watched for changes
//! ([`AddressWatcher`]), so an address added to a node device starts answering NodePorts and
//! becomes the SNAT source of its device without a restart.
//!
//! The watcher polls `getifaddrs(3)` (one netlink dump of links and addresses) every
//! `interval` and calls back only when the set changed. Polling, rather than an rtnetlink
//! subscription, keeps this dependency-free; a change is seen within one interval (default
//! 1 s). Everything runs in the network namespace of the thread that calls [`scan`] or
//! [`AddressWatcher::spawn`] (tests call them from inside the node's namespace).
//!
//! The callback is where the agent (1) updates `KP_NODE_ADDR4` / `KP_NODE_ADDR6` through
//! [`crate::dataplane::ebpf::node_path::TcPath::set_node_addresses`] / [`crate::dataplane::ebpf::node_path::TcPath::set_node_addresses6`] and (2) hands [`NodeAddresses::all`] to the eBPF
//! planner, which creates one NodePort frontend per node address.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use nix::ifaddrs::getifaddrs;
use nix::net::if_::{InterfaceFlags, if_nametoindex};

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
    pub fn node_addrs(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.addrs.iter().copied().filter(|a| is_node_addr(*a))
    }
}

/// Global-scope unicast: what NodePorts answer on and SNAT uses as source.
pub fn is_node_addr(addr: IpAddr) -> bool {
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

/// Default polling interval of [`AddressWatcher`].
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// Every device of the calling thread's network namespace with its addresses, by name.
pub fn scan() -> std::io::Result<Vec<Interface>> {
    let mut by_name: BTreeMap<String, Interface> = BTreeMap::new();
    for ifa in getifaddrs().map_err(std::io::Error::from)? {
        let iface = match by_name.get_mut(&ifa.interface_name) {
            Some(i) => i,
            None => {
                // A device that disappeared between the dump and this call is skipped.
                let Ok(index) = if_nametoindex(ifa.interface_name.as_str()) else {
                    continue;
                };
                by_name
                    .entry(ifa.interface_name.clone())
                    .or_insert(Interface {
                        name: ifa.interface_name.clone(),
                        index,
                        up: ifa.flags.contains(InterfaceFlags::IFF_UP),
                        loopback: ifa.flags.contains(InterfaceFlags::IFF_LOOPBACK),
                        addrs: Vec::new(),
                    })
            }
        };
        let addr = ifa.address.as_ref().and_then(|a| {
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        });
        if let Some(addr) = addr {
            iface.addrs.push(addr);
        }
    }
    Ok(by_name.into_values().collect())
}

/// The node addresses of a set of devices (see [`is_node_addr`]).
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
    /// [`is_node_addr`]).
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

/// Polls the node's addresses on a background thread and calls back on every change (and once
/// at start). Stops (and joins) on drop.
pub struct AddressWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl AddressWatcher {
    /// Starts watching `devices` (all non-loopback devices when `None`) in the calling thread's
    /// network namespace. Scan errors are logged and retried next interval.
    pub fn spawn<F>(devices: Option<Vec<String>>, interval: Duration, mut on_change: F) -> Self
    where
        F: FnMut(&NodeAddresses) + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_thread = Arc::clone(&stop);
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
                    // Sleep in small steps so drop does not wait a whole interval.
                    let mut slept = Duration::ZERO;
                    while slept < interval && !stop_thread.load(Ordering::Relaxed) {
                        let step = Duration::from_millis(50).min(interval - slept);
                        thread::sleep(step);
                        slept += step;
                    }
                }
            })
            .expect("spawning the node address watcher thread");
        AddressWatcher {
            stop,
            thread: Some(thread),
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
}
