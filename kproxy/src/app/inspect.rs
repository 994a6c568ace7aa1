//! `kproxy inspect`: per service port, its frontends, its endpoints with their state, and what
//! the kernel holds for it in the active mode:
//!
//! - ebpf: the frontends' entries of the pinned service map, the backends behind their slots,
//!   session-affinity and TC connection-table entries of the service, and every pinned map's
//!   fill level (entries / capacity);
//! - iptables: the nat-table rules of the service port's chains, found by name (the hashed
//!   `KUBE-SVC-`/`SVL-`/`EXT-`/`FW-` names computed from the port, as the proxier does), the
//!   rules jumping to them and the `KUBE-SEP-` chains they jump to — not by comment, since
//!   upstream's large-cluster mode (> 1000 endpoints) drops the comments;
//! - ipvs: the virtual servers on the service's addresses and their real servers;
//! - nftables: the port's map/set elements and chains in the `ip`/`ip6 kube-proxy` tables,
//!   read through netlink ([`super::inspect_nftables`]).
//!
//! Each kernel table is read once (one dump per pinned map, one `iptables-save`, one IPVS
//! listing) and joined to the services through hash indexes, so the cost is linear in the
//! number of services and entries. `--service ns/name` reports one service's ports.
//!
//! The services come from `--manifests`, or else from the API server like the agent's
//! (`--kubeconfig` / `--master`, else in-cluster): Services and EndpointSlices listed once,
//! with upstream's label selector, and the Node of `--hostname-override`, built into the same
//! snapshot the agent's tracker builds. The mode is `--proxy-mode`, else the one whose kernel
//! objects exist (pins, then `kube-ipvs0`, then the iptables `KUBE-SERVICES` chain, then a
//! `kube-proxy` nftables table).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::Path;

use anyhow::{Context, bail};
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use kproxy_common::ct::{CtEntry, CtKey, MAP_CT};
use kproxy_common::ct6::{CtEntry6, CtKey6, MAP_CT6};
use kproxy_common::layout::LAYOUTS;
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, MAP_AFFINITY, MAP_BACKEND_SLOTS, MAP_SERVICES,
    ServiceKey, ServiceValue, SlotValue,
};
use serde::Serialize;

use crate::cli::RenderOutput;
use crate::config::{ModeChoice, ProxyConfig, SourceConfig};
use crate::dataplane::ProxyMode;
use crate::dataplane::ebpf::service_maps::plan::decode_addr;
use crate::dataplane::iptables::names::service_chains;
use crate::model::{Protocol, ServicePort, ServicePortName, Snapshot};

/// The service ports a report covers, in snapshot order; `reports[i]` is `selected[i]`'s.
type Selected<'a> = [(&'a ServicePortName, &'a ServicePort)];

/// One endpoint and its state.
#[derive(Debug, Clone, Serialize)]
pub struct BackendState {
    pub address: String,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    pub local: bool,
}

/// One service port.
#[derive(Debug, Clone, Serialize)]
pub struct ServiceReport {
    pub name: String,
    pub protocol: String,
    pub frontends: Vec<String>,
    pub backends: Vec<BackendState>,
    /// What the kernel holds for it (mode-specific lines).
    pub kernel: Vec<String>,
    /// Backends the kernel balances to (`addr:port`).
    pub kernel_backends: Vec<String>,
    /// ebpf: session-affinity entries of this service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_entries: Option<usize>,
    /// ebpf: TC connection-table entries of this service.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ct_entries: Option<usize>,
}

/// One pinned map's fill level.
#[derive(Debug, Clone, Serialize)]
pub struct MapFill {
    pub map: String,
    pub entries: usize,
    pub capacity: u32,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub mode: ProxyMode,
    pub services: Vec<ServiceReport>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub maps: Vec<MapFill>,
}

fn proto_num(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

fn sock(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

fn frontends(sp: &ServicePort) -> Vec<String> {
    let mut v: Vec<String> = sp.cluster_ips.iter().map(|ip| sock(*ip, sp.port)).collect();
    v.extend(sp.external_ips.iter().map(|ip| sock(*ip, sp.port)));
    v.extend(sp.load_balancer_ingress.iter().map(|i| sock(i.ip, sp.port)));
    if sp.node_port != 0 {
        v.push(format!("<node>:{}", sp.node_port));
    }
    v
}

/// The frontend addresses of a service port (NodePort: any address with that port).
fn matches_frontend(sp: &ServicePort, ip: IpAddr, port: u16) -> bool {
    (port == sp.port
        && (sp.cluster_ips.contains(&ip)
            || sp.external_ips.contains(&ip)
            || sp.load_balancer_ingress.iter().any(|i| i.ip == ip)))
        || (sp.node_port != 0 && port == sp.node_port)
}

/// `iptables-save -t nat` of the backend that holds `KUBE-SERVICES` (IPv4 then IPv6).
fn iptables_nat() -> String {
    let mut out = String::new();
    for bin in [
        "iptables-nft-save",
        "iptables-legacy-save",
        "ip6tables-nft-save",
        "ip6tables-legacy-save",
    ] {
        if let Ok(o) = std::process::Command::new(bin).args(["-t", "nat"]).output() {
            let text = String::from_utf8_lossy(&o.stdout);
            if text.lines().any(|l| l.starts_with(":KUBE-SERVICES")) {
                out.push_str(&text);
            }
        }
    }
    out
}

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

fn ebpf_view(
    cfg: &ProxyConfig,
    selected: &Selected,
    reports: &mut [ServiceReport],
    maps: &mut Vec<MapFill>,
) -> anyhow::Result<()> {
    let dir = cfg.bpf.bpffs.join("kproxy");
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

/// `iptables-save -t nat` text indexed by chain and by jump target.
#[derive(Default)]
struct NatRules<'a> {
    /// `-A` lines per chain, in order.
    by_chain: HashMap<&'a str, Vec<&'a str>>,
    /// `-A` lines per chain they jump (`-j`/`-g`) to.
    by_target: HashMap<&'a str, Vec<&'a str>>,
}

impl<'a> NatRules<'a> {
    fn parse(text: &'a str) -> Self {
        let mut r = NatRules::default();
        for line in text.lines().filter(|l| l.starts_with("-A ")) {
            let mut words = line.split_whitespace().skip(1);
            let Some(chain) = words.next() else { continue };
            r.by_chain.entry(chain).or_default().push(line);
            if let Some(target) = jump_target(line) {
                r.by_target.entry(target).or_default().push(line);
            }
        }
        r
    }

    fn chain(&self, name: &str) -> &[&'a str] {
        self.by_chain.get(name).map_or(&[], Vec::as_slice)
    }

    /// The rules of a service port: those jumping to its chains, its chains' own, and those
    /// of the endpoint chains its chains jump to (each once, in that order); and the DNAT
    /// destinations of the endpoint chains.
    fn of(&self, name: &ServicePortName) -> (Vec<&'a str>, Vec<String>) {
        let c = service_chains(name);
        let own = [&c.firewall, &c.external, &c.cluster, &c.local];
        let mut seen = HashSet::new();
        let mut lines = vec![];
        let mut add = |l: &'a str, lines: &mut Vec<&'a str>| {
            if seen.insert(l) {
                lines.push(l);
            }
        };
        for chain in own {
            for l in self.by_target.get(chain.as_str()).into_iter().flatten() {
                add(l, &mut lines);
            }
        }
        let mut endpoints = vec![];
        for chain in own {
            for l in self.chain(chain) {
                add(l, &mut lines);
                if let Some(t) = jump_target(l).filter(|t| t.starts_with("KUBE-SEP-"))
                    && !endpoints.contains(&t)
                {
                    endpoints.push(t);
                }
            }
        }
        let mut backends = vec![];
        for sep in endpoints {
            for l in self.chain(sep) {
                add(l, &mut lines);
                if let Some(dst) = l.split("--to-destination ").nth(1) {
                    let dst = dst.split_whitespace().next().unwrap_or("").to_string();
                    if !backends.contains(&dst) {
                        backends.push(dst);
                    }
                }
            }
        }
        (lines, backends)
    }
}

/// The chain an `-A` rule jumps or goes to.
fn jump_target(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            return words.next();
        }
    }
    None
}

fn iptables_view(selected: &Selected, reports: &mut [ServiceReport]) {
    let nat = iptables_nat();
    let rules = NatRules::parse(&nat);
    for ((name, _), r) in selected.iter().zip(reports.iter_mut()) {
        let (lines, backends) = rules.of(name);
        r.kernel = lines.into_iter().map(String::from).collect();
        r.kernel_backends = backends;
    }
}

fn ipvs_view(selected: &Selected, reports: &mut [ServiceReport]) -> anyhow::Result<()> {
    use crate::dataplane::ipvs::genl::IpvsHandle;
    let mut h = IpvsHandle::open().context("opening IPVS generic netlink")?;
    let services = h.services().context("listing IPVS virtual servers")?;
    // Virtual servers by (protocol, port); each service looks at its ports' only.
    let mut by_port: HashMap<(Protocol, u16), Vec<usize>> = HashMap::new();
    for (i, vs) in services.iter().enumerate() {
        by_port
            .entry((vs.key.protocol, vs.key.port))
            .or_default()
            .push(i);
    }
    for ((_, sp), r) in selected.iter().zip(reports.iter_mut()) {
        let mut mine: BTreeSet<usize> = BTreeSet::new();
        for port in [sp.port, sp.node_port].into_iter().filter(|p| *p != 0) {
            mine.extend(by_port.get(&(sp.protocol, port)).into_iter().flatten());
        }
        for vs in mine.into_iter().map(|i| &services[i]).filter(|vs| {
            vs.key.protocol == sp.protocol && matches_frontend(sp, vs.key.addr, vs.key.port)
        }) {
            r.kernel.push(format!(
                "virtual server {} {} scheduler={}",
                vs.key.protocol.lower(),
                sock(vs.key.addr, vs.key.port),
                vs.scheduler
            ));
            for d in h.destinations(&vs.key).unwrap_or_default() {
                r.kernel.push(format!(
                    "  -> {} weight={} active={} inactive={}",
                    sock(d.addr, d.port),
                    d.weight,
                    d.active_conns,
                    d.inactive_conns
                ));
                let a = sock(d.addr, d.port);
                if !r.kernel_backends.contains(&a) {
                    r.kernel_backends.push(a);
                }
            }
        }
    }
    Ok(())
}

/// Builds the report (see the module docs); `service` (`namespace/name`) limits it to that
/// service's ports.
pub fn report(cfg: &ProxyConfig, service: Option<&str>) -> anyhow::Result<Report> {
    let (snap, _) = match &cfg.source {
        SourceConfig::Manifests(path) => {
            crate::app::agent::snapshot_from_manifests(path, &cfg.node_name)?
        }
        SourceConfig::Kube { kubeconfig, master } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the tokio runtime")?
            .block_on(crate::app::agent::snapshot_from_api(
                kubeconfig.as_deref(),
                master.as_deref(),
                &cfg.node_name,
            ))
            .context("reading the services from the API server")?,
    };
    let selected: Vec<(&ServicePortName, &ServicePort)> = snap
        .services
        .iter()
        .filter(|(name, _)| service.is_none_or(|s| name.service() == s))
        .map(|(name, sp)| (name, &**sp))
        .collect();
    if let Some(s) = service
        && selected.is_empty()
    {
        bail!("--service {s}: no such service is proxied (none of its ports is in the snapshot)");
    }
    let mode = match cfg.mode {
        ModeChoice::Forced(m) => m,
        ModeChoice::Detect => super::modes::Evidence::here(cfg)
            .programmed()
            .or_else(|| super::inspect_nftables::programmed().then_some(ProxyMode::Nftables))
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "no datapath of kproxy is programmed here (no pins, no kube-ipvs0 or its \
                     ipsets, no KUBE-SVC/KUBE-SEP chains, no kube-proxy nftables table)"
                )
            })?,
    };
    let mut out = Report {
        mode,
        services: selected
            .iter()
            .map(|(name, sp)| service_report(&snap, name, sp))
            .collect(),
        maps: vec![],
    };
    match mode {
        ProxyMode::Ebpf => ebpf_view(cfg, &selected, &mut out.services, &mut out.maps)?,
        ProxyMode::Iptables => iptables_view(&selected, &mut out.services),
        ProxyMode::Ipvs => ipvs_view(&selected, &mut out.services)?,
        ProxyMode::Nftables => {
            super::inspect_nftables::nftables_view(&snap, &selected, &mut out.services)?
        }
    }
    Ok(out)
}

/// A service port's report before the kernel view.
fn service_report(snap: &Snapshot, name: &ServicePortName, sp: &ServicePort) -> ServiceReport {
    ServiceReport {
        name: name.to_string(),
        protocol: sp.protocol.lower().to_string(),
        frontends: frontends(sp),
        backends: snap
            .endpoints_of(name)
            .iter()
            .map(|e| BackendState {
                address: sock(e.ip, e.port),
                ready: e.ready,
                serving: e.serving,
                terminating: e.terminating,
                local: e.is_local,
            })
            .collect(),
        kernel: vec![],
        kernel_backends: vec![],
        affinity_entries: None,
        ct_entries: None,
    }
}

/// The report as a table (one block per service port).
pub fn table(r: &Report) -> String {
    let mut s = format!("mode: {}\n", r.mode);
    for svc in &r.services {
        let _ = writeln!(s, "\n{} ({})", svc.name, svc.protocol);
        let _ = writeln!(s, "  frontends: {}", svc.frontends.join(", "));
        let _ = writeln!(s, "  backends:");
        for b in &svc.backends {
            let mut state: Vec<&str> = vec![];
            for (on, word) in [
                (b.ready, "ready"),
                (b.serving, "serving"),
                (b.terminating, "terminating"),
                (b.local, "local"),
            ] {
                if on {
                    state.push(word);
                }
            }
            let programmed = if svc.kernel_backends.contains(&b.address) {
                "programmed"
            } else {
                "not programmed"
            };
            let _ = writeln!(
                s,
                "    {:<24} {:<36} {programmed}",
                b.address,
                state.join(",")
            );
        }
        if let (Some(a), Some(c)) = (svc.affinity_entries, svc.ct_entries) {
            let _ = writeln!(s, "  affinity entries: {a}, TC CT entries: {c}");
        }
        let _ = writeln!(s, "  kernel ({}):", svc.kernel.len());
        for l in &svc.kernel {
            let _ = writeln!(s, "    {l}");
        }
    }
    if !r.maps.is_empty() {
        let _ = writeln!(s, "\nmaps:");
        let width = r.maps.iter().map(|m| m.map.len()).max().unwrap_or(0);
        for m in &r.maps {
            let pct = if m.capacity == 0 {
                0.0
            } else {
                100.0 * m.entries as f64 / f64::from(m.capacity)
            };
            let _ = writeln!(
                s,
                "  {:<width$} {:>8} / {:<8} ({pct:.1}%)",
                m.map, m.entries, m.capacity
            );
        }
    }
    s
}

/// `kproxy inspect` output (`service`: `--service namespace/name`).
pub fn run(
    cfg: &ProxyConfig,
    output: RenderOutput,
    service: Option<&str>,
) -> anyhow::Result<String> {
    let r = report(cfg, service)?;
    Ok(match output {
        RenderOutput::Json => serde_json::to_string_pretty(&r)? + "\n",
        _ => table(&r),
    })
}
