//! The frontend filter: a bit array in front of [`MAP_SERVICES`](crate::service::MAP_SERVICES)
//! that lets the node-device programs (TC, XDP) skip hash lookups that would miss.
//!
//! A packet arriving on a node device may be for a frontend in either scope: an
//! external-scope entry (NodePort, ExternalIP, LoadBalancer IP, whose new flows use it) or a
//! cluster-scope one (a ClusterIP reached from outside the node). Without the filter, telling
//! them apart cost one or two hash lookups per packet that is not an established flow, most of
//! which miss (ordinary traffic to the node and its pods). With it, each scope gets a one-bit
//! answer first, from an array read the verifier inlines:
//!
//! - **bit set: no frontend of that scope is at this (address, port, protocol)** — the lookup
//!   is skipped;
//! - bit clear: maybe one is (a Bloom filter with one hash function: false positives cost the
//!   lookup they would have cost anyway, never a wrong answer).
//!
//! The bits say "absent" rather than "present" so that an array nobody has written yet (all
//! zero: a map created by this build before its first sync, e.g. after an upgrade) means
//! "maybe everywhere", i.e. the programs do every lookup as if there were no filter.
//!
//! Both scopes share one array; the scope is part of the hashed key ([`filter_slot`]). The
//! agent (`kproxy::dataplane::ebpf::filter`) keeps, per bit, how many frontends hash to it,
//! clears a bit before the first frontend that hashes to it is written and sets it again after
//! the last one is deleted, so a written frontend is never hidden.
//!
//! Size: [`FILTER_WORDS`] × 64 = 2 Mi bits (256 KiB). With `n` frontends in the map, a packet
//! that is for no frontend still does a lookup with probability ≈ `n / 2 Mi` per scope (a
//! cluster with 10k services of two ports and ExternalIPs has ≈ 40k entries: 2 %).

/// `Array<u64>` of [`FILTER_WORDS`] words: the frontend filter (see the module docs).
pub const MAP_FRONTEND_FILTER: &str = "KP_FE_FILTER";

/// `map_flags` of [`MAP_FRONTEND_FILTER`]: the agent writes words through a shared mapping.
pub const FILTER_MAP_FLAGS: u32 = crate::BPF_F_MMAPABLE;

/// Words of [`MAP_FRONTEND_FILTER`] (a power of two). Changing it, or [`filter_slot`], changes
/// what the pinned words mean: bump the map's layout version (`crate::layout`), so a pin of
/// the old meaning is replaced, never read by programs of the new one.
pub const FILTER_WORDS: u32 = 1 << 15;

/// A word with every bit saying "absent": what the agent writes where no frontend hashes.
pub const ALL_ABSENT: u64 = u64::MAX;

/// The word index and bit mask of a frontend key in [`MAP_FRONTEND_FILTER`]: the fields of a
/// [`ServiceKey`](crate::service::ServiceKey) (address in its 16-byte form, port in network
/// order, protocol, scope) through a multiply-xorshift hash (the finaliser of MurmurHash3),
/// cheap in BPF (no loops, no helpers) and well spread for addresses that differ only in
/// their last bytes.
#[inline(always)]
pub const fn filter_slot(addr: &[u32; 4], port: u16, proto: u8, scope: u8) -> (u32, u64) {
    let a = (addr[0] as u64) | ((addr[1] as u64) << 32);
    let b = (addr[2] as u64) | ((addr[3] as u64) << 32);
    let c = (port as u64) | ((proto as u64) << 16) | ((scope as u64) << 24);
    let mut h = a.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ c.wrapping_mul(0x1656_67b1_9e37_79f9);
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    (((h >> 6) as u32) & (FILTER_WORDS - 1), 1u64 << (h & 63))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frontends that differ in one field land on different bits (a spread check, not a
    /// proof: 4096 ClusterIPs × 2 ports × 2 scopes over 2 Mi bits should nearly never share).
    #[test]
    fn nearby_keys_spread() {
        let mut seen = [0u64; FILTER_WORDS as usize];
        let mut collisions = 0;
        let mut n = 0;
        for i in 0u32..4096 {
            let addr = [
                0,
                0,
                u32::from_ne_bytes([0, 0, 0xff, 0xff]),
                (0x0a60_0000 + i).to_be(),
            ];
            for port in [80u16.to_be(), 443u16.to_be()] {
                for scope in 0..2 {
                    let (w, m) = filter_slot(&addr, port, 6, scope);
                    assert!(w < FILTER_WORDS);
                    assert_eq!(m.count_ones(), 1);
                    if seen[w as usize] & m != 0 {
                        collisions += 1;
                    }
                    seen[w as usize] |= m;
                    n += 1;
                }
            }
        }
        // Expected ≈ n²/(2·2Mi) ≈ 64 for uniform hashing.
        assert_eq!(n, 16384);
        assert!(collisions < 200, "{collisions} collisions among {n} keys");
    }
}
