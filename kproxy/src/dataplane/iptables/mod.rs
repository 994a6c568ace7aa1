//! iptables proxier. Placeholder: filled by the iptables work.
