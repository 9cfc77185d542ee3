//! One answerer per VIP through random membership changes, in the HA lab: four
//! possible nodes, each a namespace that can run the real agent (file source,
//! one shared file), a client namespace. A seeded sequence of events (a node
//! added to the file and its agent started, or listed before its agent runs; a
//! node removed from the file with its agent left running, SIGTERMed or
//! SIGKILLed; an agent restarted after SIGKILL or SIGTERM; a stopped member's
//! agent started; a cable pulled, a node's link set down or the node isolated with its link up, and healed; the
//! timers in the file changed), and after each one, within a bound derived from
//! the timers in force:
//!
//! - every agent that runs, is in the model and is connected has read the file
//!   and sees the owners `ownership::assign` gives for exactly those nodes, and
//!   holds exactly its own;
//! - every running agent out of the model holds nothing;
//! - from the client, every VIP is answered by exactly its owner's MAC, and no
//!   other MAC announces it (so nothing held by a node out of the model or cut
//!   off reaches the client; a cut-off member may hold VIPs on its side).
//!
//! The seed is printed at the start and on failure; `VIP_MEMBERSHIP_SEED=N`
//! replays a seed's events (their timing is real, so not every interleaving).
//! Also here: a reload while a member is down keeps every VIP answered.
//! The scenarios are timing-sensitive, so they run one at a time.
use std::{
    collections::BTreeMap,
    fmt,
    net::Ipv4Addr,
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use rand::{rngs::SmallRng, Rng, SeedableRng};
use vip_tests::{
    agent::{agent_bin, wait_for, write_atomic},
    halab::{arp_probe, ha_config_of, vip, HaLab, HaSpec, Naming},
    netns::{hex_mac, privileged},
};

static SERIAL: Mutex<()> = Mutex::new(());

const NODES: usize = 4;
const VIPS: usize = 6;
const EVENTS: usize = 60;
/// The agents' `--reload-interval` (halab): a file change reaches each within it.
const RELOAD: Duration = Duration::from_millis(200);

/// (heartbeatInterval, deadAfter, holdTime) in ms, each valid (deadAfter ≥ 3
/// intervals and ≥ 4/3 holdTime); the first is the lab's default.
const TIMERS: [(u64, u64, u64); 4] = [(40, 250, 180), (30, 200, 150), (50, 400, 300), (60, 320, 240)];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// The node's bridge port down: its cable pulled.
    Cable,
    /// The node's own eth0 set down.
    Link,
    /// The node's bridge port disabled: its link stays up on a silent network.
    Isolate,
}

impl Cut {
    /// Whether the node's uplink loses its carrier (or is down): a lost NIC, so
    /// the node holds nothing; when isolated it believes it is alone.
    fn link_lost(self) -> bool {
        self != Cut::Isolate
    }
}

#[derive(Clone, Debug)]
enum Event {
    /// `start`: its agent is started after the file is written; `running`: it
    /// kept running since it was removed.
    Add {
        node: usize,
        start: bool,
        running: bool,
    },
    Remove {
        node: usize,
        stop: Option<i32>,
    },
    Restart {
        node: usize,
        sig: i32,
    },
    Start {
        node: usize,
    },
    Partition {
        node: usize,
        how: Cut,
    },
    Heal {
        node: usize,
    },
    Timers {
        set: usize,
    },
}

fn sig_name(sig: i32) -> &'static str {
    if sig == libc::SIGKILL {
        "SIGKILL"
    } else {
        "SIGTERM"
    }
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Add { node, running: true, .. } => write!(f, "add node-{} back to the file (its agent kept running)", node + 1),
            Event::Add { node, start: true, .. } => write!(f, "add node-{} (file, then its agent)", node + 1),
            Event::Add { node, .. } => write!(f, "add node-{} to the file (its agent not running)", node + 1),
            Event::Remove { node, stop: None } => write!(f, "remove node-{} from the file (its agent keeps running)", node + 1),
            Event::Remove { node, stop: Some(s) } => write!(f, "remove node-{} from the file, then {} its agent", node + 1, sig_name(*s)),
            Event::Restart { node, sig } => write!(f, "restart node-{}'s agent ({} + start)", node + 1, sig_name(*sig)),
            Event::Start { node } => write!(f, "start node-{}'s agent", node + 1),
            Event::Partition { node, how: Cut::Cable } => write!(f, "pull node-{}'s cable", node + 1),
            Event::Partition { node, how: Cut::Link } => write!(f, "set node-{}'s link down", node + 1),
            Event::Partition { node, how: Cut::Isolate } => write!(f, "isolate node-{} (link up)", node + 1),
            Event::Heal { node } => write!(f, "heal node-{}", node + 1),
            Event::Timers { set } => {
                let (i, d, h) = TIMERS[*set];
                write!(f, "timers: heartbeatInterval {i}ms, deadAfter {d}ms, holdTime {h}ms")
            }
        }
    }
}

/// What the test has done to the lab (the lab's agents say whether each runs).
struct World {
    members: Vec<usize>,
    cut: [Option<Cut>; NODES],
    timers: usize,
    /// Bumped on every write, so that each write changes the file's text.
    version: u32,
}

impl World {
    fn connected_members(&self, lab: &HaLab) -> Vec<usize> {
        self.members.iter().copied().filter(|&i| lab.nodes[i].agent.is_some() && self.cut[i].is_none()).collect()
    }
}

fn write_model(lab: &mut HaLab, w: &mut World) {
    let (i, d, h) = TIMERS[w.timers];
    (lab.spec.heartbeat_ms, lab.spec.dead_after_ms, lab.spec.hold_ms) = (i, d, h);
    w.version += 1;
    let text = format!("{}# version {}\n", ha_config_of(&lab.spec, &w.members), w.version);
    write_atomic(&lab.config, &text).expect("writing the lab's file");
}

fn generation(lab: &HaLab, i: usize) -> Option<u64> {
    Some(lab.status(i)?.config.generation)
}

/// Starts node `i`'s agent after removing its status file, so that what is read
/// next is this process's.
fn start(lab: &mut HaLab, i: usize) {
    let _ = std::fs::remove_file(&lab.nodes[i].status_file);
    lab.start_agent(i).expect("starting an agent");
}

fn cut(lab: &HaLab, i: usize, how: Cut, up: bool) {
    match how {
        Cut::Cable => lab.seg.cable(&lab.nodes[i].ns, up).expect("cable"),
        Cut::Link => {
            lab.nodes[i].ns.ip(&["link", "set", "eth0", if up { "up" } else { "down" }]).expect("link");
        }
        Cut::Isolate => lab.seg.isolate(&lab.nodes[i].ns, !up).expect("isolate"),
    }
}

/// An event that applies to the lab now and leaves at least one connected
/// member running (else no VIP could have an answerer), drawn from `rng`. Only
/// a removal or a cut can take that away: nothing else stops a member's agent
/// for good.
fn draw(rng: &mut SmallRng, lab: &HaLab, w: &World) -> Event {
    let running = |i: usize| lab.nodes[i].agent.is_some();
    let member = |i: usize| w.members.contains(&i);
    let cut = w.cut.iter().flatten().count();
    loop {
        // A kind (weights out of 12), then a node it applies to.
        let kind = rng.random_range(0..12);
        let fits: Vec<usize> = (0..NODES)
            .filter(|&i| match kind {
                0..=1 => !member(i),
                2..=3 => member(i) && w.members.len() > 1,
                4..=5 => member(i) && running(i),
                6 => member(i) && !running(i),
                7 => w.cut[i].is_none() && cut < 2,
                8..=9 => w.cut[i].is_some(),
                _ => i == 0, // timers: no node involved, one candidate
            })
            .collect();
        let Some(&node) = fits.get(rng.random_range(0..fits.len().max(1))) else { continue };
        let e = match kind {
            0..=1 => Event::Add { node, start: !running(node) && rng.random_bool(0.85), running: running(node) },
            2..=3 => Event::Remove { node, stop: [None, Some(libc::SIGTERM), Some(libc::SIGKILL)][rng.random_range(0..3)] },
            4..=5 => Event::Restart { node, sig: if rng.random_bool(0.5) { libc::SIGKILL } else { libc::SIGTERM } },
            6 => Event::Start { node },
            7 => Event::Partition { node, how: [Cut::Cable, Cut::Link, Cut::Isolate][rng.random_range(0..3)] },
            8..=9 => Event::Heal { node },
            _ => {
                let set = rng.random_range(0..TIMERS.len());
                if set == w.timers {
                    continue;
                }
                Event::Timers { set }
            }
        };
        // Who would still answer afterwards.
        let left = w.connected_members(lab).into_iter().filter(|&i| match e {
            Event::Remove { node, .. } | Event::Partition { node, .. } => i != node,
            _ => true,
        });
        if left.count() > 0 {
            return e;
        }
    }
}

/// Applies `e`; returns the agents that were running before and still run the
/// same process, with their config generation before the file was written (each
/// must read the new file), and the agents it started.
fn apply(lab: &mut HaLab, w: &mut World, e: &Event) -> (BTreeMap<usize, u64>, Vec<usize>) {
    let running: BTreeMap<usize, u64> = (0..NODES).filter(|&i| lab.nodes[i].agent.is_some()).map(|i| (i, generation(lab, i).expect("a status"))).collect();
    let mut reread = BTreeMap::new();
    let mut started = Vec::new();
    match *e {
        Event::Add { node, start: s, .. } => {
            w.members.push(node);
            w.members.sort();
            write_model(lab, w);
            reread = running;
            if s {
                start(lab, node);
                started.push(node);
            }
        }
        Event::Remove { node, stop } => {
            w.members.retain(|&m| m != node);
            write_model(lab, w);
            reread = running;
            if let Some(sig) = stop {
                lab.stop_agent(node, sig);
                reread.remove(&node);
            }
        }
        Event::Restart { node, sig } => {
            lab.stop_agent(node, sig);
            start(lab, node);
            started.push(node);
        }
        Event::Start { node } => {
            start(lab, node);
            started.push(node);
        }
        Event::Partition { node, how } => {
            cut(lab, node, how, false);
            w.cut[node] = Some(how);
        }
        Event::Heal { node } => {
            cut(lab, node, w.cut[node].take().expect("a cut node"), true);
        }
        Event::Timers { set } => {
            w.timers = set;
            write_model(lab, w);
            reread = running;
        }
    }
    (reread, started)
}

/// The agents' view matches what the lab is (see the module docs); the mismatch otherwise.
fn statuses_agree(lab: &HaLab, w: &World, reread: &BTreeMap<usize, u64>, want: &BTreeMap<Ipv4Addr, String>) -> Result<(), String> {
    let connected = w.connected_members(lab);
    for i in (0..NODES).filter(|&i| lab.nodes[i].agent.is_some()) {
        let name = &lab.nodes[i].name;
        let g = generation(lab, i).ok_or(format!("{name}: no status yet"))?;
        if reread.get(&i).is_some_and(|before| g <= *before) {
            return Err(format!("{name} has not read the new file (generation {g})"));
        }
        let held = lab.held_by(i);
        if !w.members.contains(&i) {
            if !held.is_empty() {
                return Err(format!("{name} is out of the model and holds {held:?}"));
            }
        } else if w.cut[i].is_some_and(Cut::link_lost) {
            if !held.is_empty() {
                return Err(format!("{name} lost its uplink and holds {held:?}"));
            }
        } else if connected.contains(&i) {
            let seen = lab.owners_seen_by(i).unwrap_or_default();
            if seen != *want {
                return Err(format!("{name} sees owners {seen:?}"));
            }
            // With no health check, a service's backends are the members the
            // agent counts alive: they must be exactly the connected ones.
            let alive: Vec<String> = connected.iter().map(|&j| lab.nodes[j].name.clone()).collect();
            let services = lab.status(i).unwrap_or_default().services;
            if services.len() != VIPS || services.iter().any(|s| s.backends != alive) {
                return Err(format!("{name} does not count exactly {alive:?} alive: services {services:?}"));
            }
            let own: Vec<Ipv4Addr> = want.iter().filter(|(_, o)| *o == name).map(|(v, _)| *v).collect();
            if held != own {
                return Err(format!("{name} holds {held:?}, owns {own:?}"));
            }
        }
    }
    Ok(())
}

/// Every VIP answered by its owner's MAC alone and announced by no other MAC, in
/// a probe of `rounds` requests per VIP `gap_ms` apart.
fn arp_agrees(lab: &HaLab, want: &BTreeMap<Ipv4Addr, String>, rounds: u32, gap_ms: u64) -> Result<(), String> {
    let vips: Vec<Ipv4Addr> = want.keys().copied().collect();
    let claims = arp_probe(&lab.client, &vips, rounds, Duration::from_millis(gap_ms)).map_err(|e| format!("ARP probe: {e:#}"))?;
    let who = |m: &[u8; 6]| lab.nodes.iter().find(|n| n.mac == *m).map_or_else(|| hex_mac(*m), |n| n.name.clone());
    let mut bad = Vec::new();
    for (v, owner) in want {
        let mac = lab.nodes[lab.index_of(owner)].mac;
        let c = &claims[v];
        if c.answered.len() != 1 || !c.answered.contains(&mac) || c.announced.iter().any(|m| *m != mac) {
            let answered: Vec<String> = c.answered.iter().map(who).collect();
            let announced: Vec<String> = c.announced.iter().map(who).collect();
            bad.push(format!("{v} (owner {owner}): answered by {answered:?}, announced by {announced:?}"));
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join("; "))
    }
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Fails with the seed, the events so far and the end of every agent's log.
fn fail(seed: u64, lab: &HaLab, history: &[String], why: String) -> ! {
    let logs: String =
        lab.nodes.iter().map(|n| format!("--- {} (last lines):\n{}\n", n.name, tail(&std::fs::read_to_string(&n.log).unwrap_or_default(), 40))).collect();
    panic!("seed {seed} (replay with VIP_MEMBERSHIP_SEED={seed}): {why}\nevents:\n{}\n{logs}", history.join("\n"));
}

#[test]
fn every_vip_has_one_answerer_through_random_membership_changes() {
    if !privileged() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let seed =
        std::env::var("VIP_MEMBERSHIP_SEED").map(|s| s.parse().expect("VIP_MEMBERSHIP_SEED must be an integer")).unwrap_or_else(|_| rand::random::<u64>());
    eprintln!("membership test: seed {seed} (replay with VIP_MEMBERSHIP_SEED={seed})");
    let mut rng = SmallRng::seed_from_u64(seed);
    let began = Instant::now();
    // Health checks off: ownership is what is under test, and four agents probing
    // each other only load the machine.
    let spec = HaSpec { nodes: NODES, vips: VIPS, health_check: false, ..Default::default() };
    let mut lab = HaLab::build(spec, Naming::Unique, Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap();
    let mut w = World { members: vec![0, 1, 2], cut: [None; NODES], timers: 0, version: 0 };
    write_model(&mut lab, &mut w);
    for i in 0..3 {
        start(&mut lab, i);
    }
    let vips: Vec<Ipv4Addr> = (0..VIPS).map(vip).collect();
    let mut history: Vec<String> = Vec::new();
    let mut took: Vec<Duration> = Vec::new();
    for step in 0..=EVENTS {
        // Step 0 is the start itself.
        let (old_timers, t0) = (w.timers, Instant::now());
        let (reread, started) = if step == 0 {
            history.push("start node-1..3 on a three-node file".into());
            (BTreeMap::new(), vec![0, 1, 2])
        } else {
            let e = draw(&mut rng, &lab, &w);
            history.push(format!("{step:>2}. {e}"));
            apply(&mut lab, &mut w, &e)
        };
        let connected: Vec<String> = w.connected_members(&lab).iter().map(|&i| lab.nodes[i].name.clone()).collect();
        let want = vip_agent::ha::ownership::assign(&vips, &connected);
        // The bound, from the timers in force (the larger of the old and new):
        // the file read (RELOAD); an agent started and its data path attached (up
        // to 1 s on this loaded 2-core machine); a heartbeat restarted by the
        // change presumes its peers alive for one deadAfter, notices a silent one
        // at its next tick and hears a healed one within an interval (2
        // intervals); a stopped agent's entries lapse holdTime after their last
        // refresh; 1 s for status writes, the ARP probe and scheduling.
        let (a, b) = (TIMERS[old_timers], TIMERS[w.timers]);
        let (i, d, h) = (a.0.max(b.0), a.1.max(b.1), a.2.max(b.2));
        let bound = RELOAD + Duration::from_secs(1) + Duration::from_millis(d + 2 * i + h) + Duration::from_secs(1);
        // Agreement counts only once it cannot be the state from before the
        // event: a status shows the file's generation as soon as the agent's main
        // loop has read it, before its liveness thread has restarted heartbeats
        // with it, and a restarted heartbeat (as a new agent's) presumes its
        // peers alive for one deadAfter and notices a silent one at its next
        // tick. So every agent that read the file or started must have done so
        // deadAfter + 2 intervals + 100 ms (the heartbeat port's re-bind) ago;
        // and a stopped agent's entries must have lapsed (holdTime).
        let presumption = Duration::from_millis(d + 2 * i + 100);
        let mut fresh: BTreeMap<usize, Instant> = BTreeMap::new();
        let fresh_agents: Vec<usize> = (0..NODES).filter(|&j| lab.nodes[j].agent.is_some() && (reread.contains_key(&j) || started.contains(&j))).collect();
        let settled = wait_for(bound, || {
            for &j in &fresh_agents {
                let seen = generation(&lab, j).is_some_and(|g| reread.get(&j).is_none_or(|before| g > *before));
                if seen {
                    fresh.entry(j).or_insert_with(Instant::now);
                }
            }
            let waited = fresh.len() == fresh_agents.len() && fresh.values().all(|t| t.elapsed() >= presumption);
            (waited && t0.elapsed() >= Duration::from_millis(h) && statuses_agree(&lab, &w, &reread, &want).is_ok()).then_some(())
        });
        if settled.is_none() {
            let why = statuses_agree(&lab, &w, &reread, &want)
                .err()
                .unwrap_or_else(|| format!("agents that read the file or started: {fresh_agents:?}, seen so: {fresh:?}"));
            fail(seed, &lab, &history, format!("no agreement within {bound:?} of event {step}: {why}"));
        }
        if let Err(why) = arp_agrees(&lab, &want, 3, 40) {
            fail(seed, &lab, &history, format!("after event {step}, the agents agree but the client sees: {why}"));
        }
        // Still agreed after the probe: not a passing moment.
        if let Err(why) = statuses_agree(&lab, &w, &reread, &want) {
            fail(seed, &lab, &history, format!("after event {step}, agreement lost again: {why}"));
        }
        let t = t0.elapsed();
        took.push(t);
        let (cut, running): (Vec<String>, Vec<String>) = (
            (0..NODES).filter(|&i| w.cut[i].is_some()).map(|i| lab.nodes[i].name.clone()).collect(),
            (0..NODES).filter(|&i| lab.nodes[i].agent.is_some()).map(|i| lab.nodes[i].name.clone()).collect(),
        );
        eprintln!("{} -> checked in {t:.2?} (bound {bound:?}); answering: {connected:?}, running: {running:?}, cut: {cut:?}", history[step]);
    }
    // Every pool has its interface on every node here: an agent that said it owns a
    // VIP with no interface for it decided from a model and a placement that did
    // not belong together (a node removed from the file, for an instant).
    for n in &lab.nodes {
        let log = std::fs::read_to_string(&n.log).unwrap_or_default();
        if let Some(line) = log.lines().find(|l| l.contains("its pool has no interface here")) {
            fail(seed, &lab, &history, format!("{}: a false ownership error: {line}", n.name));
        }
    }
    took.sort();
    eprintln!(
        "membership test: seed {seed}, {EVENTS} events checked in {:.1?}; per event median {:.2?}, max {:.2?}",
        began.elapsed(),
        took[took.len() / 2],
        took[took.len() - 1]
    );
}

/// A change of the file restarts every agent's heartbeats; they must not presume
/// a member they know to be down alive again (it would be given VIPs for a
/// deadAfter, unanswered meanwhile). Three members, node-3's agent killed; then
/// the timers change back and forth: every ARP probe (each VIP asked once, answers
/// awaited 25 ms, continuously) during and after each reload gets exactly the owner's MAC.
#[test]
fn a_reload_keeps_every_vip_answered_while_a_member_is_down() {
    if !privileged() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let spec = HaSpec { nodes: NODES, vips: VIPS, health_check: false, ..Default::default() };
    let mut lab = HaLab::build(spec, Naming::Unique, Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap();
    let mut w = World { members: vec![0, 1, 2], cut: [None; NODES], timers: 0, version: 0 };
    write_model(&mut lab, &mut w);
    for i in 0..3 {
        start(&mut lab, i);
    }
    lab.kill_agent(2);
    let vips: Vec<Ipv4Addr> = (0..VIPS).map(vip).collect();
    let want = vip_agent::ha::ownership::assign(&vips, &["node-1".to_owned(), "node-2".to_owned()]);
    let converged = wait_for(Duration::from_secs(5), || statuses_agree(&lab, &w, &BTreeMap::new(), &want).ok());
    assert!(converged.is_some(), "no agreement with node-3 down: {:?}\n{}", statuses_agree(&lab, &w, &BTreeMap::new(), &want), lab.agent_logs());
    arp_agrees(&lab, &want, 3, 40).unwrap_or_else(|e| panic!("before any reload: {e}"));
    let mut bad = Vec::new();
    for (round, set) in [2, 0, 2, 0].into_iter().enumerate() {
        w.timers = set;
        write_model(&mut lab, &mut w);
        // The reload comes within RELOAD; watch twice as long plus a deadAfter.
        let t0 = Instant::now();
        while t0.elapsed() < RELOAD * 2 + Duration::from_millis(TIMERS[set].1) {
            if let Err(e) = arp_agrees(&lab, &want, 1, 25) {
                bad.push(format!("reload {round}, {:?} after the write: {e}", t0.elapsed()));
            }
        }
    }
    assert!(bad.is_empty(), "VIPs not answered by their owner alone during reloads:\n{}\n{}", bad.join("\n"), lab.agent_logs());
}
