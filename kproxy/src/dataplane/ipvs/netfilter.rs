//! The ipsets and iptables rules around IPVS, applied with the standard tools: `ipset restore`
//! (each changed set is rebuilt in a temporary set and swapped in atomically, so lookups
//! never see a half-filled set) and `iptables-restore --noflush` (only our chains are
//! declared, hence flushed and refilled, in one transaction per table), plus the jumps from
//! the built-in chains (`-C` then `-I`). The restore texts are pure functions, unit-tested.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::process::{Command, Stdio};

use super::plan::{self, FILTER_CHAINS, JUMPS, NAT_CHAINS, PlannedSet, Rules, SetType};
use crate::model::IpFamily;

/// The temporary set a set is rebuilt in before the swap: one per set and family, so a stale
/// one left by a crash always has the right type (≤ 31 bytes).
fn tmp_set(index: usize, family: IpFamily) -> String {
    let f = match family {
        IpFamily::V4 => 4,
        IpFamily::V6 => 6,
    };
    format!("KPROXY-TMP{f}-{index}")
}

fn create_options(set: &PlannedSet, family: IpFamily) -> String {
    match set.set_type {
        SetType::BitmapPort => "range 0-65535".into(),
        _ => format!(
            "family {} hashsize 1024 maxelem 65536",
            match family {
                IpFamily::V4 => "inet",
                IpFamily::V6 => "inet6",
            }
        ),
    }
}

/// `ipset -exist restore` input that makes every set of `sets` hold exactly its entries
/// (sets in `unchanged` are only ensured to exist).
pub(crate) fn ipset_restore_input(
    sets: &BTreeMap<&'static str, PlannedSet>,
    family: IpFamily,
    applied: &BTreeMap<String, BTreeSet<String>>,
    full: bool,
) -> String {
    let mut out = String::new();
    for (i, set) in sets.values().enumerate() {
        let before = if full { None } else { applied.get(&set.name) };
        match before {
            Some(b) if *b == set.entries => {}
            Some(b) => {
                // Only the difference: one endpoint change touches a few entries of sets
                // that hold one per endpoint (KUBE-LOOP-BACK).
                for e in b.difference(&set.entries) {
                    out.push_str(&format!("del {} {e}\n", set.name));
                }
                for e in set.entries.difference(b) {
                    out.push_str(&format!("add {} {e}\n", set.name));
                }
            }
            None => {
                let tmp = tmp_set(i, family);
                let opts = create_options(set, family);
                let t = set.set_type.as_str();
                out.push_str(&format!("create {} {t} {opts}\n", set.name));
                out.push_str(&format!("create {tmp} {t} {opts}\n"));
                out.push_str(&format!("flush {tmp}\n"));
                for e in &set.entries {
                    out.push_str(&format!("add {tmp} {e}\n"));
                }
                out.push_str(&format!("swap {tmp} {}\n", set.name));
                out.push_str(&format!("destroy {tmp}\n"));
            }
        }
    }
    out
}

/// Where the tools run: the network namespace the dataplane was created in (kept open), so a
/// sync called from another thread still changes the right namespace.
#[derive(Debug)]
pub(crate) struct Tools {
    netns: Option<OwnedFd>,
}

impl Tools {
    /// Pins the calling thread's network namespace.
    pub(crate) fn here() -> std::io::Result<Tools> {
        let f = std::fs::File::open("/proc/thread-self/ns/net")?;
        Ok(Tools {
            netns: Some(f.into()),
        })
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        if let Some(fd) = &self.netns {
            let raw = fd.as_raw_fd();
            // SAFETY: only setns(2), async-signal-safe, runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setns(raw, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd
    }

    fn run_with_input(&self, program: &str, args: &[&str], stdin: &str) -> Result<(), String> {
        run_with_input(self.command(program), program, args, stdin)
    }

    fn run(&self, program: &str, args: &[&str]) -> Result<String, String> {
        run(self.command(program), program, args)
    }
}

/// Runs `cmd args…` with `stdin`, failing with its stderr.
fn run_with_input(
    mut cmd: Command,
    program: &str,
    args: &[&str],
    stdin: &str,
) -> Result<(), String> {
    let mut child = cmd
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawning {program}: {e}"))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(stdin.as_bytes())
        .map_err(|e| format!("writing to {program}: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for {program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn run(mut cmd: Command, program: &str, args: &[&str]) -> Result<String, String> {
    let out = cmd
        .args(args)
        .output()
        .map_err(|e| format!("spawning {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Applies the sets: every set exists; those `rebuild` selects get exactly their entries.
/// Makes the kernel's sets hold `sets`' entries: with `full` (or for a set not in `applied`,
/// the entries last written per set name), each set is created if missing and rebuilt whole
/// (filled under a temporary name, then swapped in); otherwise only the entries that differ
/// from `applied` are deleted and added. Runs `ipset` only when there is something to write.
pub(crate) fn apply_sets(
    tools: &Tools,
    sets: &BTreeMap<&'static str, PlannedSet>,
    family: IpFamily,
    applied: &BTreeMap<String, BTreeSet<String>>,
    full: bool,
) -> Result<(), String> {
    let input = ipset_restore_input(sets, family, applied, full);
    if input.is_empty() {
        return Ok(());
    }
    tools.run_with_input("ipset", &["-exist", "restore"], &input)
}

/// The `iptables` binary matching an `iptables-restore` binary name.
pub(crate) fn iptables_binary(restore: &str) -> String {
    restore.replacen("-restore", "", 1)
}

/// Replaces our chains' contents and ensures the jumps into them.
pub(crate) fn apply_rules(tools: &Tools, rules: &Rules, restore: &str) -> Result<(), String> {
    let input = plan::iptables_restore_input(rules);
    tools.run_with_input(restore, &["--noflush"], &input)?;
    let ipt = iptables_binary(restore);
    for (table, from, to, comment) in JUMPS {
        let spec = ["-m", "comment", "--comment", comment, "-j", to];
        let mut check = vec!["-w", "-t", table, "-C", from];
        check.extend(spec);
        if tools.run(&ipt, &check).is_err() {
            let mut insert = vec!["-w", "-t", table, "-I", from];
            insert.extend(spec);
            tools.run(&ipt, &insert)?;
        }
    }
    Ok(())
}

/// Whether `table` may be touched through the binaries of `restore`: always for the nf_tables
/// backend; for the legacy one only when the table exists, since naming it creates it
/// ([`crate::dataplane::netfilter::exec::legacy_tables`]).
fn table_present(restore: &str, table: &str) -> bool {
    if !restore.contains("legacy") {
        return true;
    }
    let family = if restore.starts_with("ip6") {
        IpFamily::V6
    } else {
        IpFamily::V4
    };
    crate::dataplane::netfilter::exec::legacy_tables(family)
        .iter()
        .any(|t| t == table)
}

/// Unhooks the IPVS mode's rules: deletes its jumps from the built-in chains and flushes its
/// chains, so nothing of it references a chain any more (chains and sets stay). Run before
/// another mode's cleanup that deletes chains both modes share (`KUBE-MARK-MASQ`, …).
/// Missing rules and chains are fine; nothing here fails.
pub(crate) fn unhook(tools: &Tools, restore: &str) {
    let ipt = iptables_binary(restore);
    delete_jumps(tools, &ipt, restore);
    for (table, chains) in [("nat", NAT_CHAINS), ("filter", FILTER_CHAINS)] {
        if !table_present(restore, table) {
            continue;
        }
        for chain in chains.iter() {
            let _ = tools.run(&ipt, &["-w", "-t", table, "-F", chain]);
        }
    }
}

fn delete_jumps(tools: &Tools, ipt: &str, restore: &str) {
    for (table, from, to, comment) in JUMPS {
        if !table_present(restore, table) {
            continue;
        }
        let spec = ["-m", "comment", "--comment", comment, "-j", to];
        loop {
            let mut del = vec!["-w", "-t", table, "-D", from];
            del.extend(spec);
            if tools.run(ipt, &del).is_err() {
                break;
            }
        }
    }
}

/// Removes the jumps, our chains and our sets (missing ones are fine).
pub(crate) fn cleanup(tools: &Tools, family: IpFamily, restore: &str) -> Result<(), String> {
    let ipt = iptables_binary(restore);
    let mut errors = vec![];
    unhook(tools, restore);
    for (table, chains) in [("nat", NAT_CHAINS), ("filter", FILTER_CHAINS)] {
        if !table_present(restore, table) {
            continue;
        }
        for chain in chains.iter() {
            if let Err(e) = tools.run(&ipt, &["-w", "-t", table, "-X", chain])
                && !e.contains("No chain")
                && !e.contains("does not exist")
            {
                errors.push(e);
            }
        }
    }
    for (base, _, _) in plan::IPSETS {
        let name = plan::set_name(base, family);
        if let Err(e) = tools.run("ipset", &["destroy", &name])
            && !e.contains("does not exist")
        {
            errors.push(e);
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// `ipset version` ≥ 6.0 (upstream's minimum), as `Err(why)` otherwise.
pub(crate) fn check_ipset_version() -> Result<String, String> {
    let out = run(Command::new("ipset"), "ipset", &["version"])
        .map_err(|e| format!("ipset is unusable: {e}"))?;
    let v = parse_ipset_version(&out)
        .ok_or_else(|| format!("cannot parse `ipset version`: {out:?}"))?;
    if v.0 < 6 {
        return Err(format!("ipset {}.{} is older than 6.0", v.0, v.1));
    }
    Ok(format!("{}.{}", v.0, v.1))
}

/// `ipset v7.17, protocol version: 7` → (7, 17).
pub(crate) fn parse_ipset_version(s: &str) -> Option<(u32, u32)> {
    let v = s.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let v = v.trim_end_matches(',');
    let mut it = v.split('.');
    Some((
        it.next()?.parse().ok()?,
        it.next().unwrap_or("0").parse().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_are_rebuilt_when_new_or_full_else_changed_by_their_difference() {
        let set = |name: &str, t, entries: &[&str]| PlannedSet {
            name: name.into(),
            set_type: t,
            comment: "",
            entries: entries.iter().map(|e| e.to_string()).collect(),
        };
        let mut sets = BTreeMap::new();
        sets.insert(
            "KUBE-CLUSTER-IP",
            set(
                "KUBE-CLUSTER-IP",
                SetType::HashIpPort,
                &["10.96.0.10,tcp:80", "10.96.0.11,tcp:80"],
            ),
        );
        sets.insert(
            "KUBE-NODE-PORT-TCP",
            set("KUBE-NODE-PORT-TCP", SetType::BitmapPort, &["30080"]),
        );
        // Nothing written yet: every set is created and rebuilt.
        let none = BTreeMap::new();
        let first = ipset_restore_input(&sets, IpFamily::V4, &none, false);
        assert_eq!(
            first,
            "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536\n\
             create KPROXY-TMP4-0 hash:ip,port family inet hashsize 1024 maxelem 65536\n\
             flush KPROXY-TMP4-0\n\
             add KPROXY-TMP4-0 10.96.0.10,tcp:80\n\
             add KPROXY-TMP4-0 10.96.0.11,tcp:80\n\
             swap KPROXY-TMP4-0 KUBE-CLUSTER-IP\n\
             destroy KPROXY-TMP4-0\n\
             create KUBE-NODE-PORT-TCP bitmap:port range 0-65535\n\
             create KPROXY-TMP4-1 bitmap:port range 0-65535\n\
             flush KPROXY-TMP4-1\n\
             add KPROXY-TMP4-1 30080\n\
             swap KPROXY-TMP4-1 KUBE-NODE-PORT-TCP\n\
             destroy KPROXY-TMP4-1\n"
        );
        let applied: BTreeMap<String, BTreeSet<String>> = sets
            .values()
            .map(|s| (s.name.clone(), s.entries.clone()))
            .collect();
        // Unchanged: nothing to run; with `full` everything is rebuilt again.
        assert_eq!(
            ipset_restore_input(&sets, IpFamily::V4, &applied, false),
            ""
        );
        assert_eq!(
            ipset_restore_input(&sets, IpFamily::V4, &applied, true),
            first
        );
        // One entry replaced: its deletion and addition only.
        sets.insert(
            "KUBE-CLUSTER-IP",
            set(
                "KUBE-CLUSTER-IP",
                SetType::HashIpPort,
                &["10.96.0.10,tcp:80", "10.96.0.12,tcp:80"],
            ),
        );
        assert_eq!(
            ipset_restore_input(&sets, IpFamily::V4, &applied, false),
            "del KUBE-CLUSTER-IP 10.96.0.11,tcp:80\n\
             add KUBE-CLUSTER-IP 10.96.0.12,tcp:80\n"
        );
    }

    #[test]
    fn versions_and_binaries() {
        assert_eq!(
            parse_ipset_version("ipset v7.17, protocol version: 7"),
            Some((7, 17))
        );
        assert_eq!(
            parse_ipset_version("ipset v6.38, protocol version: 6"),
            Some((6, 38))
        );
        assert_eq!(parse_ipset_version("garbage"), None);
        assert_eq!(
            iptables_binary("iptables-legacy-restore"),
            "iptables-legacy"
        );
        assert_eq!(iptables_binary("ip6tables-restore"), "ip6tables");
    }
}
