//! The nftables proxier: upstream kube-proxy's nftables mode (pkg/proxy/nftables), object for
//! object. Pure parts only so far (the applier that runs `nft` comes later):
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

pub mod config;
pub mod elements;
pub mod fake;
pub mod names;
pub mod proxier;
pub mod service;
pub mod setup;
pub mod transaction;

pub use config::NftablesConfig;
pub use fake::FakeTable;
pub use proxier::{NftBackend, NftSyncError, NftSyncStats, Proxier, render};
pub use transaction::{Transaction, canonical_sort};
