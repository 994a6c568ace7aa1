//! `kproxy inspect`: per service port, its frontends, its endpoints with their state, and what
//! the kernel holds for it in the active mode:
//!
//! - ebpf: the frontends' entries of the pinned service map, the backends behind their slots,
//!   session-affinity and TC connection-table entries of the service, and every pinned map's
//!   fill level (entries / capacity);
//! - iptables: the nat-table rules carrying the service port's comment (`ns/name:port`);
//! - ipvs: the virtual servers on the service's addresses and their real servers.
//!
//! The services come from `--manifests`, or else from the API server like the agent's
//! (`--kubeconfig` / `--master`, else in-cluster): Services and EndpointSlices listed once,
//! with upstream's label selector, and the Node of `--hostname-override`, built into the same
//! snapshot the agent's tracker builds. The mode is `--proxy-mode`, else the one whose kernel
//! objects exist (pins, then `kube-ipvs0`, then the iptables `KUBE-SERVICES` chain).

use std::fmt::Write as _;
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
use serde::Serialize;

use crate::cli::RenderOutput;
use crate::config::{ModeChoice, ProxyConfig, SourceConfig};
use crate::dataplane::ProxyMode;
use crate::dataplane::ebpf::service_maps::plan::decode_addr;
use crate::model::{Protocol, ServicePort, Snapshot};

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

fn open_hash<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> anyhow::Result<(BpfHashMap<MapData, K, V>, u32)> {
    let data = MapData::from_pin(dir.join(name))
        .with_context(|| format!("opening pinned map {}", dir.join(name).display()))?;
    let cap = data.info().map(|i| i.max_entries()).unwrap_or(0);
    let m = BpfHashMap::try_from(Map::HashMap(data))
        .with_context(|| format!("map {name} is not a hash map"))?;
    Ok((m, cap))
}

fn lru<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> anyhow::Result<(BpfHashMap<MapData, K, V>, u32)> {
    let data = MapData::from_pin(dir.join(name))
        .with_context(|| format!("opening pinned map {}", dir.join(name).display()))?;
    let cap = data.info().map(|i| i.max_entries()).unwrap_or(0);
    let m = BpfHashMap::try_from(Map::LruHashMap(data))
        .with_context(|| format!("map {name} is not an LRU hash map"))?;
    Ok((m, cap))
}

/// Opens a hash map whether it is plain or LRU.
fn any_hash<K: aya::Pod, V: aya::Pod>(
    dir: &Path,
    name: &str,
) -> anyhow::Result<(BpfHashMap<MapData, K, V>, u32)> {
    open_hash(dir, name).or_else(|_| lru(dir, name))
}

fn pinned_count(dir: &Path, name: &str) -> Option<MapFill> {
    let data = MapData::from_pin(dir.join(name)).ok()?;
    let info = data.info().ok()?;
    let capacity = info.max_entries();
    // Count keys with the raw syscall-free way aya offers: iterate as a byte-keyed map.
    let entries = match info.map_type() {
        Ok(_) => count_keys(&data).unwrap_or(0),
        Err(_) => 0,
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

fn ebpf_view(cfg: &ProxyConfig, snap: &Snapshot, out: &mut Report) -> anyhow::Result<()> {
    let dir = cfg.bpf.bpffs.join("kproxy");
    let (services, _) = open_hash::<ServiceKey, ServiceValue>(&dir, MAP_SERVICES)?;
    let (slots, _) = open_hash::<BackendSlotKey, SlotValue>(&dir, MAP_BACKEND_SLOTS)?;
    let affinity: Vec<AffinityKey> = any_hash::<AffinityKey, AffinityValue>(&dir, MAP_AFFINITY)
        .map(|(m, _)| m.keys().filter_map(Result::ok).collect())
        .unwrap_or_default();
    // Flows of both families: (svc_id) of every KP_CT and KP_CT6 entry.
    let mut ct: Vec<u32> = any_hash::<CtKey, CtEntry>(&dir, MAP_CT)
        .map(|(m, _)| {
            m.iter()
                .filter_map(Result::ok)
                .map(|(_, v)| v.svc_id)
                .collect()
        })
        .unwrap_or_default();
    ct.extend(
        any_hash::<CtKey6, CtEntry6>(&dir, MAP_CT6)
            .map(|(m, _)| {
                m.iter()
                    .filter_map(Result::ok)
                    .map(|(_, v)| v.svc_id)
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default(),
    );
    let entries: Vec<(ServiceKey, ServiceValue)> = services.iter().filter_map(Result::ok).collect();
    for (name, sp) in &snap.services {
        let r = out
            .services
            .iter_mut()
            .find(|r| r.name == name.to_string())
            .expect("every service port has a report");
        let mut ids = std::collections::BTreeSet::new();
        for (k, v) in &entries {
            let ip = decode_addr(k.addr);
            let port = u16::from_be(k.port);
            if k.proto != proto_num(sp.protocol) || !matches_frontend(sp, ip, port) {
                continue;
            }
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
                    if let Ok(SlotValue { backend: b, .. }) = slots.get(
                        &BackendSlotKey {
                            svc_id: v.svc_id,
                            slot,
                        },
                        0,
                    ) {
                        let a = sock(decode_addr(b.addr), u16::from_be(b.port));
                        if !r.kernel_backends.contains(&a) {
                            r.kernel_backends.push(a);
                        }
                    }
                }
            }
        }
        r.affinity_entries = Some(affinity.iter().filter(|k| ids.contains(&k.svc_id)).count());
        r.ct_entries = Some(ct.iter().filter(|id| ids.contains(id)).count());
    }
    for name in LAYOUTS.iter().filter(|l| l.is_keyed()).map(|l| l.name) {
        if let Some(f) = pinned_count(&dir, name) {
            out.maps.push(f);
        }
    }
    Ok(())
}

fn iptables_view(snap: &Snapshot, out: &mut Report) {
    let nat = iptables_nat();
    for name in snap.services.keys() {
        let r = out
            .services
            .iter_mut()
            .find(|r| r.name == name.to_string())
            .expect("every service port has a report");
        let comment = name.to_string();
        for line in nat.lines().filter(|l| l.starts_with("-A ")) {
            let tagged = line.contains(&format!("--comment \"{comment}\""))
                || line.contains(&format!("--comment {comment} "))
                || line.contains(&format!("--comment \"{comment} "));
            if !tagged {
                continue;
            }
            r.kernel.push(line.to_string());
            if let Some(dst) = line.split("--to-destination ").nth(1) {
                let dst = dst.split_whitespace().next().unwrap_or("").to_string();
                if !r.kernel_backends.contains(&dst) {
                    r.kernel_backends.push(dst);
                }
            }
        }
    }
}

fn ipvs_view(snap: &Snapshot, out: &mut Report) -> anyhow::Result<()> {
    use crate::dataplane::ipvs::genl::IpvsHandle;
    let mut h = IpvsHandle::open().context("opening IPVS generic netlink")?;
    let services = h.services().context("listing IPVS virtual servers")?;
    for (name, sp) in &snap.services {
        let r = out
            .services
            .iter_mut()
            .find(|r| r.name == name.to_string())
            .expect("every service port has a report");
        for vs in services.iter().filter(|vs| {
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

/// Builds the report (see the module docs).
pub fn report(cfg: &ProxyConfig) -> anyhow::Result<Report> {
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
    let mode = match cfg.mode {
        ModeChoice::Forced(m) => m,
        ModeChoice::Detect => super::modes::Evidence::here(cfg).programmed().ok_or_else(|| {
            anyhow::anyhow!(
                "no datapath of kproxy is programmed here (no pins, no kube-ipvs0 or its ipsets, \
                 no KUBE-SVC/KUBE-SEP chains)"
            )
        })?,
    };
    let mut out = Report {
        mode,
        services: vec![],
        maps: vec![],
    };
    for (name, sp) in &snap.services {
        out.services.push(ServiceReport {
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
        });
    }
    match mode {
        ProxyMode::Ebpf => ebpf_view(cfg, &snap, &mut out)?,
        ProxyMode::Iptables => iptables_view(&snap, &mut out),
        ProxyMode::Ipvs => ipvs_view(&snap, &mut out)?,
    }
    Ok(out)
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

/// `kproxy inspect` output.
pub fn run(cfg: &ProxyConfig, output: RenderOutput) -> anyhow::Result<String> {
    let r = report(cfg)?;
    Ok(match output {
        RenderOutput::Json => serde_json::to_string_pretty(&r)? + "\n",
        _ => table(&r),
    })
}
