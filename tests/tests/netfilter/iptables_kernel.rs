//! The iptables applier against the real kernel, in a private network namespace, on both
//! backends (nf_tables and legacy): full and partial syncs leave exactly the planned rules,
//! other programs' nat rules survive, and cleanup removes everything of ours. The runner's
//! sysctls are read and written in its namespace.

use kproxy::dataplane::Dataplane;
use kproxy::dataplane::iptables::config::BackendChoice as Choice;
use kproxy::dataplane::iptables::{IptablesConfig, IptablesDataplane};
use kproxy::model::{ChangedSet, Tracker};
use kproxy_tests::fixtures::upstream;
use kproxy_tests::iptables_corpus::{feed, load_input};
use kproxy_tests::netns::{Netns, require_root};

fn save(ns: &Netns, tool: &str, table: &str) -> String {
    ns.exec(tool, &["-t", table]).expect("save")
}

/// Rule lines of our chains in an iptables-save dump, without counters, sorted.
fn rule_lines(dump: &str) -> Vec<String> {
    let mut v: Vec<String> = dump
        .lines()
        .filter(|l| l.starts_with("-A KUBE-"))
        .map(|l| l.replace('"', ""))
        .collect();
    v.sort();
    v
}

/// What the kernel shows for `planned` restored into a fresh namespace with plain
/// iptables-restore (iptables-save normalizes rule text, so compare save against save).
fn reference_lines(save_tool: &str, planned: &str, table: &str) -> Vec<String> {
    let ns = Netns::new("ipt-kernel-ref").expect("netns");
    let restore = save_tool.replace("-save", "-restore");
    let mut child = ns
        .command(&restore)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("restore");
    use std::io::Write as _;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(planned.as_bytes())
        .expect("write");
    assert!(
        child.wait().expect("wait").success(),
        "reference restore failed:\n{planned}"
    );
    rule_lines(&save(&ns, save_tool, table))
}

fn assert_same(what: &str, got: Vec<String>, want: Vec<String>) {
    let missing: Vec<&String> = want.iter().filter(|l| !got.contains(l)).collect();
    let extra: Vec<&String> = got.iter().filter(|l| !want.contains(l)).collect();
    assert!(
        missing.is_empty() && extra.is_empty() && got.len() == want.len(),
        "{what}: missing {missing:#?}\nextra {extra:#?}"
    );
}

fn run_backend(choice: Choice, save_tool: &str, foreign_rule: bool) {
    let ns = Netns::new(&format!("ipt-kernel-{save_tool}")).expect("netns");
    let case = upstream("iptables/cases/overall-iptables-rules/input.yaml");
    let input = load_input(&case);
    let mut cfg: IptablesConfig = input.cfg.clone();
    cfg.backend = choice;
    cfg.netns = Some(ns.path());
    cfg.sync_period = std::time::Duration::from_secs(3600);
    if foreign_rule {
        let tool = save_tool.replace("-save", "");
        ns.exec(&tool, &["-t", "nat", "-N", "OTHER-PROGRAM"])
            .expect("foreign chain");
        ns.exec(
            &tool,
            &["-t", "nat", "-A", "PREROUTING", "-j", "OTHER-PROGRAM"],
        )
        .expect("foreign rule");
    }
    let mut dp = IptablesDataplane::new([cfg.clone()]).expect("dataplane");
    let mut tracker = Tracker::new(&input.node_name);
    let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
    dp.sync(&snap, &changed).expect("full sync");
    // Without nfacct support the planned rules are upstream's minus the nfacct matches.
    let mut expected_cfg = cfg.clone();
    expected_cfg.nfacct_counters = Default::default();
    expected_cfg.random_fully = dp.proxiers()[0].cfg.random_fully;
    let planned = kproxy::dataplane::iptables::render(&snap, &expected_cfg);
    let nat = save(&ns, save_tool, "nat");
    assert_same(
        "nat after full sync",
        rule_lines(&nat),
        reference_lines(save_tool, &planned, "nat"),
    );
    let filter = save(&ns, save_tool, "filter");
    assert_same(
        "filter after full sync",
        rule_lines(&filter),
        reference_lines(save_tool, &planned, "filter"),
    );
    assert!(
        nat.contains(
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        ),
        "{nat}"
    );
    if foreign_rule {
        assert!(
            nat.contains("-A PREROUTING -j OTHER-PROGRAM") && nat.contains(":OTHER-PROGRAM"),
            "{nat}"
        );
    }

    // A partial sync: drop svc1 (its chains go, with -X) and change svc4's endpoints.
    let services: Vec<_> = input
        .services
        .iter()
        .filter(|s| s.metadata.name.as_deref() != Some("svc1"))
        .cloned()
        .collect();
    let (snap2, changed2) = feed(&mut tracker, &services, &input.slices);
    assert!(!changed2.services.is_empty());
    dp.sync(&snap2, &changed2).expect("partial sync");
    assert_eq!(dp.proxiers()[0].stats.partial_syncs, 1);
    let stats = dp.proxiers()[0].stats;
    assert!(
        stats.chains_omitted_last > 0 && stats.chains_written_last > 0,
        "a partial sync applies the changed chains only: {stats:?}"
    );
    let planned2 = kproxy::dataplane::iptables::render(&snap2, &expected_cfg);
    let nat2 = save(&ns, save_tool, "nat");
    let want2 = reference_lines(save_tool, &planned2, "nat");
    assert_same("nat after partial sync", rule_lines(&nat2), want2.clone());
    assert!(
        !nat2.contains("KUBE-SVC-XPGD46QRK7WJZT7O"),
        "svc1's chain deleted:\n{nat2}"
    );
    // Nothing changed: a no-op partial sync keeps everything.
    dp.sync(&snap2, &ChangedSet::default()).expect("no-op sync");
    assert_eq!(
        dp.proxiers()[0].stats.chains_written_last,
        0,
        "nothing differs from the kernel: nothing restored"
    );
    assert_same(
        "nat after no-op sync",
        rule_lines(&save(&ns, save_tool, "nat")),
        want2,
    );

    dp.cleanup().expect("cleanup");
    let nat3 = save(&ns, save_tool, "nat");
    let filter3 = save(&ns, save_tool, "filter");
    for (name, d) in [("nat", &nat3), ("filter", &filter3)] {
        for l in d.lines() {
            let ours = l.contains("KUBE-") && !l.contains("KUBE-FIREWALL");
            assert!(!ours, "{name} still has {l:?}:\n{d}");
        }
    }
    if foreign_rule {
        assert!(nat3.contains("-A PREROUTING -j OTHER-PROGRAM"), "{nat3}");
    }
}

#[test]
fn nft_backend_full_partial_cleanup() {
    if !require_root() {
        return;
    }
    run_backend(Choice::Nft, "iptables-nft-save", false);
}

#[test]
fn nft_backend_keeps_foreign_nat_rules() {
    if !require_root() {
        return;
    }
    run_backend(Choice::Nft, "iptables-nft-save", true);
}

#[test]
fn legacy_backend_full_partial_cleanup() {
    if !require_root() {
        return;
    }
    run_backend(Choice::Legacy, "iptables-legacy-save", false);
}

#[test]
fn legacy_backend_keeps_foreign_nat_rules() {
    if !require_root() {
        return;
    }
    run_backend(Choice::Legacy, "iptables-legacy-save", true);
}

/// The iptables datapath reads and writes sysctls through `/proc/sys` in process (the kproxy
/// image ships no procps `sysctl`), in the runner's namespace and not the caller's: a
/// `route_localnet` written through a runner for a fresh namespace is set there, and the test
/// process' own namespace keeps its value.
#[test]
fn runner_sysctls_are_read_and_written_in_its_namespace() {
    use kproxy::dataplane::iptables::exec::CommandRunner;
    if !require_root() {
        return;
    }
    let key = "net.ipv4.conf.all.route_localnet";
    let path = "/proc/sys/net/ipv4/conf/all/route_localnet";
    let ns = Netns::new("ipt-kernel-sysctl").expect("netns");
    let here = std::fs::read_to_string(path).unwrap();
    let runner = CommandRunner {
        netns: Some(ns.path()),
    };
    assert_eq!(runner.sysctl_get(key).as_deref(), Some("0"));
    runner.sysctl_set(key, "1").unwrap();
    assert_eq!(runner.sysctl_get(key).as_deref(), Some("1"));
    let inside = ns.run(|| std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(inside.trim(), "1", "set in the runner's namespace");
    assert_eq!(
        std::fs::read_to_string(path).unwrap(),
        here,
        "the caller's namespace is untouched"
    );
    assert_eq!(runner.sysctl_get("net.ipv4.no_such_sysctl"), None);
    let err = runner
        .sysctl_set("net.ipv4.no_such_sysctl", "1")
        .unwrap_err();
    assert!(err.contains("/proc/sys/net/ipv4/no_such_sysctl"), "{err}");
}
