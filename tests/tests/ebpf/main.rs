//! The eBPF datapath on this kernel: socket LB, the TC service path, XDP, Maglev, map layout
//! migration, the packet counter. One test binary for these files (see tests/README.md).

mod bpf_counter;
mod ebpf_layout;
mod ebpf_maglev;
mod ebpf_routed;
mod ebpf_sock;
mod ebpf_sock_destroy;
mod ebpf_tc;
mod ebpf_tc6;
mod ebpf_tc6_testrun;
mod ebpf_tc_helpers;
mod ebpf_tc_testrun;
mod ebpf_xdp_fastpath;
