//! The composition root (upstream's `cmd/kube-proxy/app`): everything that knows more than one
//! layer. It turns a [`crate::config::ProxyConfig`] into a running agent: sources, tracker,
//! sync runner, one [`crate::dataplane::Dataplane`], the observers.
//!
//! - [`agent`]: the long-running agent (sources → tracker → runner → datapath, servers).
//! - [`build`]: `ProxyConfig` → the datapath of a mode (its config mapped from the proxy
//!   config, wrapped for conntrack cleanup and metrics), `render`.
//! - [`modes`]: which mode can run here (probe), which one's state is here, choosing one,
//!   removing the others' leftovers (cleanup).
//! - [`inspect`]: `kproxy inspect`, what the kernel holds per service port.
//! - [`process`] (oom score), [`sysctl`], [`nodeip`], [`logging`]: process and node settings.

pub mod agent;
pub mod build;
pub mod inspect;
pub mod inspect_nftables;
pub mod logging;
pub mod modes;
pub mod nodeip;
pub mod process;
pub mod sysctl;
