//! Chain names, exactly as upstream computes them (`proxier.go`: `portProtoHash`,
//! `servicePortEndpointChainName`): the first 16 characters of the standard base32 encoding
//! of `sha256(servicePortName + protocol [+ "ip:port"])`, behind a fixed prefix.

use ring::digest::{SHA256, digest};

pub(crate) use crate::dataplane::netfilter::ServiceChains;
use crate::model::{Endpoint, ServicePortName};

pub(crate) const KUBE_SERVICES: &str = "KUBE-SERVICES";
pub(crate) const KUBE_EXTERNAL_SERVICES: &str = "KUBE-EXTERNAL-SERVICES";
pub(crate) const KUBE_NODEPORTS: &str = "KUBE-NODEPORTS";
pub(crate) const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
pub(crate) const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
pub(crate) const KUBE_FORWARD: &str = "KUBE-FORWARD";
pub(crate) const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
pub(crate) const KUBE_PROXY_CANARY: &str = "KUBE-PROXY-CANARY";
/// Kubelet's anti-martian chain, which upstream duplicates (and never deletes).
pub(crate) const KUBE_FIREWALL: &str = "KUBE-FIREWALL";

/// Prefixes of the per-service chains (upstream `isServiceChainName`).
pub(crate) const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
];

/// Whether `chain` is a per-service chain (ours to delete when stale).
pub(crate) fn is_service_chain(chain: &str) -> bool {
    SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
}

const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// First 16 characters of base32(sha256(s)) (16 chars = 80 bits = the first 10 bytes).
fn hash16(s: &str) -> String {
    let d = digest(&SHA256, s.as_bytes());
    let bytes = &d.as_ref()[..10];
    let mut bits: u128 = 0;
    for b in bytes {
        bits = (bits << 8) | u128::from(*b);
    }
    (0..16)
        .map(|i| BASE32[((bits >> (75 - 5 * i)) & 31) as usize] as char)
        .collect()
}

/// Upstream `portProtoHash(servicePortName, protocol)`.
pub(crate) fn port_proto_hash(name: &ServicePortName) -> String {
    hash16(&format!("{name}{}", name.protocol.lower()))
}

/// Upstream's `KUBE-SVC/SVL/EXT/FW-<hash>` chains of a service port.
pub(crate) fn service_chains(name: &ServicePortName) -> ServiceChains {
    let h = port_proto_hash(name);
    ServiceChains::named(["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-"], &h)
}

/// Upstream `servicePortEndpointChainName`: `KUBE-SEP-…` of one endpoint of one service port.
pub(crate) fn endpoint_chain(name: &ServicePortName, ep: &Endpoint) -> String {
    format!(
        "KUBE-SEP-{}",
        hash16(&format!("{name}{}{}", name.protocol.lower(), ep.addr()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;
    use crate::model::testing::port_name;

    fn spn(ns: &str, n: &str, p: &str) -> ServicePortName {
        port_name(ns, n, p, Protocol::Tcp)
    }

    #[test]
    fn hashes_match_upstream_examples() {
        assert_eq!(
            port_proto_hash(&spn("ns1", "svc1", "p80")),
            "XPGD46QRK7WJZT7O"
        );
        assert_eq!(hash16("ns1/svc1:p80tcp10.180.0.1:80"), "SXIVWICOYRO3J4NJ");
        assert_eq!(
            service_chains(&spn("ns2", "svc2", "p8080")).cluster,
            "KUBE-SVC-2VJB64SDSIJUP5T6"
        );
    }

    #[test]
    fn service_chain_prefixes() {
        assert!(is_service_chain("KUBE-SEP-AAAA"));
        assert!(is_service_chain("KUBE-FW-AAAA"));
        assert!(!is_service_chain("KUBE-SERVICES"));
        assert!(!is_service_chain("KUBE-FIREWALL"));
    }
}
