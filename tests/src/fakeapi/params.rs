//! List/watch query parameters (pure): parsing and the object filter they describe.

use std::time::Duration;

use serde_json::Value;

use super::selector::{FieldSelector, LabelSelector};
use super::status::ApiError;

/// The query parameters of a list or watch request.
#[derive(Debug, Clone, Default)]
pub struct Params {
    pub label_selector: LabelSelector,
    pub field_selector: FieldSelector,
    /// `limit` (0 or absent = everything).
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
    pub resource_version: Option<String>,
    pub resource_version_match: Option<String>,
    pub watch: bool,
    pub allow_watch_bookmarks: bool,
    pub timeout: Option<Duration>,
    pub send_initial_events: bool,
}

impl Params {
    /// Parses decoded `(name, value)` pairs; unknown parameters are ignored (as the real server
    /// does), malformed values are a 400 naming the parameter.
    pub fn parse(pairs: &[(String, String)]) -> Result<Params, ApiError> {
        let mut p = Params::default();
        for (k, v) in pairs {
            match k.as_str() {
                "labelSelector" => {
                    p.label_selector =
                        LabelSelector::parse(v).map_err(|e| ApiError::bad_request(e.0))?;
                }
                "fieldSelector" => {
                    p.field_selector =
                        FieldSelector::parse(v).map_err(|e| ApiError::bad_request(e.0))?;
                }
                "limit" => p.limit = Some(number(k, v)?).filter(|&n| n > 0).map(|n| n as usize),
                "continue" => p.continue_token = Some(v.clone()).filter(|s| !s.is_empty()),
                "resourceVersion" => p.resource_version = Some(v.clone()),
                "resourceVersionMatch" => {
                    p.resource_version_match = Some(v.clone()).filter(|s| !s.is_empty())
                }
                "watch" => p.watch = boolean(k, v)?,
                "allowWatchBookmarks" => p.allow_watch_bookmarks = boolean(k, v)?,
                "sendInitialEvents" => p.send_initial_events = boolean(k, v)?,
                "timeoutSeconds" => p.timeout = Some(Duration::from_secs(number(k, v)?)),
                _ => {}
            }
        }
        Ok(p)
    }

    /// The filter for objects in `namespace` (from the path) matching the selectors.
    pub fn filter(&self, namespace: Option<&str>) -> Filter {
        Filter {
            namespace: namespace.map(str::to_owned),
            labels: self.label_selector.clone(),
            fields: self.field_selector.clone(),
        }
    }
}

fn boolean(name: &str, v: &str) -> Result<bool, ApiError> {
    match v {
        "true" | "1" => Ok(true),
        "false" | "0" | "" => Ok(false),
        _ => Err(ApiError::bad_request(format!(
            "invalid value for {name}: {v:?} is not a boolean"
        ))),
    }
}

fn number(name: &str, v: &str) -> Result<u64, ApiError> {
    v.parse().map_err(|_| {
        ApiError::bad_request(format!(
            "invalid value for {name}: {v:?} is not a non-negative integer"
        ))
    })
}

/// Which objects a request sees: namespace from the path plus label and field selectors.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    /// Whether a label or field selector narrows the list (the namespace aside).
    pub fn has_selectors(&self) -> bool {
        !self.labels.0.is_empty() || !self.fields.0.is_empty()
    }

    pub fn matches(&self, obj: &Value) -> bool {
        let ns_ok = self.namespace.as_deref().is_none_or(|ns| {
            obj.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns)
        });
        ns_ok && self.labels.matches_object(obj) && self.fields.matches_object(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_kube_rs_watch_parameters() {
        let p = Params::parse(&pairs(&[
            ("watch", "true"),
            ("timeoutSeconds", "290"),
            ("allowWatchBookmarks", "true"),
            ("labelSelector", "!a,!b"),
            ("resourceVersion", "12"),
        ]))
        .unwrap();
        assert!(p.watch && p.allow_watch_bookmarks);
        assert_eq!(p.timeout, Some(Duration::from_secs(290)));
        assert_eq!(p.resource_version.as_deref(), Some("12"));
        assert_eq!(p.label_selector.0.len(), 2);
    }

    #[test]
    fn bad_values_name_the_parameter() {
        let e = Params::parse(&pairs(&[("limit", "ten")])).unwrap_err();
        assert_eq!(e.code, 400);
        assert!(e.message.contains("limit"), "{e}");
        let e = Params::parse(&pairs(&[("watch", "maybe")])).unwrap_err();
        assert!(e.message.contains("watch"), "{e}");
        let e = Params::parse(&pairs(&[("fieldSelector", "spec.x=1")])).unwrap_err();
        assert!(e.message.contains("spec.x"), "{e}");
    }

    #[test]
    fn filter_applies_namespace_and_selectors() {
        let obj = serde_json::json!({"metadata": {"name": "a", "namespace": "ns1", "labels": {"x": "1"}}});
        let p = Params::parse(&pairs(&[("labelSelector", "x=1")])).unwrap();
        assert!(p.filter(Some("ns1")).matches(&obj));
        assert!(p.filter(None).matches(&obj));
        assert!(!p.filter(Some("ns2")).matches(&obj));
        let p = Params::parse(&pairs(&[("labelSelector", "x=2")])).unwrap();
        assert!(!p.filter(None).matches(&obj));
    }
}
