//! The real [`IptablesBackend`]: runs the iptables binaries of one family and one backend
//! (nf_tables or legacy), optionally inside a network namespace (`nsenter --net=PATH`).
//! Every command takes the xtables lock with `-w` (waits up to `LOCK_WAIT_SECONDS`); every
//! restore is a `--noflush` one.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::model::IpFamily;

pub use crate::dataplane::netfilter::backend::{Flavor, detect_backend, tool};

use super::config::BackendChoice as Choice;
use super::kernel::{IptablesBackend, IptablesError, RestoreMode};

/// How long a command waits for the xtables lock.
pub(crate) const LOCK_WAIT_SECONDS: &str = "5";

/// Runs commands, optionally inside a network namespace.
#[derive(Debug, Clone, Default)]
pub struct CommandRunner {
    pub netns: Option<PathBuf>,
}

impl CommandRunner {
    pub(crate) fn command(&self, program: &str) -> Command {
        crate::dataplane::netfilter::exec::command(self.netns.as_deref(), program)
    }

    /// Runs `program args` with optional stdin; returns (success, stdout, stderr).
    pub(crate) fn run(
        &self,
        program: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> std::io::Result<(bool, String, String)> {
        let mut c = self.command(program);
        c.args(args);
        let out = crate::dataplane::netfilter::exec::run(c, stdin)?;
        Ok((out.success, out.stdout, out.stderr))
    }

    /// Runs `f` in this runner's network namespace: on the calling thread when it has none,
    /// else on a short-lived thread that joined it (`setns`), so the caller's namespace is
    /// untouched. What depends on the namespace — `/proc/sys/net` files opened and netlink
    /// dumps made inside `f` — is that namespace's.
    pub(crate) fn in_netns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
        let Some(path) = &self.netns else {
            return Ok(f());
        };
        std::thread::scope(|scope| {
            scope
                .spawn(|| -> std::io::Result<T> {
                    let ns = std::fs::File::open(path)?;
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(std::io::Error::from)?;
                    Ok(f())
                })
                .join()
                .map_err(|_| std::io::Error::other("the namespace thread panicked"))?
        })
    }

    /// A sysctl's value (`net.ipv4.ip_forward`), read from `/proc/sys`, if readable. Read in
    /// process, not with procps' `sysctl`: the kproxy image ships no procps.
    pub fn sysctl_get(&self, key: &str) -> Option<String> {
        let path = sysctl_path(key);
        self.in_netns(|| std::fs::read_to_string(&path))
            .ok()?
            .ok()
            .map(|v| v.trim().to_string())
    }

    /// Writes a sysctl through `/proc/sys`. A read-only `/proc/sys` (an unprivileged
    /// container's) fails with "Read-only file system".
    pub fn sysctl_set(&self, key: &str, value: &str) -> Result<(), String> {
        let path = sysctl_path(key);
        match self.in_netns(|| std::fs::write(&path, value)) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) | Err(e) => Err(format!("writing {}: {e}", path.display())),
        }
    }
}

/// `/proc/sys/<key with dots as slashes>`.
fn sysctl_path(key: &str) -> PathBuf {
    PathBuf::from("/proc/sys").join(key.replace('.', "/"))
}

/// `iptables-save -t nat` of every backend and family here, in the order iptables-nft,
/// iptables-legacy, ip6tables-nft, ip6tables-legacy (a missing binary or legacy table
/// contributes nothing and creates nothing).
pub(crate) fn nat_tables_everywhere() -> Vec<String> {
    let mut out = vec![];
    for family in [IpFamily::V4, IpFamily::V6] {
        for flavor in [Flavor::Nft, Flavor::Legacy] {
            let mut b = ExecIptables::new(family, flavor, CommandRunner::default());
            if let Ok(text) = b.save("nat") {
                out.push(text);
            }
        }
    }
    out
}

/// Chooses the backend like upstream's iptables-wrapper: a kubelet hint chain
/// (`KUBE-IPTABLES-HINT` / `KUBE-KUBELET-CANARY`) decides first (nft checked first); else the
/// backend whose save output holds more rules; nft on a tie.
pub(crate) fn detect_flavor(choice: Choice, runner: &CommandRunner) -> Flavor {
    match choice {
        Choice::Nft => return Flavor::Nft,
        Choice::Legacy => return Flavor::Legacy,
        Choice::Auto => {}
    }
    detect_backend(runner.netns.as_deref())
}

/// `iptables --version` ≥ 1.6.2 supports `MASQUERADE --random-fully`.
pub(crate) fn has_random_fully(runner: &CommandRunner, family: IpFamily, flavor: Flavor) -> bool {
    let Ok((_, out, _)) = runner.run(&tool(family, flavor, ""), &["--version"], None) else {
        return false;
    };
    let Some(v) = out.split_whitespace().find(|w| w.starts_with('v')) else {
        return false;
    };
    let parts: Vec<u32> = v[1..].split('.').filter_map(|p| p.parse().ok()).collect();
    parts.as_slice() >= [1, 6, 2].as_slice()
}

/// The iptables binaries of one family and flavor.
#[derive(Debug, Clone)]
pub struct ExecIptables {
    pub family: IpFamily,
    pub flavor: Flavor,
    pub runner: CommandRunner,
}

impl ExecIptables {
    /// The plain binary of this family and backend (`iptables-nft`, `ip6tables-legacy`, …).
    pub(crate) fn binary(&self) -> String {
        tool(self.family, self.flavor, "")
    }

    /// Whether `table` exists: always assumed on nf_tables (whose save creates nothing); on
    /// legacy it is looked up first, since naming a legacy table creates it
    /// ([`crate::dataplane::netfilter::exec::legacy_tables`]).
    pub(crate) fn table_exists(&self, table: &str) -> bool {
        if self.flavor == Flavor::Nft {
            return true;
        }
        let family = self.family;
        self.runner
            .in_netns(|| crate::dataplane::netfilter::exec::legacy_tables(family))
            .is_ok_and(|tables| tables.iter().any(|t| t == table))
    }

    pub fn new(family: IpFamily, flavor: Flavor, runner: CommandRunner) -> Self {
        ExecIptables {
            family,
            flavor,
            runner,
        }
    }

    fn iptables(&self, table: &str, args: &[&str]) -> Result<(bool, String), IptablesError> {
        let prog = tool(self.family, self.flavor, "");
        let mut all = vec!["-w", LOCK_WAIT_SECONDS, "-t", table];
        all.extend_from_slice(args);
        let (ok, _, err) = self
            .runner
            .run(&prog, &all, None)
            .map_err(|e| IptablesError::new(format!("{prog} {}", all.join(" ")), e.to_string()))?;
        Ok((ok, err))
    }

    /// Runs an existence check (`-C`, `-n -L chain`): exit 0 = exists, 1 (no such rule/chain)
    /// or 2 (legacy: `-j` target chain unknown) = absent; anything else, e.g. 4 when the
    /// xtables lock was not free within the wait, is an error — not "absent" (else a check
    /// during a long restore would look like a flush).
    fn exists(&self, table: &str, args: &[&str]) -> Result<bool, IptablesError> {
        let (code, _) = self.query(table, args, false, &[0, 1, 2])?;
        Ok(code == 0)
    }

    /// Whether `chain` holds the rule `args`, read from `iptables -S chain` (exit 1: the chain
    /// is gone, so the rule too). The same answer as `-C`, far cheaper on nf_tables: `-C`
    /// fetches the rules of the whole table into iptables-nft's cache (0.1–0.3 s of CPU with
    /// 10k services, measured), `-S` only those of the chain (≈ 5 ms). Rules are compared as
    /// iptables prints them (quotes dropped, spaces collapsed); `args` must be written in
    /// that canonical form, as [`jump_rules`](super::plan::jump_rules) are.
    pub(crate) fn rule_listed(
        &self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError> {
        let (code, stdout) = self.query(table, &["-S", chain], true, &[0, 1])?;
        if code != 0 {
            return Ok(false);
        }
        let want = normalize_rule(&format!("-A {chain} {}", args.join(" ")));
        Ok(String::from_utf8_lossy(&stdout)
            .lines()
            .any(|l| normalize_rule(l) == want))
    }

    /// Runs a read-only query (`iptables -w N -t table args…`, stdin closed, stdout captured
    /// when `stdout`) and returns its exit code and output. A failure to run it, or an exit
    /// code not in `answers` (the codes that are an answer, not a failure), is an error naming
    /// the command, its status and stderr.
    fn query(
        &self,
        table: &str,
        args: &[&str],
        stdout: bool,
        answers: &[i32],
    ) -> Result<(i32, Vec<u8>), IptablesError> {
        let prog = tool(self.family, self.flavor, "");
        let mut all = vec!["-w", LOCK_WAIT_SECONDS, "-t", table];
        all.extend_from_slice(args);
        let op = || format!("{prog} {}", all.join(" "));
        let out = self
            .runner
            .command(&prog)
            .args(&all)
            .stdin(Stdio::null())
            .stdout(if stdout {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| IptablesError::new(op(), e.to_string()))?;
        match out.status.code() {
            Some(code) if answers.contains(&code) => Ok((code, out.stdout)),
            _ => Err(IptablesError::new(
                op(),
                format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            )),
        }
    }

    fn check(&self, table: &str, args: &[&str]) -> Result<(), IptablesError> {
        let (ok, err) = self.iptables(table, args)?;
        if ok {
            Ok(())
        } else {
            Err(IptablesError::new(
                format!("iptables -t {table} {}", args.join(" ")),
                err.trim().to_string(),
            ))
        }
    }
}

/// `input` with a `-S` (list the table's rules) after each `*table` line: the bulk form of a
/// `--noflush` restore for iptables-nft.
///
/// Why (iptables-nft 1.8.9, read in its sources and measured): before running a `--noflush`
/// restore, iptables-nft collects the chains the commands name — each command's chain and
/// jump target — into a list kept sorted by insertion (a linear walk with `strcmp` per
/// command, `cache_chain_list_insert`), then fetches those chains one netlink request each.
/// The walk makes a restore of C commands naming N chains cost O(C × N): 80 % of the
/// process's time is that `strcmp`; declaring 6k / 12k / 24k chains alone takes 0.08 / 0.38 /
/// 2.4 s, and 10k services × 5 endpoints (230k commands, 60k chains) take minutes. A command
/// naming no chain ends the list: the whole table is fetched in one dump instead, as a
/// restore without `--noflush` does. `-S` without a chain is the only such command that
/// changes nothing (the others: `-F`, `-X` and `-Z` without a chain flush, delete or zero
/// every chain, other programs' included); it lists the table, which costs a fetch of its
/// rules (≈ 1.6 s of CPU at 10k × 5, nothing on an empty table) and output sent to /dev/null.
/// iptables-legacy has no such list (libiptc reads the whole table anyway), so only the nft
/// backend gets the line.
pub(crate) fn with_table_listings(input: &str) -> String {
    let mut out = String::with_capacity(input.len() + 64);
    for line in input.split_inclusive('\n') {
        out.push_str(line);
        if line.starts_with('*') {
            if !line.ends_with('\n') {
                out.push('\n');
            }
            out.push_str("-S\n");
        }
    }
    out
}

/// Rule text without quotes and with single spaces, for comparing listed and generated rules.
pub(crate) fn normalize_rule(rule: &str) -> String {
    rule.replace('"', "")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

impl IptablesBackend for ExecIptables {
    /// `iptables-restore -w N --counters --noflush`. A [`RestoreMode::NoFlushBulk`] restore
    /// with the nf_tables backend gets a `-S` line after each `*table` line: see
    /// `with_table_listings`. Its output (that listing) goes to /dev/null, not to a pipe: a
    /// pipe nobody reads while the input is still being written could block both sides.
    fn restore(&mut self, input: &str, mode: RestoreMode) -> Result<(), IptablesError> {
        let prog = tool(self.family, self.flavor, "restore");
        let args = ["-w", LOCK_WAIT_SECONDS, "--counters", "--noflush"];
        let op = || format!("{prog} {}", args.join(" "));
        let bulk;
        let input = if mode == RestoreMode::NoFlushBulk && self.flavor == Flavor::Nft {
            bulk = with_table_listings(input);
            bulk.as_str()
        } else {
            input
        };
        let mut child = self
            .runner
            .command(&prog)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| IptablesError::new(op(), e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A failed write shows in the exit status and stderr.
            let _ = stdin.write_all(input.as_bytes());
        }
        let out = child
            .wait_with_output()
            .map_err(|e| IptablesError::new(op(), e.to_string()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(IptablesError::new(
                op(),
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ))
        }
    }

    fn save(&mut self, table: &str) -> Result<String, IptablesError> {
        if !self.table_exists(table) {
            return Ok(String::new());
        }
        let prog = tool(self.family, self.flavor, "save");
        let (ok, out, err) = self
            .runner
            .run(&prog, &["-t", table], None)
            .map_err(|e| IptablesError::new(prog.clone(), e.to_string()))?;
        if ok {
            Ok(out)
        } else {
            Err(IptablesError::new(
                format!("{prog} -t {table}"),
                err.trim().to_string(),
            ))
        }
    }

    fn ensure_chain(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError> {
        let (ok, err) = self.iptables(table, &["-N", chain])?;
        if ok {
            Ok(false)
        } else if err.contains("already exists") {
            Ok(true)
        } else {
            Err(IptablesError::new(
                format!("iptables -t {table} -N {chain}"),
                err.trim().to_string(),
            ))
        }
    }

    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError> {
        self.exists(table, &["-n", "-L", chain])
    }

    fn ensure_rule_prepend(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError> {
        // The listing first (cheap on nf_tables, see `rule_listed`); `-C` only confirms a
        // miss, so a rule printed differently is never inserted twice.
        if self.rule_listed(table, chain, args)? || self.rule_exists(table, chain, args)? {
            return Ok(true);
        }
        let mut a = vec!["-I", chain];
        a.extend(strs(args));
        self.check(table, &a)?;
        Ok(false)
    }

    fn rule_exists(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError> {
        let mut a = vec!["-C", chain];
        a.extend(strs(args));
        self.exists(table, &a)
    }

    fn delete_rule(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<(), IptablesError> {
        let mut a = vec!["-D", chain];
        a.extend(strs(args));
        // Delete every copy (a leftover of upstream kube-proxy may duplicate ours).
        for _ in 0..16 {
            if !self.iptables(table, &a)?.0 {
                break;
            }
        }
        Ok(())
    }

    fn delete_chain(&mut self, table: &str, chain: &str) -> Result<(), IptablesError> {
        if !self.chain_exists(table, chain)? {
            return Ok(());
        }
        self.check(table, &["-F", chain])?;
        self.check(table, &["-X", chain])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_listings_follow_each_table_line() {
        let input = "*filter\n:KUBE-FORWARD - [0:0]\nCOMMIT\n*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j RETURN\nCOMMIT\n";
        assert_eq!(
            with_table_listings(input),
            "*filter\n-S\n:KUBE-FORWARD - [0:0]\nCOMMIT\n*nat\n-S\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j RETURN\nCOMMIT\n"
        );
        assert_eq!(with_table_listings("*nat"), "*nat\n-S\n");
    }
}
