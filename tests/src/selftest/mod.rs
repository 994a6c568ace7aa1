//! Tests of the helpers themselves (the library's unit tests, `cargo test -p kproxy-tests
//! --lib`): what the integration tests rely on the sandboxes, the shared topology and the fake
//! API server to do.

mod fakeapi;
mod netns;
mod topology;
