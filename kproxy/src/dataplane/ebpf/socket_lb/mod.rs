//! Socket-level load balancing: the cgroup programs' home ([`cgroup`] checks it), and
//! [`sock_destroy`] (with [`sock_diag`]) closing UDP sockets connected to a backend that left.

pub mod cgroup;
pub mod sock_destroy;
pub mod sock_diag;
