//! Change tracking. Placeholder: filled by the model work.
use std::sync::Arc;

use super::{ChangedSet, ModelWarning, Snapshot};
use crate::source::Event;

/// Counts of changes not yet in a snapshot (upstream's `*_changes_pending` metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pending {
    pub services: usize,
    pub endpoints: usize,
}

pub struct Tracker {}

impl Tracker {
    pub fn new(_node_name: impl Into<String>) -> Self {
        unimplemented!()
    }
    pub fn apply(&mut self, _event: Event) -> Vec<ModelWarning> {
        unimplemented!()
    }
    pub fn is_synced(&self) -> bool {
        unimplemented!()
    }
    pub fn pending(&self) -> Pending {
        unimplemented!()
    }
    pub fn snapshot(&mut self) -> (Arc<Snapshot>, ChangedSet) {
        unimplemented!()
    }
}
