//! Label and field selectors as the API server parses them (pure).
//!
//! Label selector terms, comma-separated (AND): `k`, `!k`, `k=v`, `k==v`, `k!=v`,
//! `k in (a,b)`, `k notin (a,b)`. As upstream, `k!=v` and `k notin (…)` also match objects
//! without label `k`. Field selectors support `metadata.name` and `metadata.namespace` with
//! `=`, `==`, `!=`; any other field is rejected like the real server does.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// A selector that could not be parsed; the message names the offending term.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SelectorError(pub String);

/// One label requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, BTreeSet<String>),
    NotIn(String, BTreeSet<String>),
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::NotExists(k) => !labels.contains_key(k),
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::NotEquals(k, v) => labels.get(k) != Some(v),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
        }
    }
}

/// A parsed label selector (all requirements must hold; empty matches everything).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<Requirement>);

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        let mut reqs = vec![];
        for term in split_top_level(s) {
            let term = term.trim();
            if term.is_empty() {
                if s.trim().is_empty() {
                    continue;
                }
                return Err(SelectorError(format!(
                    "unable to parse requirement: empty term in label selector {s:?}"
                )));
            }
            reqs.push(parse_requirement(term)?);
        }
        Ok(LabelSelector(reqs))
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| r.matches(labels))
    }

    /// Matches the labels of a JSON object (`metadata.labels`).
    pub fn matches_object(&self, obj: &Value) -> bool {
        self.matches(&labels_of(obj))
    }
}

/// Splits on commas outside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = vec![];
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_requirement(term: &str) -> Result<Requirement, SelectorError> {
    if let Some(key) = term.strip_prefix('!') {
        return Ok(Requirement::NotExists(key_of(key.trim(), term)?));
    }
    if let Some(open) = term.find('(') {
        let close = term
            .rfind(')')
            .filter(|&c| c > open && term[c + 1..].trim().is_empty())
            .ok_or_else(|| {
                SelectorError(format!("unable to parse requirement {term:?}: missing ')'"))
            })?;
        let mut head = term[..open].split_whitespace();
        let (key, op) = match (head.next(), head.next(), head.next()) {
            (Some(k), Some(op), None) => (key_of(k, term)?, op),
            _ => {
                return Err(SelectorError(format!(
                    "unable to parse requirement {term:?}: expected 'key in (…)'"
                )));
            }
        };
        let values = term[open + 1..close]
            .split(',')
            .map(|v| value_of(v.trim(), term))
            .collect::<Result<BTreeSet<_>, _>>()?;
        return match op {
            "in" => Ok(Requirement::In(key, values)),
            "notin" => Ok(Requirement::NotIn(key, values)),
            _ => Err(SelectorError(format!(
                "unable to parse requirement {term:?}: unknown operator {op:?}"
            ))),
        };
    }
    for (op, neg) in [("!=", true), ("==", false), ("=", false)] {
        if let Some((k, v)) = term.split_once(op) {
            let (k, v) = (key_of(k.trim(), term)?, value_of(v.trim(), term)?);
            return Ok(if neg {
                Requirement::NotEquals(k, v)
            } else {
                Requirement::Equals(k, v)
            });
        }
    }
    Ok(Requirement::Exists(key_of(term, term)?))
}

fn key_of(key: &str, term: &str) -> Result<String, SelectorError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/');
    if key.is_empty() || !key.chars().all(ok_char) {
        return Err(SelectorError(format!(
            "unable to parse requirement {term:?}: invalid label key {key:?}"
        )));
    }
    Ok(key.to_owned())
}

fn value_of(v: &str, term: &str) -> Result<String, SelectorError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if !v.chars().all(ok_char) {
        return Err(SelectorError(format!(
            "unable to parse requirement {term:?}: invalid label value {v:?}"
        )));
    }
    Ok(v.to_owned())
}

/// `metadata.labels` of a JSON object.
pub fn labels_of(obj: &Value) -> BTreeMap<String, String> {
    obj.pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// A field the fake can select on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Name,
    Namespace,
}

/// A parsed field selector.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(pub Vec<(Field, bool, String)>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        let mut terms = vec![];
        for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (field, negated, value) = if let Some((f, v)) = term.split_once("!=") {
                (f, true, v)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, false, v)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, false, v)
            } else {
                return Err(SelectorError(format!(
                    "invalid selector: {term:?}; can't understand it"
                )));
            };
            let field = match field.trim() {
                "metadata.name" => Field::Name,
                "metadata.namespace" => Field::Namespace,
                other => return Err(SelectorError(format!("field label not supported: {other}"))),
            };
            terms.push((field, negated, value.trim().to_owned()));
        }
        Ok(FieldSelector(terms))
    }

    pub fn matches_object(&self, obj: &Value) -> bool {
        self.0.iter().all(|(field, negated, want)| {
            let ptr = match field {
                Field::Name => "/metadata/name",
                Field::Namespace => "/metadata/namespace",
            };
            let have = obj.pointer(ptr).and_then(Value::as_str).unwrap_or("");
            (have == want) != *negated
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn proxyable_selector_excludes_labelled_objects() {
        let s = LabelSelector::parse(
            "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless",
        )
        .unwrap();
        assert!(s.matches(&labels(&[("app", "x")])));
        assert!(!s.matches(&labels(&[(
            "service.kubernetes.io/service-proxy-name",
            "other"
        )])));
        assert!(!s.matches(&labels(&[("service.kubernetes.io/headless", "")])));
    }

    #[test]
    fn equality_and_set_operators() {
        let l = labels(&[("env", "prod"), ("tier", "web")]);
        for (sel, want) in [
            ("env=prod", true),
            ("env==prod", true),
            ("env!=prod", false),
            ("missing!=x", true),
            ("env", true),
            ("missing", false),
            ("env in (dev, prod)", true),
            ("env notin (dev,prod)", false),
            ("missing notin (a)", true),
            ("missing in (a)", false),
            ("env=prod,tier=db", false),
            ("env in (prod),tier", true),
            ("", true),
        ] {
            assert_eq!(
                LabelSelector::parse(sel).unwrap().matches(&l),
                want,
                "{sel}"
            );
        }
    }

    #[test]
    fn bad_label_selectors_name_the_term() {
        for bad in ["env in (a", "a b c", "k=v v", "env,,tier", "k op (a)"] {
            let e = LabelSelector::parse(bad).unwrap_err();
            assert!(
                e.0.contains("requirement") || e.0.contains("term"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn field_selector_on_name_and_namespace() {
        let obj = serde_json::json!({"metadata": {"name": "n1", "namespace": "ns"}});
        assert!(
            FieldSelector::parse("metadata.name=n1")
                .unwrap()
                .matches_object(&obj)
        );
        assert!(
            FieldSelector::parse("metadata.name==n1,metadata.namespace=ns")
                .unwrap()
                .matches_object(&obj)
        );
        assert!(
            !FieldSelector::parse("metadata.name!=n1")
                .unwrap()
                .matches_object(&obj)
        );
        assert!(
            !FieldSelector::parse("metadata.namespace=other")
                .unwrap()
                .matches_object(&obj)
        );
        let e = FieldSelector::parse("spec.nodeName=x").unwrap_err();
        assert_eq!(e.0, "field label not supported: spec.nodeName");
    }
}
