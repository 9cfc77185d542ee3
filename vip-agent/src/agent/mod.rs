//! `vip-agent run`: keeps one node's data path equal to the model. The model
//! comes from a source (the YAML file, re-read on change or SIGHUP, or the
//! Kubernetes API). Two loops share the work:
//! - the liveness thread (`liveness`): heartbeats, VIP ownership, held deadlines,
//!   gratuitous ARP, on a thread and runtime of its own that nothing else blocks;
//! - the programmer (`run` below): health checks and the live set change what
//!   the service maps should hold; it writes the difference as one batch per
//!   change, each service succeeding or failing on its own, and keeps the last
//!   good state on bad input.
mod desired;
pub mod liveness;
pub mod metrics;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    sync::{atomic::Ordering, Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde::{Deserialize, Serialize};
use tokio::{
    signal::unix,
    sync::{mpsc, watch},
};
use tracing::{error, info, warn};

pub use desired::{desired, health_targets, ownership, Desired, DesiredService, Observed, Ownership};
pub use liveness::Membership;

use crate::{
    config,
    dataplane::{self, AttachMode, Dataplane, ServiceAddr, Usage},
    ha::{self, garp::ArpSender},
    health::{self, Target},
    inspect::mac_str,
    model::World,
    neighbour,
};

/// Where the model comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A YAML file, re-read on change and on SIGHUP.
    File(PathBuf),
    /// The Kubernetes API (in-cluster config or KUBECONFIG): Nodes, VipPools,
    /// Services, EndpointSlices. The agent also takes part in the Lease election in
    /// `lease_namespace`; the leader allocates addresses and writes statuses.
    Kubernetes { lease_namespace: String, kubeconfig: Option<PathBuf> },
}

/// How `run` is set up (the CLI fills it).
#[derive(Clone, Debug)]
pub struct Options {
    pub source: Source,
    /// This node's name in the config's `nodes`.
    pub node_name: String,
    /// The uplink the XDP program is attached to and VIPs are answered on.
    pub iface: String,
    pub attach_mode: AttachMode,
    pub pin_dir: PathBuf,
    pub ring_capacity: u32,
    /// /metrics, /healthz, /readyz, /status; None: no HTTP server.
    pub metrics_addr: Option<SocketAddr>,
    /// Where the status JSON is written after every change (read by `inspect`).
    pub status_file: Option<PathBuf>,
    /// How often the config file is checked for changes.
    pub reload_interval: Duration,
    /// How gratuitous ARP and ARP requests leave the node.
    pub arp_sender: ArpSender,
    /// The heartbeat key file (re-read every few seconds: rotation); None: the
    /// segment is trusted and heartbeats go unsigned.
    pub heartbeat_key_file: Option<PathBuf>,
}

/// The agent's view, published as JSON (status file, /status) for `inspect` and humans.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Status {
    pub node: String,
    pub config: ConfigStatus,
    /// VIP → owner node.
    pub owners: BTreeMap<Ipv4Addr, String>,
    pub held: Vec<Ipv4Addr>,
    pub services: Vec<ServiceStatus>,
    /// Service-ports the model wants that could not be programmed, with why
    /// (retried every second and after every change).
    pub unprogrammed: Vec<UnprogrammedStatus>,
    /// How full the data path's tables are.
    pub usage: Usage,
    pub nodes: Vec<NodeStatus>,
    pub health: Vec<HealthStatus>,
    /// Recent health change → maps updated latencies, microseconds (newest last, at most 256).
    pub health_to_maps_us: Vec<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ConfigStatus {
    pub path: PathBuf,
    /// Valid configs applied since start.
    pub generation: u64,
    /// The last rejected file's error, cleared by the next valid one.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub protocol: String,
    /// Backend nodes in the ring now (candidates that are healthy, with a known MAC).
    pub backends: Vec<String>,
    /// Its health check (`HealthStatus::check`), if any.
    pub check: Option<String>,
}

/// A service-port that is not in the data path.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct UnprogrammedStatus {
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub protocol: String,
    pub error: String,
}

/// A node as a backend: its address and the MAC we forward to.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    pub addr: Ipv4Addr,
    /// None: not resolved yet (the node is in no ring until it is).
    pub mac: Option<String>,
}

/// One probe target: a node under one health check. Services sharing a check share
/// the row, so the status grows with nodes × checks, not nodes × services.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HealthStatus {
    pub node: String,
    pub check: String,
    pub healthy: bool,
    pub detail: String,
}

/// A short name of a check: `tcp:80`, `http:80/healthz`.
pub fn check_label(h: &crate::model::HealthCheck) -> String {
    match &h.probe {
        crate::model::Probe::Tcp { port } => format!("tcp:{port}"),
        crate::model::Probe::Http { port, path } => format!("http:{port}{path}"),
    }
}

struct Agent {
    opts: Options,
    dp: Dataplane,
    world: Arc<World>,
    /// The model as the liveness thread sees it.
    world_tx: watch::Sender<Arc<World>>,
    /// Bytes of the config file last read (valid or not): reloads only on change.
    config_text: Option<String>,
    health: BTreeMap<Target, (bool, String)>,
    monitor: health::Monitor,
    macs: BTreeMap<String, [u8; 6]>,
    /// The liveness thread's latest decision (live set, owners, held VIPs).
    membership: Membership,
    /// VIP → owner as this node sees it, for the controller (pool status, Events).
    owners_tx: watch::Sender<BTreeMap<Ipv4Addr, String>>,
    /// VIP → its service-ports not programmed, for the controller (pool condition, Events).
    unprogrammed_tx: watch::Sender<BTreeMap<Ipv4Addr, Vec<String>>>,
    /// What the service maps hold (services that failed are absent: retried).
    applied: BTreeMap<ServiceAddr, DesiredService>,
    /// Services the model wants that could not be programmed, with why.
    failed: BTreeMap<ServiceAddr, (String, String)>,
    unresolved: BTreeSet<String>,
    metrics: metrics::Metrics,
    status: Status,
    status_json: Arc<Mutex<String>>,
}

/// What feeds the loop new models: the file (polled) or the Kubernetes watches.
enum Feed {
    File,
    Kubernetes(watch::Receiver<World>),
}

pub async fn run(opts: Options) -> Result<()> {
    let mut metrics = metrics::Metrics::new();
    let (owners_tx, owners_rx) = watch::channel(BTreeMap::new());
    let (unprogrammed_tx, unprogrammed_rx) = watch::channel(BTreeMap::new());
    let (world, text, mut feed, source_name) = match &opts.source {
        Source::File(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let world = config::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            if world.node(&opts.node_name).is_none() {
                bail!("{}: nodes: this node ({:?}) is not listed; set --node-name to one of the listed names", path.display(), opts.node_name);
            }
            (world, Some(text), Feed::File, path.clone())
        }
        Source::Kubernetes { lease_namespace, kubeconfig } => {
            let client = crate::k8s::kube_client(kubeconfig.as_deref()).await?;
            info!("watching Nodes, VipPools, Services and EndpointSlices");
            let rx = crate::k8s::source::watch_world(client.clone(), World::default()).await;
            let world = rx.borrow().clone();
            let leading = crate::k8s::leader::spawn(client.clone(), crate::k8s::leader::LeaderConfig::new(lease_namespace, &opts.node_name));
            let view =
                crate::k8s::controller::AgentView { owners: owners_rx, pool_addresses: Some(metrics.pool_addresses.clone()), unprogrammed: unprogrammed_rx };
            tokio::spawn(crate::k8s::controller::run(client, opts.node_name.clone(), leading, Duration::from_secs(30), view));
            (world, None, Feed::Kubernetes(rx), PathBuf::from("kubernetes"))
        }
    };
    for w in config::warnings(&world) {
        warn!("{w}");
    }
    let mut dp = Dataplane::load(&opts.pin_dir, opts.ring_capacity)?;
    let attached = dp.attach(&opts.iface, opts.attach_mode)?;
    let (ifindex, mac) = dataplane::iface_info(&opts.iface)?;
    dp.set_iface(ifindex, mac)?;
    info!(iface = %opts.iface, ifindex, mac = %mac_str(&mac), mode = ?attached.mode, "XDP attached (None: kept the existing attachment)");
    let sender = match opts.arp_sender {
        ArpSender::Auto if dp.iface_native(ifindex) => ArpSender::Xdp,
        ArpSender::Auto => ArpSender::Packet,
        s => s,
    };
    let frame_tx = ha::garp::FrameTx::open(sender, &opts.pin_dir)
        .with_context(|| format!("opening the ARP sender ({sender:?}; --arp-sender xdp needs a native attachment, packet needs CAP_NET_RAW)"))?;
    info!(?sender, "gratuitous ARP and ARP requests go out through this sender");
    let (on_lo, on_lo_rx) = watch::channel(BTreeSet::new());
    ha::loopback::spawn(on_lo_rx)?;

    let (health_tx, mut health_rx) = mpsc::unbounded_channel();
    let status_json = Arc::new(Mutex::new("{}".to_owned()));
    if let Some(addr) = opts.metrics_addr {
        let bound = metrics::serve(addr, &mut metrics, opts.pin_dir.clone(), status_json.clone(), Duration::from_secs(10)).await?;
        info!(%bound, "serving /metrics /healthz /readyz /status");
    }
    let mut key_file = match &opts.heartbeat_key_file {
        Some(path) => Some(ha::auth::KeyFile::open(path)?),
        None => {
            warn!("heartbeats are not authenticated (--trusted-segment): anyone on the segment can forge them");
            None
        }
    };
    let world = Arc::new(world);
    let (world_tx, world_rx) = watch::channel(world.clone());
    let held = dp.held_handle()?;
    let mut agent = Agent {
        status: Status { node: opts.node_name.clone(), config: ConfigStatus { path: source_name, generation: 1, error: None }, ..Default::default() },
        opts,
        dp,
        world: Arc::new(World::default()),
        world_tx,
        config_text: text,
        health: BTreeMap::new(),
        monitor: health::Monitor::new(health_tx),
        macs: BTreeMap::new(),
        membership: Membership::default(),
        owners_tx,
        unprogrammed_tx,
        applied: BTreeMap::new(),
        failed: BTreeMap::new(),
        unresolved: BTreeSet::new(),
        metrics,
        status_json,
    };
    agent.metrics.config_valid.set(1);
    agent.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "ok".into() }).inc();
    agent.adopt(world);
    // Heartbeats first: a restarted agent must be heard again within deadAfter of
    // its predecessor's last heartbeat, whatever the programming below costs. The
    // liveness thread sweeps arp_held and takes what it owns before it returns;
    // then the first programming pass sweeps lb4_services (services deleted while
    // no agent ran go, with their rings), with every node presumed alive until the
    // heartbeats say otherwise.
    let setup = liveness::Setup {
        me: agent.opts.node_name.clone(),
        ifindex,
        mac,
        held,
        on_lo,
        metrics: agent.metrics.liveness.clone(),
        keys: key_file.as_ref().map(|k| k.keys.clone()),
    };
    let mut members = liveness::spawn(setup, frame_tx, world_rx)?;
    agent.membership = members.borrow_and_update().clone();
    agent.owners_tx.send_replace(agent.membership.owners.clone());
    agent.reconcile(None);
    agent.metrics.ready.store(true, Ordering::Relaxed);

    // Backends without a known MAC and services that did not fit are retried.
    let mut retry = tokio::time::interval(Duration::from_secs(1));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut resolve = tokio::time::interval(Duration::from_millis(250));
    resolve.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reload = tokio::time::interval(agent.opts.reload_interval);
    // The key file (a mounted Secret is updated in place) is re-read for rotations.
    let mut rekey = tokio::time::interval(Duration::from_secs(5));
    let mut hup = unix::signal(unix::SignalKind::hangup())?;
    let mut term = unix::signal(unix::SignalKind::terminate())?;
    let mut int = unix::signal(unix::SignalKind::interrupt())?;
    loop {
        tokio::select! {
            Some(ev) = health_rx.recv() => {
                agent.health.insert(ev.target.clone(), (ev.up, ev.detail.clone()));
                // Drain what else is queued: one map update for a burst of changes.
                while let Ok(more) = health_rx.try_recv() {
                    agent.health.insert(more.target.clone(), (more.up, more.detail));
                }
                agent.reconcile(Some(ev.at));
            }
            Ok(()) = members.changed() => {
                let m = members.borrow_and_update().clone();
                agent.take_membership(m);
            }
            Some(world) = next_world(&mut feed) => {
                info!("the cluster's model changed; applying");
                agent.status.config.generation += 1;
                agent.adopt(Arc::new(world));
                agent.reconcile(None);
            }
            _ = reload.tick(), if matches!(feed, Feed::File) => agent.reload(false),
            _ = hup.recv(), if matches!(feed, Feed::File) => agent.reload(true),
            _ = resolve.tick(), if !agent.unresolved.is_empty() => agent.reconcile(None),
            _ = retry.tick(), if !agent.failed.is_empty() => agent.reconcile(None),
            _ = rekey.tick(), if key_file.is_some() => {
                if let Some(k) = key_file.as_mut() {
                    match k.reload() {
                        Ok(true) => info!("heartbeat keys re-read from the key file"),
                        Ok(false) => {}
                        Err(e) => warn!("heartbeat key file: {e:#}; keeping the keys read before"),
                    }
                }
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
    }
    // Program and maps stay: held VIPs keep being answered until their deadline, so
    // an agent restarted within the hold time takes over without a gap.
    info!("stopping; the data path keeps running on the last state until held deadlines pass");
    Ok(())
}

impl Agent {
    /// Makes `world` the current model (probes and the liveness thread follow it).
    fn adopt(&mut self, world: Arc<World>) {
        let targets = health_targets(&world);
        self.health.retain(|t, _| targets.contains(t));
        self.monitor.sync(targets);
        self.world = world.clone();
        self.world_tx.send_replace(world);
    }

    /// A new decision of the liveness thread: rings follow the live set.
    fn take_membership(&mut self, m: Membership) {
        let live_changed = (&m.tracked, &m.live) != (&self.membership.tracked, &self.membership.live);
        self.owners_tx.send_if_modified(|cur| liveness::replace_if_changed(cur, &m.owners));
        self.membership = m;
        if live_changed {
            self.reconcile(None);
        } else {
            self.publish();
        }
    }

    /// Re-reads the config file when it changed (or when `force`d by SIGHUP) and
    /// applies it when valid.
    fn reload(&mut self, force: bool) {
        let Source::File(path) = &self.opts.source else { return };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                self.reject(format!("cannot read {}: {e}", path.display()));
                return;
            }
        };
        if !force && self.config_text.as_deref() == Some(text.as_str()) {
            return;
        }
        self.config_text = Some(text.clone());
        let world = match config::parse(&text) {
            Ok(w) => w,
            Err(e) => {
                self.reject(e.to_string());
                return;
            }
        };
        for w in config::warnings(&world) {
            warn!("{w}");
        }
        info!(path = %self.status.config.path.display(), "config changed; applying");
        self.status.config.generation += 1;
        self.status.config.error = None;
        if world.node(&self.opts.node_name).is_none() {
            // Applied all the same: a node removed from the model must stop holding
            // VIPs, not keep the last model and answer beside their new owners.
            warn!(node = %self.opts.node_name, "nodes: this node is not listed any more: it holds no VIP until it is");
            self.status.config.error = Some(format!("nodes: this node ({:?}) is not listed: it holds no VIP", self.opts.node_name));
        }
        self.metrics.config_valid.set(1);
        self.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "ok".into() }).inc();
        self.adopt(Arc::new(world));
        self.reconcile(None);
    }

    fn reject(&mut self, msg: String) {
        error!(path = %self.status.config.path.display(), error = %msg, "config rejected; the last good config keeps running");
        self.status.config.error = Some(msg);
        self.metrics.config_valid.set(0);
        self.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "error".into() }).inc();
        self.publish();
    }

    /// Computes what the service maps should hold and writes the difference
    /// (outside the async scheduler: map writes are system calls). `since`: the
    /// health change that caused this, for the latency metric.
    fn reconcile(&mut self, since: Option<Instant>) {
        tokio::task::block_in_place(|| self.reconcile_now(since));
    }

    fn reconcile_now(&mut self, since: Option<Instant>) {
        // One read of the neighbour table for every node whose MAC the model lacks.
        let unknown: Vec<&crate::model::Node> = self.world.nodes.iter().filter(|n| n.mac.is_none() && n.name != self.opts.node_name).collect();
        let table = if unknown.is_empty() { String::new() } else { neighbour::table() };
        for n in unknown {
            match neighbour::parse_proc_arp(&table, n.addr) {
                Some(m) => {
                    self.macs.insert(n.name.clone(), m);
                }
                None if !self.macs.contains_key(&n.name) => neighbour::solicit(n.addr),
                None => {}
            }
        }
        let health: BTreeMap<Target, bool> = self.health.iter().map(|(t, (up, _))| (t.clone(), *up)).collect();
        let m = &self.membership;
        let want = desired(&self.world, &Observed { me: &self.opts.node_name, tracked: &m.tracked, live: &m.live, health: &health, macs: &self.macs });
        self.unresolved = want.unresolved;
        // What changed, and what the maps hold that the model no longer has
        // (from the data path's own record, so services left by an earlier agent
        // are swept too).
        let set: BTreeMap<ServiceAddr, &dataplane::ServiceSpec> =
            want.services.iter().filter(|(a, d)| self.applied.get(a) != Some(*d)).map(|(a, d)| (*a, &d.spec)).collect();
        let remove: Vec<ServiceAddr> = self.dp.service_addrs().into_iter().filter(|a| !want.services.contains_key(a)).collect();
        self.applied.retain(|a, _| want.services.contains_key(a));
        self.failed.retain(|a, _| want.services.contains_key(a));
        let mut sweep = dataplane::Sweep::default();
        if !set.is_empty() || !remove.is_empty() {
            match self.dp.apply(&set, &remove, self.world.maglev_seed) {
                Ok(mut done) => {
                    sweep = std::mem::take(&mut done.sweep);
                    self.record(&want.services, &set, done);
                }
                Err(e) => error!("programming services: {e:#}"),
            }
        }
        // Every affected ring is written: that is when traffic follows the change.
        if let Some(at) = since {
            let took = at.elapsed();
            self.metrics.health_to_maps_seconds.observe(took.as_secs_f64());
            let l = &mut self.status.health_to_maps_us;
            l.push(took.as_micros() as u64);
            if l.len() > 256 {
                l.remove(0);
            }
            info!(took_us = took.as_micros() as u64, "health change written to the maps");
        }
        // Then flows pinned to backends their service lost re-hash.
        if !sweep.is_empty() {
            let t = Instant::now();
            match self.dp.sweep(&sweep) {
                Ok(n) => {
                    self.metrics.flow_sweep_seconds.observe(t.elapsed().as_secs_f64());
                    self.metrics.flows_evicted.inc_by(n as u64);
                    info!(evicted = n, us = t.elapsed().as_micros() as u64, "flow table swept");
                }
                Err(e) => error!("sweeping the flow table: {e:#}"),
            }
        }
        self.publish();
    }

    /// Takes note of what one batch did: applied services, failures (logged when
    /// they start or change, not on every retry), metrics.
    fn record(&mut self, want: &BTreeMap<ServiceAddr, DesiredService>, set: &BTreeMap<ServiceAddr, &dataplane::ServiceSpec>, done: dataplane::Applied) {
        for addr in set.keys() {
            let d = &want[addr];
            match done.failed.get(addr) {
                Some(e) => {
                    if self.failed.get(addr).map(|(_, old)| old) != Some(e) {
                        error!(service = %d.name, vip = %addr.vip, port = addr.port, error = %e, "service not programmed; it is retried, every other service goes on");
                    }
                    self.failed.insert(*addr, (d.name.clone(), e.clone()));
                }
                None => {
                    if self.failed.remove(addr).is_some() {
                        info!(service = %d.name, vip = %addr.vip, port = addr.port, "service programmed after all");
                    }
                    self.applied.insert(*addr, d.clone());
                }
            }
        }
        for (addr, slots) in &done.written {
            let l = metrics::ServiceLabels { service: want[addr].name.clone() };
            self.metrics.ring_updates.get_or_create(&l).inc();
            self.metrics.ring_slots_written.get_or_create(&l).inc_by(*slots as u64);
        }
        for addr in &done.removed {
            info!(vip = %addr.vip, port = addr.port, "service removed");
        }
        self.metrics.map_write_seconds.observe(done.write_time.as_secs_f64());
        info!(changed = set.len(), removed = done.removed.len(), failed = done.failed.len(), write_us = done.write_time.as_micros() as u64, "services written");
    }

    /// Refreshes the status (file and /status) and the gauges.
    fn publish(&mut self) {
        let usage = self.dp.usage();
        self.metrics.services_unprogrammed.set(self.failed.len() as i64);
        self.metrics.services_programmed.set(usage.services as i64);
        self.metrics.ring_slots_used.set(usage.ring_slots as i64);
        self.metrics.ring_slots_capacity.set(usage.ring_capacity as i64);
        self.metrics.rings.set(usage.rings as i64);
        let s = &mut self.status;
        s.usage = usage;
        s.owners = self.membership.owners.clone();
        s.held = self.membership.held.iter().copied().collect();
        let checks: BTreeMap<&str, String> = self.world.services.iter().filter_map(|v| Some((v.name.as_str(), check_label(v.health.as_ref()?)))).collect();
        s.services = self
            .applied
            .iter()
            .map(|(a, d)| ServiceStatus {
                name: d.name.clone(),
                vip: a.vip,
                port: a.port,
                protocol: crate::inspect::proto_name(a.proto).to_owned(),
                backends: d.spec.backends.iter().map(|b| b.name.clone()).collect(),
                check: checks.get(d.name.as_str()).cloned(),
            })
            .collect();
        let mut by_vip: BTreeMap<Ipv4Addr, Vec<String>> = BTreeMap::new();
        for (a, (_, e)) in &self.failed {
            by_vip.entry(a.vip).or_default().push(format!("{}/{}: {e}", a.port, crate::inspect::proto_name(a.proto)));
        }
        self.unprogrammed_tx.send_if_modified(|cur| liveness::replace_if_changed(cur, &by_vip));
        s.unprogrammed = self
            .failed
            .iter()
            .map(|(a, (name, e))| UnprogrammedStatus {
                name: name.clone(),
                vip: a.vip,
                port: a.port,
                protocol: crate::inspect::proto_name(a.proto).to_owned(),
                error: e.clone(),
            })
            .collect();
        s.nodes = self
            .world
            .nodes
            .iter()
            .map(|n| NodeStatus { node: n.name.clone(), addr: n.addr, mac: n.mac.or_else(|| self.macs.get(&n.name).copied()).map(|m| mac_str(&m)) })
            .collect();
        s.health.clear();
        self.metrics.backend_healthy.clear();
        for t in health_targets(&self.world) {
            let (healthy, detail) = match self.health.get(&t) {
                Some((up, d)) => (*up, d.clone()),
                None => (true, "no state change yet".into()),
            };
            let check = check_label(&t.check);
            self.metrics.backend_healthy.get_or_create(&metrics::BackendLabels { node: t.node.clone(), check: check.clone() }).set(healthy as i64);
            s.health.push(HealthStatus { node: t.node, check, healthy, detail });
        }
        let json = serde_json::to_string(&self.status).unwrap_or_default();
        if let Some(path) = &self.opts.status_file {
            if let Err(e) = write_atomic(path, &json) {
                warn!("writing status file {}: {e:#}", path.display());
            }
        }
        *self.status_json.lock().unwrap_or_else(|e| e.into_inner()) = json;
    }
}

/// The next model from the Kubernetes watches (pending forever with the file source).
async fn next_world(feed: &mut Feed) -> Option<World> {
    match feed {
        Feed::Kubernetes(rx) => match rx.changed().await {
            Ok(()) => Some(rx.borrow_and_update().clone()),
            Err(_) => std::future::pending().await,
        },
        Feed::File => std::future::pending().await,
    }
}

/// Write to a temporary file and rename, so readers never see half a status.
fn write_atomic(path: &std::path::Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
