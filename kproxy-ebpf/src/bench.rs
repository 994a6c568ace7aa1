//! The bench and test tools' BPF object: every program of the agent's object (`main.rs`) plus
//! the per-CPU packet counter (`counter`, the baseline) and the bench floors (`floor`). Built
//! beside the agent's object by `kproxy/build.rs`; loaded only by tests and `kp-bench`
//! (`kproxy::dataplane::ebpf::object::load_tools`), never embedded in the agent.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

include!("programs.rs");
mod counter;
mod floor;

/// Host stub: this crate is only meaningful as a BPF object.
#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("kproxy-ebpf-bench is a BPF object, not a host program");
    std::process::exit(2);
}
