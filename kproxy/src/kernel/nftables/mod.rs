//! Reading nf_tables state through netlink (`NETLINK_NETFILTER`, subsystem
//! `NFNL_SUBSYS_NFTABLES`) instead of parsing `nft list` output: one table's chains, its
//! named sets and maps, a set's elements, a chain's rule count, the table's handle.
//!
//! Upstream kube-proxy does the same since 1.37 (`NFTablesNetlink`, knftables' netlink
//! `List`): listing through `nft -j list` took 40 s at 44k services (kubernetes#139513).
//! Writing stays with `nft -f -` (as upstream's knftables).
//!
//! `wire` is the pure part (requests, answer parsing, element text), unit-tested on
//! captured bytes; [`NftNetlink`] is the socket. A dump the kernel marks interrupted
//! (`NLM_F_DUMP_INTR`: the ruleset changed while it ran) is repeated.

pub(crate) mod wire;

use std::io;
use std::path::{Path, PathBuf};

use crate::kernel::netlink::{End, MsgBuilder, NLM_F_DUMP_INTR, Socket};

pub(crate) use wire::{ChainInfo, SetInfo, TableInfo, WireError};

/// `NFPROTO_IPV4` / `NFPROTO_IPV6`.
pub const NFPROTO_IPV4: u8 = 2;
pub(crate) const NFPROTO_IPV6: u8 = 10;

/// How often an interrupted dump is tried before giving up.
const DUMP_ATTEMPTS: usize = 5;

/// A read of nf_tables state failed; each names what was being read.
#[derive(Debug, thiserror::Error)]
pub enum NftNetlinkError {
    #[error("opening an nf_tables netlink socket{}: {source}", in_netns(.netns))]
    Open {
        netns: Option<PathBuf>,
        source: io::Error,
    },
    #[error("reading {what} through netlink: {source}")]
    Io { what: String, source: io::Error },
    #[error("reading {what} through netlink: the ruleset kept changing during the dump")]
    Interrupted { what: String },
    #[error("reading {what} through netlink: {source}")]
    Parse { what: String, source: WireError },
}

fn in_netns(n: &Option<PathBuf>) -> String {
    n.as_ref()
        .map(|p| format!(" in {}", p.display()))
        .unwrap_or_default()
}

/// The family name `nft` uses (`ip`, `ip6`) → its `NFPROTO_*`.
pub(crate) fn family_of(name: &str) -> Option<u8> {
    match name {
        "ip" => Some(NFPROTO_IPV4),
        "ip6" => Some(NFPROTO_IPV6),
        _ => None,
    }
}

/// An nf_tables netlink socket for one family, in the network namespace it was opened in.
#[derive(Debug)]
pub struct NftNetlink {
    sock: Socket,
    family: u8,
    family_name: &'static str,
    /// Requests sent so far (dumps and gets, retries included).
    pub requests: u64,
}

impl NftNetlink {
    /// Opens a socket for `family` (`NFPROTO_*`) in the current network namespace, or in
    /// `netns` (a namespace file such as `/run/netns/<name>`, entered by a short-lived thread
    /// so the caller's namespace is untouched; the socket stays in `netns`).
    pub fn open(family: u8, netns: Option<&Path>) -> Result<Self, NftNetlinkError> {
        let open_err = |source| NftNetlinkError::Open {
            netns: netns.map(Path::to_path_buf),
            source,
        };
        let sock = match netns {
            None => Socket::open(libc::NETLINK_NETFILTER).map_err(open_err)?,
            Some(path) => {
                let path = path.to_path_buf();
                std::thread::spawn(move || -> io::Result<Socket> {
                    let ns = std::fs::File::open(&path)?;
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(io::Error::from)?;
                    Socket::open(libc::NETLINK_NETFILTER)
                })
                .join()
                .map_err(|_| open_err(io::Error::other("the namespace thread panicked")))?
                .map_err(open_err)?
            }
        };
        sock.set_recv_timeout(std::time::Duration::from_secs(30))
            .map_err(open_err)?;
        sock.set_rcvbuf(4 << 20);
        Ok(NftNetlink {
            sock,
            family,
            family_name: if family == NFPROTO_IPV6 { "ip6" } else { "ip" },
            requests: 0,
        })
    }

    /// Runs `req` and collects what `parse` makes of each answer's payload; `Ok(None)` when
    /// the kernel answered `ENOENT` (no such table or set). Interrupted dumps are repeated
    /// from scratch.
    fn run<T>(
        &mut self,
        req: &MsgBuilder,
        what: &dyn Fn() -> String,
        mut parse: impl FnMut(&[u8]) -> Result<Vec<T>, WireError>,
    ) -> Result<Option<Vec<T>>, NftNetlinkError> {
        for _ in 0..DUMP_ATTEMPTS {
            self.requests += 1;
            let seq = self.sock.next_seq();
            let mut out = vec![];
            let mut parse_err = None;
            let end = self.sock.exchange(&req.finish(seq), |m| {
                if parse_err.is_none() {
                    match parse(m.payload) {
                        Ok(v) => out.extend(v),
                        Err(e) => parse_err = Some(e),
                    }
                }
                Ok(())
            });
            if let Some(source) = parse_err {
                return Err(NftNetlinkError::Parse {
                    what: what(),
                    source,
                });
            }
            match end {
                Ok(End::Done { flags }) if flags & NLM_F_DUMP_INTR != 0 => continue,
                Ok(_) => return Ok(Some(out)),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
                Err(source) => {
                    return Err(NftNetlinkError::Io {
                        what: what(),
                        source,
                    });
                }
            }
        }
        Err(NftNetlinkError::Interrupted { what: what() })
    }

    /// The table, or `None` when it does not exist.
    pub fn table(&mut self, table: &str) -> Result<Option<TableInfo>, NftNetlinkError> {
        let fam = self.family_name;
        let req = wire::get_table(self.family, table);
        let found = self.run(&req, &|| format!("table {fam} {table}"), |p| {
            Ok(vec![wire::parse_table(p)?])
        })?;
        Ok(found.and_then(|v| v.into_iter().next()))
    }

    /// The chains of `table` (none when it does not exist).
    pub fn chains(&mut self, table: &str) -> Result<Vec<ChainInfo>, NftNetlinkError> {
        let fam = self.family_name;
        let req = wire::dump(self.family, wire::NFT_MSG_GETCHAIN, table, None);
        let found = self.run(&req, &|| format!("the chains of {fam} {table}"), |p| {
            let c = wire::parse_chain(p)?;
            Ok(if c.table == table { vec![c] } else { vec![] })
        })?;
        Ok(found.unwrap_or_default())
    }

    /// The named sets and maps of `table` (anonymous ones, e.g. a rule's `vmap { … }`, are
    /// left out, as `nft list sets` does).
    pub fn sets(&mut self, table: &str) -> Result<Vec<SetInfo>, NftNetlinkError> {
        let fam = self.family_name;
        let req = wire::dump(self.family, wire::NFT_MSG_GETSET, table, None);
        let found = self.run(&req, &|| format!("the sets of {fam} {table}"), |p| {
            let s = wire::parse_set(p)?;
            Ok(if s.table == table && !s.is_anonymous() {
                vec![s]
            } else {
                vec![]
            })
        })?;
        Ok(found.unwrap_or_default())
    }

    /// The elements of `set` as (key, value) texts (none when it does not exist).
    pub fn elements(
        &mut self,
        set: &SetInfo,
    ) -> Result<Vec<(String, Option<String>)>, NftNetlinkError> {
        let fam = self.family_name;
        let req = wire::dump_elements(self.family, &set.table, &set.name);
        let what = || format!("the elements of {fam} {} {}", set.table, set.name);
        let found = self.run(&req, &what, |p| wire::parse_elements(set, p))?;
        Ok(found.unwrap_or_default())
    }

    /// How many rules each chain of `table` holds (chains without rules are absent), from
    /// one dump of the whole table's rules.
    pub(crate) fn rule_counts(
        &mut self,
        table: &str,
    ) -> Result<std::collections::BTreeMap<String, usize>, NftNetlinkError> {
        let fam = self.family_name;
        let req = wire::dump(self.family, wire::NFT_MSG_GETRULE, table, None);
        let what = || format!("the rules of {fam} {table}");
        let found = self.run(&req, &what, |p| {
            Ok(vec![wire::parse_rule_chain(p)?.to_owned()])
        })?;
        let mut counts = std::collections::BTreeMap::new();
        for chain in found.unwrap_or_default() {
            *counts.entry(chain).or_insert(0) += 1;
        }
        Ok(counts)
    }

    /// How many rules `chain` of `table` holds (0 when either does not exist).
    pub(crate) fn rule_count(
        &mut self,
        table: &str,
        chain: &str,
    ) -> Result<usize, NftNetlinkError> {
        let fam = self.family_name;
        let req = wire::dump(self.family, wire::NFT_MSG_GETRULE, table, Some(chain));
        let what = || format!("the rules of {fam} {table} {chain}");
        let found = self.run(&req, &what, |p| {
            Ok(if wire::parse_rule_chain(p)? == chain {
                vec![()]
            } else {
                vec![]
            })
        })?;
        Ok(found.map_or(0, |v| v.len()))
    }
}
