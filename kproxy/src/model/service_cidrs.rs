//! The cluster's service CIDRs from `ServiceCIDR` objects (networking.k8s.io/v1), as upstream's
//! `ServiceCIDRConfig` (pkg/proxy/config/config.go) hands them to the proxiers'
//! `OnServiceCIDRsChanged`: the union of every object's `spec.cidrs`.
//!
//! Knowingly different from upstream: the union is recomputed from the objects present, so two
//! objects listing the same CIDR keep it when one of them goes (upstream deletes the old
//! object's CIDRs from one shared set); the list is sorted (upstream's is in set order).

use std::collections::BTreeMap;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;

use super::ModelWarning;
use super::input::Delta;
use super::service::parse_cidr_sloppy;

/// Folds `ServiceCIDR` deltas into the current CIDRs.
#[derive(Debug, Default)]
pub(crate) struct ServiceCidrTracker {
    /// `spec.cidrs` per object name; `None` while no ServiceCIDR event ever came (the source
    /// does not deliver them: an API server without them, or the manifests).
    objects: Option<BTreeMap<String, Vec<IpNet>>>,
    /// Objects of a streamed list in progress.
    listing: Option<BTreeMap<String, Vec<IpNet>>>,
    /// The CIDRs changed since [`ServiceCidrTracker::take_changed`].
    changed: bool,
}

fn name_of(o: &ServiceCIDR) -> String {
    o.metadata.name.clone().unwrap_or_default()
}

/// An object's `spec.cidrs`, parsed; unparsable entries are skipped with a warning.
fn parse(o: &ServiceCIDR, warnings: &mut Vec<ModelWarning>) -> Vec<IpNet> {
    let texts = o
        .spec
        .as_ref()
        .and_then(|s| s.cidrs.as_deref())
        .unwrap_or_default();
    let mut out = vec![];
    for (i, t) in texts.iter().enumerate() {
        match parse_cidr_sloppy(t) {
            Some(n) => out.push(n),
            None => warnings.push(ModelWarning::new(
                format!("ServiceCIDR {}", name_of(o)),
                format!("spec.cidrs[{i}]"),
                format!("{t:?} is not a CIDR"),
            )),
        }
    }
    out
}

impl ServiceCidrTracker {
    /// Folds one delta in; returns warnings for skipped entries.
    pub(crate) fn apply(&mut self, d: Delta<ServiceCIDR>) -> Vec<ModelWarning> {
        let mut warnings = vec![];
        let before = self.cidrs();
        match d {
            Delta::Apply(o) => {
                let cidrs = parse(&o, &mut warnings);
                self.objects
                    .get_or_insert_default()
                    .insert(name_of(&o), cidrs);
            }
            Delta::Delete(o) => {
                self.objects.get_or_insert_default().remove(&name_of(&o));
            }
            Delta::Replace(all) => {
                let mut m = BTreeMap::new();
                for o in &all {
                    m.insert(name_of(o), parse(o, &mut warnings));
                }
                self.objects = Some(m);
            }
            Delta::ListStart => self.listing = Some(BTreeMap::new()),
            Delta::Listed(page) => {
                let listing = self.listing.get_or_insert_default();
                for o in &page {
                    listing.insert(name_of(o), parse(o, &mut warnings));
                }
            }
            Delta::ListDone => self.objects = Some(self.listing.take().unwrap_or_default()),
        }
        if self.cidrs() != before {
            self.changed = true;
        }
        warnings
    }

    /// The union of every object's CIDRs, sorted, each once; `None` when no ServiceCIDR was
    /// ever delivered (the caller then uses its configured CIDRs).
    pub(crate) fn cidrs(&self) -> Option<Vec<IpNet>> {
        let objects = self.objects.as_ref()?;
        let mut all: Vec<IpNet> = objects.values().flatten().copied().collect();
        all.sort();
        all.dedup();
        Some(all)
    }

    /// Whether the CIDRs changed since the last call (and resets that).
    pub(crate) fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Whether the CIDRs changed and no snapshot has them yet.
    pub(crate) fn is_changed(&self) -> bool {
        self.changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cidr(name: &str, cidrs: &[&str]) -> ServiceCIDR {
        serde_json::from_value(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": name},
            "spec": {"cidrs": cidrs},
        }))
        .unwrap()
    }
    fn nets(s: &[&str]) -> Vec<IpNet> {
        s.iter().map(|c| c.parse().unwrap()).collect()
    }

    #[test]
    fn unknown_until_the_source_delivers_service_cidrs() {
        let mut t = ServiceCidrTracker::default();
        assert_eq!(t.cidrs(), None);
        assert!(!t.take_changed());
        // An API server serving them but holding none: known and empty.
        t.apply(Delta::Replace(vec![]));
        assert_eq!(t.cidrs(), Some(vec![]));
    }

    #[test]
    fn union_of_every_objects_cidrs_follows_applies_and_deletes() {
        let mut t = ServiceCidrTracker::default();
        let w = t.apply(Delta::Replace(vec![cidr(
            "kubernetes",
            &["10.96.0.0/12", "fd00:10:96::/112"],
        )]));
        assert!(w.is_empty());
        assert!(t.take_changed());
        assert_eq!(t.cidrs(), Some(nets(&["10.96.0.0/12", "fd00:10:96::/112"])));
        t.apply(Delta::Apply(cidr(
            "extra",
            &["172.30.0.0/16", "10.96.0.0/12"],
        )));
        assert!(t.take_changed());
        assert_eq!(
            t.cidrs(),
            Some(nets(&["10.96.0.0/12", "172.30.0.0/16", "fd00:10:96::/112"]))
        );
        // Re-applying the same object changes nothing.
        t.apply(Delta::Apply(cidr(
            "extra",
            &["172.30.0.0/16", "10.96.0.0/12"],
        )));
        assert!(!t.take_changed());
        // A CIDR another object still lists stays.
        t.apply(Delta::Delete(cidr("kubernetes", &[])));
        assert!(t.take_changed());
        assert_eq!(t.cidrs(), Some(nets(&["10.96.0.0/12", "172.30.0.0/16"])));
    }

    #[test]
    fn a_streamed_list_replaces_what_it_did_not_hold() {
        let mut t = ServiceCidrTracker::default();
        t.apply(Delta::Replace(vec![cidr("old", &["10.0.0.0/16"])]));
        t.take_changed();
        t.apply(Delta::ListStart);
        t.apply(Delta::Listed(vec![cidr("new", &["10.1.0.0/16"])]));
        assert_eq!(t.cidrs(), Some(nets(&["10.0.0.0/16"])), "until ListDone");
        assert!(!t.is_changed());
        t.apply(Delta::ListDone);
        assert!(t.take_changed());
        assert_eq!(t.cidrs(), Some(nets(&["10.1.0.0/16"])));
    }

    #[test]
    fn the_tracker_puts_them_in_the_snapshot_and_asks_for_a_sync() {
        use crate::model::Tracker;
        use crate::model::input::Event;
        let mut t = Tracker::new("n");
        let (snap, _) = t.snapshot();
        assert_eq!(
            snap.service_cidrs, None,
            "none delivered: the configured ones apply"
        );
        assert!(!t.service_cidrs_pending());
        t.apply(Event::ServiceCidr(Delta::Replace(vec![cidr(
            "kubernetes",
            &["10.96.0.0/12"],
        )])));
        assert!(t.service_cidrs_pending());
        let (snap, _) = t.snapshot();
        assert_eq!(snap.service_cidrs, Some(nets(&["10.96.0.0/12"])));
        assert!(!t.service_cidrs_pending());
        // Kept by later snapshots; an emptied list is known-empty, not unknown.
        t.apply(Event::ServiceCidr(Delta::Delete(cidr("kubernetes", &[]))));
        let (snap, _) = t.snapshot();
        assert_eq!(snap.service_cidrs, Some(vec![]));
        let (snap, _) = t.snapshot();
        assert_eq!(snap.service_cidrs, Some(vec![]));
    }

    #[test]
    fn a_bad_cidr_is_skipped_naming_object_and_field() {
        let mut t = ServiceCidrTracker::default();
        let w = t.apply(Delta::Apply(cidr("bad", &["10.96.0.0/12", "nonsense"])));
        assert_eq!(
            w.iter().map(ToString::to_string).collect::<Vec<_>>(),
            vec!["ServiceCIDR bad: spec.cidrs[1]: \"nonsense\" is not a CIDR"]
        );
        assert_eq!(t.cidrs(), Some(nets(&["10.96.0.0/12"])));
    }
}
