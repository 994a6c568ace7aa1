//! Issue #7: `--detect-local-mode NodeCIDR` with the real agent against the fake API server,
//! in iptables mode inside a network namespace:
//!
//! - while the Node has no `spec.podCIDRs` the agent waits (logs that it awaits the podCIDR
//!   allocation, programs nothing, serves no metrics yet);
//! - once the Node gets `podCIDRs`, the rules use the pod CIDR as upstream's local-traffic
//!   detector: `! -s <podCIDR>` on the ClusterIP masquerade rule and `-s <podCIDR>` on the
//!   "pod traffic for … external destinations" rule of an eTP=Local service — never the
//!   `--cluster-cidr` given as well;
//! - when the podCIDRs change afterwards, the agent exits 1 (to restart with the new ones),
//!   as upstream's NodePodCIDRHandler does.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy_tests::agentns::{NsFakeApi, nat_rules};
use kproxy_tests::agentproc::{AgentProcess, LIVENESS, ScratchDir, http_get};
use kproxy_tests::netns::{Netns, require_root};

const NODE: &str = "kpt-node";
const POD_CIDR: &str = "10.244.1.0/24";

fn node(pod_cidrs: &[&str]) -> Node {
    let mut spec = serde_json::json!({});
    if !pod_cidrs.is_empty() {
        spec = serde_json::json!({"podCIDR": pod_cidrs[0], "podCIDRs": pod_cidrs});
    }
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": NODE},
        "spec": spec,
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}
    }))
    .unwrap()
}

fn service() -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"type": "NodePort", "clusterIP": "10.96.0.30", "clusterIPs": ["10.96.0.30"],
                 "ipFamilies": ["IPv4"], "externalTrafficPolicy": "Local",
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080,
                            "nodePort": 30090}]}
    }))
    .unwrap()
}

fn slice() -> EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web-1", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "web"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": true},
                       "nodeName": NODE}]
    }))
    .unwrap()
}

/// The `-A` line of `rules` whose comment is `comment` and that jumps to a chain starting
/// with `target`.
fn rule<'a>(rules: &'a str, comment: &str, target: &str) -> Option<&'a str> {
    rules.lines().find(|l| {
        l.starts_with("-A ")
            && l.contains(&format!("--comment \"{comment}\""))
            && l.contains(&format!("-j {target}"))
    })
}

#[test]
fn node_cidr_waits_for_the_pod_cidr_and_uses_it_as_the_local_detector() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("nc-agent").unwrap();
    let fake = NsFakeApi::start(&ns);
    let scratch = ScratchDir::new("nc-agent").unwrap();
    fake.api.create(&node(&[])).unwrap();
    fake.api.create(&service()).unwrap();
    fake.api.create(&slice()).unwrap();
    let args = vec![
        format!("--kubeconfig={}", fake.kubeconfig(&scratch.0).display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=iptables".into(),
        "--detect-local-mode=NodeCIDR".into(),
        // Present but not what NodeCIDR uses.
        "--cluster-cidr=10.0.0.0/8".into(),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--healthz-bind-address=127.0.0.1:10256".into(),
    ];
    let mut agent = AgentProcess::start(&ns, &args, scratch.0.join("kproxy.log"));

    // Waiting: it says so and programs nothing (a few of its 1 s polls pass).
    agent.wait_for("the podCIDR wait", || {
        agent_log_contains(&scratch, "awaiting podCIDR allocation")
    });
    std::thread::sleep(Duration::from_secs(3));
    agent.assert_running();
    assert!(
        !nat_rules(&ns).contains("KUBE-SERVICES"),
        "rules programmed before the podCIDR is known:\n{}",
        nat_rules(&ns)
    );
    assert_eq!(http_get(&ns, 10249, "/proxyMode"), None);

    fake.api.update(&node(&[POD_CIDR])).unwrap();
    let rules = agent.wait_for("the service's rules", || {
        let r = nat_rules(&ns);
        r.contains("pod traffic for default/web:http external destinations")
            .then_some(r)
    });
    let masq = rule(&rules, "default/web:http cluster IP", "KUBE-MARK-MASQ")
        .unwrap_or_else(|| panic!("no cluster IP masquerade rule:\n{rules}"));
    assert!(
        masq.contains(&format!("! -s {POD_CIDR}")) && masq.contains("-d 10.96.0.30/32"),
        "{masq}"
    );
    let pod_traffic = rule(
        &rules,
        "pod traffic for default/web:http external destinations",
        "KUBE-SVC-",
    )
    .unwrap_or_else(|| panic!("no pod-traffic rule:\n{rules}"));
    assert!(
        pod_traffic.contains(&format!(" -s {POD_CIDR}")) && !pod_traffic.contains("! -s"),
        "{pod_traffic}"
    );
    assert!(
        !rules.contains("10.0.0.0/8"),
        "the cluster CIDR is not the detector in NodeCIDR mode:\n{rules}"
    );
    assert_eq!(
        http_get(&ns, 10249, "/proxyMode").map(|(_, b)| b.trim().to_string()),
        Some("iptables".into())
    );

    // The podCIDR changes: the agent exits 1 to restart with the new one.
    fake.api.update(&node(&["10.244.9.0/24"])).unwrap();
    let deadline = Instant::now() + LIVENESS;
    let status = loop {
        if let Some(st) = agent.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "still running after the podCIDR changed:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status.code(), Some(1), "{}", agent.log());
    assert!(agent.log().contains("podCIDRs changed"), "{}", agent.log());
}

fn agent_log_contains(scratch: &ScratchDir, what: &str) -> Option<()> {
    let log = std::fs::read_to_string(scratch.0.join("kproxy.log")).unwrap_or_default();
    log.contains(what).then_some(())
}

/// `kproxy render --proxy-mode iptables --detect-local-mode NodeCIDR` renders the Node's pod
/// CIDR into the rules in upstream's exact form (as in upstream's iptables expectations:
/// `… --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ`).
#[test]
fn render_uses_the_manifest_nodes_pod_cidr_in_upstreams_form() {
    let scratch = ScratchDir::new("nc-render").unwrap();
    let path = scratch.0.join("cluster.yaml");
    let docs: Vec<String> = [
        serde_json::to_value(node(&[POD_CIDR])).unwrap(),
        serde_json::to_value(service()).unwrap(),
        serde_json::to_value(slice()).unwrap(),
    ]
    .into_iter()
    .zip(["v1/Node", "v1/Service", "discovery.k8s.io/v1/EndpointSlice"])
    .map(|(mut v, kind)| {
        let (api, kind) = kind.rsplit_once('/').unwrap();
        v["apiVersion"] = api.into();
        v["kind"] = kind.into();
        serde_yaml::to_string(&v).unwrap()
    })
    .collect();
    std::fs::write(&path, docs.join("---\n")).unwrap();
    let o = std::process::Command::new(kproxy_tests::topology::kproxy_bin().unwrap())
        .args([
            "render",
            "--proxy-mode=iptables",
            "--detect-local-mode=NodeCIDR",
            "--cluster-cidr=10.0.0.0/8",
            &format!("--manifests={}", path.display()),
            &format!("--hostname-override={NODE}"),
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let masq = rule(&out, "default/web:http cluster IP", "KUBE-MARK-MASQ")
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        masq.ends_with(&format!(
            "-m tcp -p tcp -d 10.96.0.30 --dport 80 ! -s {POD_CIDR} -j KUBE-MARK-MASQ"
        )),
        "{masq}"
    );
    let pod = rule(
        &out,
        "pod traffic for default/web:http external destinations",
        "KUBE-SVC-",
    )
    .unwrap_or_else(|| panic!("{out}"));
    assert!(
        pod.contains(&format!(
            "external destinations\" -s {POD_CIDR} -j KUBE-SVC-"
        )),
        "{pod}"
    );
    assert!(!out.contains("10.0.0.0/8"), "{out}");
}
