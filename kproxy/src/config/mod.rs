//! Configuration. Placeholder: filled by the CLI/config work.
