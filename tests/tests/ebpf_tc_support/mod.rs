//! Shared by the `ebpf_tc*` tests: loading the object with a private bpffs, writing the
//! service maps the way the eBPF applier does (`kproxy_common::service` encoding), crafting
//! IPv4 frames and checking their checksums.
#![allow(dead_code)]

pub mod frames6;
pub mod rig;

use std::net::{IpAddr, Ipv4Addr};

use aya::Ebpf;
use aya::maps::HashMap as BpfHashMap;
use aya::maps::lpm_trie::{Key, LpmTrie};
use kproxy::dataplane::ebpf::node_path::CtEntry;
use kproxy::dataplane::ebpf::node_path::CtKey;
use kproxy::dataplane::ebpf::node_path::MAP_CT;
use kproxy::dataplane::ebpf::node_path::TcConfig;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::tc::encode6;
use kproxy::dataplane::ebpf::node_path::tc::load_object;
use kproxy_common::service::{
    BackendSlotKey, BackendValue, MAP_BACKEND_SLOTS, MAP_BACKENDS, MAP_SERVICES, MAP_SOURCE_RANGES,
    SCOPE_CLUSTER, SCOPE_EXTERNAL, SOURCE_RANGE_ALLOW, SOURCE_RANGE_ID_BITS, ServiceKey,
    ServiceValue, SlotValue, SourceRangeKey, v4_mapped,
};
use kproxy_tests::netns::Bpffs;

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;

/// The object loaded with its maps pinned under `<bpffs>/kproxy`, TC programs loaded.
pub fn load(bpffs: &Bpffs, config: TcConfig) -> (Ebpf, TcPath) {
    let dir = bpffs.path().join("kproxy");
    std::fs::create_dir_all(&dir).unwrap();
    let mut ebpf = load_object(&dir, &config).expect("loading the BPF object");
    let tc = TcPath::load(&mut ebpf, config).expect("loading the TC programs");
    (ebpf, tc)
}

pub fn ip4(a: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(a.octets())
}

/// A service-map address as the applier encodes it: IPv4 v4-mapped, IPv6 as is.
pub fn map_addr(addr: impl Into<IpAddr>) -> [u32; 4] {
    match addr.into() {
        IpAddr::V4(a) => v4_mapped(ip4(a)),
        IpAddr::V6(a) => encode6(a),
    }
}

/// Writes the frontend `addr:port` (either family).
pub fn frontend(
    ebpf: &mut Ebpf,
    addr: impl Into<IpAddr>,
    port: u16,
    proto: u8,
    scope: u8,
    v: ServiceValue,
) {
    let mut m: BpfHashMap<_, ServiceKey, ServiceValue> =
        BpfHashMap::try_from(ebpf.map_mut(MAP_SERVICES).unwrap()).unwrap();
    let key = ServiceKey {
        addr: map_addr(addr),
        port: port.to_be(),
        proto,
        scope,
    };
    m.insert(key, v, 0).unwrap();
}

pub fn remove_frontend(ebpf: &mut Ebpf, addr: Ipv4Addr, port: u16, proto: u8, scope: u8) {
    let mut m: BpfHashMap<_, ServiceKey, ServiceValue> =
        BpfHashMap::try_from(ebpf.map_mut(MAP_SERVICES).unwrap()).unwrap();
    let key = ServiceKey {
        addr: v4_mapped(ip4(addr)),
        port: port.to_be(),
        proto,
        scope,
    };
    let _ = m.remove(&key);
}

/// Writes backend `id` at `addr:port` (either family).
pub fn backend(ebpf: &mut Ebpf, id: u32, addr: impl Into<IpAddr>, port: u16, flags: u8) {
    let mut m: BpfHashMap<_, u32, BackendValue> =
        BpfHashMap::try_from(ebpf.map_mut(MAP_BACKENDS).unwrap()).unwrap();
    let v = BackendValue {
        addr: map_addr(addr),
        port: port.to_be(),
        flags,
        _pad: 0,
    };
    m.insert(id, v, 0).unwrap();
}

/// Slots `0..` of set `svc_id` holding the backends `ids` (written with [`backend`] first:
/// each slot gets a copy of its backend's value, as the agent writes them).
pub fn slots(ebpf: &mut Ebpf, svc_id: u32, ids: &[u32]) {
    let values: Vec<SlotValue> = {
        let b: BpfHashMap<_, u32, BackendValue> =
            BpfHashMap::try_from(ebpf.map(MAP_BACKENDS).unwrap()).unwrap();
        ids.iter()
            .map(|id| SlotValue {
                backend_id: *id,
                backend: b.get(id, 0).expect("slot of a backend not written"),
            })
            .collect()
    };
    let mut m: BpfHashMap<_, BackendSlotKey, SlotValue> =
        BpfHashMap::try_from(ebpf.map_mut(MAP_BACKEND_SLOTS).unwrap()).unwrap();
    for (slot, v) in values.iter().enumerate() {
        m.insert(
            BackendSlotKey {
                svc_id,
                slot: slot as u32,
            },
            v,
            0,
        )
        .unwrap();
    }
}

pub fn allow_range(ebpf: &mut Ebpf, svc_id: u32, net: Ipv4Addr, len: u32) {
    let mut m: LpmTrie<_, SourceRangeKey, u8> =
        LpmTrie::try_from(ebpf.map_mut(MAP_SOURCE_RANGES).unwrap()).unwrap();
    let key = Key::new(
        SOURCE_RANGE_ID_BITS + 96 + len,
        SourceRangeKey {
            svc_id,
            addr: v4_mapped(ip4(net)),
        },
    );
    m.insert(&key, SOURCE_RANGE_ALLOW, 0).unwrap();
}

pub fn ct_entries(ebpf: &Ebpf) -> Vec<(CtKey, CtEntry)> {
    let m: BpfHashMap<_, CtKey, CtEntry> = BpfHashMap::try_from(ebpf.map(MAP_CT).unwrap()).unwrap();
    m.iter().map(Result::unwrap).collect()
}

// ---- frames ---------------------------------------------------------------------------------

pub const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 0xaa];
pub const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 0xbb];

fn sum16(data: &[u8]) -> u32 {
    let mut s = 0u32;
    for chunk in data.chunks(2) {
        let w = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            u16::from_be_bytes([chunk[0], 0])
        };
        s += u32::from(w);
    }
    s
}

fn fold(mut s: u32) -> u16 {
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

/// Internet checksum of `data` (to put into a zeroed checksum field).
pub fn csum(data: &[u8]) -> u16 {
    fold(sum16(data))
}

fn pseudo(src: [u8; 4], dst: [u8; 4], proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src);
    p.extend_from_slice(&dst);
    p.extend_from_slice(&[0, proto]);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

/// An IPv4 header (20 bytes) with a valid checksum.
pub fn ipv4_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, payload_len: usize) -> Vec<u8> {
    let mut h = vec![0x45, 0];
    h.extend_from_slice(&((20 + payload_len) as u16).to_be_bytes());
    h.extend_from_slice(&[0x12, 0x34, 0x40, 0x00, 64, proto, 0, 0]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    let c = csum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

fn eth(ip_packet: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&MAC_B);
    f.extend_from_slice(&MAC_A);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(ip_packet);
    f
}

/// A TCP segment's bytes (header with `options`, then `payload`), checksum valid.
pub fn tcp_segment(
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    seq: u32,
    ack: u32,
    flags: u8,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    assert_eq!(options.len() % 4, 0);
    let mut t = Vec::new();
    t.extend_from_slice(&src.1.to_be_bytes());
    t.extend_from_slice(&dst.1.to_be_bytes());
    t.extend_from_slice(&seq.to_be_bytes());
    t.extend_from_slice(&ack.to_be_bytes());
    t.push((((20 + options.len()) / 4) as u8) << 4);
    t.push(flags);
    t.extend_from_slice(&64240u16.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 0]);
    t.extend_from_slice(options);
    t.extend_from_slice(payload);
    let mut all = pseudo(src.0.octets(), dst.0.octets(), TCP, t.len());
    all.extend_from_slice(&t);
    let c = csum(&all);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    t
}

pub fn tcp_frame(
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    seq: u32,
    ack: u32,
    flags: u8,
    options: &[u8],
    payload: &[u8],
) -> Vec<u8> {
    let seg = tcp_segment(src, dst, seq, ack, flags, options, payload);
    let mut ip = ipv4_header(src.0, dst.0, TCP, seg.len());
    ip.extend_from_slice(&seg);
    eth(&ip)
}

pub fn udp_datagram(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), payload: &[u8]) -> Vec<u8> {
    let mut u = Vec::new();
    u.extend_from_slice(&src.1.to_be_bytes());
    u.extend_from_slice(&dst.1.to_be_bytes());
    u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    let mut all = pseudo(src.0.octets(), dst.0.octets(), UDP, u.len());
    all.extend_from_slice(&u);
    let c = csum(&all);
    u[6..8].copy_from_slice(&(if c == 0 { 0xffff } else { c }).to_be_bytes());
    u
}

pub fn udp_frame(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), payload: &[u8]) -> Vec<u8> {
    let u = udp_datagram(src, dst, payload);
    let mut ip = ipv4_header(src.0, dst.0, UDP, u.len());
    ip.extend_from_slice(&u);
    eth(&ip)
}

/// An ICMP error (`ty`/`code`) from `src` to `dst` quoting `quoted` (an IP packet; its first
/// 28 bytes are quoted).
pub fn icmp_error_frame(src: Ipv4Addr, dst: Ipv4Addr, ty: u8, code: u8, quoted: &[u8]) -> Vec<u8> {
    let mut i = vec![ty, code, 0, 0, 0, 0, 0x05, 0xdc];
    i.extend_from_slice(&quoted[..28.min(quoted.len())]);
    let c = csum(&i);
    i[2..4].copy_from_slice(&c.to_be_bytes());
    let mut ip = ipv4_header(src, dst, ICMP, i.len());
    ip.extend_from_slice(&i);
    eth(&ip)
}

/// A parsed IPv4 frame, with every checksum verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    /// The IP payload (L4 header and data).
    pub l4: Vec<u8>,
}

/// Parses an Ethernet + IPv4 frame and asserts the IP and L4 (TCP/UDP/ICMP) checksums hold.
pub fn parse_checked(frame: &[u8]) -> Parsed {
    assert!(frame.len() >= 34, "frame too short: {}", frame.len());
    assert_eq!(&frame[12..14], &[0x08, 0x00], "not IPv4");
    let ip = &frame[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let tot = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    assert!(
        tot <= ip.len(),
        "IP total length {tot} > {} bytes present",
        ip.len()
    );
    assert_eq!(
        csum(&ip[..ihl]),
        0,
        "IPv4 header checksum is wrong: {:02x?}",
        &ip[..ihl]
    );
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let proto = ip[9];
    let l4 = ip[ihl..tot].to_vec();
    match proto {
        TCP | UDP => {
            let mut all = pseudo(src.octets(), dst.octets(), proto, l4.len());
            all.extend_from_slice(&l4);
            assert_eq!(csum(&all), 0, "{proto} checksum is wrong");
        }
        ICMP => assert_eq!(csum(&l4), 0, "ICMP checksum is wrong"),
        _ => {}
    }
    let (sport, dport) = l4_ports(proto, &l4);
    Parsed {
        src,
        dst,
        proto,
        sport,
        dport,
        l4,
    }
}

/// The (source, destination) ports of a TCP or UDP header `l4` (of either family); (0, 0) for
/// any other protocol.
pub fn l4_ports(proto: u8, l4: &[u8]) -> (u16, u16) {
    if proto == TCP || proto == UDP {
        (
            u16::from_be_bytes([l4[0], l4[1]]),
            u16::from_be_bytes([l4[2], l4[3]]),
        )
    } else {
        (0, 0)
    }
}

/// One NodePort service written the way the eBPF planner does (svc 1, `flags`): backends
/// `(id, addr, backend flags)` on port `bport`, their slots, and the frontend
/// `node:node_port/proto` as its external-scope entry plus the cluster-scope twin the planner
/// writes for every external frontend (read by socket LB; the TC programs must not take it for
/// the external entry). No frontend filter is written: all zero means "maybe everywhere".
pub fn node_port_service<A: Into<IpAddr> + Copy>(
    ebpf: &mut Ebpf,
    (node, node_port, proto): (A, u16, u8),
    flags: u32,
    bport: u16,
    backends: &[(u32, A, u8)],
) {
    for (id, addr, bflags) in backends {
        backend(ebpf, *id, *addr, bport, *bflags);
    }
    slots(ebpf, 1, &backends.iter().map(|b| b.0).collect::<Vec<_>>());
    let value = ServiceValue {
        svc_id: 1,
        count: backends.len() as u32,
        flags,
        affinity_timeout: 0,
    };
    frontend(ebpf, node, node_port, proto, SCOPE_EXTERNAL, value);
    frontend(ebpf, node, node_port, proto, SCOPE_CLUSTER, value);
}
