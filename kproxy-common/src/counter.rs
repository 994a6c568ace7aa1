//! The per-CPU packet counter: the smallest real BPF program kproxy ships. It counts every
//! packet (and its bytes) seen at one hook into one slot of a per-CPU array. It serves as the
//! end-to-end check of the BPF build/load/attach path and as the counter-only baseline of
//! `cargo xtask bench`.

/// Name of the `PerCpuArray<PacketCount>` map, indexed by [`CounterSlot`].
pub const MAP_PACKET_COUNT: &str = "KP_PKT_COUNT";

/// XDP program counting into [`CounterSlot::Xdp`].
pub const PROG_COUNT_XDP: &str = "kp_count_xdp";
/// TC classifier counting into [`CounterSlot::TcIngress`] (attach at ingress).
pub const PROG_COUNT_TC_INGRESS: &str = "kp_count_tc_in";
/// TC classifier counting into [`CounterSlot::TcEgress`] (attach at egress).
pub const PROG_COUNT_TC_EGRESS: &str = "kp_count_tc_eg";

/// Every program name in the counter object, for checks that the object holds them all.
pub const PROGRAMS: [&str; 3] = [PROG_COUNT_XDP, PROG_COUNT_TC_INGRESS, PROG_COUNT_TC_EGRESS];

/// Which hook a count came from: the index into [`MAP_PACKET_COUNT`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CounterSlot {
    Xdp = 0,
    TcIngress = 1,
    TcEgress = 2,
}

impl CounterSlot {
    /// All slots, in index order.
    pub const ALL: [CounterSlot; 3] = [
        CounterSlot::Xdp,
        CounterSlot::TcIngress,
        CounterSlot::TcEgress,
    ];

    /// The map index of this slot.
    pub const fn index(self) -> u32 {
        self as u32
    }

    /// The program that counts into this slot.
    pub const fn program(self) -> &'static str {
        match self {
            CounterSlot::Xdp => PROG_COUNT_XDP,
            CounterSlot::TcIngress => PROG_COUNT_TC_INGRESS,
            CounterSlot::TcEgress => PROG_COUNT_TC_EGRESS,
        }
    }
}

/// Number of entries of [`MAP_PACKET_COUNT`].
pub const COUNTER_SLOTS: u32 = CounterSlot::ALL.len() as u32;

/// One CPU's count at one hook.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PacketCount {
    pub packets: u64,
    /// Bytes from the start of the L2 header (XDP: `data_end - data`; TC: `skb->len`).
    pub bytes: u64,
}

impl PacketCount {
    /// Component-wise sum, saturating (used to fold per-CPU values).
    pub const fn saturating_add(self, other: PacketCount) -> PacketCount {
        PacketCount {
            packets: self.packets.saturating_add(other.packets),
            bytes: self.bytes.saturating_add(other.bytes),
        }
    }
}

// SAFETY: `PacketCount` is `#[repr(C)]`, `Copy`, has no padding (two u64) and every bit
// pattern is a valid value.
#[cfg(feature = "user")]
unsafe impl aya::Pod for PacketCount {}

/// Floor programs of the bench (`kproxy-ebpf/src/floor.rs`): what any connection-tracking
/// datapath pays per packet, measured beside the TC service path. TC classifier: parses the
/// IPv4 packet and looks its flow up in [`MAP_FLOOR_CT`] (the `Service` key of the TC path);
/// returns `TC_ACT_OK` (0) on a hit, `TC_ACT_UNSPEC` (-1) otherwise.
pub const PROG_FLOOR_CT_LOOKUP: &str = "kp_floor_ct_lookup";
/// TC classifier: parses the IPv4 packet and inserts its flow's two entries (the `Service` and
/// the reversed `RevDnat` key, as a new TC flow does) into [`MAP_FLOOR_CT`]; `TC_ACT_OK` when
/// both were inserted.
pub const PROG_FLOOR_CT_INSERT: &str = "kp_floor_ct_insert";
/// TC classifier: parses the IPv4 packet, looks its flow up in [`MAP_FLOOR_CT`] (it must be
/// missing), reads its destination's external-scope frontend entry from the pinned
/// `KP_SERVICES` (it must exist) and inserts the flow's two entries as
/// [`PROG_FLOOR_CT_INSERT`] does; `TC_ACT_OK` when all went so. The least any new flow costs:
/// the lookup that finds it new, one frontend read (as if the frontend entry held the chosen
/// backend itself) and the flow's record.
pub const PROG_FLOOR_NEW_FLOW: &str = "kp_floor_new_flow";
/// LRU hash `CtKey` → `CtEntry`, private to each loaded object (not pinned). The object
/// declares it with [`FLOOR_CT_OBJECT_ENTRIES`] so that the agent's loads of the object do
/// not allocate a connection table's worth of kernel memory for it; the bench gives it the
/// connection table's size when it loads the object for the floors.
pub const MAP_FLOOR_CT: &str = "KP_FLOOR_CT";
/// The size [`MAP_FLOOR_CT`] is declared with.
pub const FLOOR_CT_OBJECT_ENTRIES: u32 = 64;
/// The floor programs.
pub const FLOOR_PROGRAMS: [&str; 3] = [
    PROG_FLOOR_CT_LOOKUP,
    PROG_FLOOR_CT_INSERT,
    PROG_FLOOR_NEW_FLOW,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_index_the_map_densely_and_name_their_program() {
        for (i, slot) in CounterSlot::ALL.iter().enumerate() {
            assert_eq!(slot.index() as usize, i);
            assert_eq!(slot.program(), PROGRAMS[i]);
        }
        assert_eq!(COUNTER_SLOTS, 3);
    }

    #[test]
    fn names_fit_the_kernel_object_name_limit() {
        // BPF_OBJ_NAME_LEN is 16 including the NUL; longer names are truncated by the loader and
        // then no longer match what `bpftool prog show` lists.
        for name in PROGRAMS.iter().chain([MAP_PACKET_COUNT].iter()) {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
        }
    }

    #[test]
    fn packet_count_has_no_padding() {
        assert_eq!(core::mem::size_of::<PacketCount>(), 16);
    }

    #[test]
    fn saturating_add_sums_and_saturates() {
        let a = PacketCount {
            packets: 2,
            bytes: 100,
        };
        let b = PacketCount {
            packets: 3,
            bytes: u64::MAX,
        };
        assert_eq!(
            a.saturating_add(b),
            PacketCount {
                packets: 5,
                bytes: u64::MAX
            }
        );
    }
}
