//! The kernel's IPVS generic-netlink interface (family `"IPVS"`, `include/uapi/linux/ip_vs.h`):
//! virtual services and their destinations (real servers), read by dumps and changed one
//! object per message, plus the tcp/tcpfin/udp timeouts and the version.
//!
//! Only NAT ("masquerading") forwarding is used, like upstream. Encoding and decoding are pure
//! functions (unit-tested on the host); [`IpvsHandle`] sends them.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::kernel::netlink::MsgBuilder;
use crate::kernel::netlink::NLM_F_ACK;
use crate::kernel::netlink::NLM_F_DUMP;
use crate::kernel::netlink::OwnedMsg;
use crate::kernel::netlink::Socket;
use crate::kernel::netlink::attrs;
use crate::kernel::netlink::find_attr;
use crate::kernel::netlink::read_str;
use crate::kernel::netlink::read_u16;
use crate::kernel::netlink::read_u32;
use crate::model::Protocol;

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

pub(crate) const IPVS_GENL_NAME: &str = "IPVS";
const IPVS_GENL_VERSION: u8 = 1;

const CMD_NEW_SERVICE: u8 = 1;
const CMD_SET_SERVICE: u8 = 2;
const CMD_DEL_SERVICE: u8 = 3;
const CMD_GET_SERVICE: u8 = 4;
const CMD_NEW_DEST: u8 = 5;
const CMD_SET_DEST: u8 = 6;
const CMD_DEL_DEST: u8 = 7;
const CMD_GET_DEST: u8 = 8;
const CMD_SET_CONFIG: u8 = 12;
const CMD_GET_CONFIG: u8 = 13;
const CMD_GET_INFO: u8 = 15;

const CMD_ATTR_SERVICE: u16 = 1;
const CMD_ATTR_DEST: u16 = 2;
const CMD_ATTR_TIMEOUT_TCP: u16 = 4;
const CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
const CMD_ATTR_TIMEOUT_UDP: u16 = 6;

const SVC_ATTR_AF: u16 = 1;
const SVC_ATTR_PROTOCOL: u16 = 2;
const SVC_ATTR_ADDR: u16 = 3;
const SVC_ATTR_PORT: u16 = 4;
const SVC_ATTR_SCHED_NAME: u16 = 6;
const SVC_ATTR_FLAGS: u16 = 7;
const SVC_ATTR_TIMEOUT: u16 = 8;
const SVC_ATTR_NETMASK: u16 = 9;

const DEST_ATTR_ADDR: u16 = 1;
const DEST_ATTR_PORT: u16 = 2;
const DEST_ATTR_FWD_METHOD: u16 = 3;
const DEST_ATTR_WEIGHT: u16 = 4;
const DEST_ATTR_U_THRESH: u16 = 5;
const DEST_ATTR_L_THRESH: u16 = 6;
const DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const DEST_ATTR_INACT_CONNS: u16 = 8;
const DEST_ATTR_PERSIST_CONNS: u16 = 9;
const DEST_ATTR_ADDR_FAMILY: u16 = 11;

const INFO_ATTR_VERSION: u16 = 1;

/// `IP_VS_CONN_F_MASQ`: NAT forwarding.
const FWD_MASQ: u32 = 0;
/// `IP_VS_SVC_F_PERSISTENT`.
pub const SVC_F_PERSISTENT: u32 = 0x1;
/// `IP_VS_SVC_F_HASHED` (set by the kernel; ignored when comparing).
pub(crate) const SVC_F_HASHED: u32 = 0x2;
/// `IP_VS_SVC_F_SCHED1/2/3` (scheduler flags, e.g. `sh-fallback`, `sh-port`, `mh-…`).
pub const SVC_F_SCHED1: u32 = 0x8;
pub const SVC_F_SCHED2: u32 = 0x10;
pub const SVC_F_SCHED3: u32 = 0x20;

/// Identity of a virtual service: address, protocol, port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub addr: IpAddr,
    pub protocol: Protocol,
    pub port: u16,
}

impl std::fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}",
            self.protocol.lower(),
            std::net::SocketAddr::new(self.addr, self.port)
        )
    }
}

/// A virtual service as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualService {
    pub key: ServiceKey,
    pub scheduler: String,
    /// `IP_VS_SVC_F_*` (without `HASHED`).
    pub flags: u32,
    /// Persistence timeout in seconds (meaningful with `SVC_F_PERSISTENT`).
    pub timeout: u32,
}

/// A destination (real server) of a virtual service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub addr: IpAddr,
    pub port: u16,
    pub weight: u32,
    /// Read from the kernel only (0 when building requests).
    pub active_conns: u32,
    pub inactive_conns: u32,
    pub persist_conns: u32,
}

/// The tcp / tcpfin / udp connection timeouts in seconds (0 = leave unchanged).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp: u32,
    pub tcp_fin: u32,
    pub udp: u32,
}

fn af(addr: &IpAddr) -> u16 {
    match addr {
        IpAddr::V4(_) => libc::AF_INET as u16,
        IpAddr::V6(_) => libc::AF_INET6 as u16,
    }
}

/// `union nf_inet_addr`: 16 bytes, IPv4 in the first four.
fn addr_bytes(addr: &IpAddr) -> [u8; 16] {
    let mut b = [0u8; 16];
    match addr {
        IpAddr::V4(a) => b[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => b.copy_from_slice(&a.octets()),
    }
    b
}

fn parse_addr(family: u16, p: &[u8]) -> Option<IpAddr> {
    if family == libc::AF_INET as u16 {
        let o: [u8; 4] = p.get(..4)?.try_into().ok()?;
        Some(IpAddr::V4(Ipv4Addr::from(o)))
    } else if family == libc::AF_INET6 as u16 {
        let o: [u8; 16] = p.get(..16)?.try_into().ok()?;
        Some(IpAddr::V6(Ipv6Addr::from(o)))
    } else {
        None
    }
}

fn protocol_from(n: u16) -> Option<Protocol> {
    [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
        .into_iter()
        .find(|p| u16::from(p.number()) == n)
}

fn genl_msg(family: u16, cmd: u8, flags: u16) -> MsgBuilder {
    MsgBuilder::new(family, flags).header(&[cmd, IPVS_GENL_VERSION, 0, 0])
}

/// The identifying attributes of a service (inside `IPVS_CMD_ATTR_SERVICE`).
fn put_service_key(m: &mut MsgBuilder, key: &ServiceKey) {
    m.u16(SVC_ATTR_AF, af(&key.addr))
        .u16(SVC_ATTR_PROTOCOL, u16::from(key.protocol.number()))
        .attr(SVC_ATTR_ADDR, &addr_bytes(&key.addr))
        .attr(SVC_ATTR_PORT, &key.port.to_be_bytes());
}

/// `IPVS_CMD_NEW_SERVICE` / `SET_SERVICE` message for `svc`.
pub(crate) fn encode_service(family: u16, svc: &VirtualService, update: bool) -> MsgBuilder {
    let cmd = if update {
        CMD_SET_SERVICE
    } else {
        CMD_NEW_SERVICE
    };
    let mut m = genl_msg(family, cmd, NLM_F_ACK);
    m.begin_nested(CMD_ATTR_SERVICE);
    put_service_key(&mut m, &svc.key);
    let netmask: u32 = match svc.key.addr {
        IpAddr::V4(_) => 0xffff_ffff,
        IpAddr::V6(_) => 128,
    };
    let mut flags = [0u8; 8];
    flags[..4].copy_from_slice(&svc.flags.to_ne_bytes());
    flags[4..].copy_from_slice(&u32::MAX.to_ne_bytes()); // mask: set every flag as given
    m.str(SVC_ATTR_SCHED_NAME, &svc.scheduler)
        .attr(SVC_ATTR_FLAGS, &flags)
        .u32(SVC_ATTR_TIMEOUT, svc.timeout)
        .u32(SVC_ATTR_NETMASK, netmask)
        .end_nested();
    m
}

pub(crate) fn encode_del_service(family: u16, key: &ServiceKey) -> MsgBuilder {
    let mut m = genl_msg(family, CMD_DEL_SERVICE, NLM_F_ACK);
    m.begin_nested(CMD_ATTR_SERVICE);
    put_service_key(&mut m, key);
    m.end_nested();
    m
}

/// `IPVS_CMD_NEW_DEST` / `SET_DEST` / `DEL_DEST` for `dest` of service `key`.
pub(crate) fn encode_dest(
    family: u16,
    key: &ServiceKey,
    dest: &Destination,
    cmd: DestCmd,
) -> MsgBuilder {
    let c = match cmd {
        DestCmd::New => CMD_NEW_DEST,
        DestCmd::Set => CMD_SET_DEST,
        DestCmd::Del => CMD_DEL_DEST,
    };
    let mut m = genl_msg(family, c, NLM_F_ACK);
    m.begin_nested(CMD_ATTR_SERVICE);
    put_service_key(&mut m, key);
    m.end_nested();
    m.begin_nested(CMD_ATTR_DEST);
    m.attr(DEST_ATTR_ADDR, &addr_bytes(&dest.addr))
        .attr(DEST_ATTR_PORT, &dest.port.to_be_bytes())
        .u16(DEST_ATTR_ADDR_FAMILY, af(&dest.addr));
    if cmd != DestCmd::Del {
        m.u32(DEST_ATTR_FWD_METHOD, FWD_MASQ)
            .u32(DEST_ATTR_WEIGHT, dest.weight)
            .u32(DEST_ATTR_U_THRESH, 0)
            .u32(DEST_ATTR_L_THRESH, 0);
    }
    m.end_nested();
    m
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DestCmd {
    New,
    Set,
    Del,
}

/// Decodes the `IPVS_CMD_ATTR_SERVICE` of one dump reply (payload after `nlmsghdr`).
pub(crate) fn decode_service(payload: &[u8]) -> Option<VirtualService> {
    let body = payload.get(4..)?;
    let svc = find_attr(body, CMD_ATTR_SERVICE)?;
    let family = read_u16(find_attr(svc, SVC_ATTR_AF)?)?;
    // fwmark services have no address/protocol: not ours, skipped.
    let protocol = protocol_from(read_u16(find_attr(svc, SVC_ATTR_PROTOCOL)?)?)?;
    let addr = parse_addr(family, find_attr(svc, SVC_ATTR_ADDR)?)?;
    let port = u16::from_be_bytes(find_attr(svc, SVC_ATTR_PORT)?.get(..2)?.try_into().ok()?);
    let scheduler = find_attr(svc, SVC_ATTR_SCHED_NAME)
        .map(read_str)
        .unwrap_or_default();
    let flags = find_attr(svc, SVC_ATTR_FLAGS)
        .and_then(read_u32)
        .unwrap_or(0)
        & !SVC_F_HASHED;
    let timeout = find_attr(svc, SVC_ATTR_TIMEOUT)
        .and_then(read_u32)
        .unwrap_or(0);
    Some(VirtualService {
        key: ServiceKey {
            addr,
            protocol,
            port,
        },
        scheduler,
        flags,
        timeout,
    })
}

/// Decodes the `IPVS_CMD_ATTR_DEST` of one dump reply. `svc_family` is used when the kernel
/// does not send `IPVS_DEST_ATTR_ADDR_FAMILY`.
pub(crate) fn decode_dest(payload: &[u8], svc_family: u16) -> Option<Destination> {
    let body = payload.get(4..)?;
    let d = find_attr(body, CMD_ATTR_DEST)?;
    let family = find_attr(d, DEST_ATTR_ADDR_FAMILY)
        .and_then(read_u16)
        .unwrap_or(svc_family);
    let addr = parse_addr(family, find_attr(d, DEST_ATTR_ADDR)?)?;
    let port = u16::from_be_bytes(find_attr(d, DEST_ATTR_PORT)?.get(..2)?.try_into().ok()?);
    let get = |k| find_attr(d, k).and_then(read_u32).unwrap_or(0);
    Some(Destination {
        addr,
        port,
        weight: get(DEST_ATTR_WEIGHT),
        active_conns: get(DEST_ATTR_ACTIVE_CONNS),
        inactive_conns: get(DEST_ATTR_INACT_CONNS),
        persist_conns: get(DEST_ATTR_PERSIST_CONNS),
    })
}

/// Decodes `CTRL_ATTR_FAMILY_ID` from a `CTRL_CMD_GETFAMILY` reply.
fn decode_family_id(payload: &[u8]) -> Option<u16> {
    read_u16(find_attr(payload.get(4..)?, CTRL_ATTR_FAMILY_ID)?)
}

/// A socket for the IPVS generic-netlink client: a large kernel receive buffer for big dumps.
pub(super) fn open_socket(protocol: libc::c_int) -> io::Result<Socket> {
    let sock = Socket::open(protocol)?.with_recv_len(256 * 1024);
    sock.set_rcvbuf(1 << 20);
    Ok(sock)
}

/// An open generic-netlink socket with the IPVS family resolved (in the caller's network
/// namespace: IPVS state is per namespace).
#[derive(Debug)]
pub struct IpvsHandle {
    sock: Socket,
    family: u16,
}

/// Errors of the IPVS netlink interface, naming the object.
#[derive(Debug, thiserror::Error)]
pub enum IpvsError {
    #[error("the IPVS generic netlink family does not resolve ({0}): is the ip_vs module loaded?")]
    NoFamily(io::Error),
    #[error("IPVS {op} {object}: {source}")]
    Op {
        op: &'static str,
        object: String,
        source: io::Error,
    },
}

impl IpvsHandle {
    pub fn open() -> Result<IpvsHandle, IpvsError> {
        let mut sock = open_socket(libc::NETLINK_GENERIC).map_err(IpvsError::NoFamily)?;
        let mut m = MsgBuilder::new(GENL_ID_CTRL, NLM_F_ACK).header(&[CTRL_CMD_GETFAMILY, 1, 0, 0]);
        m.str(CTRL_ATTR_FAMILY_NAME, IPVS_GENL_NAME);
        let replies = sock.request(&m).map_err(IpvsError::NoFamily)?;
        let family = replies
            .iter()
            .find_map(|r| decode_family_id(&r.payload))
            .ok_or_else(|| {
                IpvsError::NoFamily(io::Error::new(
                    io::ErrorKind::NotFound,
                    "no family id in reply",
                ))
            })?;
        Ok(IpvsHandle { sock, family })
    }

    /// Sends `m`; its answers, or the error naming `op` and `object`.
    fn query(
        &mut self,
        op: &'static str,
        object: impl Into<String>,
        m: &MsgBuilder,
    ) -> Result<Vec<OwnedMsg>, IpvsError> {
        self.sock.request(m).map_err(|source| IpvsError::Op {
            op,
            object: object.into(),
            source,
        })
    }

    fn op(&mut self, op: &'static str, object: String, m: &MsgBuilder) -> Result<(), IpvsError> {
        self.query(op, object, m).map(|_| ())
    }

    /// The IPVS version as `(major, minor, patch)`.
    pub(crate) fn version(&mut self) -> Result<(u32, u32, u32), IpvsError> {
        let m = genl_msg(self.family, CMD_GET_INFO, NLM_F_ACK);
        let replies = self.query("get", "info", &m)?;
        let v = replies
            .iter()
            .find_map(|r| find_attr(r.payload.get(4..)?, INFO_ATTR_VERSION).and_then(read_u32))
            .unwrap_or(0);
        Ok((v >> 16, (v >> 8) & 0xff, v & 0xff))
    }

    pub fn services(&mut self) -> Result<Vec<VirtualService>, IpvsError> {
        let m = genl_msg(self.family, CMD_GET_SERVICE, NLM_F_DUMP);
        let replies = self.query("list", "services", &m)?;
        Ok(replies
            .iter()
            .filter_map(|r| decode_service(&r.payload))
            .collect())
    }

    pub fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<Destination>, IpvsError> {
        let mut m = genl_msg(self.family, CMD_GET_DEST, NLM_F_DUMP);
        m.begin_nested(CMD_ATTR_SERVICE);
        put_service_key(&mut m, key);
        m.end_nested();
        let replies = self.query("list destinations of", key.to_string(), &m)?;
        let family = af(&key.addr);
        Ok(replies
            .iter()
            .filter_map(|r| decode_dest(&r.payload, family))
            .collect())
    }

    pub(crate) fn add_service(&mut self, svc: &VirtualService) -> Result<(), IpvsError> {
        let m = encode_service(self.family, svc, false);
        self.op("add", svc.key.to_string(), &m)
    }
    pub(crate) fn update_service(&mut self, svc: &VirtualService) -> Result<(), IpvsError> {
        let m = encode_service(self.family, svc, true);
        self.op("update", svc.key.to_string(), &m)
    }
    pub(crate) fn delete_service(&mut self, key: &ServiceKey) -> Result<(), IpvsError> {
        let m = encode_del_service(self.family, key);
        self.op("delete", key.to_string(), &m)
    }
    pub(crate) fn dest(
        &mut self,
        key: &ServiceKey,
        d: &Destination,
        cmd: DestCmd,
    ) -> Result<(), IpvsError> {
        let m = encode_dest(self.family, key, d, cmd);
        let op = match cmd {
            DestCmd::New => "add destination",
            DestCmd::Set => "update destination",
            DestCmd::Del => "delete destination",
        };
        let object = format!("{} of {key}", std::net::SocketAddr::new(d.addr, d.port));
        self.op(op, object, &m)
    }

    /// Sets the tcp/tcpfin/udp timeouts (0 leaves one unchanged).
    pub(crate) fn set_timeouts(&mut self, t: Timeouts) -> Result<(), IpvsError> {
        let mut m = genl_msg(self.family, CMD_SET_CONFIG, NLM_F_ACK);
        m.u32(CMD_ATTR_TIMEOUT_TCP, t.tcp)
            .u32(CMD_ATTR_TIMEOUT_TCP_FIN, t.tcp_fin)
            .u32(CMD_ATTR_TIMEOUT_UDP, t.udp);
        self.op("set", "timeouts".into(), &m)
    }

    pub fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        let m = genl_msg(self.family, CMD_GET_CONFIG, NLM_F_ACK);
        let replies = self.query("get", "timeouts", &m)?;
        let mut t = Timeouts::default();
        for r in &replies {
            let body = r.payload.get(4..).unwrap_or_default();
            for (k, p) in attrs(body).map_while(Result::ok) {
                let v = read_u32(p).unwrap_or(0);
                match k {
                    CMD_ATTR_TIMEOUT_TCP => t.tcp = v,
                    CMD_ATTR_TIMEOUT_TCP_FIN => t.tcp_fin = v,
                    CMD_ATTR_TIMEOUT_UDP => t.udp = v,
                    _ => {}
                }
            }
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::netlink::wire::parse_messages;

    fn svc(addr: &str, proto: Protocol) -> VirtualService {
        VirtualService {
            key: ServiceKey {
                addr: addr.parse().unwrap(),
                protocol: proto,
                port: 8080,
            },
            scheduler: "wrr".into(),
            flags: SVC_F_PERSISTENT,
            timeout: 10800,
        }
    }

    /// A request parsed back the way the kernel reads it (its reply uses the same layout).
    fn round_trip(m: &MsgBuilder) -> Vec<u8> {
        let bytes = m.finish(3);
        let msgs = parse_messages(&bytes).unwrap();
        assert_eq!(msgs.len(), 1);
        msgs[0].payload.to_vec()
    }

    #[test]
    fn service_encoding_round_trips_for_both_families() {
        for (addr, proto) in [("10.96.0.10", Protocol::Tcp), ("fd00::10", Protocol::Sctp)] {
            let s = svc(addr, proto);
            let payload = round_trip(&encode_service(42, &s, false));
            assert_eq!(payload[0], CMD_NEW_SERVICE);
            assert_eq!(payload[1], IPVS_GENL_VERSION);
            assert_eq!(decode_service(&payload).unwrap(), s);
        }
        let payload = round_trip(&encode_service(42, &svc("10.0.0.1", Protocol::Udp), true));
        assert_eq!(payload[0], CMD_SET_SERVICE);
    }

    #[test]
    fn port_is_network_order_and_netmask_matches_family() {
        let payload = round_trip(&encode_service(
            42,
            &svc("10.96.0.10", Protocol::Tcp),
            false,
        ));
        let s = find_attr(&payload[4..], CMD_ATTR_SERVICE).unwrap();
        assert_eq!(find_attr(s, SVC_ATTR_PORT).unwrap(), &8080u16.to_be_bytes());
        assert_eq!(
            read_u32(find_attr(s, SVC_ATTR_NETMASK).unwrap()),
            Some(u32::MAX)
        );
        let addr = find_attr(s, SVC_ATTR_ADDR).unwrap();
        assert_eq!(addr.len(), 16);
        assert_eq!(&addr[..4], &[10, 96, 0, 10]);
        let payload = round_trip(&encode_service(42, &svc("fd00::1", Protocol::Tcp), false));
        let s = find_attr(&payload[4..], CMD_ATTR_SERVICE).unwrap();
        assert_eq!(read_u32(find_attr(s, SVC_ATTR_NETMASK).unwrap()), Some(128));
    }

    #[test]
    fn destination_encoding_round_trips_and_delete_is_minimal() {
        let s = svc("10.96.0.10", Protocol::Tcp);
        let d = Destination {
            addr: "10.244.1.2".parse().unwrap(),
            port: 80,
            weight: 1,
            active_conns: 0,
            inactive_conns: 0,
            persist_conns: 0,
        };
        let payload = round_trip(&encode_dest(42, &s.key, &d, DestCmd::New));
        assert_eq!(payload[0], CMD_NEW_DEST);
        assert_eq!(decode_dest(&payload, libc::AF_INET as u16).unwrap(), d);
        assert_eq!(decode_service(&payload).unwrap().key, s.key);
        let del = round_trip(&encode_dest(42, &s.key, &d, DestCmd::Del));
        let dest = find_attr(&del[4..], CMD_ATTR_DEST).unwrap();
        assert!(find_attr(dest, DEST_ATTR_WEIGHT).is_none());
        assert_eq!(
            find_attr(dest, DEST_ATTR_PORT).unwrap(),
            &80u16.to_be_bytes()
        );
    }

    #[test]
    fn kernel_hashed_flag_is_ignored_and_fwmark_services_skipped() {
        let mut m = genl_msg(42, CMD_NEW_SERVICE, 0);
        m.begin_nested(CMD_ATTR_SERVICE);
        put_service_key(
            &mut m,
            &ServiceKey {
                addr: "10.0.0.1".parse().unwrap(),
                protocol: Protocol::Tcp,
                port: 80,
            },
        );
        m.attr(
            SVC_ATTR_FLAGS,
            &[(SVC_F_HASHED) as u8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff],
        );
        m.end_nested();
        assert_eq!(decode_service(&round_trip(&m)).unwrap().flags, 0);
        let mut fw = genl_msg(42, CMD_NEW_SERVICE, 0);
        fw.begin_nested(CMD_ATTR_SERVICE)
            .u16(SVC_ATTR_AF, 2)
            .u32(5, 7)
            .end_nested();
        assert_eq!(decode_service(&round_trip(&fw)), None);
    }
}
