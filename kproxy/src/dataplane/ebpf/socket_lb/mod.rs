//! Socket-level load balancing: the cgroup programs' home ([`cgroup`] checks it), and
//! [`sock_destroy`] (with [`sock_diag`]) closing UDP sockets connected to a backend that left.

pub(crate) mod cgroup;
pub(crate) mod sock_destroy;
pub(crate) mod sock_diag;
