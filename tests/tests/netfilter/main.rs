//! The iptables proxier (upstream's corpus, the real kernel, traffic, the agent's canary
//! monitor), the nftables proxier (upstream's corpus, `nft -f` in a namespace, traffic, the
//! agent restarted under live connections), conntrack cleanup and sysctls. One test binary
//! for these files (see tests/README.md).

mod conntrack_cleanup;
mod conntrack_upstream;
mod iptables_agent;
mod iptables_corpus;
mod iptables_foreign;
mod iptables_kernel;
mod iptables_partial;
mod iptables_traffic;
mod iptables_udp_flow;
mod nftables_agent;
mod nftables_changes;
mod nftables_corpus;
mod nftables_kernel;
mod nftables_netlink;
mod nftables_options;
mod nftables_services;
mod nftables_traffic;
mod nftables_udp_flow;
mod sysctl_apply;
