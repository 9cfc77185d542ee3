//! The Kubernetes source: the VipPool resource, the Kubernetes objects turned into
//! the same model as the file (`source`), and the elected controller that allocates
//! addresses and writes statuses (`leader`, `controller`, `allocate`, `pools`),
//! and the VipStatus writers (`vipstatus`).
pub mod allocate;
pub mod controller;
pub mod crd;
pub mod heartbeat_key;
pub mod leader;
pub mod metallb_import;
pub mod pools;
pub mod reports;
pub mod source;
pub mod vipstatus;

use std::{
    fmt::Display,
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use futures::StreamExt;
use kube::{
    api::Api,
    runtime::{
        reflector::{self, Store},
        watcher,
    },
    Resource,
};
use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// A reflector store's objects, owned (the pure functions take slices).
pub(crate) fn owned<K: Clone>(v: Vec<std::sync::Arc<K>>) -> Vec<K> {
    v.into_iter().map(|x| (*x).clone()).collect()
}

/// What requests to the API server say they are (`vip-agent/0.2.0`).
pub const USER_AGENT: &str = concat!("vip-agent/", env!("CARGO_PKG_VERSION"));

/// A client from `kubeconfig`, else in-cluster config or $KUBECONFIG.
pub async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no Kubernetes config: not in a cluster, and no KUBECONFIG")?,
    };
    client_from_config(config)
}

/// A client for `config` as the agent uses it: its User-Agent, and a connect timeout
/// short enough that a watch retrying against an unreachable server notices it is
/// back within seconds (kube's default waits 30 s for a TCP connection).
pub fn client_from_config(mut config: kube::Config) -> Result<kube::Client> {
    config.headers.retain(|(name, _)| name != axum::http::header::USER_AGENT);
    config.headers.push((axum::http::header::USER_AGENT, axum::http::HeaderValue::from_static(USER_AGENT)));
    config.connect_timeout = Some(config.connect_timeout.map_or(CONNECT_TIMEOUT, |t| t.min(CONNECT_TIMEOUT)));
    Ok(kube::Client::try_from(config)?)
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Retry delays of a failing watch: exponential from 100 ms, at most ~1 s, with jitter
/// (each delay is 50–100 % of the nominal one, so the watches of many agents do not
/// hit a server that is coming back in lockstep). kube-runtime's `default_backoff`
/// (client-go's: up to 30 s, and its delay applies to the 410 Expired that follows a
/// restart too) made a new Service wait ~50 s for its address after an outage.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const CAP: Duration = Duration::from_millis(1000);

    pub(crate) fn new() -> Self {
        Self { next: Self::FIRST }
    }

    pub(crate) fn reset(&mut self) {
        self.next = Self::FIRST;
    }

    /// The delay before the next attempt.
    pub(crate) fn delay(&mut self) -> Duration {
        let nominal = self.next;
        self.next = (self.next * 2).min(Self::CAP);
        nominal.mul_f64(0.5 + 0.5 * jitter())
    }
}

/// A number in [0, 1), different on every call (std's RandomState is seeded randomly).
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether this process reaches the Kubernetes API, from what its watches and its
/// lease loop see: `vip_kube_api_reachable` (1 while requests succeed, 0 from the
/// first failure until one succeeds again) and `vip_kube_api_errors` (failed
/// requests). One process-wide instance ([`api_health`]); the agent registers its
/// two metrics. Errors are logged as one WARN when the API becomes unreachable, then
/// at most one WARN every 30 s (with the count since), and one INFO when it is back.
pub struct ApiHealth {
    pub reachable: Gauge,
    pub errors: Counter,
    state: Mutex<HealthState>,
}

#[derive(Default)]
struct HealthState {
    /// Since when requests fail (None: the last one succeeded).
    down_since: Option<Instant>,
    /// The last WARN, and the errors not logged since.
    last_warn: Option<Instant>,
    unlogged: u64,
    /// Whether this outage was logged (its end is then logged too).
    warned: bool,
    /// The last error of each request kind (`what`) since it last succeeded.
    last_errors: std::collections::BTreeMap<String, String>,
}

const WARN_EVERY: Duration = Duration::from_secs(30);

/// The process's [`ApiHealth`].
pub fn api_health() -> &'static ApiHealth {
    static HEALTH: OnceLock<ApiHealth> = OnceLock::new();
    HEALTH.get_or_init(ApiHealth::new)
}

/// Registers the Kubernetes side's metrics in `registry`: the API's health
/// ([`api_health`]) and `vip_pool_addresses`, whose handle the controller writes
/// while it leads (`controller::AgentView::pool_addresses`).
pub fn register_metrics(registry: &mut prometheus_client::registry::Registry) -> crate::metrics::Tracked<controller::PoolStateLabels, Gauge> {
    registry.register(
        "vip_kube_api_reachable",
        "1 while the Kubernetes API answers this agent's watches and lease requests, 0 while they fail",
        api_health().reachable.clone(),
    );
    registry.register("vip_kube_api_errors", "Failed Kubernetes API requests (watches, lease)", api_health().errors.clone());
    let pool_addresses = crate::metrics::Tracked::default();
    registry.register(
        "vip_pool_addresses",
        "Addresses of each pool by state (total, allocated, free); exported by the elected leader only",
        pool_addresses.family(),
    );
    pool_addresses
}

impl ApiHealth {
    fn new() -> Self {
        Self { reachable: Gauge::default(), errors: Counter::default(), state: Mutex::new(HealthState::default()) }
    }

    /// The last error of requests of `what` (`watch vippools`), if the last one failed.
    pub(crate) fn last_error(&self, what: &str) -> Option<String> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).last_errors.get(what).cloned()
    }

    /// A request (of `what`) succeeded.
    pub(crate) fn ok(&self, what: &str) {
        self.reachable.set(1);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.last_errors.remove(what);
        if let Some(since) = s.down_since.take() {
            if std::mem::take(&mut s.warned) {
                info!(what, "Kubernetes API reachable again after {:.1} s", since.elapsed().as_secs_f64());
            }
        }
    }

    /// A request (of `what`) failed with `e`.
    pub(crate) fn failed(&self, what: &str, e: &dyn Display) {
        self.errors.inc();
        self.reachable.set(0);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.last_errors.insert(what.to_owned(), e.to_string());
        let now = Instant::now();
        let since = *s.down_since.get_or_insert(now);
        if s.last_warn.is_none_or(|t| now.duration_since(t) >= WARN_EVERY) {
            let unlogged = std::mem::take(&mut s.unlogged);
            if since == now || !s.warned {
                warn!(what, "Kubernetes API request failed: {e} (retrying; further errors are logged at most every {} s)", WARN_EVERY.as_secs());
            } else {
                warn!(what, unlogged, "Kubernetes API still failing after {:.0} s: {e}", now.duration_since(since).as_secs_f64());
            }
            s.last_warn = Some(now);
            s.warned = true;
        } else {
            s.unlogged += 1;
            debug!(what, "Kubernetes API request failed: {e}");
        }
    }
}

/// The annotation in which `kubectl apply` keeps a whole copy of what it applied.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// How a watch of `plural` is named in logs and in [`ApiHealth`].
pub(crate) fn watch_name(plural: &str) -> String {
    format!("watch {plural}")
}

/// Watches `api` into a store; every change pings `changed`.
///
/// A failed request is retried after [`Backoff`] (≤ ~1 s). A 410 Expired (the
/// server lost the history the watch would resume from, as after a restart) leads
/// straight to a re-list: kube's watcher does that itself for a 410 ERROR event (we
/// only skip the delay), and a watcher whose re-watch request itself got a 410 is
/// replaced by a new one (it would retry the expired resourceVersion forever).
pub(crate) fn reflect<K>(api: Api<K>, changed: mpsc::UnboundedSender<()>) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, mut writer) = reflector::store();
    let what = watch_name(&K::plural(&Default::default()));
    tokio::spawn(async move {
        let health = api_health();
        let mut backoff = Backoff::new();
        loop {
            let mut stream = std::pin::pin!(watcher(api.clone(), watcher::Config::default()));
            let mut gone_before = false;
            loop {
                let Some(ev) = stream.next().await else { return };
                match ev {
                    Ok(ev) => {
                        backoff.reset();
                        gone_before = false;
                        // `Init` is the watcher's own marker before it lists: no request behind it.
                        if !matches!(ev, watcher::Event::Init) {
                            health.ok(&what);
                        }
                        // managedFields (kept by a real server on every object, often larger
                        // than the rest of it) and the last-applied copy are never read.
                        let ev = ev.modify(|o| {
                            let meta = o.meta_mut();
                            meta.managed_fields = None;
                            if let Some(a) = meta.annotations.as_mut() {
                                a.remove(LAST_APPLIED);
                            }
                        });
                        writer.apply_watcher_event(&ev);
                        if changed.send(()).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        health.failed(&what, &e);
                        match &e {
                            // The watcher is back to listing: do it now (once; a second 410 in a row waits).
                            watcher::Error::WatchError(s) if s.code == 410 && !gone_before => gone_before = true,
                            watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 410 => break,
                            _ => tokio::time::sleep(backoff.delay()).await,
                        }
                    }
                }
            }
        }
    });
    reader
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_about_a_second_with_jitter_and_resets() {
        let mut b = Backoff::new();
        let d: Vec<Duration> = (0..8).map(|_| b.delay()).collect();
        assert!(d[0] >= Duration::from_millis(50) && d[0] <= Duration::from_millis(100), "{d:?}");
        assert!(d.iter().all(|x| *x <= Backoff::CAP), "{d:?}");
        assert!(d[7] >= Backoff::CAP / 2, "{d:?}");
        b.reset();
        assert!(b.delay() <= Duration::from_millis(100));
        let j: std::collections::BTreeSet<u64> = (0..20).map(|_| (jitter() * 1e9) as u64).collect();
        assert!(j.len() > 15, "jitter varies: {j:?}");
    }

    /// An outage is one WARN (not one per failed request), then one INFO when it ends.
    #[test]
    fn the_agent_in_kubernetes_mode_exports_the_api_health_and_pool_addresses() {
        let mut m = crate::metrics::Metrics::new(crate::metrics::Mode::Kubernetes);
        register_metrics(&mut m.registry).with(&controller::PoolStateLabels { pool: "p".into(), state: "free".into() }, |g| g.set(3));
        let mut k = String::new();
        prometheus_client::encoding::text::encode(&mut k, &m.registry).unwrap();
        assert!(!k.contains("vip_config_valid") && !k.contains("vip_config_reloads") && k.contains("vip_kube_api_reachable"), "{k}");
        assert!(k.contains(r#"vip_pool_addresses{pool="p",state="free"} 3"#), "{k}");
    }

    #[test]
    fn api_errors_are_counted_and_logged_once_per_outage() {
        #[derive(Clone, Default)]
        struct Buf(std::sync::Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let w = buf.clone();
        let subscriber = tracing_subscriber::fmt().with_max_level(tracing::Level::INFO).with_ansi(false).with_writer(move || w.clone()).finish();
        let h = ApiHealth::new();
        tracing::subscriber::with_default(subscriber, || {
            for i in 0..50 {
                h.failed(if i % 2 == 0 { "watch services" } else { "lease vip-controller" }, &"connection refused");
            }
            assert_eq!((h.reachable.get(), h.errors.get()), (0, 50));
            h.ok("watch services");
            h.ok("lease vip-controller");
        });
        assert_eq!(h.reachable.get(), 1);
        let log = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert_eq!(log.matches("WARN").count(), 1, "{log}");
        assert_eq!(log.matches("INFO").count(), 1, "{log}");
        assert!(log.contains("reachable again"), "{log}");
    }

    #[test]
    fn user_agent_names_vip_and_its_version() {
        assert_eq!(USER_AGENT, format!("vip-agent/{}", env!("CARGO_PKG_VERSION")));
    }
}
