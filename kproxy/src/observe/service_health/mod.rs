//! healthCheckNodePort servers: upstream's `ServiceHealthServer`
//! (pkg/proxy/healthcheck/service_health.go).
//!
//! Every LoadBalancer service with `externalTrafficPolicy: Local` has a `healthCheckNodePort`;
//! kproxy listens on it (on every node address within `--nodeport-addresses`, or on all
//! addresses when that is empty) and answers any request path with
//! - 200 iff the service has local ready endpoints and the proxy is healthy (the health
//!   server's `Health()`, node eligibility not considered), else 503;
//! - headers `Content-Type: application/json`, `X-Content-Type-Options: nosniff`,
//!   `X-Load-Balancing-Endpoint-Weight: <local endpoints>`;
//! - upstream's tab-indented JSON body ([`body`]).
//!
//! The set of servers follows each successfully synced snapshot ([`desired`], the pure part):
//! a new service or a changed port opens listeners, a removed service or a changed port closes
//! them (and every connection on them). A port that cannot be opened is logged, reported as a
//! `FailedToStartServiceHealthcheck` event on the Service, and retried on the next sync.
//!
//! The local-endpoint count is upstream's `LocalReadyEndpoints`: local, ready endpoints summed
//! over all ports of the service.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use ipnet::IpNet;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info};

use crate::model::Snapshot;
use crate::observe::events::Events;
use crate::observe::health::HealthHandle;
use crate::sync::{SyncObserver, SyncOutcome};

/// A service, `namespace/name` (upstream's `NamespacedName`).
pub(crate) type ServiceName = (String, String);

/// What one service's health check serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ServiceCheck {
    pub port: u16,
    /// Local ready endpoints (over all ports of the service).
    pub local_endpoints: usize,
}

/// The health checks `snap` asks for (pure): services with a healthCheckNodePort and their
/// local ready endpoint counts.
pub(crate) fn desired(snap: &Snapshot) -> BTreeMap<ServiceName, ServiceCheck> {
    let mut out: BTreeMap<ServiceName, ServiceCheck> = BTreeMap::new();
    for svc in snap.services.values() {
        if svc.health_check_node_port == 0 {
            continue;
        }
        let key = (svc.name.namespace.clone(), svc.name.name.clone());
        out.entry(key).or_insert(ServiceCheck {
            port: svc.health_check_node_port,
            local_endpoints: 0,
        });
    }
    for (name, eps) in &snap.endpoints {
        let key = (name.namespace.clone(), name.name.clone());
        if let Some(c) = out.get_mut(&key) {
            c.local_endpoints += eps.iter().filter(|e| e.is_local && e.ready).count();
        }
    }
    out
}

/// Upstream's response body for a service (exactly, tab-indented, no trailing newline).
pub(crate) fn body(namespace: &str, name: &str, local_endpoints: usize, healthy: bool) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("strings serialize");
    format!(
        "{{\n\t\"service\": {{\n\t\t\"namespace\": {},\n\t\t\"name\": {}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {healthy}\n}}",
        q(namespace),
        q(name)
    )
}

/// Upstream's status for a health check request.
pub(crate) fn status(local_endpoints: usize, proxy_healthy: bool) -> u16 {
    if local_endpoints != 0 && proxy_healthy {
        200
    } else {
        503
    }
}

/// The addresses to listen on (pure): `None` = every address (`--nodeport-addresses` empty,
/// i.e. match-all); else the node's interface addresses within those CIDRs.
pub(crate) fn listen_addresses(
    node_port_addresses: &[IpNet],
    interface_addrs: &[IpAddr],
) -> Option<Vec<IpAddr>> {
    if node_port_addresses.is_empty() {
        return None;
    }
    let mut out: Vec<IpAddr> = interface_addrs
        .iter()
        .copied()
        .filter(|ip| node_port_addresses.iter().any(|c| c.contains(ip)))
        .collect();
    out.sort();
    out.dedup();
    Some(out)
}

/// The addresses of every local interface.
fn interface_addrs() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return vec![];
    };
    addrs
        .filter_map(|a| a.address)
        .filter_map(|s| {
            if let Some(v4) = s.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                s.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

#[derive(Clone)]
struct Shared {
    counts: Arc<RwLock<BTreeMap<ServiceName, usize>>>,
    health: HealthHandle,
}

/// One open listener; dropping it closes the port and every connection on it.
struct Listener {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Runs the health check servers; feed it as a [`SyncObserver`] ([`ServiceHealthServers::observer`]).
pub(crate) struct ServiceHealthServers {
    tx: watch::Sender<Arc<BTreeMap<ServiceName, ServiceCheck>>>,
    task: JoinHandle<()>,
}

impl Drop for ServiceHealthServers {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends each successfully synced snapshot's health checks to the servers.
pub(crate) struct Observer {
    tx: watch::Sender<Arc<BTreeMap<ServiceName, ServiceCheck>>>,
}

impl SyncObserver for Observer {
    fn sync_finished(&self, o: &SyncOutcome<'_>) {
        if o.result.is_ok() {
            self.tx.send_replace(Arc::new(desired(o.snapshot)));
        }
    }
}

impl ServiceHealthServers {
    /// Starts the manager task. `node_port_addresses` = `--nodeport-addresses` (empty: all).
    pub(crate) fn start(
        health: HealthHandle,
        events: Events,
        node_port_addresses: Vec<IpNet>,
    ) -> Self {
        let (tx, rx) = watch::channel(Arc::new(BTreeMap::new()));
        let shared = Shared {
            counts: Arc::default(),
            health,
        };
        let task = tokio::spawn(manage(rx, shared, events, node_port_addresses));
        ServiceHealthServers { tx, task }
    }

    /// The sync observer that drives these servers.
    pub(crate) fn observer(&self) -> Observer {
        Observer {
            tx: self.tx.clone(),
        }
    }
}

async fn manage(
    mut rx: watch::Receiver<Arc<BTreeMap<ServiceName, ServiceCheck>>>,
    shared: Shared,
    events: Events,
    node_port_addresses: Vec<IpNet>,
) {
    let mut open: BTreeMap<ServiceName, (u16, Vec<Listener>)> = BTreeMap::new();
    while rx.changed().await.is_ok() {
        let want = rx.borrow_and_update().clone();
        *shared.counts.write().unwrap_or_else(|e| e.into_inner()) = want
            .iter()
            .map(|(k, c)| (k.clone(), c.local_endpoints))
            .collect();
        // Close removed services and changed ports.
        open.retain(|name, (port, listeners)| {
            let keep = want.get(name).is_some_and(|c| c.port == *port);
            if !keep {
                let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.addr).collect();
                info!(service = %format!("{}/{}", name.0, name.1), ?addrs, "closing healthCheckNodePort");
            }
            keep
        });
        for (name, check) in want.iter() {
            if open.contains_key(name) {
                continue;
            }
            match listen(name, check.port, &node_port_addresses, &shared).await {
                Ok(listeners) => {
                    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.addr).collect();
                    info!(service = %format!("{}/{}", name.0, name.1), ?addrs, "opened healthCheckNodePort");
                    open.insert(name.clone(), (check.port, listeners));
                }
                Err(e) => {
                    events.failed_service_healthcheck(&name.0, &name.1, check.port, &e.to_string());
                }
            }
        }
    }
}

async fn listen(
    name: &ServiceName,
    port: u16,
    node_port_addresses: &[IpNet],
    shared: &Shared,
) -> std::io::Result<Vec<Listener>> {
    let mut out = vec![];
    match listen_addresses(node_port_addresses, &interface_addrs()) {
        None => {
            // Every address: dual-stack [::] where IPv6 exists, else 0.0.0.0.
            let l = match TcpListener::bind((Ipv6Addr::UNSPECIFIED, port)).await {
                Ok(l) => l,
                Err(_) => TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).await?,
            };
            out.push(serve(l, name.clone(), shared.clone())?);
        }
        Some(addrs) => {
            for ip in addrs {
                let l = TcpListener::bind((ip, port)).await?;
                out.push(serve(l, name.clone(), shared.clone())?);
            }
        }
    }
    Ok(out)
}

fn serve(listener: TcpListener, name: ServiceName, shared: Shared) -> std::io::Result<Listener> {
    let addr = listener.local_addr()?;
    let router = Router::new().fallback(answer).with_state((name, shared));
    let task = tokio::spawn(async move {
        // The connections live in this task's JoinSet: aborting the task closes them all.
        let mut conns = JoinSet::new();
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    debug!(error = %e, "healthCheckNodePort accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            while conns.try_join_next().is_some() {}
            let service = TowerToHyperService::new(router.clone());
            conns.spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(Listener { addr, task })
}

async fn answer(State((name, shared)): State<(ServiceName, Shared)>) -> Response {
    let count = shared
        .counts
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&name)
        .copied()
        .unwrap_or(0);
    let healthy = shared.health.is_healthy();
    crate::observe::health::server::json_response(
        status(count, healthy),
        body(&name.0, &name.1, count, healthy),
        &[("x-load-balancing-endpoint-weight", count.to_string())],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_upstreams_exact_text() {
        assert_eq!(
            body("ns", "svc", 3, true),
            "{\n\t\"service\": {\n\t\t\"namespace\": \"ns\",\n\t\t\"name\": \"svc\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
        );
    }

    /// Upstream TestServer: counts {2:3, 3:7, 4:6} → 200; missing → 503 with 0; unhealthy → 503.
    #[test]
    fn status_follows_count_and_proxy_health() {
        for n in [3, 7, 6] {
            assert_eq!(status(n, true), 200);
            assert_eq!(status(n, false), 503);
        }
        assert_eq!(status(0, true), 503);
    }

    #[test]
    fn listen_addresses_filter_by_nodeport_addresses() {
        let ips: Vec<IpAddr> = ["10.0.0.5", "127.0.0.1", "fd00::5", "192.168.1.2"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(listen_addresses(&[], &ips), None);
        let cidrs: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap(), "fd00::/64".parse().unwrap()];
        assert_eq!(
            listen_addresses(&cidrs, &ips),
            Some(vec![
                "10.0.0.5".parse().unwrap(),
                "fd00::5".parse().unwrap()
            ])
        );
    }
}
