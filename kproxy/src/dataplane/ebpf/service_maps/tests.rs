//! Unit tests of the planner and the applier (no kernel: the applier runs on in-memory tables).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use kproxy_common::service::*;

use crate::dataplane::ebpf::service_maps::MapSizes;
use crate::dataplane::ebpf::service_maps::ServiceMapsConfig;
use crate::dataplane::ebpf::service_maps::apply::Applier;
use crate::dataplane::ebpf::service_maps::apply::Tables;
use crate::dataplane::ebpf::service_maps::ids::IdAllocator;
use crate::dataplane::ebpf::service_maps::ids::SetKind;
use crate::dataplane::ebpf::service_maps::plan::MapsPlan;
use crate::dataplane::ebpf::service_maps::plan::decode_addr;
use crate::dataplane::ebpf::service_maps::plan::encode_addr;
use crate::dataplane::ebpf::service_maps::plan::plan;
use crate::dataplane::ebpf::service_maps::plan::render;
use crate::dataplane::ebpf::service_maps::tables::FilterStore;
use crate::dataplane::ebpf::service_maps::tables::MaglevStore;
use crate::dataplane::ebpf::service_maps::tables::MemFilter;
use crate::dataplane::ebpf::service_maps::tables::MemMaglev;
use crate::dataplane::ebpf::service_maps::tables::MemTable;
use crate::dataplane::ebpf::service_maps::tables::SharedMem;
use crate::model::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn name(n: &str) -> ServicePortName {
    testing::port_name("ns", n, "http", Protocol::Tcp)
}

fn svc(n: &str, cluster_ips: &[&str]) -> ServicePort {
    cluster_ips
        .iter()
        .fold(testing::service_port("ns", n, "http"), |b, ip| {
            b.cluster_ip(*ip)
        })
        .build()
}

fn ep(addr: &str, local: bool) -> Endpoint {
    testing::endpoint(addr, 8080)
        .local_on("n1", "n2", local)
        .build()
}

fn snap(items: Vec<(ServicePort, Vec<Endpoint>)>) -> Snapshot {
    testing::snapshot("n1")
        .node_addresses(["192.168.0.1", "fd00::1"])
        .services(items)
        .build()
}

fn key(addr: &str, port: u16, scope: u8) -> ServiceKey {
    ServiceKey {
        addr: encode_addr(ip(addr)),
        port: port.to_be(),
        proto: PROTO_TCP,
        scope,
    }
}

fn cfg() -> ServiceMapsConfig {
    ServiceMapsConfig::default()
}

/// Backend addresses of the set `value` points at.
fn backends_of(plan: &MapsPlan, n: &str, value: &ServiceValue) -> BTreeSet<IpAddr> {
    let sp = &plan.services[&name(n)];
    let set = sp.sets.iter().find(|s| s.svc_id == value.svc_id).unwrap();
    assert_eq!(set.backends.len() as u32, value.count);
    set.backends
        .iter()
        .map(|id| decode_addr(plan.backends[id].addr))
        .collect()
}

fn set(addrs: &[&str]) -> BTreeSet<IpAddr> {
    addrs.iter().map(|a| ip(a)).collect()
}

#[test]
fn addresses_round_trip_and_ipv4_is_v4_mapped() {
    for a in ["10.1.2.3", "fd00::7", "::1", "0.0.0.0"] {
        assert_eq!(decode_addr(encode_addr(ip(a))), ip(a));
    }
    assert!(is_v4_mapped(&encode_addr(ip("10.1.2.3"))));
    assert!(!is_v4_mapped(&encode_addr(ip("fd00::7"))));
    assert_eq!(
        encode_addr(ip("10.1.2.3")),
        v4_mapped(u32::from_ne_bytes([10, 1, 2, 3]))
    );
}

#[test]
fn dual_stack_cluster_ip_gets_one_frontend_and_set_per_family() {
    let s = snap(vec![(
        svc("web", &["10.96.0.1", "fd00:96::1"]),
        vec![
            ep("10.0.0.1", true),
            ep("10.0.0.2", false),
            ep("fd00:10::1", true),
        ],
    )]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let sp = &p.services[&name("web")];
    assert_eq!(sp.frontends.len(), 2);
    assert!(sp.errors.is_empty());
    let v4 = sp.frontends[&key("10.96.0.1", 80, SCOPE_CLUSTER)];
    let v6 = sp.frontends[&key("fd00:96::1", 80, SCOPE_CLUSTER)];
    assert_ne!(v4.svc_id, v6.svc_id);
    assert_eq!(v4.flags, SVC_F_CLUSTER_IP);
    assert_eq!(backends_of(&p, "web", &v4), set(&["10.0.0.1", "10.0.0.2"]));
    assert_eq!(backends_of(&p, "web", &v6), set(&["fd00:10::1"]));
    let b = p
        .backends
        .values()
        .find(|b| decode_addr(b.addr) == ip("10.0.0.1"))
        .unwrap();
    assert_eq!(u16::from_be(b.port), 8080);
    assert_eq!(b.flags, BE_F_LOCAL);
}

#[test]
fn a_family_without_endpoints_rejects_while_the_other_works() {
    let s = snap(vec![(
        svc("web", &["10.96.0.1", "fd00:96::1"]),
        vec![ep("10.0.0.1", true)],
    )]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let sp = &p.services[&name("web")];
    let v6 = sp.frontends[&key("fd00:96::1", 80, SCOPE_CLUSTER)];
    assert_eq!(v6.count, 0);
    assert_ne!(v6.flags & SVC_F_REJECT, 0);
    let v4 = sp.frontends[&key("10.96.0.1", 80, SCOPE_CLUSTER)];
    assert_eq!((v4.count, v4.flags & SVC_F_REJECT), (1, 0));
}

#[test]
fn node_port_with_etp_local_external_scope_uses_local_endpoints_cluster_scope_all() {
    let mut port = svc("np", &["10.96.0.2"]);
    port.service_type = ServiceType::NodePort;
    port.node_port = 30080;
    port.external_policy_local = true;
    let s = snap(vec![(
        port,
        vec![ep("10.0.0.1", true), ep("10.0.0.2", false)],
    )]);
    let mut c = cfg();
    c.node_addresses = vec![ip("192.168.0.1"), ip("192.168.1.1")];
    c.families = vec![IpFamily::V4];
    let p = plan(&s, &c, &mut IdAllocator::new());
    let sp = &p.services[&name("np")];
    // ClusterIP + 2 node addresses x 2 scopes.
    assert_eq!(
        sp.frontends.len(),
        5,
        "{:?}",
        sp.frontends.keys().collect::<Vec<_>>()
    );
    let cip = sp.frontends[&key("10.96.0.2", 80, SCOPE_CLUSTER)];
    assert_eq!(backends_of(&p, "np", &cip), set(&["10.0.0.1", "10.0.0.2"]));
    for node in ["192.168.0.1", "192.168.1.1"] {
        let ext = sp.frontends[&key(node, 30080, SCOPE_EXTERNAL)];
        assert_eq!(backends_of(&p, "np", &ext), set(&["10.0.0.1"]));
        assert_eq!(ext.flags, SVC_F_NODE_PORT | SVC_F_LOCAL_ONLY);
        let int = sp.frontends[&key(node, 30080, SCOPE_CLUSTER)];
        assert_eq!(
            int.svc_id, cip.svc_id,
            "node-local traffic short-circuits to the cluster set"
        );
        assert_eq!(int.flags, SVC_F_NODE_PORT);
    }
}

#[test]
fn etp_local_without_local_endpoints_drops_instead_of_rejecting() {
    let mut port = svc("np", &["10.96.0.2"]);
    port.node_port = 30080;
    port.external_policy_local = true;
    let s = snap(vec![(port, vec![ep("10.0.0.2", false)])]);
    let mut c = cfg();
    c.families = vec![IpFamily::V4];
    let p = plan(&s, &c, &mut IdAllocator::new());
    let ext = p.services[&name("np")].frontends[&key("192.168.0.1", 30080, SCOPE_EXTERNAL)];
    assert_eq!(ext.count, 0);
    assert_eq!(
        ext.flags & SVC_F_REJECT,
        0,
        "has endpoints elsewhere: drop, not reject"
    );
}

#[test]
fn node_addresses_default_to_the_node_objects() {
    let mut port = svc("np", &["10.96.0.2"]);
    port.node_port = 30080;
    let s = snap(vec![(
        port,
        vec![ep("10.0.0.2", false), ep("fd00:10::2", false)],
    )]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let sp = &p.services[&name("np")];
    assert!(
        sp.frontends
            .contains_key(&key("192.168.0.1", 30080, SCOPE_EXTERNAL))
    );
    let v6 = ServiceKey {
        addr: encode_addr(ip("fd00::1")),
        ..key("fd00::1", 30080, SCOPE_EXTERNAL)
    };
    assert!(sp.frontends.contains_key(&v6));
}

#[test]
fn itp_local_cluster_ip_uses_local_endpoints_and_drops_without_them() {
    let mut port = svc("itp", &["10.96.0.3"]);
    port.internal_policy_local = true;
    let s = snap(vec![(
        port.clone(),
        vec![ep("10.0.0.1", true), ep("10.0.0.2", false)],
    )]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let v = p.services[&name("itp")].frontends[&key("10.96.0.3", 80, SCOPE_CLUSTER)];
    assert_eq!(backends_of(&p, "itp", &v), set(&["10.0.0.1"]));
    assert_eq!(v.flags, SVC_F_CLUSTER_IP | SVC_F_LOCAL_ONLY);

    let s = snap(vec![(port, vec![ep("10.0.0.2", false)])]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let v = p.services[&name("itp")].frontends[&key("10.96.0.3", 80, SCOPE_CLUSTER)];
    assert_eq!((v.count, v.flags & SVC_F_REJECT), (0, 0));
}

#[test]
fn no_endpoints_at_all_rejects_everywhere() {
    let mut port = svc("none", &["10.96.0.4"]);
    port.node_port = 30001;
    port.external_ips = vec![ip("203.0.113.5")];
    let s = snap(vec![(port, vec![])]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let sp = &p.services[&name("none")];
    assert!(!sp.frontends.is_empty());
    for (k, v) in &sp.frontends {
        assert_eq!(v.count, 0);
        assert_ne!(v.flags & SVC_F_REJECT, 0, "{k:?}");
    }
}

#[test]
fn external_ips_and_lb_vips_with_source_ranges() {
    let mut port = svc("lb", &["10.96.0.5"]);
    port.service_type = ServiceType::LoadBalancer;
    port.node_port = 30002;
    port.external_ips = vec![ip("203.0.113.5")];
    port.load_balancer_ingress = vec![
        LoadBalancerIngress {
            ip: ip("198.51.100.7"),
            ip_mode: IpMode::Vip,
        },
        LoadBalancerIngress {
            ip: ip("198.51.100.8"),
            ip_mode: IpMode::Proxy,
        },
    ];
    port.load_balancer_source_ranges = vec!["192.0.2.0/24".parse().unwrap()];
    let s = snap(vec![(port, vec![ep("10.0.0.1", true)])]);
    let mut c = cfg();
    c.families = vec![IpFamily::V4];
    let p = plan(&s, &c, &mut IdAllocator::new());
    let sp = &p.services[&name("lb")];
    let ext_ip = sp.frontends[&key("203.0.113.5", 80, SCOPE_EXTERNAL)];
    assert_eq!(ext_ip.flags, SVC_F_EXTERNAL_IP);
    let lb = sp.frontends[&key("198.51.100.7", 80, SCOPE_EXTERNAL)];
    assert_eq!(lb.flags, SVC_F_LOAD_BALANCER | SVC_F_SOURCE_RANGES);
    let lb_in = sp.frontends[&key("198.51.100.7", 80, SCOPE_CLUSTER)];
    assert_eq!(lb_in.flags, SVC_F_LOAD_BALANCER);
    assert!(
        !sp.frontends
            .contains_key(&key("198.51.100.8", 80, SCOPE_EXTERNAL)),
        "ipMode Proxy is not captured"
    );
    let ranges: Vec<_> = sp.source_ranges.iter().copied().collect();
    assert_eq!(ranges.len(), 1);
    assert_eq!(ranges[0].0, SOURCE_RANGE_ID_BITS + 96 + 24);
    assert_eq!(ranges[0].1.svc_id, lb.svc_id);
    assert_eq!(decode_addr(ranges[0].1.addr), ip("192.0.2.0"));
}

#[test]
fn affinity_sets_flag_and_timeout() {
    let mut port = svc("aff", &["10.96.0.6"]);
    port.session_affinity_timeout = Some(30);
    let s = snap(vec![(port, vec![ep("10.0.0.1", true)])]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let v = p.services[&name("aff")].frontends[&key("10.96.0.6", 80, SCOPE_CLUSTER)];
    assert_ne!(v.flags & SVC_F_AFFINITY, 0);
    assert_eq!(v.affinity_timeout, 30);
}

#[test]
fn terminating_fallback_marks_backends_terminating() {
    let mut e = ep("10.0.0.1", true);
    e.ready = false;
    e.terminating = true;
    let s = snap(vec![(svc("term", &["10.96.0.7"]), vec![e])]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let v = p.services[&name("term")].frontends[&key("10.96.0.7", 80, SCOPE_CLUSTER)];
    assert_eq!(v.count, 1);
    let b = p.backends.values().next().unwrap();
    assert_eq!(b.flags, BE_F_LOCAL | BE_F_TERMINATING);
}

#[test]
fn a_frontend_claimed_twice_goes_to_the_first_service_and_the_second_is_told() {
    let mut a = svc("a", &["10.96.0.8"]);
    a.external_ips = vec![ip("203.0.113.9")];
    let mut b = svc("b", &["10.96.0.9"]);
    b.external_ips = vec![ip("203.0.113.9")];
    let s = snap(vec![
        (a, vec![ep("10.0.0.1", true)]),
        (b, vec![ep("10.0.0.2", true)]),
    ]);
    let p = plan(&s, &cfg(), &mut IdAllocator::new());
    let k = key("203.0.113.9", 80, SCOPE_EXTERNAL);
    assert!(p.services[&name("a")].frontends.contains_key(&k));
    assert!(!p.services[&name("b")].frontends.contains_key(&k));
    let errors = &p.services[&name("b")].errors;
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].contains("ns/a:http"), "{errors:?}");
    // b's ClusterIP is still programmed.
    assert!(
        p.services[&name("b")]
            .frontends
            .contains_key(&key("10.96.0.9", 80, SCOPE_CLUSTER))
    );
}

#[test]
fn ids_stay_stable_when_other_services_change() {
    let base = |extra: bool| {
        let mut items = vec![
            (
                svc("a", &["10.96.0.1"]),
                vec![ep("10.0.0.1", true), ep("10.0.0.2", true)],
            ),
            (svc("b", &["10.96.0.2"]), vec![ep("10.0.0.3", true)]),
        ];
        if extra {
            items.insert(0, (svc("0new", &["10.96.0.3"]), vec![ep("10.0.0.9", true)]));
            items[2].1.push(ep("10.0.0.4", true));
        }
        snap(items)
    };
    let mut ids = IdAllocator::new();
    let p1 = plan(&base(false), &cfg(), &mut ids);
    let p1_again = plan(&base(false), &cfg(), &mut ids);
    assert_eq!(
        p1, p1_again,
        "planning is deterministic with the same allocator"
    );
    let p2 = plan(&base(true), &cfg(), &mut ids);
    assert_eq!(p1.services[&name("a")], p2.services[&name("a")]);
    for id in p1.backends.keys() {
        assert_eq!(
            p2.backend_addr(*id),
            p1.backend_addr(*id),
            "backend {id} renumbered"
        );
    }
    assert_eq!(
        p1.services[&name("b")].sets[0].svc_id,
        p2.services[&name("b")].sets[0].svc_id
    );
    assert_eq!(p2.services[&name("b")].sets[0].kind, SetKind::Cluster);
}

#[test]
fn render_lists_frontends_sets_and_backends() {
    let mut port = svc("web", &["10.96.0.1"]);
    port.session_affinity_timeout = Some(10);
    let text = render(&snap(vec![(port, vec![ep("10.0.0.1", true)])]), &cfg());
    assert!(text.contains("service ns/web:http"), "{text}");
    assert!(
        text.contains("frontend 10.96.0.1:80/TCP (cluster) -> svc_id=1 count=1 flags=[clusterIP,affinity] affinity_timeout=10s"),
        "{text}"
    );
    assert!(text.contains("[0]=1(10.0.0.1:8080)"), "{text}");
    assert!(text.contains("backend 1 10.0.0.1:8080"), "{text}");
}

// ---- applier ----

/// Maglev table size of the in-memory applier tests.
const MAGLEV_M: u32 = 251;

struct Mem {
    services: SharedMem<ServiceKey, ServiceValue>,
    slots: SharedMem<BackendSlotKey, SlotValue>,
    backends: SharedMem<u32, BackendValue>,
    ranges: SharedMem<crate::dataplane::ebpf::service_maps::plan::SourceRangeEntry, u8>,
    affinity: SharedMem<AffinityKey, AffinityValue>,
    maglev_refs: SharedMem<u32, kproxy_common::maglev::MaglevRef>,
    maglev: Arc<Mutex<MemMaglev>>,
    filter: Arc<Mutex<MemFilter>>,
}

/// The in-memory services map and frontend filter, checking on every write the order the
/// node-device programs rely on (`crate::dataplane::ebpf::service_maps::filter`): a frontend is written only while the filter
/// says "maybe" for it, and a filter bit is set to "absent" only when no frontend in the map
/// hashes to it. Every applier test here runs with these checks.
struct FilteredFirst {
    services: SharedMem<ServiceKey, ServiceValue>,
    filter: Arc<Mutex<MemFilter>>,
}

fn filter_bit(k: &ServiceKey) -> (u32, u64) {
    kproxy_common::frontend_filter::filter_slot(&k.addr, k.port, k.proto, k.scope)
}

impl crate::dataplane::ebpf::service_maps::tables::Table<ServiceKey, ServiceValue>
    for FilteredFirst
{
    fn dump(
        &self,
    ) -> Result<
        Vec<(ServiceKey, ServiceValue)>,
        crate::dataplane::ebpf::service_maps::tables::TableError,
    > {
        self.services.dump()
    }
    fn put(
        &mut self,
        key: &ServiceKey,
        value: &ServiceValue,
    ) -> Result<(), crate::dataplane::ebpf::service_maps::tables::TableError> {
        let (w, m) = filter_bit(key);
        assert_eq!(
            self.filter.lock().unwrap().words[w as usize] & m,
            0,
            "frontend {key:?} written while the filter says it is absent"
        );
        self.services.put(key, value)
    }
    fn delete(
        &mut self,
        key: &ServiceKey,
    ) -> Result<(), crate::dataplane::ebpf::service_maps::tables::TableError> {
        self.services.delete(key)
    }
    fn capacity(&self) -> u32 {
        self.services.capacity()
    }
}

impl FilterStore for FilteredFirst {
    fn read(&self, i: u32) -> u64 {
        self.filter.read(i)
    }
    fn write(&mut self, i: u32, value: u64) {
        for k in self.services.lock().unwrap().entries.keys() {
            let (w, m) = filter_bit(k);
            assert!(
                w != i || value & m == 0,
                "filter word {i} marks frontend {k:?} absent while it is in the map"
            );
        }
        self.filter.write(i, value)
    }
}

fn shared<K: Ord, V>(name: &'static str, cap: u32) -> SharedMem<K, V> {
    Arc::new(Mutex::new(MemTable::new(name, cap)))
}

impl Mem {
    fn new(sizes: &MapSizes) -> Mem {
        Mem {
            services: shared(MAP_SERVICES, sizes.services),
            slots: shared(MAP_BACKEND_SLOTS, sizes.backend_slots),
            backends: shared(MAP_BACKENDS, sizes.backends),
            ranges: shared(MAP_SOURCE_RANGES, sizes.source_ranges),
            affinity: shared(MAP_AFFINITY, sizes.affinity),
            maglev_refs: shared(kproxy_common::maglev::MAP_MAGLEV_REF, sizes.maglev),
            maglev: Arc::new(Mutex::new(MemMaglev::new(MAGLEV_M, sizes.maglev))),
            filter: Arc::new(Mutex::new(MemFilter::default())),
        }
    }
    fn tables(&self) -> Tables {
        Tables {
            services: Box::new(FilteredFirst {
                services: self.services.clone(),
                filter: self.filter.clone(),
            }),
            slots: Box::new(self.slots.clone()),
            backends: Box::new(self.backends.clone()),
            source_ranges: Box::new(self.ranges.clone()),
            affinity: Box::new(self.affinity.clone()),
            maglev_refs: Box::new(self.maglev_refs.clone()),
            maglev: Box::new(self.maglev.clone()),
            filter: Box::new(FilteredFirst {
                services: self.services.clone(),
                filter: self.filter.clone(),
            }),
        }
    }
    fn services(&self) -> BTreeMap<ServiceKey, ServiceValue> {
        self.services.lock().unwrap().entries.clone()
    }
    /// Slot → backend id; checks that every slot's copy of its backend is the backends map's
    /// value (what the programs read from a slot is what the backends map says).
    fn slots(&self) -> BTreeMap<BackendSlotKey, u32> {
        let backends = self.backends();
        let slots = self.slots.lock().unwrap().entries.clone();
        slots
            .into_iter()
            .map(|(k, s)| {
                assert_eq!(
                    Some(&s.backend),
                    backends.get(&s.backend_id),
                    "slot {k:?} holds a stale copy of backend {}",
                    s.backend_id
                );
                (k, s.backend_id)
            })
            .collect()
    }
    fn backends(&self) -> BTreeMap<u32, BackendValue> {
        self.backends.lock().unwrap().entries.clone()
    }
    /// The frontend filter's bits that say "maybe a frontend here", as (word, bit).
    fn filter_maybe(&self) -> BTreeSet<(u32, u32)> {
        let f = self.filter.lock().unwrap();
        let mut out = BTreeSet::new();
        for (w, word) in f.words.iter().enumerate() {
            if *word == u64::MAX {
                continue;
            }
            for b in 0..64 {
                if word & (1u64 << b) == 0 {
                    out.insert((w as u32, b));
                }
            }
        }
        out
    }
    /// The bits of the frontends in the services map: what `filter_maybe` must equal.
    fn frontend_bits(&self) -> BTreeSet<(u32, u32)> {
        self.services()
            .keys()
            .map(|k| {
                let (w, m) =
                    kproxy_common::frontend_filter::filter_slot(&k.addr, k.port, k.proto, k.scope);
                (w, m.trailing_zeros())
            })
            .collect()
    }
}

/// What a plan says the maps must hold.
fn expected(
    p: &MapsPlan,
) -> (
    BTreeMap<ServiceKey, ServiceValue>,
    BTreeMap<BackendSlotKey, u32>,
) {
    let mut f = BTreeMap::new();
    let mut s = BTreeMap::new();
    for sp in p.services.values() {
        f.extend(sp.frontends.iter().map(|(k, v)| (*k, *v)));
        for set in &sp.sets {
            for (i, id) in set.backends.iter().enumerate() {
                s.insert(
                    BackendSlotKey {
                        svc_id: set.svc_id,
                        slot: i as u32,
                    },
                    *id,
                );
            }
        }
    }
    (f, s)
}

fn two_services(second_eps: usize) -> Snapshot {
    snap(vec![
        (svc("a", &["10.96.0.1"]), vec![ep("10.0.0.1", true)]),
        (
            svc("b", &["10.96.0.2"]),
            (0..second_eps)
                .map(|i| ep(&format!("10.0.1.{}", i + 1), true))
                .collect(),
        ),
    ])
}

#[test]
fn applier_writes_the_plan_and_nothing_when_unchanged() {
    let mem = Mem::new(&MapSizes::default());
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut ids = IdAllocator::new();
    let p = plan(&two_services(3), &cfg(), &mut ids);
    let out = applier.apply(&p, 0).unwrap();
    assert!(out.failed.is_empty());
    assert_eq!(out.services, 2);
    let (f, s) = expected(&p);
    assert_eq!(mem.services(), f);
    assert_eq!(mem.slots(), s);
    assert_eq!(mem.backends(), p.backends);

    let out = applier
        .apply(&plan(&two_services(3), &cfg(), &mut ids), 0)
        .unwrap();
    assert_eq!((out.writes, out.deletes), (0, 0));

    // Shrinking deletes the stale slots and backends.
    let p = plan(&two_services(1), &cfg(), &mut ids);
    let out = applier.apply(&p, 0).unwrap();
    assert_eq!(out.deletes, 4, "2 slots + 2 backends");
    let (f, s) = expected(&p);
    assert_eq!(
        (mem.services(), mem.slots(), mem.backends()),
        (f, s, p.backends.clone())
    );

    let pressure = applier.pressure();
    assert_eq!(pressure[0].map, MAP_SERVICES);
    assert_eq!(pressure[0].entries, 2);
    assert_eq!(pressure[0].capacity, DEFAULT_SERVICES_MAX);
}

#[test]
fn a_full_slot_map_fails_only_the_service_that_does_not_fit() {
    let sizes = MapSizes {
        backend_slots: 4,
        ..MapSizes::default()
    };
    let mem = Mem::new(&sizes);
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut ids = IdAllocator::new();
    // a: 1 slot, b: 2 slots: fits.
    let p1 = plan(&two_services(2), &cfg(), &mut ids);
    assert!(applier.apply(&p1, 0).unwrap().failed.is_empty());
    // b grows to 5 slots: does not fit; a is untouched, b keeps its old frontend.
    let p2 = plan(&two_services(5), &cfg(), &mut ids);
    let out = applier.apply(&p2, 0).unwrap();
    assert_eq!(out.failed.len(), 1);
    let reason = &out.failed[&name("b")];
    assert!(
        reason.contains(MAP_BACKEND_SLOTS) && reason.contains("full"),
        "{reason}"
    );
    let svcs = mem.services();
    assert_eq!(
        svcs[&key("10.96.0.1", 80, SCOPE_CLUSTER)],
        p1.services[&name("a")].frontends[&key("10.96.0.1", 80, SCOPE_CLUSTER)]
    );
    let b = svcs[&key("10.96.0.2", 80, SCOPE_CLUSTER)];
    assert_eq!(b.count, 2, "b still points at its old, complete set");
    for slot in 0..b.count {
        let id = mem.slots()[&BackendSlotKey {
            svc_id: b.svc_id,
            slot,
        }];
        assert!(
            mem.backends().contains_key(&id),
            "slot {slot} points at a missing backend"
        );
    }
    // Every slot any frontend can reach has a backend.
    for v in svcs.values() {
        for slot in 0..v.count {
            assert!(mem.slots().contains_key(&BackendSlotKey {
                svc_id: v.svc_id,
                slot
            }));
        }
    }
}

#[test]
fn a_full_services_map_fails_the_new_service_and_keeps_the_others() {
    let sizes = MapSizes {
        services: 1,
        ..MapSizes::default()
    };
    let mem = Mem::new(&sizes);
    let mut applier = Applier::new(mem.tables()).unwrap();
    let p = plan(&two_services(1), &cfg(), &mut IdAllocator::new());
    let out = applier.apply(&p, 0).unwrap();
    assert_eq!(out.services, 1);
    assert!(out.failed[&name("b")].contains("full"), "{:?}", out.failed);
    assert_eq!(mem.services().len(), 1);
    assert!(
        mem.services()
            .contains_key(&key("10.96.0.1", 80, SCOPE_CLUSTER))
    );
    // b's slots were taken back (nothing references them).
    let live: BTreeSet<u32> = mem.services().values().map(|v| v.svc_id).collect();
    assert!(
        mem.slots().keys().all(|k| live.contains(&k.svc_id)),
        "{:?}",
        mem.slots()
    );
    // b's frontends were counted before the write that failed, and uncounted after.
    assert_eq!(mem.filter_maybe(), mem.frontend_bits());
}

/// A service port whose second frontend does not fit takes its first back (rollback), and
/// the filter bits counted for both are given back with them.
#[test]
fn a_frontend_rolled_back_gives_back_its_filter_bit() {
    let sizes = MapSizes {
        services: 2,
        ..MapSizes::default()
    };
    let mem = Mem::new(&sizes);
    let mut applier = Applier::new(mem.tables()).unwrap();
    let snapshot = snap(vec![
        (svc("a", &["10.96.0.1"]), vec![ep("10.0.0.1", true)]),
        (
            // Dual-stack: two frontends, the IPv4 one (first in key order) fits.
            svc("b", &["10.96.0.2", "fd00:96::2"]),
            vec![ep("10.0.1.1", true)],
        ),
    ]);
    let p = plan(&snapshot, &cfg(), &mut IdAllocator::new());
    let out = applier.apply(&p, 0).unwrap();
    assert!(out.failed[&name("b")].contains("full"), "{:?}", out.failed);
    assert_eq!(
        mem.services().keys().copied().collect::<Vec<_>>(),
        vec![key("10.96.0.1", 80, SCOPE_CLUSTER)],
        "b's first frontend was written and taken back"
    );
    assert_eq!(
        mem.services.lock().unwrap().writes,
        2,
        "a's and b's first were written"
    );
    assert_eq!(mem.filter_maybe(), mem.frontend_bits());
    // Re-reading the maps (after a failed sync) rebuilds the same filter.
    applier.reload().unwrap();
    assert_eq!(mem.filter_maybe(), mem.frontend_bits());
}

#[test]
fn a_restarted_applier_reconciles_without_rewriting() {
    let mem = Mem::new(&MapSizes::default());
    let mut ids = IdAllocator::new();
    let p = plan(&two_services(3), &cfg(), &mut ids);
    Applier::new(mem.tables()).unwrap().apply(&p, 0).unwrap();
    // Plus a stale frontend left by a previous run.
    mem.services
        .lock()
        .unwrap()
        .entries
        .insert(key("10.96.9.9", 80, SCOPE_CLUSTER), ServiceValue::default());
    let writes_before = mem.services.lock().unwrap().writes + mem.slots.lock().unwrap().writes;

    // A new agent: fresh allocator seeded from the maps, like ServiceMaps::new does. It
    // rebuilds the filter from the pinned frontends, the stale one included.
    let mut applier = Applier::new(mem.tables()).unwrap();
    assert_eq!(mem.filter_maybe(), mem.frontend_bits());
    let mut ids = IdAllocator::new();
    let (svcs, bes) = applier.existing();
    for (k, v) in svcs {
        ids.hint_set(*k, v.svc_id);
    }
    for (id, b) in bes {
        ids.seed_backend((decode_addr(b.addr), u16::from_be(b.port)), *id);
    }
    let p2 = plan(&two_services(3), &cfg(), &mut ids);
    assert_eq!(p2, p, "ids survive the restart");
    let out = applier.apply(&p2, 0).unwrap();
    assert_eq!(out.writes, 0);
    assert_eq!(out.deletes, 1, "only the stale frontend goes");
    assert_eq!(
        mem.services.lock().unwrap().writes + mem.slots.lock().unwrap().writes,
        writes_before
    );
    assert_eq!(mem.filter_maybe(), mem.frontend_bits());
}

#[test]
fn affinity_entries_of_removed_backends_and_expired_ones_are_deleted() {
    let mem = Mem::new(&MapSizes::default());
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut ids = IdAllocator::new();
    let mut port = svc("b", &["10.96.0.2"]);
    port.session_affinity_timeout = Some(10);
    let eps = vec![ep("10.0.1.1", true), ep("10.0.1.2", true)];
    let p = plan(&snap(vec![(port.clone(), eps.clone())]), &cfg(), &mut ids);
    applier.apply(&p, 0).unwrap();
    let set = &p.services[&name("b")].sets[0];
    let sec = 1_000_000_000u64;
    let entry = |client: u64, backend: u32, last: u64| {
        (
            AffinityKey::netns(set.svc_id, client),
            AffinityValue {
                backend_id: backend,
                _pad: 0,
                last_used_ns: last,
            },
        )
    };
    {
        let mut aff = mem.affinity.lock().unwrap();
        for (k, v) in [
            entry(1, set.backends[0], 100 * sec),
            entry(2, set.backends[1], 100 * sec),
            entry(3, set.backends[0], 50 * sec),
        ] {
            aff.entries.insert(k, v);
        }
    }
    // Drop backend 1; at t=105 s client 3's entry (last used at 50 s) expired.
    let removed = set
        .backends
        .iter()
        .copied()
        .find(|id| decode_addr(p.backends[id].addr) == ip("10.0.1.2"))
        .unwrap();
    let p2 = plan(&snap(vec![(port, eps[..1].to_vec())]), &cfg(), &mut ids);
    let out = applier.apply(&p2, 105 * sec).unwrap();
    assert_eq!(out.affinity_deleted, 2);
    let left: Vec<AffinityValue> = mem
        .affinity
        .lock()
        .unwrap()
        .entries
        .values()
        .copied()
        .collect();
    assert_eq!(left.len(), 1);
    assert_ne!(left[0].backend_id, removed);
}

// ---- Maglev ----

fn maglev_cfg() -> ServiceMapsConfig {
    ServiceMapsConfig {
        families: vec![IpFamily::V4],
        lb_algorithm: crate::dataplane::ebpf::service_maps::LbAlgorithm::Maglev,
        maglev_table_size: MAGLEV_M,
        ..ServiceMapsConfig::default()
    }
}

/// NodePort services `lb-<i>` with `eps[i]` endpoints 10.<i>.0.<1..>, plus a ClusterIP-only
/// service `internal` with 2 endpoints.
fn nodeport_services(eps: &[usize]) -> Snapshot {
    let mut items = Vec::new();
    for (i, n) in eps.iter().enumerate() {
        let mut port = svc(&format!("lb-{i}"), &[&format!("10.96.1.{}", i + 1)]);
        port.service_type = ServiceType::NodePort;
        port.node_port = 30_000 + i as u16;
        items.push((
            port,
            (0..*n)
                .map(|j| ep(&format!("10.{}.0.{}", i + 1, j + 1), j % 2 == 0))
                .collect(),
        ));
    }
    items.push((
        svc("internal", &["10.96.2.1"]),
        vec![ep("10.9.0.1", true), ep("10.9.0.2", false)],
    ));
    snap(items)
}

/// The table the applier wrote for set `svc_id` (via its ref).
fn written_table(mem: &Mem, svc_id: u32) -> Vec<u32> {
    let r = mem.maglev_refs.lock().unwrap().entries[&svc_id];
    assert_eq!(r.size, MAGLEV_M);
    mem.maglev.lock().unwrap().read(r.base, r.size)
}

#[test]
fn maglev_flags_external_frontends_only() {
    let p = plan(
        &nodeport_services(&[3]),
        &maglev_cfg(),
        &mut IdAllocator::new(),
    );
    let sp = &p.services[&name("lb-0")];
    let ext = sp.frontends[&key("192.168.0.1", 30_000, SCOPE_EXTERNAL)];
    assert_eq!(ext.flags, SVC_F_NODE_PORT | SVC_F_MAGLEV);
    let inner = sp.frontends[&key("192.168.0.1", 30_000, SCOPE_CLUSTER)];
    assert_eq!(inner.flags & SVC_F_MAGLEV, 0, "socket LB keeps random");
    let cip = sp.frontends[&key("10.96.1.1", 80, SCOPE_CLUSTER)];
    assert_eq!(cip.flags & SVC_F_MAGLEV, 0);
    assert!(sp.sets.iter().all(|s| s.maglev == (s.svc_id == ext.svc_id)));
    let internal = &p.services[&name("internal")];
    assert!(internal.sets.iter().all(|s| !s.maglev));
    // Dual-stack: the IPv6 external frontend gets no table (the TC path is IPv4-only).
    let mut c = maglev_cfg();
    c.families = vec![IpFamily::V4, IpFamily::V6];
    let mut port = svc("ds", &["10.96.3.1", "fd00::3:1"]);
    port.service_type = ServiceType::NodePort;
    port.node_port = 30_100;
    let s = snap(vec![(
        port,
        vec![ep("10.3.0.1", false), ep("fd00::3:2", false)],
    )]);
    let p = plan(&s, &c, &mut IdAllocator::new());
    let sp = &p.services[&name("ds")];
    assert_ne!(
        sp.frontends[&key("192.168.0.1", 30_100, SCOPE_EXTERNAL)].flags & SVC_F_MAGLEV,
        0
    );
    assert_eq!(
        sp.frontends[&key("fd00::1", 30_100, SCOPE_EXTERNAL)].flags & SVC_F_MAGLEV,
        0
    );
    assert_eq!(sp.sets.iter().filter(|s| s.maglev).count(), 1);
    // Random mode: no flag anywhere.
    let p = plan(&nodeport_services(&[3]), &cfg(), &mut IdAllocator::new());
    assert!(
        p.services
            .values()
            .flat_map(|sp| sp.frontends.values())
            .all(|v| v.flags & SVC_F_MAGLEV == 0)
    );
    assert!(render(&nodeport_services(&[3]), &maglev_cfg()).contains("nodePort,maglev"));
}

#[test]
fn maglev_tables_are_written_before_frontends_and_hold_the_built_table() {
    let mem = Mem::new(&MapSizes {
        maglev: 4,
        ..MapSizes::default()
    });
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut ids = IdAllocator::new();
    let p = plan(&nodeport_services(&[3, 5]), &maglev_cfg(), &mut ids);
    let out = applier.apply(&p, 0).unwrap();
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    assert_eq!(out.maglev_rebuilt, 2);
    for i in 0..2 {
        let sp = &p.services[&name(&format!("lb-{i}"))];
        let set = sp.sets.iter().find(|s| s.maglev).unwrap();
        let want = crate::dataplane::ebpf::service_maps::maglev::build(
            &set.backends
                .iter()
                .map(|id| (p.backend_addr(*id).unwrap(), *id))
                .collect::<Vec<_>>(),
            MAGLEV_M,
        );
        assert_eq!(written_table(&mem, set.svc_id), want);
        let members: BTreeSet<u32> = set.backends.iter().copied().collect();
        assert!(want.iter().all(|id| members.contains(id)));
    }
    assert_eq!(mem.maglev_refs.lock().unwrap().entries.len(), 2);
    let pressure = applier.pressure();
    let mg = pressure
        .iter()
        .find(|p| p.map == kproxy_common::maglev::MAP_MAGLEV)
        .unwrap();
    assert_eq!(
        (mg.entries, mg.capacity),
        (2 * MAGLEV_M as usize, 4 * MAGLEV_M)
    );

    // Nothing changed: nothing rebuilt, nothing written.
    let out = applier
        .apply(
            &plan(&nodeport_services(&[3, 5]), &maglev_cfg(), &mut ids),
            0,
        )
        .unwrap();
    assert_eq!((out.maglev_rebuilt, out.writes, out.deletes), (0, 0, 0));
}

#[test]
fn only_the_service_whose_backends_changed_is_rebuilt_and_only_its_share_moves() {
    let mem = Mem::new(&MapSizes {
        maglev: 4,
        ..MapSizes::default()
    });
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut ids = IdAllocator::new();
    let p1 = plan(&nodeport_services(&[3, 5]), &maglev_cfg(), &mut ids);
    applier.apply(&p1, 0).unwrap();
    let set_of = |p: &MapsPlan, i: usize| {
        p.services[&name(&format!("lb-{i}"))]
            .sets
            .iter()
            .find(|s| s.maglev)
            .unwrap()
            .clone()
    };
    let before0 = written_table(&mem, set_of(&p1, 0).svc_id);
    let before1 = written_table(&mem, set_of(&p1, 1).svc_id);
    let writes_before = mem.maglev.lock().unwrap().writes;

    // lb-1 loses one of its 5 backends (the last: the planner drops it).
    let p2 = plan(&nodeport_services(&[3, 4]), &maglev_cfg(), &mut ids);
    let out = applier.apply(&p2, 0).unwrap();
    assert!(out.failed.is_empty());
    assert_eq!(out.maglev_rebuilt, 1, "only lb-1");
    assert_eq!(written_table(&mem, set_of(&p2, 0).svc_id), before0);
    let after1 = written_table(&mem, set_of(&p2, 1).svc_id);
    let removed: BTreeSet<u32> = set_of(&p1, 1)
        .backends
        .iter()
        .copied()
        .filter(|id| !set_of(&p2, 1).backends.contains(id))
        .collect();
    assert_eq!(removed.len(), 1);
    let changed = before1.iter().zip(&after1).filter(|(a, b)| a != b).count();
    let of_removed = before1.iter().filter(|id| removed.contains(id)).count();
    assert!(after1.iter().all(|id| !removed.contains(id)));
    assert!(
        changed >= of_removed && changed as f64 <= 1.5 * of_removed as f64,
        "{changed} entries changed, {of_removed} were the removed backend's"
    );
    assert_eq!(
        mem.maglev.lock().unwrap().writes - writes_before,
        changed,
        "only differing entries are written"
    );
}

#[test]
fn maglev_tables_are_freed_with_their_service_and_a_full_array_fails_only_the_new_one() {
    let mem = Mem::new(&MapSizes {
        maglev: 2,
        ..MapSizes::default()
    });
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut ids = IdAllocator::new();
    applier
        .apply(
            &plan(&nodeport_services(&[2, 2]), &maglev_cfg(), &mut ids),
            0,
        )
        .unwrap();
    // A third NodePort service: no table left.
    let p = plan(&nodeport_services(&[2, 2, 2]), &maglev_cfg(), &mut ids);
    let out = applier.apply(&p, 0).unwrap();
    assert_eq!(out.failed.len(), 1);
    let reason = &out.failed[&name("lb-2")];
    assert!(
        reason.contains("all 2 tables are in use") && reason.contains("--bpf-map-sizes maglev=N"),
        "{reason}"
    );
    assert!(
        !mem.services()
            .contains_key(&key("192.168.0.1", 30_002, SCOPE_EXTERNAL)),
        "no frontend without its table"
    );
    assert!(
        mem.services()
            .contains_key(&key("192.168.0.1", 30_001, SCOPE_EXTERNAL))
    );
    // lb-1 goes: its table is freed once its frontends are gone (end of that sync), and lb-2
    // gets it at the next sync (the runner retries failed syncs).
    let mut s = nodeport_services(&[2, 2, 2]);
    s.services.remove(&name("lb-1"));
    s.endpoints.remove(&name("lb-1"));
    let out = applier
        .apply(&plan(&s, &maglev_cfg(), &mut ids), 0)
        .unwrap();
    assert!(
        out.failed.keys().all(|n| *n == name("lb-2")),
        "{:?}",
        out.failed
    );
    assert_eq!(mem.maglev_refs.lock().unwrap().entries.len(), 1);
    let out = applier
        .apply(&plan(&s, &maglev_cfg(), &mut ids), 0)
        .unwrap();
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    assert_eq!(mem.maglev_refs.lock().unwrap().entries.len(), 2);
    assert!(
        mem.services()
            .contains_key(&key("192.168.0.1", 30_002, SCOPE_EXTERNAL))
    );
}

#[test]
fn a_restarted_applier_rebuilds_maglev_tables_without_writing_them() {
    let sizes = MapSizes {
        maglev: 4,
        ..MapSizes::default()
    };
    let mem = Mem::new(&sizes);
    let mut ids = IdAllocator::new();
    let p = plan(&nodeport_services(&[3, 4]), &maglev_cfg(), &mut ids);
    Applier::new(mem.tables()).unwrap().apply(&p, 0).unwrap();
    let writes = mem.maglev.lock().unwrap().writes;
    let refs = mem.maglev_refs.lock().unwrap().entries.clone();

    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut ids = IdAllocator::new();
    let (svcs, bes) = applier.existing();
    for (k, v) in svcs {
        ids.hint_set(*k, v.svc_id);
    }
    for (id, b) in bes {
        ids.seed_backend((decode_addr(b.addr), u16::from_be(b.port)), *id);
    }
    let out = applier
        .apply(
            &plan(&nodeport_services(&[3, 4]), &maglev_cfg(), &mut ids),
            0,
        )
        .unwrap();
    assert_eq!(out.maglev_rebuilt, 2, "rebuilt once after the restart");
    assert_eq!(out.writes, 0, "…into identical tables: nothing written");
    assert_eq!(mem.maglev.lock().unwrap().writes, writes);
    assert_eq!(mem.maglev_refs.lock().unwrap().entries, refs);
}

// ---- Incremental syncs ----

mod incremental {
    use proptest::prelude::*;

    use super::*;
    use crate::dataplane::ebpf::service_maps::plan::Planner;

    /// One service port of the property test's universe, as generated.
    #[derive(Debug, Clone)]
    struct Spec {
        udp: bool,
        dual: bool,
        node_port: bool,
        /// Index into a small pool of external IPs (shared, so frontends get contested).
        external_ip: Option<u8>,
        lb_ranges: bool,
        etp_local: bool,
        itp_local: bool,
        affinity: bool,
        /// (endpoint pool index, ready, terminating, local) — the pool is shared between
        /// services, so backends are shared too.
        endpoints: Vec<(u8, bool, bool, bool)>,
    }

    fn spec() -> impl Strategy<Value = Spec> {
        (
            any::<bool>(),
            prop::bool::weighted(0.3),
            any::<bool>(),
            prop::option::weighted(0.4, 0u8..3),
            any::<bool>(),
            prop::bool::weighted(0.3),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.3),
            prop::collection::vec(
                (
                    0u8..8,
                    prop::bool::weighted(0.8),
                    any::<bool>(),
                    any::<bool>(),
                ),
                0..5,
            ),
        )
            .prop_map(
                |(
                    udp,
                    dual,
                    node_port,
                    external_ip,
                    lb_ranges,
                    etp_local,
                    itp_local,
                    affinity,
                    endpoints,
                )| {
                    Spec {
                        udp,
                        dual,
                        node_port,
                        external_ip,
                        lb_ranges,
                        etp_local,
                        itp_local,
                        affinity,
                        endpoints,
                    }
                },
            )
    }

    fn port_name(i: usize, udp: bool) -> ServicePortName {
        testing::port_name(
            "ns",
            &format!("s{i}"),
            "http",
            if udp { Protocol::Udp } else { Protocol::Tcp },
        )
    }

    fn build(i: usize, s: &Spec) -> (ServicePort, Vec<Endpoint>) {
        let v4 = format!("10.96.0.{}", i + 1);
        let v6 = format!("fd00:96::{}", i + 1);
        let mut ips = vec![v4.as_str()];
        if s.dual {
            ips.push(v6.as_str());
        }
        let mut p = svc(&format!("s{i}"), &ips);
        p.name = port_name(i, s.udp);
        p.protocol = p.name.protocol;
        if s.node_port || s.external_ip.is_some() {
            p.service_type = if s.lb_ranges {
                ServiceType::LoadBalancer
            } else {
                ServiceType::NodePort
            };
            p.node_port = if s.node_port { 30_000 + i as u16 } else { 0 };
            p.external_policy_local = s.etp_local;
        }
        if let Some(x) = s.external_ip {
            let ip = ip(&format!("192.0.2.{}", x + 1));
            if s.lb_ranges {
                p.load_balancer_ingress = vec![LoadBalancerIngress {
                    ip,
                    ip_mode: IpMode::Vip,
                }];
                p.load_balancer_source_ranges = vec!["203.0.113.0/24".parse().unwrap()];
            } else {
                p.external_ips = vec![ip];
            }
        }
        p.internal_policy_local = s.itp_local;
        p.session_affinity_timeout = s.affinity.then_some(30);
        let eps = s
            .endpoints
            .iter()
            .map(|(n, ready, terminating, local)| {
                let addr = if n % 4 == 3 {
                    format!("fd00:10::{n}")
                } else {
                    format!("10.0.0.{n}")
                };
                Endpoint {
                    ready: *ready,
                    serving: *ready || *terminating,
                    terminating: *terminating,
                    ..ep(&addr, *local)
                }
            })
            .collect();
        (p, eps)
    }

    /// Map contents the applier left (the agent-written maps).
    type Maps = (
        BTreeMap<ServiceKey, ServiceValue>,
        BTreeMap<BackendSlotKey, u32>,
        BTreeMap<u32, BackendValue>,
        BTreeMap<crate::dataplane::ebpf::service_maps::plan::SourceRangeEntry, u8>,
    );

    fn maps(mem: &Mem) -> Maps {
        (
            mem.services(),
            mem.slots(),
            mem.backends(),
            mem.ranges.lock().unwrap().entries.clone(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Random sequences of service changes: after each incremental sync (only the changed
        /// service ports re-planned and applied), the plan equals a from-scratch plan of the
        /// same snapshot (same ids), and the maps hold exactly what a fresh applier writes for
        /// that plan into empty maps.
        #[test]
        fn incremental_syncs_equal_from_scratch(
            initial in prop::collection::vec(prop::option::of(spec()), 6),
            steps in prop::collection::vec(
                prop::collection::vec((0usize..6, prop::option::of(spec())), 1..3),
                1..8,
            ),
        ) {
            let cfg = cfg();
            let mem = Mem::new(&MapSizes::default());
            let mut applier = Applier::new(mem.tables()).unwrap();
            let mut planner = Planner::new(IdAllocator::new());
            let mut state = initial;
            let snapshot = |state: &[Option<Spec>]| {
                snap(
                    state
                        .iter()
                        .enumerate()
                        .filter_map(|(i, s)| s.as_ref().map(|s| build(i, s)))
                        .collect(),
                )
            };
            let mut prev = snapshot(&state);
            planner.full(&prev, &cfg);
            applier.apply(planner.plan(), 0).unwrap();
            for step in steps {
                for (i, s) in step {
                    state[i] = s;
                }
                let next = snapshot(&state);
                // The tracker's change set: every name whose service or endpoints differ.
                let dirty: BTreeSet<ServicePortName> = prev
                    .services
                    .keys()
                    .chain(next.services.keys())
                    .filter(|n| {
                        prev.services.get(*n) != next.services.get(*n)
                            || prev.endpoints.get(*n) != next.endpoints.get(*n)
                    })
                    .cloned()
                    .collect();
                prop_assert_eq!(&planner.changed_in(&next), &dirty);
                let changed = planner.update(&next, &cfg, &dirty);
                applier.apply_changes(planner.plan(), &changed, 0).unwrap();

                let mut ids = planner.ids().clone();
                let scratch = plan(&next, &cfg, &mut ids);
                prop_assert_eq!(planner.plan(), &scratch);
                let fresh = Mem::new(&MapSizes::default());
                Applier::new(fresh.tables()).unwrap().apply(&scratch, 0).unwrap();
                prop_assert_eq!(maps(&mem), maps(&fresh));
                // The filter lets through exactly the bits of the frontends in the map.
                prop_assert_eq!(mem.filter_maybe(), mem.frontend_bits());
                prev = next;
            }
        }
    }

    /// A frontend two service ports want goes to the first by name; when the owner stops
    /// wanting it, the other gets it at the next incremental sync although only the owner
    /// changed.
    #[test]
    fn a_contested_frontend_moves_to_the_next_claimant_incrementally() {
        let cfg = cfg();
        let mut a = svc("a", &["10.96.0.1"]);
        a.external_ips = vec![ip("192.0.2.1")];
        let mut b = svc("b", &["10.96.0.2"]);
        b.external_ips = vec![ip("192.0.2.1")];
        let eps = vec![ep("10.0.0.1", true)];
        let s1 = snap(vec![(a.clone(), eps.clone()), (b.clone(), eps.clone())]);
        let mut planner = Planner::new(IdAllocator::new());
        planner.full(&s1, &cfg);
        let front = key("192.0.2.1", 80, SCOPE_CLUSTER);
        assert!(
            planner.plan().services[&name("a")]
                .frontends
                .contains_key(&front)
        );
        assert!(
            planner.plan().services[&name("b")]
                .contested
                .contains_key(&front)
        );
        assert_eq!(planner.plan().services[&name("b")].errors.len(), 2);
        a.external_ips.clear();
        let s2 = snap(vec![(a, eps.clone()), (b, eps)]);
        let changed = planner.update(&s2, &cfg, &[name("a")].into());
        assert_eq!(changed, [name("a"), name("b")].into());
        assert!(
            planner.plan().services[&name("b")]
                .frontends
                .contains_key(&front)
        );
        assert!(planner.plan().services[&name("b")].errors.is_empty());
    }
}

/// Timing harness (not a test; run with `cargo test --release -p kproxy --lib sync_cost_at_10k
/// -- --ignored --nocapture`): the pure parts of one sync at 10k service ports × 5 endpoints,
/// in memory.
#[test]
#[ignore]
fn sync_cost_at_10k() {
    use std::time::Instant;
    let n = 10_000usize;
    let mk = |i: usize, shift: usize| {
        let p = svc(
            &format!("s{i:05}"),
            &[&format!("10.96.{}.{}", i / 250, i % 250 + 1)],
        );
        let eps: Vec<Endpoint> = (0..5)
            .map(|j| {
                ep(
                    &format!("10.{}.{}.{}", 1 + j, i / 250, (i + shift) % 250 + 1),
                    false,
                )
            })
            .collect();
        (p, eps)
    };
    let t = Instant::now();
    let s1 = snap((0..n).map(|i| mk(i, 0)).collect());
    println!("build snapshot: {:?}", t.elapsed());
    let t = Instant::now();
    let _c = s1.clone();
    println!(
        "clone snapshot (tracker's per-sync copy): {:?}",
        t.elapsed()
    );
    let mem = Mem::new(&MapSizes::default());
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut planner = crate::dataplane::ebpf::service_maps::plan::Planner::new(IdAllocator::new());
    let t = Instant::now();
    planner.full(&s1, &cfg());
    println!("full plan: {:?}", t.elapsed());
    let t = Instant::now();
    applier.apply(planner.plan(), 0).unwrap();
    println!("full apply (mem tables): {:?}", t.elapsed());
    let t = Instant::now();
    planner.full(&s1, &cfg());
    applier.apply(planner.plan(), 0).unwrap();
    println!("full re-plan + apply, nothing changed: {:?}", t.elapsed());
    let mut s2 = s1.clone();
    let (p, eps) = mk(5000, 1);
    s2.endpoints.insert(p.name.clone(), Arc::new(eps));
    let dirty: BTreeSet<ServicePortName> = [p.name.clone()].into();
    let t = Instant::now();
    let changed = planner.update(&s2, &cfg(), &dirty);
    let t1 = t.elapsed();
    let out = applier.apply_changes(planner.plan(), &changed, 0).unwrap();
    println!(
        "one change: plan {t1:?}, plan + apply {:?} ({} writes, {} deletes)",
        t.elapsed(),
        out.writes,
        out.deletes
    );
    let t = Instant::now();
    let d = planner.changed_in(&s1);
    println!("changed_in walk: {:?} ({} changed)", t.elapsed(), d.len());
}

/// An incremental apply that does not fit fails that service port only; it keeps its old,
/// complete set, is reported as failing (the datapath re-plans it at the next sync) and
/// succeeds once it fits again.
#[test]
fn an_incremental_apply_that_does_not_fit_keeps_the_old_set_and_is_retried() {
    let sizes = MapSizes {
        backend_slots: 4,
        ..MapSizes::default()
    };
    let mem = Mem::new(&sizes);
    let mut applier = Applier::new(mem.tables()).unwrap();
    let mut planner = crate::dataplane::ebpf::service_maps::plan::Planner::new(IdAllocator::new());
    planner.full(&two_services(2), &cfg());
    assert!(applier.apply(planner.plan(), 0).unwrap().failed.is_empty());
    let before = mem.services();
    let changed = planner.update(&two_services(5), &cfg(), &[name("b")].into());
    let out = applier.apply_changes(planner.plan(), &changed, 0).unwrap();
    assert!(out.failed[&name("b")].contains("full"), "{:?}", out.failed);
    assert_eq!(applier.failing(), &[name("b")].into());
    assert_eq!(
        mem.services(),
        before,
        "b still points at its old, complete set"
    );
    for v in mem.services().values() {
        for slot in 0..v.count {
            let id = mem.slots()[&BackendSlotKey {
                svc_id: v.svc_id,
                slot,
            }];
            assert!(mem.backends().contains_key(&id));
        }
    }
    let changed = planner.update(&two_services(3), &cfg(), applier.failing());
    let out = applier.apply_changes(planner.plan(), &changed, 0).unwrap();
    assert!(out.failed.is_empty(), "{:?}", out.failed);
    assert!(applier.failing().is_empty());
    let (fronts, slots) = expected(planner.plan());
    assert_eq!(mem.services(), fronts);
    assert_eq!(mem.slots(), slots);
    assert_eq!(mem.backends(), planner.plan().backends);
}
