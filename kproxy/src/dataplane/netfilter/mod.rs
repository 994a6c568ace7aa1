//! What the netfilter datapaths (iptables, IPVS) share: stale-flow [`conntrack`] cleanup and
//! [`local_detect`]ion of pod traffic.

pub mod conntrack;
pub mod local_detect;
