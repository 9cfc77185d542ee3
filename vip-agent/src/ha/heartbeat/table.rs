//! Who is alive: the pure state machine the heartbeats received feed.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

/// A liveness change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// First heartbeat, heartbeat after being dead, or a new incarnation (restart).
    Up {
        node: String,
        incarnation: u64,
    },
    Down {
        node: String,
    },
    /// Its agent is stopping and asked to stay a backend until `until` (see
    /// [`Heartbeat::leaving_ms`](super::Heartbeat::leaving_ms)); a later
    /// heartbeat of a new incarnation is Up.
    Leaving {
        node: String,
    },
    /// A leaving node's time as a backend ran out without its next agent heard.
    Gone {
        node: String,
    },
    /// Silent for half of `dead_after` (not leaving): whether its node still
    /// serves is worth asking before it is declared dead (see [`PeerSets::silent`]).
    Late {
        node: String,
    },
    /// Heard again after [`Event::Late`] without having been declared dead.
    OnTime {
        node: String,
    },
}

#[derive(Debug)]
struct Peer {
    incarnation: u64,
    seq: u64,
    last_seen: Instant,
    alive: bool,
    /// Left (a stopping agent's last heartbeat): a backend until then.
    leaving_until: Option<Instant>,
    /// Silent for half of `dead_after` or more (and not leaving), until heard.
    late: bool,
}

/// Pure liveness state for the other agents. Time is passed in, never read.
#[derive(Debug)]
pub struct PeerTable {
    dead_after: Duration,
    peers: BTreeMap<String, Peer>,
}

/// What one heartbeat did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Taken; a liveness change when there was one.
    Fresh(Option<Event>),
    /// An older incarnation, or a sequence number not above the last: a replay, a
    /// duplicate or a datagram overtaken by newer ones. Changes nothing.
    Stale,
}

impl PeerTable {
    pub fn new(dead_after: Duration) -> Self {
        Self { dead_after, peers: BTreeMap::new() }
    }

    /// Records a heartbeat received at `now`. Incarnations only go forward (an
    /// agent's incarnation is its start time): an older one, or the same one with
    /// a sequence number not above the last, is [`Seen::Stale`] and neither
    /// refreshes liveness nor produces events.
    pub fn observe(&mut self, node: &str, incarnation: u64, seq: u64, now: Instant) -> Seen {
        let up = Some(Event::Up { node: node.to_owned(), incarnation });
        let Some(p) = self.peers.get_mut(node) else {
            self.peers.insert(node.to_owned(), Peer { incarnation, seq, last_seen: now, alive: true, leaving_until: None, late: false });
            return Seen::Fresh(up);
        };
        if incarnation < p.incarnation || (incarnation == p.incarnation && seq <= p.seq) {
            return Seen::Stale;
        }
        if incarnation > p.incarnation {
            // Restarted: a new incarnation starts its own sequence, reported as Up
            // below; a peer presumed alive (incarnation 0) that is heard for the
            // first time is no change.
            let presumed = p.incarnation == 0 && p.alive;
            p.incarnation = incarnation;
            p.alive = presumed;
        }
        p.seq = seq;
        p.last_seen = now;
        let was_late = std::mem::take(&mut p.late);
        if p.alive {
            return Seen::Fresh(was_late.then(|| Event::OnTime { node: node.to_owned() }));
        }
        p.alive = true;
        p.leaving_until = None;
        Seen::Fresh(up)
    }

    /// Records a leaving heartbeat (a stopping agent's last,
    /// [`Heartbeat::leaving_ms`](super::Heartbeat::leaving_ms)): the peer is no
    /// longer alive (its VIPs go to others at once) but stays a backend for
    /// `stay`. Replays are refused as by [`PeerTable::observe`]; a new incarnation
    /// heard later is Up.
    pub fn observe_leaving(&mut self, node: &str, incarnation: u64, seq: u64, stay: Duration, now: Instant) -> Seen {
        let Some(p) = self.peers.get_mut(node) else {
            // Never heard alive: nothing to hand over, and nothing to keep.
            return Seen::Fresh(None);
        };
        if incarnation < p.incarnation || (incarnation == p.incarnation && seq <= p.seq) {
            return Seen::Stale;
        }
        p.incarnation = incarnation;
        p.seq = seq;
        p.last_seen = now;
        p.alive = false;
        p.late = false;
        p.leaving_until = Some(now + stay);
        Seen::Fresh(Some(Event::Leaving { node: node.to_owned() }))
    }

    /// Counts `node` alive as of `now` without having heard it: an agent that
    /// starts presumes its configured peers alive for one `dead_after`, so it does
    /// not grab their VIPs before their first heartbeats can arrive. Incarnation 0
    /// is "unknown": the first real heartbeat replaces it.
    pub fn presume(&mut self, node: &str, now: Instant) {
        self.peers.entry(node.to_owned()).or_insert(Peer { incarnation: 0, seq: 0, last_seen: now, alive: true, leaving_until: None, late: false });
    }

    /// Counts `node` silent (late, or dead if not presumed alive) as a replaced
    /// table did, without having heard it: it stays in [`PeerSets::silent`]
    /// until heard.
    pub fn carry_silent(&mut self, node: &str, now: Instant) {
        self.peers.entry(node.to_owned()).or_insert(Peer { incarnation: 0, seq: 0, last_seen: now, alive: false, leaving_until: None, late: false }).late =
            true;
    }

    /// After this agent itself was not running (stopped, starved), silence from
    /// peers means nothing: every peer alive before gets a fresh `dead_after`
    /// from `now` instead of being declared dead for our own gap.
    pub fn forgive(&mut self, now: Instant) {
        for p in self.peers.values_mut().filter(|p| p.alive) {
            p.last_seen = p.last_seen.max(now);
        }
    }

    /// Marks peers silent for `dead_after` or longer as dead, and leaving peers
    /// whose time ran out as gone.
    pub fn expire(&mut self, now: Instant) -> Vec<Event> {
        let mut events = Vec::new();
        for (node, p) in &mut self.peers {
            if p.alive && now.saturating_duration_since(p.last_seen) >= self.dead_after {
                p.alive = false;
                events.push(Event::Down { node: node.clone() });
            }
            if p.leaving_until.is_some_and(|t| now >= t) {
                p.leaving_until = None;
                events.push(Event::Gone { node: node.clone() });
            }
        }
        events
    }

    /// Names of the peers currently alive.
    pub fn live(&self) -> BTreeSet<String> {
        self.peers.iter().filter(|(_, p)| p.alive).map(|(n, _)| n.clone()).collect()
    }

    /// Names of the peers that left and are still backends.
    pub fn leaving(&self) -> BTreeSet<String> {
        self.peers.iter().filter(|(_, p)| p.leaving_until.is_some()).map(|(n, _)| n.clone()).collect()
    }

    /// Marks peers silent for half of `dead_after` or more, alive or dead, that
    /// are not leaving as late (see [`PeerSets::silent`]); their events.
    pub fn mark_late(&mut self, now: Instant) -> Vec<Event> {
        let mut events = Vec::new();
        for (node, p) in &mut self.peers {
            if !p.late && p.leaving_until.is_none() && now.saturating_duration_since(p.last_seen) >= self.dead_after / 2 {
                p.late = true;
                events.push(Event::Late { node: node.clone() });
            }
        }
        events
    }

    /// Names of the peers late or dead and not leaving (see [`PeerSets::silent`]).
    pub fn silent(&self) -> BTreeSet<String> {
        self.peers.iter().filter(|(_, p)| p.late).map(|(n, _)| n.clone()).collect()
    }

    /// What the heartbeat task publishes, with `me` alive.
    pub(super) fn peer_sets(&self, me: &str) -> PeerSets {
        let mut live = self.live();
        live.insert(me.to_owned());
        PeerSets { live, leaving: self.leaving(), silent: self.silent() }
    }
}

/// What the heartbeat task publishes: who is alive (holds VIPs, backs services),
/// and who left to restart and still backs services
/// ([`Heartbeat::leaving_ms`](super::Heartbeat::leaving_ms)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerSets {
    pub live: BTreeSet<String>,
    pub leaving: BTreeSet<String>,
    /// Peers silent for half of `dead_after` or more that did not say they were
    /// leaving, alive still or already dead: their agent may have crashed while
    /// their node serves on, which the agent asks their health targets
    /// (`agent::silent`) before they are declared dead.
    pub silent: BTreeSet<String>,
}
