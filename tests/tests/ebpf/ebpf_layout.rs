//! Map layout migration on this kernel (`kproxy::dataplane::ebpf::layout`): pins left by a
//! "previous build" — maps of another shape created with bpftool or rewritten layout records —
//! then the real `ServiceMaps` started over them. It carries over what the layout table
//! allows (connection-table entries whose value only grew), replaces what it cannot reuse
//! (another key size, a layout from a newer kproxy), records this build's layouts, re-attaches
//! socket LB so no program of the old layout keeps running, and traffic through socket LB works
//! afterwards.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::layout::Action;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::model::{ChangedSet, IpFamily, testing};
use kproxy_common::ct::{CtEntry, CtKey, MAP_CT};
use kproxy_common::layout::{LAYOUT_NAME_LEN, LAYOUTS, LayoutRecord, MAP_LAYOUT, layout_key};
use kproxy_common::service::{MAP_AFFINITY, MAP_SERVICES};
use kproxy_tests::netns::{Bpffs, TestCgroup, require_root, run_checked};
use kproxy_tests::topology::{POD_PORT, Probe, Topology, TopologySpec};

const VIP: &str = "10.96.9.9";
const PORT: u16 = 80;
/// What the previous build's connection-table value was: this build's minus its last field
/// (`last_seen_ns`), i.e. a build before that field was appended.
const OLD_CT_VALUE: usize = size_of::<CtEntry>() - 8;

/// What the code under test logged on this thread (INFO and above, plain text).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

impl Logs {
    /// Captures this thread's logs until the guard is dropped.
    fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        (logs.clone(), tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// Asserts that one logged line holds every piece of `parts`.
    fn assert_line(&self, parts: &[&str]) {
        let text = self.text();
        assert!(
            text.lines().any(|l| parts.iter().all(|p| l.contains(p))),
            "no log line with {parts:?} in:\n{text}"
        );
    }
}

struct Rig {
    topo: Topology,
    cgroup: TestCgroup,
    bpffs: Bpffs,
}

impl Rig {
    fn new(test: &str) -> Rig {
        let mut topo = TopologySpec::new(test)
            .local_pods(2)
            .ipv6(false)
            .build()
            .unwrap();
        topo.pod_mut("pod-l1").serve(&[]).unwrap();
        Rig {
            topo,
            cgroup: TestCgroup::new(&format!("{test}-cg")).unwrap(),
            bpffs: Bpffs::new(&format!("{test}-fs")).unwrap(),
        }
    }

    fn dir(&self) -> std::path::PathBuf {
        self.bpffs.path().join("kproxy")
    }

    fn start(&self) -> ServiceMaps {
        ServiceMaps::new(ServiceMapsConfig {
            bpffs: self.bpffs.path().to_path_buf(),
            cgroup: Some(self.cgroup.path().to_path_buf()),
            families: vec![IpFamily::V4],
            map_sizes: MapSizes {
                services: 256,
                backend_slots: 256,
                backends: 256,
                affinity: 256,
                source_ranges: 16,
                sock_rev_nat: 256,
                ..MapSizes::default()
            },
            ..ServiceMapsConfig::default()
        })
        .unwrap()
    }

    /// Programs the service and checks that a pod in the cgroup reaches it.
    fn check_traffic(&self, dp: &mut ServiceMaps) {
        let svc = testing::service_port("default", "web", "p")
            .cluster_ip(VIP)
            .port(PORT)
            .affinity(Some(60))
            .build();
        let ep = testing::endpoint(self.topo.pod("pod-l1").ip, POD_PORT)
            .local_on("node", "node2", true)
            .build();
        let snap = testing::snapshot("node").service(svc, vec![ep]).build();
        let report = dp.sync(&snap, &ChangedSet::default()).unwrap();
        assert_eq!(report.failed_services, 0);
        let r = Probe::tcp(format!("{VIP}:{PORT}"), 10)
            .timeout(Duration::from_secs(5))
            .run(&self.topo.pod("pod-l0").ns, Some(&self.cgroup))
            .unwrap();
        assert_eq!(r.answers.get("pod-l1").copied(), Some(10), "{r:?}");
    }

    fn records(&self) -> Vec<([u8; LAYOUT_NAME_LEN], LayoutRecord)> {
        let data = MapData::from_pin(self.dir().join(MAP_LAYOUT)).unwrap();
        let map: BpfHashMap<MapData, [u8; LAYOUT_NAME_LEN], LayoutRecord> =
            BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
        map.iter().map(Result::unwrap).collect()
    }

    fn set_record(&self, name: &str, f: impl FnOnce(&mut LayoutRecord)) {
        let data = MapData::from_pin(self.dir().join(MAP_LAYOUT)).unwrap();
        let mut map: BpfHashMap<MapData, [u8; LAYOUT_NAME_LEN], LayoutRecord> =
            BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
        let mut r = map.get(&layout_key(name), 0).unwrap();
        f(&mut r);
        map.insert(layout_key(name), r, 0).unwrap();
    }
}

/// `bpftool map create` at `<dir>/<name>` (what an older build's loader would have pinned).
fn create_pinned(dir: &Path, name: &str, kind: &str, key: usize, value: usize) {
    run_checked(std::process::Command::new("bpftool").args([
        "map",
        "create",
        dir.join(name).to_str().unwrap(),
        "type",
        kind,
        "key",
        &key.to_string(),
        "value",
        &value.to_string(),
        "entries",
        "1024",
        "name",
        name,
    ]))
    .unwrap();
}

fn action(dp: &ServiceMaps, name: &str) -> Action {
    dp.layout_report()
        .maps
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, a)| a.clone())
        .unwrap_or_else(|| panic!("{name} not in {:?}", dp.layout_report()))
}

fn every_record_is_this_builds(rig: &Rig) {
    let records = rig.records();
    for l in &LAYOUTS {
        let (_, r) = records
            .iter()
            .find(|(k, _)| *k == layout_key(l.name))
            .unwrap_or_else(|| panic!("no record for {}", l.name));
        assert_eq!(
            (r.version, r.map_type, r.key_size, r.value_size),
            (l.version, l.map_type, l.key_size, l.value_size),
            "{}",
            l.name
        );
    }
}

#[test]
fn connection_entries_of_a_previous_layout_are_carried_over() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("layout-carry");
    // The previous build ran: maps, records and socket-LB links are pinned.
    let dp = rig.start();
    let old_links = dp.link_ids().to_vec();
    drop(dp);
    // ... with a shorter connection-table value, holding three flows.
    std::fs::remove_file(rig.dir().join(MAP_CT)).unwrap();
    create_pinned(
        &rig.dir(),
        MAP_CT,
        "lru_hash",
        size_of::<CtKey>(),
        OLD_CT_VALUE,
    );
    rig.set_record(MAP_CT, |r| r.value_size = OLD_CT_VALUE as u32);
    let flows: Vec<(CtKey, [u8; OLD_CT_VALUE])> = (1..=3u8)
        .map(|i| {
            let key = CtKey {
                saddr: u32::from_ne_bytes([192, 0, 2, i]),
                daddr: u32::from_ne_bytes([10, 96, 9, 9]),
                sport: u16::from(i) * 1000,
                dport: PORT.to_be(),
                proto: 6,
                kind: 1,
                _pad: [0; 2],
            };
            let mut value = [0u8; OLD_CT_VALUE];
            for (j, b) in value.iter_mut().enumerate() {
                *b = i.wrapping_mul(31).wrapping_add(j as u8) | 1;
            }
            (key, value)
        })
        .collect();
    {
        let data = MapData::from_pin(rig.dir().join(MAP_CT)).unwrap();
        let mut old: BpfHashMap<MapData, CtKey, [u8; OLD_CT_VALUE]> =
            BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
        for (k, v) in &flows {
            old.insert(k, v, 0).unwrap();
        }
    }

    // This build starts over them.
    let (logs, guard) = Logs::capture();
    let mut dp = rig.start();
    drop(guard);
    logs.assert_line(&["carried the pinned map's entries over", MAP_CT, "entries=3"]);
    logs.assert_line(&["detached a program of the previous map layout"]);
    assert_eq!(action(&dp, MAP_CT), Action::Migrate);
    assert_eq!(dp.layout_report().carried.get(MAP_CT), Some(&3));
    assert_eq!(action(&dp, MAP_SERVICES), Action::Reuse);
    let data = MapData::from_pin(rig.dir().join(MAP_CT)).unwrap();
    assert_eq!(
        data.info().unwrap().value_size() as usize,
        size_of::<CtEntry>()
    );
    let ct: BpfHashMap<MapData, CtKey, [u8; size_of::<CtEntry>()]> =
        BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    let got: Vec<(CtKey, [u8; size_of::<CtEntry>()])> = ct.iter().map(Result::unwrap).collect();
    assert_eq!(got.len(), flows.len());
    for (k, v) in &flows {
        let (_, new) = got
            .iter()
            .find(|(gk, _)| gk == k)
            .expect("flow carried over");
        assert_eq!(&new[..OLD_CT_VALUE], v, "old fields kept");
        assert!(
            new[OLD_CT_VALUE..].iter().all(|b| *b == 0),
            "new field zeroed"
        );
    }
    // The old programs were detached: socket LB runs this build's programs on new links.
    let new_links = dp.link_ids().to_vec();
    assert_eq!(new_links.len(), old_links.len());
    assert!(
        new_links.iter().all(|l| !old_links.contains(l)),
        "old links kept: {old_links:?} / {new_links:?}"
    );
    every_record_is_this_builds(&rig);
    rig.check_traffic(&mut dp);

    // A restart of the same build reuses everything.
    drop(dp);
    let mut dp = rig.start();
    assert!(!dp.layout_report().changed(), "{:?}", dp.layout_report());
    assert_eq!(dp.link_ids(), new_links.as_slice());
    dp.cleanup().unwrap();
}

#[test]
fn incompatible_pins_are_replaced_and_never_reused() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("layout-replace");
    let mut dp = rig.start();
    rig.check_traffic(&mut dp);
    let affinity = MapData::from_pin(rig.dir().join(MAP_AFFINITY)).unwrap();
    let affinity: BpfHashMap<MapData, [u8; 24], [u8; 16]> =
        BpfHashMap::try_from(Map::from_map_data(affinity).unwrap()).unwrap();
    assert!(
        affinity.keys().count() > 0,
        "the connects recorded affinity"
    );
    let old_links = dp.link_ids().to_vec();
    drop(dp);
    // The previous build had a 4-byte service key ...
    std::fs::remove_file(rig.dir().join(MAP_SERVICES)).unwrap();
    create_pinned(&rig.dir(), MAP_SERVICES, "hash", 4, 16);
    rig.set_record(MAP_SERVICES, |r| r.key_size = 4);
    // ... and wrote affinity entries in a layout newer than this build knows (a downgrade).
    rig.set_record(MAP_AFFINITY, |r| r.version += 5);

    let (logs, guard) = Logs::capture();
    let mut dp = rig.start();
    drop(guard);
    logs.assert_line(&["WARN", "replacing the pinned map", MAP_SERVICES, "key 4 B"]);
    logs.assert_line(&[
        "WARN",
        "replacing the pinned map",
        MAP_AFFINITY,
        "newer kproxy",
    ]);
    logs.assert_line(&["detached a program of the previous map layout"]);
    let report = dp.layout_report().clone();
    match action(&dp, MAP_SERVICES) {
        Action::Replace(reason) => assert!(reason.contains("key 4 B"), "{reason}"),
        a => panic!("{a:?}"),
    }
    match action(&dp, MAP_AFFINITY) {
        Action::Replace(reason) => assert!(reason.contains("newer kproxy"), "{reason}"),
        a => panic!("{a:?}"),
    }
    assert_eq!(action(&dp, MAP_CT), Action::Reuse, "{report:?}");
    let services = MapData::from_pin(rig.dir().join(MAP_SERVICES)).unwrap();
    assert_eq!(services.info().unwrap().key_size(), 20);
    let affinity = MapData::from_pin(rig.dir().join(MAP_AFFINITY)).unwrap();
    let affinity: BpfHashMap<MapData, [u8; 24], [u8; 16]> =
        BpfHashMap::try_from(Map::from_map_data(affinity).unwrap()).unwrap();
    assert_eq!(
        affinity.keys().count(),
        0,
        "the newer layout's entries were kept"
    );
    let new_links = dp.link_ids().to_vec();
    assert!(
        new_links.iter().all(|l| !old_links.contains(l)),
        "old links kept: {old_links:?} / {new_links:?}"
    );
    every_record_is_this_builds(&rig);
    rig.check_traffic(&mut dp);
    dp.cleanup().unwrap();
}
