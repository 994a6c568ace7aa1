//! `kp-probe`: the servers and clients of kproxy's traffic tests (plain std, no async).
//!
//! Run inside a namespace with `Netns::command` (and, for socket-LB tests, inside a test cgroup
//! with `TestCgroup::enter_on_spawn`); [`kproxy_tests::topology`] wraps both.
//!
//! ```text
//! kp-probe serve NAME [--tcp PORT]… [--udp PORT]… [--bind IP]
//!     TCP: on accept, writes "NAME PEER\n" (PEER = the client address as the server sees it),
//!          then echoes every byte it reads until EOF.
//!     UDP: answers each datagram with "NAME PEER\n".
//!     Prints "ready" on stdout once every socket is bound.
//! kp-probe tcp ADDR [--count N] [--timeout-ms MS]
//!     N connections, one after the other; reads the first line of each.
//! kp-probe udp ADDR [--count N] [--timeout-ms MS] [--same-socket]
//!     N request/answer exchanges, each from a new socket (a new source port) unless
//!     --same-socket.
//! kp-probe hold ADDR [--seconds S] [--interval-ms MS]
//!     one TCP connection: reads the greeting, then sends a line every interval and expects
//!     its echo, for S seconds (forever, until killed, when S is 0); exits 1 on any error.
//!     Prints `{"connected": NAME}` once the greeting arrived.
//! kp-probe latency ADDR [--count N]
//!     N TCP connects; prints {"samples_ns": [...], "errors": E} (connect(2) duration each).
//! kp-probe rps ADDR [--seconds S] [--short]
//!     requests over one keep-alive connection (a line and its echo), or with --short one
//!     connection per request (connect + greeting); prints {"requests": N, "seconds": F}.
//! kp-probe wait ADDR [--name NAME] [--timeout-ms MS] [--interval-ms MS]
//!     retries a TCP connect until one answers (with NAME, when given); prints
//!     {"at_unix_ns": T, "attempts": K} (wall clock, to compare with another process's start)
//!     or exits 1 at the timeout.
//! ```
//!
//! The clients print one JSON object on stdout: `{"answers": {NAME: count}, "peers": {NAME:
//! [PEER…]}, "errors": {KIND: count}, "first_error": "…"}` where KIND is the
//! `std::io::ErrorKind` debug name (`ConnectionRefused`, `TimedOut`, …). `hold` prints
//! `{"backend": NAME, "exchanges": N}` and exits 0, or the error and exits 1.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.split_first() {
        Some((cmd, rest)) => match cmd.as_str() {
            "serve" => serve(rest),
            "tcp" => client(rest, Proto::Tcp),
            "udp" => client(rest, Proto::Udp),
            "hold" => hold(rest),
            "latency" => latency(rest),
            "rps" => rps(rest),
            "wait" => wait(rest),
            other => Err(format!("unknown command {other:?}")),
        },
        None => Err("usage: kp-probe serve|tcp|udp|hold …".into()),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kp-probe: {e}");
            ExitCode::from(2)
        }
    }
}

/// Parsed `--flag value` options after the positional argument.
struct Opts {
    positional: String,
    values: BTreeMap<String, Vec<String>>,
    flags: Vec<String>,
}

const BOOL_FLAGS: [&str; 2] = ["--same-socket", "--short"];

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut it = args.iter();
    let positional = it.next().ok_or("missing argument")?.clone();
    let mut values: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut flags = Vec::new();
    while let Some(a) = it.next() {
        if BOOL_FLAGS.contains(&a.as_str()) {
            flags.push(a.clone());
        } else if a.starts_with("--") {
            let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
            values.entry(a.clone()).or_default().push(v.clone());
        } else {
            return Err(format!("unexpected argument {a:?}"));
        }
    }
    Ok(Opts {
        positional,
        values,
        flags,
    })
}

impl Opts {
    fn all(&self, key: &str) -> Vec<u16> {
        self.values
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|v| v.parse().ok())
            .collect()
    }
    fn num(&self, key: &str, default: u64) -> Result<u64, String> {
        match self.values.get(key).and_then(|v| v.last()) {
            Some(v) => v.parse().map_err(|_| format!("{key}: not a number: {v}")),
            None => Ok(default),
        }
    }
    fn flag(&self, key: &str) -> bool {
        self.flags.iter().any(|f| f == key)
    }
    fn addr(&self) -> Result<SocketAddr, String> {
        self.positional
            .parse()
            .map_err(|_| format!("not an IP:port: {}", self.positional))
    }
}

fn serve(args: &[String]) -> Result<ExitCode, String> {
    let opts = parse(args)?;
    let name = opts.positional.clone();
    let bind: Vec<IpAddr> = match opts.values.get("--bind") {
        Some(ips) => ips
            .iter()
            .map(|s| s.parse().map_err(|_| format!("--bind: not an IP: {s}")))
            .collect::<Result<_, _>>()?,
        // One dual-stack socket per port would need IPV6_V6ONLY=0 (the default here); bind
        // both families explicitly so a host with IPv6 disabled still serves IPv4.
        None => vec![IpAddr::V4(Ipv4Addr::UNSPECIFIED)],
    };
    let with_v6 =
        !opts.values.contains_key("--bind") && UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).is_ok();
    let mut handles = Vec::new();
    let mut addrs: Vec<IpAddr> = bind.clone();
    if with_v6 {
        addrs.push(IpAddr::V6(Ipv6Addr::UNSPECIFIED));
    }
    for ip in &addrs {
        for port in opts.all("--tcp") {
            let listener = bind_tcp(SocketAddr::new(*ip, port))?;
            let name = name.clone();
            handles.push(thread::spawn(move || tcp_server(listener, name)));
        }
        for port in opts.all("--udp") {
            let sock = bind_udp(SocketAddr::new(*ip, port))?;
            let name = name.clone();
            handles.push(thread::spawn(move || udp_server(sock, name)));
        }
    }
    if handles.is_empty() {
        return Err("serve: give at least one --tcp or --udp port".into());
    }
    println!("ready");
    std::io::stdout().flush().ok();
    for h in handles {
        let _ = h.join();
    }
    Ok(ExitCode::SUCCESS)
}

/// Binds with IPV6_V6ONLY so the v4 and v6 wildcard sockets can share a port.
fn bind_tcp(addr: SocketAddr) -> Result<TcpListener, String> {
    let sock = socket(addr, libc::SOCK_STREAM)?;
    let fd = std::os::fd::IntoRawFd::into_raw_fd(sock);
    // SAFETY: fd is a fresh, owned socket.
    let listener = unsafe { <TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: plain listen(2) on an owned, bound socket.
    if unsafe { libc::listen(fd, 1024) } != 0 {
        return Err(format!(
            "listen {addr}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(listener)
}

fn bind_udp(addr: SocketAddr) -> Result<UdpSocket, String> {
    let sock = socket(addr, libc::SOCK_DGRAM)?;
    let fd = std::os::fd::IntoRawFd::into_raw_fd(sock);
    // SAFETY: fd is a fresh, owned, bound socket.
    Ok(unsafe { <UdpSocket as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// socket + SO_REUSEADDR + IPV6_V6ONLY (v6) + bind.
fn socket(addr: SocketAddr, kind: i32) -> Result<std::os::fd::OwnedFd, String> {
    use std::os::fd::FromRawFd;
    let domain = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just created and is owned here.
    let owned = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    let setopt = |level, opt| {
        // SAFETY: setsockopt with a pointer to a live c_int of the right size.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        }
    };
    setopt(libc::SOL_SOCKET, libc::SO_REUSEADDR);
    if addr.is_ipv6() {
        setopt(libc::IPPROTO_IPV6, libc::IPV6_V6ONLY);
    }
    let (storage, len) = sockaddr(addr);
    // SAFETY: storage holds a valid sockaddr of length len.
    if unsafe { libc::bind(fd, (&storage as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(format!("bind {addr}: {}", std::io::Error::last_os_error()));
    }
    Ok(owned)
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

fn tcp_server(listener: TcpListener, name: String) {
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let name = name.clone();
        thread::spawn(move || {
            let peer = conn.peer_addr().map(|p| p.to_string()).unwrap_or_default();
            if conn
                .write_all(format!("{name} {peer}\n").as_bytes())
                .is_err()
            {
                return;
            }
            let mut buf = [0u8; 4096];
            loop {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if conn.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }
}

fn udp_server(sock: UdpSocket, name: String) {
    let mut buf = [0u8; 2048];
    loop {
        if let Ok((_, peer)) = sock.recv_from(&mut buf) {
            let _ = sock.send_to(format!("{name} {peer}\n").as_bytes(), peer);
        }
    }
}

#[derive(Clone, Copy)]
enum Proto {
    Tcp,
    Udp,
}

#[derive(Default)]
struct Tally {
    answers: BTreeMap<String, u64>,
    peers: BTreeMap<String, Vec<String>>,
    errors: BTreeMap<String, u64>,
    first_error: Option<String>,
}

impl Tally {
    fn answer(&mut self, line: &str) {
        let mut parts = line.trim().splitn(2, ' ');
        let name = parts.next().unwrap_or_default().to_string();
        let peer = parts.next().unwrap_or_default().to_string();
        *self.answers.entry(name.clone()).or_default() += 1;
        let peers = self.peers.entry(name).or_default();
        if !peers.contains(&peer) {
            peers.push(peer);
        }
    }
    fn error(&mut self, e: &std::io::Error) {
        *self.errors.entry(format!("{:?}", e.kind())).or_default() += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e.to_string());
        }
    }
    fn json(&self) -> String {
        fn map<V: std::fmt::Display>(m: &BTreeMap<String, V>) -> String {
            let items: Vec<String> = m.iter().map(|(k, v)| format!("{}:{v}", quote(k))).collect();
            format!("{{{}}}", items.join(","))
        }
        let peers: BTreeMap<String, String> = self
            .peers
            .iter()
            .map(|(k, v)| {
                let list: Vec<String> = v.iter().map(|p| quote(p)).collect();
                (k.clone(), format!("[{}]", list.join(",")))
            })
            .collect();
        format!(
            "{{\"answers\":{},\"peers\":{},\"errors\":{},\"first_error\":{}}}",
            map(&self.answers),
            map(&peers),
            map(&self.errors),
            self.first_error
                .as_deref()
                .map_or_else(|| "null".to_string(), quote)
        )
    }
}

fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn client(args: &[String], proto: Proto) -> Result<ExitCode, String> {
    let opts = parse(args)?;
    let addr = opts.addr()?;
    let count = opts.num("--count", 1)?;
    let timeout = Duration::from_millis(opts.num("--timeout-ms", 2000)?);
    let mut tally = Tally::default();
    let mut shared: Option<UdpSocket> = None;
    for _ in 0..count {
        let result = match proto {
            Proto::Tcp => tcp_once(addr, timeout),
            Proto::Udp => {
                if opts.flag("--same-socket") {
                    let sock = match &shared {
                        Some(s) => Ok(s),
                        None => udp_socket(addr, timeout).map(|s| &*shared.insert(s)),
                    };
                    sock.and_then(udp_exchange)
                } else {
                    udp_socket(addr, timeout).and_then(|s| udp_exchange(&s))
                }
            }
        };
        match result {
            Ok(line) => tally.answer(&line),
            Err(e) => tally.error(&e),
        }
    }
    println!("{}", tally.json());
    Ok(ExitCode::SUCCESS)
}

fn tcp_once(addr: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    let conn = TcpStream::connect_timeout(&addr, timeout)?;
    conn.set_read_timeout(Some(timeout))?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed before the greeting",
        ));
    }
    Ok(line)
}

/// A connected UDP socket (connect(2) is where socket LB translates).
fn udp_socket(addr: SocketAddr, timeout: Duration) -> std::io::Result<UdpSocket> {
    let local: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = UdpSocket::bind(local)?;
    sock.set_read_timeout(Some(timeout))?;
    sock.connect(addr)?;
    Ok(sock)
}

fn udp_exchange(sock: &UdpSocket) -> std::io::Result<String> {
    sock.send(b"hello\n")?;
    let mut buf = [0u8; 2048];
    let n = sock.recv(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

fn hold(args: &[String]) -> Result<ExitCode, String> {
    let opts = parse(args)?;
    let addr = opts.addr()?;
    let seconds = opts.num("--seconds", 10)?;
    let interval = Duration::from_millis(opts.num("--interval-ms", 100)?);
    let run = || -> std::io::Result<(String, u64)> {
        let conn = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
        conn.set_read_timeout(Some(Duration::from_secs(3)))?;
        let mut writer = conn.try_clone()?;
        let mut reader = BufReader::new(conn);
        let mut greeting = String::new();
        reader.read_line(&mut greeting)?;
        let backend = greeting.split(' ').next().unwrap_or_default().to_string();
        println!("{{\"connected\":{}}}", quote(&backend));
        std::io::stdout().flush()?;
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let mut exchanges = 0u64;
        while seconds == 0 || Instant::now() < deadline {
            let msg = format!("ping {exchanges}\n");
            writer.write_all(msg.as_bytes())?;
            let mut echo = String::new();
            reader.read_line(&mut echo)?;
            if echo != msg {
                return Err(std::io::Error::other(format!(
                    "echo mismatch: sent {msg:?}, got {echo:?}"
                )));
            }
            exchanges += 1;
            thread::sleep(interval);
        }
        Ok((backend, exchanges))
    };
    match run() {
        Ok((backend, n)) => {
            println!("{{\"backend\":{},\"exchanges\":{n}}}", quote(&backend));
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            println!(
                "{{\"error\":{},\"kind\":{}}}",
                quote(&e.to_string()),
                quote(&format!("{:?}", e.kind()))
            );
            Ok(ExitCode::from(1))
        }
    }
}

fn latency(args: &[String]) -> Result<ExitCode, String> {
    let opts = parse(args)?;
    let addr = opts.addr()?;
    let count = opts.num("--count", 100)?;
    let mut samples = Vec::with_capacity(count as usize);
    let mut errors = 0u64;
    for _ in 0..count {
        let start = Instant::now();
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(conn) => {
                samples.push(start.elapsed().as_nanos().to_string());
                drop(conn);
            }
            Err(_) => errors += 1,
        }
    }
    println!(
        "{{\"samples_ns\":[{}],\"errors\":{errors}}}",
        samples.join(",")
    );
    Ok(ExitCode::SUCCESS)
}

fn rps(args: &[String]) -> Result<ExitCode, String> {
    let opts = parse(args)?;
    let addr = opts.addr()?;
    let seconds = opts.num("--seconds", 2)?;
    let short = opts.flag("--short");
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(seconds);
    let mut requests = 0u64;
    let result = (|| -> std::io::Result<()> {
        if short {
            while Instant::now() < deadline {
                tcp_once(addr, timeout)?;
                requests += 1;
            }
        } else {
            let conn = TcpStream::connect_timeout(&addr, timeout)?;
            conn.set_read_timeout(Some(timeout))?;
            let mut writer = conn.try_clone()?;
            let mut reader = BufReader::new(conn);
            let mut line = String::new();
            reader.read_line(&mut line)?;
            while Instant::now() < deadline {
                writer.write_all(b"request\n")?;
                line.clear();
                reader.read_line(&mut line)?;
                requests += 1;
            }
        }
        Ok(())
    })();
    if let Err(e) = result {
        println!("{{\"error\":{}}}", quote(&e.to_string()));
        return Ok(ExitCode::from(1));
    }
    println!(
        "{{\"requests\":{requests},\"seconds\":{}}}",
        start.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn wait(args: &[String]) -> Result<ExitCode, String> {
    let opts = parse(args)?;
    let addr = opts.addr()?;
    let name = opts.values.get("--name").and_then(|v| v.last()).cloned();
    let deadline = Instant::now() + Duration::from_millis(opts.num("--timeout-ms", 60_000)?);
    let interval = Duration::from_millis(opts.num("--interval-ms", 2)?);
    let mut attempts = 0u64;
    while Instant::now() < deadline {
        attempts += 1;
        if let Ok(line) = tcp_once(addr, Duration::from_millis(200)) {
            let who = line.split(' ').next().unwrap_or_default();
            if name.as_deref().is_none_or(|n| n == who) {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_err(|e| e.to_string())?;
                println!(
                    "{{\"at_unix_ns\":{},\"attempts\":{attempts}}}",
                    now.as_nanos()
                );
                return Ok(ExitCode::SUCCESS);
            }
        }
        thread::sleep(interval);
    }
    println!("{{\"error\":\"timed out\",\"attempts\":{attempts}}}");
    Ok(ExitCode::from(1))
}
