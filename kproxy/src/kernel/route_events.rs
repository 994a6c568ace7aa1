//! Routing-state change notifications (rtnetlink multicast groups): [`RouteWatch`] calls back
//! after the kernel announces a change of links, addresses, routes, rules or neighbours
//! (IPv4), in the network namespace of the thread that started it. Used by the eBPF
//! datapath to invalidate the XDP fast path's cached forwarding results
//! (`dataplane::ebpf::node_path::xdp`).
//!
//! The callback runs on the watcher's own thread, at most once per batch of messages read
//! together (a burst of neighbour updates costs one call), and also when the socket overflowed
//! (`ENOBUFS`: messages were lost, so something may have changed). It is told whether the
//! batch held a route or policy-rule announcement ([`Batch::routes_or_rules`], from the
//! messages as `netlink-packet-route` parses them; lost messages and messages that do not
//! parse count as one): what the routing policy check
//! (`kernel::routing_policy`) reads can change only then, so neighbour and address updates
//! do not cost a dump of every route.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use rtnetlink::packet_core::DecodeError;
use rtnetlink::packet_route::RouteNetlinkMessage;

use crate::kernel::rtnl::{MulticastGroup, Received, Subscription};

/// Every group whose announcements may change what `bpf_fib_lookup` answers for IPv4.
pub(crate) const ROUTING_GROUPS: [MulticastGroup; 5] = [
    MulticastGroup::Link,
    MulticastGroup::Neigh,
    MulticastGroup::Ipv4Ifaddr,
    MulticastGroup::Ipv4Route,
    MulticastGroup::Ipv4Rule,
];

/// Datagrams read after the first one before calling back.
const DRAIN_MAX: usize = 256;

/// How long one receive blocks before the thread checks whether it should stop.
const POLL: Duration = Duration::from_millis(200);

/// A thread that calls back on routing-state changes; stopped (and joined) on drop.
pub(crate) struct RouteWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RouteWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteWatch").finish_non_exhaustive()
    }
}

/// What a batch of announcements held, as [`RouteWatch`]'s callback is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Batch {
    /// A route or policy-rule announcement (`RTM_{NEW,DEL}{ROUTE,RULE}`), or lost messages.
    pub routes_or_rules: bool,
}

/// Whether the messages of one datagram (as [`crate::kernel::rtnl::parse_datagram`] gives
/// them) hold a route or rule announcement; one that did not parse may have been one.
pub(crate) fn announces_routes_or_rules(msgs: &[Result<RouteNetlinkMessage, DecodeError>]) -> bool {
    msgs.iter().any(|m| {
        matches!(
            m,
            Ok(RouteNetlinkMessage::NewRoute(_)
                | RouteNetlinkMessage::DelRoute(_)
                | RouteNetlinkMessage::NewRule(_)
                | RouteNetlinkMessage::DelRule(_))
                | Err(_)
        )
    })
}

/// What one receive saw: a batch to report (announcements, or lost ones), or nothing.
fn receive(sub: &mut Subscription, wait: bool) -> io::Result<Option<Batch>> {
    Ok(match sub.recv(wait)? {
        Received::Messages(msgs) => Some(Batch {
            routes_or_rules: announces_routes_or_rules(&msgs),
        }),
        Received::Lost => Some(Batch {
            routes_or_rules: true,
        }),
        Received::Nothing => None,
    })
}

impl RouteWatch {
    /// Joins the rtnetlink groups of [`ROUTING_GROUPS`] in the calling thread's network
    /// namespace (before returning, so no change made after this call is missed) and calls
    /// `on_change` from a thread of its own after each batch of announcements, with what the
    /// batch held.
    pub(crate) fn spawn(
        mut on_change: impl FnMut(Batch) + Send + 'static,
    ) -> io::Result<RouteWatch> {
        let mut sub = Subscription::open(&ROUTING_GROUPS, POLL)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kp-route-watch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    match receive(&mut sub, true) {
                        Ok(None) => continue,
                        Ok(Some(mut batch)) => {
                            // Drain what is queued (a bounded number: a steady stream
                            // still calls back), then call back once.
                            for _ in 0..DRAIN_MAX {
                                match receive(&mut sub, false) {
                                    Ok(Some(more)) => {
                                        batch.routes_or_rules |= more.routes_or_rules;
                                    }
                                    _ => break,
                                }
                            }
                            on_change(batch);
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "routing change notifications failed");
                            on_change(Batch {
                                routes_or_rules: true,
                            });
                            std::thread::sleep(POLL);
                        }
                    }
                }
            })?;
        Ok(RouteWatch {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for RouteWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Instant;

    use rtnetlink::packet_core::NetlinkMessage;
    use rtnetlink::packet_route::address::AddressMessage;
    use rtnetlink::packet_route::link::LinkMessage;
    use rtnetlink::packet_route::neighbour::NeighbourMessage;
    use rtnetlink::packet_route::route::RouteMessage;
    use rtnetlink::packet_route::rule::RuleMessage;

    use super::*;
    use crate::kernel::rtnl::parse_datagram;
    use crate::kernel::rtnl::tests::{in_new_netns, ip};

    /// One datagram holding `msgs` as the kernel announces them.
    fn datagram(msgs: Vec<RouteNetlinkMessage>) -> Vec<u8> {
        let mut d = Vec::new();
        for m in msgs {
            let mut m = NetlinkMessage::from(m);
            m.finalize();
            let mut b = vec![0; m.buffer_len()];
            m.serialize(&mut b);
            d.extend(b);
        }
        d
    }

    fn classify(msgs: Vec<RouteNetlinkMessage>) -> bool {
        announces_routes_or_rules(&parse_datagram(&datagram(msgs)))
    }

    #[test]
    fn route_and_rule_messages_are_told_apart_from_the_others() {
        use RouteNetlinkMessage::*;
        let route = RouteMessage::default;
        let rule = RuleMessage::default;
        for m in [
            NewRoute(route()),
            DelRoute(route()),
            NewRule(rule()),
            DelRule(rule()),
        ] {
            assert!(classify(vec![m.clone()]), "{m:?}");
        }
        let others = || {
            vec![
                NewNeighbour(NeighbourMessage::default()),
                NewAddress(AddressMessage::default()),
                NewLink(LinkMessage::default()),
            ]
        };
        assert!(!classify(others()));
        // Several messages in one datagram: any route counts.
        let mut with_route = others();
        with_route.push(DelRoute(route()));
        assert!(classify(with_route));
        // A datagram that does not parse may have held one.
        let mut bad = datagram(others());
        bad[..4].copy_from_slice(&3u32.to_ne_bytes());
        assert!(announces_routes_or_rules(&parse_datagram(&bad)));
    }

    const LIVENESS: Duration = Duration::from_secs(20);

    /// The next batch the watch reports, within [`LIVENESS`].
    fn next(rx: &mpsc::Receiver<Batch>) -> Batch {
        rx.recv_timeout(LIVENESS)
            .expect("no announcement within the liveness bound")
    }

    #[test]
    fn the_watch_reports_neighbour_and_route_changes_of_its_namespace() {
        in_new_netns(|| {
            ip(&[
                "link", "add", "kp-d0", "type", "veth", "peer", "name", "kp-d1",
            ]);
            ip(&["link", "set", "kp-d0", "up"]);
            ip(&["addr", "add", "10.9.0.1/24", "dev", "kp-d0"]);
            // Let the announcements of the set-up pass before watching.
            std::thread::sleep(Duration::from_millis(100));
            let (tx, rx) = mpsc::channel();
            let _watch = RouteWatch::spawn(move |b| {
                let _ = tx.send(b);
            })
            .unwrap();
            ip(&[
                "neigh",
                "add",
                "10.9.0.5",
                "lladdr",
                "02:00:00:00:00:05",
                "dev",
                "kp-d0",
            ]);
            assert_eq!(
                next(&rx),
                Batch {
                    routes_or_rules: false
                },
                "a neighbour"
            );
            let start = Instant::now();
            ip(&["route", "add", "10.8.0.0/16", "via", "10.9.0.2"]);
            while !next(&rx).routes_or_rules {
                assert!(start.elapsed() < LIVENESS, "no route announcement");
            }
            ip(&["rule", "add", "from", "10.1.0.0/16", "table", "100"]);
            while !next(&rx).routes_or_rules {
                assert!(start.elapsed() < LIVENESS, "no rule announcement");
            }
        });
    }
}
