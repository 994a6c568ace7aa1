//! `kproxy inspect` in the ebpf mode: per service port, the frontends' entries of the pinned
//! service map, the backends behind their slots, its session-affinity and connection-table
//! entries, and every pinned map's fill level (entries / capacity). Each map is dumped once
//! and joined to the services by service id.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::Path;

use anyhow::Context;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use kproxy_common::ct::{CtEntry, CtKey, MAP_CT};
use kproxy_common::ct6::{CtEntry6, CtKey6, MAP_CT6};
use kproxy_common::layout::LAYOUTS;
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, MAP_AFFINITY, MAP_BACKEND_SLOTS, MAP_SERVICES,
    ServiceKey, ServiceValue, SlotValue,
};

use crate::dataplane::inspect::{MapFill, Selected, ServiceReport, proto_num, sock};
use crate::model::ServicePort;

use super::service_maps::plan::decode_addr;

/// Opens the pinned hash map `name` (plain or LRU) with its capacity.
fn any_hash<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> anyhow::Result<(BpfHashMap<MapData, K, V>, u32)> {
    let data = MapData::from_pin(dir.join(name))
        .with_context(|| format!("opening pinned map {}", dir.join(name).display()))?;
    let info = data.info().ok();
    let cap = info.as_ref().map(|i| i.max_entries()).unwrap_or(0);
    let lru = info.and_then(|i| i.map_type().ok()) == Some(aya::maps::MapType::LruHash);
    let map = if lru {
        Map::LruHashMap(data)
    } else {
        Map::HashMap(data)
    };
    let m = BpfHashMap::try_from(map).with_context(|| format!("map {name} is not a hash map"))?;
    Ok((m, cap))
}

/// The fill of pinned map `name`: `dumped` entries when the view already dumped it (no second
/// walk), else a key walk.
fn pinned_count(dir: &Path, name: &str, dumped: Option<usize>) -> Option<MapFill> {
    let data = MapData::from_pin(dir.join(name)).ok()?;
    let info = data.info().ok()?;
    let capacity = info.max_entries();
    let entries = match (dumped, info.map_type()) {
        (Some(n), _) => n,
        (None, Ok(_)) => count_keys(&data).unwrap_or(0),
        (None, Err(_)) => 0,
    };
    Some(MapFill {
        map: name.to_string(),
        entries,
        capacity,
    })
}

/// Number of keys of any map (`BPF_MAP_GET_NEXT_KEY` walk).
fn count_keys(data: &MapData) -> Option<usize> {
    use std::os::fd::{AsFd, AsRawFd};
    let info = data.info().ok()?;
    let key_size = info.key_size() as usize;
    let fd = data.fd().as_fd().as_raw_fd();
    let mut key = vec![0u8; key_size];
    let mut next = vec![0u8; key_size];
    let mut n = 0usize;
    let mut first = true;
    loop {
        // SAFETY: bpf_attr for BPF_MAP_GET_NEXT_KEY: map_fd, key (null for the first), next_key;
        // both buffers are key_size bytes and outlive the call.
        let mut attr = [0u64; 4];
        attr[0] = fd as u64;
        attr[1] = if first { 0 } else { key.as_ptr() as u64 };
        attr[2] = next.as_mut_ptr() as u64;
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                4, /* BPF_MAP_GET_NEXT_KEY */
                attr.as_mut_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        if r != 0 {
            break;
        }
        n += 1;
        first = false;
        std::mem::swap(&mut key, &mut next);
        if n > 100_000_000 {
            break;
        }
    }
    Some(n)
}

/// The service-map entries by frontend: `(proto, addr, port)`, and `(proto, port)` for
/// NodePorts (any address), each a list of indexes into the dumped entries.
#[derive(Default)]
struct FrontendIndex {
    by_addr: HashMap<(u8, IpAddr, u16), Vec<usize>>,
    by_port: HashMap<(u8, u16), Vec<usize>>,
}

impl FrontendIndex {
    fn new(entries: &[(ServiceKey, ServiceValue)]) -> Self {
        let mut ix = FrontendIndex::default();
        for (i, (k, _)) in entries.iter().enumerate() {
            let (ip, port) = (decode_addr(k.addr), u16::from_be(k.port));
            ix.by_addr.entry((k.proto, ip, port)).or_default().push(i);
            ix.by_port.entry((k.proto, port)).or_default().push(i);
        }
        ix
    }

    /// Indexes of the entries [`matches_frontend`] accepts for `sp`, in dump order.
    fn of(&self, sp: &ServicePort) -> BTreeSet<usize> {
        let proto = proto_num(sp.protocol);
        let ips = sp
            .cluster_ips
            .iter()
            .chain(&sp.external_ips)
            .chain(sp.load_balancer_ingress.iter().map(|i| &i.ip));
        let mut out: BTreeSet<usize> = ips
            .filter_map(|ip| self.by_addr.get(&(proto, *ip, sp.port)))
            .flatten()
            .copied()
            .collect();
        if sp.node_port != 0
            && let Some(v) = self.by_port.get(&(proto, sp.node_port))
        {
            out.extend(v);
        }
        out
    }
}

/// Entries per service id of a dumped map.
fn count_by_id(ids: impl Iterator<Item = u32>) -> HashMap<u32, usize> {
    let mut m = HashMap::new();
    for id in ids {
        *m.entry(id).or_default() += 1;
    }
    m
}

pub(crate) fn view(
    bpffs: &Path,
    selected: &Selected,
    reports: &mut [ServiceReport],
    maps: &mut Vec<MapFill>,
) -> anyhow::Result<()> {
    let dir = bpffs.join("kproxy");
    let (services, _) = any_hash::<ServiceKey, ServiceValue>(&dir, MAP_SERVICES)?;
    let (slots, _) = any_hash::<BackendSlotKey, SlotValue>(&dir, MAP_BACKEND_SLOTS)?;
    // One dump per map, then joins by service id; the dumps' lengths are the maps' fill.
    let mut dumped: HashMap<&str, usize> = HashMap::new();
    let slots: HashMap<(u32, u32), SlotValue> = slots
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| ((k.svc_id, k.slot), v))
        .collect();
    dumped.insert(MAP_BACKEND_SLOTS, slots.len());
    let mut by_id = |name: &'static str, ids: Vec<u32>| {
        dumped.insert(name, ids.len());
        count_by_id(ids.into_iter())
    };
    let affinity = any_hash::<AffinityKey, AffinityValue>(&dir, MAP_AFFINITY)
        .map(|(m, _)| {
            let ids = m.keys().filter_map(Result::ok).map(|k| k.svc_id).collect();
            by_id(MAP_AFFINITY, ids)
        })
        .unwrap_or_default();
    // Flows of both families: the svc_id of every KP_CT and KP_CT6 entry.
    let mut ct = any_hash::<CtKey, CtEntry>(&dir, MAP_CT)
        .map(|(m, _)| {
            let ids = m
                .iter()
                .filter_map(Result::ok)
                .map(|(_, v)| v.svc_id)
                .collect();
            by_id(MAP_CT, ids)
        })
        .unwrap_or_default();
    if let Ok((m, _)) = any_hash::<CtKey6, CtEntry6>(&dir, MAP_CT6) {
        let ids = m
            .iter()
            .filter_map(Result::ok)
            .map(|(_, v)| v.svc_id)
            .collect();
        for (id, n) in by_id(MAP_CT6, ids) {
            *ct.entry(id).or_default() += n;
        }
    }
    let entries: Vec<(ServiceKey, ServiceValue)> = services.iter().filter_map(Result::ok).collect();
    dumped.insert(MAP_SERVICES, entries.len());
    let index = FrontendIndex::new(&entries);
    for ((_, sp), r) in selected.iter().zip(reports.iter_mut()) {
        let mut ids = BTreeSet::new();
        for i in index.of(sp) {
            let (k, v) = &entries[i];
            let (ip, port) = (decode_addr(k.addr), u16::from_be(k.port));
            r.kernel.push(format!(
                "frontend {} scope={} set={} slots={} flags={:#x}",
                sock(ip, port),
                k.scope,
                v.svc_id,
                v.count,
                v.flags
            ));
            if ids.insert(v.svc_id) {
                for slot in 0..v.count {
                    // The backend as the programs read it: the slot's copy.
                    if let Some(SlotValue { backend: b, .. }) = slots.get(&(v.svc_id, slot)) {
                        let a = sock(decode_addr(b.addr), u16::from_be(b.port));
                        if !r.kernel_backends.contains(&a) {
                            r.kernel_backends.push(a);
                        }
                    }
                }
            }
        }
        let sum = |m: &HashMap<u32, usize>| ids.iter().filter_map(|id| m.get(id)).sum();
        r.affinity_entries = Some(sum(&affinity));
        r.ct_entries = Some(sum(&ct));
    }
    for name in LAYOUTS.iter().filter(|l| l.is_keyed()).map(|l| l.name) {
        if let Some(f) = pinned_count(&dir, name, dumped.get(name).copied()) {
            maps.push(f);
        }
    }
    Ok(())
}
