//! The liveness path: heartbeats, VIP ownership, held-deadline refreshes,
//! gratuitous ARP and ARP-conflict watching, on a thread and runtime of their own.
//!
//! Nothing else the agent does runs here: ring programming, probes, the
//! Kubernetes client and the HTTP server live on the main runtime, and this
//! thread talks to the kernel through its own map descriptors
//! ([`crate::dataplane::HeldVips`]). So a takeover, a refresh or a heartbeat
//! never waits behind a map write, however many services there are; the only
//! input it takes from the rest is the model (a `watch`, never blocking).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result};
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

use super::{desired::ownership, record::Members};

#[cfg(test)]
mod model_check;
pub mod plan;
mod selfcheck;
use crate::{
    clock::monotonic_ns,
    dataplane::{HeldMode, HeldVips},
    ha::{
        self, arpcheck,
        garp::{FrameTx, Job, Order},
        heartbeat, HeldVip,
    },
    links::Link,
    metrics::LivenessMetrics,
    model::{AnnounceMode, World},
};

/// How long a stopping agent waits for its leaving heartbeats to be sent before
/// it releases the VIPs its peers take ([`Liveness::leave`]): 3 datagrams 1 ms apart.
const LEAVE_SEND_WAIT: Duration = Duration::from_millis(100);

/// What the liveness thread decided, for the programmer (rings follow `live`),
/// the status and the controller.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Membership {
    /// Nodes whose liveness heartbeats tell (this node and its peers).
    pub tracked: BTreeSet<String>,
    /// Those of `tracked` alive now.
    pub live: BTreeSet<String>,
    /// Those of `tracked` whose agent left to restart: not alive (their VIPs went
    /// to others), still backends for a while (`heartbeat::Heartbeat::leaving_ms`).
    pub leaving: BTreeSet<String>,
    pub owners: BTreeMap<IpAddr, String>,
    pub held: BTreeSet<IpAddr>,
    pub on_lo: BTreeSet<IpAddr>,
}

/// Where this node's VIPs live and where it is reached, as resolved by the agent
/// from the model and the host's interfaces (`links::resolve`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Uplinks {
    /// Pool name → the interface (or VLAN) its VIPs are answered on here.
    pub by_pool: BTreeMap<String, Link>,
    /// Where this node is reached (`--iface`, else the interface holding its
    /// address): ARP requests for peers that come back leave here.
    pub home: Option<Link>,
}

impl Uplinks {
    /// Every interface whose loss leaves VIPs unanswered or this node unreachable:
    /// the links, their parents, and home.
    pub fn watched(&self) -> BTreeSet<u32> {
        self.by_pool.values().chain(&self.home).flat_map(|l| [l.ifindex, l.xdp_ifindex]).filter(|i| !crate::links::is_vlan_net(*i)).collect()
    }

    /// Where `vip` is answered on this node: its pool's link.
    pub fn link_of(&self, world: &World, vip: IpAddr) -> Option<&Link> {
        self.by_pool.get(&world.pool_of(vip)?.name)
    }

    /// The `arp_held` ifindices VIPs are held under.
    fn held_ifindices(&self) -> BTreeSet<u32> {
        self.by_pool.values().map(|l| l.ifindex).collect()
    }
}

/// What the thread decides from: the model and where its pools live here, always
/// sent together. A placement is computed from a model: were they two channels, the
/// thread could see the new placement with the old model for an instant (a node
/// that just left the model would still own its VIPs, with no interface for them).
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    pub world: Arc<World>,
    pub uplinks: Arc<Uplinks>,
}

/// What the thread needs from the agent's start.
pub struct Setup {
    pub me: String,
    pub held: HeldVips,
    /// The IPv4 VIPs of `announce: lo` pools we hold, for the loopback task.
    pub on_lo: watch::Sender<BTreeSet<IpAddr>>,
    pub metrics: LivenessMetrics,
    /// Heartbeat keys (None: a trusted segment, unsigned heartbeats).
    pub keys: Option<ha::auth::SharedKeys>,
    /// Set when the agent stops: peers are told, and keep this node a backend
    /// for that long (`heartbeat::Options::leave`).
    pub leave: watch::Receiver<Option<Duration>>,
    /// The VIPs held, with since when and their last announcement, for their
    /// `VipStatus`: only ever sent on, never waited for.
    pub held_vips: watch::Sender<BTreeMap<IpAddr, HeldVip>>,
    /// How often each VIP held by another node and checked by this one is asked
    /// for (`run --arp-check-interval`); zero: no ARP self-check.
    pub arp_check: Duration,
    /// Where the peers' cluster-wide settings go, as their heartbeats carry them.
    pub peer_settings: watch::Sender<BTreeMap<String, String>>,
}

/// Starts the thread, which first sweeps `arp_held` (entries of VIPs this node
/// no longer holds are released, those of VIPs in no pool removed) and takes
/// what it owns; returns once that is done. It runs until `world`'s sender is
/// dropped.
pub fn spawn(setup: Setup, frames: FrameTx, inputs: watch::Receiver<Inputs>) -> Result<watch::Receiver<Membership>> {
    let (tx, rx) = watch::channel(Membership::default());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("vip-liveness".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(anyhow::anyhow!("liveness runtime: {e}")));
                    return;
                }
            };
            rt.block_on(async move {
                let arp_tx = ha::garp::spawn_sender(frames);
                let mut l = Liveness::new(setup, inputs, tx, arp_tx);
                let first = l.start().await;
                let ok = first.is_ok();
                let _ = ready_tx.send(first);
                if ok {
                    l.run().await;
                }
            });
        })
        .context("starting the liveness thread")?;
    ready_rx.recv().context("the liveness thread ended at start")??;
    Ok(rx)
}

struct Liveness {
    s: Setup,
    inputs: watch::Receiver<Inputs>,
    world: Arc<World>,
    uplinks: Arc<Uplinks>,
    out: watch::Sender<Membership>,
    arp_tx: mpsc::UnboundedSender<Order>,
    heartbeat: Option<(heartbeat::Options, watch::Receiver<heartbeat::PeerSets>)>,
    tracked: BTreeSet<String>,
    live: BTreeSet<String>,
    leaving: BTreeSet<String>,
    /// What is written to `arp_held`: VIP → how it is announced, and the ifindex
    /// it is held under.
    held: plan::Held,
    owners: BTreeMap<IpAddr, String>,
    /// The deadline last written to held VIPs (monotonic ns): past it, they went stale.
    deadline: u64,
    /// When each held VIP was last announced (its pool's refresh counts from
    /// it), and that time on the wall clock (for its status).
    last_garp: BTreeMap<IpAddr, (Instant, SystemTime)>,
    /// Since when each held VIP is held.
    since: BTreeMap<IpAddr, SystemTime>,
    /// `arp_conflict` packets counted so far (to log new ones).
    conflicts: u64,
    /// Conflicting claims counted per VIP so far (`arp_conflicts`).
    contested: BTreeMap<IpAddr, u64>,
    /// Whether every watched interface (`Uplinks::watched`) is up with a carrier.
    link_up: bool,
    /// Owned VIPs of pools without an interface here (logged once each).
    unplaced: BTreeSet<IpAddr>,
    /// The solicited-node groups of the IPv6 VIPs answered here.
    groups: ha::groups::Groups,
    /// Held VIPs found held at start (see [`HeldVip::adopted`]).
    adopted: BTreeSet<IpAddr>,
    /// The ARP self-check, as checker and as holder.
    arp: selfcheck::SelfCheck,
    /// This node's cluster-wide settings, for its heartbeats.
    settings: watch::Sender<String>,
}

/// The ticker that re-writes held deadlines: three times per hold time.
pub fn hold_refresh(w: &World) -> tokio::time::Interval {
    let mut t = tokio::time::interval(w.announce.hold_time / 3);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

impl Liveness {
    fn new(s: Setup, mut inputs: watch::Receiver<Inputs>, out: watch::Sender<Membership>, arp_tx: mpsc::UnboundedSender<Order>) -> Self {
        let Inputs { world, uplinks } = inputs.borrow_and_update().clone();
        let arp = selfcheck::SelfCheck::new(s.arp_check);
        Self {
            s,
            inputs,
            world,
            uplinks,
            out,
            arp_tx,
            heartbeat: None,
            tracked: BTreeSet::new(),
            live: BTreeSet::new(),
            leaving: BTreeSet::new(),
            held: BTreeMap::new(),
            owners: BTreeMap::new(),
            deadline: 0,
            last_garp: BTreeMap::new(),
            since: BTreeMap::new(),
            conflicts: 0,
            contested: BTreeMap::new(),
            link_up: true,
            unplaced: BTreeSet::new(),
            groups: ha::groups::Groups::default(),
            adopted: BTreeSet::new(),
            arp,
            settings: watch::channel(String::new()).0,
        }
    }

    /// Where `vip` is answered on this node: its pool's link.
    fn link_of(&self, vip: IpAddr) -> Option<&Link> {
        self.uplinks.link_of(&self.world, vip)
    }

    /// Whether every watched interface is up with a carrier.
    fn links_up(&self) -> bool {
        self.uplinks.watched().into_iter().all(crate::dataplane::link_up)
    }

    /// `arp_conflicts` counts on every interface VIPs are held under.
    fn conflicts_now(&self) -> BTreeMap<IpAddr, u64> {
        self.uplinks.held_ifindices().into_iter().flat_map(|i| self.s.held.conflicts(i).unwrap_or_default()).collect()
    }

    /// Sweeps what an earlier agent left in `arp_held`, starts heartbeats and
    /// takes the VIPs this node owns.
    async fn start(&mut self) -> Result<()> {
        // Conflicts counted before this start are not news.
        self.conflicts = self.conflict_count().unwrap_or(0);
        self.contested = self.conflicts_now();
        let now = monotonic_ns();
        // Fresh entries are ours from before a restart: start from them, so that
        // those we no longer own are released (and those we keep are not
        // re-announced as a takeover).
        for e in self.s.held.entries()? {
            if e.deadline_ns > now {
                self.held.insert(e.vip, (e.announce, e.ifindex));
            }
        }
        self.adopted = self.held.keys().copied().collect();
        // Watches an earlier agent left mid-check would never be read.
        if let Err(e) = self.s.held.clear_arp_watch() {
            warn!("clearing arp_watch: {e:#}");
        }
        self.link_up = self.links_up();
        self.sync_heartbeat().await;
        self.decide(false);
        Ok(())
    }

    async fn run(&mut self) {
        let mut refresh = hold_refresh(&self.world);
        // Each pool's refresh (at least 1 s) is checked against this finer tick.
        let mut garp_refresh = tokio::time::interval(Duration::from_millis(250));
        let mut watch_conflicts = tokio::time::interval(Duration::from_millis(100));
        // Heartbeats that could not start (our address missing) are tried again.
        let mut rebind = tokio::time::interval(Duration::from_secs(1));
        // The uplink's state: polled (one ioctl), so that a lost NIC is noticed
        // within this tick even when heartbeats still get through another network.
        let mut link = tokio::time::interval(Duration::from_millis(50));
        // The ARP self-check: one request per tick at most (arpcheck::RATE a second).
        let mut arp_check = tokio::time::interval(Duration::from_secs(1) / arpcheck::RATE);
        arp_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.s.metrics.last_turn_ns.store(monotonic_ns(), Ordering::Relaxed);
            tokio::select! {
                Ok(()) = self.s.leave.changed() => {
                    if self.s.leave.borrow_and_update().is_some() {
                        self.leave().await;
                        break;
                    }
                }
                changed = self.inputs.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let Inputs { world, uplinks } = self.inputs.borrow_and_update().clone();
                    let world_changed = !Arc::ptr_eq(&world, &self.world);
                    let timers_changed = world.announce.hold_time != self.world.announce.hold_time;
                    self.world = world;
                    if !Arc::ptr_eq(&uplinks, &self.uplinks) {
                        self.uplinks = uplinks;
                        info!(pools = self.uplinks.by_pool.len(), "interfaces of the pools changed");
                        self.link_up = self.links_up();
                    }
                    self.sync_heartbeat().await;
                    if timers_changed {
                        refresh = hold_refresh(&self.world);
                    }
                    self.decide(false);
                    if world_changed {
                        // Deadlines follow the new hold time at once.
                        self.refresh();
                    }
                }
                Some(sets) = next_live(&mut self.heartbeat) => {
                    info!(live = ?sets.live, leaving = ?sets.leaving, "live nodes changed");
                    let back: Vec<IpAddr> = sets.live.difference(&self.live).filter_map(|n| self.world.node(n)).map(|n| n.addr).collect();
                    self.resolve(back);
                    self.live = sets.live;
                    self.leaving = sets.leaving;
                    self.decide(true);
                }
                _ = refresh.tick() => self.refresh(),
                _ = rebind.tick(), if self.heartbeat.is_none() && self.live.is_empty() => {
                    self.sync_heartbeat().await;
                    if !self.live.is_empty() {
                        self.decide(true);
                    }
                }
                _ = link.tick() => {
                    let up = self.links_up();
                    if up != self.link_up {
                        self.link_up = up;
                        if up {
                            info!("uplink up again: heartbeats restart, VIPs come back as peers hear us");
                        } else {
                            warn!("uplink down (no carrier or admin down): heartbeats stop and this node holds no VIP, so that its peers take them over");
                        }
                        self.sync_heartbeat().await;
                        self.decide(true);
                    }
                }
                _ = garp_refresh.tick() => self.refresh_garp(),
                _ = watch_conflicts.tick() => self.watch_conflicts(),
                _ = arp_check.tick(), if self.arp.enabled() => self.arp_check(),
                Some((from, findings)) = self.arp.report() => self.arp_findings(&from, findings),
            }
        }
        info!("liveness thread stopping; VIPs still held stay answered until their deadline");
    }

    /// The agent stops: once its leaving heartbeats are out (peers take its VIPs
    /// at once), the VIPs a live peer takes are released here (stale: no more
    /// ARP answers; clients still sending here are balanced, frames from other
    /// nodes passed). Left fresh until their deadline, they would make this node
    /// and their new holder both fresh holders for that time, and two fresh
    /// holders whose rings differ on a flow (this node's last state, the
    /// peer's with this node leaving) forward its frames to each other, with no
    /// hop limit at layer 2. A VIP no live peer takes stays answered until its
    /// deadline, for the next agent.
    async fn leave(&mut self) {
        if let Some((_, rx)) = self.heartbeat.as_mut() {
            // The task ends once it has sent them.
            let sent = tokio::time::timeout(LEAVE_SEND_WAIT, async { while rx.changed().await.is_ok() {} }).await;
            if sent.is_err() {
                warn!("leaving heartbeats not sent within {LEAVE_SEND_WAIT:?}; releasing the VIPs peers take anyway");
            }
        }
        let mut peers = self.live.clone();
        peers.remove(&self.s.me);
        let taken = ownership(&self.world, &self.s.me, &peers).owners;
        let released: Vec<(IpAddr, u32)> = self.held.iter().filter(|(v, _)| taken.contains_key(v)).map(|(v, (_, i))| (*v, *i)).collect();
        let _ = self.arp_tx.send(Order::Cancel(released.iter().map(|(v, _)| *v).collect()));
        for (vip, ifindex) in &released {
            match self.s.held.release(*ifindex, *vip) {
                Ok(()) => info!(%vip, ifindex, new_holder = %taken[vip], "released VIP on leaving (its pinned flows keep being forwarded)"),
                Err(e) => error!(%vip, "releasing VIP on leaving: {e:#}"),
            }
        }
    }

    /// (Re)starts heartbeats when their settings (our address, the peers eligible
    /// to hold VIPs, timers) changed. With no peer there are none, and every node
    /// counts as alive.
    async fn sync_heartbeat(&mut self) {
        let me = self.s.me.clone();
        let f = &self.world.failover;
        if !self.link_up {
            // Nothing can be answered or forwarded here: leave the membership
            // (peers stop hearing us and take our VIPs, and we leave their rings),
            // whatever network the heartbeats use.
            self.heartbeat = None;
            self.tracked = BTreeSet::from([me]);
            self.live = BTreeSet::new();
            return;
        }
        let Some(my) = self.world.node(&me) else {
            // Not in the model (removed from the file, Node gone): not a member, so
            // no heartbeats and no VIP; peers take ours.
            if self.heartbeat.take().is_some() || !self.live.is_empty() {
                warn!(node = %me, "this node is not in the model: it sends no heartbeats and holds no VIP");
            }
            self.tracked = BTreeSet::from([me]);
            self.live = BTreeSet::new();
            return;
        };
        self.settings.send_if_modified(|cur| replace_if_changed(cur, &crate::model::cluster_settings(&self.world)));
        let peers: Vec<(String, SocketAddr)> =
            self.world.holders().into_iter().filter(|n| n.name != me).map(|n| (n.name.clone(), SocketAddr::from((n.addr, f.heartbeat_port)))).collect();
        // Peers the running task has seen go down stay down in its replacement
        // until heard (only a new agent presumes every peer alive).
        let dead = self.heartbeat.as_ref().map_or_else(BTreeSet::new, |(cur, rx)| {
            let sets = rx.borrow();
            cur.peers.iter().map(|(n, _)| n).filter(|n| !sets.live.contains(*n)).cloned().collect()
        });
        let want = heartbeat::Options {
            bind: SocketAddr::from((my.addr, f.heartbeat_port)),
            peers,
            dead,
            me: me.clone(),
            interval: f.heartbeat_interval,
            dead_after: f.dead_after,
            gate: Some((self.s.metrics.last_turn_ns.clone(), self.world.announce.hold_time / 2)),
            metrics: Some(self.s.metrics.heartbeat.clone()),
            keys: self.s.keys.clone(),
            leave: Some(self.s.leave.clone()),
            arp: Some(self.arp.link()),
            settings: Some(heartbeat::SettingsLink { ours: self.settings.subscribe(), peers: self.s.peer_settings.clone() }),
        };
        let same =
            |a: &heartbeat::Options, b: &heartbeat::Options| (a.bind, &a.peers, a.interval, a.dead_after) == (b.bind, &b.peers, b.interval, b.dead_after);
        if self.heartbeat.as_ref().is_some_and(|(cur, _)| same(cur, &want)) {
            return;
        }
        // Dropping the receiver stops the old task, which then releases the port.
        self.heartbeat = None;
        if want.peers.is_empty() {
            self.tracked = BTreeSet::from([me]);
            self.live = self.world.nodes.iter().map(|n| n.name.clone()).collect();
            return;
        }
        self.tracked = want.peers.iter().map(|(n, _)| n.clone()).chain([me]).collect();
        for attempt in 0..50 {
            match heartbeat::run(want.clone()).await {
                Ok(rx) => {
                    self.live = rx.borrow().live.clone();
                    self.leaving = rx.borrow().leaving.clone();
                    info!(bind = %want.bind, peers = want.peers.len(), "heartbeats running");
                    self.heartbeat = Some((want, rx));
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempt < 49 => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => {
                    // Peers cannot hear us (the address is not ours, or the port is
                    // taken): they count us dead and take our VIPs, so we hold none.
                    // Retried every second.
                    error!(bind = %want.bind, "cannot start heartbeats: {e}; peers see this node as dead, so it holds no VIP until they can hear it");
                    self.live = BTreeSet::new();
                    return;
                }
            }
        }
    }

    /// Applies the decision ([`plan::plan`]) to `arp_held`: taken VIPs held and
    /// announced, lost ones released (their pending announcements cancelled),
    /// VIPs in no pool forgotten; then tells the status, the loopback task, the
    /// metrics and the programmer. `reassert`: see [`plan::plan`].
    fn decide(&mut self, reassert: bool) {
        let (world, uplinks) = (self.world.clone(), self.uplinks.clone());
        let placed = |v: IpAddr| uplinks.by_pool.get(&world.pool_of(v)?.name).map(|l| l.ifindex);
        let p = plan::plan(&self.world, &self.s.me, &self.live, placed, &self.held, reassert);
        for v in p.unplaced.difference(&self.unplaced) {
            error!(vip = %v, "this node owns the VIP but its pool has no interface here: not answered (see the host problems)");
        }
        if !p.cancel.is_empty() {
            let _ = self.arp_tx.send(Order::Cancel(p.cancel.clone()));
        }
        for (vip, ifindex) in &p.release {
            match self.s.held.release(*ifindex, *vip) {
                Ok(()) => info!(%vip, ifindex, "released VIP (its pinned flows keep being forwarded)"),
                Err(e) => error!(%vip, "releasing VIP: {e:#}"),
            }
        }
        let deadline = monotonic_ns() + self.world.announce.hold_time.as_nanos() as u64;
        for vip in &p.take {
            let (announce, ifindex) = p.want[vip];
            if let Err(e) = self.s.held.hold(ifindex, *vip, deadline, announce) {
                error!(%vip, "holding VIP: {e:#}");
            } else {
                info!(%vip, ifindex, on_lo = announce == HeldMode::Lo, "holding VIP");
            }
        }
        match self.s.held.entries() {
            Ok(entries) => {
                let drop = plan::forget(&self.world, placed, &entries);
                if !drop.is_empty() {
                    let gone: Vec<(u32, IpAddr)> = drop.iter().map(|e| (e.ifindex, e.vip)).collect();
                    if let Err(err) = self.s.held.forget_all(&gone) {
                        error!("forgetting VIPs: {err:#}");
                    }
                    for e in drop {
                        info!(vip = %e.vip, ifindex = e.ifindex, "forgot VIP (in no pool, or moved to another interface)");
                    }
                }
            }
            Err(e) => error!("reading arp_held: {e:#}"),
        }
        let now = SystemTime::now();
        let plan::Plan { ownership: o, unplaced, want, take, announce, .. } = p;
        self.unplaced = unplaced;
        // A VIP taken (again) is no longer the one found held at start.
        let kept = |v: &IpAddr| want.contains_key(v) && !take.contains(v);
        self.adopted.retain(kept);
        self.arp.keep(kept, &self.s.metrics);
        self.since.retain(|v, _| kept(v));
        for v in want.keys() {
            self.since.entry(*v).or_insert(now);
        }
        self.held = want;
        self.sync_groups();
        self.announce(announce, true);
        self.last_garp.retain(|v, _| o.held.contains(v));
        self.tell_held();
        self.s.on_lo.send_if_modified(|cur| replace_if_changed(cur, &o.on_lo));
        self.s.metrics.record(&self.world, &self.owners, &o, &Members { me: &self.s.me, tracked: &self.tracked, live: &self.live });
        self.owners = o.owners.clone();
        let m = Membership {
            tracked: self.tracked.clone(),
            live: self.live.clone(),
            leaving: self.leaving.clone(),
            owners: o.owners,
            held: o.held,
            on_lo: o.on_lo,
        };
        self.out.send_if_modified(|cur| replace_if_changed(cur, &m));
        // Last: O(VIPs × nodes) hashing, after everything a failover waits for.
        if self.arp.enabled() {
            let mine = selfcheck::checked_here(&self.world, &self.s.me, &self.live, &self.owners, |p| self.uplinks.by_pool.contains_key(p));
            self.arp.check_for(mine);
        }
    }

    /// Joins the solicited-node group of every IPv6 VIP answered here on the
    /// interface the program sees its solicitations on, and leaves the others
    /// (see ha::groups). A failed join is retried at the next refresh.
    fn sync_groups(&mut self) {
        let want: BTreeSet<(u32, std::net::Ipv6Addr)> = self
            .held
            .iter()
            .filter(|(_, (a, _))| *a == HeldMode::Arp)
            .filter_map(|(v, _)| match v {
                IpAddr::V6(v6) => Some((self.link_of(*v)?.xdp_ifindex, *v6)),
                IpAddr::V4(_) => None,
            })
            .collect();
        for (ifindex, vip, e) in self.groups.sync(&want) {
            error!(%vip, ifindex, "joining the VIP's solicited-node multicast group: {e}; solicitations may not reach this node");
        }
    }

    /// Re-writes the deadline of every held VIP (fencing: if this stops, they go stale).
    fn refresh(&mut self) {
        let now = monotonic_ns();
        let last = self.deadline;
        let lapsed = last != 0 && now > last;
        let deadline = now + self.world.announce.hold_time.as_nanos() as u64;
        let mut by_ifindex: BTreeMap<u32, Vec<(IpAddr, HeldMode)>> = BTreeMap::new();
        for (v, (a, i)) in &self.held {
            by_ifindex.entry(*i).or_default().push((*v, *a));
        }
        for (ifindex, all) in by_ifindex {
            if let Err(e) = self.s.held.hold_all(ifindex, &all, deadline) {
                error!(ifindex, "refreshing held VIPs: {e:#}");
            }
        }
        self.deadline = deadline;
        self.sync_groups();
        if lapsed && !self.held.is_empty() {
            // We were not running (stopped, starved) and our VIPs went stale; peers
            // may have taken them and moved clients away. Taking them back is a
            // takeover like any other: announce it.
            warn!(stale_ms = (now - last) / 1_000_000, "held VIPs had gone stale; re-announcing them");
            self.announce(self.held.keys().copied().collect(), true);
        }
    }

    /// Gratuitous ARP for those of `vips` announced by ARP, an unsolicited Neighbor
    /// Advertisement for IPv6 ones (in the background, through the same sender): on
    /// a `takeover` each pool's count of frames, its interval apart, so switches and
    /// neighbours learn the new owner at once; else one frame (refresh, conflict).
    fn announce(&mut self, vips: BTreeSet<IpAddr>, takeover: bool) {
        let now = (Instant::now(), SystemTime::now());
        let mut by_settings: BTreeMap<crate::model::Garp, Vec<_>> = BTreeMap::new();
        for v in vips {
            if self.world.announce_mode(v) == AnnounceMode::Lo {
                continue;
            }
            let Some(l) = self.link_of(v) else { continue };
            let frame = ha::garp::tagged(&ha::garp::announcement_frame(l.mac, v), l.vlan);
            by_settings.entry(self.world.garp(v)).or_default().push((v, l.xdp_ifindex, frame));
            self.last_garp.insert(v, now);
        }
        let announced = !by_settings.is_empty();
        for (g, frames) in by_settings {
            let rounds = if takeover { g.count } else { 1 };
            let _ = self.arp_tx.send(Order::Send(Job { frames, rounds, gap: g.interval, what: "gratuitous ARP or unsolicited neighbour advertisement" }));
        }
        if announced {
            self.tell_held();
        }
    }

    /// Sends the held VIPs to their status writer (a `watch`: never waits).
    fn tell_held(&self) {
        let vips: BTreeMap<IpAddr, HeldVip> = self
            .held
            .iter()
            .filter_map(|(v, (_, ifindex))| {
                let l = self.link_of(*v)?;
                // A pool's `vlan` is no interface of the host: its parent is.
                let interface = if crate::links::is_vlan_net(*ifindex) { l.xdp_iface.clone() } else { l.name.clone() };
                let since = *self.since.get(v)?;
                Some((
                    *v,
                    HeldVip {
                        since,
                        last_garp: self.last_garp.get(v).map(|(_, t)| *t),
                        interface,
                        vlan: l.vlan,
                        adopted: self.adopted.contains(v),
                        arp: self.arp.check_of(v),
                    },
                ))
            })
            .collect();
        self.s.held_vips.send_if_modified(|cur| replace_if_changed(cur, &vips));
    }

    /// One gratuitous ARP for each held VIP whose pool's refresh has passed since
    /// it was last announced (switch FDB and neighbour entries age out).
    fn refresh_garp(&mut self) {
        let now = Instant::now();
        let due: BTreeSet<IpAddr> =
            self.held.keys().filter(|v| self.last_garp.get(v).is_none_or(|(t, _)| now.duration_since(*t) >= self.world.garp(**v).refresh)).copied().collect();
        if !due.is_empty() {
            self.announce(due, false);
        }
    }

    /// Asks ARP for the addresses of nodes that just came back. After our link was
    /// down the kernel's neighbour entries for them sit INCOMPLETE until its next
    /// retry (up to a second): their heartbeats reach us, ours would not reach them.
    /// The reply to this request completes the entries at once. IPv6 nodes get a
    /// datagram instead, which has the kernel solicit them now.
    fn resolve(&self, addrs: Vec<IpAddr>) {
        let Some(me) = self.world.node(&self.s.me).map(|n| n.addr) else { return };
        let Some(home) = &self.uplinks.home else { return };
        let mut frames = Vec::new();
        for a in addrs {
            match (me, a) {
                (IpAddr::V4(me), IpAddr::V4(a)) => {
                    frames.push((a.into(), home.xdp_ifindex, ha::garp::tagged(&ha::garp::arp_request_frame(home.mac, me, a), home.vlan)))
                }
                (_, IpAddr::V6(_)) => crate::neighbour::solicit(a),
                // An IPv4 peer of an IPv6 node: no address of ours to ask from.
                (IpAddr::V6(_), IpAddr::V4(_)) => {}
            }
        }
        if !frames.is_empty() {
            let _ = self.arp_tx.send(Order::Send(Job { frames, rounds: 1, gap: Duration::ZERO, what: "ARP request" }));
        }
    }

    /// One turn of the ARP self-check as a checker ([`selfcheck::SelfCheck::turn`]).
    fn arp_check(&mut self) {
        let mut cx = selfcheck::Ctx { held: &mut self.s.held, metrics: &self.s.metrics, frames: &self.arp_tx, world: &self.world, uplinks: &self.uplinks };
        if self.arp.turn(&mut cx) {
            self.tell_held();
        }
    }

    /// A checker's findings for VIPs this node holds ([`selfcheck::SelfCheck::findings`]).
    fn arp_findings(&mut self, from: &str, findings: Vec<arpcheck::Finding>) {
        let mut cx = selfcheck::Ctx { held: &mut self.s.held, metrics: &self.s.metrics, frames: &self.arp_tx, world: &self.world, uplinks: &self.uplinks };
        if self.arp.findings(from, findings, &self.held, &self.since, &mut cx) {
            self.tell_held();
        }
    }

    /// Conflicting claims the data path counted: `arp_conflict` and `ndp_conflict`.
    fn conflict_count(&self) -> Result<u64> {
        let arp = self.s.held.reason_count(vip_common::Reason::ArpConflict)?.0;
        Ok(arp + self.s.held.reason_count(vip_common::Reason::NdpConflict)?.0)
    }

    /// Logs and counts ARP replies, gratuitous ARP or Neighbor Advertisements from
    /// another MAC claiming a VIP we hold (counted by the data path as
    /// `arp_conflict`, `ndp_conflict`).
    fn watch_conflicts(&mut self) {
        let Ok(n) = self.conflict_count() else { return };
        if n > self.conflicts {
            self.s.metrics.arp_conflicts.inc_by(n - self.conflicts);
            // Which VIPs: those whose count in arp_conflicts went up (a new entry
            // counts from 0). Whoever claimed them (a partitioned node, a node that
            // woke up) may have pulled clients away; the holder's announcement of
            // those VIPs, and only those, brings them back.
            let now = self.conflicts_now();
            let contested: BTreeSet<IpAddr> =
                now.iter().filter(|(v, c)| **c > self.contested.get(v).copied().unwrap_or(0) && self.held.contains_key(v)).map(|(v, _)| *v).collect();
            warn!(new = n - self.conflicts, vips = ?contested, "ARP conflict: another MAC claims a VIP this node holds; re-announcing it");
            self.contested = now;
            self.announce(contested, false);
        }
        self.conflicts = n;
    }
}

/// Sets `cur` to `want` when they differ (cloning only then); whether it did.
pub fn replace_if_changed<T: Clone + PartialEq>(cur: &mut T, want: &T) -> bool {
    let changed = cur != want;
    if changed {
        cur.clone_from(want);
    }
    changed
}

/// The next live set from the heartbeat task (pending forever without one).
async fn next_live(hb: &mut Option<(heartbeat::Options, watch::Receiver<heartbeat::PeerSets>)>) -> Option<heartbeat::PeerSets> {
    match hb {
        Some((_, rx)) => match rx.changed().await {
            Ok(()) => Some(rx.borrow_and_update().clone()),
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}
