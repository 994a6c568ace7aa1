//! Serving an axum router on one address, the way kube-proxy runs its HTTP servers: a bind
//! that fails is logged and retried every [`RETRY`] in the background (the proxy keeps
//! working without the server), and the server stops when its [`Served`] handle is dropped.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::{error, info};

/// Delay between bind attempts (upstream: 5 s).
pub(crate) const RETRY: Duration = Duration::from_secs(5);

/// A running (or still binding) server; dropping it stops it.
#[derive(Debug)]
pub(crate) struct Served {
    /// The bound address, when the first bind succeeded (tests bind port 0 and read it here).
    pub local_addr: Option<SocketAddr>,
    task: JoinHandle<()>,
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds `addr` and serves `router` on it. `what` names the server in logs.
pub(crate) async fn serve(what: &'static str, addr: SocketAddr, router: Router) -> Served {
    match TcpListener::bind(addr).await {
        Ok(listener) => {
            let local_addr = listener.local_addr().ok();
            info!(server = what, address = %local_addr.unwrap_or(addr), "serving");
            Served {
                local_addr,
                task: tokio::spawn(run(what, listener, router)),
            }
        }
        Err(e) => {
            error!(server = what, address = %addr, error = %e, "cannot bind; retrying every {RETRY:?}");
            let task = tokio::spawn(async move {
                loop {
                    tokio::time::sleep(RETRY).await;
                    match TcpListener::bind(addr).await {
                        Ok(listener) => {
                            info!(server = what, address = %addr, "serving");
                            run(what, listener, router).await;
                            return;
                        }
                        Err(e) => {
                            error!(server = what, address = %addr, error = %e, "cannot bind; retrying");
                        }
                    }
                }
            });
            Served {
                local_addr: None,
                task,
            }
        }
    }
}

async fn run(what: &'static str, listener: TcpListener, router: Router) {
    if let Err(e) = axum::serve(listener, router).await {
        error!(server = what, error = %e, "server stopped");
    }
}
