//! `cargo xtask guest [ARGS…]`: run the IPVS test suite (`tests/tests/ipvs_guest.rs`) inside a
//! QEMU guest that boots Debian's stock kernel, because the host kernel has no IPVS and cannot
//! load modules. `cargo xtask test` runs it after the host suite; ARGS go to the test binary
//! (e.g. a test name filter).
//!
//! Steps (everything lives under `target/guest/`, nothing is installed on the host):
//!
//! 1. **Kernel**: the package `linux-image-amd64` depends on (resolved at run time with
//!    `apt-cache depends`, so Debian point releases are followed) is fetched with
//!    `apt-get download` and unpacked with `dpkg -x` into `target/guest/kernel/<package>/`.
//! 2. **Base initramfs** (cached per kernel and per [`INIT_SCRIPT`]/[`GUEST_MODULES`]): static
//!    busybox as `/init`, the modules of [`GUEST_MODULES`] with their dependencies
//!    (`modprobe -d … -S … --show-depends`), `depmod -b`, `/sbin/modprobe` → busybox so the
//!    kernel's on-demand loads (e.g. an IPVS scheduler) work.
//! 3. **Payload** (built every run): the test binary of the ordinary host build (`cargo test
//!    --workspace --exclude kproxy-ebpf --no-run`, exactly the host suite's selection and
//!    profile, so after its `cargo test` nothing recompiles; a separate static build would
//!    recompile every dependency, ≈ 8 min on 2 cores), a copy of it stripped of debug info, plus the host tools the tests run ([`PAYLOAD_TOOLS`]: `ip`,
//!    `nsenter`, `ipset`, `iptables-legacy`, `ipvsadm`), all with their shared libraries and
//!    the dynamic loader at the paths `ldd` names (the guest runs Debian 12's kernel, the
//!    host is Debian 12, so the host's glibc is the one the binaries are linked against), the
//!    xtables plugins and `/etc/protocols` (ipset resolves `tcp` through it). Appended to the
//!    base archive as a second cpio at a 4-byte aligned offset (512 here).
//! 4. **Boot**: `qemu-system-x86_64 -accel tcg -cpu max` (KVM is tried first when `/dev/kvm`
//!    exists and the verdict is not cached yet; on this machine kind `/dev/kvm` is a nested PVM
//!    device on which a stock kernel does not boot, so the probe falls back to TCG and remembers
//!    that in `target/guest/accel`). The console goes to `target/guest/console.log`, the test
//!    output to a second serial port (`target/guest/output.log`, echoed), and the exit status
//!    through `isa-debug-exit` (qemu exits with `(status << 1) | 1`; a guest that dies without
//!    writing it makes qemu exit 0, which counts as failure).

use std::collections::BTreeSet;
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::process::{display, output, run_step};

/// Kernel modules loaded at guest boot (with their dependencies). Missing ones fail the build
/// of the initramfs with the module's name.
pub const GUEST_MODULES: &[&str] = &[
    "ip_vs",
    "ip_vs_rr",
    "ip_vs_wrr",
    "ip_vs_lc",
    "ip_vs_sh",
    "ip_vs_mh",
    "nf_conntrack",
    "nf_nat",
    "dummy",
    "veth",
    "ip_tables",
    "ip6_tables",
    "ip6table_nat",
    "ip6table_filter",
    "ip6t_REJECT",
    "iptable_nat",
    "iptable_filter",
    "ipt_REJECT",
    "xt_MASQUERADE",
    "xt_mark",
    "xt_comment",
    "xt_addrtype",
    "xt_conntrack",
    "xt_set",
    "xt_ipvs",
    "xt_physdev",
    "ip_set",
    "ip_set_hash_ip",
    "ip_set_hash_ipport",
    "ip_set_hash_ipportip",
    "ip_set_hash_ipportnet",
    "ip_set_hash_net",
    "ip_set_bitmap_port",
];

/// Host programs copied into the payload (with their libraries) for the tests to run.
pub const PAYLOAD_TOOLS: &[&str] = &[
    "/usr/bin/ip",
    "/usr/bin/nsenter",
    "/usr/sbin/ipset",
    "/usr/sbin/xtables-legacy-multi",
    "/usr/sbin/ipvsadm",
];

/// Where the xtables plugins live (copied whole: iptables loads them by match/target name).
const XTABLES_DIR: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// The test target run in the guest.
pub const GUEST_TEST: &str = "ipvs_guest";

/// Set in the guest for the test binary: the tests run for real only when they see it (or
/// when the host itself has IPVS).
pub const IN_GUEST_ENV: &str = "KPROXY_IN_GUEST";

/// The guest's `/init` (busybox sh). `@MODULES@` is replaced by [`GUEST_MODULES`].
const INIT_SCRIPT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /run /tmp /var
ln -s /run /var/run
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
echo "kproxy-guest: init reached at $(cut -d' ' -f1 /proc/uptime) s" > /dev/ttyS1
for m in @MODULES@; do
  modprobe "$m" || echo "kproxy-guest: modprobe $m failed" > /dev/ttyS1
done
ip link set lo up
start=$(cut -d' ' -f1 /proc/uptime)
cd /payload
sh /payload/run.sh > /dev/ttyS1 2>&1
rc=$?
echo "kproxy-guest: payload exited $rc after $start .. $(cut -d' ' -f1 /proc/uptime) s (guest clock)" > /dev/ttyS1
[ "$rc" -gt 127 ] && rc=127
printf "\\$(printf %03o "$rc")" | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
poweroff -f
"#;

/// Marker the init script prints first on the output port (the KVM probe waits for it).
const INIT_MARKER: &str = "kproxy-guest: init reached";

/// What one guest run measured.
#[derive(Debug)]
pub struct GuestOutcome {
    pub passed: bool,
    /// qemu start → `/init` reached (seen on the output port).
    pub boot: Option<Duration>,
    /// qemu start → qemu exit.
    pub total: Duration,
    pub accel: &'static str,
}

/// `cargo xtask guest [ARGS…]`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Arguments for the guest's test binary, as given (e.g. a test name filter).
    #[arg(allow_hyphen_values = true, value_name = "ARGS")]
    args: Vec<String>,
    /// What follows a leading `--` (clap takes that `--` as its own).
    #[arg(last = true, hide = true)]
    after_dashes: Vec<String>,
}

impl Args {
    /// The arguments as given on the command line.
    pub fn test_args(&self) -> Vec<String> {
        crate::rejoin(&self.args, &self.after_dashes)
    }
}

pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let outcome = run_suite(&args.test_args())?;
    Ok(if outcome.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Builds everything, boots the guest, prints its output and timings.
pub fn run_suite(args: &[String]) -> anyhow::Result<GuestOutcome> {
    let root = crate::workspace_root();
    let test_bin = build_test(&root)?;
    // The payload keeps the file's name (cargo's `ipvs_guest-<hash>`).
    let name = test_bin
        .file_name()
        .context("test binary without a name")?
        .to_string_lossy()
        .into_owned();
    let quoted: Vec<String> = args.iter().map(|a| shell_quote(a)).collect();
    let script = format!(
        "export {IN_GUEST_ENV}=1 KPROXY_TESTS_REQUIRE_KERNEL=1 RUST_BACKTRACE=1\n\
         exec /payload/{name} --include-ignored --test-threads=1 {}\n",
        quoted.join(" ")
    );
    let (outcome, _) = run_payload(&[test_bin], &script)?;
    Ok(outcome)
}

/// Boots the guest with `files` copied into `/payload/` (stripped of debug info, with their
/// shared libraries) beside the [`PAYLOAD_TOOLS`], running `script` as `/payload/run.sh`;
/// prints its output and timings and returns them (the output port's text too).
/// `cargo xtask bench --ipvs-guest` uses it for the benchmark binaries.
pub fn run_payload(files: &[PathBuf], script: &str) -> anyhow::Result<(GuestOutcome, String)> {
    let root = crate::workspace_root();
    let work = root.join("target/guest");
    fs::create_dir_all(&work)?;
    let kernel = Kernel::ensure(&work.join("kernel"))?;
    let base = base_initramfs(&work, &kernel)?;
    let payload = payload_cpio(&work, files, script)?;
    let initrd = work.join("initrd.img");
    concat_aligned(&base, &payload, &initrd)?;
    let outcome = boot(&work, &kernel, &initrd)?;
    println!(
        "guest: {} ({}): boot to /init {}, whole run {:.1} s",
        if outcome.passed { "PASSED" } else { "FAILED" },
        outcome.accel,
        outcome.boot.map_or("not reached".to_string(), |b| format!(
            "{:.1} s",
            b.as_secs_f64()
        )),
        outcome.total.as_secs_f64()
    );
    let output = fs::read_to_string(work.join("output.log")).unwrap_or_default();
    Ok((outcome, output))
}

/// `cargo test --no-run` with exactly the host suite's selection, profile and environment
/// ([`crate::test`]), so it is fresh after that suite ran; returns [`GUEST_TEST`]'s executable.
/// Not `--test` [`GUEST_TEST`] nor `-p kproxy-tests`: a narrower selection leaves other
/// targets' dev-dependencies out of feature unification, which changes the hash of `kproxy`,
/// `kproxy-tests` and the test binary and recompiles them (measured: 25 s here).
fn build_test(root: &Path) -> anyhow::Result<PathBuf> {
    let mut cmd = crate::process::cargo();
    cmd.arg("test")
        .args(crate::test::HOST_PACKAGES)
        .args(["--no-run", "--message-format=json-render-diagnostics"])
        .current_dir(root)
        .stderr(Stdio::inherit());
    println!("guest: $ {}", display(&cmd));
    let out = cmd.output().context("spawning cargo")?;
    if !out.status.success() {
        bail!("building the {GUEST_TEST} test binary failed");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in stdout.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact"
            && msg["target"]["name"] == GUEST_TEST
            && let Some(exe) = msg["executable"].as_str()
        {
            return Ok(PathBuf::from(exe));
        }
    }
    bail!("cargo built {GUEST_TEST} but reported no executable")
}

/// An unpacked Debian kernel package.
pub struct Kernel {
    /// e.g. `6.1.0-56-amd64`.
    pub version: String,
    /// The `dpkg -x` root (holds `boot/` and `lib/modules/`).
    pub root: PathBuf,
}

impl Kernel {
    /// Resolves `linux-image-amd64`'s dependency and unpacks it into `cache` unless present.
    pub fn ensure(cache: &Path) -> anyhow::Result<Kernel> {
        let deps = output(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))
            .context("`apt-cache depends linux-image-amd64` failed (is this Debian?)")?;
        let package = parse_kernel_dependency(&deps).with_context(|| {
            format!("no linux-image-* dependency in `apt-cache depends linux-image-amd64`:\n{deps}")
        })?;
        let version = package.trim_start_matches("linux-image-").to_string();
        let root = cache.join(&package);
        let done = root.join(".complete");
        if !done.exists() {
            let dl = cache.join("download");
            let _ = fs::remove_dir_all(&dl);
            let _ = fs::remove_dir_all(&root);
            fs::create_dir_all(&dl)?;
            run_step(
                "guest",
                Command::new("apt-get")
                    .args(["download", &package])
                    .current_dir(&dl),
            )
            .with_context(|| format!("downloading {package} (try `apt-get update`)"))?;
            let deb = fs::read_dir(&dl)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| p.extension().is_some_and(|x| x == "deb"))
                .context("apt-get download produced no .deb")?;
            fs::create_dir_all(&root)?;
            run_step("guest", Command::new("dpkg").arg("-x").arg(&deb).arg(&root))?;
            // The package ships no modules.dep (its postinst makes it): resolve dependencies.
            run_step(
                "guest",
                Command::new("depmod").arg("-b").arg(&root).arg(&version),
            )?;
            fs::remove_dir_all(&dl)?;
            fs::write(&done, "")?;
        }
        let kernel = Kernel { version, root };
        if !kernel.vmlinuz().exists() {
            bail!(
                "{} is missing from the unpacked package",
                kernel.vmlinuz().display()
            );
        }
        Ok(kernel)
    }
    pub fn vmlinuz(&self) -> PathBuf {
        self.root.join(format!("boot/vmlinuz-{}", self.version))
    }
    fn modules_dir(&self) -> PathBuf {
        self.root.join("lib/modules").join(&self.version)
    }
}

/// The `Depends: linux-image-…` line of `apt-cache depends linux-image-amd64`.
fn parse_kernel_dependency(deps: &str) -> Option<String> {
    deps.lines().find_map(|l| {
        let name = l.trim().strip_prefix("Depends:")?.trim();
        (name.starts_with("linux-image-") && !name.starts_with('<')).then(|| name.to_string())
    })
}

/// Builds (or reuses) the busybox + modules initramfs for `kernel`.
fn base_initramfs(work: &Path, kernel: &Kernel) -> anyhow::Result<PathBuf> {
    let init = INIT_SCRIPT.replace("@MODULES@", &GUEST_MODULES.join(" "));
    let key = fnv1a(format!("{}\n{init}", kernel.version).as_bytes());
    let out = work.join(format!("base-{}-{key:016x}.cpio", kernel.version));
    if out.exists() {
        return Ok(out);
    }
    let busybox = Path::new("/bin/busybox");
    let ldd = Command::new("ldd").arg(busybox).output();
    let dynamic = ldd.is_ok_and(|o| o.status.success());
    if !busybox.exists() || dynamic {
        bail!("a static /bin/busybox is needed (apt-get install busybox-static)");
    }
    let stage = work.join("base-stage");
    let _ = fs::remove_dir_all(&stage);
    for dir in [
        "bin",
        "sbin",
        "proc",
        "sys",
        "dev",
        "run",
        "tmp",
        "payload",
        "lib/modules",
    ] {
        fs::create_dir_all(stage.join(dir))?;
    }
    fs::copy(busybox, stage.join("bin/busybox"))?;
    std::os::unix::fs::symlink("/bin/busybox", stage.join("sbin/modprobe"))?;
    write_executable(&stage.join("init"), &init)?;

    // Modules with dependencies, as the host's kmod resolves them against the guest kernel.
    let mut files = BTreeSet::new();
    let kroot = kernel.root.to_str().context("non-UTF-8 cache path")?;
    for module in GUEST_MODULES {
        let deps = Command::new("modprobe")
            .args(["-d", kroot, "-S", &kernel.version, "--show-depends", module])
            .output()
            .context("spawning modprobe (apt-get install kmod)")?;
        if !deps.status.success() {
            bail!(
                "kernel {} has no module {module}: {}",
                kernel.version,
                String::from_utf8_lossy(&deps.stderr).trim()
            );
        }
        for line in String::from_utf8_lossy(&deps.stdout).lines() {
            // `insmod /path/x.ko [params]`; built-in modules print `builtin x`.
            if let Some(rest) = line.strip_prefix("insmod ") {
                let path = rest.split_whitespace().next().unwrap_or_default();
                files.insert(PathBuf::from(path));
            }
        }
    }
    let mods_src = kernel.modules_dir();
    let mods_dst = stage.join("lib/modules").join(&kernel.version);
    for file in &files {
        let rel = file
            .strip_prefix(&mods_src)
            .with_context(|| format!("{} is outside {}", file.display(), mods_src.display()))?;
        let dst = mods_dst.join(rel);
        fs::create_dir_all(dst.parent().expect("module path has a parent"))?;
        fs::copy(file, &dst).with_context(|| format!("copying {}", file.display()))?;
    }
    for meta in [
        "modules.order",
        "modules.builtin",
        "modules.builtin.modinfo",
    ] {
        let src = mods_src.join(meta);
        if src.exists() {
            fs::copy(&src, mods_dst.join(meta))?;
        }
    }
    run_step(
        "guest",
        Command::new("depmod")
            .arg("-b")
            .arg(&stage)
            .arg(&kernel.version),
    )?;
    println!("guest: initramfs holds {} module files", files.len());
    // Archives of older kernels or init scripts.
    for entry in fs::read_dir(work)? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with("base-") && name.ends_with(".cpio") {
            fs::remove_file(&path)?;
        }
    }
    let tmp = out.with_extension("tmp");
    write_cpio(&stage, &tmp)?;
    fs::rename(&tmp, &out)?;
    fs::remove_dir_all(&stage)?;
    Ok(out)
}

/// `files` (into `/payload/`), the tools with their libraries, and `/payload/run.sh`.
fn payload_cpio(work: &Path, files: &[PathBuf], script: &str) -> anyhow::Result<PathBuf> {
    let stage = work.join("payload-stage");
    let _ = fs::remove_dir_all(&stage);
    fs::create_dir_all(stage.join("payload"))?;
    let mut libs: BTreeSet<PathBuf> = BTreeSet::new();
    for file in files {
        // A copy: the one in target/ keeps its debug info (and cargo's freshness).
        let bin = stage
            .join("payload")
            .join(file.file_name().context("payload file without a name")?);
        fs::copy(file, &bin).with_context(|| format!("copying {}", file.display()))?;
        // Debug info is ≈ 90 % of a test binary and the guest loads the initrd slowly under
        // TCG; panic locations survive (they are not debug info), only backtraces lose lines.
        match Command::new("strip")
            .arg("--strip-debug")
            .arg(&bin)
            .status()
        {
            Ok(s) if s.success() => {}
            other => {
                println!("guest: strip --strip-debug failed ({other:?}); using the full binary")
            }
        }
        // Dynamically linked: its libraries and loader (PT_INTERP) come along.
        libs.extend(shared_libraries(file)?);
    }
    for tool in PAYLOAD_TOOLS {
        copy_into(&stage, Path::new(tool))?;
        libs.extend(shared_libraries(Path::new(tool))?);
    }
    for entry in fs::read_dir(XTABLES_DIR).with_context(|| format!("reading {XTABLES_DIR}"))? {
        let path = entry?.path();
        copy_into(&stage, &path)?;
        libs.extend(shared_libraries(&path)?);
    }
    for lib in &libs {
        copy_into(&stage, lib)?;
    }
    // ipset and iptables resolve protocol names (`tcp`) through it.
    copy_into(&stage, Path::new("/etc/protocols"))?;
    // The agent's API client (rustls) refuses to start without a system CA store, even for
    // a plain-HTTP API server (the benchmarks' fake one).
    let ca = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if ca.exists() {
        copy_into(&stage, ca)?;
    }
    // The names the tests call.
    let sbin = stage.join("usr/sbin");
    for link in [
        "iptables",
        "iptables-save",
        "iptables-restore",
        "ip6tables",
        "ip6tables-save",
        "ip6tables-restore",
    ] {
        let legacy = link.replacen("tables", "tables-legacy", 1);
        for name in [link.to_string(), legacy] {
            let _ = fs::remove_file(sbin.join(&name));
            std::os::unix::fs::symlink("xtables-legacy-multi", sbin.join(name))?;
        }
    }
    write_executable(&stage.join("payload/run.sh"), script)?;
    let out = work.join("payload.cpio");
    write_cpio(&stage, &out)?;
    fs::remove_dir_all(&stage)?;
    Ok(out)
}

/// Copies `src` (resolving symlinks) to the same absolute path under `stage`.
fn copy_into(stage: &Path, src: &Path) -> anyhow::Result<()> {
    let rel = src.strip_prefix("/").unwrap_or(src);
    let dst = stage.join(rel);
    if dst.exists() {
        return Ok(());
    }
    fs::create_dir_all(dst.parent().expect("absolute path has a parent"))?;
    fs::copy(src, &dst).with_context(|| format!("copying {}", src.display()))?;
    Ok(())
}

/// The absolute library paths `ldd` lists for `bin` (the loader included; none for a static
/// binary). A library `ldd` cannot find is an error naming it.
fn shared_libraries(bin: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .context("spawning ldd")?;
    parse_ldd(&String::from_utf8_lossy(&out.stdout))
        .with_context(|| format!("resolving the shared libraries of {}", bin.display()))
}

/// `ldd` output → absolute paths: `libx.so => /lib/x/libx.so (0x…)` or
/// `/lib64/ld-linux-x86-64.so.2 (0x…)`; `linux-vdso.so.1 (0x…)` is the kernel's.
fn parse_ldd(text: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for line in text.lines() {
        let (name, target) = match line.split_once("=>") {
            Some((name, target)) => (name.trim(), target.trim()),
            None => (line.trim(), line.trim()),
        };
        if target.starts_with("not found") {
            bail!("{name} not found");
        }
        if let Some(path) = target.split_whitespace().next()
            && path.starts_with('/')
        {
            paths.push(PathBuf::from(path));
        }
    }
    Ok(paths)
}

/// `find . | cpio -o -H newc` of `dir` into `out`.
fn write_cpio(dir: &Path, out: &Path) -> anyhow::Result<()> {
    let file = fs::File::create(out)?;
    let status = Command::new("sh")
        .args([
            "-c",
            "find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet",
        ])
        .current_dir(dir)
        .stdout(file)
        .status()
        .context("spawning cpio (apt-get install cpio)")?;
    if !status.success() {
        bail!("cpio of {} failed ({status})", dir.display());
    }
    Ok(())
}

/// `base` padded to a multiple of 512 bytes, then `payload`: the kernel unpacks both.
fn concat_aligned(base: &Path, payload: &Path, out: &Path) -> anyhow::Result<()> {
    let mut data = fs::read(base)?;
    data.resize(data.len().next_multiple_of(512), 0);
    data.extend(fs::read(payload)?);
    fs::write(out, data)?;
    Ok(())
}

fn write_executable(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::write(path, text)?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A whole run may take this long before qemu is killed (TCG is ≈5× slower than the host).
const RUN_TIMEOUT: Duration = Duration::from_secs(900);
/// KVM must reach `/init` within this long, else it is given up for TCG.
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(30);

fn boot(work: &Path, kernel: &Kernel, initrd: &Path) -> anyhow::Result<GuestOutcome> {
    let verdict_file = work.join(format!("accel-{}", kernel.version));
    let cached = fs::read_to_string(&verdict_file).unwrap_or_default();
    let try_kvm = Path::new("/dev/kvm").exists() && cached.trim() != "tcg";
    if try_kvm {
        match boot_with(work, kernel, initrd, "kvm", Some(KVM_PROBE_TIMEOUT))? {
            Some(outcome) => {
                fs::write(&verdict_file, "kvm")?;
                return Ok(outcome);
            }
            None => {
                println!("guest: KVM did not boot the guest; using TCG from now on");
                fs::write(&verdict_file, "tcg")?;
            }
        }
    }
    boot_with(work, kernel, initrd, "tcg", None)?
        .context("the guest did not reach /init under TCG (see target/guest/console.log)")
}

/// Boots once. With `probe`, returns `None` when `/init` is not reached within it.
fn boot_with(
    work: &Path,
    kernel: &Kernel,
    initrd: &Path,
    accel: &'static str,
    probe: Option<Duration>,
) -> anyhow::Result<Option<GuestOutcome>> {
    let console = work.join("console.log");
    let out = work.join("output.log");
    fs::write(&out, "")?;
    let mut cmd = Command::new("qemu-system-x86_64");
    match accel {
        "kvm" => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        _ => cmd.args(["-accel", "tcg", "-cpu", "max"]),
    };
    cmd.args([
        "-m",
        "1024",
        "-smp",
        "1",
        "-nodefaults",
        "-display",
        "none",
        "-no-reboot",
    ])
    .args(["-net", "none"])
    .arg("-kernel")
    .arg(kernel.vmlinuz())
    .arg("-initrd")
    .arg(initrd)
    .args(["-append", "console=ttyS0 panic=-1 quiet loglevel=4"])
    .arg("-serial")
    .arg(format!("file:{}", console.display()))
    .arg("-serial")
    .arg(format!("file:{}", out.display()))
    .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=4"])
    .stdin(Stdio::null());
    println!("guest: $ {}", display(&cmd));
    let start = Instant::now();
    let mut child = cmd.spawn().context("spawning qemu-system-x86_64")?;
    let mut boot = None;
    let mut printed = 0;
    let status = loop {
        let text = fs::read(&out).unwrap_or_default();
        if text.len() > printed {
            std::io::stdout().write_all(&text[printed..])?;
            printed = text.len();
        }
        if boot.is_none() && String::from_utf8_lossy(&text).contains(INIT_MARKER) {
            boot = Some(start.elapsed());
        }
        if let Some(status) = child.try_wait()? {
            let text = fs::read(&out).unwrap_or_default();
            std::io::stdout().write_all(&text[printed.min(text.len())..])?;
            if boot.is_none() && String::from_utf8_lossy(&text).contains(INIT_MARKER) {
                boot = Some(start.elapsed());
            }
            break status;
        }
        if let Some(limit) = probe
            && boot.is_none()
            && start.elapsed() > limit
        {
            kill(&mut child);
            return Ok(None);
        }
        if start.elapsed() > RUN_TIMEOUT {
            kill(&mut child);
            bail!("the guest ran longer than {RUN_TIMEOUT:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let total = start.elapsed();
    if probe.is_some() && boot.is_none() {
        return Ok(None);
    }
    // isa-debug-exit: qemu's status is (guest status << 1) | 1.
    let passed = status.code() == Some(1);
    if !passed {
        println!(
            "guest: qemu exited with {status} (guest status {}); console: {}",
            status
                .code()
                .map_or("none".into(), |c| (c >> 1).to_string()),
            console.display()
        );
    }
    Ok(Some(GuestOutcome {
        passed,
        boot,
        total,
        accel,
    }))
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_the_kernel_package_from_apt_cache_output() {
        let deps = "linux-image-amd64\n  Depends: linux-image-6.1.0-56-amd64\n";
        assert_eq!(
            parse_kernel_dependency(deps).as_deref(),
            Some("linux-image-6.1.0-56-amd64")
        );
        assert_eq!(parse_kernel_dependency("linux-image-amd64\n"), None);
    }

    #[test]
    fn ldd_output_gives_libraries_and_loader_and_rejects_missing_ones() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f1)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f3)\n";
        assert_eq!(
            parse_ldd(out).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
        assert!(
            parse_ldd("\tnot a dynamic executable\n")
                .unwrap()
                .is_empty()
        );
        let err = parse_ldd("\tlibfoo.so.1 => not found\n").unwrap_err();
        assert_eq!(err.to_string(), "libfoo.so.1 not found");
    }

    #[test]
    fn init_script_reports_status_through_the_debug_exit_port() {
        assert!(INIT_SCRIPT.contains("seek=244"), "0xf4 = 244");
        assert!(INIT_SCRIPT.contains(INIT_MARKER));
    }
}
