//! How to tell pod-originated ("local") traffic from other traffic (pure): upstream's
//! `LocalTrafficDetector` (pkg/proxy/util/localdetector.go) and its per-family selection
//! (cmd/kube-proxy `getLocalDetectors`).
//!
//! A [`LocalDetector`] is one rule: source address in a CIDR, arrival on a bridge interface,
//! or arrival on an interface whose name starts with a prefix — or nothing ([`LocalDetector::None`],
//! upstream's no-op detector, "not implemented"). Datapaths render it:
//! - iptables: [`LocalDetector::if_local`] / [`LocalDetector::if_not_local`] give upstream's
//!   exact match arguments (`-s 10.0.0.0/8`, `! -s …`, `-i cbr0`, `-i veth+`);
//! - nftables-style text: [`LocalDetector::if_local_nft`] / [`LocalDetector::if_not_local_nft`];
//! - eBPF and tests: [`LocalDetector::is_local`] evaluates it for one packet.
//!
//! [`detectors`] picks one detector per IP family from `--detect-local-mode`:
//! - `ClusterCIDR` (the default): the first `--cluster-cidr` of each family; a family without
//!   one gets no detector;
//! - `NodeCIDR`: the first of the Node's `spec.podCIDRs` of each family. As upstream, the
//!   agent waits for the Node to get podCIDRs before it builds the datapath
//!   (`agent::wait_for_pod_cidrs`, at most 5 minutes), hands them to the iptables/ipvs
//!   datapaths (`dataplane::factory`), and exits to restart when they change later
//!   ([`DetectLocalMode::needs_node_pod_cidrs`]);
//! - `BridgeInterface`: `--pod-bridge-interface` for both families;
//! - `InterfaceNamePrefix`: `--pod-interface-name-prefix` for both families.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use ipnet::IpNet;

use crate::model::IpFamily;

/// `--detect-local-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DetectLocalMode {
    #[default]
    ClusterCidr,
    NodeCidr,
    BridgeInterface,
    InterfaceNamePrefix,
}

impl DetectLocalMode {
    pub fn as_str(self) -> &'static str {
        match self {
            DetectLocalMode::ClusterCidr => "ClusterCIDR",
            DetectLocalMode::NodeCidr => "NodeCIDR",
            DetectLocalMode::BridgeInterface => "BridgeInterface",
            DetectLocalMode::InterfaceNamePrefix => "InterfaceNamePrefix",
        }
    }

    /// Whether the detectors depend on the Node's podCIDRs (wait for them before building).
    pub fn needs_node_pod_cidrs(self) -> bool {
        self == DetectLocalMode::NodeCidr
    }
}

impl fmt::Display for DetectLocalMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DetectLocalMode {
    type Err = String;
    /// Upstream's spellings; empty means the default (`ClusterCIDR`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" | "ClusterCIDR" => Ok(DetectLocalMode::ClusterCidr),
            "NodeCIDR" => Ok(DetectLocalMode::NodeCidr),
            "BridgeInterface" => Ok(DetectLocalMode::BridgeInterface),
            "InterfaceNamePrefix" => Ok(DetectLocalMode::InterfaceNamePrefix),
            other => Err(format!(
                "unknown detect-local-mode {other:?}: expected ClusterCIDR, NodeCIDR, \
                 BridgeInterface or InterfaceNamePrefix"
            )),
        }
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
    pub fn is_implemented(&self) -> bool {
        !matches!(self, LocalDetector::None)
    }

    /// iptables match arguments selecting local traffic (upstream `IfLocal`); empty for `None`.
    pub fn if_local(&self) -> Vec<String> {
        match self {
            LocalDetector::None => vec![],
            LocalDetector::Cidr(c) => vec!["-s".into(), c.to_string()],
            LocalDetector::BridgeInterface(i) => vec!["-i".into(), i.clone()],
            LocalDetector::InterfaceNamePrefix(p) => vec!["-i".into(), format!("{p}+")],
        }
    }

    /// iptables match arguments selecting non-local traffic (upstream `IfNotLocal`).
    pub fn if_not_local(&self) -> Vec<String> {
        let mut v = self.if_local();
        if !v.is_empty() {
            v.insert(0, "!".into());
        }
        v
    }

    /// nftables expression words selecting local traffic (upstream `IfLocalNFT`).
    pub fn if_local_nft(&self) -> Vec<String> {
        self.nft(false)
    }

    /// nftables expression words selecting non-local traffic (upstream `IfNotLocalNFT`).
    pub fn if_not_local_nft(&self) -> Vec<String> {
        self.nft(true)
    }

    fn nft(&self, negate: bool) -> Vec<String> {
        let (key, value) = match self {
            LocalDetector::None => return vec![],
            LocalDetector::Cidr(c) => (
                match c {
                    IpNet::V4(_) => "ip saddr",
                    IpNet::V6(_) => "ip6 saddr",
                },
                c.to_string(),
            ),
            LocalDetector::BridgeInterface(i) => ("iif", i.clone()),
            LocalDetector::InterfaceNamePrefix(p) => ("iifname", format!("{p}*")),
        };
        let mut v: Vec<String> = key.split(' ').map(str::to_owned).collect();
        if negate {
            v.push("!=".into());
        }
        v.push(value);
        v
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
pub struct LocalDetectors {
    pub v4: LocalDetector,
    pub v6: LocalDetector,
}

impl LocalDetectors {
    pub fn get(&self, family: IpFamily) -> &LocalDetector {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }
}

/// Inputs of [`detectors`].
#[derive(Debug, Clone, Default)]
pub struct DetectLocalConfig {
    pub mode: DetectLocalMode,
    /// `--cluster-cidr` (comma-separated in the flag), any order of families.
    pub cluster_cidrs: Vec<IpNet>,
    /// `--pod-bridge-interface`.
    pub bridge_interface: String,
    /// `--pod-interface-name-prefix`.
    pub interface_name_prefix: String,
}

/// A configuration that cannot give any detector.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DetectLocalError {
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
pub fn detectors(
    cfg: &DetectLocalConfig,
    primary: IpFamily,
    node_pod_cidrs: &[IpNet],
) -> Result<(LocalDetectors, Vec<String>), DetectLocalError> {
    let by_first_cidr = |cidrs: &[IpNet]| LocalDetectors {
        v4: first_of(cidrs, IpFamily::V4),
        v6: first_of(cidrs, IpFamily::V6),
    };
    let mut warnings = vec![];
    let d = match cfg.mode {
        DetectLocalMode::ClusterCidr => {
            let d = by_first_cidr(&cfg.cluster_cidrs);
            if !d.get(primary).is_implemented() {
                warnings.push(format!(
                    "detect-local-mode set to ClusterCIDR, but no cluster CIDR specified for the \
                     primary IP family ({}); traffic from pods is not recognised as local",
                    primary.name()
                ));
            }
            d
        }
        DetectLocalMode::NodeCidr => {
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
        DetectLocalMode::BridgeInterface => {
            if cfg.bridge_interface.is_empty() {
                return Err(DetectLocalError::NoBridgeInterface);
            }
            let d = LocalDetector::BridgeInterface(cfg.bridge_interface.clone());
            LocalDetectors {
                v4: d.clone(),
                v6: d,
            }
        }
        DetectLocalMode::InterfaceNamePrefix => {
            if cfg.interface_name_prefix.is_empty() {
                return Err(DetectLocalError::NoInterfacePrefix);
            }
            let d = LocalDetector::InterfaceNamePrefix(cfg.interface_name_prefix.clone());
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
    fn words(v: Vec<String>) -> String {
        v.join(" ")
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
        let cfg = DetectLocalConfig {
            mode: DetectLocalMode::ClusterCidr,
            cluster_cidrs: vec![
                net("fd00:10::/48"),
                net("10.244.0.0/16"),
                net("10.96.0.0/16"),
            ],
            ..Default::default()
        };
        let (d, w) = detectors(&cfg, IpFamily::V4, &[]).unwrap();
        assert_eq!(d.v4, LocalDetector::Cidr(net("10.244.0.0/16")));
        assert_eq!(d.v6, LocalDetector::Cidr(net("fd00:10::/48")));
        assert!(w.is_empty());
        let cfg = DetectLocalConfig {
            cluster_cidrs: vec![net("10.244.0.0/16")],
            ..cfg
        };
        let (d, w) = detectors(&cfg, IpFamily::V6, &[]).unwrap();
        assert_eq!(d.v6, LocalDetector::None);
        assert_eq!(w.len(), 1, "primary family without a CIDR is warned about");
        let (d, w) = detectors(&DetectLocalConfig::default(), IpFamily::V4, &[]).unwrap();
        assert_eq!(d, LocalDetectors::default());
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn node_cidr_mode_uses_the_pod_cidrs() {
        let cfg = DetectLocalConfig {
            mode: DetectLocalMode::NodeCidr,
            cluster_cidrs: vec![net("10.0.0.0/8")],
            ..Default::default()
        };
        let (d, w) = detectors(&cfg, IpFamily::V4, &[net("10.244.1.0/24")]).unwrap();
        assert_eq!(d.v4, LocalDetector::Cidr(net("10.244.1.0/24")));
        assert_eq!(d.v6, LocalDetector::None);
        assert!(w.is_empty());
        assert!(DetectLocalMode::NodeCidr.needs_node_pod_cidrs());
    }

    #[test]
    fn interface_modes_apply_to_both_families_and_need_their_flag() {
        let cfg = DetectLocalConfig {
            mode: DetectLocalMode::BridgeInterface,
            bridge_interface: "cbr0".into(),
            ..Default::default()
        };
        let (d, _) = detectors(&cfg, IpFamily::V4, &[]).unwrap();
        assert_eq!(d.v4, LocalDetector::BridgeInterface("cbr0".into()));
        assert_eq!(d.v6, d.v4);
        let cfg = DetectLocalConfig {
            mode: DetectLocalMode::InterfaceNamePrefix,
            ..Default::default()
        };
        assert_eq!(
            detectors(&cfg, IpFamily::V4, &[]).unwrap_err(),
            DetectLocalError::NoInterfacePrefix
        );
    }

    #[test]
    fn mode_spellings() {
        for m in [
            DetectLocalMode::ClusterCidr,
            DetectLocalMode::NodeCidr,
            DetectLocalMode::BridgeInterface,
            DetectLocalMode::InterfaceNamePrefix,
        ] {
            assert_eq!(m.as_str().parse::<DetectLocalMode>().unwrap(), m);
        }
        assert_eq!(
            "".parse::<DetectLocalMode>().unwrap(),
            DetectLocalMode::ClusterCidr
        );
        assert!("clustercidr".parse::<DetectLocalMode>().is_err());
    }
}
