//! Kubernetes API source. Placeholder: filled by the sources work.
