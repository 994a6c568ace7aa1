//! The composition root (upstream's `cmd/kube-proxy/app`): everything that knows more than one
//! layer. It turns a [`crate::config::ProxyConfig`] into a running agent: sources, tracker,
//! sync runner, one [`crate::dataplane::Dataplane`], the observers.
//!
//! - [`agent`]: the long-running agent (sources → tracker → runner → datapath, servers).
//! - [`registry`]: the proxy modes (each one's face), detection order, building the chosen
//!   mode's datapath, which mode's state is here, removing the others' leftovers (cleanup).
//! - [`inspect`]: `kproxy inspect`, what the kernel holds per service port.
//! - [`process`] (oom score), [`sysctl`], `nodeip`, [`logging`]: process and node settings.

pub mod agent;
pub mod inspect;
pub mod logging;
pub(crate) mod nodeip;
pub mod process;
pub mod registry;
pub mod sysctl;
