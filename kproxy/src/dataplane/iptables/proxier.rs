//! The sync state machine of one per-family proxier, over an [`IptablesBackend`]: full vs
//! partial syncs, stale-chain deletion, jump rules, and the restore mode.
//!
//! Like upstream's `syncProxyRules`: a sync is full on the first run, after any failure, when
//! forced (canary monitor, node change) and at least every [`FULL_SYNC_PERIOD`]; otherwise it
//! is partial and omits the SVC/SVL/EXT/FW/SEP chains of services that did not change. The
//! text of every restore input ([`IptablesProxier::last_input`]) is upstream's (a full sync in
//! large-cluster mode may add `-X` lines, see below).
//!
//! ## Restore mode: always `--noflush`, in bulk form on full syncs
//! Every restore is a `--noflush` one, as upstream's: only the chains the input declares are
//! flushed, so other programs' chains and rules (Docker's, a CNI portmap's) are never touched,
//! whatever they add at any moment. kproxy once replaced the nat table as a whole (no
//! `--noflush`) when an `iptables-save` taken just before showed nothing but our objects;
//! that lost any rule another program added between the save and the restore (issue #29),
//! and could not be made safe: iptables-nft takes no lock at all (the xtables lock is
//! iptables-legacy's, `/run/xtables.lock`), and a restore cannot be made conditional on the
//! table being what an earlier save showed. So nothing that is not ours is ever flushed.
//!
//! Why the whole-table form existed, and why it is no longer needed: iptables-nft 1.8.9 is
//! superlinear on a `--noflush` restore of many chains because, before running it, it
//! collects every chain a command names (its chain and its jump target) into a list sorted by
//! insertion — a linear `strcmp` walk per command — so a restore of C commands naming N chains
//! costs O(C × N) (4k services × 5: 17.9 s; 10k: minutes). A command naming no chain makes it
//! fetch the whole table in one dump instead, as a flushing restore does. A full sync's
//! restore ([`RestoreMode::NoFlushBulk`]) therefore carries a chain-less `-S` per table on the
//! nft backend (see [`with_table_listings`](super::exec::with_table_listings)): its cold start
//! beside a foreign rule costs what the old whole-table restore of a clean table did (10k × 5
//! in the measurement of bench/anchors/2026-11-29-iptables-foreign-rule.md: 6.0 s of
//! iptables CPU either way). A full resync over the full table pays ≈ 1.6 s more CPU than the
//! whole-table one did (`-S` fetches and lists the table's rules, then every chain is flushed
//! and refilled instead of the table being replaced) — the price of never flushing others'
//! rules. iptables-legacy has no such list; its `--noflush` restore costs what a whole-table
//! one does, and holds the xtables lock across its read-modify-write of the table. Partial
//! syncs declare a few chains and stay plain `--noflush` (the `-S` would fetch every rule).
//!
//! A full sync deletes (`-X`) every stale per-service chain its `iptables-save` shows, also in
//! large-cluster mode where upstream waits for its periodic cleanup: the save is taken anyway,
//! and a full sync leaves exactly the planned chains, as the whole-table restore did.
//!
//! ## What a partial sync actually restores
//! A partial sync's input is upstream's (it re-declares and rewrites KUBE-SERVICES,
//! KUBE-NODEPORTS, … with one rule per service, plus the changed services' chains). Applied
//! as is, that is a chain flush and ~10k appends through iptables-nft `--noflush` at 10k
//! services (≈ 1 s of iptables CPU, 3–4 s wall on a loaded machine; the restore of only the
//! changed service's chains takes ≈ 0.05 s). The applier leaves out of the applied input every chain whose complete
//! content equals what it wrote last time ([`KernelChains`]); a `--noflush` restore leaves an
//! omitted chain as it is, so the kernel ends up exactly as after upstream's input. What the
//! proxier logs and compares ([`IptablesProxier::last_input`]) stays upstream's text. The knowledge is
//! rebuilt by every full sync and dropped after any failure (the next sync is full). In
//! large-cluster mode the stale per-service chains a cleanup deletes are taken from that
//! knowledge (chains seen by the last full sync's `iptables-save` plus those written since)
//! instead of an `iptables-save` of the whole (huge) nat table. Knowingly different from
//! upstream: between full syncs an external edit of KUBE-SERVICES & co. that leaves the canary
//! and the PREROUTING jump in place is repaired at the next full sync, not the next sync.
//!
//! ## Planning
//! The rules come from an [`IncrementalPlanner`] kept across syncs: only service ports whose
//! service or endpoints changed are planned again (everything after a config, node or
//! large-cluster-mode change; a full sync compares every port with the cache, a partial one
//! looks only at the ports its change set names); the shared chains and the restore text are
//! assembled from the cached per-port pieces (the shared chains reassembled only when a port's
//! part of them changed), byte-identical to a from-scratch [`plan`](super::plan::plan).
//!
//! ## What bounds a cold start on nft
//! Measured by hand (iptables 1.8.9, kernel 6.18, 10k services × 5 endpoints, a whole-table
//! nat restore — which costs what today's bulk `--noflush` restore does — of 60k chains and
//! 170k rules in a fresh netns, loaded 2-core machine): ≈5.4 s
//! user + 3.5 s sys inside `iptables-nft-restore`. The user time is iptables-nft's own and
//! grows superlinearly with the number of chains: declaring 6k / 20k / 60k chains alone takes
//! 0.01 / 0.10 / 1.9 s user, and rules that jump to user chains cost far more than DNAT rules
//! (dropping the 100k SEP rules saves 0.8 s; the 70k jump rules cost ≈2.7 s). Comments make
//! no difference (large-cluster mode already drops most; stripping the rest: same time), and
//! splitting the declarations over several `--noflush` restores is slower (≈0.5 s per 10k
//! chains each). The chains and rules are upstream's, so their number is fixed: the bound is
//! iptables-nft's per-chain cost, not the input's shape.
//!
//! Splitting the cold restore was measured again (10k × 5, nat table only, loaded 2-core
//! machine, each variant once, so ±20 %): one whole-table restore 8.2 s; a whole-table
//! restore of the fixed chains, then the per-service chains in `--noflush` batches of 100 /
//! 500 / 2,000 services (not reachable from a base chain until the last restore writes
//! KUBE-SERVICES), then KUBE-SERVICES: 10.5 / 9.5 / 48 s. A `--noflush` restore of many
//! chains is superlinear inside iptables-nft itself (the chain list above: the batches had
//! no `-S`), and each extra restore pays a process and a commit; nothing beat a single
//! restore.
//!
//! ## What bounds a partial sync on nft
//! Measured in the agent under the bench (debug log line "iptables sync phases", 10k services
//! × 5, one endpoint change, loaded 2-core machine): planning ≈ 0.1 ms (only the ports the
//! change set names; the shared chains are reused when no port's part of them changed),
//! rendering and diffing ≈ 4 ms, the restore of the one or two changed chains 130–250 ms
//! depending on the machine's load, the rest (conntrack check, metrics) a few ms. Almost all
//! of the restore is kernel time inside one `sendmsg`: at commit nf_tables validates the
//! table (`nft_table_validate` → `nft_chain_validate`, recursively over every chain reachable
//! from a base chain; perf puts ≈ 80 % of the restore there) whenever the transaction adds a
//! rule with a verdict or an xt target, i.e. for every service change. The walk visits
//! KUBE-SERVICES and the 60k service/endpoint chains below it twice (from PREROUTING and from
//! OUTPUT), so it grows with the whole ruleset, not with the change: a restore declaring one
//! new chain with one `-j ACCEPT` rule takes 0.11 s of system time on the 10k table (idle
//! machine). The chains and their jumps are upstream's, so this is the floor of a change with
//! the nf_tables backend, and the applier already does one restore per sync. The rest of a
//! restore is small: iptables-nft fetches only the declared chains, by name (≈ 2 ms under
//! strace). `iptables -C` would fetch the rules of the whole table (0.1–0.3 s of CPU), which
//! is why the canary monitor and the jump checks list the chain instead
//! ([`ExecIptables::rule_listed`](super::exec::ExecIptables::rule_listed)).
//!
//! With iptables-legacy the kernel API replaces a whole table per commit: every restore, even
//! of one chain, reads the whole nat table from the kernel and writes it back, so the cost of
//! any sync grows with the total number of rules (the bound of that backend: 0.7–1.0 s per
//! partial restore at 10k × 5, measured the same way, against ≈ 5 ms for everything else).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::model::{ChangedSet, Snapshot};

use super::config::{FULL_SYNC_PERIOD, IptablesConfig};
use super::incremental::{IncrementalPlanner, UpdateStats};
use super::kernel::{IptablesBackend, IptablesError, RestoreMode};
use super::names::is_service_chain;
use super::plan::{ServiceKey, jump_rules, service_key};
use super::render::{TableInput, render_tables};
use super::written::KernelChains;

/// Counters of the proxier (upstream's metrics of the same meaning).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProxierStats {
    pub full_syncs: u64,
    pub partial_syncs: u64,
    /// Failed restores (`sync_proxy_rules_iptables_restore_failures_total`).
    pub restore_failures: u64,
    /// Failed partial restores (`sync_proxy_rules_iptables_partial_restore_failures_total`).
    pub partial_restore_failures: u64,
    /// Chains (both tables) the last sync's applied restore declared.
    pub chains_written_last: usize,
    /// Chains of upstream's input the last (partial) sync left out as unchanged.
    pub chains_omitted_last: usize,
    /// nat rules written by the last sync (`sync_proxy_rules_iptables_last{table=nat}`).
    pub nat_rules_last: usize,
}

/// What one successful sync did.
#[derive(Debug, Clone)]
pub struct SyncOutcome {
    pub full: bool,
    /// Endpoints of the family's service ports (upstream's count for large-cluster mode).
    pub total_endpoints: usize,
    pub large_cluster: bool,
    /// What the planner re-planned.
    pub planned: UpdateStats,
}

/// One per-family proxier.
pub struct IptablesProxier<B: IptablesBackend> {
    pub cfg: IptablesConfig,
    pub backend: B,
    need_full_sync: bool,
    force_full: Arc<AtomicBool>,
    last_full_sync: Option<Instant>,
    last_cleanup: Option<Instant>,
    last_input: String,
    pub stats: ProxierStats,
    /// What the kernel is known to hold (see the module docs).
    kernel: KernelChains,
    /// Per-service-port plans kept between syncs.
    planner: IncrementalPlanner,
}

/// Wall time of the phases of one sync, for the debug log.
struct Phases {
    last: Instant,
    laps: Vec<(&'static str, Duration)>,
}

impl Phases {
    fn start() -> Self {
        Phases {
            last: Instant::now(),
            laps: vec![],
        }
    }

    /// Ends the phase `name` (started at the previous lap).
    fn lap(&mut self, name: &'static str) {
        let now = Instant::now();
        self.laps.push((name, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, d)) in self.laps.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{name}={:.1}", d.as_secs_f64() * 1000.0)?;
        }
        Ok(())
    }
}

/// The restore input of one sync (the shared chains and the per-service chains to write).
struct SyncInput {
    filter: TableInput,
    nat: TableInput,
    /// Rules in `nat` (shared and per-service chains, before stale-chain deletes).
    nat_rules: usize,
}

/// The chains of one table's `iptables-save`, in order.
#[derive(Debug, Default)]
struct Saved {
    chains: Vec<String>,
}

fn parse_save(text: &str) -> Saved {
    Saved {
        chains: text
            .lines()
            .filter_map(|l| l.strip_prefix(':'))
            .filter_map(|c| c.split_whitespace().next())
            .map(str::to_owned)
            .collect(),
    }
}

impl<B: IptablesBackend> IptablesProxier<B> {
    pub fn new(cfg: IptablesConfig, backend: B) -> Self {
        IptablesProxier {
            cfg,
            backend,
            need_full_sync: true,
            force_full: Arc::new(AtomicBool::new(false)),
            last_full_sync: None,
            last_cleanup: None,
            last_input: String::new(),
            stats: ProxierStats::default(),
            kernel: KernelChains::default(),
            planner: IncrementalPlanner::new(),
        }
    }

    /// A flag that forces the next sync to be full (set by the canary monitor).
    pub(crate) fn force_full_flag(&self) -> Arc<AtomicBool> {
        self.force_full.clone()
    }

    /// Forces the next sync to be full.
    pub fn force_full_sync(&mut self) {
        self.need_full_sync = true;
    }

    /// Pretends the last stale-chain cleanup happened `ago` ago (upstream's tests set
    /// `lastIPTablesCleanup` the same way).
    pub fn set_last_cleanup(&mut self, ago: Duration) {
        self.last_cleanup = Instant::now().checked_sub(ago);
    }

    /// The restore input (upstream's text, `--noflush` semantics) of the last sync attempt.
    pub fn last_input(&self) -> &str {
        &self.last_input
    }

    /// Whether the next sync will be full.
    pub fn next_sync_is_full(&self) -> bool {
        self.need_full_sync
            || self.force_full.load(Ordering::Relaxed)
            || !self.cfg.partial_sync
            || self
                .last_full_sync
                .is_none_or(|t| t.elapsed() > FULL_SYNC_PERIOD)
    }

    fn ensure_jumps(&mut self) -> Result<(), IptablesError> {
        for j in jump_rules() {
            self.backend.ensure_chain(j.table, j.to)?;
            self.backend.ensure_rule_prepend(j.table, j.from, &j.args)?;
        }
        Ok(())
    }

    /// Plans `snap` and writes it. `changed` names the service ports changed since the
    /// previous call (a node change forces a full sync).
    pub fn sync(
        &mut self,
        snap: &Snapshot,
        changed: &ChangedSet,
    ) -> Result<SyncOutcome, IptablesError> {
        let full = self.next_sync_is_full() || changed.node;
        self.force_full.store(false, Ordering::Relaxed);
        let mut phases = Phases::start();
        let r = self.sync_inner(snap, changed, full, &mut phases);
        tracing::debug!(family = ?self.cfg.family, full, ok = r.is_ok(), chains_written = self.stats.chains_written_last, chains_omitted = self.stats.chains_omitted_last, "iptables sync phases (ms): {phases}");
        match &r {
            Ok(_) => {
                self.need_full_sync = false;
                if full {
                    self.last_full_sync = Some(Instant::now());
                    self.stats.full_syncs += 1;
                } else {
                    self.stats.partial_syncs += 1;
                }
            }
            Err(e) => {
                tracing::warn!(family = ?self.cfg.family, full, error = %e, "iptables sync failed; the next sync is a full one");
                self.need_full_sync = true;
                self.kernel.clear();
            }
        }
        r
    }

    fn sync_inner(
        &mut self,
        snap: &Snapshot,
        changed: &ChangedSet,
        full: bool,
        phases: &mut Phases,
    ) -> Result<SyncOutcome, IptablesError> {
        if full {
            self.ensure_jumps()?;
            phases.lap("jumps");
        }
        let (outcome, mut input) = self.plan_input(snap, changed, full, phases);
        let saved_nat =
            self.delete_stale_chains(full, outcome.large_cluster, &mut input.nat, phases);
        self.render_input(&input);
        phases.lap("render");
        if full {
            self.restore_full(input, saved_nat.as_ref(), phases)?;
        } else {
            self.restore_partial(&input, phases)?;
        }
        Ok(outcome)
    }

    /// Updates the plan (all service ports, or the changed ones) and makes the restore
    /// input: the shared chains and the per-service chains to write.
    fn plan_input(
        &mut self,
        snap: &Snapshot,
        changed: &ChangedSet,
        full: bool,
        phases: &mut Phases,
    ) -> (SyncOutcome, SyncInput) {
        let planned = if full {
            self.planner.update(snap, &self.cfg)
        } else {
            self.planner.update_changed(snap, &self.cfg, changed)
        };
        phases.lap("plan");
        self.planner.refresh_shared(&self.cfg);
        let shared = self.planner.shared();
        phases.lap("shared");

        let mut filter = TableInput::new("filter");
        filter.add(&shared.filter);
        let mut nat = TableInput::new("nat");
        nat.add(&shared.nat);
        let mut nat_rules = shared.nat.rule_count();
        // Per-service chains by service (upstream's order: services sorted by name, ports in
        // snapshot order): all of them, or those of the changed services.
        let mut add = |pp: &super::plan::PortPlan| {
            nat.add(&pp.chains);
            nat_rules += pp.chains.rule_count();
        };
        if full {
            self.planner.ports().for_each(|(_, pp)| add(pp));
        } else {
            let changed_services: BTreeSet<ServiceKey> =
                changed.services.iter().map(service_key).collect();
            for key in &changed_services {
                self.planner.service_ports(key).for_each(&mut add);
            }
        }
        let outcome = SyncOutcome {
            full,
            total_endpoints: shared.total_endpoints,
            large_cluster: shared.large_cluster,
            planned,
        };
        (
            outcome,
            SyncInput {
                filter,
                nat,
                nat_rules,
            },
        )
    }

    /// Stale per-service chains go into `nat` as deletes (and, on full syncs, the saved nat
    /// table tells whether it holds only our objects: returned). A partial sync in
    /// large-cluster mode takes the existing chains from what it knows instead of saving a
    /// huge table.
    fn delete_stale_chains(
        &mut self,
        full: bool,
        large_cluster: bool,
        nat: &mut TableInput,
        phases: &mut Phases,
    ) -> Option<Saved> {
        let cleanup_due = full
            || !large_cluster
            || self
                .last_cleanup
                .is_none_or(|t| t.elapsed() > self.cfg.sync_period);
        let known_chains = !full && large_cluster && !self.kernel.is_empty();
        let mut saved_nat = None;
        if full || (cleanup_due && !known_chains) {
            match self.backend.save("nat") {
                Ok(text) => saved_nat = Some(parse_save(&text)),
                Err(e) => {
                    tracing::error!(error = %e, "iptables-save failed: stale chains will not be deleted")
                }
            }
            phases.lap("save");
        }
        if cleanup_due {
            let active = self.planner.active_chains();
            let existing: Option<Vec<&str>> = match &saved_nat {
                Some(saved) => Some(saved.chains.iter().map(String::as_str).collect()),
                None if known_chains => Some(self.kernel.chains("nat").collect()),
                None => None,
            };
            if let Some(existing) = existing {
                let stale: BTreeSet<String> = existing
                    .into_iter()
                    .filter(|c| is_service_chain(c) && !active.contains(*c))
                    .map(str::to_owned)
                    .collect();
                for c in &stale {
                    nat.delete(c);
                }
                self.last_cleanup = Some(Instant::now());
            }
        }
        saved_nat
    }

    /// Renders the whole input into `last_input` (what a full sync restores).
    fn render_input(&mut self, input: &SyncInput) {
        self.last_input.clear();
        let len = input.filter.rendered_len() + input.nat.rendered_len();
        // Exactly the text's size: the buffer is kept between syncs.
        if self.last_input.capacity() > 2 * len {
            self.last_input.shrink_to(len);
        } else {
            self.last_input.reserve_exact(len);
        }
        input.filter.render(&mut self.last_input);
        input.nat.render(&mut self.last_input);
        self.stats.nat_rules_last = input.nat_rules;
    }

    /// A partial sync writes only the chains that differ from the kernel's known content.
    fn restore_partial(
        &mut self,
        input: &SyncInput,
        phases: &mut Phases,
    ) -> Result<(), IptablesError> {
        let (filter, omitted_f) = self.kernel.without_unchanged(&input.filter);
        let (nat, omitted_n) = self.kernel.without_unchanged(&input.nat);
        phases.lap("diff");
        self.stats.chains_omitted_last = omitted_f + omitted_n;
        let tables: Vec<TableInput> = [filter, nat]
            .into_iter()
            .filter(|t| !t.chains.is_empty() || !t.deletes.is_empty())
            .collect();
        self.stats.chains_written_last = tables.iter().map(|t| t.chains.len()).sum();
        if !tables.is_empty() {
            let input = render_tables(&tables);
            if let Err(e) = self.backend.restore(&input, RestoreMode::NoFlush) {
                return Err(self.restore_failed(e, false));
            }
            phases.lap("restore");
        }
        for t in &tables {
            self.kernel.record(t);
        }
        phases.lap("record");
        Ok(())
    }

    /// A full sync restores everything (both tables, one `--noflush` restore in bulk form);
    /// then rebuilds the kernel knowledge: what the save showed plus the input.
    fn restore_full(
        &mut self,
        input: SyncInput,
        saved_nat: Option<&Saved>,
        phases: &mut Phases,
    ) -> Result<(), IptablesError> {
        let SyncInput { filter, nat, .. } = input;
        self.stats.chains_omitted_last = 0;
        self.stats.chains_written_last = filter.chains.len() + nat.chains.len();
        let result = self
            .backend
            .restore(&self.last_input, RestoreMode::NoFlushBulk);
        phases.lap("restore");
        match result {
            Ok(()) => {
                self.kernel.clear();
                match saved_nat {
                    Some(s) => self
                        .kernel
                        .set_saved("nat", s.chains.iter().map(String::as_str)),
                    None => self.kernel.forget_table("nat"),
                }
                self.kernel.record(&filter);
                self.kernel.record(&nat);
                phases.lap("record");
                Ok(())
            }
            Err(e) => Err(self.restore_failed(e, true)),
        }
    }

    fn restore_failed(&mut self, e: IptablesError, full: bool) -> IptablesError {
        self.stats.restore_failures += 1;
        if !full {
            self.stats.partial_restore_failures += 1;
        }
        self.kernel.clear();
        e
    }
}
