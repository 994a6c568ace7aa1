//! Kernel interfaces more than one datapath uses: `netlink` (one socket type and one message
//! splitter for the netlink families no maintained crate covers here: conntrack, sock_diag,
//! IPVS generic netlink, nf_tables), `rtnl` (rtnetlink through the `rtnetlink` crates:
//! requests, dumps, change announcements) and the node's [`addresses`], [`nftables`]
//! (nf_tables state read through netlink) and `route_events` (rtnetlink change
//! notifications) and `routing_policy` (whether routing looks at the source address).

pub mod addresses;
pub(crate) mod netlink;
pub mod nftables;
pub(crate) mod route_events;
pub(crate) mod routing_policy;
pub(crate) mod rtnl;
