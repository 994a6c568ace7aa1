//! Chain and set names, exactly as upstream computes them (pkg/proxy/nftables/proxier.go:
//! `hashAndTruncate`, `servicePortChainNameBase`, `servicePortEndpointChainNameBase`):
//! `base32(sha256(base))[:8] + "-" + base`, cut to 237 characters + `...` when longer than 240
//! (knftables' 256-character name limit minus a 16-character prefix allowance).

use ring::digest::{SHA256, digest};

pub(crate) use crate::dataplane::netfilter::ServiceChains;
use crate::model::{Endpoint, ServicePortName};

/// knftables `NameLengthMax` minus upstream's prefix allowance (16).
pub(crate) const CHAIN_NAME_BASE_LENGTH_MAX: usize = 256 - 16;

pub(crate) const SERVICE_PREFIX: &str = "service-";
pub(crate) const LOCAL_PREFIX: &str = "local-";
pub(crate) const EXTERNAL_PREFIX: &str = "external-";
pub(crate) const FIREWALL_PREFIX: &str = "firewall-";
pub(crate) const ENDPOINT_PREFIX: &str = "endpoint-";
pub(crate) const AFFINITY_PREFIX: &str = "affinity-";

const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// First 8 characters of the standard base32 encoding of sha256(s) (40 bits = 5 bytes).
fn hash8(s: &str) -> String {
    let d = digest(&SHA256, s.as_bytes());
    let bits = d.as_ref()[..5]
        .iter()
        .fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
    (0..8)
        .map(|i| BASE32[((bits >> (35 - 5 * i)) & 31) as usize] as char)
        .collect()
}

/// Upstream `hashAndTruncate`.
pub fn hash_and_truncate(name: &str) -> String {
    let full = format!("{}-{name}", hash8(name));
    if full.len() > CHAIN_NAME_BASE_LENGTH_MAX {
        // Names are ASCII (namespace/service/port names, IPs with '.'), so byte cuts are safe.
        format!("{}...", &full[..CHAIN_NAME_BASE_LENGTH_MAX - 3])
    } else {
        full
    }
}

/// Upstream `servicePortChainNameBase`: `HASH-ns/svc/proto/port`.
pub fn service_base(name: &ServicePortName) -> String {
    hash_and_truncate(&format!(
        "{}/{}/{}/{}",
        name.namespace,
        name.name,
        name.protocol.lower(),
        name.port
    ))
}

/// Upstream `servicePortEndpointChainNameBase` for an endpoint given as `ip` and `port`
/// (IPv6 colons become dots).
pub fn endpoint_base_of(name: &ServicePortName, ip: &str, port: u16) -> String {
    hash_and_truncate(&format!(
        "{}/{}/{}/{}__{}/{}",
        name.namespace,
        name.name,
        name.protocol.lower(),
        name.port,
        ip.replace(':', "."),
        port
    ))
}

/// The base of an endpoint's chain and affinity set.
pub(crate) fn endpoint_base(name: &ServicePortName, ep: &Endpoint) -> String {
    endpoint_base_of(name, &ep.ip.to_string(), ep.port)
}

/// Chain of an endpoint (`endpoint-…`).
pub(crate) fn endpoint_chain(name: &ServicePortName, ep: &Endpoint) -> String {
    format!("{ENDPOINT_PREFIX}{}", endpoint_base(name, ep))
}

/// Affinity set of an endpoint (`affinity-…`).
pub(crate) fn affinity_set(name: &ServicePortName, ep: &Endpoint) -> String {
    format!("{AFFINITY_PREFIX}{}", endpoint_base(name, ep))
}

/// Upstream's `service-/local-/external-/firewall-<base>` chains of a service port.
pub(crate) fn service_chains(name: &ServicePortName) -> ServiceChains {
    let b = service_base(name);
    ServiceChains::named(
        [
            SERVICE_PREFIX,
            LOCAL_PREFIX,
            EXTERNAL_PREFIX,
            FIREWALL_PREFIX,
        ],
        &b,
    )
}

/// Upstream `isServiceChainName`: per-service chains always contain a `/`.
pub fn is_service_chain(name: &str) -> bool {
    name.contains('/')
}

/// Whether `name` is an endpoint chain (`endpoint-<hash>-<service port>__<ip>/<port>`).
pub(crate) fn is_endpoint_chain(name: &str) -> bool {
    name.starts_with(ENDPOINT_PREFIX) && is_service_chain(name)
}

/// Upstream `isAffinitySetName`.
pub(crate) fn is_affinity_set(name: &str) -> bool {
    name.starts_with(AFFINITY_PREFIX)
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
    fn names_match_upstream_examples() {
        let s = spn("ns1", "svc1", "p80");
        assert_eq!(
            service_chains(&s).cluster,
            "service-ULMVA6XW-ns1/svc1/tcp/p80"
        );
        assert_eq!(
            endpoint_base_of(&s, "10.180.0.1", 80),
            "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        );
        assert!(is_service_chain(
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
        ));
        assert!(!is_service_chain("services"));
    }

    #[test]
    fn long_names_are_truncated_to_240() {
        let long = "x".repeat(300);
        let t = hash_and_truncate(&long);
        assert_eq!(t.len(), 240);
        assert!(t.ends_with("..."));
        assert_eq!(hash_and_truncate("a").len(), 10);
    }
}
