//! What the netfilter datapaths (iptables, IPVS) share: stale-flow [`conntrack`] cleanup and
//! [`local_detect`]ion of pod traffic; [`with_conntrack`] runs the cleanup after each sync.

pub mod conntrack;
pub mod local_detect;
pub mod with_conntrack;
