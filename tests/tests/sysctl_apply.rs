//! `kproxy::app::sysctl::apply` doing real file I/O: on a fake /proc + /sys tree (the global
//! conntrack settings, which must never be changed on the test machine), and inside a test
//! network namespace for the per-namespace sysctls.

use std::fs;
use std::path::Path;
use std::time::Duration;

use kproxy::app::sysctl::BRIDGE_NF_CALL_IPTABLES;
use kproxy::app::sysctl::CONNTRACK_MAX;
use kproxy::app::sysctl::Change;
use kproxy::app::sysctl::ConntrackConfig;
use kproxy::app::sysctl::Host;
use kproxy::app::sysctl::ROUTE_LOCALNET;
use kproxy::app::sysctl::SysctlConfig;
use kproxy::app::sysctl::TCP_BE_LIBERAL;
use kproxy::app::sysctl::TCP_CLOSE_WAIT;
use kproxy::app::sysctl::TCP_ESTABLISHED;
use kproxy::app::sysctl::Target;
use kproxy::app::sysctl::UDP_STREAM_TIMEOUT;
use kproxy::app::sysctl::UDP_TIMEOUT;
use kproxy::app::sysctl::apply;
use kproxy_tests::netns::{Netns, require_root, unique_name};

/// A temp directory removed on drop.
struct TempTree(std::path::PathBuf);
impl Drop for TempTree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn put(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, text).unwrap();
}

fn fake_host(sysfs_opts: &str) -> (TempTree, Host) {
    let dir = std::env::temp_dir().join(unique_name("sysctl-fake"));
    let root = &dir;
    put(root, "proc/sys/net/netfilter/nf_conntrack_max", "65536\n");
    put(
        root,
        "sys/module/nf_conntrack/parameters/hashsize",
        "16384\n",
    );
    put(
        root,
        "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established",
        "432000\n",
    );
    put(
        root,
        "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait",
        "3600\n",
    );
    put(
        root,
        "proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal",
        "0\n",
    );
    put(
        root,
        "proc/sys/net/netfilter/nf_conntrack_udp_timeout",
        "30\n",
    );
    put(
        root,
        "proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream",
        "120\n",
    );
    put(root, "proc/sys/net/ipv4/conf/all/route_localnet", "0\n");
    put(root, "proc/sys/net/bridge/bridge-nf-call-iptables", "0\n");
    put(root, "sys/devices/system/cpu/online", "0-7\n");
    put(
        root,
        "proc/self/mounts",
        &format!("proc /proc proc rw 0 0\nsysfs /sys sysfs {sysfs_opts},nosuid 0 0\n"),
    );
    let host = Host::rooted(&dir);
    (TempTree(dir), host)
}

fn full_config() -> SysctlConfig {
    SysctlConfig {
        conntrack: ConntrackConfig {
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(30),
            udp_stream_timeout: Duration::from_secs(180),
            ..ConntrackConfig::upstream_defaults()
        },
        localhost_node_ports: true,
    }
}

#[test]
fn fake_tree_gets_upstreams_values_once() {
    let (_tree, host) = fake_host("rw");
    let report = apply(&full_config(), &host);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    // 8 CPUs × 32768 = 262144 > min 131072; hashsize 262144/4.
    let c = |target, old, new| Change {
        target,
        old: Some(old),
        new,
    };
    assert_eq!(
        report.written,
        vec![
            c(CONNTRACK_MAX, 65536, 262144),
            c(Target::ConntrackHashsize, 16384, 65536),
            c(TCP_ESTABLISHED, 432000, 86400),
            c(TCP_BE_LIBERAL, 0, 1),
            c(UDP_STREAM_TIMEOUT, 120, 180),
            c(ROUTE_LOCALNET, 0, 1),
        ]
    );
    assert_eq!(
        report.plan.unchanged,
        vec![(TCP_CLOSE_WAIT, 3600), (UDP_TIMEOUT, 30)]
    );
    for (target, want) in [
        (CONNTRACK_MAX, 262144),
        (Target::ConntrackHashsize, 65536),
        (TCP_ESTABLISHED, 86400),
        (TCP_BE_LIBERAL, 1),
        (UDP_STREAM_TIMEOUT, 180),
        (ROUTE_LOCALNET, 1),
    ] {
        assert_eq!(host.read(target).unwrap(), want, "{target}");
    }
    let warning = report.bridge_warning.expect("bridge-nf-call-iptables is 0");
    assert!(warning.contains("is 0"), "{warning}");

    // Applying again changes nothing.
    let again = apply(&full_config(), &host);
    assert!(
        again.written.is_empty() && again.errors.is_empty(),
        "{again:?}"
    );
    assert_eq!(again.plan.unchanged.len(), 8);
}

#[test]
fn read_only_sysfs_skips_hashsize_and_write_errors_are_reported() {
    let (tree, host) = fake_host("ro");
    // A target that cannot be written: its path is a directory.
    fs::remove_file(host.path(UDP_STREAM_TIMEOUT)).unwrap();
    fs::create_dir(host.path(UDP_STREAM_TIMEOUT)).unwrap();
    let report = apply(&full_config(), &host);
    assert_eq!(report.plan.skipped.len(), 1, "{:?}", report.plan.skipped);
    assert_eq!(report.plan.skipped[0].0, Target::ConntrackHashsize);
    assert_eq!(
        host.read(Target::ConntrackHashsize).unwrap(),
        16384,
        "untouched"
    );
    assert_eq!(
        host.read(CONNTRACK_MAX).unwrap(),
        262144,
        "the max is still set"
    );
    assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
    let msg = report.errors[0].to_string();
    assert!(
        msg.contains("net.netfilter.nf_conntrack_udp_timeout_stream") && msg.contains("180"),
        "{msg}"
    );
    assert_eq!(
        host.read(ROUTE_LOCALNET).unwrap(),
        1,
        "later writes still happen"
    );
    drop(tree);
}

#[test]
fn per_namespace_sysctls_are_set_in_a_test_netns_only() {
    if !require_root() {
        return;
    }
    let real = Host::real();
    let host_before: Vec<Option<i64>> =
        [TCP_ESTABLISHED, TCP_BE_LIBERAL, UDP_TIMEOUT, ROUTE_LOCALNET]
            .iter()
            .map(|t| real.read(*t).ok())
            .collect();
    let ns = Netns::new("sysctl-apply").unwrap();
    ns.sysctl("net.bridge.bridge-nf-call-iptables", "0")
        .unwrap();
    eprintln!(
        "skipped: writing {CONNTRACK_MAX} and the nf_conntrack hashsize: both are global (read-only \
         outside the initial network namespace); their writes are tested on a fake tree"
    );
    let cfg = SysctlConfig {
        conntrack: ConntrackConfig {
            max_per_core: 0,
            min: 0,
            tcp_established_timeout: Duration::from_secs(12345),
            tcp_close_wait_timeout: Duration::from_secs(678),
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(45),
            udp_stream_timeout: Duration::from_secs(150),
        },
        localhost_node_ports: true,
    };
    let (report, values) = ns
        .run(|| {
            let host = Host::real();
            let report = apply(&cfg, &host);
            let values: Vec<i64> = [
                TCP_ESTABLISHED,
                TCP_CLOSE_WAIT,
                TCP_BE_LIBERAL,
                UDP_TIMEOUT,
                UDP_STREAM_TIMEOUT,
                ROUTE_LOCALNET,
            ]
            .iter()
            .map(|t| host.read(*t).unwrap())
            .collect();
            (report, values)
        })
        .unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(values, vec![12345, 678, 1, 45, 150, 1]);
    assert_eq!(report.written.len(), 6, "{:?}", report.written);
    assert!(report.written.iter().all(|c| c.old.is_some()));
    assert!(
        report.bridge_warning.is_some(),
        "{BRIDGE_NF_CALL_IPTABLES}=0 in the netns is reported"
    );
    let host_after: Vec<Option<i64>> =
        [TCP_ESTABLISHED, TCP_BE_LIBERAL, UDP_TIMEOUT, ROUTE_LOCALNET]
            .iter()
            .map(|t| real.read(*t).ok())
            .collect();
    assert_eq!(
        host_before, host_after,
        "the host's own values are untouched"
    );
}
