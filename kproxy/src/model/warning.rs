//! Problems found while turning Kubernetes objects into the model.

use std::fmt;

/// A part of a Kubernetes object that was skipped, naming the object, the field and why.
/// The builders return these instead of failing: everything else in the object is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelWarning {
    /// e.g. `Service default/web` or `EndpointSlice default/web-abc12`.
    pub object: String,
    /// JSON path of the offending field, e.g. `spec.ports[1].port`.
    pub field: String,
    pub reason: String,
}

impl ModelWarning {
    pub(crate) fn new(
        object: impl Into<String>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        ModelWarning {
            object: object.into(),
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ModelWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.object, self.field, self.reason)
    }
}
