//! The registry's view of the faces: every mode has one, the orders, and what each face maps
//! from the configuration where modes differ (NodePort addresses, local-traffic detection,
//! sync periods, metrics, render).

use std::net::IpAddr;

use ipnet::IpNet;

use super::*;
use crate::config::ModeChoice;
use crate::dataplane::netfilter::backend::Flavor;
use crate::dataplane::netfilter::local_detect::LocalDetector;
use crate::model::IpFamily;

fn cfg(args: &[&str]) -> ProxyConfig {
    let mut v = vec!["kproxy"];
    v.extend_from_slice(args);
    let inv = crate::cli::parse(v.into_iter().map(std::ffi::OsString::from)).unwrap();
    crate::cli::load(&inv, Some("n".into())).unwrap().config
}

/// The IPv4 IPVS proxier's configuration with NodePorts on `ip`.
fn ipvs_v4(
    c: &ProxyConfig,
    ip: IpAddr,
    flavor: Flavor,
    pod_cidrs: &[IpNet],
) -> crate::dataplane::ipvs::face::IpvsConfig {
    crate::dataplane::ipvs::face::configs(c, &[IpFamily::V4], |_| vec![ip], flavor, pod_cidrs)
        .remove(0)
}

/// A dual-stack cluster CIDR and `--masquerade-all`, plus `extra` flags.
fn dual_stack_masquerading(extra: &[&str]) -> ProxyConfig {
    let mut args = vec![
        "--cluster-cidr=10.244.0.0/16,fd00:10::/64",
        "--masquerade-all",
    ];
    args.extend_from_slice(extra);
    cfg(&args)
}

#[test]
fn every_mode_has_its_face_and_detection_tries_nftables_after_ebpf_and_before_ipvs() {
    for m in ProxyMode::ALL {
        assert_eq!(face(m).mode(), m);
        assert_eq!(face(m).metrics().mode, m);
    }
    assert_eq!(
        DETECT_ORDER,
        [
            ProxyMode::Ebpf,
            ProxyMode::Nftables,
            ProxyMode::Ipvs,
            ProxyMode::Iptables
        ]
    );
    for order in [DETECT_ORDER, INSPECT_ORDER, REMOVAL_ORDER] {
        let mut o = order.to_vec();
        o.sort_by_key(|m| m.as_str());
        o.dedup();
        assert_eq!(o.len(), 4, "{order:?} names every mode once");
    }
}

#[test]
fn upstreams_mode_specific_metrics_are_registered_per_mode() {
    let ipt = face(ProxyMode::Iptables).metrics();
    assert!(ipt.iptables_restore && ipt.iptables_sync && !ipt.nftables_sync && !ipt.bpf);
    let ipvs = face(ProxyMode::Ipvs).metrics();
    assert!(ipvs.iptables_restore && !ipvs.iptables_sync && !ipvs.nftables_sync);
    let nft = face(ProxyMode::Nftables).metrics();
    assert!(nft.nftables_sync && !nft.iptables_restore);
    assert!(face(ProxyMode::Ebpf).metrics().bpf);
    let text = metrics(ProxyMode::Ipvs).encode();
    assert!(text.contains("kubeproxy_sync_proxy_rules_iptables_restore_failures"));
    assert!(!text.contains("kubeproxy_sync_full_proxy_rules_duration_seconds"));
}

#[test]
fn runner_periods_follow_the_mode() {
    let mut c = cfg(&[]);
    c.ebpf_sync.sync_period = std::time::Duration::from_secs(10);
    c.iptables.sync.sync_period = std::time::Duration::from_secs(20);
    c.ipvs.sync.sync_period = std::time::Duration::from_secs(40);
    c.nftables.sync.sync_period = std::time::Duration::from_secs(50);
    for (m, secs) in [
        (ProxyMode::Ebpf, 10),
        (ProxyMode::Iptables, 20),
        (ProxyMode::Ipvs, 40),
        (ProxyMode::Nftables, 50),
    ] {
        assert_eq!(runner_config(&c, m).max_interval.as_secs(), secs, "{m}");
    }
}

#[test]
fn unset_node_port_addresses_mean_primary_in_nftables_mode_only() {
    let unset = cfg(&[]);
    assert_eq!(unset.node_port_addresses, NodePortAddresses::Unset);
    assert!(runs_primary(&unset, ProxyMode::Nftables));
    for m in [ProxyMode::Iptables, ProxyMode::Ipvs, ProxyMode::Ebpf] {
        assert!(!runs_primary(&unset, m), "{m}");
    }
    assert!(may_run_primary(&unset));
    let mut forced = unset.clone();
    forced.mode = ModeChoice::Forced(ProxyMode::Nftables);
    assert!(may_run_primary(&forced));
    forced.mode = ModeChoice::Forced(ProxyMode::Iptables);
    assert!(!may_run_primary(&forced));
    let cidrs = cfg(&["--nodeport-addresses=10.0.0.0/8"]);
    assert!(!runs_primary(&cidrs, ProxyMode::Nftables));
    assert!(!may_run_primary(&cidrs));
    let primary = cfg(&["--nodeport-addresses=primary", "--proxy-mode=iptables"]);
    assert!(runs_primary(&primary, ProxyMode::Iptables));
    assert!(may_run_primary(&primary));
}

#[test]
fn a_netfilter_conntrack_mode_is_wrapped_for_cleanup_and_ebpf_is_not() {
    assert!(face(ProxyMode::Iptables).netfilter_conntrack());
    assert!(face(ProxyMode::Ipvs).netfilter_conntrack());
    assert!(face(ProxyMode::Nftables).netfilter_conntrack());
    assert!(!face(ProxyMode::Ebpf).netfilter_conntrack());
}

#[test]
fn node_cidr_mode_detects_local_traffic_by_the_nodes_pod_cidrs() {
    let c = cfg(&["--cluster-cidr=10.0.0.0/8", "--detect-local-mode=NodeCIDR"]);
    let pod_cidrs: Vec<IpNet> = vec![
        "10.244.1.0/24".parse().unwrap(),
        "fd00:244:1::/64".parse().unwrap(),
    ];
    let v =
        crate::dataplane::iptables::face::configs(&c, &[IpFamily::V4, IpFamily::V6], &pod_cidrs);
    assert_eq!(v[0].local_detector, LocalDetector::Cidr(pod_cidrs[0]));
    assert_eq!(v[1].local_detector, LocalDetector::Cidr(pod_cidrs[1]));
    // Not known (yet): nothing is local, never the cluster CIDR.
    let v = crate::dataplane::iptables::face::configs(&c, &[IpFamily::V4], &[]);
    assert_eq!(v[0].local_detector, LocalDetector::None);
    let ip: IpAddr = "192.0.2.1".parse().unwrap();
    let v = ipvs_v4(&c, ip, Flavor::Nft, &pod_cidrs);
    assert_eq!(v.cluster_cidr, Some(pod_cidrs[0]));
    let c = cfg(&["--cluster-cidr=10.0.0.0/8"]);
    let v = ipvs_v4(&c, ip, Flavor::Nft, &pod_cidrs);
    assert_eq!(v.cluster_cidr, Some("10.0.0.0/8".parse().unwrap()));
}

#[test]
fn node_port_addresses_default_to_the_primary_ips_in_nftables_mode_only() {
    let mut c = cfg(&[]);
    c.primary_node_ips = vec!["192.0.2.7".parse().unwrap(), "fd00::7".parse().unwrap()];
    let primary: Vec<IpNet> = vec![
        "192.0.2.7/32".parse().unwrap(),
        "fd00::7/128".parse().unwrap(),
    ];
    let v = crate::dataplane::nftables::face::configs(&c, &[IpFamily::V4], &[]);
    assert_eq!(v[0].node_port_addresses, primary);
    assert_eq!(
        crate::dataplane::iptables::face::configs(&c, &[IpFamily::V4], &[])[0].node_port_addresses,
        vec![]
    );
    assert!(node_port_cidrs(&c, ProxyMode::Ipvs).is_empty());
    assert!(node_port_cidrs(&c, ProxyMode::Ebpf).is_empty());
    // `primary` given explicitly applies to every mode.
    let mut p = cfg(&["--nodeport-addresses=primary"]);
    p.primary_node_ips = c.primary_node_ips.clone();
    assert_eq!(node_port_cidrs(&p, ProxyMode::Iptables), primary);
    // Explicit CIDRs (and `all`) win over the nftables default.
    let a = cfg(&["--nodeport-addresses=all"]);
    assert_eq!(
        crate::dataplane::nftables::face::configs(&a, &[IpFamily::V4], &[])[0].node_port_addresses,
        vec![
            "0.0.0.0/0".parse::<IpNet>().unwrap(),
            "::/0".parse().unwrap()
        ]
    );
    // The Node's IPs unknown: every local address, as upstream with loopback node IPs.
    let unknown = cfg(&["--proxy-mode=nftables"]);
    assert!(node_port_cidrs(&unknown, ProxyMode::Nftables).is_empty());
}

#[test]
fn render_plan_takes_the_primary_ips_from_the_node() {
    use crate::model::testing::snapshot;
    let mut snap = snapshot("n").build();
    snap.node.addresses = vec!["192.0.2.7".parse().unwrap(), "192.0.2.8".parse().unwrap()];
    let out = render_plan(ProxyMode::Nftables, &cfg(&[]), &snap).unwrap();
    assert!(
        out.contains("add element ip kube-proxy nodeport-ips { 192.0.2.7 }"),
        "{out}"
    );
    assert!(!out.contains("192.0.2.8"), "{out}");
}

#[test]
fn render_plan_prints_both_nftables_tables() {
    use crate::model::testing::{endpoint, service_port, snapshot};
    let snap = snapshot("n")
        .service(
            service_port("ns1", "svc1", "p80")
                .cluster_ip("172.30.0.41")
                .build(),
            vec![endpoint("10.180.0.1", 8080).build()],
        )
        .build();
    let out = render_plan(ProxyMode::Nftables, &cfg(&[]), &snap).unwrap();
    assert!(out.starts_with("# IPv4\nadd table ip kube-proxy"), "{out}");
    assert!(out.contains("# IPv6\nadd table ip6 kube-proxy"), "{out}");
    assert!(out.contains("dnat to 10.180.0.1:8080"), "{out}");
}

#[test]
fn iptables_configs_follow_the_proxy_config() {
    let c = dual_stack_masquerading(&[
        "--iptables-masquerade-bit=12",
        "--nodeport-addresses=192.0.2.0/24",
    ]);
    let v = crate::dataplane::iptables::face::configs(&c, &[IpFamily::V4, IpFamily::V6], &[]);
    assert_eq!(v.len(), 2);
    assert_eq!(
        v[0].local_detector,
        LocalDetector::Cidr("10.244.0.0/16".parse().unwrap())
    );
    assert_eq!(
        v[1].local_detector,
        LocalDetector::Cidr("fd00:10::/64".parse().unwrap())
    );
    assert!(v.iter().all(|c| c.masquerade_all && c.masquerade_bit == 12));
    assert_eq!(
        v[0].node_port_addresses,
        vec!["192.0.2.0/24".parse::<IpNet>().unwrap()]
    );
}

#[test]
fn ipvs_configs_follow_the_proxy_config() {
    let c = cfg(&[
        "--cluster-cidr=10.244.0.0/16",
        "--ipvs-scheduler=lc",
        "--ipvs-strict-arp",
        "--ipvs-tcp-timeout=10s",
    ]);
    let ip: IpAddr = "192.0.2.1".parse().unwrap();
    let v = ipvs_v4(&c, ip, Flavor::Legacy, &[]);
    assert_eq!(v.scheduler, "lc");
    assert!(v.strict_arp);
    assert_eq!(v.timeouts.tcp, 10);
    assert_eq!(v.node_ips, vec![ip]);
    assert_eq!(v.cluster_cidr, Some("10.244.0.0/16".parse().unwrap()));
    assert_eq!(v.iptables_restore, "iptables-legacy-restore");
    assert!(v.validate().is_ok());
}

#[test]
fn nftables_configs_follow_the_nftables_section() {
    let c = dual_stack_masquerading(&[]);
    let v = crate::dataplane::nftables::face::configs(&c, &[IpFamily::V4, IpFamily::V6], &[]);
    assert_eq!(v.len(), 2);
    assert_eq!(
        v[1].local_detector,
        LocalDetector::Cidr("fd00:10::/64".parse().unwrap())
    );
    assert!(v.iter().all(|c| c.masquerade_all && c.masquerade_bit == 14));
    let mut c = cfg(&[]);
    c.nftables.masquerade_bit = 9;
    let v = crate::dataplane::nftables::face::configs(&c, &[IpFamily::V4], &[]);
    assert_eq!(
        crate::dataplane::netfilter::node_ports::masquerade_mark(v[0].masquerade_bit),
        "0x200"
    );
    assert!(!v[0].masquerade_all);
}

#[test]
fn ebpf_config_maps_sizes_lb_algorithm_and_xdp() {
    let c = cfg(&["--bpf-map-sizes=services=4096,ct=1024", "--bpffs=/tmp/x"]);
    let e = crate::dataplane::ebpf::face::config(&c, &[IpFamily::V4]);
    assert_eq!(e.ebpf.map_sizes.services, 4096);
    assert_eq!(e.ebpf.map_sizes.ct, 1024);
    assert_eq!(e.ebpf.bpffs, std::path::PathBuf::from("/tmp/x"));
    let c = cfg(&[
        "--bpf-lb-algorithm=maglev",
        "--bpf-lb-maglev-table-size=1021",
        "--bpf-map-sizes=maglev=8",
    ]);
    let e = crate::dataplane::ebpf::face::config(&c, &[IpFamily::V4]);
    assert_eq!(e.ebpf.lb_algorithm, crate::config::LbAlgorithm::Maglev);
    assert_eq!(e.ebpf.maglev_table_size, 1021);
    assert_eq!(e.ebpf.map_sizes.maglev, 8);
    let c = cfg(&["--bpf-xdp=native"]);
    let e = crate::dataplane::ebpf::face::config(&c, &[IpFamily::V4]);
    assert_eq!(e.xdp, crate::config::XdpPolicy::Native);
}

#[test]
fn ebpf_ct_timeouts_follow_upstream_conntrack_and_the_bpf_extension() {
    use std::time::Duration;
    let mut c = cfg(&["--conntrack-tcp-timeout-close-wait=30m"]);
    c.bpf.ct_tcp_time_wait = Duration::from_secs(7);
    c.bpf.ct_tcp_close = Duration::from_secs(3);
    c.bpf.ct_expiry_interval = Duration::from_secs(2);
    let t = crate::dataplane::ebpf::face::config(&c, &[IpFamily::V4]).ct_timeouts;
    // Half-closed: upstream's close-wait flag; fully closed / reset: the extension.
    assert_eq!(t.tcp_closing, Duration::from_secs(1800));
    assert_eq!(t.tcp, Duration::from_secs(86_400));
    assert_eq!(t.tcp_time_wait, Duration::from_secs(7));
    assert_eq!(t.tcp_close, Duration::from_secs(3));
    assert_eq!(t.interval, Duration::from_secs(2));
}
