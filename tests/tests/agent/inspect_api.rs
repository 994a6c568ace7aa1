//! Issue #7: `kproxy inspect` against the API server (the fake one), in a network namespace
//! where the real agent runs iptables mode from the same API server: the services, endpoint
//! states and node-locality come from the API (listed once, the agent's snapshot), the kernel
//! column from what iptables holds.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy_tests::agentns::{NsFakeApi, kproxy_output, nat_rules};
use kproxy_tests::agentproc::{AgentProcess, ScratchDir};
use kproxy_tests::netns::{Netns, require_root};

const NODE: &str = "kpt-node";

fn objects() -> (Node, Vec<Service>, Vec<EndpointSlice>) {
    let node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": NODE},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}
    }))
    .unwrap();
    let web = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"clusterIP": "10.96.0.40", "clusterIPs": ["10.96.0.40"], "ipFamilies": ["IPv4"],
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
    }))
    .unwrap();
    // Not proxied (upstream's label selector): inspect must not show it either.
    let other = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "other", "namespace": "shop",
                     "labels": {"service.kubernetes.io/service-proxy-name": "someone-else"}},
        "spec": {"clusterIP": "10.96.0.41", "clusterIPs": ["10.96.0.41"], "ipFamilies": ["IPv4"],
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80}]}
    }))
    .unwrap();
    let slice = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web-1", "namespace": "shop",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": [
            {"addresses": ["10.244.1.5"], "conditions": {"ready": true}, "nodeName": NODE},
            {"addresses": ["10.244.2.5"], "conditions": {"ready": true}, "nodeName": "node2"},
            {"addresses": ["10.244.2.6"],
             "conditions": {"ready": false, "serving": true, "terminating": true},
             "nodeName": "node2"}
        ]
    }))
    .unwrap();
    (node, vec![web, other], vec![slice])
}

#[test]
fn inspect_reads_services_from_the_api_server_and_the_kernel() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ia-inspect").unwrap();
    let fake = NsFakeApi::start(&ns);
    let scratch = ScratchDir::new("ia-inspect").unwrap();
    let (node, services, slices) = objects();
    fake.api.create(&node).unwrap();
    for s in &services {
        fake.api.create(s).unwrap();
    }
    for s in &slices {
        fake.api.create(s).unwrap();
    }
    let common = vec![
        format!("--kubeconfig={}", fake.kubeconfig(&scratch.0).display()),
        format!("--hostname-override={NODE}"),
    ];
    let mut agent_args = common.clone();
    agent_args.extend([
        "--proxy-mode=iptables".to_string(),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
    ]);
    let mut agent = AgentProcess::start(&ns, &agent_args, scratch.0.join("kproxy.log"));
    agent.wait_for("the service's rules", || {
        nat_rules(&ns).contains("shop/web:http").then_some(())
    });
    fake.api.clear_requests();

    // No --proxy-mode: the mode is found from the kernel (KUBE-SERVICES).
    let mut args = common.clone();
    args.extend(["inspect".to_string(), "--output".into(), "json".into()]);
    let o = kproxy_output(&ns, &args);
    assert!(
        o.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mode"], "iptables", "{v:#}");
    let svcs = v["services"].as_array().unwrap();
    let names: Vec<&str> = svcs.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["shop/web:http"], "{v:#}");
    let web = &svcs[0];
    assert_eq!(
        web["frontends"].as_array().unwrap(),
        &[serde_json::json!("10.96.0.40:80")],
        "{web:#}"
    );
    let states: BTreeMap<&str, (bool, bool, bool, bool)> = web["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["address"].as_str().unwrap(),
                (
                    b["ready"].as_bool().unwrap(),
                    b["serving"].as_bool().unwrap(),
                    b["terminating"].as_bool().unwrap(),
                    b["local"].as_bool().unwrap(),
                ),
            )
        })
        .collect();
    assert_eq!(
        states,
        BTreeMap::from([
            ("10.244.1.5:8080", (true, true, false, true)),
            ("10.244.2.5:8080", (true, true, false, false)),
            ("10.244.2.6:8080", (false, true, true, false)),
        ]),
        "{web:#}"
    );
    // The kernel balances to the ready endpoints (the terminating one is only a fallback).
    let mut kernel: Vec<&str> = web["kernel_backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_str().unwrap())
        .collect();
    kernel.sort();
    assert_eq!(kernel, ["10.244.1.5:8080", "10.244.2.5:8080"], "{web:#}");
    assert!(
        web["kernel"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().contains("KUBE-SVC-")),
        "{web:#}"
    );
    // It listed from the API server (once per kind) and watched nothing.
    let reqs = fake.api.requests();
    let paths: Vec<String> = reqs
        .iter()
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    for want in [
        "GET /api/v1/services",
        "GET /apis/discovery.k8s.io/v1/endpointslices",
        &format!("GET /api/v1/nodes/{NODE}"),
    ] {
        assert_eq!(
            paths.iter().filter(|p| p.as_str() == want).count(),
            1,
            "{want} once: {paths:#?}"
        );
    }
    assert!(
        !reqs.iter().any(|r| r.query.contains("watch=true")),
        "{paths:#?}"
    );

    // The table output names the same service and endpoints.
    let mut args = common;
    args.extend(["inspect".to_string(), "--proxy-mode=iptables".into()]);
    let o = kproxy_output(&ns, &args);
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        table.contains("shop/web:http") && table.contains("10.244.2.6:8080"),
        "{table}"
    );
    assert!(!table.contains("shop/other"), "{table}");
    agent.assert_running();
}
