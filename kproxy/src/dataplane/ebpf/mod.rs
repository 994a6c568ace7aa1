//! `--proxy-mode ebpf`: one [`Dataplane`](crate::dataplane::Dataplane), [`EbpfDataplane`]
//! (in `dataplane`), configured by an [`EbpfConfig`].
//!
//! - [`object`]: the embedded BPF object, completed for this kernel (BTF), and the only place
//!   it is loaded from.
//! - `pins`: the bpffs and the pin directory `<bpffs>/kproxy/`; [`layout`]: the pinned
//!   maps and their layout upgrades; `addr`: addresses in the maps' encoding.
//! - [`service_maps`]: snapshot → service map entries (pure plan, ids, Maglev, frontend
//!   filter), the applier that writes them, and its loader (the object with its pins, the
//!   socket-LB links).
//! - `socket_lb`: the cgroup the socket-LB programs attach to, UDP socket destruction.
//! - [`node_path`]: the TC and XDP programs on node devices (NodePort/ExternalIP/LB from
//!   outside), their devices and the flow (connection) table.
//! - `face`: the mode's face (probe, build, leftovers, inspect) and `inspect`, its
//!   `kproxy inspect` reader.
//!
//! The sub-modules form a stack without loops (checked by `layering`): `object`, `pins`,
//! `layout`, `addr` at the bottom; `socket_lb` on them; `service_maps` on those; `node_path`
//! and `dataplane` on top.

pub(crate) mod addr;
pub(crate) mod dataplane;
pub(crate) mod face;
pub(crate) mod inspect;
pub mod layout;
pub mod node_path;
pub mod object;
pub(crate) mod pins;
pub mod service_maps;
pub(crate) mod socket_lb;

pub use dataplane::{EbpfConfig, EbpfDataplane, EbpfError};
