//! Around an agent process in a network namespace, for the `agent` group's `agent_node_cidr`
//! and `inspect_api` (the agent process itself: [`crate::agentproc`]): a fake API server
//! listening inside a network namespace (so an agent in that namespace reaches it on
//! 127.0.0.1), the nat rules of both iptables backends, and one-shot `kproxy` commands.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::fakeapi::FakeApi;
use crate::netns::Netns;
use crate::topology::kproxy_bin;

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
