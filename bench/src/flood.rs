//! The [`throughput`](super::throughput) group's packet generator and receiver: small UDP/IPv4
//! frames with complete checksums, sent flat out from one thread through an `AF_PACKET` socket
//! (qdisc bypassed, `sendmmsg` batches of [`BATCH`]) for a bounded time and count, and a
//! counting sink in each backend pod (an nftables counter at prerouting, priority raw, that
//! counts and drops what reaches the pod's address and port).
//!
//! CPU spent: on a veth path the whole journey of a frame (the sender's device, the node's
//! XDP / TC / netfilter, the second node, the pod) runs in softirq on the sending CPU, mostly
//! at the sender's `local_bh_enable` — charged to the sending thread on this kernel
//! (`CONFIG_IRQ_TIME_ACCOUNTING` is off) — and otherwise in `ksoftirqd`. [`SoftirqThreads`] and
//! the sender's thread CPU clock together are the CPU the path spent, whatever else the shared
//! machine runs.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use kproxy_tests::netns::{Netns, run_checked};

/// Frames per `sendmmsg`.
pub const BATCH: usize = 64;
/// UDP payload bytes: the frame is 60 bytes, Ethernet's minimum without the FCS.
pub const PAYLOAD: usize = 18;

/// One UDP/IPv4 frame with complete IPv4 and UDP checksums (TTL 64, DF clear, id 0).
pub fn udp_frame(
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
) -> Vec<u8> {
    let udp_len = 8 + PAYLOAD;
    let ip_len = 20 + udp_len;
    let mut f = Vec::with_capacity(14 + ip_len);
    f.extend_from_slice(&dst_mac);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let ip_start = f.len();
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&(ip_len as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 0, 64, 17, 0, 0]);
    f.extend_from_slice(&src.0.octets());
    f.extend_from_slice(&dst.0.octets());
    let ip_sum = checksum(&[&f[ip_start..]]);
    f[ip_start + 10..ip_start + 12].copy_from_slice(&ip_sum.to_be_bytes());
    let udp_start = f.len();
    f.extend_from_slice(&src.1.to_be_bytes());
    f.extend_from_slice(&dst.1.to_be_bytes());
    f.extend_from_slice(&(udp_len as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend(b"kproxy-throughput!".iter().take(PAYLOAD));
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend_from_slice(&src.0.octets());
    pseudo.extend_from_slice(&dst.0.octets());
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
    let udp_sum = match checksum(&[&pseudo, &f[udp_start..]]) {
        0 => 0xffff,
        s => s,
    };
    f[udp_start + 6..udp_start + 8].copy_from_slice(&udp_sum.to_be_bytes());
    f
}

/// The Internet checksum (RFC 1071) over the concatenation of `parts` (each of even length but
/// the last).
pub fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        for pair in part.chunks(2) {
            let hi = u32::from(pair[0]) << 8;
            sum += hi | pair.get(1).map_or(0, |b| u32::from(*b));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// What one flood sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sent {
    pub packets: u64,
    /// `sendmmsg` calls that failed (e.g. `ENOBUFS`); the sender keeps going.
    pub errors: u64,
    pub wall: Duration,
    /// CPU time of the sending thread (including the softirq work it ran).
    pub thread_cpu: Duration,
}

/// Sends `frames` round-robin out of `ifname` in `ns` as fast as one thread can, until `time`
/// has passed or `max_packets` are sent.
pub fn flood(
    ns: &Netns,
    ifname: &str,
    frames: &[Vec<u8>],
    time: Duration,
    max_packets: u64,
) -> anyhow::Result<Sent> {
    anyhow::ensure!(!frames.is_empty(), "no frames to send");
    ns.run(|| send_loop(ifname, frames, time, max_packets))?
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn send_loop(
    ifname: &str,
    frames: &[Vec<u8>],
    time: Duration,
    max_packets: u64,
) -> anyhow::Result<Sent> {
    let ifindex =
        nix::net::if_::if_nametoindex(ifname).with_context(|| format!("no device {ifname}"))?;
    // SAFETY: plain socket calls on a descriptor owned by `_fd`; every pointer handed to the
    // kernel points into locals or `frames`, which outlive the calls.
    unsafe {
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            bail!("AF_PACKET socket: {}", std::io::Error::last_os_error());
        }
        let _fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let one: libc::c_int = 1;
        if libc::setsockopt(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_QDISC_BYPASS,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        ) != 0
        {
            bail!("PACKET_QDISC_BYPASS: {}", std::io::Error::last_os_error());
        }
        let mut sll: libc::sockaddr_ll = std::mem::zeroed();
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_IP as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        if libc::bind(
            fd,
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        ) != 0
        {
            bail!("binding to {ifname}: {}", std::io::Error::last_os_error());
        }
        // One iovec and message per frame, repeated up to a whole number of batches.
        let n = frames.len().div_ceil(BATCH) * BATCH;
        let mut iov: Vec<libc::iovec> = (0..n)
            .map(|i| libc::iovec {
                iov_base: frames[i % frames.len()].as_ptr() as *mut libc::c_void,
                iov_len: frames[i % frames.len()].len(),
            })
            .collect();
        let mut msgs: Vec<libc::mmsghdr> = iov
            .iter_mut()
            .map(|v| {
                let mut m: libc::mmsghdr = std::mem::zeroed();
                m.msg_hdr.msg_iov = v;
                m.msg_hdr.msg_iovlen = 1;
                m
            })
            .collect();
        let mut sent = Sent::default();
        let (start, cpu0) = (Instant::now(), thread_cpu());
        let mut at = 0;
        while sent.packets < max_packets && start.elapsed() < time {
            let want = BATCH.min((max_packets - sent.packets) as usize) as u32;
            let r = libc::sendmmsg(fd, msgs[at..].as_mut_ptr(), want, 0);
            if r < 0 {
                sent.errors += 1;
            } else {
                sent.packets += r as u64;
            }
            at = (at + BATCH) % n;
        }
        sent.wall = start.elapsed();
        sent.thread_cpu = thread_cpu().saturating_sub(cpu0);
        Ok(sent)
    }
}

/// CPU time of the `ksoftirqd/N` threads, to add the softirq work deferred to them.
pub struct SoftirqThreads {
    pids: Vec<u32>,
}

impl SoftirqThreads {
    pub fn find() -> anyhow::Result<SoftirqThreads> {
        let mut pids = Vec::new();
        for entry in std::fs::read_dir("/proc")? {
            let entry = entry?;
            let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            if comm.starts_with("ksoftirqd/") {
                pids.push(pid);
            }
        }
        anyhow::ensure!(!pids.is_empty(), "no ksoftirqd threads found in /proc");
        Ok(SoftirqThreads { pids })
    }

    /// Their user + system CPU time so far.
    pub fn cpu(&self) -> Duration {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let ticks: f64 = self
            .pids
            .iter()
            .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
            .filter_map(|stat| {
                let rest = stat.rsplit_once(')')?.1.to_string();
                let f: Vec<&str> = rest.split_whitespace().collect();
                Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
            })
            .sum();
        Duration::from_secs_f64(ticks / hz)
    }
}

/// Name of the nftables table of a [`Sink`] (in the pod's own namespace).
const SINK_TABLE: &str = "kp_thru_sink";

/// A counting sink in a backend pod: UDP to the pod's address and `port` is counted and
/// dropped at prerouting (priority raw, before the pod's conntrack), so the pod's receive path
/// ends there and the count is what arrived translated to the backend's address and port.
pub struct Sink<'a> {
    ns: &'a Netns,
}

impl<'a> Sink<'a> {
    pub fn install(ns: &'a Netns, addr: Ipv4Addr, port: u16) -> anyhow::Result<Sink<'a>> {
        let rules = format!(
            "table ip {SINK_TABLE} {{\n  counter delivered {{ }}\n  chain pre {{\n    type filter hook prerouting priority raw; policy accept;\n    ip daddr {addr} udp dport {port} counter name \"delivered\" drop\n  }}\n}}\n"
        );
        let path = std::env::temp_dir().join(format!("kp-thru-sink-{}.nft", std::process::id()));
        std::fs::write(&path, rules)?;
        let mut cmd = ns.command("nft");
        cmd.arg("-f").arg(&path);
        let r = run_checked(&mut cmd).context("installing the sink's nftables table");
        let _ = std::fs::remove_file(&path);
        r?;
        Ok(Sink { ns })
    }

    /// Packets counted so far.
    pub fn delivered(&self) -> anyhow::Result<u64> {
        let mut cmd = self.ns.command("nft");
        cmd.args(["-j", "list", "counter", "ip", SINK_TABLE, "delivered"]);
        let out = run_checked(&mut cmd)?;
        let v: serde_json::Value = serde_json::from_str(out.trim()).context("nft -j")?;
        v["nftables"]
            .as_array()
            .and_then(|a| a.iter().find_map(|o| o["counter"]["packets"].as_u64()))
            .with_context(|| format!("no counter in {out}"))
    }
}

/// The MAC address of `ifname` in `ns`.
pub fn mac(ns: &Netns, ifname: &str) -> anyhow::Result<[u8; 6]> {
    let out = ns.ip(&["-j", "link", "show", "dev", ifname])?;
    let v: serde_json::Value = serde_json::from_str(out.trim())?;
    let text = v[0]["address"]
        .as_str()
        .with_context(|| format!("{ifname}: no address in {out}"))?;
    let mut mac = [0u8; 6];
    let parts: Vec<&str> = text.split(':').collect();
    anyhow::ensure!(parts.len() == 6, "{ifname}: bad MAC {text}");
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).with_context(|| format!("{ifname}: bad MAC {text}"))?;
    }
    Ok(mac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_carry_complete_checksums() {
        let f = udp_frame(
            [2, 0, 0, 0, 0, 1],
            [2, 0, 0, 0, 0, 2],
            (Ipv4Addr::new(192, 168, 77, 2), 10_000),
            (Ipv4Addr::new(192, 168, 77, 1), 30_090),
        );
        assert_eq!(f.len(), 60);
        // A header with its checksum in place sums to zero.
        assert_eq!(checksum(&[&f[14..34]]), 0);
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&f[26..34]);
        pseudo.extend_from_slice(&[0, 17, 0, 26]);
        assert_eq!(checksum(&[&pseudo, &f[34..]]), 0);
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), 30_090);
    }

    #[test]
    fn checksum_matches_rfc1071_example() {
        // RFC 1071 section 3: 00 01 f2 03 f4 f5 f6 f7 sums to ddf2 (checksum 220d).
        assert_eq!(
            checksum(&[&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]]),
            0x220d
        );
    }
}
