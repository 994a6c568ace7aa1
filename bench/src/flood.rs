//! The [`throughput`](super::throughput) group's packet generator and receiver: small UDP/IPv4
//! frames with complete checksums, sent flat out from one thread for a bounded time and count
//! ([`Generator`]: in-kernel XDP live frames, or an `AF_PACKET` socket), and a counting sink in
//! each backend pod (an nftables counter at prerouting, priority raw, that counts and drops
//! what reaches the pod's address and port).
//!
//! CPU spent: on a veth path the whole journey of a frame (the sender's device, the node's
//! XDP / TC / netfilter, the second node, the pod) runs in softirq on the sending CPU, mostly
//! when the sender re-enables bottom halves (`local_bh_enable`) — charged to the sending
//! thread on this kernel (`CONFIG_IRQ_TIME_ACCOUNTING` is off) — and otherwise in
//! `ksoftirqd`. [`SoftirqThreads`] and the sender's thread CPU clock together are the CPU the
//! path spent, whatever else the shared machine runs.

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

/// How the frames are put on the wire (`KP_BENCH_THROUGHPUT_GEN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generator {
    /// In-kernel, like a NIC's receive ring (default): a small XDP program
    /// (`generator_program`: a random source port of the flows' range, then a redirect
    /// into the client's device), run by `BPF_PROG_TEST_RUN` with
    /// `BPF_F_TEST_XDP_LIVE_FRAMES` ([`LIVE_REPEAT`] frames per call). The frames reach the node's device as XDP frames (`ndo_xdp_xmit` of the veth
    /// pair), so the node's XDP program sees them as a native driver would hand them over,
    /// and without XDP the device builds the skb, as a NIC driver does; no socket buffer is
    /// allocated on the sending side.
    XdpLive,
    /// An `AF_PACKET` socket (qdisc bypassed, `sendmmsg` batches of [`BATCH`]): the frames
    /// arrive as skbs, which a veth must copy into a page for its XDP program.
    AfPacket,
}

impl Generator {
    pub fn from_env() -> anyhow::Result<Generator> {
        match std::env::var("KP_BENCH_THROUGHPUT_GEN").as_deref() {
            Err(_) | Ok("xdp-live") => Ok(Generator::XdpLive),
            Ok("af-packet") => Ok(Generator::AfPacket),
            Ok(other) => bail!(
                "KP_BENCH_THROUGHPUT_GEN: {other:?} is neither \"xdp-live\" nor \"af-packet\""
            ),
        }
    }
}

/// Frames per `BPF_PROG_TEST_RUN` call of [`Generator::XdpLive`] (each call sets up a page
/// pool and tears it down, which costs milliseconds: calls are long).
pub const LIVE_REPEAT: u32 = 1 << 16;

/// Like [`flood`], with the generator chosen. [`Generator::XdpLive`] sends `frames` (a few
/// templates) in turn, [`LIVE_REPEAT`] at a time, each packet with its source port rewritten
/// to one of `sports` (first, count: a power of two) at random; [`Generator::AfPacket`] sends them as they are.
pub fn flood_with(
    generator: Generator,
    ns: &Netns,
    ifname: &str,
    frames: &[Vec<u8>],
    sports: (u16, u16),
    time: Duration,
    max_packets: u64,
) -> anyhow::Result<Sent> {
    match generator {
        Generator::AfPacket => flood(ns, ifname, frames, time, max_packets),
        Generator::XdpLive => {
            anyhow::ensure!(!frames.is_empty(), "no frames to send");
            anyhow::ensure!(
                sports.1.is_power_of_two(),
                "the number of flows ({}) must be a power of two",
                sports.1
            );
            ns.run(|| live_loop(ifname, frames, sports, time, max_packets))?
        }
    }
}

/// `bpf(2)`.
fn bpf(cmd: libc::c_int, attr: *mut libc::c_void, size: usize) -> std::io::Result<i64> {
    // SAFETY: the callers pass a pointer to an attribute struct of `size` bytes.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, size) };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// One BPF instruction.
#[repr(C)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: dst | (src << 4),
        off,
        imm,
    }
}

/// The generator's XDP program: writes `template`'s Ethernet, IPv4 and UDP headers (42 bytes)
/// over the frame — a live-mode frame's page comes back from the receivers with their
/// rewrites (NAT, TTL, MACs), so every run starts from the template — with the UDP source port
/// `first + (random & mask)` and its checksum updated from the template's (RFC 1624, so every
/// frame stays complete), then `return bpf_redirect(ifindex, 0)`.
fn generator_program(
    ifindex: u32,
    template: &[u8],
    first: u16,
    mask: u16,
) -> anyhow::Result<Vec<Insn>> {
    const MOV_X: u8 = 0xbf;
    const MOV_K: u8 = 0xb7;
    const ADD_K: u8 = 0x07;
    const ADD_X: u8 = 0x0f;
    const AND_K: u8 = 0x57;
    const XOR_K: u8 = 0xa7;
    const RSH_K: u8 = 0x77;
    const TO_BE: u8 = 0xdc;
    const LDX_W: u8 = 0x61;
    const ST_W: u8 = 0x62;
    const STX_H: u8 = 0x6b;
    const JGT_X: u8 = 0x2d;
    const JNE_K: u8 = 0x55;
    const CALL: u8 = 0x85;
    const EXIT: u8 = 0x95;
    const FUNC_PRANDOM: i32 = 7;
    const FUNC_REDIRECT: i32 = 23;
    const SPORT: usize = 14 + 20;
    const UDP_CSUM: usize = SPORT + 6;
    const HEADERS: usize = UDP_CSUM + 2;
    anyhow::ensure!(template.len() >= HEADERS, "template frame too short");
    // Checksum arithmetic on the 16-bit words as loaded (byte order does not matter to it).
    let word = |at: usize| u32::from(u16::from_le_bytes([template[at], template[at + 1]]));
    let base = (!word(UDP_CSUM) & 0xffff) + (!word(SPORT) & 0xffff);
    let mut p = vec![
        insn(MOV_X, 6, 1, 0, 0),
        insn(CALL, 0, 0, 0, FUNC_PRANDOM),
        insn(AND_K, 0, 0, 0, i32::from(mask)),
        insn(ADD_K, 0, 0, 0, i32::from(first)),
        insn(TO_BE, 0, 0, 0, 16),
        insn(LDX_W, 2, 6, 0, 0),
        insn(LDX_W, 3, 6, 4, 0),
        insn(MOV_X, 4, 2, 0, 0),
        insn(ADD_K, 4, 0, 0, HEADERS as i32),
        // Too short: to the XDP_ABORTED exit at the end.
        insn(JGT_X, 4, 3, 0, 0),
    ];
    let jump_at = p.len() - 1;
    for at in (0..UDP_CSUM).step_by(4) {
        let bytes = [
            template[at],
            template[at + 1],
            template[at + 2],
            template[at + 3],
        ];
        p.push(insn(ST_W, 2, 0, at as i16, i32::from_le_bytes(bytes)));
    }
    p.extend([
        insn(STX_H, 2, 0, SPORT as i16, 0),
        insn(MOV_K, 7, 0, 0, base as i32),
        insn(ADD_X, 7, 0, 0, 0),
    ]);
    for _ in 0..2 {
        p.extend([
            insn(MOV_X, 8, 7, 0, 0),
            insn(RSH_K, 8, 0, 0, 16),
            insn(AND_K, 7, 0, 0, 0xffff),
            insn(ADD_X, 7, 8, 0, 0),
        ]);
    }
    p.extend([
        insn(XOR_K, 7, 0, 0, 0xffff),
        // A UDP checksum of zero means "none": send 0xffff instead.
        insn(JNE_K, 7, 0, 1, 0),
        insn(MOV_K, 7, 0, 0, 0xffff),
        insn(STX_H, 2, 7, UDP_CSUM as i16, 0),
        insn(MOV_K, 1, 0, 0, i32::try_from(ifindex)?),
        insn(MOV_K, 2, 0, 0, 0),
        insn(CALL, 0, 0, 0, FUNC_REDIRECT),
        insn(EXIT, 0, 0, 0, 0),
    ]);
    let aborted = p.len();
    p.extend([insn(MOV_K, 0, 0, 0, 0), insn(EXIT, 0, 0, 0, 0)]);
    p[jump_at].off = i16::try_from(aborted - jump_at - 1)?;
    Ok(p)
}

/// Loads [`generator_program`] as an XDP program.
fn load_generator(
    ifindex: u32,
    template: &[u8],
    first: u16,
    mask: u16,
) -> anyhow::Result<std::os::fd::OwnedFd> {
    let insns = generator_program(ifindex, template, first, mask)?;
    #[repr(C)]
    struct ProgLoad {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
        prog_name: [u8; 16],
        rest: [u8; 96],
    }
    const BPF_PROG_LOAD: libc::c_int = 5;
    const BPF_PROG_TYPE_XDP: u32 = 6;
    let license = b"GPL\0";
    let mut name = [0u8; 16];
    name[..10].copy_from_slice(b"kp_thr_gen");
    let mut attr = ProgLoad {
        prog_type: BPF_PROG_TYPE_XDP,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
        rest: [0; 96],
    };
    let fd = bpf(
        BPF_PROG_LOAD,
        (&mut attr as *mut ProgLoad).cast(),
        std::mem::size_of::<ProgLoad>(),
    )
    .context("loading the generator's XDP program")?;
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

fn live_loop(
    ifname: &str,
    frames: &[Vec<u8>],
    sports: (u16, u16),
    time: Duration,
    max_packets: u64,
) -> anyhow::Result<Sent> {
    #[repr(C)]
    struct TestRun {
        prog_fd: u32,
        retval: u32,
        data_size_in: u32,
        data_size_out: u32,
        data_in: u64,
        data_out: u64,
        repeat: u32,
        duration: u32,
        ctx_size_in: u32,
        ctx_size_out: u32,
        ctx_in: u64,
        ctx_out: u64,
        flags: u32,
        cpu: u32,
        batch_size: u32,
        pad: u32,
    }
    const BPF_PROG_TEST_RUN: libc::c_int = 10;
    const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;
    let ifindex =
        nix::net::if_::if_nametoindex(ifname).with_context(|| format!("no device {ifname}"))?;
    // One program per template frame (its headers are in the program).
    let progs = frames
        .iter()
        .map(|f| load_generator(ifindex, f, sports.0, sports.1 - 1))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut sent = Sent::default();
    let (start, cpu0) = (Instant::now(), thread_cpu());
    let mut i = 0;
    while sent.packets < max_packets && start.elapsed() < time {
        let (frame, prog) = (&frames[i % frames.len()], &progs[i % frames.len()]);
        i += 1;
        let repeat = u64::from(LIVE_REPEAT).min(max_packets - sent.packets) as u32;
        let mut attr = TestRun {
            prog_fd: std::os::fd::AsRawFd::as_raw_fd(prog) as u32,
            retval: 0,
            data_size_in: frame.len() as u32,
            data_size_out: 0,
            data_in: frame.as_ptr() as u64,
            data_out: 0,
            repeat,
            duration: 0,
            ctx_size_in: 0,
            ctx_size_out: 0,
            ctx_in: 0,
            ctx_out: 0,
            flags: BPF_F_TEST_XDP_LIVE_FRAMES,
            cpu: 0,
            batch_size: 0,
            pad: 0,
        };
        match bpf(
            BPF_PROG_TEST_RUN,
            (&mut attr as *mut TestRun).cast(),
            std::mem::size_of::<TestRun>(),
        ) {
            Ok(_) => sent.packets += u64::from(repeat),
            Err(e) if sent.packets == 0 => {
                return Err(e).context("BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES");
            }
            Err(_) => sent.errors += 1,
        }
    }
    sent.wall = start.elapsed();
    sent.thread_cpu = thread_cpu().saturating_sub(cpu0);
    Ok(sent)
}

/// Switches generic receive offload of `ifname` in the calling thread's namespace on or off
/// (`ETHTOOL_SGRO`). On a veth, GRO on gives the receiving end a NAPI ring: it then takes
/// frames redirected by XDP (`ndo_xdp_xmit`) without an XDP program of its own, and builds
/// their skbs as a NIC driver does.
pub fn set_gro(ifname: &str, on: bool) -> anyhow::Result<()> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    const ETHTOOL_SGRO: u32 = 0x2c;
    let mut value = EthtoolValue {
        cmd: ETHTOOL_SGRO,
        data: u32::from(on),
    };
    // SAFETY: a datagram socket for the ioctl, closed by `OwnedFd`; a zeroed ifreq with the
    // name and a pointer to `value`, which outlives the call.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            bail!("socket: {}", std::io::Error::last_os_error());
        }
        let _fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let mut req: libc::ifreq = std::mem::zeroed();
        for (d, s) in req.ifr_name.iter_mut().zip(ifname.bytes().take(15)) {
            *d = s as libc::c_char;
        }
        req.ifr_ifru.ifru_data = (&mut value as *mut EthtoolValue).cast();
        if libc::ioctl(fd, libc::SIOCETHTOOL, &mut req) != 0 {
            bail!(
                "{ifname}: ETHTOOL_SGRO: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
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

    /// The hand-assembled generator program, run once per frame (`BPF_PROG_TEST_RUN` without
    /// live frames) on a frame whose headers are garbage, as a recycled page's may be: every
    /// output carries the template's headers, a source port of the range and complete
    /// checksums, and the verdict is a redirect.
    #[test]
    fn generator_program_writes_complete_frames_of_the_flows() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root (BPF_PROG_LOAD)");
            return;
        }
        let template = udp_frame(
            [2, 0, 0, 0, 0, 1],
            [2, 0, 0, 0, 0, 2],
            (Ipv4Addr::new(192, 168, 77, 2), 20_000),
            (Ipv4Addr::new(192, 168, 77, 1), 30_090),
        );
        let prog = load_generator(1, &template, 20_000, 1023).unwrap();
        let mut ports = std::collections::BTreeSet::new();
        for _ in 0..64 {
            let input = vec![0xa5u8; template.len()];
            let mut out = vec![0u8; template.len()];
            let mut attr = [0u64; 10];
            // prog_fd, retval | data_size_in, data_size_out | data_in | data_out | repeat.
            attr[0] = std::os::fd::AsRawFd::as_raw_fd(&prog) as u64;
            attr[1] = input.len() as u64 | ((out.len() as u64) << 32);
            attr[2] = input.as_ptr() as u64;
            attr[3] = out.as_mut_ptr() as u64;
            attr[4] = 1;
            bpf(10, attr.as_mut_ptr().cast(), std::mem::size_of_val(&attr)).unwrap();
            let retval = (attr[0] >> 32) as u32;
            assert_eq!(retval, 4, "XDP_REDIRECT");
            assert_eq!(out[..34], template[..34]);
            assert_eq!(out[36..40], template[36..40]);
            assert_eq!(out[42..], input[42..], "the payload is left alone");
            let sport = u16::from_be_bytes([out[34], out[35]]);
            assert!((20_000..21_024).contains(&sport), "{sport}");
            ports.insert(sport);
            // Live frames keep data_in's payload (the template's): the checksum covers it.
            let mut pseudo = out[26..34].to_vec();
            pseudo.extend_from_slice(&[0, 17, 0, 26]);
            assert_eq!(checksum(&[&pseudo, &out[34..42], &template[42..]]), 0);
        }
        assert!(ports.len() > 32, "random flows: {ports:?}");
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
