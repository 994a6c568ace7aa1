//! [`PerFamily`]: the one way a mode runs dual-stack — one part per IP family, every part
//! synced on every sync, their results joined into one [`SyncReport`].
//!
//! The iptables, nftables and ipvs modes keep one proxier per family (upstream runs one per
//! family behind its `metaProxier`); the ebpf mode's maps hold both families in one plan and
//! need no wrapper. A part that fails does not stop the others (as upstream's meta proxier):
//! the sync fails, naming each failed family, and the runner retries it.

use crate::model::{ChangedSet, IpFamily, Snapshot};

use super::{CleanupError, ProxyMode, SyncError, SyncReport};

/// One IP family's part of a dual-stack datapath.
pub(crate) trait FamilyPart {
    fn family(&self) -> IpFamily;
    /// Syncs this family. The report's `endpoints` and `failed_services` are summed over the
    /// families; `services` is recomputed by [`PerFamily::sync`].
    fn sync_family(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, String>;
    /// Removes this family's kernel state.
    fn cleanup_family(&mut self) -> Result<(), String>;
}

/// A per-family datapath could not be assembled.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FamilyError {
    #[error("{0} datapath needs at least one IP family")]
    NoFamily(ProxyMode),
    #[error("{0} datapath: two parts for {1:?}")]
    Duplicate(ProxyMode, IpFamily),
}

/// One part per family, in the order given.
pub(crate) struct PerFamily<P> {
    mode: ProxyMode,
    parts: Vec<P>,
}

impl<P: FamilyPart> PerFamily<P> {
    /// `parts` must hold at least one part and at most one per family.
    pub(crate) fn new(mode: ProxyMode, parts: Vec<P>) -> Result<Self, FamilyError> {
        if parts.is_empty() {
            return Err(FamilyError::NoFamily(mode));
        }
        for (i, p) in parts.iter().enumerate() {
            if parts[..i].iter().any(|q| q.family() == p.family()) {
                return Err(FamilyError::Duplicate(mode, p.family()));
            }
        }
        Ok(PerFamily { mode, parts })
    }

    pub(crate) fn parts(&self) -> &[P] {
        &self.parts
    }

    pub(crate) fn parts_mut(&mut self) -> &mut [P] {
        &mut self.parts
    }

    pub(crate) fn families(&self) -> Vec<IpFamily> {
        self.parts.iter().map(FamilyPart::family).collect()
    }

    /// Syncs every part. Service ports are counted once however many families program them
    /// (those with a ClusterIP of one of the parts' families).
    pub(crate) fn sync(
        &mut self,
        snap: &Snapshot,
        changed: &ChangedSet,
    ) -> Result<SyncReport, SyncError> {
        let mut endpoints = 0;
        let mut failed_services = 0;
        let mut errors = vec![];
        for p in &mut self.parts {
            match p.sync_family(snap, changed) {
                Ok(r) => {
                    endpoints += r.endpoints;
                    failed_services += r.failed_services;
                }
                Err(e) => errors.push(format!("{:?}: {e}", p.family())),
            }
        }
        if !errors.is_empty() {
            return Err(SyncError::Kernel(errors.join("; ")));
        }
        let mut report = SyncReport::of_families(snap, &self.families(), endpoints);
        report.failed_services = failed_services;
        Ok(report)
    }

    /// Cleans up every part; stops at the first failure.
    pub(crate) fn cleanup(&mut self) -> Result<(), CleanupError> {
        let mode = self.mode;
        for p in &mut self.parts {
            let family = p.family();
            p.cleanup_family().map_err(|reason| CleanupError {
                mode,
                reason: format!("{family:?}: {reason}"),
            })?;
        }
        Ok(())
    }
}

/// A per-family datapath is a datapath (the ipvs mode's is this alone).
impl<P: FamilyPart + Send> super::Dataplane for PerFamily<P> {
    fn mode(&self) -> ProxyMode {
        self.mode
    }
    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        PerFamily::sync(self, snap, changed)
    }
    fn cleanup(&mut self) -> Result<(), CleanupError> {
        PerFamily::cleanup(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testing::{endpoint, service_port, snapshot};

    struct Part {
        family: IpFamily,
        fail: bool,
        synced: usize,
    }

    impl FamilyPart for Part {
        fn family(&self) -> IpFamily {
            self.family
        }
        fn sync_family(&mut self, snap: &Snapshot, _: &ChangedSet) -> Result<SyncReport, String> {
            self.synced += 1;
            if self.fail {
                return Err("boom".into());
            }
            Ok(SyncReport {
                services: 99,
                endpoints: snap.services.len(),
                failed_services: 1,
            })
        }
        fn cleanup_family(&mut self) -> Result<(), String> {
            Ok(())
        }
    }

    fn part(family: IpFamily, fail: bool) -> Part {
        Part {
            family,
            fail,
            synced: 0,
        }
    }

    #[test]
    fn every_family_syncs_and_services_are_counted_once() {
        let snap = snapshot("n")
            .service(
                service_port("ns", "s", "p")
                    .cluster_ip("10.0.0.1")
                    .cluster_ip("fd00::1")
                    .build(),
                vec![endpoint("10.1.0.1", 80).build()],
            )
            .build();
        let mut pf = PerFamily::new(
            ProxyMode::Iptables,
            vec![part(IpFamily::V4, false), part(IpFamily::V6, false)],
        )
        .unwrap();
        let r = pf.sync(&snap, &ChangedSet::default()).unwrap();
        assert_eq!((r.services, r.endpoints, r.failed_services), (1, 2, 2));
    }

    #[test]
    fn a_failed_family_fails_the_sync_after_the_others_ran() {
        let mut pf = PerFamily::new(
            ProxyMode::Nftables,
            vec![part(IpFamily::V4, true), part(IpFamily::V6, false)],
        )
        .unwrap();
        let err = pf
            .sync(&Snapshot::default(), &ChangedSet::default())
            .unwrap_err();
        assert_eq!(err.to_string(), "V4: boom");
        assert_eq!(pf.parts()[1].synced, 1, "V6 synced despite V4's failure");
    }

    #[test]
    fn no_part_or_two_of_a_family_is_refused() {
        assert_eq!(
            PerFamily::<Part>::new(ProxyMode::Ipvs, vec![]).err(),
            Some(FamilyError::NoFamily(ProxyMode::Ipvs))
        );
        assert_eq!(
            PerFamily::new(
                ProxyMode::Ipvs,
                vec![part(IpFamily::V4, false), part(IpFamily::V4, false)]
            )
            .err(),
            Some(FamilyError::Duplicate(ProxyMode::Ipvs, IpFamily::V4))
        );
    }
}
