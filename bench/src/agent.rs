//! The agent under measurement: the real `kproxy` binary, started inside the topology's node
//! namespace in one mode, with its log captured so a mode that cannot run is reported with the
//! agent's own words.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;

pub use kproxy_tests::agentproc::{ScratchDir, strip_ansi};
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup};
use kproxy_tests::topology::{NODE_CLIENT_IF, Probe, kproxy_bin, target_bin};

use super::services::NODE_NAME;

/// Where the agent reads the cluster state from.
#[derive(Debug, Clone)]
pub enum Source {
    Manifests(PathBuf),
    Kubeconfig(PathBuf),
}

/// A `kproxy` process in the node namespace; killed on drop.
pub struct RunningAgent {
    child: Child,
    /// Wall clock just before exec.
    pub started: SystemTime,
    log: PathBuf,
}

/// The agent's `--proxy-mode` for a benchmark mode name: `iptables-nft` and `iptables-legacy`
/// are the iptables mode on one backend each.
pub fn proxy_mode(mode: &str) -> &str {
    match mode {
        "iptables-nft" | "iptables-legacy" => "iptables",
        m => m,
    }
}

/// The iptables backend (`nft` / `legacy`) a benchmark mode runs on, if it names one.
pub fn iptables_backend(mode: &str) -> Option<&'static str> {
    match mode {
        "iptables-nft" => Some("nft"),
        "iptables-legacy" => Some("legacy"),
        _ => None,
    }
}

/// Makes the agent pick `backend` the way it (like upstream's iptables-wrapper) detects it in
/// a real node: kubelet's hint chain `KUBE-IPTABLES-HINT` in the mangle table of that backend,
/// created in the node namespace before the agent starts. No agent flag is involved.
pub fn plant_backend_hint(node: &Netns, backend: &str) -> anyhow::Result<()> {
    let mut cmd = node.command(format!("iptables-{backend}"));
    // The legacy lock, /run/xtables.lock, is the host's (every network namespace shares it):
    // another iptables-legacy user on the machine held it > 5 s during a quick run. A
    // liveness bound, not a timing.
    cmd.args(["-w", "60", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"]);
    kproxy_tests::netns::run_checked(&mut cmd)
        .with_context(|| format!("hint chain in iptables-{backend}"))?;
    Ok(())
}

/// Fails unless the agent programmed its service chains into `backend` and none into the
/// other one (the bench measures the backend it claims to).
pub fn check_backend(node: &Netns, backend: &str) -> anyhow::Result<()> {
    let has_services = |b: &str| -> anyhow::Result<bool> {
        let mut cmd = node.command(format!("iptables-{b}-save"));
        cmd.args(["-t", "nat"]);
        let out = kproxy_tests::netns::run_checked(&mut cmd)?;
        Ok(out.lines().any(|l| l.starts_with(":KUBE-SERVICES ")))
    };
    let other = if backend == "nft" { "legacy" } else { "nft" };
    anyhow::ensure!(
        has_services(backend)? && !has_services(other)?,
        "the agent did not program iptables-{backend} alone (hint chain not honoured)"
    );
    Ok(())
}

/// How the agent of `mode` is started (mode-specific flags included).
pub struct AgentSpec<'a> {
    /// Benchmark mode: `ebpf`, `ipvs`, `iptables-nft`, `iptables-legacy`.
    pub mode: &'a str,
    pub node: &'a Netns,
    pub source: Source,
    /// Socket-LB cgroup (ebpf).
    pub cgroup: Option<&'a TestCgroup>,
    /// Private bpffs (ebpf).
    pub bpffs: Option<&'a Bpffs>,
    /// Where the log goes.
    pub log: PathBuf,
}

impl AgentSpec<'_> {
    /// The agent's command line (after the binary).
    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            format!("--proxy-mode={}", proxy_mode(self.mode)),
            format!("--hostname-override={NODE_NAME}"),
            // Programming delay is what is measured: no rate limit between syncs.
            "--min-sync-period=0s".into(),
            "--iptables-min-sync-period=0s".into(),
            "--ipvs-min-sync-period=0s".into(),
        ];
        match &self.source {
            Source::Manifests(p) => a.push(format!("--manifests={}", p.display())),
            Source::Kubeconfig(p) => a.push(format!("--kubeconfig={}", p.display())),
        }
        if let Some(cg) = self.cgroup {
            a.push(format!("--bpf-cgroup={}", cg.path().display()));
        }
        if let Some(fs) = self.bpffs {
            a.push(format!("--bpffs={}", fs.path().display()));
        }
        if self.mode == "ebpf" {
            a.push(format!("--bpf-devices={NODE_CLIENT_IF}"));
        }
        a
    }

    pub fn start(&self) -> anyhow::Result<RunningAgent> {
        self.start_with(self.args())
    }

    /// Starts the agent with `args` (e.g. [`AgentSpec::args`] with some replaced) instead of
    /// [`AgentSpec::args`].
    pub fn start_with(&self, args: Vec<String>) -> anyhow::Result<RunningAgent> {
        if let Some(backend) = iptables_backend(self.mode) {
            plant_backend_hint(self.node, backend)?;
        }
        let log =
            File::create(&self.log).with_context(|| format!("creating {}", self.log.display()))?;
        let mut cmd = self.node.command(kproxy_bin()?);
        if self.mode == "nftables" {
            // nftables.minSyncPeriod has no flag (as upstream), and 0 in the file means the 1 s
            // default (upstream defaulting): 1ns is no rate limit. The dump gives the floors.
            let config = self.log.with_file_name("nftables-config.yaml");
            std::fs::write(
                &config,
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                 nftables:\n  minSyncPeriod: 1ns\n",
            )?;
            cmd.arg(format!("--config={}", config.display()));
            let dump = super::nftables::dump_dir(&self.log);
            std::fs::create_dir_all(&dump)?;
            cmd.env(kproxy::dataplane::nftables::kernel::DUMP_DIR_ENV, &dump);
        }
        cmd.args(args)
            .env(
                "RUST_LOG",
                std::env::var("KP_BENCH_AGENT_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let started = SystemTime::now();
        // nsenter execs the agent in place: the pid is the agent's.
        let child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
        Ok(RunningAgent {
            child,
            started,
            log: self.log.clone(),
        })
    }
}

impl RunningAgent {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Err(log tail)` when the agent has exited.
    pub fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!("agent exited ({status}): {}", self.log_tail())),
            Err(e) => Err(format!("agent state unknown: {e}")),
        }
    }

    /// The last lines of the agent's log.
    pub fn log_tail(&self) -> String {
        let text = strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default());
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    /// Peak resident set size (VmHWM) in MB.
    pub fn peak_rss_mb(&self) -> anyhow::Result<f64> {
        status_mb(self.pid(), "VmHWM")
    }

    /// Resident set size now (VmRSS) in MB.
    pub fn rss_mb(&self) -> anyhow::Result<f64> {
        status_mb(self.pid(), "VmRSS")
    }

    /// Open file descriptors now.
    pub fn fds(&self) -> anyhow::Result<usize> {
        Ok(std::fs::read_dir(format!("/proc/{}/fd", self.pid()))?.count())
    }

    /// User + system CPU seconds so far.
    pub fn cpu_seconds(&self) -> anyhow::Result<f64> {
        Ok(self.cpu_and_children_seconds()?.0)
    }

    /// User + system CPU seconds of the agent's children it waited for (`nft`,
    /// `iptables-restore`, …).
    pub fn children_cpu_seconds(&self) -> anyhow::Result<f64> {
        Ok(self.cpu_and_children_seconds()?.1)
    }

    /// [`Self::cpu_seconds`] and [`Self::children_cpu_seconds`] from one read of
    /// `/proc/<pid>/stat`.
    fn cpu_and_children_seconds(&self) -> anyhow::Result<(f64, f64)> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))?;
        // Fields after the parenthesised command: state is field 3; utime 14, stime 15,
        // cutime 16, cstime 17.
        let rest = stat.rsplit_once(')').context("bad /proc/pid/stat")?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| -> anyhow::Result<f64> {
            f.get(i)
                .context("short /proc/pid/stat")?
                .parse::<f64>()
                .map_err(Into::into)
        };
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Ok((
            (field(11)? + field(12)?) / hz,
            (field(13)? + field(14)?) / hz,
        ))
    }

    /// Waits until the agent has settled after its syncs: two consecutive half-second
    /// intervals in which it and its children (`nft`, `iptables-restore`) used under 20 ms of
    /// CPU, or `timeout`. A latency measured while the agent still works (an nftables agent's
    /// follow-up syncs after its first, at 10k services) measures the contention for the
    /// 2 cores, not the datapath. Returns whether it settled.
    pub fn wait_settled(&self, timeout: Duration) -> anyhow::Result<bool> {
        let deadline = std::time::Instant::now() + timeout;
        let used = || -> anyhow::Result<f64> {
            let (own, children) = self.cpu_and_children_seconds()?;
            Ok(own + children)
        };
        let (mut last, mut quiet) = (used()?, 0);
        while std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(500));
            let now = used()?;
            quiet = if now - last < 0.02 { quiet + 1 } else { 0 };
            if quiet == 2 {
                return Ok(true);
            }
            last = now;
        }
        Ok(false)
    }

    /// Waits until `addr` answers from `client` (inside `cgroup` when given), by `name` when
    /// given; returns the wall clock of the first answer. Fails with the agent's log as soon as
    /// the agent exits, or at `timeout`.
    pub fn wait_answer(
        &mut self,
        client: &Netns,
        cgroup: Option<&TestCgroup>,
        addr: &str,
        name: Option<&str>,
        timeout: Duration,
    ) -> Result<SystemTime, String> {
        let deadline = std::time::Instant::now() + timeout;
        // Short rounds of `kp-probe wait`, checking in between that the agent still runs.
        const ROUND: Duration = Duration::from_secs(2);
        loop {
            self.check_alive()?;
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "{addr} did not answer within {timeout:?}; agent log: {}",
                    self.log_tail()
                ));
            }
            let round = left.min(ROUND);
            let mut cmd = client.command(target_bin("kp-probe").map_err(|e| e.to_string())?);
            cmd.args(["wait", addr, "--timeout-ms", &round.as_millis().to_string()]);
            if let Some(n) = name {
                cmd.args(["--name", n]);
            }
            if let Some(cg) = cgroup {
                cg.enter_on_spawn(&mut cmd).map_err(|e| e.to_string())?;
            }
            let out = cmd.output().map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&out.stdout);
            let v: serde_json::Value = serde_json::from_str(text.trim())
                .map_err(|e| format!("kp-probe wait said {text:?}: {e}"))?;
            if let Some(ns) = v.get("at_unix_ns").and_then(|t| t.as_u64()) {
                return Ok(SystemTime::UNIX_EPOCH + Duration::from_nanos(ns));
            }
        }
    }
}

/// A `kp-probe wait` already polling (every millisecond) for `name` behind an address, started
/// before the change it waits for so that process start-up is not part of the measured delay.
pub struct Waiter {
    child: Child,
}

impl Waiter {
    /// Starts polling `addr` from `client` (inside `cgroup` when given) until `name` answers or
    /// `timeout`; returns once the poller runs (its process image is `kp-probe`).
    pub fn start(
        client: &Netns,
        cgroup: Option<&TestCgroup>,
        addr: &str,
        name: &str,
        timeout: Duration,
    ) -> anyhow::Result<Waiter> {
        let mut cmd = client.command(target_bin("kp-probe")?);
        cmd.args(["wait", addr, "--name", name, "--interval-ms", "1"])
            .args(["--timeout-ms", &timeout.as_millis().to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(cg) = cgroup {
            cg.enter_on_spawn(&mut cmd)?;
        }
        let child = cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?;
        let waiter = Waiter { child };
        // nsenter execs kp-probe in place: once the image is kp-probe, it is polling (give its
        // first connect a moment).
        let comm = format!("/proc/{}/comm", waiter.child.id());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(&comm).unwrap_or_default().trim() != "kp-probe" {
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "kp-probe wait did not start within 10 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        Ok(waiter)
    }

    /// The wall clock of the first answer from the awaited name.
    pub fn finish(self) -> anyhow::Result<SystemTime> {
        let out = self.child.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(text.trim())
            .with_context(|| format!("kp-probe wait said {text:?}"))?;
        let ns = v
            .get("at_unix_ns")
            .and_then(|t| t.as_u64())
            .with_context(|| format!("no answer: {text}"))?;
        Ok(SystemTime::UNIX_EPOCH + Duration::from_nanos(ns))
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `probe` and fails unless it got answers only (for sanity checks before measuring).
pub fn check_reachable(
    probe: &Probe,
    ns: &Netns,
    cgroup: Option<&TestCgroup>,
) -> Result<(), String> {
    let r = probe.run(ns, cgroup).map_err(|e| e.to_string())?;
    if r.total_errors() > 0 || r.total_answers() == 0 {
        return Err(format!("{} is not reachable: {r:?}", probe.addr));
    }
    Ok(())
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmHWM`) in MB.
pub fn status_mb(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .with_context(|| format!("no {field} in /proc/{pid}/status"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kb / 1024.0)
}
