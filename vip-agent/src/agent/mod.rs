//! `vip-agent run`: keeps one node's data path equal to the model. The model
//! comes from a source (today the YAML file, re-read on change or SIGHUP); health
//! checks and the live-node view change what is desired; the loop writes only
//! the difference to the pinned maps and keeps the last good state on bad input.
mod desired;
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

pub use desired::{desired, health_targets, Desired, DesiredService, Observed};

use crate::{
    config,
    dataplane::{self, monotonic_ns, AttachMode, Dataplane, ServiceAddr},
    ha::{
        self,
        garp::{ArpSender, Job},
        heartbeat,
    },
    health::{self, Target},
    inspect::mac_str,
    model::{AnnounceMode, World},
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
    ifindex: u32,
    /// Our interface MAC: the sender of gratuitous ARP.
    mac: [u8; 6],
    world: World,
    /// Bytes of the config file last read (valid or not): reloads only on change.
    config_text: Option<String>,
    health: BTreeMap<Target, (bool, String)>,
    monitor: health::Monitor,
    macs: BTreeMap<String, [u8; 6]>,
    /// Nodes alive in the heartbeat view (every node until heartbeats say otherwise).
    live: BTreeSet<String>,
    heartbeat: Option<(heartbeat::Options, watch::Receiver<BTreeSet<String>>)>,
    /// `arp_conflict` packets counted so far (to log new ones).
    conflicts: u64,
    /// The deadline last written to held VIPs (monotonic ns): past it, they went stale.
    deadline: u64,
    /// When backends without a known MAC were last looked up.
    last_resolve: Instant,
    /// The queue of the one task that sends our ARP frames.
    arp_tx: mpsc::UnboundedSender<Job>,
    /// When each held VIP was last announced (its pool's refresh counts from it).
    last_garp: BTreeMap<Ipv4Addr, Instant>,
    /// The VIPs of `announce: lo` pools we hold, for the loopback task.
    on_lo: watch::Sender<BTreeSet<Ipv4Addr>>,
    /// VIP → owner as this node sees it, for the controller (pool status, Events).
    owners_tx: watch::Sender<BTreeMap<Ipv4Addr, String>>,
    applied: Desired,
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
            let view = crate::k8s::controller::AgentView { owners: owners_rx, pool_addresses: Some(metrics.pool_addresses.clone()) };
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
    let arp_tx = ha::garp::spawn_sender(frame_tx, ifindex);
    let (on_lo, on_lo_rx) = watch::channel(BTreeSet::new());
    ha::loopback::spawn(on_lo_rx)?;

    let (health_tx, mut health_rx) = mpsc::unbounded_channel();
    let status_json = Arc::new(Mutex::new("{}".to_owned()));
    if let Some(addr) = opts.metrics_addr {
        let bound = metrics::serve(addr, &mut metrics, opts.pin_dir.clone(), status_json.clone(), Duration::from_secs(10)).await?;
        info!(%bound, "serving /metrics /healthz /readyz /status");
    }
    let live = world.nodes.iter().map(|n| n.name.clone()).collect();
    let mut agent = Agent {
        status: Status { node: opts.node_name.clone(), config: ConfigStatus { path: source_name, generation: 1, error: None }, ..Default::default() },
        opts,
        dp,
        ifindex,
        mac,
        world: World::default(),
        config_text: text,
        health: BTreeMap::new(),
        monitor: health::Monitor::new(health_tx),
        macs: BTreeMap::new(),
        live,
        heartbeat: None,
        conflicts: 0,
        deadline: 0,
        last_resolve: Instant::now(),
        arp_tx,
        last_garp: BTreeMap::new(),
        on_lo,
        owners_tx,
        applied: Desired::default(),
        metrics,
        status_json,
    };
    agent.metrics.config_valid.set(1);
    agent.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "ok".into() }).inc();
    // Conflicts counted before this start are not news.
    agent.conflicts = agent.dp.reason_count(vip_common::Reason::ArpConflict).map_or(0, |c| c.0);
    agent.adopt(world);
    agent.sync_heartbeat().await;
    agent.reconcile(None)?;
    agent.metrics.ready.store(true, Ordering::Relaxed);

    let mut refresh = hold_refresh(&agent.world);
    // Each pool's refresh (at least 1 s) is checked against this finer tick.
    let mut garp_refresh = tokio::time::interval(Duration::from_millis(250));
    let mut watch_conflicts = tokio::time::interval(Duration::from_millis(100));
    let mut reload = tokio::time::interval(agent.opts.reload_interval);
    let mut hup = unix::signal(unix::SignalKind::hangup())?;
    let mut term = unix::signal(unix::SignalKind::terminate())?;
    let mut int = unix::signal(unix::SignalKind::interrupt())?;
    loop {
        agent.metrics.last_turn_ns.store(monotonic_ns(), Ordering::Relaxed);
        tokio::select! {
            Some(ev) = health_rx.recv() => {
                agent.health.insert(ev.target.clone(), (ev.up, ev.detail.clone()));
                // Drain what else is queued: one map update for a burst of changes.
                while let Ok(more) = health_rx.try_recv() {
                    agent.health.insert(more.target.clone(), (more.up, more.detail));
                }
                if let Err(e) = agent.reconcile(Some(ev.at)) {
                    error!("applying a health change: {e:#}");
                }
            }
            Some(live) = next_live(&mut agent.heartbeat) => {
                info!(live = ?live, "live nodes changed");
                let back: Vec<Ipv4Addr> = live.difference(&agent.live).filter_map(|n| agent.world.node(n)).map(|n| n.addr).collect();
                agent.resolve(back);
                agent.live = live;
                if let Err(e) = agent.reconcile(None) {
                    error!("applying a liveness change: {e:#}");
                }
                // Membership changed: while it was split, others may have taken our
                // VIPs and moved clients (a healed partition). Every holder re-asserts.
                agent.announce(agent.applied.held.clone(), true);
            }
            _ = refresh.tick() => {
                if let Err(e) = agent.refresh() {
                    error!("refreshing held VIPs: {e:#}");
                }
            }
            _ = garp_refresh.tick() => agent.refresh_garp(),
            _ = watch_conflicts.tick() => agent.watch_conflicts(),
            Some(world) = next_world(&mut feed) => {
                info!("the cluster's model changed; applying");
                agent.status.config.generation += 1;
                agent.adopt(world);
                agent.sync_heartbeat().await;
                if let Err(e) = agent.reconcile(None) {
                    error!("applying the cluster's model: {e:#}");
                }
            }
            _ = reload.tick(), if matches!(feed, Feed::File) => {
                if agent.reload(false) {
                    agent.sync_heartbeat().await;
                    refresh = hold_refresh(&agent.world);
                }
            }
            _ = hup.recv(), if matches!(feed, Feed::File) => {
                if agent.reload(true) {
                    agent.sync_heartbeat().await;
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
    /// Makes `world` the current model (probes follow it).
    fn adopt(&mut self, world: World) {
        let targets = health_targets(&world);
        self.health.retain(|t, _| targets.contains(t));
        self.monitor.sync(targets);
        self.world = world;
    }

    /// Re-reads the config file when it changed (or when `force`d by SIGHUP);
    /// true when a new valid config was adopted.
    fn reload(&mut self, force: bool) -> bool {
        let Source::File(path) = &self.opts.source else { return false };
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                self.reject(format!("cannot read {}: {e}", path.display()));
                return false;
            }
        };
        if !force && self.config_text.as_deref() == Some(text.as_str()) {
            return false;
        }
        self.config_text = Some(text.clone());
        let world = match config::parse(&text) {
            Ok(w) if w.node(&self.opts.node_name).is_none() => {
                self.reject(format!("nodes: this node ({:?}) is not listed", self.opts.node_name));
                return false;
            }
            Ok(w) => w,
            Err(e) => {
                self.reject(e.to_string());
                return false;
            }
        };
        for w in config::warnings(&world) {
            warn!("{w}");
        }
        info!(path = %self.status.config.path.display(), "config changed; applying");
        self.status.config.generation += 1;
        self.status.config.error = None;
        self.metrics.config_valid.set(1);
        self.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "ok".into() }).inc();
        self.adopt(world);
        if let Err(e) = self.reconcile(None) {
            error!("applying the new config: {e:#}");
        }
        true
    }

    /// (Re)starts the heartbeat task when its settings (our address, the peers
    /// eligible to hold VIPs, timers) changed. With no peer there is none.
    async fn sync_heartbeat(&mut self) {
        let me = self.opts.node_name.clone();
        let f = &self.world.failover;
        let Some(my) = self.world.node(&me) else { return };
        let peers: Vec<(String, SocketAddr)> = self
            .world
            .holders()
            .into_iter()
            .filter(|n| n.name != me)
            .map(|n| (n.name.clone(), SocketAddr::from((n.addr, f.heartbeat_port))))
            .collect();
        let want = heartbeat::Options {
            bind: SocketAddr::from((my.addr, f.heartbeat_port)),
            peers,
            me,
            interval: f.heartbeat_interval,
            dead_after: f.dead_after,
            gate: Some((self.metrics.last_turn_ns.clone(), self.world.announce.hold_time / 2)),
        };
        let same = |a: &heartbeat::Options, b: &heartbeat::Options| {
            (a.bind, &a.peers, a.interval, a.dead_after) == (b.bind, &b.peers, b.interval, b.dead_after)
        };
        if self.heartbeat.as_ref().is_some_and(|(cur, _)| same(cur, &want)) {
            return;
        }
        // Dropping the receiver stops the old task, which then releases the port.
        self.heartbeat = None;
        if want.peers.is_empty() {
            self.live = self.world.nodes.iter().map(|n| n.name.clone()).collect();
            return;
        }
        for attempt in 0..50 {
            match heartbeat::run(want.clone()).await {
                Ok(rx) => {
                    self.live = rx.borrow().clone();
                    info!(bind = %want.bind, peers = want.peers.len(), "heartbeats running");
                    self.heartbeat = Some((want, rx));
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempt < 49 => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => {
                    error!(bind = %want.bind, "cannot start heartbeats: {e}; peers will see this node as dead");
                    return;
                }
            }
        }
    }

    /// Gratuitous ARP for those of `vips` announced by ARP (in the background): on
    /// a `takeover` each pool's count of frames, its interval apart, so switches and
    /// neighbours learn the new owner at once; else one frame (refresh, conflict).
    fn announce(&mut self, vips: BTreeSet<Ipv4Addr>, takeover: bool) {
        let now = Instant::now();
        let mut by_settings: BTreeMap<crate::model::Garp, Vec<_>> = BTreeMap::new();
        for v in vips {
            if self.world.announce_mode(v) == AnnounceMode::Lo {
                continue;
            }
            self.last_garp.insert(v, now);
            by_settings.entry(self.world.garp(v)).or_default().push((v, ha::garp::garp_frame(self.mac, v)));
        }
        for (g, frames) in by_settings {
            let rounds = if takeover { g.count } else { 1 };
            let _ = self.arp_tx.send(Job { frames, rounds, gap: g.interval, what: "gratuitous ARP" });
        }
    }

    /// One gratuitous ARP for each held VIP whose pool's refresh has passed since
    /// it was last announced (switch FDB and neighbour entries age out).
    fn refresh_garp(&mut self) {
        let now = Instant::now();
        let due: BTreeSet<Ipv4Addr> = self
            .applied
            .held
            .iter()
            .filter(|v| self.last_garp.get(v).is_none_or(|t| now.duration_since(*t) >= self.world.garp(**v).refresh))
            .copied()
            .collect();
        if !due.is_empty() {
            self.announce(due, false);
        }
    }

    /// Asks ARP for the addresses of nodes that just came back. After our link was
    /// down the kernel's neighbour entries for them sit INCOMPLETE until its next
    /// retry (up to a second): their heartbeats reach us, ours would not reach them.
    /// The reply to this request completes the entries at once.
    fn resolve(&self, addrs: Vec<Ipv4Addr>) {
        let Some(me) = self.world.node(&self.opts.node_name).map(|n| n.addr) else { return };
        let frames: Vec<_> = addrs.into_iter().map(|a| (a, ha::garp::arp_request_frame(self.mac, me, a))).collect();
        if !frames.is_empty() {
            let _ = self.arp_tx.send(Job { frames, rounds: 1, gap: Duration::ZERO, what: "ARP request" });
        }
    }

    /// Logs and counts ARP replies or gratuitous ARP from another MAC claiming a
    /// VIP we hold (counted by the data path as `arp_conflict`).
    fn watch_conflicts(&mut self) {
        let Ok((n, _)) = self.dp.reason_count(vip_common::Reason::ArpConflict) else { return };
        if n > self.conflicts {
            warn!(new = n - self.conflicts, held = ?self.applied.held, "ARP conflict: another MAC claims a VIP this node holds; re-announcing ours");
            self.metrics.arp_conflicts.inc_by(n - self.conflicts);
            // Whoever claimed it (a partitioned node, a node that woke up) may have
            // pulled clients away; the holder's announcement brings them back.
            self.announce(self.applied.held.clone(), false);
        }
        self.conflicts = n;
    }

    fn reject(&mut self, msg: String) {
        error!(path = %self.status.config.path.display(), error = %msg, "config rejected; the last good config keeps running");
        self.status.config.error = Some(msg);
        self.metrics.config_valid.set(0);
        self.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "error".into() }).inc();
        self.publish();
    }

    /// Re-writes the deadline of every held VIP (fencing: if this stops, they go stale).
    fn refresh(&mut self) -> Result<()> {
        let now = monotonic_ns();
        let last = self.deadline;
        let lapsed = last != 0 && now > last;
        let deadline = now + self.world.announce.hold_time.as_nanos() as u64;
        for vip in &self.applied.held {
            self.dp.hold_vip_flags(self.ifindex, *vip, deadline, held_flags(&self.applied, *vip))?;
        }
        self.deadline = deadline;
        if lapsed && !self.applied.held.is_empty() {
            // We were not running (stopped, starved) and our VIPs went stale; peers
            // may have taken them and moved clients away. Taking them back is a
            // takeover like any other: announce it.
            warn!(stale_ms = (now - last) / 1_000_000, "held VIPs had gone stale; re-announcing them");
            self.announce(self.applied.held.clone(), true);
        }
        // Backends waiting for a MAC: look again (and ask the kernel to resolve
        // them), at most four times a second.
        if !self.applied.unresolved.is_empty() && self.last_resolve.elapsed() >= Duration::from_millis(250) {
            self.last_resolve = Instant::now();
            self.reconcile(None)?;
        }
        Ok(())
    }

    /// Computes what the maps should hold and writes the difference. `since`: the
    /// health change that caused this, for the latency metric.
    fn reconcile(&mut self, since: Option<Instant>) -> Result<()> {
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
        let want = desired(&self.world, &Observed { me: &self.opts.node_name, live: &self.live, health: &health, macs: &self.macs });
        self.write(&want)?;
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
        self.applied = want;
        self.publish();
        Ok(())
    }

    fn write(&mut self, want: &Desired) -> Result<()> {
        let seed = self.world.maglev_seed;
        for (addr, svc) in &want.services {
            if self.applied.services.get(addr) == Some(svc) {
                continue;
            }
            let u = self.dp.set_service(*addr, &svc.backends, svc.table_size, seed).with_context(|| format!("service {} ({addr:?})", svc.name))?;
            let l = metrics::ServiceLabels { service: svc.name.clone() };
            self.metrics.ring_updates.get_or_create(&l).inc();
            self.metrics.ring_slots_written.get_or_create(&l).inc_by(u.slots_written as u64);
            self.metrics.ring_update_seconds.observe(u.elapsed.as_secs_f64());
            info!(service = %svc.name, vip = %addr.vip, port = addr.port, backends = svc.backends.len(), slots = u.slots_written, us = u.elapsed.as_micros() as u64, "ring written");
        }
        let gone: Vec<ServiceAddr> = self.applied.services.keys().filter(|a| !want.services.contains_key(a)).copied().collect();
        for addr in gone {
            self.dp.remove_service(addr)?;
            info!(vip = %addr.vip, port = addr.port, "service removed");
        }
        let deadline = monotonic_ns() + self.world.announce.hold_time.as_nanos() as u64;
        // Taken, or held under another announce mode (its pool changed).
        let taken: BTreeSet<Ipv4Addr> =
            want.held.iter().filter(|v| !self.applied.held.contains(v) || held_flags(&self.applied, **v) != held_flags(want, **v)).copied().collect();
        for vip in &taken {
            self.dp.hold_vip_flags(self.ifindex, *vip, deadline, held_flags(want, *vip))?;
            info!(%vip, on_lo = want.on_lo.contains(vip), "holding VIP");
        }
        self.announce(taken, true);
        self.last_garp.retain(|v, _| want.held.contains(v));
        self.on_lo.send_if_modified(|cur| replace_if_changed(cur, &want.on_lo));
        for vip in self.applied.held.difference(&want.held) {
            self.dp.release_vip(self.ifindex, *vip)?;
            info!(%vip, "released VIP (its pinned flows keep being forwarded)");
        }
        // Entries of VIPs that left every pool (also from before a restart) go entirely.
        for (ifindex, vip, _) in self.dp.held_vips()? {
            if ifindex == self.ifindex && self.world.pool_of(vip).is_none() {
                self.dp.forget_vip(ifindex, vip)?;
                info!(%vip, "forgot VIP (in no pool)");
            }
        }
        for (vip, owner) in &self.applied.owners {
            if want.owners.get(vip) != Some(owner) {
                self.metrics.vip_owner.remove(&metrics::VipLabels { vip: vip.to_string(), node: owner.clone() });
            }
        }
        for (vip, owner) in &want.owners {
            self.metrics.vip_owner.get_or_create(&metrics::VipLabels { vip: vip.to_string(), node: owner.clone() }).set(1);
        }
        self.metrics.vips_held.set(want.held.len() as i64);
        self.metrics.pool_held.clear();
        for pool in &self.world.pools {
            let l = metrics::PoolLabels { pool: pool.name.clone() };
            let held = pool.addresses.iter().filter(|a| want.held.contains(a)).count();
            self.metrics.pool_held.get_or_create(&l).set(held as i64);
            let moved = pool.addresses.iter().filter(|a| matches!((self.applied.owners.get(a), want.owners.get(a)), (Some(o), Some(n)) if o != n)).count();
            if moved > 0 {
                self.metrics.pool_owner_changes.get_or_create(&l).inc_by(moved as u64);
            }
        }
        self.owners_tx.send_if_modified(|cur| replace_if_changed(cur, &want.owners));
        Ok(())
    }

    /// Refreshes the status (file and /status) and the health gauges.
    fn publish(&mut self) {
        let s = &mut self.status;
        s.owners = self.applied.owners.clone();
        s.held = self.applied.held.iter().copied().collect();
        let checks: BTreeMap<&str, String> =
            self.world.services.iter().filter_map(|v| Some((v.name.as_str(), check_label(v.health.as_ref()?)))).collect();
        s.services = self
            .applied
            .services
            .iter()
            .map(|(a, d)| ServiceStatus {
                name: d.name.clone(),
                vip: a.vip,
                port: a.port,
                protocol: if a.proto == vip_common::PROTO_UDP { "udp" } else { "tcp" }.to_owned(),
                backends: d.backends.iter().map(|b| b.name.clone()).collect(),
                check: checks.get(d.name.as_str()).cloned(),
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

/// Sets `cur` to `want` when they differ (cloning only then); whether it did.
fn replace_if_changed<T: Clone + PartialEq>(cur: &mut T, want: &T) -> bool {
    let changed = cur != want;
    if changed {
        cur.clone_from(want);
    }
    changed
}

/// The `arp_held` flags of a held VIP.
fn held_flags(d: &Desired, vip: Ipv4Addr) -> u8 {
    if d.on_lo.contains(&vip) {
        vip_common::HELD_NO_ARP
    } else {
        0
    }
}

/// The ticker that re-writes held deadlines: three times per hold time.
fn hold_refresh(w: &World) -> tokio::time::Interval {
    let mut t = tokio::time::interval(w.announce.hold_time / 3);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
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

/// The next live set from the heartbeat task (pending forever without one).
async fn next_live(hb: &mut Option<(heartbeat::Options, watch::Receiver<BTreeSet<String>>)>) -> Option<BTreeSet<String>> {
    match hb {
        Some((_, rx)) => match rx.changed().await {
            Ok(()) => Some(rx.borrow_and_update().clone()),
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
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
