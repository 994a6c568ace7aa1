//! Service → [`ServicePort`]s, with upstream kube-proxy's rules (pkg/proxy/serviceport.go
//! `newBaseServiceInfo`, servicechangetracker.go):
//!
//! - not proxied (no warning, by design): `type: ExternalName`, clusterIP `None` or empty
//!   (headless / not allocated), and the labels the informers select away
//!   (`service.kubernetes.io/service-proxy-name`, `service.kubernetes.io/headless`);
//! - cluster IPs from `spec.clusterIPs` (else `spec.clusterIP`), one per family, checked
//!   against `spec.ipFamilies`; ports TCP/UDP/SCTP; nodePort; externalIPs; LB ingress IPs with
//!   ipMode (unset = VIP); `loadBalancerSourceRanges` (whitespace trimmed, as upstream);
//!   externalTrafficPolicy=Local only when the service is externally accessible;
//!   healthCheckNodePort only for LoadBalancer + eTP Local (upstream `NeedsHealthCheck`);
//!   ClientIP affinity with `timeoutSeconds` (default 10800).
//!
//! Bad input never fails the whole object unless its primary cluster IP is unusable: the bad
//! part is skipped and reported as a [`ModelWarning`] naming `Service ns/name` and the field.

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServiceSpec};

use super::types::{
    IpFamily, IpMode, LoadBalancerIngress, Protocol, ServicePort, ServicePortName, ServiceType,
};
use super::warning::ModelWarning;

/// Default `sessionAffinityConfig.clientIP.timeoutSeconds` (upstream's
/// `DefaultClientIPServiceAffinitySeconds`).
pub(crate) const DEFAULT_AFFINITY_TIMEOUT_SECONDS: u32 = 10800;
/// Largest allowed affinity timeout (one day, as the API validates).
pub(crate) const MAX_AFFINITY_TIMEOUT_SECONDS: i32 = 86400;

/// Parses an IP the way Go's `netutils.ParseIPSloppy` does: IPv4 octets may carry leading
/// zeros (read as decimal), as old Kubernetes releases allowed.
pub(crate) fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    let parts: Vec<&str> = s.split('.').collect();
    if parts.len() != 4 {
        return None;
    }
    let mut octets = [0u8; 4];
    for (o, p) in octets.iter_mut().zip(&parts) {
        if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *o = p.parse().ok()?;
    }
    Some(IpAddr::from(octets))
}

/// Parses a CIDR sloppily (leading zeros in IPv4 octets allowed) and masks it.
pub(crate) fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    let (ip, len) = s.split_once('/')?;
    let ip = parse_ip_sloppy(ip)?;
    let len: u8 = len.parse().ok()?;
    IpNet::new(ip, len).ok().map(|n| n.trunc())
}

/// Why a service is not proxied by design (not an error), or `None` if it is proxied.
pub(crate) fn skip_reason(svc: &Service) -> Option<&'static str> {
    let labels = svc.metadata.labels.as_ref();
    if labels.is_some_and(|l| l.contains_key("service.kubernetes.io/service-proxy-name")) {
        return Some("label service.kubernetes.io/service-proxy-name: served by another proxy");
    }
    if labels.is_some_and(|l| l.contains_key("service.kubernetes.io/headless")) {
        return Some("label service.kubernetes.io/headless");
    }
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some("type ExternalName");
    }
    match spec.cluster_ip.as_deref() {
        None | Some("") | Some("None") => Some("no cluster IP (headless or not allocated)"),
        _ => None,
    }
}

/// The warnings about one Service, each naming it (`Service ns/name`) and the field.
struct Warnings {
    object: String,
    list: Vec<ModelWarning>,
}

impl Warnings {
    fn warn(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        self.list
            .push(ModelWarning::new(&self.object, field, reason));
    }
}

/// Builds the proxied ports of `svc`, and a warning for every part that was skipped.
pub(crate) fn service_ports(svc: &Service) -> (Vec<ServicePort>, Vec<ModelWarning>) {
    let ns = svc
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = svc.metadata.name.clone().unwrap_or_default();
    let mut w = Warnings {
        object: format!("Service {ns}/{name}"),
        list: vec![],
    };
    let Some(spec) = svc.spec.as_ref() else {
        return (vec![], vec![]);
    };
    if skip_reason(svc).is_some() {
        return (vec![], vec![]);
    }
    if name.is_empty() {
        w.warn("metadata.name", "missing");
        return (vec![], w.list);
    }
    let service_type = service_type(spec, &mut w);
    let Some(cluster_ips) = cluster_ips(spec, &mut w) else {
        return (vec![], w.list);
    };
    let external_ips = external_ips(spec, &mut w);
    let load_balancer_ingress = load_balancer_ingress(svc, &mut w);
    let load_balancer_source_ranges = load_balancer_source_ranges(spec, &mut w);
    let policies = traffic_policies(spec, service_type, &mut w);
    let session_affinity_timeout = session_affinity_timeout(spec, &mut w);

    // Exact capacity: the tracker keeps this Vec for the service's lifetime (a default-grown
    // one holds 4 ports of ≈ 200 bytes for the usual single port).
    let mut ports = Vec::with_capacity(spec.ports.as_ref().map_or(0, Vec::len));
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let Some((protocol, port, node_port)) = port_numbers(i, p, &mut w) else {
            continue;
        };
        ports.push(ServicePort {
            name: ServicePortName::new(
                ns.clone(),
                name.clone(),
                p.name.clone().unwrap_or_default(),
                protocol,
            ),
            service_type,
            cluster_ips: cluster_ips.clone(),
            port,
            protocol,
            node_port,
            external_ips: external_ips.clone(),
            load_balancer_ingress: load_balancer_ingress.clone(),
            load_balancer_source_ranges: load_balancer_source_ranges.clone(),
            external_policy_local: policies.external_policy_local,
            internal_policy_local: policies.internal_policy_local,
            health_check_node_port: policies.health_check_node_port,
            session_affinity_timeout,
        });
    }
    (ports, w.list)
}

/// `spec.type`; an unknown one is treated as ClusterIP.
fn service_type(spec: &ServiceSpec, w: &mut Warnings) -> ServiceType {
    match spec.type_.as_deref() {
        None | Some("ClusterIP") => ServiceType::ClusterIp,
        Some("NodePort") => ServiceType::NodePort,
        Some("LoadBalancer") => ServiceType::LoadBalancer,
        Some(other) => {
            w.warn(
                "spec.type",
                format!("unknown service type {other:?}; treated as ClusterIP"),
            );
            ServiceType::ClusterIp
        }
    }
}

/// Cluster IPs: clusterIPs (if set) else clusterIP, one per family, checked against
/// `spec.ipFamilies`. `None` (service skipped) when the first is unusable.
fn cluster_ips(spec: &ServiceSpec, w: &mut Warnings) -> Option<Vec<IpAddr>> {
    let raw_ips: Vec<(String, String)> = match spec.cluster_ips.as_ref().filter(|v| !v.is_empty()) {
        Some(ips) => ips
            .iter()
            .enumerate()
            .map(|(i, ip)| (format!("spec.clusterIPs[{i}]"), ip.clone()))
            .collect(),
        None => vec![(
            "spec.clusterIP".into(),
            spec.cluster_ip.clone().unwrap_or_default(),
        )],
    };
    let families = spec.ip_families.clone().unwrap_or_default();
    let mut cluster_ips: Vec<IpAddr> = vec![];
    for (i, (field, raw)) in raw_ips.iter().enumerate() {
        let Some(ip) = parse_ip_sloppy(raw.trim()) else {
            if i == 0 {
                w.warn(field, format!("invalid IP {raw:?}; service skipped"));
                return None;
            }
            w.warn(field, format!("invalid IP {raw:?}"));
            continue;
        };
        if let Some(fam) = families.get(i) {
            let want = match fam.as_str() {
                "IPv4" => Some(IpFamily::V4),
                "IPv6" => Some(IpFamily::V6),
                _ => None,
            };
            if want.is_some_and(|f| !f.matches(&ip)) {
                let reason = format!("{ip} does not match spec.ipFamilies[{i}] {fam}");
                if i == 0 {
                    w.warn(field, format!("{reason}; service skipped"));
                    return None;
                }
                w.warn(field, reason);
                continue;
            }
        }
        if cluster_ips
            .iter()
            .any(|c| IpFamily::of(c) == IpFamily::of(&ip))
        {
            w.warn(
                field,
                format!("second cluster IP of the same family ({ip}) ignored"),
            );
            continue;
        }
        cluster_ips.push(ip);
    }
    Some(cluster_ips)
}

/// `spec.externalIPs`, invalid ones skipped.
fn external_ips(spec: &ServiceSpec, w: &mut Warnings) -> Vec<IpAddr> {
    let mut external_ips = vec![];
    for (i, raw) in spec.external_ips.iter().flatten().enumerate() {
        match parse_ip_sloppy(raw.trim()) {
            Some(ip) => external_ips.push(ip),
            None => w.warn(
                format!("spec.externalIPs[{i}]"),
                format!("invalid IP {raw:?}"),
            ),
        }
    }
    external_ips
}

/// `status.loadBalancer.ingress` IPs with their ipMode (hostname-only ingress skipped).
fn load_balancer_ingress(svc: &Service, w: &mut Warnings) -> Vec<LoadBalancerIngress> {
    let mut load_balancer_ingress = vec![];
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for (i, ing) in ingress.into_iter().flatten().enumerate() {
        let Some(raw) = ing.ip.as_deref().filter(|s| !s.is_empty()) else {
            continue; // hostname-only ingress: nothing to capture
        };
        let Some(ip) = parse_ip_sloppy(raw.trim()) else {
            w.warn(
                format!("status.loadBalancer.ingress[{i}].ip"),
                format!("invalid IP {raw:?}"),
            );
            continue;
        };
        let ip_mode = match ing.ip_mode.as_deref() {
            None | Some("VIP") => IpMode::Vip,
            Some("Proxy") => IpMode::Proxy,
            Some(other) => {
                w.warn(
                    format!("status.loadBalancer.ingress[{i}].ipMode"),
                    format!("unknown ipMode {other:?}; treated as VIP"),
                );
                IpMode::Vip
            }
        };
        load_balancer_ingress.push(LoadBalancerIngress { ip, ip_mode });
    }
    load_balancer_ingress
}

/// `spec.loadBalancerSourceRanges` (whitespace trimmed, as upstream), invalid ones skipped.
fn load_balancer_source_ranges(spec: &ServiceSpec, w: &mut Warnings) -> Vec<IpNet> {
    let mut ranges = vec![];
    for (i, raw) in spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .enumerate()
    {
        match parse_cidr_sloppy(raw.trim()) {
            Some(net) => ranges.push(net),
            None => w.warn(
                format!("spec.loadBalancerSourceRanges[{i}]"),
                format!("invalid CIDR {raw:?}"),
            ),
        }
    }
    ranges
}

/// The traffic policies and the health check node port they imply.
struct TrafficPolicies {
    external_policy_local: bool,
    internal_policy_local: bool,
    health_check_node_port: u16,
}

/// upstream apiservice.ExternallyAccessible / ExternalPolicyLocal / NeedsHealthCheck.
fn traffic_policies(
    spec: &ServiceSpec,
    service_type: ServiceType,
    w: &mut Warnings,
) -> TrafficPolicies {
    let externally_accessible = matches!(
        service_type,
        ServiceType::NodePort | ServiceType::LoadBalancer
    ) || (service_type == ServiceType::ClusterIp
        && !spec.external_ips.as_ref().is_none_or(Vec::is_empty));
    let external_policy_local =
        externally_accessible && spec.external_traffic_policy.as_deref() == Some("Local");
    let internal_policy_local = spec.internal_traffic_policy.as_deref() == Some("Local");
    let mut health_check_node_port = 0;
    if service_type == ServiceType::LoadBalancer && external_policy_local {
        match spec.health_check_node_port {
            Some(p @ 1..=65535) => health_check_node_port = p as u16,
            Some(0) | None => w.warn(
                "spec.healthCheckNodePort",
                "missing for a LoadBalancer with externalTrafficPolicy=Local",
            ),
            Some(p) => w.warn(
                "spec.healthCheckNodePort",
                format!("{p} is out of range 1-65535"),
            ),
        }
    }
    TrafficPolicies {
        external_policy_local,
        internal_policy_local,
        health_check_node_port,
    }
}

/// ClientIP affinity's timeout (default 10800 s), `None` without affinity.
fn session_affinity_timeout(spec: &ServiceSpec, w: &mut Warnings) -> Option<u32> {
    match spec.session_affinity.as_deref() {
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match t {
                None => Some(DEFAULT_AFFINITY_TIMEOUT_SECONDS),
                Some(t @ 1..=MAX_AFFINITY_TIMEOUT_SECONDS) => Some(t as u32),
                Some(t) => {
                    w.warn(
                        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                        format!(
                            "{t} is out of range 1-{MAX_AFFINITY_TIMEOUT_SECONDS}; default {DEFAULT_AFFINITY_TIMEOUT_SECONDS} used"
                        ),
                    );
                    Some(DEFAULT_AFFINITY_TIMEOUT_SECONDS)
                }
            }
        }
        None | Some("None") => None,
        Some(other) => {
            w.warn(
                "spec.sessionAffinity",
                format!("unknown session affinity {other:?}; none used"),
            );
            None
        }
    }
}

/// `spec.ports[i]`'s protocol, port and node port; `None` (port skipped) when the protocol
/// or port is unusable.
fn port_numbers(
    i: usize,
    p: &k8s_openapi::api::core::v1::ServicePort,
    w: &mut Warnings,
) -> Option<(Protocol, u16, u16)> {
    let Some(protocol) = Protocol::parse(p.protocol.as_deref()) else {
        w.warn(
            format!("spec.ports[{i}].protocol"),
            format!(
                "unknown protocol {:?}; port skipped",
                p.protocol.as_deref().unwrap_or("")
            ),
        );
        return None;
    };
    let port = match u16::try_from(p.port) {
        Ok(port) if port != 0 => port,
        _ => {
            w.warn(
                format!("spec.ports[{i}].port"),
                format!("{} is out of range 1-65535; port skipped", p.port),
            );
            return None;
        }
    };
    let node_port = match p.node_port {
        None => 0,
        Some(np) => match u16::try_from(np) {
            Ok(np) => np,
            Err(_) => {
                w.warn(
                    format!("spec.ports[{i}].nodePort"),
                    format!("{np} is out of range 0-65535; no node port"),
                );
                0
            }
        },
    };
    Some((protocol, port, node_port))
}
