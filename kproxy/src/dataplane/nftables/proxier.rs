//! The nftables proxier's sync state machine (upstream `syncProxyRules`), pure over a
//! [`NftBackend`]: full syncs rewrite the static part of the table and every service, partial
//! syncs plan only the services in the model's [`ChangedSet`] (what every other service port
//! holds is kept from the sync that last planned it, `PortRecord`); map and set elements
//! are reconciled one by one; chains no longer used are flushed and deleted once stale for
//! more than a second (the clock is a parameter), at the start of a later sync's transaction.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::model::{ChangedSet, Protocol, ServicePortName, Snapshot};

use super::config::NftablesConfig;
use super::fake::FakeTable;
use super::names::{is_affinity_set, is_endpoint_chain, is_service_chain};
use super::service::{PortRecord, Storages, Store, SyncContext};
use super::setup::{BASE_CHAINS, CLUSTER_IPS, SERVICES, TABLE, setup};
use super::transaction::{Object, Transaction, Verb};

/// How long a flushed chain waits before it is deleted (kernels before 6.2 notice a map
/// element's chain is unreferenced only a little after the element is gone).
pub(crate) const STALE_CHAIN_DELAY: Duration = Duration::from_secs(1);

/// The kernel side of the proxier: the table's current objects and a way to run a
/// transaction. [`FakeTable`] is the in-memory one. A table that does not exist has no
/// chains, sets or elements (not an error).
pub trait NftBackend {
    fn list_chains(&mut self) -> Result<Vec<String>, String>;
    fn list_sets(&mut self) -> Result<Vec<String>, String>;
    fn list_elements(&mut self, set: &str) -> Result<Vec<(String, Option<String>)>, String>;
    fn run(&mut self, tx: &Transaction) -> Result<(), String>;
    /// Runs one sync's transaction in consecutive parts, cut before the operations at
    /// `cuts` ([`split_points`]; none: whole), each part atomically and in order; stops at
    /// the first failure. `full`: the sync is a full one (for logs and dumps).
    fn run_parts(&mut self, tx: &Transaction, cuts: &[usize], full: bool) -> Result<(), String> {
        let _ = full;
        if cuts.is_empty() {
            return self.run(tx);
        }
        split(tx, cuts).iter().try_for_each(|part| self.run(part))
    }
    /// How many rules `chain` holds (0 when it does not exist), for the canary check;
    /// `None`: this backend cannot tell (the check then only looks at chains and sets).
    fn rule_count(&mut self, _chain: &str) -> Result<Option<usize>, String> {
        Ok(None)
    }
    /// The chains of the table that hold no rule (e.g. stale chains an earlier process
    /// flushed and did not get to delete), or `None` when the backend cannot tell. A
    /// proxier's first full sync asks, before it keeps existing endpoint chains as they are.
    fn list_empty_chains(&mut self) -> Result<Option<Vec<String>>, String> {
        Ok(None)
    }
}

impl NftBackend for FakeTable {
    fn list_chains(&mut self) -> Result<Vec<String>, String> {
        Ok(FakeTable::list_chains(self))
    }
    fn list_sets(&mut self) -> Result<Vec<String>, String> {
        Ok(FakeTable::list_sets(self))
    }
    fn list_elements(&mut self, set: &str) -> Result<Vec<(String, Option<String>)>, String> {
        Ok(FakeTable::list_elements(self, set))
    }
    fn run(&mut self, tx: &Transaction) -> Result<(), String> {
        self.apply(tx).map_err(|e| e.to_string())
    }
    fn rule_count(&mut self, chain: &str) -> Result<Option<usize>, String> {
        Ok(Some(self.chains.get(chain).map_or(0, |c| c.rules.len())))
    }
    fn list_empty_chains(&mut self) -> Result<Option<Vec<String>>, String> {
        Ok(Some(
            self.chains
                .iter()
                .filter(|(_, c)| c.rules.is_empty())
                .map(|(n, _)| n.clone())
                .collect(),
        ))
    }
}

/// A sync that failed; the next one is full.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("nftables sync failed: {0}")]
pub struct NftSyncError(pub String);

/// What the last successful sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NftSyncStats {
    pub full: bool,
    /// Operations in the main transaction.
    pub operations: usize,
    /// Stale chains deleted at the start of the sync's own transaction (0 when that failed and
    /// the sync ran without them: the next sync tries them again).
    pub stale_chains_deleted: usize,
    pub service_ports: usize,
    /// Upstream's `sync_proxy_rules_no_local_endpoints_total` (internal / external).
    pub no_local_internal: usize,
    pub no_local_external: usize,
}

/// One per-family nftables proxier.
#[derive(Debug, Clone)]
pub struct NftablesProxier {
    pub cfg: NftablesConfig,
    need_full_sync: bool,
    /// The base chains were recreated once (first successful sync).
    base_chains_recreated: bool,
    /// Flushed chains and when they became stale (clock of the `now` arguments).
    pub stale_chains: BTreeMap<String, Duration>,
    storages: Storages,
    pub stats: NftSyncStats,
    /// The main transaction of the last sync attempt.
    pub last_transaction: Option<Transaction>,
    /// Stale-chain deletions that failed so far (upstream's nftables cleanup failures).
    pub cleanup_failures: u64,
    /// The canary: how many rules each static (non-service) chain got from the last
    /// successful full sync; partial syncs check the kernel still holds exactly these.
    static_rules: BTreeMap<String, usize>,
    /// Partial syncs turned full because the table was changed from outside.
    pub outside_changes: u64,
    /// A full sync's transaction is committed in parts of about this many operations
    /// ([`split_points`]); `usize::MAX`: one transaction, like upstream.
    pub batch_operations: usize,
    /// The chains and sets (not maps) of the table as of this proxier's last successful
    /// sync (its listing at the last full sync, updated by every transaction since), so a
    /// partial sync lists nothing (a dump of 60k chains costs more than the commit of one
    /// change); `None`: list them from the backend.
    known: Option<(BTreeSet<String>, BTreeSet<String>)>,
    /// What each service port holds, as of the last sync that planned it.
    held: Held,
}

impl NftablesProxier {
    pub fn new(cfg: NftablesConfig) -> Self {
        NftablesProxier {
            cfg,
            need_full_sync: true,
            base_chains_recreated: false,
            stale_chains: BTreeMap::new(),
            storages: Storages::default(),
            stats: NftSyncStats::default(),
            last_transaction: None,
            cleanup_failures: 0,
            static_rules: BTreeMap::new(),
            outside_changes: 0,
            batch_operations: FULL_SYNC_BATCH_OPERATIONS,
            known: None,
            held: Held::default(),
        }
    }

    pub fn next_sync_is_full(&self) -> bool {
        self.need_full_sync
    }

    /// Replaces the settings (e.g. the node's addresses changed); a change makes the next
    /// sync full, as every part of the table may depend on them.
    pub(crate) fn set_config(&mut self, cfg: NftablesConfig) {
        if cfg != self.cfg {
            self.cfg = cfg;
            self.need_full_sync = true;
        }
    }

    /// Upstream `OnServiceCIDRsChanged`: the `ServiceCIDR` objects' CIDRs, when the snapshot has
    /// them, replace the configured ones (`NftablesConfig::service_cidrs`, kproxy's
    /// `serviceCIDRs` setting, which stays in use when the API server serves no ServiceCIDRs).
    /// Knowingly different from upstream, which writes new CIDRs only at its next full sync: a
    /// change makes this sync full, so the `cluster-ips-check` drop rule follows at once.
    fn follow_service_cidrs(&mut self, snap: &Snapshot) {
        let Some(cidrs) = &snap.service_cidrs else {
            return;
        };
        if *cidrs != self.cfg.service_cidrs {
            tracing::info!(
                family = self.cfg.table_family(),
                service_cidrs = %self.cfg.service_cidrs_text_of(cidrs),
                "service CIDRs from the ServiceCIDR objects (networking.k8s.io/v1)"
            );
            let mut cfg = self.cfg.clone();
            cfg.service_cidrs = cidrs.clone();
            self.set_config(cfg);
        }
    }

    /// Forces the next sync to be full (e.g. upstream's hourly full resync).
    pub(crate) fn force_full_sync(&mut self) {
        self.need_full_sync = true;
    }

    fn new_tx(&self) -> Transaction {
        Transaction::new(self.cfg.table_family(), TABLE)
    }

    /// The stale chains flushed more than [`STALE_CHAIN_DELAY`] ago: deleted at the start
    /// of this sync's transaction.
    fn due_stale_chains(&self, now: Duration) -> Vec<String> {
        self.stale_chains
            .iter()
            .filter(|(_, t)| now.saturating_sub(**t) > STALE_CHAIN_DELAY)
            .map(|(c, _)| c.clone())
            .collect()
    }

    /// The table's chains and sets: what this proxier knows when it may trust that
    /// (`known`, taken: the sync puts it back updated), else listed from the backend (then
    /// `true`).
    fn table_objects(
        &mut self,
        backend: &mut dyn NftBackend,
    ) -> Result<(BTreeSet<String>, BTreeSet<String>, bool), String> {
        match self.known.take() {
            Some((chains, sets)) => Ok((chains, sets, false)),
            None => Ok((
                backend.list_chains()?.into_iter().collect(),
                backend.list_sets()?.into_iter().collect(),
                true,
            )),
        }
    }

    /// A full sync's plan: the static part of the table, then every service port (each
    /// element reconciled against the kernel's, existing endpoint chains kept where they
    /// can be, see [`SyncContext::existing`]).
    fn plan_full(
        &mut self,
        snap: &Snapshot,
        backend: &mut dyn NftBackend,
        distrust_chains: bool,
        (chains, sets): (&BTreeSet<String>, &BTreeSet<String>),
    ) -> Result<SyncPlan, String> {
        let mut tx = self.new_tx();
        setup(&self.cfg, &mut tx, !self.base_chains_recreated);
        for s in self.storages.all_mut() {
            let content = backend.list_elements(&s.name)?;
            s.reset(content);
        }
        let mut existing = if distrust_chains {
            BTreeSet::new()
        } else {
            chains.clone()
        };
        self.forget_empty_chains(&mut existing, backend)?;
        let existing = Some((existing, sets.clone()));
        let mut ctx = SyncContext::new(&self.cfg, &snap.node, tx, &mut self.storages, existing);
        self.held = Held::default();
        // Where each service port's operations start in the transaction.
        let mut port_starts = vec![];
        for svc in snap.services.values() {
            let Some(cluster_ip) = svc.cluster_ip(self.cfg.family) else {
                continue;
            };
            port_starts.push(ctx.tx.ops.len());
            let record = ctx.service_port(svc, cluster_ip, snap.endpoints_of(&svc.name), false);
            self.held.insert(svc.name.clone(), record);
        }
        Ok(SyncPlan {
            tx: ctx.tx,
            port_starts,
            in_use: InUse::All(ctx.active_chains, ctx.active_affinity_sets),
        })
    }

    /// A partial sync's plan: every port of each service in `changed` (upstream rewrites
    /// a service whole when one of its ports changed) is planned again, after what it held
    /// was released; no other service port is looked at. Upstream walks every service port
    /// on every sync and skips writing the unchanged ones' chains; the operations are the
    /// same (an unchanged port's elements are already in place), the work is not: at 10k
    /// services it was ≈ 250 ms of CPU per sync (hashed names, element reconciliation).
    fn plan_partial(&mut self, snap: &Snapshot, changed: &ChangedSet) -> SyncPlan {
        let services: BTreeSet<(&str, &str)> = changed
            .services
            .iter()
            .map(|n| (n.namespace.as_str(), n.name.as_str()))
            .collect();
        let (mut rewritten, sharing) = self.release(&services);
        let tx = self.new_tx();
        let mut ctx = SyncContext::new(&self.cfg, &snap.node, tx, &mut self.storages, None);
        for &(ns, name) in &services {
            for (port, svc) in ports_of(&snap.services, ns, name) {
                let Some(cluster_ip) = svc.cluster_ip(self.cfg.family) else {
                    continue;
                };
                let record = ctx.service_port(svc, cluster_ip, snap.endpoints_of(port), false);
                self.held.insert(port.clone(), record);
            }
        }
        rewritten.after = (
            std::mem::take(&mut ctx.active_chains),
            std::mem::take(&mut ctx.active_affinity_sets),
        );
        // Ports of other services that hold a key the rewritten ports released (the same
        // external IP and port on two services): their elements are reconciled again after
        // the rewritten ones, so the key never keeps the value of a port that no longer
        // holds it (their chains stay as they are).
        for port in sharing {
            let (Some(svc), Some(old)) = (snap.services.get(&port), self.held.records.get(&port))
            else {
                continue;
            };
            let Some(cluster_ip) = svc.cluster_ip(self.cfg.family) else {
                continue;
            };
            for (store, key) in &old.elements {
                ctx.storages.get_mut(*store).release(key);
            }
            let record = ctx.service_port(svc, cluster_ip, snap.endpoints_of(&port), true);
            self.held.insert(port, record);
        }
        SyncPlan {
            tx: ctx.tx,
            port_starts: vec![],
            in_use: InUse::Rewritten(rewritten),
        }
    }

    /// Forgets what the ports of `services` held (their records, their hold on element
    /// keys): what they held before, and the ports of other services that hold one of the
    /// element keys they released.
    fn release(&mut self, services: &BTreeSet<(&str, &str)>) -> (Rewritten, Vec<ServicePortName>) {
        let mut rewritten = Rewritten::default();
        let mut released = BTreeSet::new();
        for &(ns, name) in services {
            let before: Vec<ServicePortName> = ports_of(&self.held.records, ns, name)
                .map(|(k, _)| k.clone())
                .collect();
            for port in before {
                let record = self.held.remove(&port);
                for (store, key) in &record.elements {
                    self.storages.get_mut(*store).release(key);
                }
                released.extend(record.elements);
                rewritten.before.0.extend(record.chains);
                rewritten.before.1.extend(record.affinity_sets);
            }
        }
        released.retain(|(store, key)| self.storages.get_mut(*store).is_held(key));
        (rewritten, self.held.holders_of(&released))
    }

    /// Makes the table match `snap`. `now` is the caller's monotonic clock.
    pub fn sync(
        &mut self,
        snap: &Snapshot,
        changed: &ChangedSet,
        now: Duration,
        backend: &mut dyn NftBackend,
    ) -> Result<NftSyncStats, NftSyncError> {
        self.follow_service_cidrs(snap);
        let mut full = self.need_full_sync || changed.node;
        // Until this sync succeeds, the next one must be full.
        self.need_full_sync = true;
        if full {
            // A full sync reads the table.
            self.known = None;
        }
        // After an outside change no existing chain can be trusted to hold its rules (`nft
        // flush table` empties every chain): the full sync rewrites every endpoint chain.
        let mut distrust_chains = false;
        if !full && let Some(what) = self.outside_change(backend).map_err(NftSyncError)? {
            tracing::info!(
                family = self.cfg.table_family(),
                change = %what,
                "the kube-proxy nftables table was changed from outside; doing a full sync"
            );
            self.outside_changes += 1;
            full = true;
            distrust_chains = true;
        }
        let err = |e: String| NftSyncError(e);
        let (mut listed_chains, mut listed_sets, listed) =
            self.table_objects(backend).map_err(err)?;
        let SyncPlan {
            mut tx,
            port_starts,
            in_use,
        } = if full {
            let listing = (&listed_chains, &listed_sets);
            self.plan_full(snap, backend, distrust_chains, listing)
                .map_err(err)?
        } else {
            self.plan_partial(snap, changed)
        };
        let listing = (&listed_chains, &listed_sets);
        match in_use {
            InUse::All(chains, sets) => self.stale_objects(&mut tx, &chains, &sets, now, listing),
            InUse::Rewritten(_) if listed => {
                // The table was listed (a failed stale-chain deletion left it unknown):
                // whatever it holds beyond what the service ports use is stale.
                let (chains, sets) = self.held.in_use();
                self.stale_objects(&mut tx, &chains, &sets, now, listing);
            }
            InUse::Rewritten(r) => self.stale_rewritten(&mut tx, &r, now, listing),
        }
        for s in self.storages.all_mut() {
            s.cleanup(&mut tx);
        }
        let cuts = if full {
            split_points(&port_starts, self.batch_operations)
        } else {
            vec![]
        };
        // Chains flushed more than a second ago (and not used again, `stale_objects`) are
        // deleted first in the same transaction: upstream deletes them in a transaction of
        // their own before the sync's, which costs a second `nft` run (a whole chain and set
        // dump for nft's cache, and a commit) whenever a chain went stale. Should that
        // transaction fail (a chain still referenced from outside), the sync's is run alone
        // and the chains are looked at again by the next sync, as upstream retries them.
        let due = self.due_stale_chains(now);
        let mut result = Err(String::new());
        let mut stale_deleted = 0;
        if !due.is_empty() {
            let mut with = self.new_tx();
            for c in &due {
                with.delete(Object::chain(c.as_str()));
            }
            with.ops.extend(tx.ops.iter().cloned());
            let shifted: Vec<usize> = cuts.iter().map(|c| c + due.len()).collect();
            result = backend.run_parts(&with, &shifted, full);
            match &result {
                Ok(()) => {
                    stale_deleted = due.len();
                    for c in &due {
                        self.stale_chains.remove(c);
                    }
                    self.learn(&mut listed_chains, &mut listed_sets, &with);
                }
                Err(e) => {
                    tracing::error!(error = %e, "unable to delete stale nftables chains; will retry later");
                    self.cleanup_failures += 1;
                    for c in &due {
                        self.stale_chains.remove(c);
                    }
                }
            }
        }
        if due.is_empty() || result.is_err() {
            result = backend.run_parts(&tx, &cuts, full);
            if result.is_ok() {
                self.learn(&mut listed_chains, &mut listed_sets, &tx);
                if !due.is_empty() {
                    // Whether the due chains still exist is known only to the kernel now.
                    self.known = None;
                }
            }
        }
        let operations = tx.num_operations();
        self.last_transaction = Some(tx);
        if let Err(e) = result {
            // The recorded stale chains were not flushed after all; recompute next time.
            self.stale_chains.clear();
            self.known = None;
            return Err(NftSyncError(e));
        }
        self.need_full_sync = false;
        self.base_chains_recreated = true;
        if full {
            self.static_rules = static_rule_counts(self.last_transaction.as_ref());
        }
        self.stats = NftSyncStats {
            full,
            operations,
            stale_chains_deleted: stale_deleted,
            service_ports: self.held.records.len(),
            no_local_internal: self.held.no_local_internal,
            no_local_external: self.held.no_local_external,
        };
        Ok(self.stats.clone())
    }

    /// What the table holds after `tx` ran over `chains` and `sets` ([`Self::known`]).
    fn learn(
        &mut self,
        chains: &mut BTreeSet<String>,
        sets: &mut BTreeSet<String>,
        tx: &Transaction,
    ) {
        for op in &tx.ops {
            match (&op.verb, &op.object) {
                (Verb::Add, Object::Chain { name, .. }) => {
                    chains.insert(name.clone());
                }
                (Verb::Delete, Object::Chain { name, .. }) => {
                    chains.remove(name);
                }
                (Verb::Add, Object::Set { name, .. }) => {
                    sets.insert(name.clone());
                }
                (Verb::Delete, Object::Set { name, .. }) => {
                    sets.remove(name);
                }
                _ => {}
            }
        }
        self.known = Some((std::mem::take(chains), std::mem::take(sets)));
    }

    /// Removes the chains that hold no rule from `chains` (the existing chains a full sync
    /// keeps as they are when they are endpoint chains): a kept empty endpoint chain would
    /// let its share of the service's packets fall through, undNATed, for as long as the
    /// endpoint lasts. Empty are the chains this proxier flushed as stale and — on its first
    /// sync, which does not know what an earlier process flushed — those the backend
    /// reports without rules (every endpoint chain when it cannot tell). Only endpoint chains
    /// are kept, so the backend is asked only when the table has some.
    fn forget_empty_chains(
        &self,
        chains: &mut BTreeSet<String>,
        backend: &mut dyn NftBackend,
    ) -> Result<(), String> {
        chains.retain(|c| !self.stale_chains.contains_key(c));
        if self.base_chains_recreated || !chains.iter().any(|c| is_endpoint_chain(c)) {
            return Ok(());
        }
        match backend.list_empty_chains()? {
            Some(empty) => empty.iter().for_each(|c| {
                chains.remove(c);
            }),
            None => chains.retain(|c| !is_endpoint_chain(c)),
        }
        Ok(())
    }

    /// The canary/consistency check before a partial sync: `Some(what)` when the table was
    /// changed from outside, so the sync must be full. Checked: every base chain, the
    /// `services` chain and the `cluster-ips` set exist (`nft delete table`, a deleted
    /// chain), and every static chain holds exactly the rules the last full sync wrote
    /// (`nft flush table`, `nft flush chain`, a rule deleted or added by someone else).
    ///
    /// Upstream's nftables proxier has no such check (KEP-3866: every component owns its
    /// table; a full resync runs every hour, as here); its iptables mode
    /// polls a canary chain. kproxy's partial syncs only write changed services, so without
    /// this an outside change would last until the next full sync. Costs one small rule
    /// dump per static chain (a chain and set listing only for a backend that cannot count
    /// rules); map elements are not compared (a flushed map is repaired by the next full
    /// sync).
    fn outside_change(&self, backend: &mut dyn NftBackend) -> Result<Option<String>, String> {
        // The rule counts first: every base chain and `services` hold rules after a full
        // sync, and `cluster-ips` cannot go while `cluster-ips-check` refers to it, so when
        // the backend counts rules, a missing chain or set shows as a count of 0 and the
        // table need not be listed (60k chains at 10k services).
        let mut counted = !self.static_rules.is_empty();
        for (chain, want) in &self.static_rules {
            match backend.rule_count(chain)? {
                Some(n) if n != *want => {
                    return Ok(Some(format!(
                        "chain {chain} holds {n} rules, the last full sync wrote {want}"
                    )));
                }
                Some(_) => {}
                None => counted = false,
            }
        }
        if counted {
            return Ok(None);
        }
        let (chains, sets) = match &self.known {
            Some((c, s)) => (c.clone(), s.clone()),
            None => (
                backend.list_chains()?.into_iter().collect(),
                backend
                    .list_sets()?
                    .into_iter()
                    .collect::<BTreeSet<String>>(),
            ),
        };
        let missing = BASE_CHAINS
            .iter()
            .map(|(name, ..)| *name)
            .chain([SERVICES])
            .find(|c| !chains.contains(*c));
        if let Some(c) = missing {
            return Ok(Some(format!("chain {c} is missing")));
        }
        if !sets.contains(CLUSTER_IPS) {
            return Ok(Some(format!("set {CLUSTER_IPS} is missing")));
        }
        Ok(None)
    }

    /// Flushes service chains no longer in use (recording them stale) and deletes affinity
    /// sets no longer in use. Upstream re-flushes an already stale chain on every sync and
    /// restarts its clock; kproxy flushes it once and keeps its first stale time, so a chain
    /// is deleted one second after it became unused even when syncs come faster.
    fn stale_objects(
        &mut self,
        tx: &mut Transaction,
        active_chains: &BTreeSet<String>,
        active_sets: &BTreeSet<String>,
        now: Duration,
        (chains, sets): (&BTreeSet<String>, &BTreeSet<String>),
    ) {
        for chain in chains {
            if !is_service_chain(chain) {
                continue;
            }
            if active_chains.contains(chain) {
                if !self.stale_chains.is_empty() {
                    self.stale_chains.remove(chain);
                }
            } else if !self.stale_chains.contains_key(chain) {
                tx.flush(Object::chain(chain.as_str()));
                self.stale_chains.insert(chain.clone(), now);
            }
        }
        for set in sets {
            if is_affinity_set(set) && !active_sets.contains(set) {
                tx.delete(Object::Set {
                    name: set.clone(),
                    spec: Default::default(),
                });
            }
        }
    }

    /// [`Self::stale_objects`] for a partial sync, from what the rewritten service ports
    /// held before and hold now (the other ports hold what they held, and every other chain
    /// of the table is static or stale already): the same operations, in the same order.
    fn stale_rewritten(
        &mut self,
        tx: &mut Transaction,
        r: &Rewritten,
        now: Duration,
        (chains, sets): (&BTreeSet<String>, &BTreeSet<String>),
    ) {
        if !self.stale_chains.is_empty() {
            for chain in &r.after.0 {
                self.stale_chains.remove(chain);
            }
        }
        for chain in r.before.0.difference(&r.after.0) {
            if chains.contains(chain) && !self.stale_chains.contains_key(chain) {
                tx.flush(Object::chain(chain.as_str()));
                self.stale_chains.insert(chain.clone(), now);
            }
        }
        for set in r.before.1.difference(&r.after.1) {
            if sets.contains(set) {
                tx.delete(Object::Set {
                    name: set.clone(),
                    spec: Default::default(),
                });
            }
        }
    }
}

/// A sync's transaction before the stale-object handling and the element cleanup.
struct SyncPlan {
    tx: Transaction,
    /// Where each service port's operations start (full syncs, [`split_points`]).
    port_starts: Vec<usize>,
    in_use: InUse,
}

/// What a plan tells about the service chains and affinity sets in use.
enum InUse {
    /// A full sync: all of them.
    All(BTreeSet<String>, BTreeSet<String>),
    /// A partial sync: what the rewritten service ports held before and hold now.
    Rewritten(Rewritten),
}

/// Chains and affinity sets of the service ports a partial sync rewrote, before and after.
#[derive(Default)]
struct Rewritten {
    before: (BTreeSet<String>, BTreeSet<String>),
    after: (BTreeSet<String>, BTreeSet<String>),
}

/// What every service port holds in the table ([`PortRecord`]s), and the no-local-endpoints
/// counts over them.
#[derive(Debug, Clone, Default)]
struct Held {
    records: BTreeMap<ServicePortName, PortRecord>,
    no_local_internal: usize,
    no_local_external: usize,
}

impl Held {
    fn insert(&mut self, port: ServicePortName, record: PortRecord) {
        self.no_local_internal += usize::from(record.no_local_internal);
        self.no_local_external += usize::from(record.no_local_external);
        if let Some(old) = self.records.insert(port, record) {
            self.forget(&old);
        }
    }

    fn remove(&mut self, port: &ServicePortName) -> PortRecord {
        let record = self.records.remove(port).unwrap_or_default();
        self.forget(&record);
        record
    }

    fn forget(&mut self, record: &PortRecord) {
        self.no_local_internal -= usize::from(record.no_local_internal);
        self.no_local_external -= usize::from(record.no_local_external);
    }

    /// The service ports holding any of `keys` (one scan of every port: called only when a
    /// partial sync released keys that other service ports hold too).
    fn holders_of(&self, keys: &BTreeSet<(Store, String)>) -> Vec<ServicePortName> {
        if keys.is_empty() {
            return vec![];
        }
        self.records
            .iter()
            .filter(|(_, r)| r.elements.iter().any(|e| keys.contains(e)))
            .map(|(port, _)| port.clone())
            .collect()
    }

    /// Every chain and affinity set a service port holds.
    fn in_use(&self) -> (BTreeSet<String>, BTreeSet<String>) {
        let mut out = (BTreeSet::new(), BTreeSet::new());
        for r in self.records.values() {
            out.0.extend(r.chains.iter().cloned());
            out.1.extend(r.affinity_sets.iter().cloned());
        }
        out
    }
}

/// The entries of `map` for the ports of service `ns`/`name`: consecutive, as port names
/// sort by namespace, name, port and protocol, and none sorts before port `""` with
/// [`Protocol::Tcp`] (the first protocol).
fn ports_of<'m, V>(
    map: &'m BTreeMap<ServicePortName, V>,
    ns: &'m str,
    name: &'m str,
) -> impl Iterator<Item = (&'m ServicePortName, &'m V)> + 'm {
    let from = ServicePortName::new(
        ns.to_string(),
        name.to_string(),
        String::new(),
        Protocol::Tcp,
    );
    map.range(from..)
        .take_while(move |(k, _)| k.namespace == ns && k.name == name)
}

/// The size of the parts a full sync's transaction is committed in (operations, see
/// [`split_points`]), chosen by measurement (bench/nftables-speed.md).
pub(crate) const FULL_SYNC_BATCH_OPERATIONS: usize = 20_000;

/// Where to cut a full sync's transaction (operation indices, ascending, none at 0): at the
/// start of a service port (`port_starts`), once the current part holds at least `budget`
/// operations. The first part holds the static setup, the last one the cleanup (stale
/// chains flushed, leftover elements and affinity sets deleted).
///
/// Why committing a full sync in parts is safe: the planner writes each service port's
/// operations together — its chains (added and flushed), its map and set elements (an
/// element whose value changes is deleted and re-added in place), its rules — and nothing
/// outside that run of operations refers to its chains except the cleanup at the end, which
/// flushes chains only after every element that pointed to them was replaced or deleted.
/// A cut between two service ports therefore leaves every service either as the previous
/// sync left it or as this sync wants it, each whole: its element points to a chain that
/// already holds all its rules, and its ClusterIP enters `cluster-ips` (whose
/// `cluster-ips-check` rejects ports of ClusterIPs without a `service-ips` element) in the
/// same part as its `service-ips` element. The static part (base chains, dispatch rules,
/// the sets and maps) is written whole in the first part. A part that fails leaves the
/// next sync full; it reads the kernel's chains and elements again.
///
/// Why: the kernel re-walks the whole pending transaction for every anonymous set it binds
/// (`__nft_set_trans_bind`, once per `numgen … vmap` rule), so one transaction of n
/// services costs O(n²); parts of a bounded size make it O(n) (see the module docs).
pub fn split_points(port_starts: &[usize], budget: usize) -> Vec<usize> {
    let mut cuts = vec![];
    let mut from = 0;
    for &at in port_starts {
        if at > from && at - from >= budget {
            cuts.push(at);
            from = at;
        }
    }
    cuts
}

/// `tx` cut at `cuts` ([`split_points`]) into consecutive transactions.
pub fn split(tx: &Transaction, cuts: &[usize]) -> Vec<Transaction> {
    let mut out = vec![];
    let mut from = 0;
    for &at in cuts.iter().chain([&tx.ops.len()]) {
        let mut part = Transaction::new(&tx.family, &tx.table);
        part.ops = tx.ops[from..at].to_vec();
        out.push(part);
        from = at;
    }
    out
}

/// Rules per static (non-service) chain that a full sync's transaction leaves: every static
/// chain is flushed by the full sync before its rules are added, so the adds are the count.
fn static_rule_counts(tx: Option<&Transaction>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for op in tx.map(|t| t.ops.as_slice()).unwrap_or_default() {
        match (&op.verb, &op.object) {
            (Verb::Add, Object::Rule { chain, .. }) if !is_service_chain(chain) => {
                *out.entry(chain.clone()).or_insert(0) += 1;
            }
            (Verb::Add, Object::Chain { name, .. }) if !is_service_chain(name) => {
                out.entry(name.clone()).or_insert(0);
            }
            _ => {}
        }
    }
    out
}

/// The whole table `snap` gives under `cfg` (a full sync into an empty table), as `nft -f`
/// text in upstream's canonical order.
pub fn render(snap: &Snapshot, cfg: &NftablesConfig) -> Result<String, NftSyncError> {
    let mut table = FakeTable::new(cfg.table_family(), TABLE);
    let mut p = NftablesProxier::new(cfg.clone());
    p.sync(snap, &ChangedSet::default(), Duration::ZERO, &mut table)?;
    Ok(super::transaction::canonical_sort(&table.dump()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::netfilter::local_detect::LocalDetector;
    use crate::dataplane::nftables::transaction::Op;
    use crate::model::testing::{SnapshotBuilder, endpoint, port_name, service_port, snapshot};
    use crate::model::{Endpoint, IpFamily};

    fn cfg(family: IpFamily) -> NftablesConfig {
        NftablesConfig::new(
            family,
            LocalDetector::Cidr(match family {
                IpFamily::V4 => "10.0.0.0/8".parse().unwrap(),
                IpFamily::V6 => "fd00:10::/64".parse().unwrap(),
            }),
        )
    }

    fn two_services(second_ep: &str) -> Snapshot {
        snapshot("n")
            .service(
                service_port("ns1", "a", "p")
                    .cluster_ip("172.30.0.1")
                    .build(),
                vec![endpoint("10.0.1.1", 80).build()],
            )
            .service(
                service_port("ns2", "b", "p")
                    .cluster_ip("172.30.0.2")
                    .affinity(Some(60))
                    .build(),
                vec![endpoint(second_ep, 80).build()],
            )
            .build()
    }

    fn changed(names: &[(&str, &str)]) -> ChangedSet {
        ChangedSet {
            services: names
                .iter()
                .map(|(ns, n)| port_name(ns, n, "p", Protocol::Tcp))
                .collect(),
            node: false,
        }
    }

    /// A backend whose next `run` fails.
    struct Failing<'a>(&'a mut FakeTable, bool);
    impl NftBackend for Failing<'_> {
        fn list_chains(&mut self) -> Result<Vec<String>, String> {
            Ok(FakeTable::list_chains(self.0))
        }
        fn list_sets(&mut self) -> Result<Vec<String>, String> {
            Ok(FakeTable::list_sets(self.0))
        }
        fn list_elements(&mut self, s: &str) -> Result<Vec<(String, Option<String>)>, String> {
            Ok(FakeTable::list_elements(self.0, s))
        }
        fn run(&mut self, tx: &Transaction) -> Result<(), String> {
            if std::mem::take(&mut self.1) {
                return Err("injected".into());
            }
            self.0.apply(tx).map_err(|e| e.to_string())
        }
    }

    #[test]
    fn partial_sync_writes_only_the_changed_service() {
        let mut t = FakeTable::new("ip", TABLE);
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        p.sync(
            &two_services("10.0.2.1"),
            &ChangedSet::default(),
            Duration::ZERO,
            &mut t,
        )
        .expect("full");
        assert!(!p.next_sync_is_full());
        let s = p
            .sync(
                &two_services("10.0.2.2"),
                &changed(&[("ns2", "b")]),
                Duration::ZERO,
                &mut t,
            )
            .expect("partial");
        assert!(!s.full);
        let tx = p.last_transaction.as_ref().expect("tx").to_string();
        assert!(!tx.contains("ns1/a"), "unchanged service rewritten:\n{tx}");
        assert!(tx.contains("dnat to 10.0.2.2:80"), "{tx}");
        // The old endpoint chain is flushed and stale; its affinity set deleted right away.
        assert!(tx.contains("flush chain ip kube-proxy endpoint-"), "{tx}");
        assert!(tx.contains("delete set ip kube-proxy affinity-"), "{tx}");
        assert_eq!(p.stale_chains.len(), 1);
        assert_eq!(
            t.list_sets()
                .iter()
                .filter(|s| s.starts_with("affinity-"))
                .count(),
            1
        );
    }

    /// A backend over a [`FakeTable`] that records what it was asked.
    #[derive(Default)]
    struct Recording {
        table: Option<FakeTable>,
        runs: Vec<Transaction>,
        listings: usize,
        fail_with_deletions: bool,
    }
    impl Recording {
        fn new() -> Self {
            Recording {
                table: Some(FakeTable::new("ip", TABLE)),
                ..Default::default()
            }
        }
        fn t(&mut self) -> &mut FakeTable {
            self.table.as_mut().unwrap()
        }
    }
    impl NftBackend for Recording {
        fn list_chains(&mut self) -> Result<Vec<String>, String> {
            self.listings += 1;
            Ok(FakeTable::list_chains(self.t()))
        }
        fn list_sets(&mut self) -> Result<Vec<String>, String> {
            self.listings += 1;
            Ok(FakeTable::list_sets(self.t()))
        }
        fn list_elements(&mut self, s: &str) -> Result<Vec<(String, Option<String>)>, String> {
            Ok(FakeTable::list_elements(self.t(), s))
        }
        fn rule_count(&mut self, chain: &str) -> Result<Option<usize>, String> {
            NftBackend::rule_count(self.t(), chain)
        }
        fn run(&mut self, tx: &Transaction) -> Result<(), String> {
            let deletes_chain = tx
                .ops
                .iter()
                .any(|o| o.verb == Verb::Delete && matches!(o.object, Object::Chain { .. }));
            if self.fail_with_deletions && deletes_chain {
                return Err("chain in use".into());
            }
            self.runs.push(tx.clone());
            self.t().apply(tx).map_err(|e| e.to_string())
        }
    }

    /// `n` services of 3 endpoints each.
    fn many_services(n: u32) -> Snapshot {
        let mut b = snapshot("n");
        for i in 0..n {
            b = b.service(
                service_port("ns", &format!("s{i}"), "p")
                    .cluster_ip(&format!("172.30.1.{i}"))
                    .build(),
                (1..=3)
                    .map(|j| endpoint(&format!("10.1.{i}.{j}"), 80).build())
                    .collect(),
            );
        }
        b.build()
    }

    #[test]
    fn split_points_cut_at_port_starts_once_the_budget_is_reached() {
        assert_eq!(split_points(&[10, 15, 22, 30, 41], 10), vec![10, 22, 41]);
        assert_eq!(split_points(&[10, 15], usize::MAX), Vec::<usize>::new());
        assert_eq!(split_points(&[0, 3], 1), vec![3], "never a cut at 0");
        let mut tx = Transaction::new("ip", TABLE);
        for i in 0..5 {
            tx.add(Object::chain(format!("c{i}")));
        }
        let parts = split(&tx, &[2, 4]);
        assert_eq!(
            parts.iter().map(|p| p.ops.len()).collect::<Vec<_>>(),
            [2, 2, 1]
        );
    }

    /// A full sync in parts leaves the table a single transaction gives, every part cut
    /// where a service port's operations start, the setup whole in the first part.
    #[test]
    fn a_full_sync_in_parts_gives_the_same_table() {
        let snap = many_services(20);
        let mut one = Recording::new();
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        p.batch_operations = usize::MAX;
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut one)
            .expect("one");
        assert_eq!(one.runs.len(), 1);
        let whole = one.runs[0].clone();
        let mut parts = Recording::new();
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        p.batch_operations = 50;
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut parts)
            .expect("parts");
        assert!(parts.runs.len() > 3, "{} parts", parts.runs.len());
        assert_eq!(
            canonical(parts.t()),
            canonical(one.t()),
            "same table either way"
        );
        let ops: Vec<Op> = parts.runs.iter().flat_map(|r| r.ops.clone()).collect();
        assert_eq!(ops, whole.ops, "the same operations in the same order");
        assert!(
            parts.runs[0]
                .ops
                .iter()
                .any(|o| matches!(&o.object, Object::Rule { chain, .. } if chain == SERVICES))
        );
        for r in &parts.runs[1..] {
            match &r.ops[0].object {
                Object::Chain { name, .. } => {
                    assert!(name.starts_with("endpoint-"), "part starts at {name}")
                }
                o => panic!("part starts with {o:?}"),
            }
        }
        // Partial syncs are never cut.
        let next = many_services(19);
        let before = parts.runs.len();
        p.sync(
            &next,
            &changed(&[("ns", "s19")]),
            Duration::ZERO,
            &mut parts,
        )
        .expect("partial");
        assert_eq!(parts.runs.len(), before + 1);
    }

    #[test]
    fn partial_syncs_list_nothing_and_stale_chains_go_in_the_sync_transaction() {
        let mut b = Recording::new();
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        let ms = Duration::from_millis;
        p.sync(
            &two_services("10.0.2.1"),
            &ChangedSet::default(),
            ms(0),
            &mut b,
        )
        .expect("full");
        let listed = b.listings;
        assert!(listed > 0, "a full sync lists the table");
        // a's second endpoint moves: its old chain is flushed (stale).
        p.sync(
            &two_services("10.0.2.9"),
            &changed(&[("ns2", "b")]),
            ms(100),
            &mut b,
        )
        .expect("partial");
        assert_eq!(p.stale_chains.len(), 1);
        let runs = b.runs.len();
        // More than a second later, another change: one transaction deletes the stale
        // chain first, then writes the change.
        p.sync(
            &two_services("10.0.2.8"),
            &changed(&[("ns2", "b")]),
            ms(1200),
            &mut b,
        )
        .expect("partial");
        assert_eq!(b.runs.len(), runs + 1, "one nft run");
        let tx = b.runs.last().unwrap().to_string();
        assert!(
            tx.starts_with("delete chain ip kube-proxy endpoint-") && tx.contains("10.0.2.1"),
            "{tx}"
        );
        assert!(tx.contains("dnat to 10.0.2.8:80"), "{tx}");
        assert_eq!(p.stats.stale_chains_deleted, 1);
        assert_eq!(b.listings, listed, "partial syncs list nothing");
        assert!(
            FakeTable::list_chains(b.t())
                .iter()
                .all(|c| !c.contains("10.0.2.1"))
        );
        // The next full sync leaves what a fresh one into an empty table gives.
        p.force_full_sync();
        p.sync(
            &two_services("10.0.2.8"),
            &ChangedSet::default(),
            ms(2500),
            &mut b,
        )
        .expect("full");
        p.sync(
            &two_services("10.0.2.8"),
            &ChangedSet::default(),
            ms(4000),
            &mut b,
        )
        .expect("cleanup");
        assert_eq!(
            render(&two_services("10.0.2.8"), &p.cfg).expect("render"),
            canonical(b.t())
        );
    }

    #[test]
    fn a_failed_stale_chain_deletion_leaves_the_sync_to_run_alone() {
        let mut b = Recording::new();
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        let ms = Duration::from_millis;
        p.sync(
            &two_services("10.0.2.1"),
            &ChangedSet::default(),
            ms(0),
            &mut b,
        )
        .expect("full");
        p.sync(
            &two_services("10.0.2.9"),
            &changed(&[("ns2", "b")]),
            ms(100),
            &mut b,
        )
        .expect("partial");
        b.fail_with_deletions = true;
        let s = p
            .sync(
                &two_services("10.0.2.8"),
                &changed(&[("ns2", "b")]),
                ms(1200),
                &mut b,
            )
            .expect("the change still goes in");
        assert!(!s.full && s.stale_chains_deleted == 0, "{s:?}");
        assert_eq!(p.cleanup_failures, 1);
        assert!(canonical(b.t()).contains("dnat to 10.0.2.8:80"));
        // The next sync lists the table again and finds the chain, still flushed.
        b.fail_with_deletions = false;
        let listed = b.listings;
        p.sync(
            &two_services("10.0.2.8"),
            &ChangedSet::default(),
            ms(1300),
            &mut b,
        )
        .expect("partial");
        assert!(b.listings > listed);
        assert!(p.stale_chains.keys().any(|c| c.contains("10.0.2.1")));
    }

    #[test]
    fn stale_chains_are_deleted_after_more_than_a_second() {
        let mut t = FakeTable::new("ip", TABLE);
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        let snap = two_services("10.0.2.1");
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        let gone = snapshot("n").build();
        let ms = Duration::from_millis;
        let all = changed(&[("ns1", "a"), ("ns2", "b")]);
        p.sync(&gone, &all, ms(500), &mut t).expect("remove");
        assert_eq!(p.stale_chains.len(), 4, "2 service + 2 endpoint chains");
        assert_eq!(
            t.list_chains().iter().filter(|c| c.contains('/')).count(),
            4
        );
        let s = p
            .sync(&gone, &ChangedSet::default(), ms(1500), &mut t)
            .expect("1 s");
        assert_eq!(
            s.stale_chains_deleted, 0,
            "exactly 1 s is not yet stale enough"
        );
        assert_eq!(s.operations, 0, "stale chains are flushed once, not again");
        let s = p
            .sync(&gone, &ChangedSet::default(), ms(1501), &mut t)
            .expect("later");
        assert_eq!(s.stale_chains_deleted, 4);
        assert!(FakeTable::list_chains(&t).iter().all(|c| !c.contains('/')));
        assert!(p.stale_chains.is_empty());
    }

    #[test]
    fn a_failed_sync_makes_the_next_one_full() {
        let mut t = FakeTable::new("ip", TABLE);
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        let snap = two_services("10.0.2.1");
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        let before = t.dump();
        let next = two_services("10.0.2.9");
        let err = p
            .sync(
                &next,
                &changed(&[("ns2", "b")]),
                Duration::ZERO,
                &mut Failing(&mut t, true),
            )
            .expect_err("injected failure");
        assert!(err.to_string().contains("injected"));
        assert_eq!(t.dump(), before, "nothing applied");
        assert!(p.next_sync_is_full() && p.stale_chains.is_empty());
        let s = p
            .sync(&next, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full resync");
        assert!(s.full);
        assert!(t.dump().contains("dnat to 10.0.2.9:80"));
        // Once the old endpoint's flushed chain is gone, the table is what a fresh full
        // sync into an empty table gives.
        assert_eq!(p.stale_chains.len(), 1);
        p.sync(
            &next,
            &ChangedSet::default(),
            Duration::from_secs(2),
            &mut t,
        )
        .expect("cleanup");
        assert_eq!(render(&next, &p.cfg).expect("render"), canonical(&t));
    }

    fn canonical(t: &FakeTable) -> String {
        super::super::transaction::canonical_sort(&t.dump())
    }

    #[test]
    fn ipv6_table_uses_ip6_matches() {
        let snap = snapshot("n")
            .service(
                service_port("ns", "s", "p")
                    .cluster_ip("fd00:172:30::41")
                    .node_port(3001)
                    .build(),
                vec![endpoint("fd00:10:180::1", 80).build()],
            )
            .build();
        let out = render(&snap, &cfg(IpFamily::V6)).expect("render");
        for want in [
            "add table ip6 kube-proxy { comment \"rules for kube-proxy\" ; }",
            "add rule ip6 kube-proxy services fib daddr type local ip6 daddr != ::1 meta l4proto . th dport vmap @service-nodeports",
            "add element ip6 kube-proxy service-ips { fd00:172:30::41 . tcp . 80 : goto service-",
            "ip6 daddr fd00:172:30::41 ip6 saddr != fd00:10::/64 jump mark-for-masquerade",
            "meta l4proto tcp dnat to [fd00:10:180::1]:80",
        ] {
            assert!(out.contains(want), "{want} missing:\n{out}");
        }
        assert!(
            !out.contains("nodeport-ips"),
            "match-all deletes the set:\n{out}"
        );
        // A v4-only service is not in the v6 table.
        let v4 = snapshot("n")
            .service(
                service_port("ns", "s", "p")
                    .cluster_ip("172.30.0.1")
                    .build(),
                vec![],
            )
            .build();
        assert!(
            !render(&v4, &cfg(IpFamily::V6))
                .expect("render")
                .contains("add element ip6 kube-proxy cluster-ips")
        );
    }

    #[test]
    fn first_sync_recreates_base_chains_of_another_priority() {
        let mut t = FakeTable::new("ip", TABLE);
        t.load(
            "add table ip kube-proxy\nadd chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -90 ; }\nadd chain ip kube-proxy old\nadd rule ip kube-proxy nat-prerouting jump old\n",
        )
        .expect("load");
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        let snap = two_services("10.0.2.1");
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("first sync replaces the chain");
        let c = &t.chains["nat-prerouting"];
        assert_eq!(c.base.as_ref().map(|b| b.priority), Some(-100));
        assert_eq!(c.rules.len(), 1, "only `jump services`: {:?}", c.rules);
        // Only the first sync recreates them.
        p.force_full_sync();
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        let tx = p.last_transaction.as_ref().expect("tx").to_string();
        assert!(
            !tx.contains("delete chain ip kube-proxy nat-prerouting"),
            "{tx}"
        );
    }

    #[test]
    fn a_table_deleted_from_outside_makes_the_next_sync_full() {
        let mut t = FakeTable::new("ip", TABLE);
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        let snap = two_services("10.0.2.1");
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        let want = canonical(&t);
        // Nothing changed: a partial sync that writes nothing.
        let s = p
            .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("partial");
        assert!(!s.full && s.operations == 0, "{s:?}");
        // `nft delete table ip kube-proxy`.
        t.load("delete table ip kube-proxy\n").expect("delete");
        assert!(FakeTable::list_chains(&t).is_empty());
        let s = p
            .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("repair");
        assert!(s.full, "{s:?}");
        assert_eq!(canonical(&t), want);
    }

    /// The canary beyond a deleted table: a flushed table (rules gone, chains kept), one
    /// flushed base chain, a rule added to a static chain by someone else. Each makes the
    /// next partial sync full and restores the table; an untouched table does not.
    #[test]
    fn rules_changed_from_outside_make_the_next_sync_full() {
        let snap = two_services("10.0.2.1");
        for (outside, what) in [
            (
                "flush table ip kube-proxy\n",
                "holds 0 rules, the last full sync wrote",
            ),
            (
                "flush chain ip kube-proxy nat-prerouting\n",
                "nat-prerouting holds 0",
            ),
            (
                "add rule ip kube-proxy services drop\n",
                "services holds 3 rules",
            ),
        ] {
            let mut t = FakeTable::new("ip", TABLE);
            let mut p = NftablesProxier::new(cfg(IpFamily::V4));
            p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
                .expect("full");
            let want = canonical(&t);
            assert_eq!(p.outside_change(&mut t).unwrap(), None, "{outside}");
            let s = p
                .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
                .expect("partial");
            assert!(!s.full, "untouched table: {s:?}");
            t.load(outside).expect("outside change");
            let change = p.outside_change(&mut t).unwrap().expect(outside);
            assert!(change.contains(what), "{outside}: {change}");
            let s = p
                .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
                .expect("repair");
            assert!(s.full, "{outside}: {s:?}");
            assert_eq!(p.outside_changes, 1);
            assert_eq!(canonical(&t), want, "{outside}");
        }
    }

    #[test]
    fn service_cidrs_of_the_snapshot_replace_the_configured_ones() {
        let drop_rules = |t: &FakeTable| -> Vec<String> {
            canonical(t)
                .lines()
                .filter(|l| l.contains("Drop traffic to unallocated ClusterIPs"))
                .map(String::from)
                .collect()
        };
        let mut t = FakeTable::new("ip", TABLE);
        let mut c = cfg(IpFamily::V4);
        c.service_cidrs = vec!["172.30.0.0/16".parse().unwrap()];
        let mut p = NftablesProxier::new(c);
        // No ServiceCIDRs delivered: the configured CIDRs.
        let mut snap = two_services("10.0.2.1");
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        assert_eq!(
            drop_rules(&t),
            [
                "add rule ip kube-proxy cluster-ips-check ip daddr { 172.30.0.0/16 } drop comment \"Drop traffic to unallocated ClusterIPs\""
            ]
        );
        // The API's: this family's ones, at once (a full sync).
        snap.service_cidrs = Some(vec![
            "172.30.0.0/16".parse().unwrap(),
            "172.31.0.0/16".parse().unwrap(),
            "fd00:10:96::/112".parse().unwrap(),
        ]);
        let s = p
            .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("sync");
        assert!(s.full, "{s:?}");
        assert_eq!(
            drop_rules(&t),
            [
                "add rule ip kube-proxy cluster-ips-check ip daddr { 172.30.0.0/16,172.31.0.0/16 } drop comment \"Drop traffic to unallocated ClusterIPs\""
            ]
        );
        // Unchanged: partial syncs again.
        let s = p
            .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("sync");
        assert!(!s.full, "{s:?}");
        // Served but none: no drop rule.
        snap.service_cidrs = Some(vec![]);
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("sync");
        assert!(drop_rules(&t).is_empty(), "{}", canonical(&t));
    }

    #[test]
    fn a_config_change_makes_the_next_sync_full() {
        let mut t = FakeTable::new("ip", TABLE);
        let mut c = cfg(IpFamily::V4);
        c.node_port_addresses = vec!["192.168.0.0/24".parse().unwrap()];
        c.local_addresses = vec!["192.168.0.2".parse().unwrap()];
        let mut p = NftablesProxier::new(c.clone());
        let snap = two_services("10.0.2.1");
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        p.set_config(c.clone());
        assert!(!p.next_sync_is_full(), "same settings");
        c.local_addresses.push("192.168.0.3".parse().unwrap());
        p.set_config(c);
        assert!(p.next_sync_is_full());
        p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        assert_eq!(t.list_elements("nodeport-ips").len(), 2);
    }

    /// The rules of every chain whose name contains `ip` (an endpoint's chain).
    fn endpoint_rules(t: &FakeTable, ip: &str) -> Vec<Vec<String>> {
        t.chains
            .iter()
            .filter(|(n, _)| n.starts_with("endpoint-") && n.contains(ip))
            .map(|(_, c)| c.rules.iter().map(|(r, _)| r.clone()).collect())
            .collect()
    }

    /// One service without affinity (a kept endpoint chain needs no affinity set).
    fn one_service(ep: &str) -> Snapshot {
        snapshot("n")
            .service(
                service_port("ns1", "a", "p")
                    .cluster_ip("172.30.0.1")
                    .build(),
                vec![endpoint("10.0.1.1", 80).build(), endpoint(ep, 80).build()],
            )
            .build()
    }

    /// a's second endpoint moves from 10.0.2.1 to 10.0.2.2 in a partial sync: 10.0.2.1's
    /// chain is flushed (stale, not yet deleted).
    fn with_a_flushed_endpoint_chain() -> (NftablesProxier, FakeTable) {
        let mut t = FakeTable::new("ip", TABLE);
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        p.sync(
            &one_service("10.0.2.1"),
            &ChangedSet::default(),
            Duration::ZERO,
            &mut t,
        )
        .expect("full");
        p.sync(
            &one_service("10.0.2.2"),
            &changed(&[("ns1", "a")]),
            Duration::ZERO,
            &mut t,
        )
        .expect("partial");
        assert_eq!(endpoint_rules(&t, "10.0.2.1"), vec![Vec::<String>::new()]);
        (p, t)
    }

    #[test]
    fn a_full_sync_rewrites_an_endpoint_chain_it_flushed() {
        let (mut p, mut t) = with_a_flushed_endpoint_chain();
        p.force_full_sync();
        p.sync(
            &one_service("10.0.2.1"),
            &ChangedSet::default(),
            Duration::ZERO,
            &mut t,
        )
        .expect("full");
        let rules = endpoint_rules(&t, "10.0.2.1");
        assert_eq!(rules.len(), 1);
        assert!(
            rules[0].iter().any(|r| r.contains("dnat to 10.0.2.1:80")),
            "{rules:?}"
        );
    }

    #[test]
    fn a_new_proxier_rewrites_an_endpoint_chain_an_earlier_one_flushed() {
        let (_, mut t) = with_a_flushed_endpoint_chain();
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        p.sync(
            &one_service("10.0.2.1"),
            &ChangedSet::default(),
            Duration::ZERO,
            &mut t,
        )
        .expect("full");
        let rules = endpoint_rules(&t, "10.0.2.1");
        assert!(
            rules[0].iter().any(|r| r.contains("dnat to 10.0.2.1:80")),
            "{rules:?}"
        );
        // 10.0.1.1's endpoint chain held its rules: kept as it is (not in the transaction).
        let tx = p.last_transaction.as_ref().expect("tx").to_string();
        assert!(!tx.contains("dnat to 10.0.1.1:80"), "{tx}");
    }

    /// Service `i`'s ports at `step` of [`churn`]: one or two ports (an `http` one and at
    /// times a `dns` one over UDP, sharing the ClusterIP), 0–3 endpoints, affinity or not, a
    /// node port or not, eTP Local or not, all varying with the step.
    fn churned_service(i: u32, step: u32, b: SnapshotBuilder) -> SnapshotBuilder {
        let v = (i * 7 + step * 3) % 11;
        if v == 10 {
            return b; // absent at this step
        }
        let ip = format!("172.30.2.{i}");
        let eps = |n: u32, port: u16| -> Vec<Endpoint> {
            (0..n)
                .map(|j| {
                    endpoint(format!("10.2.{i}.{}", (j + v) % 4).as_str(), port)
                        .local_on("n", "other", j == 0)
                        .build()
                })
                .collect()
        };
        let http = service_port("ns", &format!("s{i}"), "http")
            .cluster_ip(ip.as_str())
            .affinity(v.is_multiple_of(3).then_some(30))
            .node_port(if v.is_multiple_of(2) {
                30_000 + i as u16
            } else {
                0
            })
            .external_policy_local(v % 4 == 1)
            .build();
        let b = b.service(http, eps(v % 4, 80));
        if v % 5 < 2 {
            return b;
        }
        let dns = service_port("ns", &format!("s{i}"), "dns")
            .protocol(Protocol::Udp)
            .port(53)
            .cluster_ip(ip.as_str())
            .build();
        b.service(dns, eps((v + 1) % 3, 53))
    }

    fn churn(step: u32) -> Snapshot {
        (0..8)
            .fold(snapshot("n"), |b, i| churned_service(i, step, b))
            .build()
    }

    /// The ports whose service or endpoints differ between `a` and `b` (the tracker's
    /// `ChangedSet`).
    fn differences(a: &Snapshot, b: &Snapshot) -> ChangedSet {
        let names: BTreeSet<&ServicePortName> =
            a.services.keys().chain(b.services.keys()).collect();
        ChangedSet {
            services: names
                .into_iter()
                .filter(|n| {
                    a.services.get(*n) != b.services.get(*n)
                        || a.endpoints_of(n) != b.endpoints_of(n)
                })
                .cloned()
                .collect(),
            node: false,
        }
    }

    /// Partial syncs plan only the changed services (and release what they held), yet every
    /// one leaves the table a full sync of the same snapshot leaves — once the chains it
    /// flushed are deleted — and the same service-port and no-local-endpoint counts; ports
    /// of a service come and go, endpoints, affinity, node ports and policies change.
    #[test]
    fn partial_syncs_leave_what_a_full_sync_leaves() {
        let mut t = FakeTable::new("ip", TABLE);
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        let mut now = Duration::ZERO;
        let mut prev = churn(0);
        p.sync(&prev, &ChangedSet::default(), now, &mut t)
            .expect("full");
        let mut partial = 0;
        for step in 1..=24 {
            let snap = churn(step);
            let changed = differences(&prev, &snap);
            now += Duration::from_millis(100);
            let s = p.sync(&snap, &changed, now, &mut t).expect("partial");
            assert!(!s.full, "step {step}");
            partial += usize::from(!changed.services.is_empty());
            // Every chain the transaction writes rules into is a changed service's.
            for op in &p.last_transaction.as_ref().expect("tx").ops {
                if let (Verb::Add, Object::Rule { chain, .. }) = (&op.verb, &op.object) {
                    assert!(
                        changed
                            .services
                            .iter()
                            .any(|n| chain.contains(&format!("ns/{}/", n.name))),
                        "step {step}: {chain} is not a changed service's"
                    );
                }
            }
            now += Duration::from_secs(2);
            let s = p
                .sync(&snap, &ChangedSet::default(), now, &mut t)
                .expect("stale chains deleted");
            assert!(p.stale_chains.is_empty(), "step {step}");
            let mut fresh_table = FakeTable::new("ip", TABLE);
            let mut fresh = NftablesProxier::new(cfg(IpFamily::V4));
            let want = fresh
                .sync(
                    &snap,
                    &ChangedSet::default(),
                    Duration::ZERO,
                    &mut fresh_table,
                )
                .expect("fresh");
            assert_eq!(canonical(&t), canonical(&fresh_table), "step {step}");
            assert_eq!(
                (s.service_ports, s.no_local_internal, s.no_local_external),
                (
                    want.service_ports,
                    want.no_local_internal,
                    want.no_local_external
                ),
                "step {step}"
            );
            prev = snap;
        }
        assert!(partial >= 20, "{partial} steps changed something");
    }

    /// Two services claim one external IP and port: whichever wrote the `service-ips`
    /// element last, once one is gone (or changes) the other's value is what stays — the
    /// table a full sync of the remaining snapshot writes.
    #[test]
    fn a_key_two_services_share_keeps_the_remaining_ones_value() {
        let shared = |name: &str, ip: &str, ep: &str| {
            (
                service_port(name, name, "p")
                    .cluster_ip(ip)
                    .external_ip("192.168.99.1")
                    .build(),
                vec![endpoint(ep, 80).build()],
            )
        };
        let both = snapshot("n")
            .service(
                shared("a", "172.30.0.1", "10.0.1.1").0,
                shared("a", "172.30.0.1", "10.0.1.1").1,
            )
            .service(
                shared("b", "172.30.0.2", "10.0.2.1").0,
                shared("b", "172.30.0.2", "10.0.2.1").1,
            )
            .build();
        let a_only = snapshot("n")
            .service(
                shared("a", "172.30.0.1", "10.0.1.1").0,
                shared("a", "172.30.0.1", "10.0.1.1").1,
            )
            .build();
        let value = |t: &FakeTable| -> Option<String> {
            t.list_elements("service-ips")
                .into_iter()
                .find(|(k, _)| k.starts_with("192.168.99.1 "))
                .and_then(|(_, v)| v)
        };
        let mut t = FakeTable::new("ip", TABLE);
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        p.sync(&both, &ChangedSet::default(), Duration::ZERO, &mut t)
            .expect("full");
        assert!(
            value(&t).expect("element").contains("b/b/tcp/p"),
            "{:?}",
            value(&t)
        );
        p.sync(&a_only, &changed(&[("b", "b")]), Duration::ZERO, &mut t)
            .expect("b removed");
        assert!(
            value(&t).expect("element").contains("a/a/tcp/p"),
            "{:?}",
            value(&t)
        );
        p.sync(
            &a_only,
            &ChangedSet::default(),
            Duration::from_secs(2),
            &mut t,
        )
        .expect("stale chains deleted");
        assert_eq!(render(&a_only, &p.cfg).expect("render"), canonical(&t));
        assert_eq!(p.cleanup_failures, 0);
    }

    #[test]
    fn ports_of_finds_every_port_of_one_service() {
        let mut m = BTreeMap::new();
        for (ns, n, port, proto) in [
            ("a", "s", "x", Protocol::Tcp),
            ("b", "s", "", Protocol::Tcp),
            ("b", "s", "", Protocol::Sctp),
            ("b", "s", "dns", Protocol::Udp),
            ("b", "s2", "", Protocol::Tcp),
            ("b", "t", "", Protocol::Tcp),
        ] {
            m.insert(port_name(ns, n, port, proto), ());
        }
        let found: Vec<String> = ports_of(&m, "b", "s")
            .map(|(k, _)| format!("{}/{:?}", k.port, k.protocol))
            .collect();
        assert_eq!(found, ["/Tcp", "/Sctp", "dns/Udp"]);
        assert_eq!(ports_of(&m, "b", "r").count(), 0);
    }

    /// A backend that cannot tell which chains are empty (the trait's default).
    struct Blind<'a>(&'a mut FakeTable);
    impl NftBackend for Blind<'_> {
        fn list_chains(&mut self) -> Result<Vec<String>, String> {
            Ok(FakeTable::list_chains(self.0))
        }
        fn list_sets(&mut self) -> Result<Vec<String>, String> {
            Ok(FakeTable::list_sets(self.0))
        }
        fn list_elements(&mut self, s: &str) -> Result<Vec<(String, Option<String>)>, String> {
            Ok(FakeTable::list_elements(self.0, s))
        }
        fn run(&mut self, tx: &Transaction) -> Result<(), String> {
            self.0.apply(tx).map_err(|e| e.to_string())
        }
    }

    #[test]
    fn a_new_proxier_over_a_backend_that_cannot_tell_rewrites_every_endpoint_chain() {
        let (_, mut t) = with_a_flushed_endpoint_chain();
        let mut p = NftablesProxier::new(cfg(IpFamily::V4));
        p.sync(
            &one_service("10.0.2.1"),
            &ChangedSet::default(),
            Duration::ZERO,
            &mut Blind(&mut t),
        )
        .expect("full");
        let tx = p.last_transaction.as_ref().expect("tx").to_string();
        assert!(tx.contains("dnat to 10.0.1.1:80"), "{tx}");
        assert!(tx.contains("dnat to 10.0.2.1:80"), "{tx}");
    }
}
