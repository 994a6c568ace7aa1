//! Socket-level load balancing: the cgroup `sock_addr` programs (`kproxy-ebpf/src/sock.rs`)
//! that translate a service frontend to a backend when a socket connects or sends, using the
//! service maps of [`crate::service`], and the cgroup `sock_release` program that deletes a
//! socket's per-socket entries ([`crate::service::MAP_SOCK_REV_NAT`],
//! [`crate::service::MAP_SOCK_FWD`], [`crate::service::MAP_SOCK_SENT`]) when it goes away.

/// `cgroup/connect4`: TCP/UDP `connect()` to a frontend → a backend.
pub const PROG_SOCK_CONNECT4: &str = "kp_sk_conn4";
/// `cgroup/connect6`.
pub const PROG_SOCK_CONNECT6: &str = "kp_sk_conn6";
/// `cgroup/sendmsg4`: unconnected UDP `sendto()` to a frontend → a backend.
pub const PROG_SOCK_SENDMSG4: &str = "kp_sk_send4";
/// `cgroup/sendmsg6`.
pub const PROG_SOCK_SENDMSG6: &str = "kp_sk_send6";
/// `cgroup/recvmsg4`: UDP `recvfrom()` from a backend reports the frontend.
pub const PROG_SOCK_RECVMSG4: &str = "kp_sk_recv4";
/// `cgroup/recvmsg6`.
pub const PROG_SOCK_RECVMSG6: &str = "kp_sk_recv6";
/// `cgroup/getpeername4`: `getpeername()` of a translated socket reports the frontend.
pub const PROG_SOCK_GETPEERNAME4: &str = "kp_sk_peer4";
/// `cgroup/getpeername6`.
pub const PROG_SOCK_GETPEERNAME6: &str = "kp_sk_peer6";

/// `cgroup/sock_release` (`BPF_CGROUP_INET_SOCK_RELEASE`, kernel ≥ 5.9): the socket's last
/// file reference closed; its per-socket entries are deleted.
pub const PROG_SOCK_RELEASE: &str = "kp_sk_release";

/// Every socket-LB program, in attach order.
pub const PROGRAMS: [&str; 9] = [
    PROG_SOCK_CONNECT4,
    PROG_SOCK_CONNECT6,
    PROG_SOCK_SENDMSG4,
    PROG_SOCK_SENDMSG6,
    PROG_SOCK_RECVMSG4,
    PROG_SOCK_RECVMSG6,
    PROG_SOCK_GETPEERNAME4,
    PROG_SOCK_GETPEERNAME6,
    PROG_SOCK_RELEASE,
];

/// errno a socket gets when it connects (or sends) to a frontend without any endpoint
/// (upstream: REJECT with icmp-port-unreachable, which a TCP connect sees as ECONNREFUSED).
pub const ERRNO_NO_ENDPOINTS: i32 = 111; // ECONNREFUSED

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_the_kernel_object_name_limit() {
        for name in PROGRAMS {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
        }
    }
}
