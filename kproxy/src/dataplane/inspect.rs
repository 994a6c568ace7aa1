//! What `kproxy inspect` reports per service port, as every mode's reader fills it
//! (`dataplane/<mode>/inspect.rs`, called through the mode's face): the port's frontends and
//! endpoints come from the snapshot, the kernel lines and the backends the kernel balances to
//! from the mode's own state.

use std::net::IpAddr;

use serde::Serialize;

use crate::model::{Protocol, ServicePort, ServicePortName};

/// The service ports a report covers, in snapshot order; `reports[i]` is `selected[i]`'s.
pub(crate) type Selected<'a> = [(&'a ServicePortName, &'a ServicePort)];

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

/// One map's fill level.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MapFill {
    pub map: String,
    pub entries: usize,
    pub capacity: u32,
}

/// The IP protocol number.
pub(crate) fn proto_num(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

/// `addr:port`, IPv6 in brackets.
pub(crate) fn sock(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}

/// The frontends of a service port as the report lists them.
pub(crate) fn frontends(sp: &ServicePort) -> Vec<String> {
    let mut v: Vec<String> = sp.cluster_ips.iter().map(|ip| sock(*ip, sp.port)).collect();
    v.extend(sp.external_ips.iter().map(|ip| sock(*ip, sp.port)));
    v.extend(sp.load_balancer_ingress.iter().map(|i| sock(i.ip, sp.port)));
    if sp.node_port != 0 {
        v.push(format!("<node>:{}", sp.node_port));
    }
    v
}

/// Whether `ip:port` is a frontend of the service port (NodePort: any address with that port).
pub(crate) fn matches_frontend(sp: &ServicePort, ip: IpAddr, port: u16) -> bool {
    (port == sp.port
        && (sp.cluster_ips.contains(&ip)
            || sp.external_ips.contains(&ip)
            || sp.load_balancer_ingress.iter().any(|i| i.ip == ip)))
        || (sp.node_port != 0 && port == sp.node_port)
}
