//! EndpointSlice → Endpoints, merged per service port. Placeholder: filled by the model work.
