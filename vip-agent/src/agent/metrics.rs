//! Prometheus metrics and the agent's HTTP endpoints: /metrics, /healthz,
//! /readyz and /status (the same JSON as the status file).
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    hash::Hash,
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex, RwLock,
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::get, Router};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::{ConstGauge, Gauge},
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};
use tracing::warn;

use crate::{
    clock::monotonic_ns,
    dataplane::Dataplane,
    ha::heartbeat::{Gaps, PeerLabels},
    k8s::controller::PoolStateLabels,
    model::ServiceAddr,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct VipLabels {
    pub vip: String,
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ArpLabels {
    pub vip: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct HeldLabels {
    pub vip: String,
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct BackendLabels {
    pub node: String,
    pub check: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct NodeLabels {
    pub node: String,
}

/// A service-port: the Service's name and what it is reached at (never the data
/// path's ids, which are re-used).
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ServiceLabels {
    pub service: String,
    pub vip: String,
    pub port: String,
    pub protocol: String,
}

impl ServiceLabels {
    pub fn new(service: &str, a: &ServiceAddr) -> Self {
        Self { service: service.to_owned(), vip: a.vip.to_string(), port: a.port.to_string(), protocol: a.protocol.name().to_owned() }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct PoolLabels {
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    revision: String,
}

/// The git revision the agent was built from (`VIP_GIT_REVISION`, which build.rs
/// sets from git when it is not given), or "unknown".
pub fn revision() -> &'static str {
    option_env!("VIP_GIT_REVISION").filter(|r| !r.is_empty()).unwrap_or("unknown")
}

/// A labelled family whose series follow what exists: those of a service, VIP,
/// peer or pool that went are removed (a series never outlives its subject).
#[derive(Debug)]
pub struct Tracked<L, M> {
    family: Family<L, M>,
    seen: Arc<Mutex<HashSet<L>>>,
}

impl<L, M> Clone for Tracked<L, M> {
    fn clone(&self) -> Self {
        Self { family: self.family.clone(), seen: self.seen.clone() }
    }
}

impl<L: Clone + Hash + Eq, M: Default> Default for Tracked<L, M> {
    fn default() -> Self {
        Self { family: Family::default(), seen: Arc::default() }
    }
}

impl<L: Clone + Hash + Eq, M: Default> Tracked<L, M> {
    /// The family, to register.
    pub fn family(&self) -> Family<L, M> {
        self.family.clone()
    }

    /// Runs `f` on the series of `labels` (made if new).
    pub fn with<R>(&self, labels: &L, f: impl FnOnce(&M) -> R) -> R {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).insert(labels.clone());
        f(&self.family.get_or_create(labels))
    }

    /// Removes the series `keep` refuses.
    pub fn retain(&self, keep: impl Fn(&L) -> bool) {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).retain(|l| {
            let k = keep(l);
            if !k {
                self.family.remove(l);
            }
            k
        });
    }

    /// The label sets that have a series.
    pub fn labels(&self) -> HashSet<L> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl<L: Clone + Hash + Eq> Tracked<L, Gauge> {
    /// Exactly these series with these values (set in place: a scrape never sees
    /// the family empty in between).
    pub fn set_all(&self, values: impl IntoIterator<Item = (L, i64)>) {
        let mut keep = HashSet::new();
        for (l, v) in values {
            self.with(&l, |g| g.set(v));
            keep.insert(l);
        }
        self.retain(|l| keep.contains(l));
    }
}

/// The metrics the liveness thread writes (shared with the registry).
#[derive(Clone)]
pub struct Liveness {
    /// 1 for the current owner of each VIP, as this node sees it.
    pub vip_owner: Tracked<VipLabels, Gauge>,
    pub vips_held: Gauge,
    /// 1 for each VIP this node answers for.
    pub vip_held: Tracked<HeldLabels, Gauge>,
    /// VIPs of each pool this node holds.
    pub pool_held: Tracked<PoolLabels, Gauge>,
    /// VIPs of each pool with no live eligible node, as this node (a member) sees it.
    pub pool_unowned: Tracked<PoolLabels, Gauge>,
    /// Owner changes of each pool's VIPs seen by this node (failovers, rebalancing).
    pub pool_owner_changes: Tracked<PoolLabels, Counter>,
    /// 1 for each peer heard within deadAfter, 0 for the others.
    pub peer_live: Tracked<PeerLabels, Gauge>,
    pub dead_after: Gauge<f64, AtomicU64>,
    pub arp_conflicts: Counter,
    /// The ARP self-check: for each held VIP a peer checked, the MACs other than
    /// ours that answered; and the requests this node sent as a checker.
    pub arp_foreign: Tracked<ArpLabels, Gauge>,
    pub arp_checks: Counter,
    /// The heartbeat task's: stalls (should stay 0), gaps per peer, rejections.
    pub heartbeat: crate::ha::heartbeat::Metrics,
    /// Monotonic ns of the liveness loop's last turn (for /healthz and the heartbeat gate).
    pub last_turn_ns: Arc<AtomicU64>,
}

/// What the liveness thread knows of the membership when it decides.
pub struct Members<'a> {
    pub me: &'a str,
    /// This node and the peers it exchanges heartbeats with.
    pub tracked: &'a BTreeSet<String>,
    pub live: &'a BTreeSet<String>,
}

impl Liveness {
    /// Records a new ownership decision (`before`: the owners of the last one).
    pub fn record(&self, world: &crate::model::World, before: &BTreeMap<std::net::IpAddr, String>, o: &super::desired::Ownership, m: &Members) {
        self.vip_owner.set_all(o.owners.iter().map(|(vip, owner)| (VipLabels { vip: vip.to_string(), node: owner.clone() }, 1)));
        self.vips_held.set(o.held.len() as i64);
        self.vip_held.set_all(o.held.iter().filter_map(|v| Some((HeldLabels { vip: v.to_string(), pool: world.pool_of(*v)?.name.clone() }, 1))));
        self.pool_held
            .set_all(world.pools.iter().map(|p| (PoolLabels { pool: p.name.clone() }, p.addresses.iter().filter(|a| o.held.contains(a)).count() as i64)));
        // A node that is no member (not in the model, its link down) sees no owner
        // anywhere: its view says nothing about the pools, except those no node of
        // the model may hold (every agent knows those are unowned).
        let member = m.live.contains(m.me);
        self.pool_unowned.set_all(
            world
                .pools
                .iter()
                .filter(|p| member || world.eligible(p).is_empty())
                .map(|p| (PoolLabels { pool: p.name.clone() }, p.addresses.iter().filter(|a| !o.owners.contains_key(a)).count() as i64)),
        );
        for pool in &world.pools {
            let moved = pool.addresses.iter().filter(|a| matches!((before.get(a), o.owners.get(a)), (Some(x), Some(y)) if x != y)).count();
            self.pool_owner_changes.with(&PoolLabels { pool: pool.name.clone() }, |c| c.inc_by(moved as u64));
        }
        let pools: BTreeSet<&str> = world.pools.iter().map(|p| p.name.as_str()).collect();
        self.pool_owner_changes.retain(|l| pools.contains(l.pool.as_str()));
        let peers = || m.tracked.iter().filter(|n| *n != m.me);
        self.peer_live.set_all(peers().map(|n| (PeerLabels { peer: n.clone() }, m.live.contains(n) as i64)));
        self.heartbeat.gaps.track(peers().map(String::as_str), Instant::now());
        self.dead_after.set(world.failover.dead_after.as_secs_f64());
    }
}

/// Where the agent's model comes from: some metrics exist in one mode only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    File,
    Kubernetes,
}

/// Names the data path's counters are labelled with: what the agent programmed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub services: BTreeMap<ServiceAddr, String>,
    /// By [`crate::dataplane::backend_key`], as the backends' counters are.
    pub nodes: BTreeMap<Ipv4Addr, String>,
}

/// The agent's own metrics (the BPF counters are read at scrape time by `BpfCounters`).
pub struct Metrics {
    pub registry: Registry,
    pub liveness: Liveness,
    /// 1 healthy, 0 not, per backend node and health check.
    pub backend_healthy: Tracked<BackendLabels, Gauge>,
    pub ring_updates: Tracked<ServiceLabels, Counter>,
    pub ring_slots_written: Tracked<ServiceLabels, Counter>,
    /// 1 for each service-port failing open (every backend's check down).
    pub service_failing_open: Tracked<ServiceLabels, Gauge>,
    /// One batch of service changes written to the maps (sweep excluded).
    pub map_write_seconds: Histogram,
    /// The flow-table sweep that follows a batch which took backends from services.
    pub flow_sweep_seconds: Histogram,
    pub flows_evicted: Counter,
    pub health_to_maps_seconds: Histogram,
    /// File mode only.
    pub config_reloads: Family<ResultLabels, Counter>,
    pub config_valid: Gauge,
    /// Service-ports the model wants that are not programmed (no room, no id).
    pub services_unprogrammed: Gauge,
    pub services_programmed: Gauge,
    pub services_capacity: Gauge,
    pub ring_slots_used: Gauge,
    pub ring_slots_capacity: Gauge,
    pub rings: Gauge,
    pub host_problems: Gauge,
    /// Addresses of each pool by state; written by the elected controller only.
    pub pool_addresses: Tracked<PoolStateLabels, Gauge>,
    /// What the data path's counters are labelled with (updated by `publish`).
    pub names: Arc<RwLock<Names>>,
    pub ready: Arc<AtomicBool>,
    /// Waiting, idle, on a node the model leaves out (a kubeadm control plane
    /// labelled exclude-from-external-load-balancers, a Node not Ready): ready too,
    /// so that the DaemonSet's rollout does not wait on a node vip does not serve.
    pub idle: Arc<AtomicBool>,
}

impl Metrics {
    pub fn new(mode: Mode) -> Self {
        Self::with_modes(&[mode])
    }

    /// The metrics of every mode in `modes` (all of them for the reference).
    fn with_modes(modes: &[Mode]) -> Self {
        let mut registry = Registry::default();
        let buckets = || Histogram::new(exponential_buckets(1e-5, 2.5, 15)); // 10 µs .. ~5 s
        let m = Self {
            liveness: Liveness {
                vip_owner: Tracked::default(),
                vips_held: Gauge::default(),
                vip_held: Tracked::default(),
                pool_held: Tracked::default(),
                pool_unowned: Tracked::default(),
                pool_owner_changes: Tracked::default(),
                peer_live: Tracked::default(),
                dead_after: Gauge::default(),
                arp_conflicts: Counter::default(),
                arp_foreign: Tracked::default(),
                arp_checks: Counter::default(),
                heartbeat: Default::default(),
                last_turn_ns: Arc::new(AtomicU64::new(monotonic_ns())),
            },
            backend_healthy: Tracked::default(),
            ring_updates: Tracked::default(),
            ring_slots_written: Tracked::default(),
            service_failing_open: Tracked::default(),
            map_write_seconds: buckets(),
            flow_sweep_seconds: buckets(),
            flows_evicted: Counter::default(),
            health_to_maps_seconds: buckets(),
            config_reloads: Family::default(),
            config_valid: Gauge::default(),
            services_unprogrammed: Gauge::default(),
            services_programmed: Gauge::default(),
            services_capacity: Gauge::default(),
            ring_slots_used: Gauge::default(),
            ring_slots_capacity: Gauge::default(),
            rings: Gauge::default(),
            host_problems: Gauge::default(),
            pool_addresses: Tracked::default(),
            names: Arc::default(),
            ready: Arc::new(AtomicBool::new(false)),
            idle: Arc::new(AtomicBool::new(false)),
            registry: Registry::default(),
        };
        let build = Family::<BuildLabels, Gauge>::default();
        build.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION").to_owned(), revision: revision().to_owned() }).set(1);
        registry.register("vip_build_info", "The agent's version and the git revision it was built from (always 1)", build);
        let l = &m.liveness;
        registry.register("vip_owner", "Owner node of each VIP as this node sees it (1 = owns it)", l.vip_owner.family());
        registry.register("vip_vips_held", "VIPs this node holds", l.vips_held.clone());
        registry.register(
            "vip_held",
            "1 for each VIP this node answers for (ARP, or lo for announce: lo pools); an owned VIP whose pool has no interface here is not held",
            l.vip_held.family(),
        );
        registry.register("vip_pool_vips_held", "VIPs of each pool this node holds", l.pool_held.family());
        registry.register(
            "vip_pool_vips_unowned",
            "VIPs of each pool that no live eligible node owns, as this node sees it (exported while this node is a live member, and by every node for a pool no node of the model may hold)",
            l.pool_unowned.family(),
        );
        registry.register(
            "vip_pool_owner_changes",
            "Owner changes of each pool's VIPs seen by this node (failovers, rebalancing)",
            l.pool_owner_changes.family(),
        );
        registry.register("vip_arp_conflicts", "ARP replies or gratuitous ARP from another MAC claiming a VIP this node holds", l.arp_conflicts.clone());
        registry.register(
            "vip_arp_foreign_answers",
            "For each VIP this node holds that a peer checked (the ARP self-check): how many MACs other than this node's answered the peer's ARP request for it, at the last check (0: only this node)",
            l.arp_foreign.family(),
        );
        registry.register(
            "vip_arp_checks",
            "ARP requests this node sent to check who answers for VIPs other nodes hold (the ARP self-check)",
            l.arp_checks.clone(),
        );
        registry.register(
            "vip_peer_live",
            "Each peer this node exchanges heartbeats with: 1 heard within deadAfter, 0 dead (or leaving to restart)",
            l.peer_live.family(),
        );
        registry.register("vip_heartbeat_dead_after_seconds", "deadAfter: how long a silent peer is presumed alive", l.dead_after.clone());
        registry.register(
            "vip_liveness_stalls",
            "Heartbeat turns held back because the liveness loop or the heartbeat task had stalled (should stay 0)",
            l.heartbeat.stalls.clone(),
        );
        registry.register_collector(Box::new(GapCollector(l.heartbeat.gaps.clone())));
        registry.register(
            "vip_heartbeats_rejected",
            "Heartbeat datagrams that changed nothing, by reason (unknown_sender, malformed, unknown_key, bad_tag, wrong_name, stale)",
            l.heartbeat.rejected.clone(),
        );
        registry.register(
            "vip_backend_healthy",
            "Health of each backend node under each health check (1 healthy, 0 down or joining: a node newly probed is 0 until it passes `rise` probes)",
            m.backend_healthy.family(),
        );
        registry.register("vip_ring_updates", "Maglev ring changes per service-port", m.ring_updates.family());
        registry.register(
            "vip_service_failing_open",
            "1 for each service-port whose health check has every backend down and that fails open: new connections go to all of them (the pool's noHealthyBackend: FailOpen)",
            m.service_failing_open.family(),
        );
        registry.register(
            "vip_ring_slots_written",
            "Ring slots written per service-port (0 when it joined a ring another service had)",
            m.ring_slots_written.family(),
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
        if modes.contains(&Mode::File) {
            registry.register("vip_config_reloads", "Config file loads by result (ok, error)", m.config_reloads.clone());
            registry.register("vip_config_valid", "1 when the last config file read was valid, 0 when it was rejected", m.config_valid.clone());
        }
        if modes.contains(&Mode::Kubernetes) {
            registry.register(
                "vip_kube_api_reachable",
                "1 while the Kubernetes API answers this agent's watches and lease requests, 0 while they fail",
                crate::k8s::api_health().reachable.clone(),
            );
            registry.register("vip_kube_api_errors", "Failed Kubernetes API requests (watches, lease)", crate::k8s::api_health().errors.clone());
            registry.register(
                "vip_pool_addresses",
                "Addresses of each pool by state (total, allocated, free); exported by the elected leader only",
                m.pool_addresses.family(),
            );
        }
        registry.register(
            "vip_services_unprogrammed",
            "Service-ports the model wants that could not be programmed (see /status for why); retried",
            m.services_unprogrammed.clone(),
        );
        registry.register("vip_services_programmed", "Service-ports programmed in the data path", m.services_programmed.clone());
        registry.register("vip_services_capacity", "Service-ports the data path can hold (lb4_services)", m.services_capacity.clone());
        registry.register("vip_ring_slots_used", "Slots of lb4_ring in use (rings are shared between services with equal rings)", m.ring_slots_used.clone());
        registry.register("vip_ring_slots_capacity", "Slots of lb4_ring (--ring-capacity)", m.ring_slots_capacity.clone());
        registry.register("vip_rings", "Distinct Maglev rings in lb4_ring", m.rings.clone());
        registry.register(
            "vip_host_problems",
            "Problems of this host that keep it from taking its VIP traffic (listed in /status and vip-agent inspect)",
            m.host_problems.clone(),
        );
        Self { registry, ..m }
    }

    /// Names the data path's counters after what the agent programmed.
    pub fn set_names(&self, names: Names) {
        *self.names.write().unwrap_or_else(|e| e.into_inner()) = names;
    }
}

/// `vip_heartbeat_gap_max_seconds`, computed at scrape time (the current silence counts).
#[derive(Debug)]
struct GapCollector(Gaps);

impl Collector for GapCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let gaps = self.0.max_at(Instant::now());
        let help = format!(
            "Longest time without a heartbeat from each peer over the last {} s, the current silence included",
            crate::ha::heartbeat::GAP_WINDOW.as_secs()
        );
        let mut fam = enc.encode_descriptor("vip_heartbeat_gap_max_seconds", &help, None, ConstGauge::new(0.0).metric_type())?;
        for (peer, g) in gaps {
            ConstGauge::new(g).encode(fam.encode_family(&PeerLabels { peer })?)?;
        }
        Ok(())
    }
}

/// The data path's per-CPU counters, summed at scrape time from the pinned maps.
#[derive(Debug)]
pub struct BpfCounters {
    pin_dir: PathBuf,
    /// Opened lazily (and again after an error): the maps may be re-created.
    dp: Mutex<Option<DebugDp>>,
    names: Arc<RwLock<Names>>,
}

struct DebugDp(Dataplane);
impl std::fmt::Debug for DebugDp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dataplane")
    }
}

impl BpfCounters {
    pub fn new(pin_dir: PathBuf, names: Arc<RwLock<Names>>) -> Self {
        Self { pin_dir, dp: Mutex::new(None), names }
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
        let names = self.names.read().unwrap_or_else(|e| e.into_inner());
        encode_counters(&mut enc, &c, &names)
    }
}

/// The data path's counters as metric families (at scrape time, and for the
/// reference). Services and backends are labelled with what the agent named
/// them (ids are re-used); those it has not named (yet) are left out.
fn encode_counters(enc: &mut DescriptorEncoder, c: &crate::dataplane::Counters, names: &Names) -> std::fmt::Result {
    let reason = |(r, v): (&&'static str, &(u64, u64)), bytes: bool| (ReasonLabels { reason: (*r).to_owned() }, if bytes { v.1 } else { v.0 });
    const_counter_family(enc, "vip_xdp_packets", "Packets seen by the XDP program, by reason", c.reasons.iter().map(|x| reason(x, false)))?;
    const_counter_family(enc, "vip_xdp_bytes", "Bytes seen by the XDP program, by reason", c.reasons.iter().map(|x| reason(x, true)))?;
    let services = labelled(&c.services, |id| {
        let a = c.service_addrs.get(&id)?;
        Some(ServiceLabels::new(names.services.get(a)?, a))
    });
    let backends = labelled(&c.backends, |id| Some(NodeLabels { node: names.nodes.get(c.backend_addrs.get(&id)?)?.clone() }));
    const_counter_family(enc, "vip_service_packets", "Packets balanced per service-port", rows(&services, false))?;
    const_counter_family(enc, "vip_service_bytes", "Bytes balanced per service-port", rows(&services, true))?;
    const_counter_family(enc, "vip_backend_packets", "Packets sent to each backend node", rows(&backends, false))?;
    const_counter_family(enc, "vip_backend_bytes", "Bytes sent to each backend node", rows(&backends, true))?;
    Ok(())
}

/// The packets (or bytes) of each label set.
fn rows<L: Clone>(m: &BTreeMap<L, (u64, u64)>, bytes: bool) -> impl Iterator<Item = (L, u64)> + '_ {
    m.iter().map(move |(l, v)| (l.clone(), if bytes { v.1 } else { v.0 }))
}

/// Per-id counters summed under the labels `name` gives each id.
fn labelled<L: Ord>(by_id: &BTreeMap<u32, (u64, u64)>, name: impl Fn(u32) -> Option<L>) -> BTreeMap<L, (u64, u64)> {
    let mut out: BTreeMap<L, (u64, u64)> = BTreeMap::new();
    for (id, (p, b)) in by_id {
        if let Some(l) = name(*id) {
            let e = out.entry(l).or_default();
            *e = (e.0 + p, e.1 + b);
        }
    }
    out
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
    /// The mode it exists in, when only one.
    pub only: Option<Mode>,
}

/// Every metric the agent exports, read back from its registry's own exposition
/// (both modes), each with the mode it is limited to, if any.
pub fn reference() -> Vec<MetricDoc> {
    let names = |modes: &[Mode]| exposition(modes).into_iter().map(|d| d.name).collect::<BTreeSet<_>>();
    let (file, kube) = (names(&[Mode::File]), names(&[Mode::Kubernetes]));
    let mut all = exposition(&[Mode::File, Mode::Kubernetes]);
    for d in &mut all {
        d.only = match (file.contains(&d.name), kube.contains(&d.name)) {
            (true, false) => Some(Mode::File),
            (false, true) => Some(Mode::Kubernetes),
            _ => None,
        };
    }
    all
}

/// The exposition of the metrics of `modes`, with one series of each labelled
/// family made up so that its labels show.
fn exposition(modes: &[Mode]) -> Vec<MetricDoc> {
    let mut m = Metrics::with_modes(modes);
    let l = &m.liveness;
    let s = String::new;
    l.vip_owner.with(&VipLabels { vip: s(), node: s() }, |_| ());
    l.vip_held.with(&HeldLabels { vip: s(), pool: s() }, |_| ());
    for f in [&l.pool_held, &l.pool_unowned] {
        f.with(&PoolLabels { pool: s() }, |_| ());
    }
    l.pool_owner_changes.with(&PoolLabels { pool: s() }, |_| ());
    l.peer_live.with(&PeerLabels { peer: s() }, |_| ());
    l.arp_foreign.with(&ArpLabels { vip: s() }, |_| ());
    l.heartbeat.gaps.track(["x"], Instant::now());
    let _ = l.heartbeat.rejected.get_or_create(&crate::ha::heartbeat::RejectLabels { reason: s() });
    m.backend_healthy.with(&BackendLabels { node: s(), check: s() }, |_| ());
    let svc = ServiceAddr { vip: Ipv4Addr::UNSPECIFIED.into(), port: 0, protocol: crate::model::Protocol::Tcp };
    for f in [&m.ring_updates, &m.ring_slots_written] {
        f.with(&ServiceLabels::new("", &svc), |_| ());
    }
    m.service_failing_open.with(&ServiceLabels::new("", &svc), |_| ());
    let _ = m.config_reloads.get_or_create(&ResultLabels { result: s() });
    m.pool_addresses.with(&PoolStateLabels { pool: s(), state: s() }, |_| ());
    #[derive(Debug)]
    struct Sample(ServiceAddr);
    impl Collector for Sample {
        fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
            let one = BTreeMap::from([(0, (0, 0))]);
            let c = crate::dataplane::Counters {
                reasons: [("x", (0, 0))].into(),
                services: one.clone(),
                backends: one,
                service_addrs: [(0, self.0)].into(),
                backend_addrs: [(0, Ipv4Addr::UNSPECIFIED)].into(),
            };
            let names = Names { services: [(self.0, "x".into())].into(), nodes: [(Ipv4Addr::UNSPECIFIED, "x".into())].into() };
            encode_counters(&mut enc, &c, &names)
        }
    }
    m.registry.register_collector(Box::new(Sample(svc)));
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
            docs.push(MetricDoc { name: name.to_owned(), kind: String::new(), labels: Vec::new(), help: help.to_owned(), only: None });
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
    use crate::{agent::desired::ownership, config::parse, model::Protocol};

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

    fn scrape(r: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, r).unwrap();
        text
    }

    /// The series of `family` in `text`, as their label text, sorted.
    fn series<'a>(text: &'a str, family: &str) -> Vec<&'a str> {
        let mut v: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix(family)?.strip_prefix('{')?.split_once('}').map(|(labels, _)| labels)).collect();
        v.sort();
        v
    }

    const CFG: &str = r#"
nodes:
  - {name: lb1, address: 198.18.0.1, mac: "02:00:00:00:00:01"}
  - {name: lb2, address: 198.18.0.2, mac: "02:00:00:00:00:02"}
pools:
  - {name: a, addresses: [198.18.1.1-198.18.1.2]}
  - {name: b, addresses: [198.18.2.1]}
services: []
"#;

    #[test]
    fn series_of_pools_vips_and_peers_that_went_are_removed() {
        let m = Metrics::new(Mode::File);
        let l = &m.liveness;
        let both = parse(CFG).unwrap();
        let live: BTreeSet<String> = ["lb1".to_owned(), "lb2".to_owned()].into();
        let o = ownership(&both, "lb1", &live);
        l.record(&both, &BTreeMap::new(), &o, &Members { me: "lb1", tracked: &live, live: &live });
        let t = scrape(&m.registry);
        assert_eq!(series(&t, "vip_owner").len(), 3, "{t}");
        assert_eq!(series(&t, "vip_pool_owner_changes_total"), [r#"pool="a""#, r#"pool="b""#], "{t}");
        assert_eq!(series(&t, "vip_peer_live"), [r#"peer="lb2""#], "{t}");
        assert!(t.contains(r#"vip_peer_live{peer="lb2"} 1"#), "{t}");
        let held = o.held.len();
        assert!(held > 0 && series(&t, "vip_held").len() == held, "{t}");
        assert!(t.contains(r#"vip_pool_vips_unowned{pool="a"} 0"#), "{t}");

        // Pool b goes, lb2 dies: every VIP left is lb1's, one owner change counted
        // for each that lb2 held; b's series go, lb2 stays a peer (dead).
        let one = parse(&CFG.replace("  - {name: b, addresses: [198.18.2.1]}\n", "")).unwrap();
        let me: BTreeSet<String> = ["lb1".to_owned()].into();
        let o2 = ownership(&one, "lb1", &me);
        l.record(&one, &o.owners, &o2, &Members { me: "lb1", tracked: &live, live: &me });
        let t = scrape(&m.registry);
        assert_eq!(series(&t, "vip_owner"), [r#"vip="198.18.1.1",node="lb1""#, r#"vip="198.18.1.2",node="lb1""#], "{t}");
        let moved_a = o.owners.iter().filter(|(v, n)| one.pool_of(**v).is_some() && *n == "lb2").count();
        assert!(t.contains(&format!(r#"vip_pool_owner_changes_total{{pool="a"}} {moved_a}"#)), "{t}");
        assert_eq!(series(&t, "vip_pool_owner_changes_total"), [r#"pool="a""#], "{t}");
        assert_eq!(series(&t, "vip_pool_vips_held"), [r#"pool="a""#], "{t}");
        assert!(t.contains(r#"vip_peer_live{peer="lb2"} 0"#), "{t}");
        assert!(series(&t, "vip_held").iter().all(|s| s.ends_with(r#"pool="a""#)) && series(&t, "vip_held").len() == 2, "{t}");

        // lb2 leaves the model: no longer a peer, nor a series (of liveness or gaps).
        let alone = parse(&CFG.replace("  - {name: lb2, address: 198.18.0.2, mac: \"02:00:00:00:00:02\"}\n", "")).unwrap();
        l.record(&alone, &o2.owners, &ownership(&alone, "lb1", &me), &Members { me: "lb1", tracked: &me, live: &me });
        let t = scrape(&m.registry);
        assert!(series(&t, "vip_peer_live").is_empty() && series(&t, "vip_heartbeat_gap_max_seconds").is_empty(), "{t}");
    }

    #[test]
    fn a_node_that_is_no_member_says_only_what_the_model_tells_of_unowned_vips() {
        let m = Metrics::new(Mode::Kubernetes);
        let w = parse(CFG).unwrap();
        let none = BTreeSet::new();
        let tracked: BTreeSet<String> = ["lb1".to_owned()].into();
        m.liveness.record(&w, &BTreeMap::new(), &ownership(&w, "lb1", &none), &Members { me: "lb1", tracked: &tracked, live: &none });
        assert!(series(&scrape(&m.registry), "vip_pool_vips_unowned").is_empty());
        // A member whose pools have no eligible live node: all of them unowned.
        let only_me: BTreeSet<String> = ["lb1".to_owned()].into();
        let w2 = parse(&CFG.replace("[198.18.2.1]}", "[198.18.2.1], nodeSelector: {role: none}}")).unwrap();
        m.liveness.record(&w2, &BTreeMap::new(), &ownership(&w2, "lb1", &only_me), &Members { me: "lb1", tracked: &tracked, live: &only_me });
        let t = scrape(&m.registry);
        assert!(t.contains(r#"vip_pool_vips_unowned{pool="b"} 1"#) && t.contains(r#"vip_pool_vips_unowned{pool="a"} 0"#), "{t}");
        // No member (excluded itself, say), but pool b admits no node of the model:
        // every agent knows b's VIPs are unowned, and says so.
        m.liveness.record(&w2, &BTreeMap::new(), &ownership(&w2, "lb1", &none), &Members { me: "lb1", tracked: &tracked, live: &none });
        let t = scrape(&m.registry);
        assert_eq!(series(&t, "vip_pool_vips_unowned"), [r#"pool="b""#], "{t}");
        assert!(t.contains(r#"vip_pool_vips_unowned{pool="b"} 1"#), "{t}");
    }

    #[test]
    fn data_path_counters_are_labelled_by_name_never_by_id() {
        let web = ServiceAddr { vip: "198.18.1.1".parse().unwrap(), port: 80, protocol: Protocol::Tcp };
        let dns = ServiceAddr { vip: "198.18.1.1".parse().unwrap(), port: 53, protocol: Protocol::Udp };
        let (b1, b2): (Ipv4Addr, Ipv4Addr) = ("198.18.0.11".parse().unwrap(), "198.18.0.12".parse().unwrap());
        let c = crate::dataplane::Counters {
            reasons: [("forwarded", (5, 500))].into(),
            // Id 9: a service another agent left, not named by this one.
            services: [(3, (7, 700)), (4, (1, 100)), (9, (2, 200))].into(),
            backends: [(0, (4, 400)), (1, (3, 300))].into(),
            service_addrs: [(3, web), (4, dns), (9, ServiceAddr { port: 443, ..web })].into(),
            backend_addrs: [(0, b1), (1, b2)].into(),
        };
        let names =
            Names { services: [(web, "default/web".into()), (dns, "kube-system/dns".into())].into(), nodes: [(b1, "b1".into()), (b2, "b2".into())].into() };
        #[derive(Debug)]
        struct C(crate::dataplane::Counters, Arc<RwLock<Names>>);
        impl Collector for C {
            fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
                encode_counters(&mut enc, &self.0, &self.1.read().unwrap())
            }
        }
        let names = Arc::new(RwLock::new(names));
        let mut r = Registry::default();
        r.register_collector(Box::new(C(c, names.clone())));
        let t = scrape(&r);
        assert!(t.contains(r#"vip_service_packets_total{service="default/web",vip="198.18.1.1",port="80",protocol="tcp"} 7"#), "{t}");
        assert!(t.contains(r#"vip_service_bytes_total{service="kube-system/dns",vip="198.18.1.1",port="53",protocol="udp"} 100"#), "{t}");
        assert_eq!(series(&t, "vip_service_packets_total").len(), 2, "the unnamed id is left out: {t}");
        assert!(t.contains(r#"vip_backend_packets_total{node="b1"} 4"#) && t.contains(r#"vip_backend_bytes_total{node="b2"} 300"#), "{t}");
        assert!(!t.contains("id="), "{t}");
        // The service goes from the agent's names: its series goes.
        names.write().unwrap().services.remove(&web);
        let t = scrape(&r);
        assert!(!t.contains("default/web"), "{t}");
    }

    #[test]
    fn tracked_families_keep_only_what_exists() {
        let t: Tracked<PoolLabels, Gauge> = Tracked::default();
        let p = |n: &str| PoolLabels { pool: n.into() };
        t.set_all([(p("a"), 1), (p("b"), 2)]);
        t.set_all([(p("b"), 3)]);
        assert_eq!(t.labels(), HashSet::from([p("b")]));
        assert!(t.family().get(&p("a")).is_none());
        assert_eq!(t.family().get(&p("b")).map(|g| g.get()), Some(3));
        let c: Tracked<PoolLabels, Counter> = Tracked::default();
        c.with(&p("x"), |c| c.inc());
        c.retain(|l| l.pool != "x");
        assert!(c.family().get(&p("x")).is_none() && c.labels().is_empty());
    }

    #[test]
    fn build_info_names_the_version() {
        let t = scrape(&Metrics::new(Mode::File).registry);
        assert!(t.contains(&format!(r#"vip_build_info{{version="{}",revision="{}"}} 1"#, env!("CARGO_PKG_VERSION"), revision())), "{t}");
        assert!(t.contains("vip_config_valid") && !t.contains("vip_kube_api") && !t.contains("vip_pool_addresses"), "{t}");
        let k = scrape(&Metrics::new(Mode::Kubernetes).registry);
        assert!(!k.contains("vip_config_valid") && !k.contains("vip_config_reloads") && k.contains("vip_kube_api_reachable"), "{k}");
    }
}
