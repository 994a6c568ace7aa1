//! How to tell pod-originated ("local") traffic from other traffic (pure): upstream's
//! `LocalDetector` (pkg/proxy/util/localdetector.go) and its per-family selection
//! (cmd/kube-proxy `getLocalDetectors`).
//!
//! A [`LocalDetector`] is one rule: source address in a CIDR, arrival on a bridge interface,
//! or arrival on an interface whose name starts with a prefix — or nothing ([`LocalDetector::None`],
//! upstream's no-op detector, "not implemented"). Datapaths render it:
//! - iptables: `LocalDetector::if_local` / `LocalDetector::if_not_local` give upstream's
//!   exact match arguments (`-s 10.0.0.0/8`, `! -s …`, `-i cbr0`, `-i veth+`);
//! - nftables-style text: `LocalDetector::if_local_nft` / `LocalDetector::if_not_local_nft`;
//! - eBPF and tests: [`LocalDetector::is_local`] evaluates it for one packet.
//!
//! `detectors` picks one detector per IP family from `--detect-local-mode`:
//! - `ClusterCIDR` (the default): the first `--cluster-cidr` of each family; a family without
//!   one gets no detector;
//! - `NodeCIDR`: the first of the Node's `spec.podCIDRs` of each family. As upstream, the
//!   agent waits for the Node to get podCIDRs before it builds the datapath
//!   (`agent::wait_for_pod_cidrs`, at most 5 minutes), hands them to the iptables/ipvs
//!   datapaths (their faces), and exits to restart when they change later
//!   ([`DetectLocal::needs_node_pod_cidrs`]);
//! - `BridgeInterface`: `--pod-bridge-interface` for both families;
//! - `InterfaceNamePrefix`: `--pod-interface-name-prefix` for both families.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::model::IpFamily;

/// `detectLocalMode` and its parameters: how the user chose to recognise pod traffic.
/// `detectors` turns it into one [`LocalDetector`] per family.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub enum DetectLocal {
    /// Source in the cluster CIDRs (of the packet's family) is local; a family without a
    /// cluster CIDR detects nothing as local.
    #[default]
    ClusterCidr,
    /// Source in the Node object's `spec.podCIDRs` is local.
    NodeCidr,
    /// Traffic entering from this bridge is local (`detectLocal.bridgeInterface`).
    BridgeInterface(String),
    /// Traffic entering from interfaces with this prefix is local
    /// (`detectLocal.interfaceNamePrefix`).
    InterfaceNamePrefix(String),
}

impl DetectLocal {
    /// Upstream's spelling of the mode.
    pub fn as_str(&self) -> &'static str {
        match self {
            DetectLocal::ClusterCidr => "ClusterCIDR",
            DetectLocal::NodeCidr => "NodeCIDR",
            DetectLocal::BridgeInterface(_) => "BridgeInterface",
            DetectLocal::InterfaceNamePrefix(_) => "InterfaceNamePrefix",
        }
    }

    /// Whether the detectors depend on the Node's podCIDRs (wait for them before building).
    pub fn needs_node_pod_cidrs(&self) -> bool {
        *self == DetectLocal::NodeCidr
    }
}

/// One way to recognise pod-originated traffic.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LocalDetector {
    /// Not implemented: nothing is considered local (upstream's no-op detector).
    #[default]
    None,
    /// Source address within the CIDR.
    Cidr(IpNet),
    /// Arrived on this bridge interface.
    BridgeInterface(String),
    /// Arrived on an interface whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

impl LocalDetector {
    /// Upstream `IsImplemented`.
    pub(crate) fn is_implemented(&self) -> bool {
        !matches!(self, LocalDetector::None)
    }

    /// iptables match arguments selecting local traffic (upstream `IfLocal`); `None` when not
    /// implemented.
    pub(crate) fn if_local(&self) -> Option<String> {
        match self {
            LocalDetector::None => None,
            LocalDetector::Cidr(c) => Some(format!("-s {c}")),
            LocalDetector::BridgeInterface(i) => Some(format!("-i {i}")),
            LocalDetector::InterfaceNamePrefix(p) => Some(format!("-i {p}+")),
        }
    }

    /// iptables match arguments selecting non-local traffic (upstream `IfNotLocal`).
    pub(crate) fn if_not_local(&self) -> Option<String> {
        self.if_local().map(|l| format!("! {l}"))
    }

    /// nftables expression selecting local traffic (upstream `IfLocalNFT`).
    pub(crate) fn if_local_nft(&self) -> Option<String> {
        self.nft("")
    }

    /// nftables expression selecting non-local traffic (upstream `IfNotLocalNFT`).
    pub(crate) fn if_not_local_nft(&self) -> Option<String> {
        self.nft("!= ")
    }

    fn nft(&self, op: &str) -> Option<String> {
        Some(match self {
            LocalDetector::None => return None,
            LocalDetector::Cidr(c @ IpNet::V4(_)) => format!("ip saddr {op}{c}"),
            LocalDetector::Cidr(c @ IpNet::V6(_)) => format!("ip6 saddr {op}{c}"),
            LocalDetector::BridgeInterface(i) => format!("iif {op}{i}"),
            LocalDetector::InterfaceNamePrefix(p) => format!("iifname {op}{p}*"),
        })
    }

    /// Whether a packet from `src` that arrived on interface `in_iface` is local traffic.
    pub fn is_local(&self, src: IpAddr, in_iface: &str) -> bool {
        match self {
            LocalDetector::None => false,
            LocalDetector::Cidr(c) => c.contains(&src),
            LocalDetector::BridgeInterface(i) => in_iface == i,
            LocalDetector::InterfaceNamePrefix(p) => in_iface.starts_with(p.as_str()),
        }
    }
}

/// The detector of each family.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct LocalDetectors {
    pub v4: LocalDetector,
    pub v6: LocalDetector,
}

impl LocalDetectors {
    pub(crate) fn get(&self, family: IpFamily) -> &LocalDetector {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }
}

/// A configuration that cannot give any detector.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DetectLocalError {
    #[error(
        "detect-local-mode BridgeInterface needs --pod-bridge-interface (detectLocal.bridgeInterface)"
    )]
    NoBridgeInterface,
    #[error(
        "detect-local-mode InterfaceNamePrefix needs --pod-interface-name-prefix (detectLocal.interfaceNamePrefix)"
    )]
    NoInterfacePrefix,
}

/// Upstream `getLocalDetectors`: one detector per family, plus warnings to log (upstream logs
/// them at info level) when the primary family ends up without a detector.
pub(crate) fn detectors(
    mode: &DetectLocal,
    cluster_cidrs: &[IpNet],
    primary: IpFamily,
    node_pod_cidrs: &[IpNet],
) -> Result<(LocalDetectors, Vec<String>), DetectLocalError> {
    let by_first_cidr = |cidrs: &[IpNet]| LocalDetectors {
        v4: first_of(cidrs, IpFamily::V4),
        v6: first_of(cidrs, IpFamily::V6),
    };
    let mut warnings = vec![];
    let d = match mode {
        DetectLocal::ClusterCidr => {
            let d = by_first_cidr(cluster_cidrs);
            if !d.get(primary).is_implemented() {
                warnings.push(format!(
                    "detect-local-mode set to ClusterCIDR, but no cluster CIDR specified for the \
                     primary IP family ({}); traffic from pods is not recognised as local",
                    primary.name()
                ));
            }
            d
        }
        DetectLocal::NodeCidr => {
            let d = by_first_cidr(node_pod_cidrs);
            if !d.get(primary).is_implemented() {
                warnings.push(format!(
                    "detect-local-mode set to NodeCIDR, but no PodCIDR defined at the node for the \
                     primary IP family ({})",
                    primary.name()
                ));
            }
            d
        }
        DetectLocal::BridgeInterface(bridge) => {
            if bridge.is_empty() {
                return Err(DetectLocalError::NoBridgeInterface);
            }
            let d = LocalDetector::BridgeInterface(bridge.clone());
            LocalDetectors {
                v4: d.clone(),
                v6: d,
            }
        }
        DetectLocal::InterfaceNamePrefix(prefix) => {
            if prefix.is_empty() {
                return Err(DetectLocalError::NoInterfacePrefix);
            }
            let d = LocalDetector::InterfaceNamePrefix(prefix.clone());
            LocalDetectors {
                v4: d.clone(),
                v6: d,
            }
        }
    };
    Ok((d, warnings))
}

fn first_of(cidrs: &[IpNet], family: IpFamily) -> LocalDetector {
    cidrs
        .iter()
        .find(|c| family.matches(&c.addr()))
        .map(|c| LocalDetector::Cidr(c.trunc()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }
    fn words(v: Option<String>) -> String {
        v.unwrap_or_default()
    }

    #[test]
    fn iptables_args_match_upstream() {
        let cases = [
            (
                LocalDetector::Cidr(net("10.0.0.0/14")),
                "-s 10.0.0.0/14",
                "! -s 10.0.0.0/14",
            ),
            (
                LocalDetector::Cidr(net("2002:0:0:1234::/64")),
                "-s 2002:0:0:1234::/64",
                "! -s 2002:0:0:1234::/64",
            ),
            (
                LocalDetector::BridgeInterface("eth0".into()),
                "-i eth0",
                "! -i eth0",
            ),
            (
                LocalDetector::InterfaceNamePrefix("eth".into()),
                "-i eth+",
                "! -i eth+",
            ),
            (LocalDetector::None, "", ""),
        ];
        for (d, local, not_local) in cases {
            assert_eq!(words(d.if_local()), local, "{d:?}");
            assert_eq!(words(d.if_not_local()), not_local, "{d:?}");
        }
    }

    #[test]
    fn nft_words_match_upstream() {
        let cases = [
            (
                LocalDetector::Cidr(net("10.0.0.0/14")),
                "ip saddr 10.0.0.0/14",
                "ip saddr != 10.0.0.0/14",
            ),
            (
                LocalDetector::Cidr(net("2002::/64")),
                "ip6 saddr 2002::/64",
                "ip6 saddr != 2002::/64",
            ),
            (
                LocalDetector::BridgeInterface("cbr0".into()),
                "iif cbr0",
                "iif != cbr0",
            ),
            (
                LocalDetector::InterfaceNamePrefix("veth".into()),
                "iifname veth*",
                "iifname != veth*",
            ),
        ];
        for (d, local, not_local) in cases {
            assert_eq!(words(d.if_local_nft()), local);
            assert_eq!(words(d.if_not_local_nft()), not_local);
        }
    }

    #[test]
    fn is_local_evaluates_each_kind() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let c = LocalDetector::Cidr(net("10.244.0.0/16"));
        assert!(c.is_local(ip("10.244.3.4"), "eth0"));
        assert!(!c.is_local(ip("10.245.0.1"), "eth0"));
        let b = LocalDetector::BridgeInterface("cbr0".into());
        assert!(b.is_local(ip("1.2.3.4"), "cbr0"));
        assert!(!b.is_local(ip("1.2.3.4"), "cbr01"));
        let p = LocalDetector::InterfaceNamePrefix("veth".into());
        assert!(p.is_local(ip("1.2.3.4"), "veth1234"));
        assert!(!p.is_local(ip("1.2.3.4"), "eth0"));
        assert!(!LocalDetector::None.is_local(ip("10.244.3.4"), "veth0"));
    }

    #[test]
    fn cluster_cidr_mode_uses_the_first_cidr_of_each_family() {
        let mode = DetectLocal::ClusterCidr;
        let cidrs = [
            net("fd00:10::/48"),
            net("10.244.0.0/16"),
            net("10.96.0.0/16"),
        ];
        let (d, w) = detectors(&mode, &cidrs, IpFamily::V4, &[]).unwrap();
        assert_eq!(d.v4, LocalDetector::Cidr(net("10.244.0.0/16")));
        assert_eq!(d.v6, LocalDetector::Cidr(net("fd00:10::/48")));
        assert!(w.is_empty());
        let (d, w) = detectors(&mode, &[net("10.244.0.0/16")], IpFamily::V6, &[]).unwrap();
        assert_eq!(d.v6, LocalDetector::None);
        assert_eq!(w.len(), 1, "primary family without a CIDR is warned about");
        let (d, w) = detectors(&DetectLocal::default(), &[], IpFamily::V4, &[]).unwrap();
        assert_eq!(d, LocalDetectors::default());
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn node_cidr_mode_uses_the_pod_cidrs() {
        let mode = DetectLocal::NodeCidr;
        let (d, w) = detectors(
            &mode,
            &[net("10.0.0.0/8")],
            IpFamily::V4,
            &[net("10.244.1.0/24")],
        )
        .unwrap();
        assert_eq!(d.v4, LocalDetector::Cidr(net("10.244.1.0/24")));
        assert_eq!(d.v6, LocalDetector::None);
        assert!(w.is_empty());
        assert!(mode.needs_node_pod_cidrs());
        assert!(!DetectLocal::ClusterCidr.needs_node_pod_cidrs());
    }

    #[test]
    fn interface_modes_apply_to_both_families_and_need_their_flag() {
        let mode = DetectLocal::BridgeInterface("cbr0".into());
        let (d, _) = detectors(&mode, &[], IpFamily::V4, &[]).unwrap();
        assert_eq!(d.v4, LocalDetector::BridgeInterface("cbr0".into()));
        assert_eq!(d.v6, d.v4);
        assert_eq!(
            detectors(
                &DetectLocal::InterfaceNamePrefix(String::new()),
                &[],
                IpFamily::V4,
                &[]
            )
            .unwrap_err(),
            DetectLocalError::NoInterfacePrefix
        );
        assert_eq!(
            detectors(
                &DetectLocal::BridgeInterface(String::new()),
                &[],
                IpFamily::V4,
                &[]
            )
            .unwrap_err(),
            DetectLocalError::NoBridgeInterface
        );
    }

    /// The spellings upstream's `detectLocalMode` uses (the config file parses them in
    /// `config::resolve`; messages print them back).
    #[test]
    fn mode_spellings() {
        let spelled: Vec<&str> = [
            DetectLocal::ClusterCidr,
            DetectLocal::NodeCidr,
            DetectLocal::BridgeInterface("cbr0".into()),
            DetectLocal::InterfaceNamePrefix("veth".into()),
        ]
        .iter()
        .map(DetectLocal::as_str)
        .collect();
        assert_eq!(
            spelled,
            [
                "ClusterCIDR",
                "NodeCIDR",
                "BridgeInterface",
                "InterfaceNamePrefix"
            ]
        );
    }
}
