//! Types and names shared by the kproxy BPF programs (`kproxy-ebpf`, built for
//! `bpfel-unknown-none`) and the agent (`kproxy`, feature `user`).
//!
//! Everything a map key/value or a program/map name means is defined here once. Map values are
//! `#[repr(C)]`, `Copy` and free of padding the two sides could disagree on; the `user` feature
//! implements `aya::Pod` for them so the agent can read and write the maps.
//!
//! Attribute macros on the BPF side (`#[map]`, `#[xdp]`, `#[classifier]`) only take literals, so
//! the BPF crate repeats each name once as an identifier; the agent's unit test
//! `bpf::tests::object_has_every_shared_name` parses the built object and fails if any name here
//! is missing from it.
#![no_std]

pub mod counter;
pub mod ct;
