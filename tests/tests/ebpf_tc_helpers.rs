//! The TC service path with its checksum-state read turned off (`kproxy::dataplane::ebpf::object::
//! use_checksum_helpers_only`): what runs on a kernel without `bpf_cast_to_kern_ctx` or BTF,
//! and for `CHECKSUM_COMPLETE` skbs everywhere — every L4 checksum is updated by the kernel
//! helpers. Its own test binary because the choice is made once per process, before the
//! first load. Same checks as `ebpf_tc::translated_checksums_hold_in_every_skb_state`.

mod ebpf_tc_support;

use std::net::IpAddr;

use ebpf_tc_support::rig::{NODE_PORT, Rig, endpoint, service, snapshot};
use kproxy::model::Protocol;
use kproxy_tests::netns::require_root;
use kproxy_tests::topology::{CLIENT_IP, NODE_IP, NODE_LINK_IP};

#[test]
fn helper_checksums_hold_in_every_skb_state() {
    if !require_root() {
        return;
    }
    assert!(
        kproxy::dataplane::ebpf::object::use_checksum_helpers_only(),
        "nothing in this process loaded the object before"
    );
    assert!(!kproxy::dataplane::ebpf::object::reads_checksum_state());
    let rig = Rig::new("tc-helpers");
    let pods = vec![
        endpoint(std::net::Ipv4Addr::new(10, 244, 1, 2), true),
        endpoint(std::net::Ipv4Addr::new(10, 244, 2, 2), false),
    ];
    rig.sync(&snapshot(
        vec![IpAddr::V4(NODE_IP), IpAddr::V4(NODE_LINK_IP)],
        vec![
            (service("web", Protocol::Tcp), pods.clone()),
            (service("web", Protocol::Udp), pods),
        ],
    ));
    let addr = format!("{NODE_IP}:{NODE_PORT}");
    // Offload on everywhere (the usual test setup), then finished in software.
    rig.assert_both_backends(&addr, NODE_LINK_IP.into(), CLIENT_IP.into());
    rig.assert_checksums_finished_in_software(&addr, NODE_LINK_IP.into(), CLIENT_IP.into());
}
