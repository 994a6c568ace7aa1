//! The deploy manifests as the tests read them: `deploy/kproxy.yaml`, and the kustomize base
//! and overlays rendered by the real `kubectl kustomize` (Debian's kubernetes-client), parsed
//! into JSON documents and k8s-openapi types. Used by the `agent` group's `deploy_manifests`
//! (the manifests themselves) and `deploy_image` (the image run as the DaemonSet describes).

use std::path::PathBuf;
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec};
use serde_json::Value;

use crate::tools::require_tool;

/// The repository's `deploy/` directory.
pub fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Every document of a multi-document YAML text as JSON.
pub fn parse_documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d).unwrap();
            serde_json::to_value(v).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// `kubectl kustomize deploy/<dir>`, or `None` (test skipped) without kubectl; without it
/// under `KPROXY_TESTS_REQUIRE_KERNEL=1` the test fails instead.
pub fn kustomize(dir: &str) -> Option<Vec<Value>> {
    let kubectl = require_tool("kubectl", "kubernetes-client")?;
    let o = Command::new(kubectl)
        .arg("kustomize")
        .arg(deploy_dir().join(dir))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "kubectl kustomize deploy/{dir}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    Some(parse_documents(&String::from_utf8(o.stdout).unwrap()))
}

/// The container's command followed by its args, as the kubelet runs them.
pub fn command_line(c: &Container) -> Vec<String> {
    let mut argv = c.command.clone().unwrap_or_default();
    argv.extend(c.args.clone().unwrap_or_default());
    argv
}

/// The DaemonSet and the ConfigMaps of one rendering.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub daemonset: DaemonSet,
    pub config_maps: Vec<ConfigMap>,
}

impl Rendered {
    /// Picks the (one) DaemonSet and every ConfigMap out of `docs`.
    pub fn from_documents(what: &str, docs: &[Value]) -> Rendered {
        let ds: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "DaemonSet").collect();
        assert_eq!(ds.len(), 1, "{what}: one DaemonSet");
        Rendered {
            daemonset: serde_json::from_value(ds[0].clone()).unwrap(),
            config_maps: docs
                .iter()
                .filter(|d| d["kind"] == "ConfigMap")
                .map(|d| serde_json::from_value(d.clone()).unwrap())
                .collect(),
        }
    }

    /// The pod template's spec.
    pub fn pod(&self) -> &PodSpec {
        self.daemonset
            .spec
            .template
            .spec
            .as_ref()
            .expect("the DaemonSet has a pod spec")
    }

    /// The pod's one container.
    pub fn container(&self) -> &Container {
        let pod = self.pod();
        assert_eq!(pod.containers.len(), 1, "one container");
        &pod.containers[0]
    }

    pub fn config_map(&self, name: &str) -> &ConfigMap {
        self.config_maps
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("no ConfigMap {name} in the rendering"))
    }
}
