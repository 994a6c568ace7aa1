//! Issue #7: the agent checks `--bpf-cgroup` before running socket LB (see
//! `kproxy::dataplane::ebpf::socket_lb::cgroup` for the rule), with the real binary in a network namespace:
//!
//! - inside a new cgroup namespace rooted at a test cgroup with its **own** cgroup2 mount (what
//!   a container runtime gives a container: `unshare --cgroup --mount` + `mount -t cgroup2`),
//!   `--proxy-mode=ebpf` exits 1 naming the cgroup and the reason; without `--proxy-mode` the
//!   agent rejects ebpf with that reason in its log and runs the next mode, nftables
//!   (`/proxyMode`);
//! - inside a new cgroup namespace that still sees the host's hierarchy (`unshare --cgroup`
//!   alone: the inherited mount's root is above the namespace root), ebpf runs: the rule is
//!   about what the mount shows, not about the namespace alone.

use std::path::{Path, PathBuf};
use std::process::Command;

use kproxy_tests::agentproc::{AgentProcess, ScratchDir, http_get, strip_ansi};
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup, require_root};
use kproxy_tests::topology::kproxy_bin;

const REFUSAL: &str = "private cgroup namespace";

fn manifests(dir: &Path) -> PathBuf {
    let path = dir.join("node.yaml");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Node\nmetadata: {name: kpt-node}\n\
         status:\n  addresses: [{type: InternalIP, address: 192.0.2.1}]\n",
    )
    .unwrap();
    path
}

/// `unshare --cgroup [--mount …] sh -c SCRIPT` inside `ns`, started inside `cg` (so the new
/// cgroup namespace is rooted at `cg`).
fn in_cgroup_namespace(ns: &Netns, cg: &TestCgroup, own_mount: bool, script: &str) -> Command {
    let mut cmd = ns.command("unshare");
    cmd.arg("--cgroup");
    if own_mount {
        cmd.args(["--mount", "--propagation", "private"]);
    }
    cmd.args(["--", "sh", "-c", script]);
    cg.enter_on_spawn(&mut cmd).unwrap();
    cmd
}

/// `mkdir DIR; mount -t cgroup2 none DIR; exec kproxy ARGS --bpf-cgroup=DIR`.
fn own_mount_script(dir: &Path, args: &[String]) -> String {
    format!(
        "mkdir -p {d} && mount -t cgroup2 none {d} && exec {bin} {args} --bpf-cgroup={d}",
        d = dir.display(),
        bin = kproxy_bin().unwrap().display(),
        args = args.join(" ")
    )
}

/// `GET /proxyMode` from the agent's metrics server inside `ns`, once it answers.
fn proxy_mode(agent: &mut AgentProcess, ns: &Netns) -> String {
    agent.wait_for("the metrics server", || {
        http_get(ns, 10249, "/proxyMode").map(|(_, b)| b.trim().to_string())
    })
}

fn common_args(m: &Path, bpffs: &Bpffs) -> Vec<String> {
    vec![
        format!("--manifests={}", m.display()),
        "--hostname-override=kpt-node".into(),
        format!("--bpffs={}", bpffs.path().display()),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
    ]
}

#[test]
fn forced_ebpf_in_a_private_cgroup_namespace_fails_naming_the_cgroup() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ac-forced").unwrap();
    let cg = TestCgroup::new("ac-forced-cg").unwrap();
    let bpffs = Bpffs::new("ac-forced-fs").unwrap();
    let scratch = ScratchDir::new("ac-forced").unwrap();
    let mnt = scratch.0.join("cgroup");
    let mut args = common_args(&manifests(&scratch.0), &bpffs);
    args.push("--proxy-mode=ebpf".into());
    let o = in_cgroup_namespace(&ns, &cg, true, &own_mount_script(&mnt, &args))
        .output()
        .unwrap();
    let err = strip_ansi(&String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("error: --proxy-mode=ebpf"), "{err}");
    assert!(
        err.contains(&format!("--bpf-cgroup {}", mnt.display())) && err.contains(REFUSAL),
        "{err}"
    );
    // Nothing was attached or pinned.
    assert_eq!(bpffs.entries().unwrap(), Vec::<String>::new());
}

#[test]
fn detection_in_a_private_cgroup_namespace_falls_back_and_logs_why() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ac-detect").unwrap();
    let cg = TestCgroup::new("ac-detect-cg").unwrap();
    let bpffs = Bpffs::new("ac-detect-fs").unwrap();
    let scratch = ScratchDir::new("ac-detect").unwrap();
    let mnt = scratch.0.join("cgroup");
    let args = common_args(&manifests(&scratch.0), &bpffs);
    let mut agent = AgentProcess::spawn(
        in_cgroup_namespace(&ns, &cg, true, &own_mount_script(&mnt, &args)),
        scratch.0.join("kproxy.log"),
    );
    let mode = proxy_mode(&mut agent, &ns);
    let log = agent.log();
    // The next mode is nftables where `nft` runs (kernel >= 5.13 here), else ipvs, which
    // this host kernel cannot run, else iptables.
    let nft = Command::new("nft")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let want = if nft {
        "nftables"
    } else if kproxy::dataplane::ipvs::usable().is_ok() {
        "ipvs"
    } else {
        "iptables"
    };
    assert_eq!(mode, want, "{log}");
    assert!(
        log.lines().any(|l| l.contains("proxy mode rejected")
            && l.contains("mode=ebpf")
            && l.contains(REFUSAL)),
        "the log says why ebpf was rejected:\n{log}"
    );
}

#[test]
fn a_cgroup_namespace_that_sees_the_hosts_hierarchy_runs_ebpf() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ac-host").unwrap();
    let cg = TestCgroup::new("ac-host-cg").unwrap();
    let bpffs = Bpffs::new("ac-host-fs").unwrap();
    let scratch = ScratchDir::new("ac-host").unwrap();
    let mut args = common_args(&manifests(&scratch.0), &bpffs);
    args.push("--proxy-mode=ebpf".into());
    args.push(format!("--bpf-cgroup={}", cg.path().display()));
    let script = format!(
        "exec {} {}",
        kproxy_bin().unwrap().display(),
        args.join(" ")
    );
    let mut agent = AgentProcess::spawn(
        in_cgroup_namespace(&ns, &cg, false, &script),
        scratch.0.join("kproxy.log"),
    );
    assert_eq!(proxy_mode(&mut agent, &ns), "ebpf", "{}", agent.log());
    assert!(!agent.log().contains(REFUSAL), "{}", agent.log());
    // Socket LB is attached (its links pinned) to the test cgroup.
    let links = std::fs::read_dir(bpffs.path().join("kproxy/links"))
        .unwrap()
        .count();
    assert_eq!(
        links,
        kproxy_common::sock::PROGRAMS.len(),
        "{}",
        agent.log()
    );
}
