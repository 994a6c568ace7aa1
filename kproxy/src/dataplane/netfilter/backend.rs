//! The two iptables backends (nf_tables and legacy x_tables), their binaries' names and the
//! choice between them, shared by the iptables and ipvs modes (both write iptables rules).

use std::path::Path;

use crate::model::IpFamily;

/// A resolved backend: nf_tables or legacy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Nft,
    Legacy,
}

impl Flavor {
    fn suffix(self) -> &'static str {
        match self {
            Flavor::Nft => "nft",
            Flavor::Legacy => "legacy",
        }
    }
}

/// The binary of `family` and `flavor`: `what` = `""` → `iptables-nft`, `"save"` →
/// `iptables-nft-save`, `"restore"` → `iptables-nft-restore` (`ip6tables-…` for IPv6).
pub fn tool(family: IpFamily, flavor: Flavor, what: &str) -> String {
    let base = match family {
        IpFamily::V4 => "iptables",
        IpFamily::V6 => "ip6tables",
    };
    if what.is_empty() {
        format!("{base}-{}", flavor.suffix())
    } else {
        format!("{base}-{}-{what}", flavor.suffix())
    }
}

/// Rules in both families' tables of `flavor` (a whole save: naming no table creates none),
/// and whether the kubelet's hint chain is among them.
fn count_rules(netns: Option<&Path>, flavor: Flavor) -> (usize, bool) {
    let mut n = 0;
    let mut hint = false;
    for fam in [IpFamily::V4, IpFamily::V6] {
        let cmd = super::exec::command(netns, &tool(fam, flavor, "save"));
        if let Ok(out) = super::exec::run(cmd, None) {
            n += out.stdout.lines().filter(|l| l.starts_with('-')).count();
            hint |= out.stdout.lines().any(|l| {
                l.starts_with(":KUBE-IPTABLES-HINT ") || l.starts_with(":KUBE-KUBELET-CANARY ")
            });
        }
    }
    (n, hint)
}

/// Chooses the backend like upstream's iptables-wrapper: a kubelet hint chain
/// (`KUBE-IPTABLES-HINT` / `KUBE-KUBELET-CANARY`) decides first (nft checked first); else the
/// backend whose save output holds more rules; nft on a tie.
pub fn detect_backend(netns: Option<&Path>) -> Flavor {
    let (nft, nft_hint) = count_rules(netns, Flavor::Nft);
    let (legacy, legacy_hint) = count_rules(netns, Flavor::Legacy);
    let flavor = if nft_hint {
        Flavor::Nft
    } else if legacy_hint || legacy > nft {
        Flavor::Legacy
    } else {
        Flavor::Nft
    };
    tracing::info!(
        ?flavor,
        nft_rules = nft,
        legacy_rules = legacy,
        "iptables backend detected"
    );
    flavor
}
