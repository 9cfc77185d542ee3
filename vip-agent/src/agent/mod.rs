//! `vip-agent run`: keeps one node's data path equal to the model. The model
//! comes from a source (the YAML file, re-read on change or SIGHUP, or the
//! Kubernetes API). Two loops share the work:
//! - the liveness thread (`liveness`): heartbeats, VIP ownership, held deadlines,
//!   gratuitous ARP, on a thread and runtime of its own that nothing else blocks;
//! - the programmer (the agent loop, `serve`): health checks and the live set
//!   change what the service maps should hold; it writes the difference as one
//!   batch per change, each service succeeding or failing on its own, and keeps
//!   the last good state on bad input.
//!
//! [`run`] builds everything once (the source, the data path, the tasks, the
//! liveness thread) and hands the `Agent` to that loop.
mod apply;
pub mod desired;
mod feed;
mod interfaces;
mod keys;
pub mod liveness;
mod options;
mod publish;
mod record;
mod serve;
mod silent;

use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::{atomic::Ordering, Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use tokio::{
    signal::unix,
    sync::{mpsc, watch},
};
use tracing::{info, warn};

pub use desired::{desired, health_targets, ownership, Desired, DesiredService, Observed, Ownership};
pub use feed::Source;
pub use liveness::{Membership, Uplinks};
pub use options::{HeartbeatKey, Options};

use crate::{
    config,
    dataplane::{self, Dataplane, ServiceAddr},
    ha,
    health::{self, HealthChange, Target},
    metrics,
    model::{NoHolder, World},
    preflight,
    status::{ConfigStatus, Status},
};

/// How long peers keep a stopping agent's node a backend (its data path and
/// kube-proxy keep serving) for its next agent to start: a pod's restart or a
/// rolling update takes seconds. A node that goes down meanwhile leaves the rings
/// by its failed health checks.
pub const LEAVING_STAY: Duration = Duration::from_secs(30);

struct Agent {
    /// This node's name.
    me: String,
    /// The node's FRR (`announce: bgp`; idle without BGP settings).
    speaker: crate::bgp::frr::Speaker,
    /// The config file (file source): re-read on change and on SIGHUP.
    config_file: Option<PathBuf>,
    /// How VIP traffic is taken in on this node's backends (the host check).
    intake: preflight::Intake,
    /// Where the status JSON is written after every change (read by `inspect`).
    status_file: Option<PathBuf>,
    dp: Dataplane,
    /// Where pools' VIPs are answered here; the program attached there.
    interfaces: interfaces::Interfaces,
    /// The model and the latest placement, for the liveness thread (together:
    /// see `liveness::Inputs`).
    liveness_tx: watch::Sender<liveness::Inputs>,
    /// What the latest placement found wrong (part of the host problems).
    iface_problems: Vec<String>,
    /// The VIPs this node is a backend of in `world` (what the host check reads).
    backed: BTreeSet<IpAddr>,
    world: Arc<World>,
    /// Bytes of the config file last read (valid or not): reloads only on change.
    config_text: Option<String>,
    health: BTreeMap<Target, (bool, String)>,
    /// Targets that joined down and have not come up (or been reported down) yet.
    joining: BTreeSet<Target>,
    monitor: health::Monitor,
    macs: BTreeMap<String, [u8; 6]>,
    /// `macs` for the liveness thread, which records a VIP's previous holder.
    macs_tx: watch::Sender<BTreeMap<String, [u8; 6]>>,
    /// The liveness thread's latest decision (live set, owners, held VIPs).
    membership: Membership,
    /// Asks silent peers' health targets whether their nodes still serve.
    silent: silent::SilentChecks,
    /// Silent peers whose nodes answered: backends still (see `silent`).
    serving: BTreeSet<String>,
    /// VIP → owner as this node sees it, for the controller (pool status, Events).
    owners_tx: watch::Sender<BTreeMap<IpAddr, String>>,
    /// VIP → its service-ports not programmed, for the controller (pool condition, Events).
    unprogrammed_tx: watch::Sender<BTreeMap<IpAddr, Vec<String>>>,
    /// VIP → why no node holds it, for the controller (pool condition, Events).
    unheld_tx: watch::Sender<BTreeMap<IpAddr, NoHolder>>,
    /// VIP → the nodes its rings spread to, for the VipStatus of the VIPs held here.
    backends_tx: watch::Sender<BTreeMap<IpAddr, Vec<String>>>,
    /// The VIPs and the interfaces they arrive on, for the routing rule that
    /// keeps the stack from routing their frames back (route_guard).
    guard_tx: watch::Sender<crate::route_guard::Guard>,
    /// What the service maps hold (services that failed are absent: retried).
    applied: BTreeMap<ServiceAddr, DesiredService>,
    /// Services the model wants that could not be programmed, with why.
    failed: BTreeMap<ServiceAddr, (String, dataplane::DataplaneError)>,
    unresolved: BTreeSet<String>,
    metrics: metrics::Metrics,
    status: Status,
    status_json: Arc<Mutex<String>>,
    /// Each peer's cluster-wide settings, as its heartbeats last carried them.
    peer_settings: BTreeMap<String, String>,
}

/// The agent's stop: SIGTERM or SIGINT (registered now, so that a signal
/// arriving while the agent starts is not lost).
pub fn stop_signals() -> Result<impl Future<Output = ()>> {
    let mut term = unix::signal(unix::SignalKind::terminate())?;
    let mut int = unix::signal(unix::SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

/// Builds the agent and runs it (`Agent::serve`) until `shutdown` completes
/// (the binary: [`stop_signals`]; tests that run it in-process: their own), then
/// tells the peers it leaves and returns, leaving the data path running on the
/// last state.
pub async fn run(opts: Options, shutdown: impl Future<Output = ()>) -> Result<()> {
    let mut shutdown = std::pin::pin!(shutdown);
    // Consumed here: each part goes to what uses it.
    let Options {
        source,
        node_name: me,
        iface,
        attach_mode,
        pin_dir,
        ring_capacity,
        metrics_addr,
        status_file,
        reload_interval,
        arp_sender,
        arp_check_interval,
        heartbeat_key,
        frr,
    } = opts;
    let mut metrics = metrics::Metrics::new(source.mode());
    let (owners_tx, owners) = watch::channel(BTreeMap::new());
    let (unprogrammed_tx, unprogrammed) = watch::channel(BTreeMap::new());
    let (unheld_tx, unheld) = watch::channel(BTreeMap::new());
    let (backends_tx, backends) = watch::channel(BTreeMap::new());
    let (held_vips_tx, held_vips) = watch::channel(BTreeMap::new());
    let to_controller = feed::ControllerInputs { owners, unprogrammed, unheld, held_vips, backends };
    let feed::Started { world, text, mut feed, api } = feed::start(source, &me, &mut metrics, to_controller).await?;
    for w in config::warnings(&world) {
        warn!("{w}");
    }
    let dp = Dataplane::load(&pin_dir, ring_capacity)?;
    let (on_lo, on_lo_rx) = watch::channel(BTreeSet::new());
    let speaker = crate::bgp::frr::Speaker::spawn(frr, me.clone(), Arc::new(World::default()), on_lo.subscribe(), metrics.bgp.clone());
    ha::loopback::spawn(on_lo_rx)?;
    let (guard_tx, guard_rx) = watch::channel(crate::route_guard::Guard::default());
    crate::route_guard::spawn(guard_rx)?;

    let (health_tx, health) = mpsc::unbounded_channel();
    let (serving_tx, serving) = mpsc::unbounded_channel();
    let status_json = Arc::new(Mutex::new("{}".to_owned()));
    if let Some(addr) = metrics_addr {
        let bound = crate::http::serve(addr, &mut metrics, pin_dir.clone(), status_json.clone(), Duration::from_secs(10)).await?;
        info!(%bound, "serving /metrics /healthz /readyz /status");
    }
    let (keys, key_updates) = keys::start(heartbeat_key, api.as_ref()).await?;
    let world = Arc::new(world);
    let held = dp.held_handle()?;
    let (liveness_tx, liveness_rx) = watch::channel(liveness::Inputs::default());
    let mut agent = Agent {
        speaker,
        interfaces: interfaces::Interfaces::new(iface, attach_mode),
        liveness_tx,
        iface_problems: Vec::new(),
        backed: BTreeSet::new(),
        status: Status { node: me.clone(), config: ConfigStatus { path: feed.origin(), generation: 1, error: None }, ..Default::default() },
        me,
        config_file: feed.file().map(Path::to_path_buf),
        intake: feed.intake(),
        status_file,
        dp,
        world: Arc::new(World::default()),
        config_text: text,
        health: BTreeMap::new(),
        joining: BTreeSet::new(),
        monitor: health::Monitor::new(health_tx),
        macs: BTreeMap::new(),
        macs_tx: watch::channel(BTreeMap::new()).0,
        membership: Membership::default(),
        silent: silent::SilentChecks::new(serving_tx),
        serving: BTreeSet::new(),
        owners_tx,
        unprogrammed_tx,
        unheld_tx,
        backends_tx,
        guard_tx,
        applied: BTreeMap::new(),
        failed: BTreeMap::new(),
        unresolved: BTreeSet::new(),
        metrics,
        status_json,
        peer_settings: BTreeMap::new(),
    };
    if agent.config_text.is_some() {
        agent.metrics.config_valid.set(1);
        agent.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "ok".into() }).inc();
    }
    // The program is attached where the model's pools live before anything is held.
    agent.adopt(world);
    if !agent.wait_until_in_model(&mut feed, shutdown.as_mut()).await {
        return Ok(());
    }
    if agent.interfaces.attached_count() == 0 {
        bail!("the XDP program is attached to no interface: {}", agent.iface_problems.join("; "));
    }
    let (frame_tx, sender) = ha::garp::FrameTx::choose(arp_sender, agent.interfaces.all_native(&agent.dp), agent.interfaces.first_ifindex(), &pin_dir)
        .with_context(|| format!("opening the ARP sender (--arp-sender {arp_sender:?})"))?;
    agent.metrics.arp_sender.get_or_create(&metrics::SenderLabels { sender: format!("{sender:?}").to_lowercase() }).set(1);
    info!(?sender, "gratuitous ARP and ARP requests go out through this sender");
    // Heartbeats first: a restarted agent must be heard again within deadAfter of
    // its predecessor's last heartbeat, whatever the programming below costs. The
    // liveness thread sweeps arp_held and takes what it owns before it returns;
    // then the first programming pass sweeps lb4_services (services deleted while
    // no agent ran go, with their rings), with every node presumed alive until the
    // heartbeats say otherwise.
    let (leave_tx, leave_rx) = watch::channel(None);
    let (peer_settings_tx, peer_settings) = watch::channel(BTreeMap::new());
    let setup = liveness::Setup {
        me: agent.me.clone(),
        held,
        on_lo,
        metrics: agent.metrics.liveness.clone(),
        keys: keys.as_ref().map(|k| k.keys.clone()),
        leave: leave_rx,
        held_vips: held_vips_tx,
        arp_check: arp_check_interval,
        peer_settings: peer_settings_tx,
        node_macs: agent.macs_tx.subscribe(),
    };
    let mut members = liveness::spawn(setup, frame_tx, liveness_rx)?;
    agent.speaker.start();
    agent.membership = members.borrow_and_update().clone();
    agent.owners_tx.send_replace(agent.membership.owners.clone());
    agent.reconcile(None);
    agent.metrics.ready.store(true, Ordering::Relaxed);
    let inputs = serve::Inputs { feed, health, serving, members, peer_settings, keys, key_updates, reload_interval, leave: leave_tx };
    agent.serve(inputs, shutdown).await
}

impl Agent {
    /// Records a probe task's health change; when it counted, the moment it
    /// happened (a stopped task's is dropped, see [`health::Monitor::current`]).
    /// A silent peer's node answered its health targets, or stopped answering:
    /// it stays a backend, or leaves the rings (see `silent`).
    fn take_serving(&mut self, a: silent::Answer) {
        // A late answer about a peer heard again since is moot.
        if !self.membership.silent.contains(&a.node) {
            return;
        }
        let changed = if a.serving { self.serving.insert(a.node.clone()) } else { self.serving.remove(&a.node) };
        if changed {
            if a.serving {
                info!(node = %a.node, "silent peer's node answers its health targets: it stays a backend while its agent is away");
            } else {
                warn!(node = %a.node, "silent peer's node no longer answers its health targets");
            }
            self.reconcile(None);
        }
    }

    fn take_health(&mut self, ev: HealthChange) -> Option<Instant> {
        if !self.monitor.current(&ev) {
            return None;
        }
        self.joining.remove(&ev.target);
        self.health.insert(ev.target, (ev.up, ev.detail));
        Some(ev.at)
    }

    /// Makes `world` the current model (probes and the liveness thread follow it).
    fn adopt(&mut self, world: Arc<World>) {
        let targets = health_targets(&world);
        let taking_over = desired::taking_over(&self.world, &world, |t| self.health.get(t).is_none_or(|(up, _)| *up));
        self.health.retain(|t, _| targets.contains(t));
        self.joining.retain(|t| targets.contains(t));
        for t in self.monitor.sync_taking_over(targets, &taking_over) {
            let detail = format!("joining: in the rings after {} successful probes", t.check.rise);
            self.health.insert(t.clone(), (false, detail));
            self.joining.insert(t);
        }
        let before = std::mem::replace(&mut self.world, world.clone());
        let me = self.me.clone();
        // Where pools live depends on the pools and this node alone, not on the
        // services and endpoints that change far more often. Interfaces first: the
        // liveness thread then finds the new pools placed.
        let moved = before.pools != world.pools || before.node(&me) != world.node(&me);
        let uplinks = if moved { self.placement() } else { self.liveness_tx.borrow().uplinks.clone() };
        self.speaker.set_world(world.clone());
        // The model and its placement in one message (see `liveness::Inputs`).
        self.liveness_tx.send_replace(liveness::Inputs { world, uplinks });
        let backed = preflight::backed_vips(&self.world, &me);
        if moved || backed != self.backed {
            self.backed = backed;
            self.check_host();
        }
        // A node that left the model gets no more liveness decisions (it holds
        // nothing), but it may be the elected controller: it tells from the model.
        if self.world.node(&me).is_none() {
            self.tell_unheld();
        }
        self.check_settings();
    }

    /// Reports the peers whose cluster-wide settings differ from this node's
    /// (`model::cluster_settings`): in the status, `vip_settings_mismatched_peers`
    /// and a warning when a difference appears. Only peers of the model count.
    fn check_settings(&mut self) {
        let here = crate::model::cluster_settings(&self.world);
        // Called on every model change: one set, not a scan of the nodes per peer.
        let nodes: BTreeSet<&str> = self.world.nodes.iter().map(|n| n.name.as_str()).collect();
        let mut found = Vec::new();
        for (peer, there) in self.peer_settings.iter().filter(|(p, _)| nodes.contains(p.as_str())) {
            let differ = crate::model::settings_differing(&here, there);
            if !differ.is_empty() {
                let each: Vec<String> = differ.iter().map(|(name, here, there)| format!("{name} {there} there, {here} here")).collect();
                found.push(format!("{peer}: {}", each.join(", ")));
            }
        }
        for f in found.iter().filter(|f| !self.status.settings_mismatch.contains(f)) {
            warn!("a peer's cluster-wide settings differ from this node's; every agent must be set alike, or nodes disagree on who is alive and where flows go: {f}");
        }
        if found != self.status.settings_mismatch {
            self.metrics.settings_mismatched_peers.set(found.len() as i64);
            self.status.settings_mismatch = found;
            self.publish();
        }
    }

    /// Tells the controller which VIPs no node holds, and why.
    fn tell_unheld(&self) {
        let m = &self.membership;
        // Out of the model, the last decision's live set and owners are stale: it
        // hears no one, and a pool no node may hold is held by none.
        let stale = (BTreeSet::new(), BTreeMap::new());
        let (live, owners) = if self.world.node(&self.me).is_some() { (&m.live, &m.owners) } else { (&stale.0, &stale.1) };
        let now = desired::unheld(&self.world, &self.me, live, owners);
        self.unheld_tx.send_if_modified(|cur| liveness::replace_if_changed(cur, &now));
    }

    /// Resolves where this node's pools live and attaches the program there
    /// (`interfaces::place`): the uplinks for the current model.
    fn placement(&mut self) -> Arc<Uplinks> {
        let placed = self.interfaces.place(&mut self.dp, &self.world, &self.me);
        self.iface_problems = placed.problems;
        placed.uplinks
    }

    /// A new placement for the same model (the host changed); the liveness thread
    /// follows it.
    fn place(&mut self) {
        let uplinks = self.placement();
        self.liveness_tx.send_if_modified(|cur| {
            let changed = *cur.uplinks != *uplinks;
            if changed {
                cur.uplinks = uplinks;
            }
            changed
        });
    }

    /// Logs what is wrong with this host (the placement's problems and the backed
    /// VIPs' intake) when that changes (it never stops the agent: the node may be
    /// set up after it starts).
    fn check_host(&mut self) {
        let intake = self.intake;
        // ARP sysctls matter where the node is reached (its home interface).
        let home = self.liveness_tx.borrow().uplinks.home.as_ref().map_or_else(|| "all".to_owned(), |l| l.name.clone());
        let facts = preflight::HostFacts::read(&home, self.backed.iter().copied());
        let mut problems = self.iface_problems.clone();
        problems.extend(preflight::problems(&self.backed, intake, &home, &facts));
        for p in problems.iter().filter(|p| !self.status.host_problems.contains(p)) {
            warn!("this host is not ready for its VIP traffic: {p}");
        }
        if problems != self.status.host_problems {
            self.metrics.host_problems.set(problems.len() as i64);
            self.status.host_problems = problems;
            self.publish();
        }
    }

    /// A new decision of the liveness thread: rings follow the live set.
    fn take_membership(&mut self, m: Membership) {
        let live_changed = (&m.tracked, &m.live) != (&self.membership.tracked, &self.membership.live);
        self.owners_tx.send_if_modified(|cur| liveness::replace_if_changed(cur, &m.owners));
        self.silent.sync(&m.silent, &self.world);
        // A peer heard again is alive, or leaving: asked no more.
        let was = self.serving.len();
        self.serving.retain(|n| m.silent.contains(n));
        let serving_changed = self.serving.len() != was;
        self.membership = m;
        self.tell_unheld();
        if live_changed || serving_changed {
            self.reconcile(None);
        } else {
            self.publish();
        }
    }
}
