//! The agent's HTTP endpoints: /metrics (the registry), /healthz (the liveness
//! loop turned recently), /readyz (attached and programmed, or idle) and /status
//! (the same JSON as the status file).
use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use anyhow::{Context as _, Result};
use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use prometheus_client::registry::Registry;
use tracing::warn;

use crate::{
    clock::monotonic_ns,
    metrics::{BpfCounters, Metrics},
};

#[derive(Clone)]
struct Http {
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
    idle: Arc<AtomicBool>,
    last_turn_ns: Arc<AtomicU64>,
    stale_after: Duration,
    status: Arc<Mutex<String>>,
}

/// A listener on `addr`; the IPv6 wildcard (`[::]`) takes both families, so that
/// the kubelet's probes reach the agent on an IPv4, IPv6-only or dual-stack node.
fn listen(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(tokio::net::TcpListener::from_std(socket.into())?)
}

/// Serves the endpoints on `addr` until the runtime stops.
pub async fn serve(addr: SocketAddr, m: &mut Metrics, pin_dir: PathBuf, status: Arc<Mutex<String>>, stale_after: Duration) -> Result<SocketAddr> {
    m.registry.register_collector(Box::new(BpfCounters::new(pin_dir, m.names.clone())));
    let registry = std::mem::take(&mut m.registry);
    let state =
        Http { registry: Arc::new(registry), ready: m.ready.clone(), idle: m.idle.clone(), last_turn_ns: m.liveness.last_turn_ns.clone(), stale_after, status };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status_json))
        .with_state(state);
    let listener = listen(addr).with_context(|| format!("binding the metrics address {addr}"))?;
    let bound = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            warn!("metrics server stopped: {e}");
        }
    });
    Ok(bound)
}

async fn metrics(State(h): State<Http>) -> impl IntoResponse {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &h.registry) {
        Ok(()) => (StatusCode::OK, [("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], out),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, [("content-type", "text/plain")], e.to_string()),
    }
}

/// Alive: the liveness loop turned recently (a wedged agent fails its liveness probe).
async fn healthz(State(h): State<Http>) -> impl IntoResponse {
    let age = Duration::from_nanos(monotonic_ns().saturating_sub(h.last_turn_ns.load(Ordering::Relaxed)));
    if age <= h.stale_after {
        (StatusCode::OK, "ok\n".to_owned())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("liveness loop stalled for {age:?}\n"))
    }
}

/// Ready: attached, a valid config loaded and written to the maps once; or idle on
/// a node the model leaves out, where there is nothing to be ready for.
async fn readyz(State(h): State<Http>) -> impl IntoResponse {
    if h.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else if h.idle.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready: idle, this node is not in the cluster's model (Node not Ready, tainted, labelled node.kubernetes.io/exclude-from-external-load-balancers, or not registered); it joins once let in\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: no valid config applied yet\n")
    }
}

async fn status_json(State(h): State<Http>) -> impl IntoResponse {
    let s = h.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
    ([("content-type", "application/json")], s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_ipv6_wildcard_takes_both_families() {
        let l = listen("[::]:0".parse().unwrap()).unwrap();
        let port = l.local_addr().unwrap().port();
        for to in [format!("127.0.0.1:{port}"), format!("[::1]:{port}")] {
            let c = tokio::net::TcpStream::connect(&to).await.unwrap_or_else(|e| panic!("{to}: {e}"));
            l.accept().await.unwrap();
            drop(c);
        }
        // An address of one family stays that family's alone.
        let v4 = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = v4.local_addr().unwrap().port();
        assert!(tokio::net::TcpStream::connect(format!("[::1]:{port}")).await.is_err());
    }
}
