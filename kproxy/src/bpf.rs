//! The embedded BPF object and loading it.
//!
//! `build.rs` compiles `kproxy-ebpf` (Debian's rustc-web + bpf-linker, see README) and this
//! module embeds the resulting ELF. [`load`] turns it into an [`aya::Ebpf`] (maps created,
//! programs not yet loaded); [`PacketCounter`] is the first user: the per-CPU packet counter
//! attached to an interface. Names and value types come from [`kproxy_common`].
//!
//! Attaching resolves the interface in the calling thread's network namespace (tests switch a
//! dedicated thread with `setns`); the links live as long as the owning [`aya::Ebpf`].

use aya::Ebpf;
use aya::maps::{MapError, PerCpuArray};
use aya::programs::{ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode};

pub use kproxy_common::counter::{
    COUNTER_SLOTS, CounterSlot, MAP_PACKET_COUNT, PROGRAMS, PacketCount,
};

/// The BPF object built by `build.rs` (empty when built with `AYA_BUILD_SKIP=1`).
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("KPROXY_EBPF_OBJECT"));

/// Errors of loading and attaching kproxy's BPF programs.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error(
        "kproxy was built without its BPF object (AYA_BUILD_SKIP=1, the embedded object is \
         empty): rebuild without AYA_BUILD_SKIP (`cargo xtask setup` installs the BPF toolchain)"
    )]
    NotBuilt,
    #[error("loading the BPF object into the kernel: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("the BPF object has no program {name:?}")]
    MissingProgram { name: &'static str },
    #[error("the BPF object has no map {name:?}")]
    MissingMap { name: &'static str },
    #[error("BPF program {name:?}: {error}")]
    Program {
        name: &'static str,
        error: ProgramError,
    },
    #[error("BPF map {name:?}: {error}")]
    Map { name: &'static str, error: MapError },
    #[error("attaching BPF program {name:?} to interface {interface:?}: {error}")]
    Attach {
        name: &'static str,
        interface: String,
        error: ProgramError,
    },
}

/// Whether this binary carries a real BPF object (false when built with `AYA_BUILD_SKIP=1`).
pub fn is_built() -> bool {
    !OBJECT.is_empty()
}

/// Parses the embedded object and creates its maps in the kernel (programs are loaded by their
/// users). Needs CAP_BPF (root). The object's pinned maps (service maps, conntrack) go to
/// `/sys/fs/bpf`, which must be a mounted bpffs; see [`load_with_pins`].
pub fn load() -> Result<Ebpf, BpfError> {
    load_object(OBJECT)
}

/// Like [`load`], with the object's pinned maps in `map_pin_dir` (a directory on a bpffs; maps
/// already pinned there are reused).
pub fn load_with_pins(map_pin_dir: &std::path::Path) -> Result<Ebpf, BpfError> {
    if OBJECT.is_empty() {
        return Err(BpfError::NotBuilt);
    }
    Ok(aya::EbpfLoader::new()
        .default_map_pin_directory(map_pin_dir)
        .load(OBJECT)?)
}

fn load_object(object: &[u8]) -> Result<Ebpf, BpfError> {
    if object.is_empty() {
        return Err(BpfError::NotBuilt);
    }
    Ok(Ebpf::load(object)?)
}

/// The per-CPU packet counter (`kproxy_common::counter`): attach it to interfaces at XDP, TC
/// ingress or TC egress and read what it counted. Dropping it detaches everything.
pub struct PacketCounter {
    ebpf: Ebpf,
}

impl PacketCounter {
    /// Loads the object and the three counter programs into the kernel.
    pub fn load() -> Result<Self, BpfError> {
        Self::from_ebpf(load()?)
    }

    /// Like [`PacketCounter::load`], with the object's pinned maps in `map_pin_dir` (see
    /// [`load_with_pins`]).
    pub fn load_with_pins(map_pin_dir: &std::path::Path) -> Result<Self, BpfError> {
        Self::from_ebpf(load_with_pins(map_pin_dir)?)
    }

    /// Uses an already loaded object (e.g. one with pinning options); loads the programs.
    pub fn from_ebpf(mut ebpf: Ebpf) -> Result<Self, BpfError> {
        if ebpf.map(MAP_PACKET_COUNT).is_none() {
            return Err(BpfError::MissingMap {
                name: MAP_PACKET_COUNT,
            });
        }
        for slot in CounterSlot::ALL {
            let name = slot.program();
            let program = ebpf
                .program_mut(name)
                .ok_or(BpfError::MissingProgram { name })?;
            let loaded = match slot {
                CounterSlot::Xdp => <&mut Xdp>::try_from(program).and_then(|p| p.load()),
                CounterSlot::TcIngress | CounterSlot::TcEgress => {
                    <&mut SchedClassifier>::try_from(program).and_then(|p| p.load())
                }
            };
            loaded.map_err(|error| BpfError::Program { name, error })?;
        }
        Ok(PacketCounter { ebpf })
    }

    /// Attaches the program of `slot` to `interface` (in the calling thread's network
    /// namespace): XDP in the driver's default mode, TC through TCX on kernels >= 6.6.
    pub fn attach(&mut self, interface: &str, slot: CounterSlot) -> Result<(), BpfError> {
        let name = slot.program();
        let program = self
            .ebpf
            .program_mut(name)
            .ok_or(BpfError::MissingProgram { name })?;
        let attach_error = |error| BpfError::Attach {
            name,
            interface: interface.to_string(),
            error,
        };
        match slot {
            CounterSlot::Xdp => {
                let xdp = <&mut Xdp>::try_from(program).map_err(attach_error)?;
                xdp.attach(interface, XdpMode::Default)
                    .map_err(attach_error)?;
            }
            CounterSlot::TcIngress | CounterSlot::TcEgress => {
                let tc = <&mut SchedClassifier>::try_from(program).map_err(attach_error)?;
                let point = if slot == CounterSlot::TcIngress {
                    TcAttachType::Ingress
                } else {
                    TcAttachType::Egress
                };
                tc.attach(interface, point).map_err(attach_error)?;
            }
        }
        Ok(())
    }

    /// What `slot` counted so far, summed over all CPUs (and over every interface it is
    /// attached to).
    pub fn count(&self, slot: CounterSlot) -> Result<PacketCount, BpfError> {
        let name = MAP_PACKET_COUNT;
        let map = self.ebpf.map(name).ok_or(BpfError::MissingMap { name })?;
        let array = PerCpuArray::<_, PacketCount>::try_from(map)
            .map_err(|error| BpfError::Map { name, error })?;
        let per_cpu = array
            .get(&slot.index(), 0)
            .map_err(|error| BpfError::Map { name, error })?;
        Ok(per_cpu
            .iter()
            .fold(PacketCount::default(), |sum, c| sum.saturating_add(*c)))
    }

    /// The sum over every slot.
    pub fn total(&self) -> Result<PacketCount, BpfError> {
        CounterSlot::ALL
            .into_iter()
            .try_fold(PacketCount::default(), |sum, slot| {
                Ok(sum.saturating_add(self.count(slot)?))
            })
    }

    /// The underlying object, e.g. for `BPF_PROG_TEST_RUN` on [`CounterSlot::program`].
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EM_BPF: u16 = 247;

    #[test]
    fn an_empty_object_is_reported_as_not_built() {
        let err = load_object(&[]).unwrap_err();
        assert!(matches!(err, BpfError::NotBuilt), "{err:?}");
        assert!(err.to_string().contains("AYA_BUILD_SKIP"), "{err}");
    }

    /// The names in `kproxy-common` are repeated as identifiers in `kproxy-ebpf` (attribute
    /// macros take no constants); this catches any drift without needing root.
    #[test]
    fn object_has_every_shared_name() {
        if !is_built() {
            eprintln!("skipped: built with AYA_BUILD_SKIP=1, there is no BPF object to inspect");
            return;
        }
        assert_eq!(&OBJECT[..4], b"\x7fELF");
        assert_eq!(
            u16::from_le_bytes([OBJECT[18], OBJECT[19]]),
            EM_BPF,
            "e_machine is not BPF"
        );
        let obj = aya_obj::Object::parse(OBJECT).expect("the embedded object parses");
        assert!(
            obj.maps.contains_key(MAP_PACKET_COUNT),
            "maps: {:?}",
            obj.maps.keys()
        );
        for name in PROGRAMS {
            assert!(
                obj.programs.contains_key(name),
                "no program {name}: {:?}",
                obj.programs.keys()
            );
        }
        for name in kproxy_common::service::MAPS {
            assert!(
                obj.maps.contains_key(name),
                "no map {name}: {:?}",
                obj.maps.keys()
            );
        }
        for name in kproxy_common::sock::PROGRAMS {
            assert!(
                obj.programs.contains_key(name),
                "no program {name}: {:?}",
                obj.programs.keys()
            );
        }
        for name in kproxy_common::ct::MAPS {
            assert!(
                obj.maps.contains_key(name),
                "no map {name}: {:?}",
                obj.maps.keys()
            );
        }
        for name in kproxy_common::ct6::MAPS {
            assert!(
                obj.maps.contains_key(name),
                "no map {name}: {:?}",
                obj.maps.keys()
            );
        }
        for name in kproxy_common::ct6::PROGRAMS {
            assert!(
                obj.programs.contains_key(name),
                "no program {name}: {:?}",
                obj.programs.keys()
            );
        }
        for name in kproxy_common::ct::PROGRAMS {
            assert!(
                obj.programs.contains_key(name),
                "no program {name}: {:?}",
                obj.programs.keys()
            );
        }
        let ct = &obj.maps[kproxy_common::ct::MAP_CT];
        assert_eq!(
            ct.key_size() as usize,
            size_of::<kproxy_common::ct::CtKey>()
        );
        assert_eq!(
            ct.value_size() as usize,
            size_of::<kproxy_common::ct::CtEntry>()
        );
        let map = &obj.maps[MAP_PACKET_COUNT];
        assert_eq!(map.max_entries(), COUNTER_SLOTS);
        assert_eq!(map.value_size() as usize, size_of::<PacketCount>());
    }
}
