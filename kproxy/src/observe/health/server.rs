//! The healthz server (`--healthz-bind-address`, default `0.0.0.0:10256`): `/healthz` and
//! `/livez` answered from [`crate::observe::health::HealthHandle`] exactly as upstream (status 200/503,
//! `Content-Type: application/json`, `X-Content-Type-Options: nosniff`, JSON body of
//! [`crate::observe::health::answer`]), each answer counted in `kubeproxy_proxy_{healthz,livez}_total{code}`.

use std::net::SocketAddr;
use std::time::SystemTime;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::observe::health::HealthHandle;
use crate::observe::metrics::Metrics;
use crate::observe::server::Served;

#[derive(Clone)]
struct Ctx {
    health: HealthHandle,
    metrics: Metrics,
}

/// The healthz server's routes.
pub(crate) fn router(health: HealthHandle, metrics: Metrics) -> Router {
    Router::new()
        .route("/healthz", get(|s| handle(s, false)))
        .route("/livez", get(|s| handle(s, true)))
        .with_state(Ctx { health, metrics })
}

async fn handle(State(ctx): State<Ctx>, livez: bool) -> Response {
    let (code, body) = crate::observe::health::answer(&ctx.health.lock(), livez, SystemTime::now());
    ctx.metrics.count_health_request(livez, code);
    json_response(code, body, &[])
}

/// A JSON response with upstream's headers (plus `extra`).
pub(crate) fn json_response(code: u16, body: String, extra: &[(&'static str, String)]) -> Response {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    for (name, value) in extra {
        if let Ok(v) = HeaderValue::from_str(value) {
            h.insert(*name, v);
        }
    }
    r
}

/// Serves [`router`] on `addr` (bind failures retried in the background, as upstream).
pub(crate) async fn start(addr: SocketAddr, health: HealthHandle, metrics: Metrics) -> Served {
    crate::observe::server::serve("healthz", addr, router(health, metrics)).await
}
