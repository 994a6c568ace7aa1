//! Maglev consistent hashing (`--bpf-lb-algorithm maglev`): the lookup tables the agent builds
//! per endpoint set and the TC programs read, and the flow hash both sides use.
//!
//! # Layout
//!
//! | map | kind | written by | read by |
//! |---|---|---|---|
//! | [`MAP_MAGLEV`] | array of `[u32; 2]` (`BPF_F_MMAPABLE`) | agent (mmap) | TC |
//! | [`MAP_MAGLEV_REF`] | hash `svc_id` → [`MaglevRef`] | agent | TC |
//!
//! Every table of the node lives in one big array of backend ids
//! (`kproxy_common::service::MAP_BACKENDS` keys): table `t` is ids `t·M .. t·M + M` (`M` = the
//! table size, a prime, `--bpf-lb-maglev-table-size`). [`MAP_MAGLEV_REF`] says where the table
//! of a set (`svc_id`) starts and how long it is. The kernel rounds array elements up to 8
//! bytes, so each element packs [`IDS_PER_ELEM`] ids: id `e` is half `e & 1` of element
//! `e >> 1`, and the mmapped array reads as a flat `u32` array. Its `max_entries` is
//! `⌈tables × M / 2⌉`, set by the agent at load time (the compiled default is one element:
//! random mode needs no table).
//!
//! Why one array rather than a map of maps (Cilium's `HASH_OF_MAPS` with one inner array per
//! service): aya-ebpf 0.2 declares maps of maps only as BTF maps, which this object does not
//! use, and an array can be `mmap`ed by the agent, so a table is rebuilt with memory writes
//! instead of `M` syscalls (16381 per table at the default size). The cost is that the
//! capacity (`--bpf-map-sizes maglev=N` tables) is preallocated: `N × M × 4` bytes.
//!
//! Only the TC path reads the tables (north-south traffic, as in Cilium); socket LB picks a
//! random slot per connect (no 5-tuple exists yet at connect time). IPv4 only, like the TC
//! path.
//!
//! # Lookup (TC, new flows of a frontend with [`crate::service::SVC_F_MAGLEV`])
//!
//! `r = MAP_MAGLEV_REF[svc_id]`, `h = `[`flow_hash`]`(5-tuple)`, `e = r.base + h % r.size`,
//! backend id = `MAP_MAGLEV[e >> 1][e & 1]`. A missing ref or entry 0 falls back to the random slot
//! (never happens once the agent has programmed the set: it writes the table and its ref
//! before the frontend that carries the flag, see `kproxy::dataplane::ebpf::applier`).

/// `Array<[u32; 2]>`: every Maglev table, back to back.
pub const MAP_MAGLEV: &str = "KP_MAGLEV";
/// `HashMap<u32, MaglevRef>`: set id → where its table is.
pub const MAP_MAGLEV_REF: &str = "KP_MAGLEV_REF";

/// `map_flags` of [`MAP_MAGLEV`]: `BPF_F_MMAPABLE`, so the agent writes tables through a
/// shared mapping (kernel ≥ 5.5).
pub const MAGLEV_MAP_FLAGS: u32 = crate::BPF_F_MMAPABLE;

/// Backend ids per [`MAP_MAGLEV`] element (`[u32; 2]`: array elements are 8-byte aligned).
pub const IDS_PER_ELEM: u32 = 2;

/// `max_entries` of [`MAP_MAGLEV`] holding `ids` backend ids.
pub const fn maglev_elems(ids: u32) -> u32 {
    ids.div_ceil(IDS_PER_ELEM)
}

/// Compiled `max_entries` of [`MAP_MAGLEV`] (random mode: no table). The agent sets
/// `tables × M` in maglev mode.
pub const DEFAULT_MAGLEV_ENTRIES: u32 = 1;
/// Default number of tables (sets with external frontends) in maglev mode
/// (`--bpf-map-sizes maglev=N`).
pub const DEFAULT_MAGLEV_TABLES: u32 = 256;
/// `max_entries` of [`MAP_MAGLEV_REF`] (the agent sets it to the table count).
pub const DEFAULT_MAGLEV_REF_MAX: u32 = DEFAULT_MAGLEV_TABLES;

/// Default table size `M` (Cilium's default; a prime).
pub const DEFAULT_TABLE_SIZE: u32 = 16_381;
/// Smallest accepted `M`.
pub const MIN_TABLE_SIZE: u32 = 251;
/// Largest accepted `M` (Cilium's largest; 512 KiB per table).
pub const MAX_TABLE_SIZE: u32 = 131_071;

/// Value of [`MAP_MAGLEV_REF`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MaglevRef {
    /// Index of the table's first entry in [`MAP_MAGLEV`].
    pub base: u32,
    /// `M`, the table's length (never 0).
    pub size: u32,
}

// SAFETY: `#[repr(C)]`, two `u32`, no padding.
#[cfg(feature = "user")]
unsafe impl aya::Pod for MaglevRef {}

const C1: u32 = 0xcc9e_2d51;
const C2: u32 = 0x1b87_3593;
/// Fixed seed: every node maps a flow to the same table entry (the tables are the same on
/// every node for the same backends, so ECMP may spread one flow's packets over nodes).
const SEED: u32 = 0x6b70_726f; // "kpro"

#[inline(always)]
const fn mix(h: u32, k: u32) -> u32 {
    let k = k.wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

/// The flow hash of an IPv4 5-tuple (addresses and ports in network order, as in the
/// packet): MurmurHash3 (x86_32) of the four words `saddr, daddr, sport<<16|dport, proto`
/// with a fixed seed. Used by the TC program to pick the table entry and by the agent's tests
/// to predict it.
#[inline(always)]
pub const fn flow_hash(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> u32 {
    let mut h = SEED;
    h = mix(h, saddr);
    h = mix(h, daddr);
    h = mix(h, ((sport as u32) << 16) | dport as u32);
    h = mix(h, proto as u32);
    h ^= 16;
    // fmix32
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// Whether `n` is prime (table sizes).
pub const fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    if n.is_multiple_of(2) {
        return n == 2;
    }
    let mut d = 3u32;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ref_has_no_padding_and_names_fit() {
        assert_eq!(core::mem::size_of::<MaglevRef>(), 8);
        assert!(MAP_MAGLEV.len() <= 15 && MAP_MAGLEV_REF.len() <= 15);
    }

    #[test]
    fn flow_hash_depends_on_every_field() {
        let base = flow_hash(1, 2, 3, 4, 6);
        assert_ne!(base, flow_hash(9, 2, 3, 4, 6));
        assert_ne!(base, flow_hash(1, 9, 3, 4, 6));
        assert_ne!(base, flow_hash(1, 2, 9, 4, 6));
        assert_ne!(base, flow_hash(1, 2, 3, 9, 6));
        assert_ne!(base, flow_hash(1, 2, 3, 4, 17));
        // Ports are not interchangeable.
        assert_ne!(flow_hash(1, 2, 3, 4, 6), flow_hash(1, 2, 4, 3, 6));
    }

    #[test]
    fn flow_hash_spreads_sequential_ports() {
        // 2 clients × 65,536 consecutive source ports over 7 buckets: each within 2% of the mean.
        let mut buckets = [0u32; 7];
        for saddr in [0x0a00_0001u32, 0x0a00_0003] {
            for port in 0..=u16::MAX {
                buckets[(flow_hash(saddr, 0x0a00_0002, port, 80, 6) % 7) as usize] += 1;
            }
        }
        let mean = 2 * 65_536 / 7;
        for b in buckets {
            assert!(b.abs_diff(mean) < mean * 2 / 100, "{buckets:?}");
        }
    }
}
