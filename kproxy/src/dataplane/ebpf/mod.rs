//! `--proxy-mode ebpf`: one [`Dataplane`](crate::dataplane::Dataplane), [`EbpfDataplane`]
//! (in [`dataplane`]), configured by an [`EbpfConfig`].
//!
//! - [`object`]: the embedded BPF object, completed for this kernel (BTF), and the only place
//!   it is loaded from.
//! - [`layout`]: the pinned maps under `<bpffs>/kproxy/` and their layout upgrades;
//!   [`loader`]: bpffs, loading with pins, socket-LB links.
//! - [`service_maps`]: snapshot → service map entries (pure plan, ids, Maglev, frontend
//!   filter) and the applier that writes them.
//! - [`socket_lb`]: the cgroup the socket-LB programs attach to, UDP socket destruction.
//! - [`node_path`]: the TC and XDP programs on node devices (NodePort/ExternalIP/LB from
//!   outside), their devices and the flow (connection) table.

pub mod dataplane;
pub mod layout;
pub mod loader;
pub mod node_path;
pub mod object;
pub mod service_maps;
pub mod socket_lb;

pub use dataplane::{EbpfConfig, EbpfDataplane, EbpfError};
