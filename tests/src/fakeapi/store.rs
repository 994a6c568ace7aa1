//! The fake's object store (pure): objects as JSON, one global resourceVersion counter (like
//! etcd's revision), and the change history that watches and consistent paged lists read.
//!
//! History covers `(oldest_rv, rv]`: a watch or snapshot from a version older than
//! `oldest_rv` is answered with 410 Expired. [`Store::compact`] drops the history.
//!
//! Objects are immutable once stored (`Arc<Value>`; a write stores a new `Arc`), so the
//! current map, the history and list pages share them. A list page reads the state at its
//! version as a merged view: the current objects from the page's start key on, overlaid with
//! what the history says each object changed since was at that version. A page therefore costs
//! the page, the changes since its version and, without selectors, a cheap count of the rest
//! (for `remainingItemCount`, which the real server leaves unset when a label or field
//! selector is given) — not a copy of every object, which made a paged list of N objects
//! O(N²) deep copies.

use std::collections::BTreeMap;
use std::iter::Peekable;
use std::ops::{Bound, Not as _};
use std::sync::Arc;

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
    old: Option<Arc<Value>>,
    /// The object after the write (`None`: deleted).
    new: Option<Arc<Value>>,
    /// The object a watch reports: `new`, or for a delete the last state with the deletion's
    /// resourceVersion.
    reported: Arc<Value>,
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
    /// Shared with the store: the page's objects are copied only when it is serialized.
    pub items: Vec<Arc<Value>>,
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
    objects: BTreeMap<Key, Arc<Value>>,
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
        self.objects.get(&key(kind, namespace, name)).map(|v| &**v)
    }

    /// Every object of `kind` matching `filter`, in key order.
    pub fn matching(&self, kind: Kind, filter: &Filter) -> Vec<Value> {
        self.of_kind(kind, None)
            .map(|(_, v)| v)
            .filter(|o| filter.matches(o))
            .map(|o| (**o).clone())
            .collect()
    }

    /// The current objects of `kind` in key order, from after `after` on (if given).
    fn of_kind<'a>(
        &'a self,
        kind: Kind,
        after: Option<&Key>,
    ) -> impl Iterator<Item = (&'a Key, &'a Arc<Value>)> + 'a {
        let first = kind_start(kind);
        let start = match after {
            Some(k) => Bound::Excluded(k),
            None => Bound::Included(&first),
        };
        self.objects
            .range::<Key, _>((start, Bound::Unbounded))
            .take_while(move |(k, _)| k.kind == kind)
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
        if obj == *old {
            return Ok((*old).clone());
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
    fn write(&mut self, k: Key, old: Option<Arc<Value>>, new: Option<Value>) -> Value {
        self.rv += 1;
        let rv = json!(self.rv.to_string());
        let new = new.map(|mut o| {
            o["metadata"]["resourceVersion"] = rv.clone();
            Arc::new(o)
        });
        let reported = match &new {
            Some(o) => o.clone(),
            None => {
                let mut o = Value::clone(old.as_deref().expect("a delete has an old object"));
                o["metadata"]["resourceVersion"] = rv;
                Arc::new(o)
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
        (*reported).clone()
    }

    /// The objects of `kind` as they were at `rv`, in key order, from after `after` on (needs
    /// history back to `rv`): the current objects overlaid with the state at `rv` of every
    /// object written since.
    fn state_at<'a>(
        &'a self,
        kind: Kind,
        rv: u64,
        after: Option<&Key>,
    ) -> Result<impl Iterator<Item = (&'a Key, &'a Arc<Value>)> + 'a, ApiError> {
        if rv < self.oldest_rv {
            return Err(too_old(rv, self.oldest_rv));
        }
        // Newest first, so each key ends with its first change after `rv`, whose `old` is
        // the object at `rv` (`None`: it did not exist then).
        let mut changed: BTreeMap<&Key, Option<&Arc<Value>>> = BTreeMap::new();
        for c in self
            .history
            .iter()
            .rev()
            .take_while(|c| c.rv > rv)
            .filter(|c| c.key.kind == kind)
            .filter(|c| after.is_none_or(|a| &c.key > a))
        {
            changed.insert(&c.key, c.old.as_ref());
        }
        Ok(Overlay {
            base: self.of_kind(kind, after).peekable(),
            over: changed.into_iter().peekable(),
        })
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
                let (at, (namespace, name)) = parse_continue(token)?;
                if at < self.oldest_rv {
                    return Err(ApiError::expired(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    ));
                }
                let after = Key {
                    kind,
                    namespace,
                    name,
                };
                (at, Some(after))
            }
            None => (self.list_version(params)?, None),
        };
        let mut matching = self
            .state_at(kind, at, after.as_ref())?
            .filter(|(_, v)| filter.matches(v));
        let mut items = vec![];
        let mut last = None;
        for (k, v) in matching.by_ref() {
            if params.limit.is_some_and(|l| items.len() >= l) {
                // One more exists. remainingItemCount counts the rest, except with a label or
                // field selector, where the real server leaves it unset (ListMeta: "the number
                // of remaining items is unknown") — and counting would evaluate the selector on
                // every remaining object for each page, O(N²) over a paged list.
                let remaining = filter
                    .has_selectors()
                    .not()
                    .then(|| 1 + matching.count() as u64);
                let (ns, name): (String, String) = last.expect("limit > 0");
                return Ok(ListPage {
                    items,
                    resource_version: at,
                    continue_token: Some(format!("{at}/{ns}/{name}")),
                    remaining,
                });
            }
            last = Some((k.namespace.clone(), k.name.clone()));
            items.push(v.clone());
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
                    object: (*c.reported).clone(),
                })
            })
            .collect();
        Ok((events, self.rv.max(after)))
    }
}

/// A key-ordered merge of the current objects (`base`) with overriding entries (`over`; `None`
/// hides the key): what [`Store::state_at`] reads.
struct Overlay<'a, B: Iterator<Item = (&'a Key, &'a Arc<Value>)>, O>
where
    O: Iterator<Item = (&'a Key, Option<&'a Arc<Value>>)>,
{
    base: Peekable<B>,
    over: Peekable<O>,
}

impl<'a, B, O> Iterator for Overlay<'a, B, O>
where
    B: Iterator<Item = (&'a Key, &'a Arc<Value>)>,
    O: Iterator<Item = (&'a Key, Option<&'a Arc<Value>>)>,
{
    type Item = (&'a Key, &'a Arc<Value>);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let order = match (self.base.peek(), self.over.peek()) {
                (None, None) => return None,
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (Some((b, _)), Some((o, _))) => b.cmp(o),
            };
            match order {
                std::cmp::Ordering::Less => return self.base.next(),
                std::cmp::Ordering::Equal | std::cmp::Ordering::Greater => {
                    if order.is_eq() {
                        self.base.next();
                    }
                    let (k, v) = self.over.next().expect("peeked");
                    if let Some(v) = v {
                        return Some((k, v));
                    }
                }
            }
        }
    }
}

/// The smallest key of `kind`.
fn kind_start(kind: Kind) -> Key {
    Key {
        kind,
        namespace: String::new(),
        name: String::new(),
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

    fn names(items: &[Arc<Value>]) -> Vec<String> {
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

    /// Service `j` of [`paged_store`]: key order is `j` order.
    fn nth(j: usize) -> (String, String) {
        (format!("ns-{}", j / 500), format!("svc-{j:04}"))
    }

    /// 2,000 Services in 4 namespaces, every other one labelled `tier=a`, and a Node.
    fn paged_store() -> Store {
        let mut s = Store::new();
        s.create(Kind::Node, json!({"metadata": {"name": "n1"}}), None)
            .unwrap();
        for j in 0..2000 {
            let (ns, name) = nth(j);
            let tier = if j % 2 == 0 { "a" } else { "b" };
            s.create(Kind::Service, svc(&ns, &name, json!({"tier": tier})), None)
                .unwrap();
        }
        s
    }

    /// Writes between pages, around the `done`-th Service: updates (twice, flipping the label),
    /// a delete + re-create and a delete ahead of the cursor; a delete, an update and creates
    /// behind it; a create ahead; a Node write.
    fn write_between_pages(s: &mut Store, page: usize, done: usize) {
        let relabel = |s: &mut Store, j: usize, ip: &str| {
            let (ns, name) = nth(j);
            let mut o = s.get(Kind::Service, Some(&ns), &name).unwrap().clone();
            let tier = if o["metadata"]["labels"]["tier"] == "a" {
                "b"
            } else {
                "a"
            };
            o["metadata"]["labels"]["tier"] = json!(tier);
            o["spec"]["clusterIP"] = json!(ip);
            s.update(Kind::Service, o, None, false).unwrap();
        };
        let ahead = |off: usize| (done + off < 2000).then(|| nth(done + off));
        if ahead(10).is_some() {
            relabel(s, done + 10, "10.1.0.1");
            relabel(s, done + 10, "10.1.0.2");
        }
        if let Some((ns, name)) = ahead(20) {
            s.delete(Kind::Service, Some(&ns), &name).unwrap();
            s.create(Kind::Service, svc(&ns, &name, json!({"tier": "a"})), None)
                .unwrap();
        }
        if let Some((ns, name)) = ahead(30) {
            s.delete(Kind::Service, Some(&ns), &name).unwrap();
        }
        if let Some((ns, name)) = ahead(40) {
            let name = format!("{name}-new");
            s.create(Kind::Service, svc(&ns, &name, json!({"tier": "a"})), None)
                .unwrap();
        }
        if done >= 7 {
            let (ns, name) = nth(done - 5);
            s.delete(Kind::Service, Some(&ns), &name).unwrap();
            relabel(s, done - 7, "10.1.0.3");
        }
        s.create(
            Kind::Service,
            svc("ns-0", &format!("aaa-{page}"), json!({"tier": "a"})),
            None,
        )
        .unwrap();
        let mut node = s.get(Kind::Node, None, "n1").unwrap().clone();
        node["metadata"]["labels"] = json!({"page": page.to_string()});
        s.update(Kind::Node, node, None, false).unwrap();
    }

    #[test]
    fn a_paged_list_of_2000_is_one_consistent_snapshot_while_objects_change() {
        for selector in [None, Some("tier=a")] {
            let mut s = paged_store();
            let mut base: Vec<(&str, &str)> = vec![("limit", "300")];
            base.extend(selector.map(|sel| ("labelSelector", sel)));
            let filter = params(&base).filter(None);
            // What the list must return: the objects as they are when it starts.
            let expected = s.matching(Kind::Service, &filter);
            let first_rv = s.resource_version();

            let mut listed: Vec<Value> = vec![];
            let mut token: Option<String> = None;
            let mut first_token = None;
            for page in 0.. {
                let mut p = base.clone();
                p.extend(token.as_deref().map(|t| ("continue", t)));
                let got = s.list(Kind::Service, None, &params(&p)).unwrap();
                assert_eq!(got.resource_version, first_rv, "page {page}");
                listed.extend(got.items.iter().map(|o| (**o).clone()));
                let left = (expected.len() - listed.len()) as u64;
                // Upstream leaves remainingItemCount unset with a selector.
                let want = (left > 0 && selector.is_none()).then_some(left);
                assert_eq!(got.remaining, want, "page {page}");
                token = got.continue_token;
                first_token = first_token.or(token.clone());
                if token.is_none() {
                    break;
                }
                let done = listed.len() * if selector.is_some() { 2 } else { 1 };
                write_between_pages(&mut s, page, done);
            }
            let selector = selector.unwrap_or("");
            assert!(
                s.resource_version() > first_rv,
                "{selector}: nothing changed"
            );
            assert_eq!(listed.len(), expected.len(), "{selector}");
            // Same objects, same order, same content (so each exactly once, as at first_rv).
            assert!(
                listed == expected,
                "{selector}: the pages differ from the snapshot"
            );

            // The same version read in one go agrees, and a fresh list sees the writes.
            let mut exact = vec![
                ("resourceVersion", first_rv.to_string()),
                ("resourceVersionMatch", "Exact".to_string()),
            ];
            exact.extend(base[1..].iter().map(|(k, v)| (*k, v.to_string())));
            let exact: Vec<(&str, &str)> = exact.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let whole = s.list(Kind::Service, None, &params(&exact)).unwrap();
            assert!(whole.items.iter().map(|o| &**o).eq(expected.iter()));
            let now = s.list(Kind::Service, None, &params(&base[1..])).unwrap();
            assert_eq!(now.resource_version, s.resource_version());
            assert!(
                now.items
                    .iter()
                    .map(|o| &**o)
                    .eq(s.matching(Kind::Service, &filter).iter())
            );
            assert!(!now.items.iter().map(|o| &**o).eq(expected.iter()));

            // Once the history is gone, continuing the old list is 410 Expired.
            s.compact();
            let mut p = base.clone();
            p.push(("continue", first_token.as_deref().unwrap()));
            let e = s.list(Kind::Service, None, &params(&p)).unwrap_err();
            assert_eq!((e.code, e.reason.as_str()), (410, "Expired"), "{selector}");
        }
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
