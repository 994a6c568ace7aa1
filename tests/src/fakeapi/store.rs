//! The fake's object store (pure): objects as JSON, one global resourceVersion counter (like
//! etcd's revision), and the change history that watches and consistent paged lists read.
//!
//! History covers `(oldest_rv, rv]`: a watch or snapshot from a version older than
//! `oldest_rv` is answered with 410 Expired. [`Store::compact`] drops the history.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::{Value, json};

use super::kinds::Kind;
use super::params::{Filter, Params};
use super::status::ApiError;

/// Identity of a stored object: kind, namespace (`""` for cluster-scoped kinds), name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
}

/// One write.
#[derive(Debug, Clone)]
struct Change {
    rv: u64,
    key: Key,
    /// The object before the write (`None`: created).
    old: Option<Value>,
    /// The object after the write (`None`: deleted).
    new: Option<Value>,
    /// The object a watch reports: `new`, or for a delete the last state with the deletion's
    /// resourceVersion.
    reported: Value,
}

/// A watch event: type, the object, and the resourceVersion it happened at.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchEvent {
    pub rv: u64,
    pub kind: &'static str,
    pub object: Value,
}

impl WatchEvent {
    /// One line of a watch stream (without the newline).
    pub fn to_json(&self) -> Value {
        json!({"type": self.kind, "object": self.object})
    }
}

/// One page of a list.
#[derive(Debug, Clone, PartialEq)]
pub struct ListPage {
    pub items: Vec<Value>,
    /// The version the list is consistent at.
    pub resource_version: u64,
    pub continue_token: Option<String>,
    pub remaining: Option<u64>,
}

impl ListPage {
    /// The `<Kind>List` object.
    pub fn to_json(&self, kind: Kind) -> Value {
        let mut metadata = json!({"resourceVersion": self.resource_version.to_string()});
        if let Some(c) = &self.continue_token {
            metadata["continue"] = json!(c);
        }
        if let Some(n) = self.remaining {
            metadata["remainingItemCount"] = json!(n);
        }
        json!({
            "kind": format!("{}List", kind.name()),
            "apiVersion": kind.api_version(),
            "metadata": metadata,
            "items": self.items,
        })
    }
}

/// Objects, their history and the resourceVersion counter.
#[derive(Debug, Clone)]
pub struct Store {
    rv: u64,
    oldest_rv: u64,
    objects: BTreeMap<Key, Value>,
    history: Vec<Change>,
    uids: u64,
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

impl Store {
    pub fn new() -> Store {
        Store {
            rv: 1,
            oldest_rv: 1,
            objects: BTreeMap::new(),
            history: vec![],
            uids: 0,
        }
    }

    /// The latest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// The oldest resourceVersion a watch may start from.
    pub fn oldest_resource_version(&self) -> u64 {
        self.oldest_rv
    }

    /// Forgets the history: watches and snapshots from any version before now get 410.
    pub fn compact(&mut self) {
        self.history.clear();
        self.oldest_rv = self.rv;
    }

    pub fn get(&self, kind: Kind, namespace: Option<&str>, name: &str) -> Option<&Value> {
        self.objects.get(&key(kind, namespace, name))
    }

    /// Every object of `kind` matching `filter`, in key order.
    pub fn matching(&self, kind: Kind, filter: &Filter) -> Vec<Value> {
        self.of_kind(kind)
            .filter(|o| filter.matches(o))
            .cloned()
            .collect()
    }

    fn of_kind(&self, kind: Kind) -> impl Iterator<Item = &Value> {
        self.objects
            .iter()
            .filter(move |(k, _)| k.kind == kind)
            .map(|(_, v)| v)
    }

    /// Creates `obj`; `path_namespace` is the namespace of the request path, if any.
    /// Assigns resourceVersion, uid and creationTimestamp.
    pub fn create(
        &mut self,
        kind: Kind,
        mut obj: Value,
        path_namespace: Option<&str>,
    ) -> Result<Value, ApiError> {
        let k = normalize(kind, &mut obj, path_namespace)?;
        if self.objects.contains_key(&k) {
            return Err(ApiError::new(
                409,
                format!("{} {:?} already exists", kind.plural(), k.name),
            ));
        }
        self.uids += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", self.uids);
        let now = serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now()))
            .expect("time serializes");
        obj["metadata"]["uid"] = json!(uid);
        obj["metadata"]["creationTimestamp"] = now;
        Ok(self.write(k, None, Some(obj)))
    }

    /// Replaces an existing object. With `check_version`, a non-empty `metadata.resourceVersion`
    /// must be the current one (409 Conflict otherwise), as for a PUT. An update that changes
    /// nothing keeps the object's resourceVersion, as the real server does.
    pub fn update(
        &mut self,
        kind: Kind,
        mut obj: Value,
        path_namespace: Option<&str>,
        check_version: bool,
    ) -> Result<Value, ApiError> {
        let k = normalize(kind, &mut obj, path_namespace)?;
        let Some(old) = self.objects.get(&k).cloned() else {
            return Err(ApiError::not_found(kind.plural(), &k.name));
        };
        let given_rv = obj
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        if check_version
            && !given_rv.is_empty()
            && Some(given_rv)
                != old
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
        {
            return Err(ApiError::new(
                409,
                format!(
                    "Operation cannot be fulfilled on {} {:?}: the object has been modified; please apply your changes to the latest version and try again",
                    kind.plural(),
                    k.name
                ),
            ));
        }
        for field in ["uid", "creationTimestamp", "resourceVersion"] {
            match old["metadata"].get(field) {
                Some(v) => obj["metadata"][field] = v.clone(),
                None => {
                    obj["metadata"]
                        .as_object_mut()
                        .expect("normalized")
                        .remove(field);
                }
            }
        }
        if obj == old {
            return Ok(old);
        }
        Ok(self.write(k, Some(old), Some(obj)))
    }

    /// Deletes an object; returns its last state (with the deletion's resourceVersion).
    pub fn delete(
        &mut self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<Value, ApiError> {
        let k = key(kind, namespace, name);
        let Some(old) = self.objects.get(&k).cloned() else {
            return Err(ApiError::not_found(kind.plural(), name));
        };
        Ok(self.write(k, Some(old), None))
    }

    /// Records one write at the next resourceVersion; returns the reported object.
    fn write(&mut self, k: Key, old: Option<Value>, new: Option<Value>) -> Value {
        self.rv += 1;
        let rv = json!(self.rv.to_string());
        let new = new.map(|mut o| {
            o["metadata"]["resourceVersion"] = rv.clone();
            o
        });
        let reported = match &new {
            Some(o) => o.clone(),
            None => {
                let mut o = old.clone().expect("a delete has an old object");
                o["metadata"]["resourceVersion"] = rv;
                o
            }
        };
        match &new {
            Some(o) => self.objects.insert(k.clone(), o.clone()),
            None => self.objects.remove(&k),
        };
        self.history.push(Change {
            rv: self.rv,
            key: k,
            old,
            new,
            reported: reported.clone(),
        });
        reported
    }

    /// The objects of `kind` as they were at `rv` (needs history back to `rv`).
    fn state_at(&self, kind: Kind, rv: u64) -> Result<BTreeMap<Key, Value>, ApiError> {
        if rv < self.oldest_rv {
            return Err(too_old(rv, self.oldest_rv));
        }
        let mut state: BTreeMap<Key, Value> = self
            .objects
            .iter()
            .filter(|(k, _)| k.kind == kind)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for c in self
            .history
            .iter()
            .rev()
            .take_while(|c| c.rv > rv)
            .filter(|c| c.key.kind == kind)
        {
            match &c.old {
                Some(o) => state.insert(c.key.clone(), o.clone()),
                None => state.remove(&c.key),
            };
        }
        Ok(state)
    }

    /// One page of a list of `kind` in `namespace` (from the path), per `params`: the current
    /// state, or with `resourceVersionMatch=Exact` / a continue token the state at that version.
    pub fn list(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        params: &Params,
    ) -> Result<ListPage, ApiError> {
        let filter = params.filter(namespace);
        let (at, after) = match &params.continue_token {
            Some(token) => {
                let (at, after) = parse_continue(token)?;
                if at < self.oldest_rv {
                    return Err(ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    ));
                }
                (at, Some(after))
            }
            None => (self.list_version(params)?, None),
        };
        let state = self.state_at(kind, at)?;
        let mut matching = state
            .into_iter()
            .filter(|(k, _)| {
                after
                    .as_ref()
                    .is_none_or(|(ns, name)| (&k.namespace, &k.name) > (ns, name))
            })
            .filter(|(_, v)| filter.matches(v));
        let mut items = vec![];
        let mut last = None;
        for (k, v) in matching.by_ref() {
            if params.limit.is_some_and(|l| items.len() >= l) {
                // One more exists: count the rest for remainingItemCount.
                let remaining = 1 + matching.count() as u64;
                let (ns, name): (String, String) = last.expect("limit > 0");
                return Ok(ListPage {
                    items,
                    resource_version: at,
                    continue_token: Some(format!("{at}/{ns}/{name}")),
                    remaining: Some(remaining),
                });
            }
            last = Some((k.namespace.clone(), k.name.clone()));
            items.push(v);
        }
        Ok(ListPage {
            items,
            resource_version: at,
            continue_token: None,
            remaining: None,
        })
    }

    /// The version a list without continue token reads at.
    fn list_version(&self, params: &Params) -> Result<u64, ApiError> {
        let rv = match params.resource_version.as_deref() {
            None | Some("") | Some("0") => return Ok(self.rv),
            Some(s) => parse_rv(s)?,
        };
        if rv > self.rv {
            return Err(ApiError::new(
                504,
                format!("Too large resource version: {rv}, current: {}", self.rv),
            ));
        }
        match params.resource_version_match.as_deref() {
            Some("Exact") => Ok(rv),
            None | Some("NotOlderThan") => Ok(self.rv),
            Some(other) => Err(ApiError::bad_request(format!(
                "invalid value for resourceVersionMatch: {other:?}"
            ))),
        }
    }

    /// Watch events for `kind` matching `filter` after version `after`, and the version the
    /// watch has now seen everything up to. An object that starts matching is ADDED, one that
    /// stops matching is DELETED (like the real server's filtered watches).
    pub fn events_since(
        &self,
        kind: Kind,
        after: u64,
        filter: &Filter,
    ) -> Result<(Vec<WatchEvent>, u64), ApiError> {
        if after < self.oldest_rv {
            return Err(too_old(after, self.oldest_rv));
        }
        let start = self.history.partition_point(|c| c.rv <= after);
        let events = self.history[start..]
            .iter()
            .filter(|c| c.key.kind == kind)
            .filter_map(|c| {
                let was = c.old.as_ref().is_some_and(|o| filter.matches(o));
                let is = c.new.as_ref().is_some_and(|o| filter.matches(o));
                let kind = match (was, is) {
                    (false, true) => "ADDED",
                    (true, true) => "MODIFIED",
                    (true, false) => "DELETED",
                    (false, false) => return None,
                };
                Some(WatchEvent {
                    rv: c.rv,
                    kind,
                    object: c.reported.clone(),
                })
            })
            .collect();
        Ok((events, self.rv.max(after)))
    }
}

fn too_old(rv: u64, oldest: u64) -> ApiError {
    ApiError::expired(format!("too old resource version: {rv} ({oldest})"))
}

pub fn parse_rv(s: &str) -> Result<u64, ApiError> {
    s.parse()
        .map_err(|_| ApiError::bad_request(format!("invalid resource version: {s:?}")))
}

fn parse_continue(token: &str) -> Result<(u64, (String, String)), ApiError> {
    let bad = || ApiError::bad_request(format!("continue key is not valid: {token:?}"));
    let mut parts = token.splitn(3, '/');
    let (Some(rv), Some(ns), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad());
    };
    Ok((
        rv.parse().map_err(|_| bad())?,
        (ns.to_owned(), name.to_owned()),
    ))
}

fn key(kind: Kind, namespace: Option<&str>, name: &str) -> Key {
    let namespace = if kind.namespaced() {
        namespace.unwrap_or("default")
    } else {
        ""
    };
    Key {
        kind,
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    }
}

/// Checks the object's shape, fills in kind/apiVersion and namespace; returns its key.
fn normalize(kind: Kind, obj: &mut Value, path_namespace: Option<&str>) -> Result<Key, ApiError> {
    let invalid = |msg: &str| ApiError::new(422, format!("{} is invalid: {msg}", kind.name()));
    if !obj.is_object() {
        return Err(ApiError::bad_request(format!(
            "{} must be a JSON object",
            kind.name()
        )));
    }
    if let Some(k) = obj
        .get("kind")
        .and_then(Value::as_str)
        .filter(|k| *k != kind.name())
    {
        return Err(ApiError::bad_request(format!(
            "kind {k:?} sent to the {} endpoint",
            kind.plural()
        )));
    }
    obj["kind"] = json!(kind.name());
    obj["apiVersion"] = json!(kind.api_version());
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    let name = obj["metadata"]
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned();
    if name.is_empty() || name.contains('/') {
        return Err(invalid(
            "metadata.name: Required value: a name without '/' is required",
        ));
    }
    let meta = obj["metadata"].as_object_mut().expect("checked above");
    if kind.namespaced() {
        let given = meta
            .get("namespace")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
        let ns = match (given, path_namespace) {
            (Some(g), Some(p)) if g != p => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            (Some(g), _) => g,
            (None, p) => p.unwrap_or("default").to_owned(),
        };
        meta.insert("namespace".into(), json!(ns));
        Ok(key(kind, Some(&ns), &name))
    } else {
        meta.remove("namespace");
        Ok(key(kind, None, &name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(ns: &str, name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "namespace": ns, "labels": labels}, "spec": {"clusterIP": "10.0.0.1"}})
    }

    fn names(items: &[Value]) -> Vec<String> {
        items
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap().to_owned())
            .collect()
    }

    fn params(pairs: &[(&str, &str)]) -> Params {
        Params::parse(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<Vec<_>>(),
        )
        .unwrap()
    }

    #[test]
    fn create_assigns_metadata_and_versions() {
        let mut s = Store::new();
        let a = s
            .create(Kind::Service, svc("ns", "a", json!({})), None)
            .unwrap();
        let b = s
            .create(Kind::Service, svc("ns", "b", json!({})), None)
            .unwrap();
        assert_eq!(a["metadata"]["resourceVersion"], "2");
        assert_eq!(b["metadata"]["resourceVersion"], "3");
        assert_ne!(a["metadata"]["uid"], b["metadata"]["uid"]);
        assert!(a["metadata"]["creationTimestamp"].is_string());
        assert_eq!(a["kind"], "Service");
        let e = s
            .create(Kind::Service, svc("ns", "a", json!({})), None)
            .unwrap_err();
        assert_eq!(e.code, 409);
    }

    #[test]
    fn unchanged_update_keeps_version_and_stale_put_conflicts() {
        let mut s = Store::new();
        let a = s
            .create(Kind::Service, svc("ns", "a", json!({})), None)
            .unwrap();
        let same = s.update(Kind::Service, a.clone(), None, true).unwrap();
        assert_eq!(
            same["metadata"]["resourceVersion"],
            a["metadata"]["resourceVersion"]
        );
        let mut changed = a.clone();
        changed["spec"]["clusterIP"] = json!("10.0.0.2");
        let b = s
            .update(Kind::Service, changed.clone(), None, true)
            .unwrap();
        assert_eq!(b["metadata"]["resourceVersion"], "3");
        assert_eq!(b["metadata"]["uid"], a["metadata"]["uid"]);
        changed["spec"]["clusterIP"] = json!("10.0.0.3");
        assert_eq!(
            s.update(Kind::Service, changed, None, true)
                .unwrap_err()
                .code,
            409
        );
    }

    #[test]
    fn paging_is_consistent_at_the_first_pages_version() {
        let mut s = Store::new();
        for n in ["a", "b", "c"] {
            s.create(Kind::Service, svc("ns", n, json!({})), None)
                .unwrap();
        }
        let p1 = s
            .list(Kind::Service, None, &params(&[("limit", "2")]))
            .unwrap();
        assert_eq!(names(&p1.items), ["a", "b"]);
        assert_eq!(p1.remaining, Some(1));
        // A write between pages is not visible in the continued list.
        s.delete(Kind::Service, Some("ns"), "c").unwrap();
        s.create(Kind::Service, svc("ns", "d", json!({})), None)
            .unwrap();
        let token = p1.continue_token.unwrap();
        let p2 = s
            .list(
                Kind::Service,
                None,
                &params(&[("limit", "2"), ("continue", &token)]),
            )
            .unwrap();
        assert_eq!(names(&p2.items), ["c"]);
        assert_eq!(p2.resource_version, p1.resource_version);
        assert!(p2.continue_token.is_none());
        // After compaction the token is too old.
        s.compact();
        assert_eq!(
            s.list(Kind::Service, None, &params(&[("continue", &token)]))
                .unwrap_err()
                .code,
            410
        );
    }

    #[test]
    fn watch_reports_selector_transitions() {
        let mut s = Store::new();
        let filter = params(&[("labelSelector", "!skip")]).filter(None);
        let start = s.resource_version();
        let a = s
            .create(Kind::Service, svc("ns", "a", json!({})), None)
            .unwrap();
        s.create(
            Kind::Service,
            svc("ns", "hidden", json!({"skip": "1"})),
            None,
        )
        .unwrap();
        let mut labelled = a.clone();
        labelled["metadata"]["labels"] = json!({"skip": "1"});
        s.update(Kind::Service, labelled, None, false).unwrap();
        s.update(Kind::Service, a, None, false).unwrap();
        s.delete(Kind::Service, Some("ns"), "a").unwrap();
        s.create(Kind::Node, json!({"metadata": {"name": "n1"}}), None)
            .unwrap();
        let (events, seen) = s.events_since(Kind::Service, start, &filter).unwrap();
        let kinds: Vec<_> = events.iter().map(|e| e.kind).collect();
        assert_eq!(kinds, ["ADDED", "DELETED", "ADDED", "DELETED"]);
        assert_eq!(seen, s.resource_version());
        // The delete reports the last state at the deletion's version.
        assert_eq!(
            events[3].object["metadata"]["resourceVersion"],
            json!(events[3].rv.to_string())
        );
    }

    #[test]
    fn compaction_expires_older_versions() {
        let mut s = Store::new();
        let start = s.resource_version();
        s.create(Kind::Node, json!({"metadata": {"name": "n1"}}), None)
            .unwrap();
        s.compact();
        let e = s
            .events_since(Kind::Node, start, &Filter::default())
            .unwrap_err();
        assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
        assert!(
            s.events_since(Kind::Node, s.resource_version(), &Filter::default())
                .is_ok()
        );
        let exact = params(&[
            ("resourceVersion", &start.to_string()),
            ("resourceVersionMatch", "Exact"),
        ]);
        assert_eq!(s.list(Kind::Node, None, &exact).unwrap_err().code, 410);
    }

    #[test]
    fn nodes_are_cluster_scoped_and_namespaces_are_filled_in() {
        let mut s = Store::new();
        let n = s
            .create(
                Kind::Node,
                json!({"metadata": {"name": "n1", "namespace": "x"}}),
                None,
            )
            .unwrap();
        assert!(n["metadata"].get("namespace").is_none());
        let e = s
            .create(
                Kind::EndpointSlice,
                json!({"metadata": {"name": "e", "namespace": "a"}}),
                Some("b"),
            )
            .unwrap_err();
        assert_eq!(e.code, 400);
        let e = s
            .create(Kind::EndpointSlice, json!({"metadata": {}}), None)
            .unwrap_err();
        assert_eq!(e.code, 422);
        assert!(e.message.contains("metadata.name"), "{e}");
        let d = s
            .create(
                Kind::EndpointSlice,
                json!({"metadata": {"name": "e"}}),
                None,
            )
            .unwrap();
        assert_eq!(d["metadata"]["namespace"], "default");
    }
}
