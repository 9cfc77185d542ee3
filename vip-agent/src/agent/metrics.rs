//! Prometheus metrics and the agent's HTTP endpoints: /metrics, /healthz,
//! /readyz and /status (the same JSON as the status file).
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
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};
use tracing::warn;

use crate::{clock::monotonic_ns, dataplane::Dataplane, k8s::controller::PoolStateLabels};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VipLabels {
    pub vip: String,
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub node: String,
    pub check: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    pub service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

/// The metrics the liveness thread writes (shared with the registry).
#[derive(Clone)]
pub struct Liveness {
    /// 1 for the current owner of each VIP.
    pub vip_owner: Family<VipLabels, Gauge>,
    pub vips_held: Gauge,
    /// VIPs of each pool this node holds.
    pub pool_held: Family<PoolLabels, Gauge>,
    /// Owner changes of each pool's VIPs seen by this node (failovers, rebalancing).
    pub pool_owner_changes: Family<PoolLabels, Counter>,
    pub arp_conflicts: Counter,
    /// The heartbeat task's: stalls (should stay 0) and the longest gap per peer.
    pub heartbeat: crate::ha::heartbeat::Metrics,
    /// Monotonic ns of the liveness loop's last turn (for /healthz and the heartbeat gate).
    pub last_turn_ns: Arc<AtomicU64>,
}

impl Liveness {
    /// Records a new ownership decision (`before`: the owners of the last one).
    pub fn record(&self, world: &crate::model::World, before: &std::collections::BTreeMap<std::net::Ipv4Addr, String>, o: &super::desired::Ownership) {
        for (vip, owner) in before {
            if o.owners.get(vip) != Some(owner) {
                self.vip_owner.remove(&VipLabels { vip: vip.to_string(), node: owner.clone() });
            }
        }
        for (vip, owner) in &o.owners {
            self.vip_owner.get_or_create(&VipLabels { vip: vip.to_string(), node: owner.clone() }).set(1);
        }
        self.vips_held.set(o.held.len() as i64);
        self.pool_held.clear();
        for pool in &world.pools {
            let l = PoolLabels { pool: pool.name.clone() };
            let held = pool.addresses.iter().filter(|a| o.held.contains(a)).count();
            self.pool_held.get_or_create(&l).set(held as i64);
            let moved = pool.addresses.iter().filter(|a| matches!((before.get(a), o.owners.get(a)), (Some(x), Some(y)) if x != y)).count();
            if moved > 0 {
                self.pool_owner_changes.get_or_create(&l).inc_by(moved as u64);
            }
        }
    }
}

/// The agent's own metrics (the BPF counters are read at scrape time by `BpfCounters`).
pub struct Metrics {
    pub registry: Registry,
    pub liveness: Liveness,
    /// 1 healthy, 0 not, per backend node and health check.
    pub backend_healthy: Family<BackendLabels, Gauge>,
    pub ring_updates: Family<ServiceLabels, Counter>,
    pub ring_slots_written: Family<ServiceLabels, Counter>,
    /// One batch of service changes written to the maps (sweep excluded).
    pub map_write_seconds: Histogram,
    /// The flow-table sweep that follows a batch which took backends from services.
    pub flow_sweep_seconds: Histogram,
    pub flows_evicted: Counter,
    pub health_to_maps_seconds: Histogram,
    pub config_reloads: Family<ResultLabels, Counter>,
    pub config_valid: Gauge,
    /// Service-ports the model wants that are not programmed (no room, no id).
    pub services_unprogrammed: Gauge,
    pub services_programmed: Gauge,
    pub ring_slots_used: Gauge,
    pub ring_slots_capacity: Gauge,
    pub rings: Gauge,
    /// Addresses of each pool by state; written by the elected controller only.
    pub pool_addresses: Family<PoolStateLabels, Gauge>,
    pub ready: Arc<AtomicBool>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let buckets = || Histogram::new(exponential_buckets(1e-5, 2.5, 15)); // 10 µs .. ~5 s
        let m = Self {
            liveness: Liveness {
                vip_owner: Family::default(),
                vips_held: Gauge::default(),
                pool_held: Family::default(),
                pool_owner_changes: Family::default(),
                arp_conflicts: Counter::default(),
                heartbeat: Default::default(),
                last_turn_ns: Arc::new(AtomicU64::new(monotonic_ns())),
            },
            backend_healthy: Family::default(),
            ring_updates: Family::default(),
            ring_slots_written: Family::default(),
            map_write_seconds: buckets(),
            flow_sweep_seconds: buckets(),
            flows_evicted: Counter::default(),
            health_to_maps_seconds: buckets(),
            config_reloads: Family::default(),
            config_valid: Gauge::default(),
            services_unprogrammed: Gauge::default(),
            services_programmed: Gauge::default(),
            ring_slots_used: Gauge::default(),
            ring_slots_capacity: Gauge::default(),
            rings: Gauge::default(),
            pool_addresses: Family::default(),
            ready: Arc::new(AtomicBool::new(false)),
            registry: Registry::default(),
        };
        let l = &m.liveness;
        registry.register("vip_owner", "Owner node of each VIP (1 = owns it)", l.vip_owner.clone());
        registry.register("vip_vips_held", "VIPs this node holds", l.vips_held.clone());
        registry.register("vip_pool_vips_held", "VIPs of each pool this node holds", l.pool_held.clone());
        registry.register(
            "vip_pool_owner_changes",
            "Owner changes of each pool's VIPs seen by this node (failovers, rebalancing)",
            l.pool_owner_changes.clone(),
        );
        registry.register("vip_arp_conflicts", "ARP replies or gratuitous ARP from another MAC claiming a VIP this node holds", l.arp_conflicts.clone());
        registry.register(
            "vip_liveness_stalls",
            "Heartbeat turns held back because the liveness loop or the heartbeat task had stalled (should stay 0)",
            l.heartbeat.stalls.clone(),
        );
        registry.register("vip_heartbeat_gap_max_seconds", "Longest time between two heartbeats received from each peer", l.heartbeat.gap_max.clone());
        registry.register(
            "vip_heartbeats_rejected",
            "Heartbeat datagrams that changed nothing, by reason (unknown_sender, malformed, unknown_key, bad_tag, wrong_name, stale)",
            l.heartbeat.rejected.clone(),
        );
        registry.register("vip_backend_healthy", "Health of each backend node under each health check (1 healthy, 0 down)", m.backend_healthy.clone());
        registry.register("vip_ring_updates", "Maglev ring changes per service", m.ring_updates.clone());
        registry.register(
            "vip_ring_slots_written",
            "Ring slots written per service (0 when it joined a ring another service had)",
            m.ring_slots_written.clone(),
        );
        registry.register("vip_map_write_seconds", "Time to write one batch of service changes to the maps (flow sweep excluded)", m.map_write_seconds.clone());
        registry.register(
            "vip_flow_sweep_seconds",
            "Time of the flow-table sweep after a batch that took backends from services",
            m.flow_sweep_seconds.clone(),
        );
        registry.register("vip_flows_evicted", "Flow-table entries evicted because their backend left their service", m.flows_evicted.clone());
        registry.register(
            "vip_health_to_maps_seconds",
            "Time from a backend health change (deciding probe done) to every affected ring written",
            m.health_to_maps_seconds.clone(),
        );
        registry.register("vip_config_reloads", "Config file loads by result (ok, error)", m.config_reloads.clone());
        registry.register("vip_config_valid", "1 when the last config file read was valid, 0 when it was rejected", m.config_valid.clone());
        registry.register(
            "vip_kube_api_reachable",
            "1 while the Kubernetes API answers this agent's watches and lease requests, 0 while they fail",
            crate::k8s::api_health().reachable.clone(),
        );
        registry.register("vip_kube_api_errors", "Failed Kubernetes API requests (watches, lease)", crate::k8s::api_health().errors.clone());
        registry.register(
            "vip_services_unprogrammed",
            "Service-ports the model wants that could not be programmed (see /status for why); retried",
            m.services_unprogrammed.clone(),
        );
        registry.register("vip_services_programmed", "Service-ports programmed in the data path", m.services_programmed.clone());
        registry.register("vip_ring_slots_used", "Slots of lb4_ring in use (rings are shared between services with equal rings)", m.ring_slots_used.clone());
        registry.register("vip_ring_slots_capacity", "Slots of lb4_ring (--ring-capacity)", m.ring_slots_capacity.clone());
        registry.register("vip_rings", "Distinct Maglev rings in lb4_ring", m.rings.clone());
        registry.register(
            "vip_pool_addresses",
            "Addresses of each pool by state (total, allocated, free); exported by the elected leader",
            m.pool_addresses.clone(),
        );
        Self { registry, ..m }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The data path's per-CPU counters, summed at scrape time from the pinned maps.
#[derive(Debug)]
pub struct BpfCounters {
    pin_dir: PathBuf,
    /// Opened lazily (and again after an error): the maps may be re-created.
    dp: Mutex<Option<DebugDp>>,
}

struct DebugDp(Dataplane);
impl std::fmt::Debug for DebugDp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dataplane")
    }
}

impl BpfCounters {
    pub fn new(pin_dir: PathBuf) -> Self {
        Self { pin_dir, dp: Mutex::new(None) }
    }
}

fn const_counter_family<L: EncodeLabelSet>(enc: &mut DescriptorEncoder, name: &str, help: &str, rows: impl Iterator<Item = (L, u64)>) -> std::fmt::Result {
    let mut rows = rows.peekable();
    if rows.peek().is_none() {
        return Ok(());
    }
    let mut fam = enc.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
    for (labels, v) in rows {
        ConstCounter::new(v).encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IdLabels {
    id: String,
}

impl Collector for BpfCounters {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let mut guard = self.dp.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Dataplane::open(&self.pin_dir).ok().map(DebugDp);
        }
        let Some(dp) = guard.as_ref() else { return Ok(()) };
        let c = match dp.0.counters() {
            Ok(c) => c,
            Err(e) => {
                warn!("reading BPF counters: {e:#}");
                *guard = None;
                return Ok(());
            }
        };
        encode_counters(&mut enc, &c)
    }
}

/// The data path's counters as metric families (at scrape time, and for the reference).
fn encode_counters(enc: &mut DescriptorEncoder, c: &crate::dataplane::Counters) -> std::fmt::Result {
    let reason = |(r, v): (&&'static str, &(u64, u64)), bytes: bool| (ReasonLabels { reason: (*r).to_owned() }, if bytes { v.1 } else { v.0 });
    const_counter_family(enc, "vip_xdp_packets", "Packets seen by the XDP program, by reason", c.reasons.iter().map(|x| reason(x, false)))?;
    const_counter_family(enc, "vip_xdp_bytes", "Bytes seen by the XDP program, by reason", c.reasons.iter().map(|x| reason(x, true)))?;
    let id = |(i, v): (&u32, &(u64, u64)), bytes: bool| (IdLabels { id: i.to_string() }, if bytes { v.1 } else { v.0 });
    const_counter_family(
        enc,
        "vip_service_packets",
        "Packets balanced per data-path service id (see /status for names)",
        c.services.iter().map(|x| id(x, false)),
    )?;
    const_counter_family(enc, "vip_service_bytes", "Bytes balanced per data-path service id", c.services.iter().map(|x| id(x, true)))?;
    const_counter_family(enc, "vip_backend_packets", "Packets sent to each backend id (see /status for nodes)", c.backends.iter().map(|x| id(x, false)))?;
    const_counter_family(enc, "vip_backend_bytes", "Bytes sent to each backend id", c.backends.iter().map(|x| id(x, true)))?;
    Ok(())
}

/// One metric as the reference (docs/reference/metrics.md) lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricDoc {
    /// The name as scraped (counters end in `_total`; histograms add `_bucket`, `_sum`, `_count`).
    pub name: String,
    /// counter, gauge or histogram.
    pub kind: String,
    pub labels: Vec<String>,
    pub help: String,
}

/// Every metric the agent exports, read back from its registry's own exposition:
/// one series of each labelled family is made up so that its labels show.
pub fn reference() -> Vec<MetricDoc> {
    let mut m = Metrics::new();
    let l = &m.liveness;
    let _ = l.vip_owner.get_or_create(&VipLabels { vip: String::new(), node: String::new() });
    let _ = l.pool_held.get_or_create(&PoolLabels { pool: String::new() });
    let _ = l.pool_owner_changes.get_or_create(&PoolLabels { pool: String::new() });
    let _ = l.heartbeat.gap_max.get_or_create(&crate::ha::heartbeat::PeerLabels { peer: String::new() });
    let _ = l.heartbeat.rejected.get_or_create(&crate::ha::heartbeat::RejectLabels { reason: String::new() });
    let _ = m.backend_healthy.get_or_create(&BackendLabels { node: String::new(), check: String::new() });
    let _ = m.ring_updates.get_or_create(&ServiceLabels { service: String::new() });
    let _ = m.ring_slots_written.get_or_create(&ServiceLabels { service: String::new() });
    let _ = m.config_reloads.get_or_create(&ResultLabels { result: String::new() });
    let _ = m.pool_addresses.get_or_create(&PoolStateLabels { pool: String::new(), state: String::new() });
    #[derive(Debug)]
    struct Sample;
    impl Collector for Sample {
        fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
            let one = std::collections::BTreeMap::from([(0, (0, 0))]);
            encode_counters(&mut enc, &crate::dataplane::Counters { reasons: [("x", (0, 0))].into(), services: one.clone(), backends: one })
        }
    }
    m.registry.register_collector(Box::new(Sample));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &m.registry).expect("the registry encodes");
    parse_exposition(&text)
}

/// The families of an OpenMetrics text: name, type, help, label names.
fn parse_exposition(text: &str) -> Vec<MetricDoc> {
    let mut docs: Vec<MetricDoc> = Vec::new();
    let mut samples: Vec<(&str, Vec<String>)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            docs.push(MetricDoc { name: name.to_owned(), kind: String::new(), labels: Vec::new(), help: help.to_owned() });
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let d = docs.iter_mut().find(|d| d.name == name).unwrap_or_else(|| panic!("TYPE before HELP for {name}"));
            d.kind = kind.to_owned();
        } else if !line.starts_with('#') && !line.is_empty() {
            let series = line.rsplit_once(' ').map_or(line, |(s, _)| s);
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}').split(',').filter_map(|kv| kv.split_once('=')).map(|(k, _)| k.to_owned()).collect()),
                None => (series, Vec::new()),
            };
            samples.push((name, labels));
        }
    }
    for d in &mut docs {
        let suffixes: &[&str] = match d.kind.as_str() {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            _ => &[""],
        };
        let mine: Vec<&(&str, Vec<String>)> = samples.iter().filter(|(n, _)| suffixes.iter().any(|s| *n == format!("{}{s}", d.name))).collect();
        assert!(!mine.is_empty(), "metric {} has no series: make one up in metrics::reference() so that its labels show", d.name);
        d.labels = mine.iter().flat_map(|(_, l)| l.iter().cloned()).filter(|l| l != "le").collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        if d.kind == "counter" {
            d.name.push_str("_total");
        }
    }
    docs
}

#[derive(Clone)]
struct Http {
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
    last_turn_ns: Arc<AtomicU64>,
    stale_after: Duration,
    status: Arc<Mutex<String>>,
}

/// Serves the endpoints on `addr` until the runtime stops.
pub async fn serve(addr: SocketAddr, m: &mut Metrics, pin_dir: PathBuf, status: Arc<Mutex<String>>, stale_after: Duration) -> Result<SocketAddr> {
    m.registry.register_collector(Box::new(BpfCounters::new(pin_dir)));
    let registry = std::mem::take(&mut m.registry);
    let state = Http { registry: Arc::new(registry), ready: m.ready.clone(), last_turn_ns: m.liveness.last_turn_ns.clone(), stale_after, status };
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status_json))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the metrics address {addr}"))?;
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

/// Ready: attached, a valid config loaded and written to the maps once.
async fn readyz(State(h): State<Http>) -> impl IntoResponse {
    if h.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready: no valid config applied yet\n")
    }
}

async fn status_json(State(h): State<Http>) -> impl IntoResponse {
    let s = h.status.lock().unwrap_or_else(|e| e.into_inner()).clone();
    ([("content-type", "application/json")], s)
}
