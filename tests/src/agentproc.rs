//! The real `kproxy` binary as a child process, for tests that run the agent end to end:
//! [`AgentProcess`] (output captured in a log file, polled while it runs, SIGKILLed on drop),
//! a [`ScratchDir`] for its manifests and logs, [`strip_ansi`] for reading its log, and
//! [`http_get`] for its servers inside a network namespace.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{Netns, unique_name};
use crate::topology::kproxy_bin;

/// How long agent tests wait for something the agent should do (a liveness bound, not a
/// performance figure).
pub const LIVENESS: Duration = Duration::from_secs(30);

/// A fresh directory under the temp dir, removed on drop.
pub struct ScratchDir(pub PathBuf);

impl ScratchDir {
    pub fn new(hint: &str) -> anyhow::Result<ScratchDir> {
        let dir = std::env::temp_dir().join(unique_name(hint));
        std::fs::create_dir_all(&dir)?;
        Ok(ScratchDir(dir))
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `text` without terminal colour sequences (`ESC [ … m`).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// An agent process; SIGKILLed (like `kill -9`) and reaped on drop.
pub struct AgentProcess {
    pub child: Child,
    log: PathBuf,
}

impl AgentProcess {
    /// Spawns `cmd` (the agent, or a wrapper that execs it) with stdout and stderr in `log`.
    pub fn spawn(mut cmd: Command, log: PathBuf) -> AgentProcess {
        let f = File::create(&log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f);
        AgentProcess {
            child: cmd.spawn().expect("spawning kproxy"),
            log,
        }
    }

    /// `kproxy ARGS` inside `ns`.
    pub fn start(ns: &Netns, args: &[String], log: PathBuf) -> AgentProcess {
        let mut cmd = ns.command(kproxy_bin().unwrap());
        cmd.args(args);
        Self::spawn(cmd, log)
    }

    /// The log so far, without colour sequences.
    pub fn log(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// Panics (with the log) if the agent exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(st)) = self.child.try_wait() {
            panic!("kproxy exited ({st}):\n{}", self.log());
        }
    }

    /// Polls `f` until it returns `Some`, failing after [`LIVENESS`] or when the agent exits.
    pub fn wait_for<T>(&mut self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + LIVENESS;
        loop {
            self.assert_running();
            if let Some(v) = f() {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; kproxy log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGKILL (no chance to clean up) and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `GET path` from `127.0.0.1:port` inside `ns`: `(status, body)`, or `None` while nothing
/// answers.
pub fn http_get(ns: &Netns, port: u16, path: &str) -> Option<(u16, String)> {
    let path = path.to_string();
    ns.run(move || -> Option<(u16, String)> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let code = out.split_whitespace().nth(1)?.parse().ok()?;
        let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
        Some((code, body))
    })
    .unwrap()
}

#[cfg(test)]
mod tests {
    #[test]
    fn colour_sequences_are_stripped_from_the_agent_log() {
        assert_eq!(
            super::strip_ansi("\u{1b}[2m2026\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m x"),
            "2026 ERROR x"
        );
    }
}
