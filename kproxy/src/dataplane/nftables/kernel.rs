//! The kernel [`NftBackend`]: transactions through `nft -f -` (one `nft` run per transaction,
//! atomic like knftables' `Run`), the table's chains, sets, elements and rule counts read
//! back through nf_tables netlink ([`crate::kernel::nftables`]), as upstream kube-proxy does
//! since 1.37 (`NFTablesNetlink`: `nft list table` took 40 s at 44k services). No rules are
//! ever read, only counted (the canary check, [`super::proxier`]).
//!
//! A sync reads the chains and the named sets/maps once (cached until the next
//! transaction); a full sync additionally dumps the elements of the six element storages.
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
    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<String, String> {
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
}

impl KernelTable {
    pub fn new(family: &str, runner: NftRunner) -> Self {
        KernelTable {
            family: family.into(),
            runner,
            listing: None,
            netlink: None,
            nft_runs: 0,
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
    pub fn delete_table(&mut self) -> Result<(), String> {
        self.listing = None;
        let fam = self.family.clone();
        match self.nft(&["delete", "table", &fam, TABLE], None) {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(format!("nft delete table {fam} {TABLE}: {e}")),
        }
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
        if tx.ops.is_empty() {
            return Ok(());
        }
        self.listing = None;
        self.nft(&["-f", "-"], Some(&tx.to_string())).map(|_| ())
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
