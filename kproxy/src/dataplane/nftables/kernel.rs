//! The kernel [`NftBackend`]: transactions through `nft -f -` (one `nft` run per transaction,
//! atomic like knftables' `Run`), the table's chains, sets, elements and rule counts read
//! back through nf_tables netlink ([`crate::kernel::nftables`]), as upstream kube-proxy does
//! since 1.37 (`NFTablesNetlink`: `nft list table` took 40 s at 44k services). No rules are
//! ever read, only counted (the canary check, [`super::proxier`]).
//!
//! A full sync reads the chains and the named sets/maps once (cached until the next
//! transaction) and dumps the elements of the six element storages; a partial sync reads
//! only the static chains' rule counts (the proxier knows the rest, see "Loading speed" in
//! [`super`]). A full sync's transaction is run in parts, one `nft -f -` each
//! ([`NftBackend::run_parts`]); [`DUMP_DIR_ENV`] writes every transaction run to files.
//! Elements come back in the planner's text form (`172.30.0.41 . tcp . 80`,
//! `goto service-…`, `drop`), so the storages compare kernel content with planned content
//! key by key.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use crate::kernel::nftables::{NftNetlink, NftNetlinkError, SetInfo, family_of};

use super::proxier::NftBackend;
use super::setup::TABLE;
use super::transaction::Transaction;

/// Runs `nft`, in a network namespace when `netns` is set (`nsenter --net=<path>`).
#[derive(Debug, Clone, Default)]
pub struct NftRunner {
    pub netns: Option<PathBuf>,
}

impl NftRunner {
    fn command(&self) -> Command {
        crate::dataplane::netfilter::exec::command(self.netns.as_deref(), "nft")
    }

    /// Runs `nft args` with `stdin`; `Ok(stdout)` on success, `Err(stderr)` otherwise.
    pub(crate) fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        let mut c = self.command();
        c.args(args);
        let out = crate::dataplane::netfilter::exec::run(c, stdin)
            .map_err(|e| format!("running nft: {e}"))?;
        if out.success {
            Ok(out.stdout)
        } else {
            Err(out.stderr.trim().to_string())
        }
    }
}

/// Chains and named sets/maps of the table, as last read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Listing {
    chains: Vec<String>,
    sets: BTreeMap<String, SetInfo>,
}

/// The kernel's `<family> kube-proxy` table.
#[derive(Debug)]
pub struct KernelTable {
    pub family: String,
    pub runner: NftRunner,
    /// What the chain and set dumps gave; dropped by every transaction.
    listing: Option<Listing>,
    /// The netlink socket for reads, opened at the first read (in the runner's namespace).
    netlink: Option<NftNetlink>,
    /// `nft` invocations so far (transactions and deletions; reads go through netlink).
    pub nft_runs: u64,
    /// [`DUMP_DIR_ENV`]: where each transaction is written after it ran.
    dump_dir: Option<PathBuf>,
}

/// Debugging and benchmarking aid: when this environment variable names a directory, every
/// transaction the kernel backend runs is also written there after `nft` returned, as
/// `<seq>-<family>.nft` (`seq` counts the transactions of both families in the order they
/// ran), its first line a comment with how long `nft -f -` took, whether it succeeded and
/// what it was (`full sync part i of k` / `partial sync part 1 of 1` for a sync's transaction, [`super::proxier::split_points`];
/// `transaction` for the stale-chain deletions a sync starts with).
/// The files replay as they are (`nft -f FILE`; `kp-bench` times them as the floor of the
/// agent's figures). Written after the commit, so what the datapath does is not delayed.
pub const DUMP_DIR_ENV: &str = "KPROXY_NFT_DUMP_DIR";

static DUMP_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl KernelTable {
    pub fn new(family: &str, runner: NftRunner) -> Self {
        KernelTable {
            family: family.into(),
            runner,
            listing: None,
            netlink: None,
            nft_runs: 0,
            dump_dir: std::env::var_os(DUMP_DIR_ENV).map(PathBuf::from),
        }
    }

    fn nft(&mut self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
        self.nft_runs += 1;
        self.runner.run(args, stdin)
    }

    /// Netlink requests sent so far (reads).
    pub fn netlink_requests(&self) -> u64 {
        self.netlink.as_ref().map_or(0, |n| n.requests)
    }

    /// The read socket (opened on first use).
    pub fn netlink(&mut self) -> Result<&mut NftNetlink, NftNetlinkError> {
        if self.netlink.is_none() {
            let fam = family_of(&self.family).ok_or_else(|| NftNetlinkError::Open {
                netns: self.runner.netns.clone(),
                source: std::io::Error::other(format!("unknown nftables family {}", self.family)),
            })?;
            self.netlink = Some(NftNetlink::open(fam, self.runner.netns.as_deref())?);
        }
        Ok(self.netlink.as_mut().expect("just opened"))
    }

    fn listing(&mut self) -> Result<&Listing, String> {
        if self.listing.is_none() {
            let nl = self.netlink().map_err(|e| e.to_string())?;
            let chains = nl.chains(TABLE).map_err(|e| e.to_string())?;
            let sets = nl.sets(TABLE).map_err(|e| e.to_string())?;
            self.listing = Some(Listing {
                chains: chains.into_iter().map(|c| c.name).collect(),
                sets: sets.into_iter().map(|s| (s.name.clone(), s)).collect(),
            });
        }
        Ok(self.listing.as_ref().expect("just read"))
    }

    /// Deletes the table if it exists (cleanup).
    pub(crate) fn delete_table(&mut self) -> Result<(), String> {
        self.listing = None;
        let fam = self.family.clone();
        match self.nft(&["delete", "table", &fam, TABLE], None) {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(format!("nft delete table {fam} {TABLE}: {e}")),
        }
    }
}

impl KernelTable {
    /// One `nft -f -` run of the operations `ops` of `tx` (`what` labels it in a
    /// [`DUMP_DIR_ENV`] dump).
    fn run_text(
        &mut self,
        tx: &Transaction,
        ops: std::ops::Range<usize>,
        what: &str,
    ) -> Result<(), String> {
        if ops.is_empty() {
            return Ok(());
        }
        self.listing = None;
        let mut text = String::new();
        for op in &tx.ops[ops] {
            text.push_str(&tx.render_op(op));
            text.push('\n');
        }
        let started = std::time::Instant::now();
        let result = self.nft(&["-f", "-"], Some(&text)).map(|_| ());
        if let Some(dir) = &self.dump_dir {
            dump(
                dir,
                &self.family,
                &text,
                started.elapsed(),
                result.is_ok(),
                what,
            );
        }
        result
    }
}

/// Writes one transaction for [`DUMP_DIR_ENV`] (a failure is logged, never fatal).
fn dump(
    dir: &std::path::Path,
    family: &str,
    text: &str,
    took: std::time::Duration,
    ok: bool,
    what: &str,
) {
    let seq = DUMP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("{seq:06}-{family}.nft"));
    let head = format!(
        "# nft -f: {:.3} ms, {}, {what}\n",
        took.as_secs_f64() * 1e3,
        if ok { "ok" } else { "failed" }
    );
    if let Err(e) = std::fs::write(&path, head + text) {
        tracing::warn!(path = %path.display(), error = %e, "{DUMP_DIR_ENV}: cannot write");
    }
}

/// The kernel's "no such object" answer.
fn is_not_found(stderr: &str) -> bool {
    stderr.contains("No such file or directory")
}

impl NftBackend for KernelTable {
    fn list_chains(&mut self) -> Result<Vec<String>, String> {
        Ok(self.listing()?.chains.clone())
    }

    /// Sets only, not maps (knftables `List("sets")`, like [`super::FakeTable::list_sets`]).
    fn list_sets(&mut self) -> Result<Vec<String>, String> {
        Ok(self
            .listing()?
            .sets
            .values()
            .filter(|s| !s.is_map())
            .map(|s| s.name.clone())
            .collect())
    }

    fn list_elements(&mut self, set: &str) -> Result<Vec<(String, Option<String>)>, String> {
        let Some(info) = self.listing()?.sets.get(set).cloned() else {
            return Ok(vec![]);
        };
        let nl = self.netlink().map_err(|e| e.to_string())?;
        nl.elements(&info).map_err(|e| e.to_string())
    }

    fn rule_count(&mut self, chain: &str) -> Result<Option<usize>, String> {
        let nl = self.netlink().map_err(|e| e.to_string())?;
        nl.rule_count(TABLE, chain)
            .map(Some)
            .map_err(|e| e.to_string())
    }

    fn run(&mut self, tx: &Transaction) -> Result<(), String> {
        self.run_text(tx, 0..tx.ops.len(), "transaction")
    }

    fn run_parts(&mut self, tx: &Transaction, cuts: &[usize], full: bool) -> Result<(), String> {
        let k = cuts.len() + 1;
        let kind = if full { "full" } else { "partial" };
        let mut from = 0;
        for (i, &at) in cuts.iter().chain([&tx.ops.len()]).enumerate() {
            self.run_text(tx, from..at, &format!("{kind} sync part {} of {k}", i + 1))?;
            from = at;
        }
        Ok(())
    }

    /// One netlink dump of the table's rules, counted per chain: the chains without any.
    fn list_empty_chains(&mut self) -> Result<Option<Vec<String>>, String> {
        let nl = self.netlink().map_err(|e| e.to_string())?;
        let counts = nl.rule_counts(TABLE).map_err(|e| e.to_string())?;
        let chains = nl.chains(TABLE).map_err(|e| e.to_string())?;
        Ok(Some(
            chains
                .into_iter()
                .map(|c| c.name)
                .filter(|c| !counts.contains_key(c))
                .collect(),
        ))
    }
}
