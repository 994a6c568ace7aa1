//! Command line. Placeholder: filled by the CLI/config work.
