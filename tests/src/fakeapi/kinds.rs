//! The kinds the fake serves and the URL paths they live under (pure).

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// A kind served by the fake API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    /// events.k8s.io/v1 Events (what kube-rs' event `Recorder` writes).
    Event,
    /// networking.k8s.io/v1 ServiceCIDRs (cluster-scoped).
    ServiceCidr,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Node,
        Kind::Event,
        Kind::ServiceCidr,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::Event => "Event",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::Event => "events.k8s.io/v1",
            Kind::ServiceCidr => "networking.k8s.io/v1",
        }
    }

    /// Lower-case plural, as in URLs.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::Event => "events",
            Kind::ServiceCidr => "servicecidrs",
        }
    }

    pub fn namespaced(self) -> bool {
        !matches!(self, Kind::Node | Kind::ServiceCidr)
    }

    /// `/api/v1` or `/apis/<group>/<version>`.
    fn prefix(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "/api/v1",
            Kind::EndpointSlice => "/apis/discovery.k8s.io/v1",
            Kind::Event => "/apis/events.k8s.io/v1",
            Kind::ServiceCidr => "/apis/networking.k8s.io/v1",
        }
    }

    /// The API group (`""` for the core group), as RBAC rules name it.
    pub fn group(self) -> &'static str {
        match self.api_version().split_once('/') {
            Some((group, _)) => group,
            None => "",
        }
    }

    /// Collection path, all namespaces (`None`) or one.
    pub fn collection_path(self, namespace: Option<&str>) -> String {
        match namespace.filter(|_| self.namespaced()) {
            Some(ns) => format!("{}/namespaces/{ns}/{}", self.prefix(), self.plural()),
            None => format!("{}/{}", self.prefix(), self.plural()),
        }
    }
}

/// What a request path addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub kind: Kind,
    /// Namespace from the path (namespaced kinds only).
    pub namespace: Option<String>,
    /// Object name (item paths).
    pub name: Option<String>,
}

/// Parses a request path; `None` for paths the fake does not serve.
pub fn route(path: &str) -> Option<Target> {
    let path = path.trim_end_matches('/');
    for kind in Kind::ALL {
        let Some(rest) = path.strip_prefix(kind.prefix()) else {
            continue;
        };
        let parts: Vec<&str> = rest.split('/').skip(1).collect();
        if parts.iter().any(|p| p.is_empty()) {
            return None;
        }
        let target = |namespace: Option<&str>, name: Option<&str>| Target {
            kind,
            namespace: namespace.map(str::to_owned),
            name: name.map(str::to_owned),
        };
        match parts.as_slice() {
            [p] if *p == kind.plural() => return Some(target(None, None)),
            [p, name] if *p == kind.plural() => return Some(target(None, Some(name))),
            ["namespaces", ns, p] if *p == kind.plural() && kind.namespaced() => {
                return Some(target(Some(ns), None));
            }
            ["namespaces", ns, p, name] if *p == kind.plural() && kind.namespaced() => {
                return Some(target(Some(ns), Some(name)));
            }
            _ => {}
        }
    }
    None
}

/// A k8s-openapi type the fake stores (for the typed control API).
pub trait FakeResource: Serialize + DeserializeOwned + Clone {
    const KIND: Kind;
}

impl FakeResource for Service {
    const KIND: Kind = Kind::Service;
}

impl FakeResource for EndpointSlice {
    const KIND: Kind = Kind::EndpointSlice;
}

impl FakeResource for Node {
    const KIND: Kind = Kind::Node;
}

impl FakeResource for Event {
    const KIND: Kind = Kind::Event;
}

impl FakeResource for ServiceCIDR {
    const KIND: Kind = Kind::ServiceCidr;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_collections_and_items() {
        let t = route("/api/v1/services").unwrap();
        assert_eq!((t.kind, t.namespace, t.name), (Kind::Service, None, None));
        let t = route("/api/v1/namespaces/ns1/services/web").unwrap();
        assert_eq!(
            (t.kind, t.namespace.as_deref(), t.name.as_deref()),
            (Kind::Service, Some("ns1"), Some("web"))
        );
        let t = route("/apis/discovery.k8s.io/v1/namespaces/ns1/endpointslices").unwrap();
        assert_eq!(
            (t.kind, t.namespace.as_deref()),
            (Kind::EndpointSlice, Some("ns1"))
        );
        let t = route("/api/v1/nodes/n1").unwrap();
        assert_eq!((t.kind, t.name.as_deref()), (Kind::Node, Some("n1")));
    }

    #[test]
    fn unknown_paths_are_not_routed() {
        for p in [
            "/api/v1/pods",
            "/api/v1/namespaces/x/nodes",
            "/api/v1//services",
            "/apis/foo/v1/services",
            "/",
        ] {
            assert!(route(p).is_none(), "{p}");
        }
    }

    #[test]
    fn collection_paths_round_trip() {
        for kind in Kind::ALL {
            let p = kind.collection_path(Some("ns"));
            let t = route(&p).unwrap();
            assert_eq!(t.kind, kind);
            assert_eq!(t.namespace.is_some(), kind.namespaced(), "{p}");
        }
    }
}
