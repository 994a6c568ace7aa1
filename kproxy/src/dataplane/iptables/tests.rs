//! CPU cost of the planner and the proxier's bookkeeping at scale (10,000 ClusterIP services
//! × 5 endpoints by default, `KPROXY_IPT_SERVICES` to change), without any kernel: a backend
//! that accepts everything. Prints figures, asserts nothing about time (ignored by default):
//! `cargo test --release -p kproxy --lib iptables::tests -- --ignored --nocapture`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::model::{ChangedSet, Endpoint, IpFamily, Protocol, ServicePortName, Snapshot, testing};

use super::kernel::{IptablesBackend, IptablesError, RestoreMode};
use super::{IptablesConfig, IptablesProxier, plan, render};
use crate::dataplane::netfilter::local_detect::LocalDetector;

/// Accepts every operation; `save` returns an empty table.
#[derive(Default)]
struct NullBackend {
    restored_bytes: usize,
}

impl IptablesBackend for NullBackend {
    fn restore(&mut self, input: &str, _mode: RestoreMode) -> Result<(), IptablesError> {
        self.restored_bytes += input.len();
        Ok(())
    }
    fn save(&mut self, table: &str) -> Result<String, IptablesError> {
        Ok(format!("*{table}\nCOMMIT\n"))
    }
    fn ensure_chain(&mut self, _: &str, _: &str) -> Result<bool, IptablesError> {
        Ok(true)
    }
    fn chain_exists(&mut self, _: &str, _: &str) -> Result<bool, IptablesError> {
        Ok(true)
    }
    fn ensure_rule_prepend(
        &mut self,
        _: &str,
        _: &str,
        _: &[String],
    ) -> Result<bool, IptablesError> {
        Ok(true)
    }
    fn rule_exists(&mut self, _: &str, _: &str, _: &[String]) -> Result<bool, IptablesError> {
        Ok(true)
    }
    fn delete_rule(&mut self, _: &str, _: &str, _: &[String]) -> Result<(), IptablesError> {
        Ok(())
    }
    fn delete_chain(&mut self, _: &str, _: &str) -> Result<(), IptablesError> {
        Ok(())
    }
}

fn v4(n: usize, base: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        10,
        base + (n / 65536) as u8,
        ((n / 256) % 256) as u8,
        (n % 256) as u8,
    ))
}

fn port_name(i: usize) -> ServicePortName {
    testing::port_name("scale", &format!("svc{i}"), "p", Protocol::Tcp)
}

fn endpoints(i: usize, moved: bool) -> Vec<Endpoint> {
    (0..5)
        .map(|e| {
            let ip = if moved && e == 0 {
                v4(1, 127)
            } else {
                v4(i * 5 + e + 1, 128)
            };
            testing::endpoint(ip, 8080).node("other").build()
        })
        .collect()
}

/// `n` ClusterIP services × 5 endpoints.
pub(super) fn scale_snapshot(n: usize) -> Snapshot {
    (0..n)
        .fold(testing::snapshot("node").generation(0), |snap, i| {
            let port = testing::service_port("scale", &format!("svc{i}"), "p")
                .cluster_ip(v4(i, 96))
                .build();
            snap.service(port, endpoints(i, false))
        })
        .build()
}

fn services() -> usize {
    std::env::var("KPROXY_IPT_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// Best of `runs` wall times of `f` (CPU-bound, single-threaded).
fn best(runs: usize, mut f: impl FnMut()) -> Duration {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .expect("runs > 0")
}

#[test]
#[ignore = "prints CPU figures at scale; run by hand"]
fn cpu_at_scale() {
    let n = services();
    let cfg = IptablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.128.0.0/9".parse().expect("cidr")),
    );
    let snap = scale_snapshot(n);
    if let Ok(path) = std::env::var("KPROXY_IPT_DUMP") {
        // The full restore input (for timing iptables-restore by hand).
        let p = plan(&snap, &cfg);
        let mut filter = super::render::TableInput::new("filter");
        filter.add(&p.filter);
        let mut nat = super::render::TableInput::new("nat");
        nat.add(&p.nat);
        for t in p.services.values() {
            nat.add(t);
        }
        std::fs::write(path, super::render::render_tables(&[filter, nat])).expect("dump");
    }
    let mut figures: BTreeMap<&str, Duration> = BTreeMap::new();
    figures.insert("plan() from scratch", best(3, || drop(plan(&snap, &cfg))));
    figures.insert(
        "render() from scratch",
        best(3, || drop(render(&snap, &cfg))),
    );

    let mut proxier = IptablesProxier::new(cfg.clone(), NullBackend::default());
    let t = Instant::now();
    proxier.sync(&snap, &ChangedSet::default()).expect("full");
    figures.insert("proxier cold full sync", t.elapsed());
    let t = Instant::now();
    proxier.force_full_sync();
    proxier.sync(&snap, &ChangedSet::default()).expect("full");
    figures.insert("proxier warm full sync", t.elapsed());

    // Alternate one service's first endpoint between two addresses: every sync is partial
    // and changes one service port.
    let moved = port_name(n / 2);
    let mut snaps = [snap.clone(), snap];
    snaps[1]
        .endpoints
        .insert(moved.clone(), Arc::new(endpoints(n / 2, true)));
    let changed = ChangedSet {
        services: [moved].into(),
        node: false,
    };
    let mut k = 0;
    figures.insert(
        "proxier partial sync (one endpoint changed)",
        best(5, || {
            k += 1;
            let out = proxier.sync(&snaps[k % 2], &changed).expect("partial");
            assert!(!out.full);
        }),
    );
    for (what, d) in &figures {
        println!(
            "{n} services x 5 endpoints: {what}: {:.1} ms",
            d.as_secs_f64() * 1e3
        );
    }
}
