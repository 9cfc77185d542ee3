//! The agent's Prometheus metrics: the label sets, the handles each part of the
//! agent writes, and the registry they are exported from (served by
//! `crate::http`). Families computed at scrape time (the data path's counters,
//! heartbeat gaps) are in `collect`; the Kubernetes side registers its own
//! (`k8s::register_metrics`); the reference (docs/reference/metrics.md) is read
//! back from the registry by `crate::reference`.
mod collect;

use std::{
    collections::{BTreeMap, HashSet},
    hash::Hash,
    net::Ipv4Addr,
    sync::{
        atomic::{AtomicBool, AtomicU64},
        Arc, Mutex, RwLock,
    },
};

pub(crate) use collect::encode_counters;
pub use collect::BpfCounters;
use collect::GapCollector;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{exponential_buckets, Histogram},
    },
    registry::Registry,
};

use crate::{clock::monotonic_ns, ha::heartbeat::PeerLabels, model::ServiceAddr};

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct SenderLabels {
    pub sender: String,
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
pub struct LivenessMetrics {
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

/// The agent's own metrics (the BPF counters are read at scrape time by
/// [`BpfCounters`]; the Kubernetes side registers its own: `k8s::register_metrics`).
pub struct Metrics {
    pub registry: Registry,
    pub liveness: LivenessMetrics,
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
    /// 1 for the way this agent's ARP and neighbour frames leave the node.
    pub arp_sender: Family<SenderLabels, Gauge>,
    pub settings_mismatched_peers: Gauge,
    /// `announce: bgp`: the sessions and routes of this node's FRR.
    pub bgp: crate::bgp::frr::Metrics,
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
    pub(crate) fn with_modes(modes: &[Mode]) -> Self {
        let mut registry = Registry::default();
        let buckets = || Histogram::new(exponential_buckets(1e-5, 2.5, 15)); // 10 µs .. ~5 s
        let m = Self {
            liveness: LivenessMetrics {
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
            arp_sender: Family::default(),
            settings_mismatched_peers: Gauge::default(),
            bgp: Default::default(),
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
        registry.register(
            "vip_arp_sender",
            "1 for how this agent's gratuitous ARP, neighbour advertisements and ARP checks leave the node: xdp (through the vip_xmit program) or packet (a packet socket; also where the kernel refused XDP transmit, as the log says)",
            m.arp_sender.clone(),
        );
        registry.register(
            "vip_settings_mismatched_peers",
            "Peers whose cluster-wide settings (failover timers, gratuitous ARP defaults, Maglev seed) differ from this agent's, as their heartbeats tell (listed in /status and vip-agent inspect)",
            m.settings_mismatched_peers.clone(),
        );
        registry.register(
            "vip_bgp_session_up",
            "announce: bgp: 1 for each BGP session of this node's FRR in state Established, 0 for the others (read from vtysh every 5 s)",
            m.bgp.session_up.family(),
        );
        registry.register("vip_bgp_prefixes_sent", "announce: bgp: routes this node's FRR sends each peer", m.bgp.prefixes_sent.family());
        registry.register(
            "vip_bgp_prefixes_received",
            "announce: bgp: routes each peer sent that this node's FRR accepted (none: it imports nothing)",
            m.bgp.prefixes_received.family(),
        );
        registry.register(
            "vip_bgp_routes",
            "announce: bgp: VIPs in this node's FRR configuration (its held VIPs of announce: bgp pools)",
            m.bgp.advertised.clone(),
        );
        registry.register(
            "vip_bgp_reloads",
            "announce: bgp: FRR configurations applied by frr-reload.py, by result (an error is in the log and tried again every 5 s)",
            m.bgp.reloads.clone(),
        );
        Self { registry, ..m }
    }

    /// Names the data path's counters after what the agent programmed.
    pub fn set_names(&self, names: Names) {
        *self.names.write().unwrap_or_else(|e| e.into_inner()) = names;
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use prometheus_client::registry::Registry;

    pub fn scrape(r: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, r).unwrap();
        text
    }

    /// The series of `family` in `text`, as their label text, sorted.
    pub fn series<'a>(text: &'a str, family: &str) -> Vec<&'a str> {
        let mut v: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix(family)?.strip_prefix('{')?.split_once('}').map(|(labels, _)| labels)).collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::{counter::Counter, gauge::Gauge};

    use super::{testing::scrape, *};

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
        assert!(!k.contains("vip_config_valid") && !k.contains("vip_config_reloads"), "{k}");
    }
}
