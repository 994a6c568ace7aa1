//! [`TcPath`]: loads `kp_tc_in` / `kp_tc_eg` from the shared BPF object, writes the NAT
//! configuration and the per-device SNAT sources, and attaches the programs to devices.
//!
//! Attachment uses TCX links (kernel >= 6.6), four per device ([`HOOKS`]: IPv4 and IPv6
//! ingress and egress). With a pin directory (the agent's `<bpffs>/kproxy/`), each link is
//! pinned as `tc-<ifname>-in` / `-eg` / `-in6` / `-eg6`; a
//! restarted agent finds the pin and swaps its freshly loaded program into the existing link
//! (`attach_to_link`), so there is never a moment without the program and the pinned maps —
//! connection table included — carry established flows over. [`TcPath::detach`] unpins.

use crate::dataplane::ebpf::object::LoadOptions;
use std::collections::BTreeMap;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::maps::{Array, HashMap as BpfHashMap, MapError, PerCpuArray};
use aya::programs::links::{FdLink, LinkError, PinnedLink};
use aya::programs::tc::{SchedClassifierLinkId, TcAttachOptions};
use aya::programs::{LinkOrder, ProgramError, SchedClassifier, TcAttachType};
use kproxy_common::ct::{
    DEFAULT_CT_ENTRIES, DEFAULT_SNAT_PORT_MAX, DEFAULT_SNAT_PORT_MIN, MAP_CT, MAP_NAT_CONFIG,
    MAP_NODE_ADDR4, MAP_TC_STATS, NatConfig, NodeAddr4, PROG_TC_EGRESS, PROG_TC_INGRESS, TcStat,
};
use kproxy_common::ct6::{MAP_CT6, MAP_NODE_ADDR6, NodeAddr6, PROG_TC6_EGRESS, PROG_TC6_INGRESS};

/// Errors of the TC path.
#[derive(Debug, thiserror::Error)]
pub enum TcError {
    #[error("the BPF object has no program {0:?}")]
    MissingProgram(&'static str),
    #[error("the BPF object has no map {0:?}")]
    MissingMap(&'static str),
    #[error("BPF program {name:?}: {error}")]
    Program {
        name: &'static str,
        error: ProgramError,
    },
    #[error("BPF map {name:?}: {error}")]
    Map { name: &'static str, error: MapError },
    #[error("attaching {name:?} to device {device:?}: {error}")]
    Attach {
        name: &'static str,
        device: String,
        error: String,
    },
    #[error("TC path configuration, {field}: {reason}")]
    Config { field: &'static str, reason: String },
}

impl TcError {
    pub(crate) fn map(name: &'static str) -> impl Fn(MapError) -> TcError {
        move |error| TcError::Map { name, error }
    }
}

/// Configuration of the TC path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcConfig {
    /// Source ports BPF SNAT allocates from (host order, inclusive).
    pub snat_ports: RangeInclusive<u16>,
    /// Where links are pinned (`<bpffs>/kproxy/links`); `None`: links live as long as the
    /// [`Ebpf`].
    pub pin_dir: Option<PathBuf>,
    /// `max_entries` of `KP_CT` and of `KP_CT6` when this instance creates them
    /// ([`load_object`]).
    pub ct_entries: u32,
}

impl Default for TcConfig {
    fn default() -> Self {
        TcConfig {
            snat_ports: DEFAULT_SNAT_PORT_MIN..=DEFAULT_SNAT_PORT_MAX,
            pin_dir: None,
            ct_entries: DEFAULT_CT_ENTRIES,
        }
    }
}

impl TcConfig {
    fn nat_config(&self) -> Result<NatConfig, TcError> {
        let (min, max) = (*self.snat_ports.start(), *self.snat_ports.end());
        if min == 0 || min > max {
            return Err(TcError::Config {
                field: "snat_ports",
                reason: format!("{min}-{max} is not a port range within 1-65535"),
            });
        }
        Ok(NatConfig {
            snat_port_min: min,
            snat_port_max: max,
            flags: 0,
        })
    }
}

/// Loads the embedded object with its pinned maps in `map_pin_dir` (`<bpffs>/kproxy`): an
/// instance of its own that shares every pinned map (service maps, `KP_CT`) with the eBPF
/// dataplane's instance, so the TC path can be loaded, attached and maintained independently.
/// `KP_CT` and `KP_CT6` get `config.ct_entries` if this is the first load that creates them.
pub fn load_object(map_pin_dir: &Path, config: &TcConfig) -> Result<Ebpf, TcError> {
    crate::dataplane::ebpf::object::load(&LoadOptions {
        pin_dir: Some(map_pin_dir),
        max_entries: vec![(MAP_CT, config.ct_entries), (MAP_CT6, config.ct_entries)],
    })
    .map_err(|e| TcError::Config {
        field: "BPF object",
        reason: format!("loading with maps pinned in {}: {e}", map_pin_dir.display()),
    })
}

/// Every attachment on a device: program, direction, pin suffix. IPv4 and IPv6 are separate
/// programs (see `kproxy-ebpf/src/tc.rs` for why); each passes the other family on.
pub const HOOKS: [(&str, TcAttachType, &str); 4] = [
    (PROG_TC_INGRESS, TcAttachType::Ingress, "in"),
    (PROG_TC_EGRESS, TcAttachType::Egress, "eg"),
    (PROG_TC6_INGRESS, TcAttachType::Ingress, "in6"),
    (PROG_TC6_EGRESS, TcAttachType::Egress, "eg6"),
];

/// The TC programs of one loaded object and where they are attached.
pub struct TcPath {
    config: TcConfig,
    /// Device → its two links (unpinned ones; pinned ones are owned by the bpffs).
    attached: BTreeMap<String, Vec<(&'static str, SchedClassifierLinkId)>>,
}

impl TcPath {
    /// Loads both programs into the kernel (if not yet) and writes the NAT configuration.
    pub fn load(ebpf: &mut Ebpf, config: TcConfig) -> Result<TcPath, TcError> {
        let nat = config.nat_config()?;
        for (name, _, _) in HOOKS {
            let prog = classifier(ebpf, name)?;
            if prog.fd().is_err() {
                prog.load()
                    .map_err(|error| TcError::Program { name, error })?;
            }
        }
        let map = ebpf
            .map_mut(MAP_NAT_CONFIG)
            .ok_or(TcError::MissingMap(MAP_NAT_CONFIG))?;
        let mut array =
            Array::<_, NatConfig>::try_from(map).map_err(TcError::map(MAP_NAT_CONFIG))?;
        array.set(0, nat, 0).map_err(TcError::map(MAP_NAT_CONFIG))?;
        Ok(TcPath {
            config,
            attached: BTreeMap::new(),
        })
    }

    /// Attaches ingress and egress programs to `device` (in the calling thread's network
    /// namespace), reusing pinned links when a previous agent left them.
    pub fn attach(&mut self, ebpf: &mut Ebpf, device: &str) -> Result<(), TcError> {
        if self.attached.contains_key(device) {
            return Ok(());
        }
        let mut links = Vec::new();
        for (name, point, suffix) in HOOKS {
            let attach_err = |error: String| TcError::Attach {
                name,
                device: device.to_string(),
                error,
            };
            let prog = classifier(ebpf, name)?;
            let Some(dir) = &self.config.pin_dir else {
                let id = prog
                    .attach_with_options(
                        device,
                        point,
                        TcAttachOptions::TcxOrder(LinkOrder::default()),
                    )
                    .map_err(|e| attach_err(e.to_string()))?;
                links.push((name, id));
                continue;
            };
            let pin = dir.join(format!("tc-{device}-{suffix}"));
            let id = match PinnedLink::from_pin(&pin) {
                Ok(old) => {
                    let link = FdLink::from(old)
                        .try_into()
                        .map_err(|e: LinkError| attach_err(e.to_string()))?;
                    prog.attach_to_link(link)
                        .map_err(|e| attach_err(e.to_string()))?
                }
                Err(LinkError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::NotFound => {
                    prog.attach_with_options(
                        device,
                        point,
                        TcAttachOptions::TcxOrder(LinkOrder::default()),
                    )
                    .map_err(|e| attach_err(e.to_string()))?
                }
                Err(e) => return Err(attach_err(format!("reading pin {}: {e}", pin.display()))),
            };
            let link = prog.take_link(id).map_err(|e| attach_err(e.to_string()))?;
            let fd: FdLink = link
                .try_into()
                .map_err(|e: LinkError| attach_err(e.to_string()))?;
            if !pin.exists() {
                fd.pin(&pin)
                    .map_err(|e| attach_err(format!("pinning at {}: {e}", pin.display())))?;
            }
        }
        self.attached.insert(device.to_string(), links);
        tracing::info!(device, "TC service path attached");
        Ok(())
    }

    /// Detaches from `device` (and removes its pins).
    pub fn detach(&mut self, ebpf: &mut Ebpf, device: &str) -> Result<(), TcError> {
        if let Some(links) = self.attached.remove(device) {
            for (name, id) in links {
                let prog = classifier(ebpf, name)?;
                prog.detach(id)
                    .map_err(|error| TcError::Program { name, error })?;
            }
        }
        if let Some(dir) = &self.config.pin_dir {
            for (_, _, suffix) in HOOKS {
                let pin = dir.join(format!("tc-{device}-{suffix}"));
                if let Ok(link) = PinnedLink::from_pin(&pin) {
                    // Unpinning drops the last reference: the link detaches.
                    let _ = link.unpin();
                }
            }
        }
        Ok(())
    }

    /// Devices attached by this instance.
    pub fn attached(&self) -> Vec<String> {
        self.attached.keys().cloned().collect()
    }

    /// The pin directory, if links are pinned.
    pub fn pin_dir(&self) -> Option<&Path> {
        self.config.pin_dir.as_deref()
    }

    /// Replaces `KP_NODE_ADDR4` with `sources` (ifindex → SNAT source of that device); see
    /// [`crate::kernel::addresses::NodeAddresses::snat_v4`]. Then moves the XDP forwarding
    /// caches' generation, which may hold a node address per backend
    /// (`super::xdp::move_generation`).
    pub fn set_node_addresses(ebpf: &mut Ebpf, sources: &[(u32, Ipv4Addr)]) -> Result<(), TcError> {
        replace_node_addresses(ebpf, MAP_NODE_ADDR4, sources, |a| NodeAddr4 {
            addr: u32::from_ne_bytes(a.octets()),
        })?;
        super::xdp::move_generation(ebpf)
    }

    /// Replaces `KP_NODE_ADDR6` with `sources` (ifindex → IPv6 SNAT source of that device);
    /// see [`crate::kernel::addresses::NodeAddresses::snat_v6`].
    pub fn set_node_addresses6(
        ebpf: &mut Ebpf,
        sources: &[(u32, Ipv6Addr)],
    ) -> Result<(), TcError> {
        replace_node_addresses(ebpf, MAP_NODE_ADDR6, sources, |a| NodeAddr6 {
            addr: encode6(a),
        })
    }

    /// The programs' counters, summed over CPUs.
    pub fn stats(ebpf: &Ebpf) -> Result<BTreeMap<&'static str, u64>, TcError> {
        let name = MAP_TC_STATS;
        let map = ebpf.map(name).ok_or(TcError::MissingMap(name))?;
        let array = PerCpuArray::<_, u64>::try_from(map).map_err(TcError::map(name))?;
        let mut out = BTreeMap::new();
        for s in TcStat::ALL {
            let v = array.get(&s.index(), 0).map_err(TcError::map(name))?;
            out.insert(stat_name(s), v.iter().sum());
        }
        Ok(out)
    }
}

/// The metric-style name of a counter.
pub(crate) fn stat_name(s: TcStat) -> &'static str {
    match s {
        TcStat::NewFlow => "new_flow",
        TcStat::Established => "established",
        TcStat::Reply => "reply",
        TcStat::Snat => "snat",
        TcStat::SnatExhausted => "snat_failed",
        TcStat::SourceRangeDrop => "source_range_drop",
        TcStat::NoEndpoints => "no_endpoints",
        TcStat::IcmpError => "icmp_error",
        TcStat::CtInsertFailed => "ct_insert_failed",
    }
}

/// An IPv6 address as the maps hold it (`kproxy_common::ct6`: four `from_ne_bytes` words).
pub fn encode6(addr: Ipv6Addr) -> [u32; 4] {
    let o = addr.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

/// The loaded TC program `name` of `ebpf`.
pub fn classifier<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, TcError> {
    let prog = ebpf
        .program_mut(name)
        .ok_or(TcError::MissingProgram(name))?;
    prog.try_into()
        .map_err(|error| TcError::Program { name, error })
}

/// Makes the node-address map `name` hold exactly `sources` (ifindex → `encode(address)`):
/// inserts or overwrites every given device first, then removes the devices no longer given,
/// so a device that keeps its address never misses an entry.
fn replace_node_addresses<A: Copy, V: aya::Pod>(
    ebpf: &mut Ebpf,
    name: &'static str,
    sources: &[(u32, A)],
    encode: impl Fn(A) -> V,
) -> Result<(), TcError> {
    let map = ebpf.map_mut(name).ok_or(TcError::MissingMap(name))?;
    let mut table = BpfHashMap::<_, u32, V>::try_from(map).map_err(TcError::map(name))?;
    for (index, addr) in sources {
        table
            .insert(index, encode(*addr), 0)
            .map_err(TcError::map(name))?;
    }
    let stale: Vec<u32> = table
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !sources.iter().any(|(i, _)| i == k))
        .collect();
    for k in stale {
        let _ = table.remove(&k);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snat_port_range_is_validated() {
        let ok = TcConfig {
            snat_ports: 40000..=40009,
            ..TcConfig::default()
        };
        assert_eq!(ok.nat_config().unwrap().snat_port_min, 40000);
        for bad in [0..=10, RangeInclusive::new(500, 499)] {
            let err = TcConfig {
                snat_ports: bad,
                ..TcConfig::default()
            }
            .nat_config()
            .unwrap_err();
            assert!(err.to_string().contains("snat_ports"), "{err}");
        }
    }

    #[test]
    fn ipv6_addresses_are_encoded_in_header_order() {
        let w = encode6("2001:db8::1".parse().unwrap());
        let mut bytes = [0u8; 16];
        for (i, x) in w.iter().enumerate() {
            bytes[4 * i..4 * i + 4].copy_from_slice(&x.to_ne_bytes());
        }
        assert_eq!(bytes, "2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
    }

    #[test]
    fn every_counter_has_a_distinct_name() {
        let names: std::collections::BTreeSet<_> =
            TcStat::ALL.iter().map(|s| stat_name(*s)).collect();
        assert_eq!(names.len(), TcStat::ALL.len());
    }
}
