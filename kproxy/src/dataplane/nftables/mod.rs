//! The nftables proxier: upstream kube-proxy's nftables mode (pkg/proxy/nftables), object for
//! object. Everything but [`kernel`] and `dataplane` is pure:
//!
//! - `config`: [`NftablesConfig`], the resolved per-family settings.
//! - [`names`]: upstream's hashed chain and set names.
//! - [`transaction`]: objects, transactions as `nft -f` text (and parsed back), the canonical
//!   sort upstream compares dumps with.
//! - `setup`: the static part of the table (base chains, maps, dispatch rules).
//! - `service`: one service port's elements and chains.
//! - `elements`: element reconciliation (upstream `nftElementStorage`).
//! - [`proxier`]: the full/partial sync state machine with stale-chain handling.
//! - `fake`: an in-memory table applying transactions (like knftables' `Fake`).
//! - `dataplane`: [`NftablesDataplane`], the mode's `Dataplane` (one proxier per family).
//! - `localhost`: NodePorts on 127.0.0.1 through a userspace proxy (feature gate
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
//!
//! # Loading speed
//!
//! The rules are upstream's, byte for byte (every service port with endpoints gets an
//! anonymous `numgen random mod N vmap { … }` map); what kproxy chooses is how they reach the
//! kernel. Measured with `perf` on kernel 6.18 and nft 1.0.6 (bench/nftables-speed.md has the
//! figures; `cargo xtask bench` measures each beside the floor of one `nft -f` of the same
//! input):
//!
//! - **Per anonymous set, over the whole pending transaction.** Binding an anonymous set to
//!   its rule (`nf_tables_bind_set` → `__nft_set_trans_bind`) walks the entire commit list
//!   of the transaction, once per `numgen … vmap` rule. One transaction of n services
//!   therefore costs O(n²): 45% of the kernel time at 4k services, ≈ 30 s of kernel time
//!   at 10k × 5 (the 129 s once measured for anonymous maps is this walk). A full sync is
//!   therefore committed in parts of ≈ `proxier::FULL_SYNC_BATCH_OPERATIONS` operations,
//!   cut between service ports ([`proxier::split_points`], which also says why no part
//!   leaves a service half-programmed); partial syncs stay one transaction.
//! - **Per anonymous set, over the whole table.** Allocating its name (`__map%d`:
//!   `nf_tables_newset` scans and `sscanf`s every set of the table) and finding it by that
//!   name (`nft_set_lookup_global`, which never matches and scans every set before the
//!   lookup by id) are O(sets in the table) each, so loading n services costs O(n²)
//!   whatever the transaction size — the bulk of what remains at 10k and the reason a 40k
//!   resync takes minutes. Only a different ruleset (named maps) would avoid it.
//! - **Per commit, over the whole table.** A transaction adding a jump, goto or verdict
//!   element makes the commit re-validate every chain reachable from the base chains
//!   (`nft_table_validate`: `services` → `@service-ips` → every service chain → every
//!   numgen map → every endpoint chain). Smaller parts pay it more often (at 10k × 5, parts
//!   of 5,000 operations were slower than parts of 20,000, and parts of 80,000 slower again
//!   from the bind walk).
//! - **Per `nft` run, over the whole table.** nft fetches the table's chains and sets into
//!   its cache for any `add rule` or `add element` (not for a batch of `add chain`s only);
//!   the kernel restarts the chain dump from the first chain for every 32 KB message, so at
//!   10k × 5 (60k chains) that dump is about half of a one-change `nft -f`. nft has no
//!   option to skip it. Hence: one `nft` run per sync — the stale-chain deletions go at the
//!   start of the sync's transaction instead of one of their own (upstream's; on failure
//!   the sync's transaction runs alone, as upstream retries them) — and a partial sync
//!   lists nothing itself: the proxier knows the table's chains and sets from its last full
//!   sync plus every transaction since, and the canary counts the static chains' rules.
//! - **Order within a service port**: chains first, then elements, then rules (upstream's).
//!   Adding an element or rule checks the jump target's chain for loops by walking it,
//!   which is empty at that moment; elements after the rules would walk every service's
//!   chains.
//!
//! - **A partial sync plans only the changed services.** Upstream's loop visits every
//!   service port on every sync (hashed chain names, every element ensured again) and only
//!   skips writing the unchanged ones' chains: ≈ 250 ms of CPU per sync at 10k services.
//!   kproxy keeps what each service port holds in the table (its chains, affinity sets and
//!   element keys, `service::PortRecord`) and counts the holders of each element key
//!   (`elements::ElementStorage::release`), so a partial sync plans the ports of the
//!   services in the model's `ChangedSet` alone and finds their stale chains, sets and
//!   elements from what they held before: the same operations, for work proportional to
//!   the change. (Where two service ports claim one map key with different values — the
//!   same external IP and port on two services — upstream rewrites the key on every sync,
//!   ending with whichever port its map iteration visits last; kproxy reconciles the other
//!   claimants' elements after a claimant was rewritten, so the key ends with an unchanged
//!   claimant's value and never keeps one of a port that no longer claims it.)

pub(crate) mod config;
pub(crate) mod dataplane;
pub(crate) mod elements;
pub(crate) mod face;
pub(crate) mod fake;
pub(crate) mod inspect;
pub mod kernel;
pub(crate) mod localhost;
pub mod names;
pub mod proxier;
pub(crate) mod service;
pub(crate) mod setup;
pub mod transaction;

pub use config::NftablesConfig;
pub use dataplane::{FULL_SYNC_PERIOD, NftablesDataplane};
pub use fake::FakeTable;
pub use proxier::{NftBackend, NftSyncError, NftSyncStats, NftablesProxier, render};
pub use transaction::{Transaction, canonical_sort};
