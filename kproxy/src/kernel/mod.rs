//! Kernel interfaces more than one datapath uses: [`netlink`] (one socket type and one message
//! splitter for conntrack, sock_diag, IPVS generic netlink and rtnetlink) and the node's
//! [`addresses`], and [`nftables`] (nf_tables state read through netlink).

pub mod addresses;
pub mod netlink;
pub mod nftables;
