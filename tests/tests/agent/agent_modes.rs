//! The real `kproxy` binary in a node namespace of the shared topology, end to end:
//!
//! - mode detection: without CAP_BPF/CAP_SYS_ADMIN (`capsh --drop`) and without
//!   `--proxy-mode` it runs nftables (GET /proxyMode) and serves a ClusterIP and a NodePort;
//!   with full capabilities it detects ebpf;
//! - `--proxy-mode=nftables`: serves, removes the other modes' leftovers but keeps (adopts)
//!   the `ip kube-proxy` table across restarts; `kproxy cleanup` deletes the table;
//! - at start, the leftovers of other modes and of upstream kube-proxy are removed (KUBE-*
//!   chains of both iptables backends, `ip kube-proxy` nft table, ipsets, `kube-ipvs0`);
//! - `kproxy inspect --output json` shows the service and its programmed backends;
//! - after `kproxy cleanup`, iptables-save, ipset, the bpffs and bpftool show nothing of
//!   kproxy's.
//!
//! IPVS cannot run on this host kernel (no ip_vs); its cleanup is covered by the guest suite.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kproxy_tests::agentproc::{AgentProcess, ScratchDir, http_get, strip_ansi};
use kproxy_tests::manifests::{self as yaml, Port};
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup, require_root};
use kproxy_tests::topology::{
    NODE_IP, NODE_POD_CIDR, Probe, Topology, TopologySpec, assert_spread, kproxy_bin,
};

const NODE: &str = "kpt-node";
const CLUSTER_IP: &str = "10.96.0.10";
const NODE_PORT: u16 = 30080;

fn manifests(topo: &Topology, dir: &Path) -> PathBuf {
    let http = [Port::tcp("http", 80, 8080).node_port(NODE_PORT)];
    let eps: Vec<_> = topo.local_pods().map(|p| (p.ip, NODE)).collect();
    yaml::write(
        dir,
        &[
            yaml::node(NODE, NODE_IP, NODE_POD_CIDR),
            yaml::service("web", CLUSTER_IP, &http),
            yaml::slice("web", &http, &eps).yaml(),
        ],
    )
}

/// Waits until `addr` answers from `ns` (in `cg`); panics with the agent's log otherwise.
fn wait_serving(agent: &mut AgentProcess, ns: &Netns, cg: Option<&TestCgroup>, addr: &str) {
    agent.wait_for(&format!("{addr} to answer"), || {
        Probe::tcp(addr, 1)
            .timeout(Duration::from_millis(500))
            .run(ns, cg)
            .ok()
            .filter(|r| r.total_answers() == 1)
    });
}

/// `GET path` from the metrics server at 127.0.0.1:10249 inside `ns`: the body.
fn metrics_get(ns: &Netns, path: &str) -> String {
    http_get(ns, 10249, path).expect("metrics server").1
}

fn out(ns: &Netns, program: &str, args: &[&str]) -> String {
    let o = ns.command(program).args(args).output().unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn ok(ns: &Netns, program: &str, args: &[&str]) -> bool {
    ns.command(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Every `KUBE-` line of the nat, filter and mangle tables of both iptables backends, except
/// `KUBE-FIREWALL` (kubelet's chain; the iptables proxier writes its localnet rule like
/// upstream, and like upstream's cleanup leaves it).
fn kube_rules(ns: &Netns) -> Vec<String> {
    let mut v = vec![];
    for bin in ["iptables-nft-save", "iptables-legacy-save"] {
        for table in ["nat", "filter", "mangle"] {
            v.extend(
                out(ns, bin, &["-t", table])
                    .lines()
                    .filter(|l| l.contains("KUBE-") && !l.contains("KUBE-FIREWALL"))
                    .map(|l| format!("{bin} {table}: {l}")),
            );
        }
    }
    v
}

fn ipsets(ns: &Netns) -> Vec<String> {
    out(ns, "ipset", &["list", "-n"])
        .lines()
        .map(String::from)
        .collect()
}

/// What upstream kube-proxy (iptables + ipvs + nftables modes) would leave behind (this host
/// kernel has no `dummy` driver: a bridge stands in for the `kube-ipvs0` device).
fn seed_upstream_leftovers(ns: &Netns, iptables_chains: bool) {
    let chains: &[(&str, &str)] = if iptables_chains {
        &[
            ("iptables-legacy", "KUBE-SVC-LEFTOVERLEGACY1"),
            ("iptables-nft", "KUBE-SEP-LEFTOVERNFTABLES"),
        ]
    } else {
        &[]
    };
    for &(bin, chain) in chains {
        ns.exec(bin, &["-t", "nat", "-N", "KUBE-SERVICES"]).unwrap();
        ns.exec(bin, &["-t", "nat", "-N", chain]).unwrap();
        ns.exec(bin, &["-t", "nat", "-A", "KUBE-SERVICES", "-j", chain])
            .unwrap();
        ns.exec(
            bin,
            &[
                "-t",
                "nat",
                "-A",
                "PREROUTING",
                "-m",
                "comment",
                "--comment",
                "kubernetes service portals",
                "-j",
                "KUBE-SERVICES",
            ],
        )
        .unwrap();
    }
    ns.exec("ipset", &["create", "KUBE-CLUSTER-IP", "hash:ip,port"])
        .unwrap();
    ns.ip(&["link", "add", "kube-ipvs0", "type", "bridge"])
        .unwrap();
    ns.exec("nft", &["add", "table", "ip", "kube-proxy"])
        .unwrap();
}

fn assert_no_upstream_leftovers(ns: &Netns, agent: &AgentProcess, iptables_mode: bool) {
    if !iptables_mode {
        assert_eq!(kube_rules(ns), Vec::<String>::new(), "{}", agent.log());
    } else {
        let rules = kube_rules(ns);
        assert!(
            !rules.iter().any(|l| l.contains("LEFTOVER")),
            "upstream's stale service chains stay: {rules:#?}"
        );
    }
    assert_eq!(ipsets(ns), Vec::<String>::new(), "{}", agent.log());
    assert!(
        !ok(ns, "ip", &["link", "show", "kube-ipvs0"]),
        "kube-ipvs0 stays"
    );
    assert!(
        !ok(ns, "nft", &["list", "table", "ip", "kube-proxy"]),
        "nft table ip kube-proxy stays"
    );
}

fn topology(hint: &str) -> Topology {
    let mut t = TopologySpec::new(hint)
        .local_pods(2)
        .remote_pods(0)
        .ipv6(false)
        .build()
        .unwrap();
    t.serve_all().unwrap();
    t
}

fn kproxy_cmd(ns: &Netns, args: &[String]) -> Command {
    let mut c = ns.command(kproxy_bin().unwrap());
    c.args(args);
    c
}

fn inspect(ns: &Netns, args: &[String]) -> serde_json::Value {
    let o = kproxy_cmd(ns, args)
        .args(["inspect", "--output", "json"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

fn assert_inspect_web(v: &serde_json::Value, mode: &str, topo: &Topology) {
    assert_eq!(v["mode"], mode, "{v:#}");
    let svcs = v["services"].as_array().unwrap();
    let web = svcs
        .iter()
        .find(|s| s["name"] == "default/web:http")
        .unwrap_or_else(|| panic!("no default/web:http in {v:#}"));
    let want: BTreeSet<String> = topo
        .local_pods()
        .map(|p| format!("{}:8080", p.ip))
        .collect();
    let backends: BTreeSet<String> = web["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            assert_eq!(b["ready"], true);
            assert_eq!(b["local"], true);
            b["address"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(backends, want);
    let programmed: BTreeSet<String> = web["kernel_backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap().to_string())
        .collect();
    assert_eq!(programmed, want, "{web:#}");
    assert!(!web["kernel"].as_array().unwrap().is_empty(), "{web:#}");
}

#[test]
fn without_bpf_capabilities_detection_picks_nftables_and_serves() {
    if !require_root() {
        return;
    }
    let topo = topology("am-caps");
    let scratch = ScratchDir::new("am-caps").unwrap();
    let m = manifests(&topo, &scratch.0);
    topo.node
        .exec("nft", &["add", "table", "ip", "kube-proxy"])
        .unwrap();
    topo.node
        .ip(&["link", "add", "kube-ipvs0", "type", "bridge"])
        .unwrap();
    let script = format!(
        "exec {} --manifests={} --hostname-override={NODE} --metrics-bind-address=127.0.0.1:10249",
        kproxy_bin().unwrap().display(),
        m.display()
    );
    let mut cmd = topo.node.command("capsh");
    cmd.args([
        "--drop=cap_bpf,cap_sys_admin,cap_perfmon",
        "--",
        "-c",
        &script,
    ]);
    let mut agent = AgentProcess::spawn(cmd, scratch.0.join("kproxy.log"));
    let pod0 = &topo.local_pods().next().unwrap().ns;
    wait_serving(&mut agent, pod0, None, &format!("{CLUSTER_IP}:80"));
    assert_eq!(metrics_get(&topo.node, "/proxyMode").trim(), "nftables");
    // The nftables datapath reports its syncs into upstream's metrics. The rules answer as
    // soon as the transaction is committed, before the runner records the sync: poll.
    let full_syncs = |metrics: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("kubeproxy_sync_full_proxy_rules_duration_seconds_count")
                    && l.contains("IPv4")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut metrics = metrics_get(&topo.node, "/metrics");
    while full_syncs(&metrics) < Some(1.0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        metrics = metrics_get(&topo.node, "/metrics");
    }
    assert!(
        full_syncs(&metrics) >= Some(1.0),
        "no full sync counted:\n{metrics}"
    );
    let log = agent.log();
    assert!(
        log.lines()
            .any(|l| l.contains("proxy mode rejected") && l.contains("mode=ebpf")),
        "the log says why ebpf was rejected:\n{log}"
    );
    let names: Vec<String> = topo.local_pods().map(|p| p.name.clone()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let r = Probe::tcp(format!("{CLUSTER_IP}:80"), 40)
        .run(pod0, None)
        .unwrap();
    assert_spread(&r, &names);
    let r = Probe::tcp(format!("{NODE_IP}:{NODE_PORT}"), 40)
        .run(&topo.client, None)
        .unwrap();
    assert_spread(&r, &names);
    // The ipvs mode's leftovers are removed; the nftables mode's table is its own (upstream
    // kube-proxy's empty table was adopted and now holds the services).
    assert!(ok(
        &topo.node,
        "nft",
        &["list", "chain", "ip", "kube-proxy", "services"]
    ));
    assert!(!ok(&topo.node, "ip", &["link", "show", "kube-ipvs0"]));
}

/// The chain names of the `family kube-proxy` table (empty when the table does not exist).
fn nft_chains(ns: &Netns, family: &str) -> Vec<String> {
    let v: serde_json::Value =
        serde_json::from_str(&out(ns, "nft", &["-j", "list", "chains", family]))
            .unwrap_or_default();
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("chain"))
        .filter(|c| c["table"] == "kube-proxy")
        .filter_map(|c| c["name"].as_str().map(String::from))
        .collect()
}

#[test]
fn nftables_forced_serves_keeps_its_table_on_restart_and_cleanup_removes_it() {
    if !require_root() {
        return;
    }
    let topo = topology("am-nft");
    let scratch = ScratchDir::new("am-nft").unwrap();
    let m = manifests(&topo, &scratch.0);
    seed_upstream_leftovers(&topo.node, true);
    let common = vec![
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=nftables".to_string(),
        "--metrics-bind-address=127.0.0.1:10249".to_string(),
    ];
    let mut agent = AgentProcess::spawn(
        kproxy_cmd(&topo.node, &common),
        scratch.0.join("kproxy.log"),
    );
    let pod0 = &topo.local_pods().next().unwrap().ns;
    wait_serving(&mut agent, pod0, None, &format!("{CLUSTER_IP}:80"));
    assert_eq!(metrics_get(&topo.node, "/proxyMode").trim(), "nftables");
    let metrics = metrics_get(&topo.node, "/metrics");
    assert!(
        metrics.contains(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family=\"IPv4\"} 0"
        ),
        "{metrics}"
    );
    let names: Vec<String> = topo.local_pods().map(|p| p.name.clone()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let r = Probe::tcp(format!("{NODE_IP}:{NODE_PORT}"), 40)
        .run(&topo.client, None)
        .unwrap();
    assert_spread(&r, &names);
    // The iptables and ipvs modes' leftovers are gone; the nftables table is kproxy's.
    assert_eq!(
        kube_rules(&topo.node),
        Vec::<String>::new(),
        "{}",
        agent.log()
    );
    assert_eq!(ipsets(&topo.node), Vec::<String>::new());
    assert!(!ok(&topo.node, "ip", &["link", "show", "kube-ipvs0"]));
    let chains = nft_chains(&topo.node, "ip");
    assert!(
        chains.iter().any(|c| c == "services") && chains.iter().any(|c| c.starts_with("service-")),
        "{chains:?}"
    );

    // A restart in nftables mode keeps the table (start-up cleanup no longer deletes it): a
    // chain kproxy does not own survives, and the services are served again.
    agent.kill();
    topo.node
        .exec("nft", &["add", "chain", "ip", "kube-proxy", "kp-marker"])
        .unwrap();
    let mut agent = AgentProcess::spawn(
        kproxy_cmd(&topo.node, &common),
        scratch.0.join("kproxy2.log"),
    );
    // The old rules answer before the new agent ran its start-up cleanup: wait for its
    // first full sync (which comes after the cleanup), then for the service.
    agent.wait_for("the first full sync", || {
        http_get(&topo.node, 10249, "/metrics").filter(|(_, body)| {
            body.lines().any(|l| {
                l.starts_with("kubeproxy_sync_full_proxy_rules_duration_seconds_count")
                    && l.contains("IPv4")
                    && !l.ends_with(" 0")
            })
        })
    });
    wait_serving(&mut agent, pod0, None, &format!("{CLUSTER_IP}:80"));
    assert!(
        nft_chains(&topo.node, "ip")
            .iter()
            .any(|c| c == "kp-marker"),
        "the table was deleted at start-up:\n{}",
        agent.log()
    );
    agent.kill();

    let o = kproxy_cmd(&topo.node, &common)
        .arg("cleanup")
        .output()
        .unwrap();
    let log = strip_ansi(&format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    ));
    assert!(o.status.success(), "kproxy cleanup failed: {log}");
    assert_eq!(nft_chains(&topo.node, "ip"), Vec::<String>::new(), "{log}");
    assert_eq!(nft_chains(&topo.node, "ip6"), Vec::<String>::new(), "{log}");
    assert!(!ok(
        &topo.node,
        "nft",
        &["list", "table", "ip", "kube-proxy"]
    ));
}

#[test]
fn ebpf_detected_then_inspect_then_cleanup_leaves_nothing() {
    if !require_root() {
        return;
    }
    let topo = topology("am-ebpf");
    let scratch = ScratchDir::new("am-ebpf").unwrap();
    let bpffs = Bpffs::new("am-ebpf-fs").unwrap();
    let cg = TestCgroup::new("am-ebpf-cg").unwrap();
    let m = manifests(&topo, &scratch.0);
    seed_upstream_leftovers(&topo.node, true);
    let common = vec![
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        format!("--bpffs={}", bpffs.path().display()),
        format!("--bpf-cgroup={}", cg.path().display()),
    ];
    let mut cmd = kproxy_cmd(&topo.node, &common);
    cmd.arg("--metrics-bind-address=127.0.0.1:10249");
    let mut agent = AgentProcess::spawn(cmd, scratch.0.join("kproxy.log"));
    let pod0 = &topo.local_pods().next().unwrap().ns;
    wait_serving(&mut agent, pod0, Some(&cg), &format!("{CLUSTER_IP}:80"));
    assert_eq!(metrics_get(&topo.node, "/proxyMode").trim(), "ebpf");
    assert_no_upstream_leftovers(&topo.node, &agent, false);

    let names: Vec<String> = topo.local_pods().map(|p| p.name.clone()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let r = Probe::tcp(format!("{CLUSTER_IP}:80"), 40)
        .run(pod0, Some(&cg))
        .unwrap();
    assert_spread(&r, &names);
    let r = Probe::tcp(format!("{NODE_IP}:{NODE_PORT}"), 40)
        .run(&topo.client, None)
        .unwrap();
    assert_spread(&r, &names);

    let v = inspect(&topo.node, &common);
    assert_inspect_web(&v, "ebpf", &topo);
    let maps = v["maps"].as_array().unwrap();
    assert!(
        maps.iter()
            .any(|m| m["map"] == "KP_SERVICES" && m["entries"].as_u64() > Some(0)),
        "{v:#}"
    );
    let web = v["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "default/web:http")
        .unwrap();
    assert!(
        web["ct_entries"].as_u64() > Some(0),
        "NodePort flows went through the TC path's CT: {web:#}"
    );

    // The links kproxy pinned (socket LB on the cgroup, TC on the node's devices) and the
    // programs behind them, while the agent runs.
    let num_after = |json: &str, field: &str| -> Vec<u64> {
        json.split(&format!("\"{field}\":"))
            .skip(1)
            .filter_map(|t| {
                t.trim_start()
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse().ok())
            })
            .collect()
    };
    let link_dir = bpffs.path().join("kproxy/links");
    let mut links = BTreeSet::new();
    let mut progs = BTreeSet::new();
    let mut tc_links = 0;
    for e in std::fs::read_dir(&link_dir).unwrap() {
        let p = e.unwrap().path();
        tc_links += usize::from(p.file_name().unwrap().to_string_lossy().starts_with("tc-"));
        let j = out(
            &topo.node,
            "bpftool",
            &["-j", "link", "show", "pinned", &p.display().to_string()],
        );
        links.extend(num_after(&j, "id"));
        progs.extend(num_after(&j, "prog_id"));
    }
    let sock_links = kproxy_common::sock::PROGRAMS.len();
    assert!(
        links.len() >= sock_links + 2 && tc_links >= 2,
        "socket LB ({sock_links}) + TC links: {links:?}"
    );
    let cg_path = cg.path().display().to_string();
    assert_eq!(
        num_after(
            &out(&topo.node, "bpftool", &["-j", "cgroup", "show", &cg_path]),
            "id"
        )
        .len(),
        sock_links,
        "socket LB attached to the test cgroup"
    );

    agent.kill();
    let st = kproxy_cmd(&topo.node, &common)
        .arg("cleanup")
        .status()
        .unwrap();
    assert!(st.success(), "kproxy cleanup failed");
    assert_eq!(bpffs.entries().unwrap(), Vec::<String>::new());
    assert_eq!(
        num_after(
            &out(&topo.node, "bpftool", &["-j", "cgroup", "show", &cg_path]),
            "id"
        ),
        Vec::<u64>::new(),
        "socket LB detached"
    );
    // Links and programs are freed once the pins are gone (asynchronously).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all_links: BTreeSet<u64> =
            num_after(&out(&topo.node, "bpftool", &["-j", "link", "show"]), "id")
                .into_iter()
                .collect();
        let all_progs: BTreeSet<u64> =
            num_after(&out(&topo.node, "bpftool", &["-j", "prog", "show"]), "id")
                .into_iter()
                .collect();
        let l: Vec<&u64> = links.intersection(&all_links).collect();
        let p: Vec<&u64> = progs.intersection(&all_progs).collect();
        if l.is_empty() && p.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "links {l:?} / programs {p:?} still exist"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(kube_rules(&topo.node), Vec::<String>::new());
    assert_eq!(ipsets(&topo.node), Vec::<String>::new());
}

#[test]
fn iptables_forced_then_inspect_then_cleanup_leaves_nothing() {
    if !require_root() {
        return;
    }
    let topo = topology("am-ipt");
    let scratch = ScratchDir::new("am-ipt").unwrap();
    let m = manifests(&topo, &scratch.0);
    seed_upstream_leftovers(&topo.node, false);
    let common = vec![
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=iptables".to_string(),
    ];
    let mut agent = AgentProcess::spawn(
        kproxy_cmd(&topo.node, &common),
        scratch.0.join("kproxy.log"),
    );
    let pod0 = &topo.local_pods().next().unwrap().ns;
    wait_serving(&mut agent, pod0, None, &format!("{CLUSTER_IP}:80"));
    assert_no_upstream_leftovers(&topo.node, &agent, true);
    let v = inspect(&topo.node, &common);
    assert_inspect_web(&v, "iptables", &topo);

    agent.kill();
    let o = kproxy_cmd(&topo.node, &common)
        .arg("cleanup")
        .output()
        .unwrap();
    let log = strip_ansi(&format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    ));
    assert!(o.status.success(), "kproxy cleanup failed: {log}");
    // A clean run warns about nothing (the IPVS mode's chain deletions used to run before
    // the iptables mode's rules that jump to the shared chains were gone: CHAIN_DEL busy).
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("failed"))
        .collect();
    assert_eq!(warnings, Vec::<&str>::new(), "cleanup log:\n{log}");
    assert_eq!(kube_rules(&topo.node), Vec::<String>::new());
    assert_eq!(ipsets(&topo.node), Vec::<String>::new());
}

#[test]
fn a_forced_mode_that_cannot_run_fails_naming_the_mode_and_why() {
    if !require_root() {
        return;
    }
    if kproxy::dataplane::ipvs::usable().is_ok() {
        eprintln!("skipped: this kernel runs IPVS, so --proxy-mode=ipvs would start");
        return;
    }
    let ns = Netns::new("am-forced").unwrap();
    let o = ns
        .command(kproxy_bin().unwrap())
        .args([
            "--proxy-mode=ipvs",
            "--manifests=/nonexistent",
            "--hostname-override=n",
            "--metrics-bind-address=127.0.0.1:10249",
        ])
        .output()
        .unwrap();
    let err = strip_ansi(&String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("error: --proxy-mode=ipvs: IPVS is not usable"),
        "{err}"
    );
}

/// The node's netfilter tables: legacy x_tables tables (`/proc/net/ip{,6}_tables_names`, which
/// listing does not create) and nf_tables tables (`nft list tables`).
fn netfilter_tables(ns: &Netns) -> BTreeSet<String> {
    let mut t = BTreeSet::new();
    for (file, fam) in [
        ("/proc/net/ip_tables_names", "legacy ip"),
        ("/proc/net/ip6_tables_names", "legacy ip6"),
    ] {
        t.extend(
            out(ns, "cat", &[file])
                .lines()
                .map(|l| format!("{fam} {l}")),
        );
    }
    t.extend(
        out(ns, "nft", &["list", "tables"])
            .lines()
            .map(String::from),
    );
    t
}

/// A start in nftables mode, then in ebpf mode, then `kproxy inspect` and `kproxy cleanup`,
/// on a node with no netfilter tables: each leaves only what its mode owns. Reading another
/// mode's leftovers with `iptables-legacy-save -t TABLE` creates that legacy table, which the
/// start-up cleanup once did for filter, nat and mangle of both families.
#[test]
fn a_start_in_any_mode_creates_no_table_it_does_not_own() {
    if !require_root() {
        return;
    }
    let topo = topology("am-own");
    let scratch = ScratchDir::new("am-own").unwrap();
    let bpffs = Bpffs::new("am-own-fs").unwrap();
    let cg = TestCgroup::new("am-own-cg").unwrap();
    let m = manifests(&topo, &scratch.0);
    let before = netfilter_tables(&topo.node);
    assert!(
        !before.iter().any(|t| t.starts_with("legacy")),
        "the test node starts with legacy tables: {before:?}"
    );
    let pod0 = &topo.local_pods().next().unwrap().ns;
    let nft_args = vec![
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=nftables".to_string(),
        "--metrics-bind-address=127.0.0.1:10249".to_string(),
    ];
    let mut agent = AgentProcess::spawn(
        kproxy_cmd(&topo.node, &nft_args),
        scratch.0.join("kproxy-nft.log"),
    );
    wait_serving(&mut agent, pod0, None, &format!("{CLUSTER_IP}:80"));
    // Its own tables (`ip6` only where the node runs IPv6), nothing else.
    let added: BTreeSet<String> = netfilter_tables(&topo.node)
        .difference(&before)
        .cloned()
        .collect();
    let own = ["table ip kube-proxy", "table ip6 kube-proxy"];
    assert!(
        added.contains(own[0]) && added.iter().all(|t| own.contains(&t.as_str())),
        "tables added by a start in nftables mode: {added:?}\n{}",
        agent.log()
    );
    agent.kill();

    let ebpf_args = vec![
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=ebpf".to_string(),
        format!("--bpffs={}", bpffs.path().display()),
        format!("--bpf-cgroup={}", cg.path().display()),
        "--metrics-bind-address=127.0.0.1:10249".to_string(),
    ];
    let mut agent = AgentProcess::spawn(
        kproxy_cmd(&topo.node, &ebpf_args),
        scratch.0.join("kproxy-ebpf.log"),
    );
    // The old table's rules answer until the new mode is built (after the leftovers went):
    // wait for its first sync.
    let log = scratch.0.join("kproxy-ebpf.log");
    agent.wait_for("the first sync", || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|l| l.contains("first sync done"))
    });
    wait_serving(&mut agent, pod0, Some(&cg), &format!("{CLUSTER_IP}:80"));
    // The nftables mode's tables went with its leftovers; nothing else appeared.
    assert_eq!(netfilter_tables(&topo.node), before, "{}", agent.log());
    agent.kill();

    let detect: Vec<String> = ebpf_args
        .iter()
        .filter(|a| !a.starts_with("--proxy-mode"))
        .cloned()
        .collect();
    let v = inspect(&topo.node, &detect);
    assert_eq!(v["mode"], "ebpf", "{v:#}");
    let o = kproxy_cmd(&topo.node, &ebpf_args)
        .arg("cleanup")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(netfilter_tables(&topo.node), before);
}
