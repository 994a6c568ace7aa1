//! Kernel sandboxes for tests: network namespaces, veth pairs, a private bpffs and a test
//! cgroup v2 directory. Every object carries a name unique to the test (`kp-<hint>-<pid>-<n>`)
//! and is removed on `Drop`, so also when the test panics; objects a killed test process left
//! behind (its pid is gone) are swept when the next test creates a namespace or cgroup.
//!
//! - [`require_root`]: gate for kernel tests (`"skipped: <why>"` when they cannot run; a panic
//!   instead when `KPROXY_TESTS_REQUIRE_KERNEL=1`, which `cargo xtask test` sets).
//! - [`Netns`]: `ip netns add`; run a closure inside it ([`Netns::run`]: `setns` on a dedicated
//!   thread, e.g. to attach BPF or open sockets, which stay in the namespace) or a command
//!   ([`Netns::command`]: `nsenter --net=/run/netns/NAME`, which unlike `ip netns exec` leaves
//!   the mounts, e.g. the cgroup2 tree, untouched).
//! - [`Veth`]: a veth pair between two namespaces, with addresses, links up.
//! - [`Bpffs`]: `mount -t bpf` on a private directory.
//! - [`TestCgroup`]: a directory under the cgroup2 mount found in `/proc/self/mountinfo`.

use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Once;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use nix::sched::{CloneFlags, setns};

/// When `1`, [`require_root`] panics instead of skipping (`cargo xtask test` sets it, so a CI
/// run cannot pass by skipping every kernel test).
pub const REQUIRE_KERNEL_ENV: &str = "KPROXY_TESTS_REQUIRE_KERNEL";

/// Prefix of every kernel object these helpers create.
const PREFIX: &str = "kp";
/// Where `ip netns add` puts its namespace files.
const NETNS_DIR: &str = "/run/netns";
/// Files a fresh bpffs already holds (the kernel's preloaded iterators).
const BPFFS_PRELOADED: [&str; 2] = ["maps.debug", "progs.debug"];

/// True when kernel tests can run here (root, network namespaces, `ip`, `nsenter`). Otherwise
/// prints `skipped: <why>` and returns false, or panics when [`REQUIRE_KERNEL_ENV`] is `1`.
pub fn require_root() -> bool {
    let Some(why) = kernel_test_blocker() else {
        return true;
    };
    let test = thread::current().name().unwrap_or("<unnamed>").to_string();
    if std::env::var(REQUIRE_KERNEL_ENV).is_ok_and(|v| v == "1") {
        panic!("{test}: cannot run kernel tests: {why} (and {REQUIRE_KERNEL_ENV}=1)");
    }
    eprintln!("skipped: {test}: {why}");
    false
}

fn kernel_test_blocker() -> Option<String> {
    let euid = nix::unistd::geteuid();
    if !euid.is_root() {
        return Some(format!("needs root (euid {euid})"));
    }
    if !Path::new("/proc/self/ns/net").exists() {
        return Some("the kernel has no network namespaces (/proc/self/ns/net)".into());
    }
    for (tool, package) in [("ip", "iproute2"), ("nsenter", "util-linux")] {
        if !on_path(tool) {
            return Some(format!("`{tool}` ({package}) is not installed"));
        }
    }
    None
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

/// `kp-<hint>-<pid>-<n>`: unique per process (`n` counts up) and across processes (`pid`).
/// `hint` (the test name) is reduced to `[a-z0-9-]` and 24 bytes.
pub fn unique_name(hint: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let mut clean: String = hint
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    clean.truncate(24);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}-{clean}-{}-{n}", std::process::id())
}

/// The pid embedded by [`unique_name`], if `name` is one of ours.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(PREFIX)?.strip_prefix('-')?;
    let mut fields = rest.rsplit('-');
    fields.next()?.parse::<u32>().ok()?;
    fields.next()?.parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `name` is one of [`unique_name`]'s whose test process no longer exists (a leftover
/// of a killed test run).
pub fn is_stale_name(name: &str) -> bool {
    owner_pid(name).is_some_and(|pid| !pid_alive(pid))
}

/// Removes namespaces, empty cgroups and private bpffs mounts ([`Bpffs`], whose pins keep
/// their maps, tens of MB each, loaded until unmounted) left by test processes that no longer
/// exist.
fn sweep_stale() {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(|| remove_stale(is_stale_name));
}

/// [`sweep_stale`]'s work, leftovers picked by `stale` (their name).
fn remove_stale(stale: impl Fn(&str) -> bool) {
    for entry in fs::read_dir(NETNS_DIR).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if stale(&name) {
            let _ = run_checked(Command::new("ip").args(["netns", "del", &name]));
        }
    }
    if let Some(root) = cgroup2_mount() {
        for entry in fs::read_dir(root).into_iter().flatten().flatten() {
            if stale(&entry.file_name().to_string_lossy()) {
                let _ = fs::remove_dir(entry.path());
            }
        }
    }
    for entry in fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if stale(&entry.file_name().to_string_lossy()) && is_bpffs(&entry.path()) {
            let _ = nix::mount::umount2(&entry.path(), nix::mount::MntFlags::MNT_DETACH);
            let _ = fs::remove_dir(entry.path());
        }
    }
}

/// Runs `cmd`, failing with its command line and stderr unless it exits 0; returns stdout.
pub fn run_checked(cmd: &mut Command) -> anyhow::Result<String> {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().with_context(|| format!("spawning {cmd:?}"))?;
    if !status.success() {
        bail!(
            "{cmd:?} failed ({status}): {}",
            String::from_utf8_lossy(&stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&stdout).into_owned())
}

/// A network namespace (`ip netns add`), deleted on drop. Its `lo` is up.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates `kp-<hint>-<pid>-<n>`; pass the test name (plus a role) as `hint`.
    pub fn new(hint: &str) -> anyhow::Result<Netns> {
        sweep_stale();
        let name = unique_name(hint);
        run_checked(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    /// Runs `f` on a fresh thread that joined this namespace and returns its result; a panic in
    /// `f` is resumed on the caller. Sockets and BPF links created in `f` belong to this
    /// namespace (interfaces are resolved in it) and stay valid after it returns.
    pub fn run<T: Send, F: FnOnce() -> T + Send>(&self, f: F) -> anyhow::Result<T> {
        let ns = self.open()?;
        let name = &self.name;
        thread::scope(|scope| {
            let handle = thread::Builder::new()
                .name(format!("netns {name}"))
                .spawn_scoped(scope, move || -> anyhow::Result<T> {
                    setns(&ns, CloneFlags::CLONE_NEWNET)
                        .with_context(|| format!("setns into netns {name}"))?;
                    Ok(f())
                })
                .context("spawning a netns thread")?;
            handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// Like [`Netns::run`] but detached: for servers that live for the rest of the test.
    pub fn spawn<T, F>(&self, f: F) -> anyhow::Result<thread::JoinHandle<anyhow::Result<T>>>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let ns = self.open()?;
        let name = self.name.clone();
        thread::Builder::new()
            .name(format!("netns {name}"))
            .spawn(move || {
                setns(&ns, CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("setns into netns {name}"))?;
                Ok(f())
            })
            .context("spawning a netns thread")
    }

    fn open(&self) -> anyhow::Result<File> {
        File::open(self.path()).with_context(|| format!("opening netns {}", self.path().display()))
    }

    /// `nsenter --net=/run/netns/<name> -- <program>`: add arguments, then spawn/output it.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path().display()))
            .arg("--")
            .arg(program);
        cmd
    }

    /// Runs `program args…` inside the namespace; fails unless it exits 0; returns stdout.
    pub fn exec(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        run_checked(self.command(program).args(args))
    }

    /// `ip -n <name> <args…>`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        run_checked(Command::new("ip").args(["-n", &self.name]).args(args))
            .with_context(|| format!("in netns {}", self.name))
    }

    /// Writes a `net.*` sysctl of this namespace, e.g. `("net.ipv4.ip_forward", "1")`.
    pub fn sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        if !key.starts_with("net.") {
            bail!("sysctl {key:?}: only net.* keys are per network namespace");
        }
        let path = Path::new("/proc/sys").join(key.replace('.', "/"));
        self.run(|| fs::write(&path, value))?
            .with_context(|| format!("netns {}: setting {key}={value}", self.name))
    }

    /// Switches TX checksum offload of every interface but `lo` on or off (the ethtool
    /// `ETHTOOL_STXCSUM` ioctl; the `ethtool` program is not installed here). Off, the stack
    /// finishes a `CHECKSUM_PARTIAL` packet's checksum in software when it leaves, from what
    /// the field holds by then, and sends finished checksums itself.
    pub fn set_tx_checksum(&self, on: bool) -> anyhow::Result<()> {
        let links = self.ip(&["-o", "link", "show"])?;
        let names: Vec<String> = links
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|n| n.split('@').next().unwrap_or(n).to_string())
            .filter(|n| n != "lo")
            .collect();
        self.run(|| -> anyhow::Result<()> {
            let sock = nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Inet,
                nix::sys::socket::SockType::Datagram,
                nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                None,
            )?;
            for name in &names {
                #[repr(C)]
                struct EthtoolValue {
                    cmd: u32,
                    data: u32,
                }
                const ETHTOOL_STXCSUM: u32 = 0x17;
                let mut value = EthtoolValue {
                    cmd: ETHTOOL_STXCSUM,
                    data: u32::from(on),
                };
                // SAFETY: a zeroed ifreq with the name and a pointer to `value`, which
                // outlives the call.
                let rc = unsafe {
                    let mut req: libc::ifreq = std::mem::zeroed();
                    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes().take(15)) {
                        *d = s as libc::c_char;
                    }
                    req.ifr_ifru.ifru_data = (&mut value as *mut EthtoolValue).cast();
                    libc::ioctl(
                        std::os::fd::AsRawFd::as_raw_fd(&sock),
                        libc::SIOCETHTOOL,
                        &mut req,
                    )
                };
                if rc != 0 {
                    bail!(
                        "{name}: ETHTOOL_STXCSUM: {}",
                        std::io::Error::last_os_error()
                    );
                }
            }
            Ok(())
        })?
        .with_context(|| format!("netns {}: TX checksum offload {on}", self.name))
    }

    /// Disables IPv6 on every current and future interface, so links stay silent (no DAD,
    /// router or multicast-listener packets) unless the test sends something.
    pub fn disable_ipv6(&self) -> anyhow::Result<()> {
        self.sysctl("net.ipv6.conf.all.disable_ipv6", "1")?;
        self.sysctl("net.ipv6.conf.default.disable_ipv6", "1")
    }

    /// `ip route add <dst> via <gateway>`.
    pub fn add_route(&self, dst: &str, gateway: &str) -> anyhow::Result<()> {
        self.ip(&["route", "add", dst, "via", gateway]).map(drop)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(err) = run_checked(Command::new("ip").args(["netns", "del", &self.name])) {
            eprintln!("warning: removing netns {}: {err:#}", self.name);
        }
    }
}

/// One end of a [`Veth`]: namespace, interface name (at most 15 bytes) and optional address.
#[derive(Debug, Clone, Copy)]
pub struct VethEnd<'a> {
    pub ns: &'a Netns,
    pub ifname: &'a str,
    /// `addr/prefix`, e.g. `10.0.0.1/24`.
    pub cidr: Option<&'a str>,
}

impl<'a> VethEnd<'a> {
    pub fn new(ns: &'a Netns, ifname: &'a str) -> Self {
        VethEnd {
            ns,
            ifname,
            cidr: None,
        }
    }

    pub fn addr(self, cidr: &'a str) -> Self {
        VethEnd {
            cidr: Some(cidr),
            ..self
        }
    }
}

/// A veth pair created directly inside two test namespaces (never in the host's), both ends
/// up and addressed. Deleted on drop (also when the namespaces go away first).
#[derive(Debug)]
pub struct Veth {
    ns: String,
    ifname: String,
}

impl Veth {
    pub fn create(a: VethEnd<'_>, b: VethEnd<'_>) -> anyhow::Result<Veth> {
        for end in [&a, &b] {
            if end.ifname.is_empty() || end.ifname.len() > 15 {
                bail!("veth interface name {:?}: must be 1..=15 bytes", end.ifname);
            }
        }
        if a.ns.name == b.ns.name && a.ifname == b.ifname {
            bail!(
                "veth ends must differ, both are {} in {}",
                a.ifname,
                a.ns.name
            );
        }
        run_checked(Command::new("ip").args([
            "link", "add", a.ifname, "netns", &a.ns.name, "type", "veth", "peer", "name", b.ifname,
            "netns", &b.ns.name,
        ]))?;
        let veth = Veth {
            ns: a.ns.name.clone(),
            ifname: a.ifname.to_string(),
        };
        for end in [a, b] {
            if let Some(cidr) = end.cidr {
                end.ns.ip(&["addr", "add", cidr, "dev", end.ifname])?;
            }
            end.ns.ip(&["link", "set", end.ifname, "up"])?;
        }
        Ok(veth)
    }
}

impl Drop for Veth {
    fn drop(&mut self) {
        // Gone already when its namespace was deleted first: nothing to do then.
        if Path::new(NETNS_DIR).join(&self.ns).exists() {
            let _ =
                run_checked(Command::new("ip").args(["-n", &self.ns, "link", "del", &self.ifname]));
        }
    }
}

/// A private bpffs mounted on a fresh directory under the temp dir; unmounted and removed on
/// drop.
#[derive(Debug)]
pub struct Bpffs {
    dir: PathBuf,
}

/// Whether `dir` is a bpffs mount point.
fn is_bpffs(dir: &Path) -> bool {
    use nix::sys::statfs::{BPF_FS_MAGIC, statfs};
    statfs(dir).is_ok_and(|s| s.filesystem_type() == BPF_FS_MAGIC)
}

impl Bpffs {
    pub fn new(hint: &str) -> anyhow::Result<Bpffs> {
        sweep_stale();
        let dir = std::env::temp_dir().join(unique_name(hint));
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mounted = nix::mount::mount(
            Some("bpf"),
            &dir,
            Some("bpf"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
        if let Err(errno) = mounted {
            let _ = fs::remove_dir(&dir);
            bail!("mount -t bpf bpf {}: {errno}", dir.display());
        }
        Ok(Bpffs { dir })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Names at the top of the bpffs, except the kernel's preloaded `maps.debug`/`progs.debug`.
    pub fn entries(&self) -> anyhow::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in
            fs::read_dir(&self.dir).with_context(|| format!("listing {}", self.dir.display()))?
        {
            let name = entry?.file_name().to_string_lossy().into_owned();
            if !BPFFS_PRELOADED.contains(&name.as_str()) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        if let Err(errno) = nix::mount::umount2(&self.dir, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("warning: unmounting {}: {errno}", self.dir.display());
            return;
        }
        let _ = fs::remove_dir(&self.dir);
    }
}

/// The mount point of the cgroup2 hierarchy in `/proc/self/mountinfo` format text.
pub fn parse_cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        if fs.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let point = mount.split_whitespace().nth(4)?;
        Some(PathBuf::from(unescape_mountinfo(point)))
    })
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where cgroup v2 is mounted for this process (`/sys/fs/cgroup/unified` on hybrid hosts,
/// `/sys/fs/cgroup` on pure v2 ones).
pub fn cgroup2_mount() -> Option<PathBuf> {
    parse_cgroup2_mount(&fs::read_to_string("/proc/self/mountinfo").ok()?)
}

/// A cgroup v2 directory for one test, directly under the cgroup2 mount (never the root
/// cgroup itself). On drop its processes are killed and the directory removed.
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
}

impl TestCgroup {
    pub fn new(hint: &str) -> anyhow::Result<TestCgroup> {
        sweep_stale();
        let root = cgroup2_mount().context("no cgroup2 mount in /proc/self/mountinfo")?;
        let path = root.join(unique_name(hint));
        fs::create_dir(&path).with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(TestCgroup { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves process `pid` into this cgroup.
    pub fn add_pid(&self, pid: u32) -> anyhow::Result<()> {
        fs::write(self.path.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving pid {pid} into {}", self.path.display()))
    }

    /// The pids in this cgroup.
    pub fn procs(&self) -> anyhow::Result<Vec<u32>> {
        let text = fs::read_to_string(self.path.join("cgroup.procs"))
            .with_context(|| format!("reading {}/cgroup.procs", self.path.display()))?;
        Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    /// Makes `cmd`'s process join this cgroup before it execs, so everything it does (its
    /// first `connect` included) happens inside. Combine with [`Netns::command`].
    pub fn enter_on_spawn(&self, cmd: &mut Command) -> anyhow::Result<()> {
        let procs = CString::new(self.path.join("cgroup.procs").as_os_str().as_bytes())
            .context("cgroup path contains NUL")?;
        // SAFETY: the closure only makes async-signal-safe syscalls (open/write/close) on
        // memory prepared before fork; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // "0" means the writing process itself.
                let written = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if written == 1 { Ok(()) } else { Err(err) }
            });
        }
        Ok(())
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // cgroup.kill (>= 5.14) kills every process inside, forks in flight included.
        let kill = self.path.join("cgroup.kill");
        if kill.exists() {
            let _ = fs::write(&kill, "1");
        } else {
            for pid in self.procs().unwrap_or_default() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        // Emptying is asynchronous (exiting processes); rmdir fails with EBUSY until then.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(err) if err.kind() == io::ErrorKind::NotFound => return,
                Err(err) if Instant::now() >= deadline => {
                    eprintln!("warning: removing cgroup {}: {err}", self.path.display());
                    return;
                }
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_runs_bpffs_is_unmounted_and_removed() {
        if !require_root() {
            return;
        }
        // Two private bpffs mounts; the sweep is told the first one's owner is gone.
        let (gone, live) = (
            Bpffs::new("sweep-gone").unwrap(),
            Bpffs::new("sweep-live").unwrap(),
        );
        let gone_name = gone
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let gone_dir = gone.path().to_path_buf();
        std::mem::forget(gone); // as a killed process would: no unmount
        remove_stale(|name| name == gone_name);
        assert!(!gone_dir.exists(), "{} still there", gone_dir.display());
        assert!(is_bpffs(live.path()), "the live run's bpffs was touched");
    }

    #[test]
    fn cgroup2_mount_is_found_on_hybrid_and_pure_v2_hosts() {
        let hybrid = "\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 25 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
37 35 0:32 / /sys/fs/cgroup/systemd rw,nosuid shared:11 - cgroup cgroup rw,xattr,name=systemd
";
        assert_eq!(
            parse_cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let pure =
            "30 24 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            parse_cgroup2_mount(pure),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        let none =
            "37 35 0:32 / /sys/fs/cgroup/systemd rw shared:11 - cgroup cgroup rw,name=systemd\n";
        assert_eq!(parse_cgroup2_mount(none), None);
    }

    #[test]
    fn mountinfo_escapes_are_decoded() {
        let line = "36 35 0:31 / /mnt/my\\040cg rw shared:10 - cgroup2 cgroup2 rw\n";
        assert_eq!(parse_cgroup2_mount(line), Some(PathBuf::from("/mnt/my cg")));
        assert_eq!(unescape_mountinfo("a\\134b\\0"), "a\\b\\0");
    }

    #[test]
    fn unique_names_differ_and_carry_the_pid() {
        let a = unique_name("My Test::case");
        let b = unique_name("My Test::case");
        assert_ne!(a, b);
        assert!(a.starts_with("kp-my-test--case-"), "{a}");
        assert_eq!(owner_pid(&a), Some(std::process::id()));
        assert_eq!(owner_pid("kp-x-notapid-3"), None);
        assert_eq!(owner_pid("other-x-12-3"), None);
        assert!(unique_name(&"x".repeat(100)).len() < 24 + 30);
    }
}
