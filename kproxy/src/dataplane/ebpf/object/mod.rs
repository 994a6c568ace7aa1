//! The embedded BPF object and loading it.
//!
//! `build.rs` compiles `kproxy-ebpf` (Debian's rustc-web + bpf-linker, see README) and this
//! module embeds the resulting ELF, completed for the running kernel at each load (the
//! `sk_buff` checksum-state read, located once through the kernel's BTF, `btf`). `load` is
//! the only place it becomes an [`aya::Ebpf`] (maps created or reused from pins, programs not
//! yet loaded). Names and value types come from [`kproxy_common`].

use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use aya::Ebpf;
use aya::maps::MapError;
use aya::programs::ProgramError;

/// The BPF object built by `build.rs` (empty when built with `AYA_BUILD_SKIP=1`).
pub(crate) static OBJECT: &[u8] = aya::include_bytes_aligned!(env!("KPROXY_EBPF_OBJECT"));

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

/// Where this kernel keeps the checksum state the programs read ([`kernel_site`]), decided
/// once per process at the first load.
static SITE: OnceLock<Option<(i32, i16, i32)>> = OnceLock::new();
/// Set by [`use_checksum_helpers_only`].
static HELPERS_ONLY: AtomicBool = AtomicBool::new(false);

/// Makes `load` take the helpers-only fallback of `kproxy_common::skb` even where the
/// kernel supports the read (how the TC path behaves on a kernel without it; for tests).
/// Returns false if the object was already completed, i.e. it is too late.
pub fn use_checksum_helpers_only() -> bool {
    HELPERS_ONLY.store(true, Ordering::SeqCst);
    SITE.get().is_none()
}

/// Whether the TC programs read the packets' checksum state (and update L4 checksums in
/// place), as opposed to the helpers-only fallback.
pub fn reads_checksum_state() -> bool {
    site().is_some()
}

fn site() -> Option<(i32, i16, i32)> {
    *SITE.get_or_init(kernel_site)
}

/// Where this kernel keeps the checksum state the programs read (`None`: helpers only).
fn kernel_site() -> Option<(i32, i16, i32)> {
    if HELPERS_ONLY.load(Ordering::SeqCst) {
        return None;
    }
    match skb_site(Path::new(btf::VMLINUX)) {
        Ok(site) => Some(site),
        Err(reason) => {
            tracing::warn!(
                %reason,
                "the TC programs cannot read the packet's checksum state; they \
                 update L4 checksums with kernel helpers (correct, slower)"
            );
            None
        }
    }
}

/// `object` completed for `site`, in u64 words (the ELF parser wants it 8-byte aligned), and
/// its length in bytes.
fn completed_words(object: &[u8], site: Option<(i32, i16, i32)>) -> (Vec<u64>, usize) {
    let mut bytes = object.to_vec();
    if let Err(e) = complete_object(&mut bytes, site) {
        // Cannot happen with the objects built from this tree (a unit test checks it);
        // loading then fails on the placeholders with the verifier's message.
        tracing::error!(error = %e, "completing the BPF object");
    }
    let mut words = vec![0u64; bytes.len().div_ceil(8)];
    for (w, chunk) in words.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        *w = u64::from_ne_bytes(b);
    }
    (words, bytes.len())
}

/// Where the build left the bench and test tools' object (`kproxy-ebpf/src/bench.rs`: the
/// agent's programs plus the packet counter and the bench floors). The agent never loads it;
/// it exists in the build tree only.
pub(crate) const TOOLS_OBJECT_PATH: &str = env!("KPROXY_EBPF_TOOLS_OBJECT");

/// Loads the bench and test tools' object (`TOOLS_OBJECT_PATH`) like `load` loads the
/// agent's: completed for this kernel, maps created or reused from pins.
pub fn load_tools(options: &LoadOptions<'_>) -> Result<Ebpf, BpfError> {
    let bytes = std::fs::read(TOOLS_OBJECT_PATH).map_err(|_| BpfError::NotBuilt)?;
    if bytes.is_empty() {
        return Err(BpfError::NotBuilt);
    }
    let (words, len) = completed_words(&bytes, kernel_site());
    // SAFETY: `words` holds at least `len` bytes and outlives the borrow.
    let aligned = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) };
    load_bytes(aligned, options)
}

/// The kfunc id and `ip_summed`'s byte offset and shift from the kernel BTF at `vmlinux`.
fn skb_site(vmlinux: &Path) -> Result<(i32, i16, i32), String> {
    use kproxy_common::skb::{KFUNC_CAST_TO_KERN_CTX, SKB_IP_SUMMED, SKB_STRUCT};
    let btf = btf::Btf::read(vmlinux).map_err(|e| e.to_string())?;
    let id = btf
        .func_id(KFUNC_CAST_TO_KERN_CTX)
        .ok_or_else(|| format!("the kernel has no kfunc {KFUNC_CAST_TO_KERN_CTX} (needs ≥ 6.3)"))?;
    let bits = btf
        .member_bits(SKB_STRUCT, SKB_IP_SUMMED)
        .ok_or_else(|| format!("the kernel's struct {SKB_STRUCT} has no {SKB_IP_SUMMED}"))?;
    let shift = bits.bit_offset % 8;
    if bits.bits != 2 || shift + bits.bits > 8 {
        return Err(format!(
            "{SKB_STRUCT}.{SKB_IP_SUMMED} is not a 2-bit field in one byte"
        ));
    }
    let off = i16::try_from(bits.bit_offset / 8).map_err(|_| "offset out of range".to_string())?;
    let id = i32::try_from(id).map_err(|_| "BTF id out of range".to_string())?;
    Ok((id, off, shift as i32))
}

/// Replaces the placeholder instructions of `kproxy_common::skb` in `object` (an ELF whose
/// code sections are 8-byte aligned, as every BPF object's are) by `site`'s (kfunc id,
/// `ip_summed` byte offset, bit shift), or by the helpers-only fallback for `None`. Returns
/// how many reads were completed; every placeholder must belong to a complete read.
pub(crate) fn complete_object(
    object: &mut [u8],
    site: Option<(i32, i16, i32)>,
) -> Result<usize, String> {
    use kproxy_common::skb::{CALL_PLACEHOLDER, LOAD_PLACEHOLDER, SHIFT_PLACEHOLDER, completed};
    let placeholders = [CALL_PLACEHOLDER, LOAD_PLACEHOLDER, SHIFT_PLACEHOLDER];
    let with = completed(site);
    let mut counts = [0usize; 3];
    for chunk in object.chunks_exact_mut(8) {
        let insn = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        if let Some(i) = placeholders.iter().position(|&p| p == insn) {
            chunk.copy_from_slice(&with[i].to_le_bytes());
            counts[i] += 1;
        }
    }
    if counts[0] != counts[1] || counts[1] != counts[2] {
        return Err(format!(
            "unmatched ip_summed placeholders in the BPF object (call/load/shift: {counts:?})"
        ));
    }
    Ok(counts[0])
}

/// Whether this binary carries a real BPF object (false when built with `AYA_BUILD_SKIP=1`).
pub(crate) fn is_built() -> bool {
    !OBJECT.is_empty()
}

/// An error with its sources: aya's errors hide the errno in `source()`, so a message without
/// them does not say why the kernel refused.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// How `load` creates the object's maps.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions<'a> {
    /// The directory (on a bpffs) of the object's pinned maps: maps pinned there are reused,
    /// the others created and pinned. `None`: every map is created for this instance only
    /// (the pinned ones under `/sys/fs/bpf`, which must then be a mounted bpffs).
    pub pin_dir: Option<&'a Path>,
    /// `max_entries` of maps this load creates (a reused pinned map keeps its size).
    pub max_entries: Vec<(&'static str, u32)>,
}

/// The one place the embedded object is loaded: parses the completed object and creates
/// (or reuses) its maps in the kernel; programs are loaded by their users. Needs CAP_BPF (root).
/// The socket-LB datapath, the node path, mode detection and the tests' tools all come here.
///
/// The object is completed ([`OBJECT`] with its `struct sk_buff` reads completed for the
/// running kernel, `kproxy_common::skb`; [`complete_object`]) for each load and dropped after
/// it: an agent loads twice (service maps, node path), and a copy kept for the process's life
/// would hold 1.5 MB for nothing.
pub(crate) fn load(options: &LoadOptions<'_>) -> Result<Ebpf, BpfError> {
    if !is_built() {
        return load_bytes(&[], options);
    }
    let (words, len) = completed_words(OBJECT, site());
    // SAFETY: `words` holds at least `len` bytes and outlives the borrow.
    let aligned = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) };
    load_bytes(aligned, options)
}

fn load_bytes(object: &[u8], options: &LoadOptions<'_>) -> Result<Ebpf, BpfError> {
    if object.is_empty() {
        return Err(BpfError::NotBuilt);
    }
    let mut loader = aya::EbpfLoader::new();
    if let Some(dir) = options.pin_dir {
        loader.default_map_pin_directory(dir);
    }
    for (name, entries) in &options.max_entries {
        loader.map_max_entries(name, *entries);
    }
    Ok(loader.load(object)?)
}

pub(crate) mod btf;

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_common::counter::{COUNTER_SLOTS, MAP_PACKET_COUNT, PROGRAMS, PacketCount};

    const EM_BPF: u16 = 247;

    /// Every `ip_summed` read of the built object is completed, for a kernel site and for the
    /// fallback, and no placeholder is left.
    #[test]
    fn object_reads_are_completed() {
        use kproxy_common::skb::{CALL_PLACEHOLDER, LOAD_PLACEHOLDER, SHIFT_PLACEHOLDER};
        if !is_built() {
            eprintln!("skipped: built with AYA_BUILD_SKIP=1, there is no BPF object to inspect");
            return;
        }
        let left = |o: &[u8]| {
            o.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .filter(|i| [CALL_PLACEHOLDER, LOAD_PLACEHOLDER, SHIFT_PLACEHOLDER].contains(i))
                .count()
        };
        assert!(left(OBJECT) > 0, "the object reads ip_summed somewhere");
        for site in [Some((1234, 128, 5)), None] {
            let mut o = OBJECT.to_vec();
            let n = complete_object(&mut o, site).unwrap();
            assert_eq!(n * 3, left(OBJECT), "{site:?}");
            assert_eq!(left(&o), 0, "{site:?}");
        }
        let mut broken = OBJECT.to_vec();
        let at = broken
            .chunks_exact(8)
            .position(|c| u64::from_le_bytes(c.try_into().unwrap()) == LOAD_PLACEHOLDER)
            .unwrap();
        broken[at * 8..at * 8 + 8].copy_from_slice(&0u64.to_le_bytes());
        assert!(complete_object(&mut broken, None).is_err());
    }

    #[test]
    fn an_empty_object_is_reported_as_not_built() {
        let err = load_bytes(&[], &LoadOptions::default()).unwrap_err();
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
        let programs = [
            &kproxy_common::sock::PROGRAMS[..],
            &kproxy_common::ct::PROGRAMS,
            &kproxy_common::ct6::PROGRAMS,
        ];
        for name in programs.concat() {
            assert!(
                obj.programs.contains_key(name),
                "no program {name}: {:?}",
                obj.programs.keys()
            );
        }
        let maps = [
            &kproxy_common::service::MAPS[..],
            &kproxy_common::ct::MAPS,
            &kproxy_common::ct6::MAPS,
        ];
        for name in maps.concat() {
            assert!(
                obj.maps.contains_key(name),
                "no map {name}: {:?}",
                obj.maps.keys()
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
    }

    /// The bench and test tools (packet counter, floors) are in the tools' object and not in
    /// the agent's.
    #[test]
    fn tools_live_in_their_own_object() {
        if !is_built() {
            eprintln!("skipped: built with AYA_BUILD_SKIP=1, there is no BPF object to inspect");
            return;
        }
        let agent = aya_obj::Object::parse(OBJECT).expect("the embedded object parses");
        let bytes = std::fs::read(TOOLS_OBJECT_PATH).expect("the tools' object is built");
        let tools = aya_obj::Object::parse(&bytes).expect("the tools' object parses");
        let tool_programs = [&PROGRAMS[..], &kproxy_common::counter::FLOOR_PROGRAMS].concat();
        for name in &tool_programs {
            assert!(tools.programs.contains_key(*name), "tools lack {name}");
            assert!(
                !agent.programs.contains_key(*name),
                "the agent carries {name}"
            );
        }
        for name in [MAP_PACKET_COUNT, kproxy_common::counter::MAP_FLOOR_CT] {
            assert!(tools.maps.contains_key(name), "tools lack {name}");
            assert!(!agent.maps.contains_key(name), "the agent carries {name}");
        }
        // Every program of the agent is in the tools' object too (the floors measure them).
        for name in agent.programs.keys() {
            assert!(tools.programs.contains_key(name), "tools lack {name}");
        }
        let map = &tools.maps[MAP_PACKET_COUNT];
        assert_eq!(map.max_entries(), COUNTER_SLOTS);
        assert_eq!(map.value_size() as usize, size_of::<PacketCount>());
    }
}
