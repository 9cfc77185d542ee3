//! The liveness path: heartbeats, VIP ownership, held-deadline refreshes,
//! gratuitous ARP and ARP-conflict watching, on a thread and runtime of their own.
//!
//! Nothing else the agent does runs here: ring programming, probes, the
//! Kubernetes client and the HTTP server live on the main runtime, and this
//! thread talks to the kernel through its own map descriptors
//! ([`crate::dataplane::HeldVips`]). So a takeover, a refresh or a heartbeat
//! never waits behind a map write, however many services there are; the only
//! input it takes from the rest is the model (a `watch`, never blocking).
//!
//! Here the thread and its loop; `plan` decides, `apply` carries a decision out
//! (`arp_held`, announcements), `heartbeats` runs the heartbeat task, `conflicts`
//! watches other MACs claiming VIPs, `selfcheck` is the ARP self-check.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::{atomic::Ordering, Arc},
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, Result};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

mod apply;
mod conflicts;
mod heartbeats;
#[cfg(test)]
mod model_check;
pub mod plan;
mod selfcheck;

use heartbeats::next_live;

use crate::{
    clock::monotonic_ns,
    dataplane::HeldVips,
    ha::{
        self, arpcheck,
        garp::{FrameTx, Order},
        heartbeat, HeldVip,
    },
    links::Link,
    metrics::LivenessMetrics,
    model::World,
};

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
    /// Those of `tracked` silent without having said they leave, alive or not
    /// (`heartbeat::PeerSets::silent`): whether their node still serves is asked
    /// of their health targets (`agent::silent`).
    pub silent: BTreeSet<String>,
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
    /// The MACs of nodes the model leaves without one, as the agent resolved
    /// them: that of a VIP's previous holder is recorded when the VIP is taken.
    pub node_macs: watch::Receiver<BTreeMap<String, [u8; 6]>>,
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
    silent: BTreeSet<String>,
    /// What is written to `arp_held`: VIP → how it is announced, and the ifindex
    /// it is held under.
    held: plan::Held,
    owners: BTreeMap<IpAddr, String>,
    /// Held VIPs of `distribution: all` pools that another node is the named
    /// owner of: that node alone writes their status.
    others_to_report: BTreeSet<IpAddr>,
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
    /// VIPs taken whose previous holder's MAC was not known yet: VIP → (that
    /// node, the ifindex it is held under), recorded once it is.
    pending_handoff: BTreeMap<IpAddr, (String, u32)>,
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
            silent: BTreeSet::new(),
            held: BTreeMap::new(),
            owners: BTreeMap::new(),
            others_to_report: BTreeSet::new(),
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
            pending_handoff: BTreeMap::new(),
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
                    // A peer late or heard again changes no holder: told as it is.
                    self.silent = sets.silent;
                    if (&sets.live, &sets.leaving) == (&self.live, &self.leaving) {
                        let silent = &self.silent;
                        self.out.send_if_modified(|m| replace_if_changed(&mut m.silent, silent));
                        continue;
                    }
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
}

/// Sets `cur` to `want` when they differ (cloning only then); whether it did.
pub fn replace_if_changed<T: Clone + PartialEq>(cur: &mut T, want: &T) -> bool {
    let changed = cur != want;
    if changed {
        cur.clone_from(want);
    }
    changed
}
