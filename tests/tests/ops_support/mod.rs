//! Helpers shared by the agent-process tests of `agent_node_cidr.rs` and `inspect_api.rs`:
//! the agent binary as a child process, a scratch directory, a fake API server listening
//! inside a network namespace (so an agent in that namespace reaches it on 127.0.0.1), and
//! plain HTTP GETs into a namespace.

#![allow(dead_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kproxy_tests::fakeapi::FakeApi;
use kproxy_tests::netns::{Netns, unique_name};
use kproxy_tests::topology::kproxy_bin;

pub const LIVENESS: Duration = Duration::from_secs(30);

/// A temporary directory, removed on drop.
pub struct Scratch(pub PathBuf);
impl Scratch {
    pub fn new(hint: &str) -> Scratch {
        let d = std::env::temp_dir().join(unique_name(hint));
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in s.chars() {
        match (esc, c) {
            (false, '\u{1b}') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

/// The agent binary running inside `ns`; killed on drop.
pub struct Agent {
    pub child: Child,
    log: PathBuf,
}

impl Agent {
    pub fn start(ns: &Netns, args: &[String], log: PathBuf) -> Agent {
        let f = File::create(&log).unwrap();
        let mut cmd = ns.command(kproxy_bin().unwrap());
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f);
        Agent {
            child: cmd.spawn().expect("spawning kproxy"),
            log,
        }
    }
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
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fake API server listening on 127.0.0.1 inside a network namespace, served by a
/// current-thread runtime on a thread of that namespace. Stopped on drop.
pub struct NsFakeApi {
    pub api: FakeApi,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl NsFakeApi {
    pub fn start(ns: &Netns) -> NsFakeApi {
        let (api_tx, api_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = ns
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let api = FakeApi::start().await.unwrap();
                    api_tx.send(api.clone()).unwrap();
                    let _ = stopped.await;
                    api.stop().await;
                });
            })
            .unwrap();
        let api = api_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        NsFakeApi {
            api,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Writes a kubeconfig pointing at the server (reachable from inside the namespace).
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        self.api.write_kubeconfig(&path).unwrap();
        path
    }
}

impl Drop for NsFakeApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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

/// `iptables-save -t nat` of both backends inside `ns`.
pub fn nat_rules(ns: &Netns) -> String {
    ["iptables-nft-save", "iptables-legacy-save"]
        .iter()
        .map(|bin| {
            let o = ns.command(bin).args(["-t", "nat"]).output().unwrap();
            String::from_utf8_lossy(&o.stdout).into_owned()
        })
        .collect()
}

/// Runs `kproxy ARGS` inside `ns` to completion.
pub fn kproxy_output(ns: &Netns, args: &[String]) -> std::process::Output {
    let mut cmd: Command = ns.command(kproxy_bin().unwrap());
    cmd.args(args).output().unwrap()
}
