//! The eBPF datapath on this kernel: socket LB, the TC service path, XDP, Maglev, map layout
//! migration, the packet counter. One test binary for these files (see tests/README.md).
//!
//! Not here: `ebpf_tc_helpers` switches the process to helper-only checksums
//! (`kproxy::dataplane::ebpf::object::use_checksum_helpers_only`, once per process, before the first load), which
//! would change what every other test here runs; it is its own binary,
//! tests/tests/ebpf_tc_helpers.rs.

mod bpf_counter;
mod ebpf_ct_expiry;
mod ebpf_layout;
mod ebpf_maglev;
mod ebpf_routed;
mod ebpf_sock;
mod ebpf_sock_destroy;
mod ebpf_tc;
mod ebpf_tc6;
mod ebpf_tc6_testrun;
mod ebpf_tc_testrun;
mod ebpf_xdp_fastpath;
