//! Service → ServicePorts. Placeholder: filled by the model work.
