//! Localhost NodePorts for nftables mode (upstream's alpha feature gate
//! `KubeProxyNFTablesLocalhostNodePorts`): nftables cannot DNAT a packet addressed to
//! 127.0.0.1 (the kernel drops "martian" loopback destinations on the way out of the host;
//! iptables mode relied on `route_localnet=1`, which nftables mode does not set), so a TCP
//! NodePort is served on `127.0.0.1:<nodePort>` by a small userspace proxy instead.
//!
//! - [`plan`] (pure) turns a snapshot into the ports to listen on and, per port, the endpoints a
//!   connection from the node itself may reach: the same ones the table sends locally
//!   originated NodePort traffic to: the cluster endpoints, whatever the traffic policies
//!   (upstream short-circuits LOCAL-source traffic of an `externalTrafficPolicy: Local`
//!   service to its cluster chain, and every externally accessible service keeps one);
//!   serving terminating endpoints only as the table's fallback when none is ready.
//! - [`Chooser`] (pure) picks one endpoint per connection: uniformly at random like the table's
//!   `numgen random mod N`, or the client's previous endpoint within the service's
//!   `sessionAffinity` timeout (the table's per-endpoint affinity sets).
//! - [`LocalhostNodePorts`] runs it on tokio: one listener per port, following NodePort
//!   changes at every sync (a removed port's listener closes; its open connections keep going,
//!   as conntrack'd flows do); per connection, a backend chosen when it is accepted, then a
//!   copy loop each way with one bounded buffer ([`BUFFER_BYTES`]), half-closes passed on.
//!   A port whose service has no usable endpoint is not listened on, so a connect is refused
//!   at once, as the table's REJECT refuses it; a connection whose endpoint vanished or does
//!   not answer in the meantime is reset.
//!
//! Scope, as upstream's gate: TCP only, IPv4 only (`::1` was never a NodePort address;
//! `route_localnet` is IPv4-only). The listeners bind `127.0.0.1` only.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinHandle;

use crate::model::{IpFamily, Protocol, ServicePortName, Snapshot};

pub(crate) use crate::dataplane::settings::NFTABLES_LOCALHOST_NODEPORTS as FEATURE_GATE;

/// The address the listeners bind.
pub(crate) const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Bytes buffered per direction of one connection.
pub(crate) const BUFFER_BYTES: usize = 64 * 1024;

/// How long a connection attempt to an endpoint may take before the client is reset.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What one localhost NodePort forwards to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PortTarget {
    pub service: ServicePortName,
    /// The endpoints a connection may reach (empty: reset every connection).
    pub endpoints: Vec<SocketAddr>,
    /// `sessionAffinity: ClientIP` timeout.
    pub affinity: Option<Duration>,
}

/// The ports to serve and their targets, from `snap` (TCP NodePorts of services with an IPv4
/// ClusterIP).
pub(crate) fn plan(snap: &Snapshot) -> BTreeMap<u16, PortTarget> {
    let mut out = BTreeMap::new();
    for svc in snap.services.values() {
        if svc.node_port == 0
            || svc.protocol != Protocol::Tcp
            || svc.cluster_ip(IpFamily::V4).is_none()
        {
            continue;
        }
        // A NodePort service is externally accessible, so it always uses cluster endpoints.
        let cluster = snap.categorize(svc).cluster.unwrap_or_default();
        let endpoints = cluster
            .iter()
            .filter(|e| IpFamily::V4.matches(&e.ip))
            .map(|e| SocketAddr::new(e.ip, e.port))
            .collect();
        out.insert(
            svc.node_port,
            PortTarget {
                service: svc.name.clone(),
                endpoints,
                affinity: svc
                    .session_affinity_timeout
                    .map(|s| Duration::from_secs(u64::from(s))),
            },
        );
    }
    out
}

/// Picks an endpoint per connection, remembering each client's choice for affinity.
#[derive(Debug, Default)]
pub(crate) struct Chooser {
    /// (port, client) → (endpoint, last used).
    sticky: HashMap<(u16, IpAddr), (SocketAddr, Instant)>,
    seed: u64,
}

impl Chooser {
    /// The endpoint for a connection from `client` to `port`, or `None` (no endpoints).
    /// `random` is a fresh random number (a parameter, so tests can drive it).
    pub(crate) fn choose(
        &mut self,
        port: u16,
        target: &PortTarget,
        client: IpAddr,
        now: Instant,
        random: u64,
    ) -> Option<SocketAddr> {
        if target.endpoints.is_empty() {
            return None;
        }
        if let Some(timeout) = target.affinity
            && let Some((ep, last)) = self.sticky.get_mut(&(port, client))
            && now.duration_since(*last) <= timeout
            && target.endpoints.contains(ep)
        {
            *last = now;
            return Some(*ep);
        }
        let ep = target.endpoints[(random % target.endpoints.len() as u64) as usize];
        if target.affinity.is_some() {
            self.sticky.insert((port, client), (ep, now));
        }
        Some(ep)
    }

    /// Forgets affinity entries of ports no longer served and entries past every timeout.
    pub(crate) fn retain(&mut self, targets: &BTreeMap<u16, PortTarget>, now: Instant) {
        self.sticky.retain(|(port, _), (_, last)| {
            targets
                .get(port)
                .and_then(|t| t.affinity)
                .is_some_and(|timeout| now.duration_since(*last) <= timeout)
        });
    }

    fn random(&mut self) -> u64 {
        self.seed = self.seed.wrapping_add(1);
        let mut h = RandomState::new().build_hasher();
        h.write_u64(self.seed);
        h.finish()
    }
}

/// The state every listener reads: current targets and the chooser.
#[derive(Debug, Default)]
struct Shared {
    targets: BTreeMap<u16, PortTarget>,
    chooser: Chooser,
}

/// Starting the localhost proxy failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LocalhostError {
    #[error("localhost NodePorts need a tokio runtime (the agent's)")]
    NoRuntime,
}

/// The running localhost NodePort proxy.
pub(crate) struct LocalhostNodePorts {
    runtime: tokio::runtime::Handle,
    shared: Arc<Mutex<Shared>>,
    listeners: BTreeMap<u16, JoinHandle<()>>,
}

impl LocalhostNodePorts {
    /// A proxy on the current tokio runtime, serving nothing until [`Self::update`].
    pub(crate) fn new() -> Result<Self, LocalhostError> {
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| LocalhostError::NoRuntime)?;
        Ok(LocalhostNodePorts {
            runtime,
            shared: Arc::default(),
            listeners: BTreeMap::new(),
        })
    }

    /// Follows `snap`: new targets for every connection accepted from now on, listeners
    /// opened for new NodePorts and closed for removed ones. A port that cannot be bound (in
    /// use by another process) is logged and retried at the next update.
    pub(crate) fn update(&mut self, snap: &Snapshot) {
        let targets = plan(snap);
        let wanted = |port: &u16| targets.get(port).is_some_and(|t| !t.endpoints.is_empty());
        self.listeners.retain(|port, task| {
            let keep = wanted(port) && !task.is_finished();
            if !keep {
                task.abort();
            }
            keep
        });
        for &port in targets.keys().filter(|p| wanted(p)) {
            if self.listeners.contains_key(&port) {
                continue;
            }
            match self.bind(port) {
                Ok(listener) => {
                    let shared = self.shared.clone();
                    let task = self.runtime.spawn(serve(listener, port, shared));
                    self.listeners.insert(port, task);
                }
                Err(e) => {
                    tracing::warn!(port, error = %e, "cannot listen for a localhost NodePort")
                }
            }
        }
        let mut shared = self.shared.lock().expect("localhost proxy state poisoned");
        shared.chooser.retain(&targets, Instant::now());
        shared.targets = targets;
    }

    /// Listens on `port`. A listener this proxy closed a moment ago may still hold the port
    /// until the runtime drops its aborted task: `EADDRINUSE` is retried for up to ~200 ms
    /// (this runs on the sync's blocking thread, so sleeping is fine).
    fn bind(&self, port: u16) -> std::io::Result<TcpListener> {
        let _guard = self.runtime.enter();
        let mut tries = 0;
        loop {
            let socket = TcpSocket::new_v4()?;
            socket.set_reuseaddr(true)?;
            match socket.bind(SocketAddr::new(IpAddr::V4(LOOPBACK), port)) {
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 20 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e),
                Ok(()) => return socket.listen(1024),
            }
        }
    }

    /// Closes every listener (open connections finish on their own).
    pub(crate) fn stop(&mut self) {
        for (_, task) in std::mem::take(&mut self.listeners) {
            task.abort();
        }
    }
}

impl Drop for LocalhostNodePorts {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(listener: TcpListener, port: u16, shared: Arc<Mutex<Shared>>) {
    tracing::info!(port, "serving a NodePort on {LOOPBACK}");
    loop {
        let (client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(port, error = %e, "localhost NodePort accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let backend = {
            let mut s = shared.lock().expect("localhost proxy state poisoned");
            let random = s.chooser.random();
            let Shared { targets, chooser } = &mut *s;
            targets
                .get(&port)
                .and_then(|t| chooser.choose(port, t, peer.ip(), Instant::now(), random))
        };
        tokio::spawn(forward(client, backend, port));
    }
}

/// One connection: to `backend`, or reset when there is none or it does not answer.
async fn forward(client: TcpStream, backend: Option<SocketAddr>, port: u16) {
    let Some(backend) = backend else {
        reset(client);
        return;
    };
    let upstream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(backend)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(port, %backend, error = %e, "localhost NodePort: endpoint refused");
            reset(client);
            return;
        }
        Err(_) => {
            tracing::debug!(port, %backend, "localhost NodePort: endpoint did not answer");
            reset(client);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    let (a, b) = tokio::join!(pump(cr, uw), pump(ur, cw));
    if let Err(e) = a.and(b) {
        tracing::debug!(port, %backend, error = %e, "localhost NodePort connection ended");
    }
}

/// Copies `from` to `to` through one bounded buffer until EOF, then half-closes `to`.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
) -> std::io::Result<()> {
    let mut buf = BytesMut::with_capacity(BUFFER_BYTES);
    loop {
        buf.clear();
        if from.read_buf(&mut buf).await? == 0 {
            return to.shutdown().await;
        }
        to.write_all(&buf).await?;
    }
}

/// Closes `s` with a TCP reset (what the table's REJECT sends a TCP client).
fn reset(s: TcpStream) {
    // Deprecated because a non-zero linger blocks the dropping thread; a zero linger never
    // blocks (the kernel sends the reset at once).
    #[allow(deprecated)]
    let _ = s.set_linger(Some(Duration::ZERO));
    drop(s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::testing::{endpoint, service_port, snapshot};

    const NODE: &str = "node-a";

    fn ep(ip: &str, local: bool) -> crate::model::Endpoint {
        endpoint(ip, 8080).local_on(NODE, "node-b", local).build()
    }

    fn addrs(t: &PortTarget) -> Vec<String> {
        t.endpoints.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn plan_takes_ipv4_tcp_nodeports_only() {
        let tcp = service_port("ns", "web", "http")
            .cluster_ip("10.0.0.1")
            .node_port(30080);
        let udp = service_port("ns", "dns", "dns")
            .protocol(Protocol::Udp)
            .cluster_ip("10.0.0.2")
            .node_port(30053);
        let cluster_only = service_port("ns", "db", "sql").cluster_ip("10.0.0.3");
        let v6 = service_port("ns", "six", "http")
            .cluster_ip("fd00::1")
            .node_port(30066);
        let snap = snapshot(NODE)
            .service(tcp.build(), vec![ep("10.1.0.1", false)])
            .service(udp.build(), vec![ep("10.1.0.2", false)])
            .service(cluster_only.build(), vec![ep("10.1.0.3", false)])
            .service(v6.build(), vec![ep("fd01::1", false)])
            .build();
        let p = plan(&snap);
        assert_eq!(p.keys().copied().collect::<Vec<_>>(), vec![30080]);
        assert_eq!(addrs(&p[&30080]), vec!["10.1.0.1:8080"]);
        assert_eq!(p[&30080].service.name, "web");
    }

    #[test]
    fn local_origin_traffic_uses_cluster_endpoints_even_with_external_policy_local() {
        // As the table: LOCAL-source NodePort traffic of an eTP=Local service goes to the
        // cluster chain, so a node without a local endpoint still reaches a remote one.
        let etp = service_port("ns", "web", "http")
            .cluster_ip("10.0.0.1")
            .node_port(30080)
            .external_policy_local(true);
        let snap = snapshot(NODE)
            .service(
                etp.build(),
                vec![ep("10.1.0.1", false), ep("10.1.0.2", false)],
            )
            .build();
        assert_eq!(
            addrs(&plan(&snap)[&30080]),
            vec!["10.1.0.1:8080", "10.1.0.2:8080"]
        );
    }

    #[test]
    fn internal_policy_local_does_not_narrow_local_origin_nodeport_traffic() {
        // Upstream's UsesClusterEndpoints is true for every externally accessible service
        // ("we need Cluster endpoints to implement short circuiting"), so LOCAL-source
        // NodePort traffic reaches every ready endpoint even with both policies Local.
        let both = service_port("ns", "web", "http")
            .cluster_ip("10.0.0.1")
            .node_port(30080)
            .external_policy_local(true)
            .internal_policy_local(true);
        let snap = snapshot(NODE)
            .service(
                both.build(),
                vec![ep("10.1.0.1", false), ep("10.1.0.2", true)],
            )
            .build();
        assert_eq!(
            addrs(&plan(&snap)[&30080]),
            vec!["10.1.0.1:8080", "10.1.0.2:8080"]
        );
    }

    #[test]
    fn unready_endpoints_are_not_targets_and_none_left_means_reset() {
        let web = service_port("ns", "web", "http")
            .cluster_ip("10.0.0.1")
            .node_port(30080);
        let unready = endpoint("10.1.0.1", 8080)
            .ready(false)
            .serving(false)
            .build();
        let snap = snapshot(NODE).service(web.build(), vec![unready]).build();
        let p = plan(&snap);
        assert!(p[&30080].endpoints.is_empty());
        let mut c = Chooser::default();
        assert_eq!(
            c.choose(
                30080,
                &p[&30080],
                "127.0.0.1".parse().unwrap(),
                Instant::now(),
                7
            ),
            None
        );
    }

    fn target(n: u8, affinity: Option<u64>) -> PortTarget {
        PortTarget {
            service: crate::model::testing::port_name("ns", "web", "http", Protocol::Tcp),
            endpoints: (1..=n)
                .map(|i| SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 1, 0, i)), 8080))
                .collect(),
            affinity: affinity.map(Duration::from_secs),
        }
    }

    #[test]
    fn without_affinity_every_endpoint_is_chosen() {
        let t = target(3, None);
        let mut c = Chooser::default();
        let now = Instant::now();
        let client = "127.0.0.1".parse().unwrap();
        let picked: std::collections::BTreeSet<_> = (0..30)
            .map(|i| c.choose(30080, &t, client, now, i).unwrap())
            .collect();
        assert_eq!(picked.len(), 3);
        assert!(c.sticky.is_empty());
    }

    #[test]
    fn affinity_keeps_a_client_on_its_endpoint_until_the_timeout() {
        let t = target(3, Some(10));
        let mut c = Chooser::default();
        let t0 = Instant::now();
        let client = "127.0.0.1".parse().unwrap();
        let first = c.choose(30080, &t, client, t0, 0).unwrap();
        for i in 1..30 {
            let at = t0 + Duration::from_secs(i / 3);
            assert_eq!(c.choose(30080, &t, client, at, i).unwrap(), first);
        }
        // Idle past the timeout: a fresh choice (random 1 picks the second endpoint).
        let late = t0 + Duration::from_secs(9 + 11);
        assert_ne!(c.choose(30080, &t, client, late, 1).unwrap(), first);
    }

    #[test]
    fn affinity_moves_when_its_endpoint_is_gone_and_is_forgotten_with_its_port() {
        let mut c = Chooser::default();
        let t0 = Instant::now();
        let client = "127.0.0.1".parse().unwrap();
        let first = c
            .choose(30080, &target(3, Some(100)), client, t0, 2)
            .unwrap();
        let mut shrunk = target(3, Some(100));
        shrunk.endpoints.retain(|e| *e != first);
        let second = c.choose(30080, &shrunk, client, t0, 2).unwrap();
        assert_ne!(second, first);
        c.retain(&BTreeMap::new(), t0);
        assert!(c.sticky.is_empty());
    }
}
