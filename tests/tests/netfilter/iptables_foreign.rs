//! Other programs' nat rules beside the iptables proxier, in the real kernel (a private
//! network namespace, both backends): a rule another agent adds between the proxier's
//! `iptables-save` and its restore survives the restore, and a foreign chain and foreign
//! rules in the built-in chains survive every sync (full, partial, full again) byte for byte.
//!
//! The agent's write is injected through the proxier's kernel interface
//! ([`IptablesBackend`]): a wrapper around the real backend runs it right after the proxier's
//! `save("nat")` returned, so it lands deterministically inside the window between the save
//! and the restore (no sleeping and hoping).

use std::sync::{Arc, Mutex};

use kproxy::dataplane::iptables::exec::{CommandRunner, ExecIptables, Flavor};
use kproxy::dataplane::iptables::kernel::{IptablesBackend, IptablesError, RestoreMode};
use kproxy::dataplane::iptables::{IptablesConfig, IptablesProxier};
use kproxy::model::{ChangedSet, Tracker};
use kproxy_tests::fixtures::upstream;
use kproxy_tests::iptables_corpus::{CaseInput, feed, load_input};
use kproxy_tests::netns::{Netns, require_root};

/// A hook run once, set by the test, taken by the backend.
type Hook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// The real backend, with a hook run once after the next `save("nat")`.
struct AfterSave {
    inner: ExecIptables,
    hook: Hook,
}

impl IptablesBackend for AfterSave {
    fn restore(&mut self, input: &str, mode: RestoreMode) -> Result<(), IptablesError> {
        self.inner.restore(input, mode)
    }
    fn save(&mut self, table: &str) -> Result<String, IptablesError> {
        let saved = self.inner.save(table)?;
        if table == "nat"
            && let Some(hook) = self.hook.lock().expect("poisoned").take()
        {
            hook();
        }
        Ok(saved)
    }
    fn ensure_chain(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError> {
        self.inner.ensure_chain(table, chain)
    }
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError> {
        self.inner.chain_exists(table, chain)
    }
    fn ensure_rule_prepend(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError> {
        self.inner.ensure_rule_prepend(table, chain, args)
    }
    fn rule_exists(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError> {
        self.inner.rule_exists(table, chain, args)
    }
    fn delete_rule(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<(), IptablesError> {
        self.inner.delete_rule(table, chain, args)
    }
    fn delete_chain(&mut self, table: &str, chain: &str) -> Result<(), IptablesError> {
        self.inner.delete_chain(table, chain)
    }
}

fn tools(flavor: Flavor) -> (&'static str, &'static str) {
    match flavor {
        Flavor::Nft => ("iptables-nft", "iptables-nft-save"),
        Flavor::Legacy => ("iptables-legacy", "iptables-legacy-save"),
    }
}

/// The lines of a nat dump that are not ours (no `KUBE-` in them), counters dropped.
fn foreign_lines(dump: &str) -> Vec<String> {
    dump.lines()
        .filter(|l| !l.starts_with('#') && !l.contains("KUBE-"))
        .map(|l| match l.find(" [") {
            Some(i) if l.starts_with(':') => l[..i].to_string(),
            _ => l.to_string(),
        })
        .collect()
}

/// A proxier over the real backend in `ns`, with the corpus' overall case.
fn proxier(ns: &Netns, flavor: Flavor) -> (IptablesProxier<AfterSave>, Hook, CaseInput) {
    let case = upstream("iptables/cases/overall-iptables-rules/input.yaml");
    let input = load_input(&case);
    let mut cfg: IptablesConfig = input.cfg.clone();
    cfg.netns = Some(ns.path());
    cfg.sync_period = std::time::Duration::from_secs(3600);
    cfg.nfacct_counters = Default::default();
    let hook: Hook = Arc::new(Mutex::new(None));
    let backend = AfterSave {
        inner: ExecIptables::new(
            cfg.family,
            flavor,
            CommandRunner {
                netns: Some(ns.path()),
            },
        ),
        hook: hook.clone(),
    };
    (IptablesProxier::new(cfg, backend), hook, input)
}

/// Another agent's rule, added right after the proxier saved a nat table holding nothing
/// but kube-proxy's objects, is still there after the sync (on the old code the whole-table
/// restore that followed deleted it).
fn rule_added_between_save_and_restore(flavor: Flavor) {
    let ns = Netns::new("ipt-foreign-race").expect("netns");
    let (tool, save_tool) = tools(flavor);
    let (mut p, hook, input) = proxier(&ns, flavor);
    let mut tracker = Tracker::new(&input.node_name);
    let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
    // A first sync: nat then holds kube-proxy's objects alone.
    p.sync(&snap, &changed).expect("first sync");
    let rule = [
        "-t",
        "nat",
        "-A",
        "POSTROUTING",
        "-s",
        "172.17.0.0/16",
        "!",
        "-o",
        "docker0",
        "-j",
        "MASQUERADE",
    ];
    let path = ns.path();
    *hook.lock().expect("poisoned") = Some(Box::new(move || {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", path.display()))
            .arg(tool)
            .args(rule)
            .output()
            .expect("run the other agent's iptables");
        assert!(out.status.success(), "{out:?}");
    }));
    p.force_full_sync();
    p.sync(&snap, &ChangedSet::default()).expect("full sync");
    assert!(
        hook.lock().expect("poisoned").is_none(),
        "the full sync saved the nat table (the hook ran)"
    );
    let nat = ns.exec(save_tool, &["-t", "nat"]).expect("save");
    assert!(
        nat.contains("-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE"),
        "the rule added between the proxier's save and its restore was lost:\n{nat}"
    );
    assert!(
        nat.contains("-A KUBE-SERVICES "),
        "the proxier's rules are there too:\n{nat}"
    );
}

#[test]
fn nft_rule_added_between_save_and_restore_survives() {
    if !require_root() {
        return;
    }
    rule_added_between_save_and_restore(Flavor::Nft);
}

#[test]
fn legacy_rule_added_between_save_and_restore_survives() {
    if !require_root() {
        return;
    }
    rule_added_between_save_and_restore(Flavor::Legacy);
}

/// A foreign chain with rules, and foreign rules in two built-in chains (one before the
/// proxier's jump, one after): every sync leaves all of them byte for byte as they were.
fn foreign_objects_survive_every_sync(flavor: Flavor) {
    let ns = Netns::new("ipt-foreign-keep").expect("netns");
    let (tool, save_tool) = tools(flavor);
    for args in [
        &["-t", "nat", "-N", "DOCKER"][..],
        &["-t", "nat", "-A", "DOCKER", "-i", "docker0", "-j", "RETURN"],
        &[
            "-t",
            "nat",
            "-A",
            "DOCKER",
            "!",
            "-i",
            "docker0",
            "-p",
            "tcp",
            "--dport",
            "8080",
            "-j",
            "DNAT",
            "--to-destination",
            "172.17.0.2:80",
        ],
        &[
            "-t",
            "nat",
            "-A",
            "PREROUTING",
            "-m",
            "addrtype",
            "--dst-type",
            "LOCAL",
            "-j",
            "DOCKER",
        ],
        &[
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-s",
            "172.17.0.0/16",
            "!",
            "-o",
            "docker0",
            "-j",
            "MASQUERADE",
        ],
    ] {
        ns.exec(tool, args).expect("foreign object");
    }
    let before = foreign_lines(&ns.exec(save_tool, &["-t", "nat"]).expect("save"));
    assert!(
        before.iter().any(|l| l.starts_with("-A DOCKER ")),
        "{before:?}"
    );
    let (mut p, _hook, input) = proxier(&ns, flavor);
    let mut tracker = Tracker::new(&input.node_name);
    let check = |what: &str| {
        let nat = ns.exec(save_tool, &["-t", "nat"]).expect("save");
        assert_eq!(foreign_lines(&nat), before, "{what}:\n{nat}");
        assert!(nat.contains("-A KUBE-SERVICES "), "{what}:\n{nat}");
    };
    let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
    p.sync(&snap, &changed).expect("first sync");
    check("after the first (full) sync");
    let services: Vec<_> = input
        .services
        .iter()
        .filter(|s| s.metadata.name.as_deref() != Some("svc1"))
        .cloned()
        .collect();
    let (snap2, changed2) = feed(&mut tracker, &services, &input.slices);
    p.sync(&snap2, &changed2).expect("partial sync");
    assert_eq!(p.stats.partial_syncs, 1);
    check("after a partial sync");
    p.force_full_sync();
    p.sync(&snap2, &ChangedSet::default()).expect("full resync");
    assert_eq!(p.stats.full_syncs, 2);
    check("after a full resync");
}

#[test]
fn nft_foreign_objects_survive_every_sync() {
    if !require_root() {
        return;
    }
    foreign_objects_survive_every_sync(Flavor::Nft);
}

#[test]
fn legacy_foreign_objects_survive_every_sync() {
    if !require_root() {
        return;
    }
    foreign_objects_survive_every_sync(Flavor::Legacy);
}
