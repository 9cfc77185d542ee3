//! A model check of membership with fake time. Simulated agents, each with its
//! own [`PeerTable`] and the liveness thread's own decision ([`plan::plan`]),
//! exchange heartbeats over a simulated network
//! (delays that reorder, loss, partitions into groups) while a seeded scenario
//! adds and removes nodes, stops, restarts (new incarnation) and pauses agents,
//! and changes the timers. Each simulated agent follows the rules of the
//! liveness thread (`agent/liveness.rs`) and the heartbeat task
//! (`heartbeat.rs`):
//!
//! - it applies the shared model when its reload poll next reads it (up to
//!   [`LAG`] after a change), and reads it when it starts;
//! - a node not in the model sends no heartbeats and holds nothing; a member
//!   sends heartbeats to every other member and accepts them only from those;
//! - heartbeats restart (new incarnation, new table) when the peers or the
//!   timers change, presuming alive every peer but those the old task had seen
//!   go down (a new agent presumes every peer alive); with no peer, every
//!   member is live;
//! - expiry is checked on every send tick and every receive; after a gap in its
//!   own running longer than `max(deadAfter/2, 2·interval)` it forgives peers;
//! - it decides with [`plan::plan`] (the owners are `assign(VIPs, live members)`)
//!   and applies the plan to its `arp_held` as the thread does (released
//!   entries out, taken ones in); a restarted agent finds the entries it left.
//!
//! Whenever nothing has changed for [`bound`] (and no datagram is being lost),
//! every group of nodes that can hear each other must agree: each running member
//! in the group sees exactly `assign(VIPs, running members of the group)`, a
//! running non-member holds nothing, and every VIP has exactly one holder in the
//! group, by the entries of the nodes' `arp_held`. A failure names its seed; `VIP_MODEL_SEED=N` replays one seed,
//! `VIP_MODEL_SEEDS=N` sets how many are run.
use std::{
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet, BinaryHeap},
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use rand::{rngs::SmallRng, Rng, SeedableRng};

use super::plan::{self, Held};
use crate::{
    ha::{
        heartbeat::{PeerTable, Seen},
        ownership::assign,
    },
    model::{self, AnnounceMode, Pool, World},
};

const NODES: usize = 5;
const VIPS: u32 = 7;
/// Scenario steps per seed.
const STEPS: usize = 40;
/// The agents' reload poll: a model change reaches each one within this.
const LAG: Duration = Duration::from_millis(200);
/// Largest one-way delay of a datagram (delays vary, so datagrams overtake each other).
const MAX_DELAY: Duration = Duration::from_millis(4);
/// (heartbeatInterval, deadAfter) in ms, each valid for the config (deadAfter ≥ 3 intervals).
const TIMERS: [(u64, u64); 4] = [(40, 250), (30, 200), (50, 400), (60, 320)];

/// How long after the last change every group must agree: every agent has read
/// the model (LAG), a heartbeat task restarted by it presumes its peers alive for
/// one deadAfter and notices a silent one at its next tick (one interval); a
/// peer that is heard again (heal, resume) is heard within an interval and a
/// delay; plus one interval of slack for the tick phase.
fn bound() -> Duration {
    let (interval, dead_after) = TIMERS.iter().fold((0, 0), |(i, d), &(ti, td)| (i.max(ti), d.max(td)));
    LAG + Duration::from_millis(dead_after + 2 * interval) + MAX_DELAY
}

fn name(i: usize) -> String {
    format!("node-{i}")
}

/// Sorted, as a pool's addresses are.
fn vips() -> Vec<IpAddr> {
    (0..VIPS).map(|k| Ipv4Addr::from(0xc612_010a + k).into()).collect()
}

/// The ifindex every simulated node answers its VIPs on.
const IFINDEX: u32 = 2;

/// The model as the agents' `World`: the members, one pool of every VIP.
fn world(m: &Model) -> World {
    World {
        nodes: m
            .members
            .iter()
            .map(|i| model::Node { name: name(*i), addr: Ipv4Addr::new(198, 18, 0, 10 + *i as u8).into(), mac: None, labels: BTreeMap::new(), taints: vec![] })
            .collect(),
        pools: vec![Pool {
            name: "pool".into(),
            addresses: vips(),
            node_selector: BTreeMap::new(),
            tolerations: vec![],
            announce: AnnounceMode::Arp,
            distribution: Default::default(),
            garp: None,
            interfaces: vec![],
            vlan: None,
            bgp: Default::default(),
        }],
        ..World::default()
    }
}

fn index(node: &str) -> usize {
    node.trim_start_matches("node-").parse().expect("a node name")
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Model {
    members: BTreeSet<usize>,
    interval: Duration,
    dead_after: Duration,
}

/// One heartbeat task.
struct Hb {
    /// Distinguishes this task's ticks from an earlier task's.
    id: u64,
    peers: BTreeSet<usize>,
    interval: Duration,
    dead_after: Duration,
    table: PeerTable,
    incarnation: u64,
    seq: u64,
    last_turn: Duration,
}

#[derive(Default)]
struct Node {
    running: bool,
    paused: bool,
    /// A tick that came due while paused (fires at the resume).
    missed_tick: bool,
    /// Datagrams that arrived while paused (read at the resume).
    inbox: Vec<(usize, u64, u64)>,
    /// A reload poll that came due while paused (runs at the resume).
    missed_reload: bool,
    model: Option<Model>,
    hb: Option<Hb>,
    live: BTreeSet<usize>,
    owners: BTreeMap<IpAddr, usize>,
    /// Its `arp_held` entries held fresh (they outlive the agent).
    held: Held,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A tick of heartbeat task `hb` of `node`.
    Tick {
        node: usize,
        hb: u64,
    },
    /// A datagram from `from` (incarnation, seq) reaching `to`.
    Deliver {
        to: usize,
        from: usize,
        inc: u64,
        seq: u64,
    },
    /// `node`'s reload poll reads the model.
    Reload {
        node: usize,
    },
    /// The next scenario step.
    Step,
    /// Resume a paused agent / start a stopped one (the second half of a step).
    Resume {
        node: usize,
    },
    Start {
        node: usize,
    },
    /// Check agreement if nothing changed since `since` (ns).
    Check {
        since: u64,
    },
}

struct Sim {
    rng: SmallRng,
    t0: Instant,
    now: Duration,
    queue: BinaryHeap<Reverse<(Duration, u64, Ev)>>,
    order: u64,
    nodes: Vec<Node>,
    model: Model,
    /// Connectivity group of each node: datagrams pass only within a group.
    side: Vec<u32>,
    next_side: u32,
    loss: f64,
    last_change: Duration,
    last_incarnation: u64,
    next_hb: u64,
    steps: usize,
    checks: usize,
    /// A broken invariant seen while running (reported by `run`).
    broken: Option<String>,
    log: Vec<String>,
    vips: Vec<IpAddr>,
}

impl Sim {
    fn new(seed: u64) -> Self {
        let (i, d) = TIMERS[0];
        let model = Model { members: (0..3).collect(), interval: Duration::from_millis(i), dead_after: Duration::from_millis(d) };
        let mut s = Self {
            rng: SmallRng::seed_from_u64(seed),
            t0: Instant::now(),
            now: Duration::ZERO,
            queue: BinaryHeap::new(),
            order: 0,
            nodes: (0..NODES).map(|_| Node::default()).collect(),
            model,
            side: vec![0; NODES],
            next_side: 1,
            loss: 0.0,
            last_change: Duration::ZERO,
            last_incarnation: 0,
            next_hb: 0,
            steps: 0,
            checks: 0,
            broken: None,
            log: Vec::new(),
            vips: vips(),
        };
        for i in 0..3 {
            s.start(i);
        }
        s.at(Duration::ZERO, Ev::Step);
        s
    }

    fn at(&mut self, t: Duration, e: Ev) {
        self.order += 1;
        self.queue.push(Reverse((t, self.order, e)));
    }

    fn instant(&self) -> Instant {
        self.t0 + self.now
    }

    fn note(&mut self, what: String) {
        self.log.push(format!("{:>9.3}s {what}", self.now.as_secs_f64()));
    }

    fn changed(&mut self) {
        self.last_change = self.now;
        let since = self.now.as_nanos() as u64;
        self.at(self.now + bound(), Ev::Check { since });
    }

    /// A new process: reads the model, starts heartbeats, decides.
    fn start(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        // The entries an earlier agent left are still fresh: the new one starts from them.
        let held = std::mem::take(&mut n.held);
        *n = Node { running: true, held, ..Node::default() };
        self.apply_model(i);
    }

    /// The liveness thread's `sync_heartbeat` and `decide` for the current model.
    fn apply_model(&mut self, i: usize) {
        let model = self.model.clone();
        let now = self.now;
        let n = &mut self.nodes[i];
        // Only the timers changed: heartbeats restart, and must not change who is live.
        let timers_only = n.hb.is_some() && n.model.as_ref().is_some_and(|m| m.members == model.members);
        let live_before = n.live.clone();
        n.model = Some(model.clone());
        if !model.members.contains(&i) {
            n.hb = None;
            n.live.clear();
        } else {
            let peers: BTreeSet<usize> = model.members.iter().copied().filter(|p| *p != i).collect();
            let same = n.hb.as_ref().is_some_and(|h| (&h.peers, h.interval, h.dead_after) == (&peers, model.interval, model.dead_after));
            if !same {
                // Peers the old task saw go down are not presumed alive again.
                let dead: BTreeSet<usize> = n.hb.take().map_or_else(BTreeSet::new, |h| h.peers.iter().copied().filter(|p| !n.live.contains(p)).collect());
                if peers.is_empty() {
                    n.live = model.members.clone();
                } else {
                    // A new task: new incarnation (start time, always forward),
                    // peers presumed alive but those known dead, first tick at once.
                    self.last_incarnation = (now.as_nanos() as u64 + 1).max(self.last_incarnation + 1);
                    self.next_hb += 1;
                    let mut table = PeerTable::new(model.dead_after);
                    for p in peers.iter().filter(|p| !dead.contains(p)) {
                        table.presume(&name(*p), self.t0 + now);
                    }
                    let n = &mut self.nodes[i];
                    n.live = peers.iter().copied().filter(|p| !dead.contains(p)).chain([i]).collect();
                    n.hb = Some(Hb {
                        id: self.next_hb,
                        peers,
                        interval: model.interval,
                        dead_after: model.dead_after,
                        table,
                        incarnation: self.last_incarnation,
                        seq: 0,
                        last_turn: now,
                    });
                    let id = self.next_hb;
                    self.at(now, Ev::Tick { node: i, hb: id });
                }
            }
        }
        if timers_only && self.nodes[i].live != live_before && self.broken.is_none() {
            self.broken = Some(format!("a timers-only reload changed node-{i}'s live set from {live_before:?} to {:?}", self.nodes[i].live));
        }
        self.decide(i);
    }

    /// The liveness thread's `decide`: the plan, applied to `arp_held`.
    fn decide(&mut self, i: usize) {
        let n = &self.nodes[i];
        let world = world(n.model.as_ref().expect("a running node has read the model"));
        let live: BTreeSet<String> = n.live.iter().map(|l| name(*l)).collect();
        let p = plan::plan(&world, &name(i), &live, |_| Some(IFINDEX), &n.held, false);
        let n = &mut self.nodes[i];
        n.held = plan::applied(&n.held, &p);
        n.owners = p.ownership.owners.iter().map(|(v, o)| (*v, index(o))).collect();
    }

    /// The heartbeat task's stall check at the start of a turn.
    fn turn(&mut self, i: usize) {
        let (now, at) = (self.now, self.instant());
        let Some(h) = self.nodes[i].hb.as_mut() else { return };
        let stall = (h.dead_after / 2).max(h.interval * 2);
        if now - h.last_turn > stall {
            h.table.forgive(at);
        }
        h.last_turn = now;
    }

    /// After a tick or a receive: expiry, and a new decision if the live set changed.
    fn expire(&mut self, i: usize) {
        let at = self.instant();
        let n = &mut self.nodes[i];
        let Some(h) = n.hb.as_mut() else { return };
        h.table.expire(at);
        let live: BTreeSet<usize> = h.table.live().iter().map(|s| index(s)).chain([i]).collect();
        if live != n.live {
            n.live = live;
            self.decide(i);
        }
    }

    fn tick(&mut self, i: usize, id: u64) {
        let n = &mut self.nodes[i];
        if !n.running || n.hb.as_ref().is_none_or(|h| h.id != id) {
            return; // a task that has ended
        }
        if n.paused {
            n.missed_tick = true;
            return;
        }
        self.turn(i);
        let h = self.nodes[i].hb.as_mut().expect("checked above");
        h.seq += 1;
        let (inc, seq, interval) = (h.incarnation, h.seq, h.interval);
        let peers: Vec<usize> = h.peers.iter().copied().collect();
        for p in peers {
            if self.side[p] == self.side[i] && !self.rng.random_bool(self.loss) {
                let d = self.rng.random_range(Duration::ZERO..=MAX_DELAY);
                self.at(self.now + d, Ev::Deliver { to: p, from: i, inc, seq });
            }
        }
        self.expire(i);
        self.at(self.now + interval, Ev::Tick { node: i, hb: id });
    }

    fn deliver(&mut self, to: usize, from: usize, inc: u64, seq: u64) {
        if self.side[to] != self.side[from] || !self.nodes[to].running || self.nodes[to].hb.is_none() {
            return; // cut on the way, or nobody listening
        }
        if self.nodes[to].paused {
            self.nodes[to].inbox.push((from, inc, seq));
            return;
        }
        self.receive(to, from, inc, seq);
    }

    fn receive(&mut self, to: usize, from: usize, inc: u64, seq: u64) {
        self.turn(to);
        let at = self.instant();
        let Some(h) = self.nodes[to].hb.as_mut() else { return };
        // Accepted only from the address of a peer of the receiver's model.
        if h.peers.contains(&from) {
            let _: Seen = h.table.observe(&name(from), inc, seq, at);
        }
        self.expire(to);
    }

    fn resume(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        if !n.running || !n.paused {
            return;
        }
        n.paused = false;
        let inbox = std::mem::take(&mut n.inbox);
        let tick = std::mem::take(&mut n.missed_tick).then(|| n.hb.as_ref().map(|h| h.id)).flatten();
        let reload = std::mem::take(&mut n.missed_reload);
        for (from, inc, seq) in inbox {
            self.receive(i, from, inc, seq);
        }
        if let Some(id) = tick {
            self.tick(i, id);
        }
        if reload {
            self.reload(i);
        }
    }

    /// The reload poll: applies the model if it changed since the agent read it.
    fn reload(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        if !n.running || n.model.as_ref() == Some(&self.model) {
            return;
        }
        if n.paused {
            n.missed_reload = true;
            return;
        }
        self.apply_model(i);
    }

    /// Writes a new model; each running agent reads it within LAG.
    fn set_model(&mut self, m: Model) {
        self.model = m;
        for i in 0..NODES {
            if self.nodes[i].running {
                let lag = self.rng.random_range(Duration::ZERO..=LAG);
                self.at(self.now + lag, Ev::Reload { node: i });
            }
        }
    }

    /// One scenario step, chosen among those that apply.
    fn step(&mut self) {
        self.steps += 1;
        let members = self.model.members.clone();
        let running: Vec<usize> = (0..NODES).filter(|i| self.nodes[*i].running && !self.nodes[*i].paused).collect();
        let mut d = Duration::ZERO;
        match self.rng.random_range(0..10) {
            0 => {
                if let Some(i) = pick(&mut self.rng, (0..NODES).filter(|i| !members.contains(i))) {
                    let mut m = self.model.clone();
                    m.members.insert(i);
                    self.set_model(m);
                    // Mostly its agent starts too; sometimes it is listed before it runs.
                    let start = !self.nodes[i].running && self.rng.random_bool(0.8);
                    if start {
                        self.start(i);
                    }
                    self.note(format!("add node-{i} (agent started: {start})"));
                }
            }
            1 if members.len() > 1 => {
                let i = pick(&mut self.rng, members.iter().copied()).expect("members");
                let mut m = self.model.clone();
                m.members.remove(&i);
                self.set_model(m);
                let stop = self.rng.random_bool(0.5);
                if stop {
                    self.nodes[i] = Node::default();
                }
                self.note(format!("remove node-{i} (agent stopped: {stop})"));
            }
            2 => {
                if let Some(i) = pick(&mut self.rng, running.iter().copied().filter(|i| members.contains(i))) {
                    // SIGKILL or SIGTERM and a new process a moment later.
                    d = self.rng.random_range(Duration::ZERO..Duration::from_millis(300));
                    self.nodes[i] = Node::default();
                    self.at(self.now + d, Ev::Start { node: i });
                    self.note(format!("restart node-{i} (back after {d:?})"));
                }
            }
            3 => {
                if let Some(i) = pick(&mut self.rng, (0..NODES).filter(|i| members.contains(i) && !self.nodes[*i].running)) {
                    self.start(i);
                    self.note(format!("start node-{i}"));
                }
            }
            4 => {
                if let Some(i) = pick(&mut self.rng, running.iter().copied().filter(|i| members.contains(i))) {
                    self.nodes[i] = Node::default();
                    self.note(format!("stop node-{i}"));
                }
            }
            5 => {
                if let Some(i) = pick(&mut self.rng, running.iter().copied()) {
                    // SIGSTOP for up to three deadAfters, then SIGCONT.
                    d = self.rng.random_range(Duration::ZERO..self.model.dead_after * 3);
                    self.nodes[i].paused = true;
                    self.at(self.now + d, Ev::Resume { node: i });
                    self.note(format!("pause node-{i} for {d:?}"));
                }
            }
            6 => {
                // A group of nodes cut off from the rest (and from any other group).
                let cut: Vec<usize> = (0..NODES).filter(|_| self.rng.random_bool(0.3)).collect();
                if !cut.is_empty() && cut.len() < NODES {
                    let s = self.next_side;
                    self.next_side += 1;
                    for i in &cut {
                        self.side[*i] = s;
                    }
                    self.note(format!("partition {cut:?} off"));
                }
            }
            7 => {
                if let Some(i) = pick(&mut self.rng, (0..NODES).filter(|i| self.side[*i] != 0)) {
                    let heal_all = self.rng.random_bool(0.5);
                    if heal_all {
                        self.side = vec![0; NODES];
                    } else {
                        self.side[i] = 0;
                    }
                    self.note(format!("heal {}", if heal_all { "all".into() } else { format!("node-{i}") }));
                }
            }
            8 => {
                let (i, dead) = TIMERS[self.rng.random_range(0..TIMERS.len())];
                let m = Model { interval: Duration::from_millis(i), dead_after: Duration::from_millis(dead), ..self.model.clone() };
                if m != self.model {
                    self.set_model(m);
                    self.note(format!("timers {i}ms/{dead}ms"));
                }
            }
            _ => {
                self.loss = if self.loss > 0.0 { 0.0 } else { self.rng.random_range(0.05..0.3) };
                let loss = self.loss;
                self.note(format!("loss {loss:.2}"));
            }
        }
        let end = self.now + d;
        self.last_change = self.last_change.max(end);
        if self.steps < STEPS {
            // Often faster than the bound (changes pile up), sometimes slower (checked).
            let gap = self.rng.random_range(Duration::ZERO..bound() * 2);
            self.at(end + gap, Ev::Step);
        } else if self.loss > 0.0 {
            self.loss = 0.0;
            self.note("loss 0 (end)".into());
        }
        if d.is_zero() {
            self.changed();
        }
    }

    /// Every group agrees (see the module docs); the failure says how not.
    fn check(&mut self) -> Result<(), String> {
        self.checks += 1;
        let groups: BTreeSet<u32> = self.side.iter().copied().collect();
        for g in groups {
            let up: Vec<usize> = (0..NODES).filter(|i| self.side[*i] == g && self.nodes[*i].running && !self.nodes[*i].paused).collect();
            let members: Vec<usize> = up.iter().copied().filter(|i| self.model.members.contains(i)).collect();
            let want: BTreeMap<IpAddr, usize> =
                assign(&self.vips, &members.iter().map(|i| name(*i)).collect::<Vec<_>>()).into_iter().map(|(v, o)| (v, index(&o))).collect();
            for &i in &up {
                let n = &self.nodes[i];
                if n.model.as_ref() != Some(&self.model) {
                    return Err(format!("node-{i} has not read the model"));
                }
                let expect = if self.model.members.contains(&i) { want.clone() } else { BTreeMap::new() };
                if n.owners != expect {
                    return Err(format!("group {g} ({up:?}): node-{i} sees owners {:?} (live {:?}), want {expect:?}", n.owners, n.live));
                }
            }
            for v in &self.vips {
                let holders: Vec<usize> = up.iter().copied().filter(|i| self.nodes[*i].held.contains_key(v)).collect();
                if holders.len() != usize::from(!members.is_empty()) {
                    return Err(format!("group {g}: {v} held by {holders:?}"));
                }
            }
        }
        Ok(())
    }

    fn run(&mut self) -> Result<(), String> {
        while let Some(Reverse((t, _, e))) = self.queue.pop() {
            if t > Duration::from_secs(24 * 3600) {
                break; // heartbeats tick forever: a final check that never comes must end too
            }
            self.now = t;
            if let Some(b) = self.broken.take() {
                return Err(b);
            }
            match e {
                Ev::Tick { node, hb } => self.tick(node, hb),
                Ev::Deliver { to, from, inc, seq } => self.deliver(to, from, inc, seq),
                Ev::Reload { node } => self.reload(node),
                Ev::Step => self.step(),
                Ev::Resume { node } => {
                    self.resume(node);
                    self.changed();
                }
                Ev::Start { node } => {
                    if self.model.members.contains(&node) && !self.nodes[node].running {
                        self.start(node);
                    }
                    self.changed();
                }
                Ev::Check { since } => {
                    if since == self.last_change.as_nanos() as u64 && self.loss == 0.0 {
                        self.check()?;
                        if self.steps == STEPS {
                            return Ok(()); // the final check after the last step
                        }
                    }
                }
            }
        }
        Err("no final check: something kept changing".into())
    }
}

/// One of `from` at random.
fn pick(rng: &mut SmallRng, from: impl IntoIterator<Item = usize>) -> Option<usize> {
    let v: Vec<usize> = from.into_iter().collect();
    (!v.is_empty()).then(|| v[rng.random_range(0..v.len())])
}

fn seed_from_env(var: &str) -> Option<u64> {
    std::env::var(var).ok().map(|s| s.parse().unwrap_or_else(|_| panic!("{var} must be an integer")))
}

#[test]
fn every_group_agrees_on_one_owner_per_vip_after_random_membership_changes() {
    let seeds: Vec<u64> = match seed_from_env("VIP_MODEL_SEED") {
        Some(s) => vec![s],
        None => (0..seed_from_env("VIP_MODEL_SEEDS").unwrap_or(2000)).collect(),
    };
    let t = Instant::now();
    let (mut checks, mut sim_time) = (0, Duration::ZERO);
    for &seed in &seeds {
        let mut s = Sim::new(seed);
        if let Err(e) = s.run() {
            panic!("seed {seed} (replay: VIP_MODEL_SEED={seed}): {e}\nscenario:\n{}", s.log.join("\n"));
        }
        checks += s.checks;
        sim_time += s.now;
    }
    eprintln!("{} seeds, {checks} agreement checks over {sim_time:?} of simulated time, in {:?}", seeds.len(), t.elapsed());
}
