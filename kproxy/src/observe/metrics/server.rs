//! The metrics server (`--metrics-bind-address`, default `127.0.0.1:10249`), like upstream's:
//! - `GET /metrics`: every metric, Prometheus text 0.0.4, or OpenMetrics when the `Accept`
//!   header lists it (as upstream negotiates, see [`super::text`]);
//! - `GET /proxyMode`: the active proxy mode as plain text (`ebpf`, `ipvs` or `iptables`);
//! - `GET /healthz`: `ok` (upstream installs the generic healthz handler here too; the proxy's
//!   real health lives on the healthz server).

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::observe::metrics::Metrics;
use crate::observe::metrics::text::{self, OPENMETRICS, PROMETHEUS_TEXT};
use crate::observe::server::Served;

/// The metrics server's routes.
pub(crate) fn router(metrics: Metrics) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/proxyMode", get(proxy_mode))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(metrics)
}

async fn metrics_handler(State(m): State<Metrics>, headers: HeaderMap) -> impl IntoResponse {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(text::wants_openmetrics);
    if openmetrics {
        ([(header::CONTENT_TYPE, OPENMETRICS)], m.encode())
    } else {
        (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            text::to_prometheus_text(&m.encode()),
        )
    }
}

async fn proxy_mode(State(m): State<Metrics>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        m.mode().as_str(),
    )
}

/// Serves [`router`] on `addr` (retrying the bind in the background if it fails, as upstream
/// does); see [`crate::observe::server::serve`].
pub(crate) async fn start(addr: SocketAddr, metrics: Metrics) -> Served {
    crate::observe::server::serve("metrics", addr, router(metrics)).await
}
