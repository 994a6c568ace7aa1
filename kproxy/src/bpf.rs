//! BPF object loading. Placeholder: filled by the BPF build work.
