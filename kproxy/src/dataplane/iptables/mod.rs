//! The iptables proxier: upstream kube-proxy's iptables mode, rule for rule.
//!
//! - [`config`]: [`IptablesConfig`], the resolved per-family settings.
//! - `names`: chain names (upstream's hashed `KUBE-SVC-…`/`KUBE-SEP-…`).
//! - `plan`: the pure planner, snapshot → filter + nat rules (structured by chain).
//! - `incremental`: per-service-port plans cached between syncs (re-plans what changed).
//! - [`render`](mod@render): iptables-restore text and upstream's canonical sort.
//! - `proxier`: full/partial sync state machine over an [`kernel::IptablesBackend`].
//! - `written`: what the kernel is known to hold (lets partial syncs skip unchanged chains).
//! - [`kernel`]: the kernel interface (`--noflush` restores only) and an in-memory fake of it.
//! - [`exec`]: the real backend (iptables binaries, nft/legacy detection, `-w` lock, the bulk
//!   form of a restore for iptables-nft).
//! - `dataplane`: [`IptablesDataplane`], the `Dataplane` (start-up checks, canary monitor).
//! - `cleanup`: removal of our and upstream kube-proxy's leftovers.
//!
//! One proxier runs per IP family (like upstream's dual-stack meta-proxier).

pub(crate) mod cleanup;
pub mod config;
pub(crate) mod dataplane;
pub mod exec;
pub(crate) mod face;
pub(crate) mod incremental;
pub(crate) mod inspect;
pub mod kernel;
pub(crate) mod names;
pub(crate) mod plan;
pub(crate) mod proxier;
pub mod render;
pub(crate) mod written;

#[cfg(test)]
mod tests;

pub use config::{BackendChoice, IptablesConfig, NfacctCounters};
pub use dataplane::IptablesDataplane;
use plan::plan;
pub use proxier::IptablesProxier;

use crate::model::Snapshot;

/// The ruleset `snap` gives under `cfg`, as iptables-restore text in upstream's canonical
/// order (what `kproxy render --proxy-mode iptables` prints): a full sync's input.
pub fn render(snap: &Snapshot, cfg: &IptablesConfig) -> String {
    let p = plan(snap, cfg);
    let mut filter = render::TableInput::new("filter");
    filter.add(&p.filter);
    let mut nat = render::TableInput::new("nat");
    nat.add(&p.nat);
    for t in p.services.values() {
        nat.add(t);
    }
    render::canonical_sort(&render::render_tables(&[filter, nat]))
}
