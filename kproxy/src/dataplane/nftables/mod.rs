//! The nftables proxier: upstream kube-proxy's nftables mode (pkg/proxy/nftables), object for
//! object. Everything but [`kernel`] and [`dataplane`] is pure:
//!
//! - [`config`]: [`NftablesConfig`], the resolved per-family settings.
//! - [`names`]: upstream's hashed chain and set names.
//! - [`transaction`]: objects, transactions as `nft -f` text (and parsed back), the canonical
//!   sort upstream compares dumps with.
//! - [`setup`]: the static part of the table (base chains, maps, dispatch rules).
//! - [`service`]: one service port's elements and chains.
//! - [`elements`]: element reconciliation (upstream `nftElementStorage`).
//! - [`proxier`]: the full/partial sync state machine with stale-chain handling.
//! - [`fake`]: an in-memory table applying transactions (like knftables' `Fake`).
//! - [`dataplane`]: [`NftablesDataplane`], the mode's `Dataplane` (one proxier per family).
//! - [`localhost`]: NodePorts on 127.0.0.1 through a userspace proxy (feature gate
//!   `KubeProxyNFTablesLocalhostNodePorts`).
//! - [`kernel`]: the kernel backend (`nft -f -` transactions; chains, sets, elements and
//!   rule counts read through netlink, [`crate::kernel::nftables`]).
//!
//! The reference is upstream's test corpus at kubernetes/kubernetes 81810de6 (15 rulesets,
//! operation counts, 207 packet flows; see tests/tests/nftables_corpus.rs), which kproxy
//! matches exactly. Upstream's proxier.go of that commit was not available; rule text and
//! order follow the corpus, the algorithm an older proxier.go plus the restart optimisation
//! (kubernetes#130119) the startup case's operation count documents. Known differences:
//!
//! - A full sync does not flush the service sets and maps: it reads their elements from the
//!   kernel and reconciles them, and keeps an existing endpoint chain whose affinity set
//!   existence matches (its rules follow from its name) unless it holds no rule (a stale chain
//!   flushed but not yet deleted, by this proxier or — read once at start — an earlier one).
//!   This reproduces the corpus' startup count (`setupOps + 14`); how upstream's newest code
//!   reaches it may differ in detail.
//! - An unused chain is flushed once and deleted once stale for more than a second; upstream
//!   re-flushes it on every sync and restarts its clock, so with syncs less than a second
//!   apart it would never be deleted.
//! - The masquerade mark is written `0x4000` (upstream's test proxier); upstream's real
//!   proxier writes `%#08x` (`0x004000`), which nft reads the same.

pub mod config;
pub mod dataplane;
pub mod elements;
pub mod fake;
pub mod kernel;
pub mod localhost;
pub mod names;
pub mod proxier;
pub mod service;
pub mod setup;
pub mod transaction;

pub use config::NftablesConfig;
pub use dataplane::NftablesDataplane;
pub use fake::FakeTable;
pub use proxier::{NftBackend, NftSyncError, NftSyncStats, Proxier, render};
pub use transaction::{Transaction, canonical_sort};
