//! Types shared by the kproxy BPF programs and the agent. Placeholder.
#![no_std]
