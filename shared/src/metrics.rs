//! `--metrics-addr HOST:PORT`: Prometheus metrics at `/metrics` and a health check at
//! `/healthz` (200 `ok` — `standby` on a beat that does not lead — or 503 with the reason), for
//! both binaries. The beat adds its status page (`/`, `/api/status`) through [`serve_with`].

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::Arc;

/// `--metrics-addr HOST:PORT`: an IP address or a host name (resolved now: its first IPv4
/// address, else its first address, so `localhost` is 127.0.0.1 where both exist), for clap's
/// `value_parser`.
pub fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    use std::net::ToSocketAddrs;
    let addrs: Vec<SocketAddr> = text
        .to_socket_addrs()
        .map_err(|e| format!("{text:?} is not HOST:PORT ({e})"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{text:?}: the host name resolves to no address"))
}

/// Says whether the process is healthy: `Ok` carries the body of the 200 (`ok`, or a beat's
/// `standby`), `Err` the reason shown with the 503.
pub type HealthCheck = Arc<dyn Fn() -> Result<&'static str, String> + Send + Sync>;

#[derive(Clone)]
struct Shared {
    registry: Arc<Registry>,
    health: HealthCheck,
}

/// Binds `addr` now (so a taken port is reported at start) and serves `/metrics` and
/// `/healthz` in the background.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    health: HealthCheck,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    serve_with(addr, registry, health, Router::new()).await
}

/// [`serve`], plus the routes of `extra` (the beat's status page); `extra` must not claim
/// `/metrics` or `/healthz`.
pub async fn serve_with(
    addr: SocketAddr,
    registry: Registry,
    health: HealthCheck,
    extra: Router,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let shared = Shared {
        registry: Arc::new(registry),
        health,
    };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(shared)
        .merge(extra);
    serve_router(addr, app, "/metrics and /healthz").await
}

/// Binds `addr` now (a taken port is reported at start) and serves `app`, described by `what`
/// in the log, in the background.
pub async fn serve_router(
    addr: SocketAddr,
    app: Router,
    what: &'static str,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving {what}");
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "server of {what} stopped");
        }
    }))
}

async fn metrics(State(shared): State<Shared>) -> impl IntoResponse {
    let mut body = String::new();
    match encode(&mut body, &shared.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            e.to_string(),
        ),
    }
}

async fn healthz(State(shared): State<Shared>) -> impl IntoResponse {
    match (shared.health)() {
        Ok(state) => (StatusCode::OK, format!("{state}\n")),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_address_takes_a_host_name() {
        assert_eq!(
            parse_addr("127.0.0.1:9464"),
            Ok("127.0.0.1:9464".parse().unwrap())
        );
        let local = parse_addr("localhost:9464").unwrap();
        assert_eq!(local, "127.0.0.1:9464".parse().unwrap());
        assert!(parse_addr("localhost").is_err());
    }
}
