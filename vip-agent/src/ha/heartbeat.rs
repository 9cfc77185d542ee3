//! Failure detection between agents over UDP on the node network, independent of
//! any API server (the API server is often what is unreachable when a node fails).
//!
//! Every agent sends a small JSON datagram to every configured peer each
//! `interval`; a peer not heard from for `dead_after` is dead. [`PeerTable`] is the
//! pure state machine (fed with fake time in tests); [`run`] is the tokio task that
//! drives it and publishes the live set.
//!
//! Trust: a datagram is accepted only from the address the model gives its sender,
//! carrying that sender's name, with a valid tag under one of the cluster keys
//! (`auth`), and newer than what this table has seen from that sender (incarnation,
//! then sequence number); see docs/security.md.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};
use tokio::{net::UdpSocket, sync::watch};

/// Wire format, version 1. `sent_ms` (sender's wall clock, Unix ms) is informational
/// (logs, skew/latency metrics): clocks are not assumed to agree, so liveness uses
/// only the receiver's monotonic clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub v: u8,
    pub node: String,
    pub incarnation: u64,
    pub seq: u64,
    pub sent_ms: u64,
    /// Sent by an agent that is stopping (SIGTERM: a rolling update, a restart):
    /// take my VIPs now, but keep this node in the rings for this long, since its
    /// data path and kube-proxy keep serving the connections they carry while its
    /// next agent starts. Health checks still take it out if the node itself goes.
    /// Absent (0) in every other heartbeat; agents of before ignore it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub leaving_ms: u64,
    /// ARP self-check findings for VIPs the receiver holds (`super::arpcheck`),
    /// in the heartbeat to that peer only; absent when there are none. Agents of
    /// before ignore the field (unknown fields are skipped when decoding).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub arp: Vec<super::arpcheck::Finding>,
    /// The sender's cluster-wide settings (`model::cluster_settings`), in every
    /// [`SETTINGS_EVERY`]th heartbeat (the first among them), absent in the
    /// others; agents of before ignore it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub settings: String,
}

/// One heartbeat in this many carries the sender's settings: a second's worth at
/// the default interval, so that they cost little beside the heartbeats.
pub const SETTINGS_EVERY: u64 = 20;

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Heartbeat {
    pub const VERSION: u8 = 1;

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a struct of strings and integers serializes")
    }

    /// `None` for anything that is not a version-1 heartbeat.
    pub fn decode(b: &[u8]) -> Option<Self> {
        serde_json::from_slice::<Self>(b).ok().filter(|h| h.v == Self::VERSION)
    }
}

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
    /// [`Heartbeat::leaving_ms`]); a later heartbeat of a new incarnation is Up.
    Leaving {
        node: String,
    },
    /// A leaving node's time as a backend ran out without its next agent heard.
    Gone {
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
            self.peers.insert(node.to_owned(), Peer { incarnation, seq, last_seen: now, alive: true, leaving_until: None });
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
        if p.alive {
            return Seen::Fresh(None);
        }
        p.alive = true;
        p.leaving_until = None;
        Seen::Fresh(up)
    }

    /// Records a leaving heartbeat (a stopping agent's last, [`Heartbeat::leaving_ms`]):
    /// the peer is no longer alive (its VIPs go to others at once) but stays a
    /// backend for `stay`. Replays are refused as by [`PeerTable::observe`]; a new
    /// incarnation heard later is Up.
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
        p.leaving_until = Some(now + stay);
        Seen::Fresh(Some(Event::Leaving { node: node.to_owned() }))
    }

    /// Counts `node` alive as of `now` without having heard it: an agent that
    /// starts presumes its configured peers alive for one `dead_after`, so it does
    /// not grab their VIPs before their first heartbeats can arrive. Incarnation 0
    /// is "unknown": the first real heartbeat replaces it.
    pub fn presume(&mut self, node: &str, now: Instant) {
        self.peers.entry(node.to_owned()).or_insert(Peer { incarnation: 0, seq: 0, last_seen: now, alive: true, leaving_until: None });
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

    /// What the heartbeat task publishes, with `me` alive.
    fn peer_sets(&self, me: &str) -> PeerSets {
        let mut live = self.live();
        live.insert(me.to_owned());
        PeerSets { live, leaving: self.leaving() }
    }
}

/// What the heartbeat task publishes: who is alive (holds VIPs, backs services),
/// and who left to restart and still backs services ([`Heartbeat::leaving_ms`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerSets {
    pub live: BTreeSet<String>,
    pub leaving: BTreeSet<String>,
}

impl PeerTable {}

/// This agent start's incarnation: the wall clock in nanoseconds, so that a
/// restarted agent's incarnation is above its last one and a replayed datagram of
/// an earlier run is recognised as old. (A node whose clock went back across a
/// restart is taken for a replay by its peers until its clock passes its last
/// start; its log and `vip_heartbeats_rejected_total{reason="stale"}` on the
/// peers say so.)
pub fn new_incarnation() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How one agent's heartbeat task is set up.
#[derive(Clone, Debug)]
pub struct Options {
    /// This agent's address and port: peers accept datagrams only from it.
    pub bind: SocketAddr,
    /// Every other agent (name, address and port), presumed alive at start
    /// unless in `dead`.
    pub peers: Vec<(String, SocketAddr)>,
    /// Peers known to be down when this task replaces one with other settings
    /// (a changed file): live again only once heard. Presuming them alive would
    /// hand them VIPs, unanswered, for a `dead_after` on every change.
    pub dead: BTreeSet<String>,
    pub me: String,
    pub interval: Duration,
    pub dead_after: Duration,
    /// Monotonic ns of the agent's liveness loop's last turn, and how old it may
    /// be: a wedged loop (which no longer refreshes its held VIPs) must not look
    /// alive to peers just because this task still runs, so heartbeats stop.
    pub gate: Option<(Arc<AtomicU64>, Duration)>,
    /// Where the task reports on itself (None in unit tests).
    pub metrics: Option<Metrics>,
    /// The cluster keys heartbeats are signed and checked with; None: the segment
    /// is trusted (`--trusted-segment`): plain datagrams, filtered by address only.
    pub keys: Option<super::auth::SharedKeys>,
    /// Set to Some(stay) when the agent stops: the task sends leaving heartbeats
    /// ([`Heartbeat::leaving_ms`]) and ends.
    pub leave: Option<watch::Receiver<Option<Duration>>>,
    /// The ARP self-check's findings: those to send (by holder), and where the
    /// findings received go (with their sender's name).
    pub arp: Option<ArpLink>,
    /// This agent's cluster-wide settings to send, and where the peers' go.
    pub settings: Option<SettingsLink>,
}

/// How the cluster-wide settings ride on heartbeats ([`Heartbeat::settings`]).
#[derive(Clone, Debug)]
pub struct SettingsLink {
    /// This agent's (`model::cluster_settings`), as they are now.
    pub ours: watch::Receiver<String>,
    /// Each configured peer's, as last heard (peers no longer configured are
    /// dropped when a task starts).
    pub peers: watch::Sender<BTreeMap<String, String>>,
}

/// How the ARP self-check rides on heartbeats ([`Heartbeat::arp`]).
#[derive(Clone, Debug)]
pub struct ArpLink {
    pub outbox: super::arpcheck::Outbox,
    pub reports: tokio::sync::mpsc::UnboundedSender<(String, Vec<super::arpcheck::Finding>)>,
}

/// Why a received datagram changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rejected {
    /// From an address that is no configured peer's.
    UnknownSender,
    /// Not a heartbeat (or unsigned where keys are set).
    Malformed,
    /// Signed with a key we do not have.
    UnknownKey,
    /// A bad tag: forged or altered.
    BadTag,
    /// A name that is not the one the model gives the sender's address.
    WrongName,
    /// An older incarnation or a sequence number already seen: a replay.
    Stale,
}

impl Rejected {
    pub fn name(self) -> &'static str {
        match self {
            Rejected::UnknownSender => "unknown_sender",
            Rejected::Malformed => "malformed",
            Rejected::UnknownKey => "unknown_key",
            Rejected::BadTag => "bad_tag",
            Rejected::WrongName => "wrong_name",
            Rejected::Stale => "stale",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct RejectLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, prometheus_client::encoding::EncodeLabelSet)]
pub struct PeerLabels {
    pub peer: String,
}

/// What the heartbeat task measures.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Turns on which the gate was shut or this task itself had not run for a
    /// while: a tripwire that should stay at zero.
    pub stalls: prometheus_client::metrics::counter::Counter,
    /// How close each peer came to being declared dead, lately.
    pub gaps: Gaps,
    /// Datagrams that changed nothing, by reason.
    pub rejected: prometheus_client::metrics::family::Family<RejectLabels, prometheus_client::metrics::counter::Counter>,
}

/// How far back [`Gaps`] looks: longer than a scrape interval (Prometheus' default
/// is one minute), so that every gap is seen by at least one scrape.
pub const GAP_WINDOW: Duration = Duration::from_secs(120);

/// The longest time without a heartbeat from each peer over the last
/// [`GAP_WINDOW`], the current silence included: a rolling maximum, so that one
/// slow moment long ago does not hide how the peer is doing now, and a peer that
/// went silent shows at once. Shared by the heartbeat tasks an agent runs in turn.
#[derive(Clone, Debug, Default)]
pub struct Gaps(Arc<std::sync::Mutex<BTreeMap<String, PeerGaps>>>);

#[derive(Debug)]
struct PeerGaps {
    /// When it was last heard (or first tracked), and by which incarnation (None:
    /// not heard yet).
    last: Instant,
    incarnation: Option<u64>,
    /// Gaps between heartbeats of one incarnation (a restart is no gap), by end.
    gaps: std::collections::VecDeque<(Instant, Duration)>,
}

impl Gaps {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, PeerGaps>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The peers heartbeats are exchanged with now: others are forgotten (their
    /// series go), new ones are counted from `now`.
    pub fn track<'a>(&self, peers: impl IntoIterator<Item = &'a str>, now: Instant) {
        let peers: BTreeSet<&str> = peers.into_iter().collect();
        let mut all = self.lock();
        all.retain(|p, _| peers.contains(p.as_str()));
        for p in peers {
            all.entry(p.to_owned()).or_insert_with(|| PeerGaps { last: now, incarnation: None, gaps: Default::default() });
        }
    }

    /// A heartbeat accepted from `peer` at `now` (untracked peers are ignored: a
    /// task that is being replaced must not bring back a peer that left).
    pub fn heard(&self, peer: &str, incarnation: u64, now: Instant) {
        let mut all = self.lock();
        let Some(p) = all.get_mut(peer) else { return };
        // Gaps are between heartbeats of one incarnation: the wait for a peer's
        // first one (its agent starting after ours) and a restart are none; the
        // silence shows while it lasts all the same (`max_at`).
        if p.incarnation == Some(incarnation) {
            p.gaps.push_back((now, now.saturating_duration_since(p.last)));
        }
        (p.last, p.incarnation) = (now, Some(incarnation));
        while p.gaps.front().is_some_and(|(end, _)| now.saturating_duration_since(*end) > GAP_WINDOW) {
            p.gaps.pop_front();
        }
    }

    /// Each tracked peer's longest gap in the window ending at `now`, in seconds.
    pub fn max_at(&self, now: Instant) -> BTreeMap<String, f64> {
        self.lock()
            .iter()
            .map(|(name, p)| {
                let silence = now.saturating_duration_since(p.last);
                let recent = p.gaps.iter().filter(|(end, _)| now.saturating_duration_since(*end) <= GAP_WINDOW).map(|(_, g)| *g);
                (name.clone(), recent.fold(silence, Duration::max).as_secs_f64())
            })
            .collect()
    }
}

/// Binds `bind` and spawns the heartbeat task on the current tokio runtime. The
/// receiver holds the live set (always including `me`; peers presumed alive until
/// `dead_after` passes without a heartbeat) and changes only when the set does.
/// The task stops, releasing the socket, once every receiver is dropped.
///
/// A dead peer is noticed between `dead_after` and `dead_after + interval` after
/// its last heartbeat (expiry is checked on every send tick and receive).
pub async fn run(o: Options) -> io::Result<watch::Receiver<PeerSets>> {
    let sock = UdpSocket::bind(o.bind).await?;
    if let Some(m) = &o.metrics {
        m.gaps.track(o.peers.iter().map(|(n, _)| n.as_str()), Instant::now());
    }
    let mut table = PeerTable::new(o.dead_after);
    let now = Instant::now();
    for (name, _) in o.peers.iter().filter(|(n, _)| !o.dead.contains(n)) {
        table.presume(name, now);
    }
    if let Some(l) = &o.settings {
        // A set: a scan of the peers per entry would be quadratic in the cluster's size.
        let configured: std::collections::HashSet<&str> = o.peers.iter().map(|(n, _)| n.as_str()).collect();
        l.peers.send_if_modified(|m| {
            let before = m.len();
            m.retain(|n, _| configured.contains(n.as_str()));
            m.len() != before
        });
    }
    let (tx, rx) = watch::channel(table.peer_sets(&o.me));
    tokio::spawn(heartbeat_loop(sock, o, table, tx));
    Ok(rx)
}

fn gate_open(gate: &Option<(Arc<AtomicU64>, Duration)>) -> bool {
    match gate {
        None => true,
        Some((last_turn, max_age)) => {
            let age = crate::clock::monotonic_ns().saturating_sub(last_turn.load(Ordering::Relaxed));
            Duration::from_nanos(age) <= *max_age
        }
    }
}

/// The heartbeat in a datagram from `from`, if it is one we take: from a known
/// peer's address, signed with one of our keys (when we have keys), carrying
/// the name the model gives that address.
fn accept(datagram: &[u8], from: SocketAddr, known: &HashMap<SocketAddr, String>, keys: Option<&super::auth::Keys>) -> Result<Heartbeat, Rejected> {
    let name = known.get(&plain(from)).ok_or(Rejected::UnknownSender)?;
    let payload = match keys {
        Some(k) => k.open(datagram).map_err(|r| match r {
            super::auth::Reject::Malformed => Rejected::Malformed,
            super::auth::Reject::UnknownKey => Rejected::UnknownKey,
            super::auth::Reject::BadTag => Rejected::BadTag,
        })?,
        None => datagram,
    };
    let hb = Heartbeat::decode(payload).ok_or(Rejected::Malformed)?;
    if hb.node != *name {
        return Err(Rejected::WrongName);
    }
    Ok(hb)
}

/// An address and port alone: an IPv6 sender's flow label and scope id (set by the
/// kernel or not) do not make it another peer.
fn plain(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip(), a.port())
}

async fn heartbeat_loop(sock: UdpSocket, o: Options, mut table: PeerTable, tx: watch::Sender<PeerSets>) {
    let Options { ref peers, ref me, interval, ref gate, ref metrics, .. } = o;
    let (peers, me, gate, metrics) = (peers.clone(), me.clone(), gate.clone(), metrics.clone());
    let stalled = || {
        if let Some(m) = &metrics {
            m.stalls.inc();
        }
    };
    let incarnation = new_incarnation();
    // A sender is the peer the model puts at its address, and no one else.
    let known: HashMap<SocketAddr, String> = peers.iter().map(|(n, a)| (plain(*a), n.clone())).collect();
    let keys = o.keys.clone();
    // Rejections are counted always and logged at most once per reason every 10 s.
    let mut last_logged: BTreeMap<Rejected, Instant> = BTreeMap::new();
    let mut reject = |why: Rejected, from: SocketAddr, now: Instant| {
        if let Some(m) = &metrics {
            m.rejected.get_or_create(&RejectLabels { reason: why.name().into() }).inc();
        }
        if last_logged.get(&why).is_none_or(|t| now.duration_since(*t) >= Duration::from_secs(10)) {
            last_logged.insert(why, now);
            tracing::warn!(%from, reason = why.name(), "heartbeat datagram rejected (further ones of this kind are counted in vip_heartbeats_rejected_total, logged every 10 s)");
        }
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut buf = [0u8; 1500];
    // A gap this long between our own turns means we were not running.
    let stall = (o.dead_after / 2).max(interval * 2);
    let mut last_turn = Instant::now();
    tracing::info!(%me, incarnation, peers = peers.len(), "heartbeat started");
    let mut leave = o.leave.clone();
    let seal = |hb: Heartbeat| -> Vec<u8> {
        let hb = hb.encode();
        match &keys {
            Some(k) => k.read().unwrap_or_else(|e| e.into_inner()).seal(&hb),
            None => hb,
        }
    };
    loop {
        let events = tokio::select! {
            _ = tx.closed() => break,
            Some(stay) = leaving(&mut leave) => {
                // Three times, a millisecond apart: one lost datagram must not cost
                // the peers a dead_after with our VIPs unanswered.
                for _ in 0..3 {
                    seq += 1;
                    let hb = seal(Heartbeat { v: Heartbeat::VERSION, node: me.clone(), incarnation, seq, sent_ms: unix_ms(), leaving_ms: stay.as_millis() as u64, arp: Vec::new(), settings: String::new() });
                    for (_, p) in &peers {
                        let _ = sock.send_to(&hb, p).await;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                tracing::info!(stay = ?stay, "sent leaving heartbeats: peers take this node's VIPs now and keep it a backend meanwhile");
                break;
            }
            _ = tick.tick() => {
                let now = Instant::now();
                if now.duration_since(last_turn) > stall {
                    tracing::warn!(gap = ?now.duration_since(last_turn), "heartbeat task was not running; not blaming peers for our gap");
                    stalled();
                    table.forgive(now);
                }
                last_turn = now;
                if gate_open(&gate) {
                    seq += 1;
                    let settings = match &o.settings {
                        Some(l) if seq % SETTINGS_EVERY == 1 => l.ours.borrow().clone(),
                        _ => String::new(),
                    };
                    let plain = Heartbeat { v: Heartbeat::VERSION, node: me.clone(), incarnation, seq, sent_ms: unix_ms(), leaving_ms: 0, arp: Vec::new(), settings };
                    let hb = seal(plain.clone());
                    for (name, p) in &peers {
                        // A peer whose VIPs this node checked gets its findings.
                        let arp = o.arp.as_ref().map(|a| a.outbox.take(name)).unwrap_or_default();
                        let own;
                        let datagram = if arp.is_empty() {
                            &hb
                        } else {
                            own = seal(Heartbeat { arp, ..plain.clone() });
                            &own
                        };
                        // A peer that is down may refuse (ICMP unreachable): that is what
                        // the protocol detects, not an error of ours.
                        if let Err(e) = sock.send_to(datagram, p).await {
                            tracing::debug!(peer = %p, error = %e, "heartbeat send failed");
                        }
                    }
                } else {
                    tracing::warn!("liveness loop stalled: not sending heartbeats");
                    stalled();
                }
                table.expire(Instant::now())
            }
            r = sock.recv_from(&mut buf) => {
                let now = Instant::now();
                if now.duration_since(last_turn) > stall {
                    table.forgive(now);
                }
                last_turn = now;
                let mut ev = Vec::new();
                match r {
                    Ok((n, from)) => match accept(&buf[..n], from, &known, keys.as_ref().map(|k| k.read().unwrap_or_else(|e| e.into_inner()).clone()).as_deref()) {
                        Err(why) => reject(why, from, now),
                        Ok(hb) => match if hb.leaving_ms > 0 {
                            table.observe_leaving(&hb.node, hb.incarnation, hb.seq, Duration::from_millis(hb.leaving_ms), now)
                        } else {
                            table.observe(&hb.node, hb.incarnation, hb.seq, now)
                        } {
                            Seen::Stale => reject(Rejected::Stale, from, now),
                            Seen::Fresh(e) => {
                                if let Some(m) = &metrics {
                                    m.gaps.heard(&hb.node, hb.incarnation, now);
                                }
                                if let (false, Some(l)) = (hb.settings.is_empty(), &o.settings) {
                                    l.peers.send_if_modified(|m| {
                                        let changed = m.get(&hb.node) != Some(&hb.settings);
                                        if changed {
                                            m.insert(hb.node.clone(), hb.settings.clone());
                                        }
                                        changed
                                    });
                                }
                                if let (false, Some(a)) = (hb.arp.is_empty(), &o.arp) {
                                    let _ = a.reports.send((hb.node.clone(), hb.arp));
                                }
                                ev.extend(e);
                            }
                        },
                    },
                    // Linux reports an earlier send's ICMP error on the next receive.
                    Err(e) => tracing::debug!(error = %e, "heartbeat receive error"),
                }
                ev.extend(table.expire(now));
                ev
            }
        };
        if events.is_empty() {
            continue;
        }
        for e in &events {
            tracing::info!(?e, "peer liveness changed");
        }
        let sets = table.peer_sets(&me);
        tx.send_if_modified(|cur| {
            let changed = *cur != sets;
            *cur = sets;
            changed
        });
    }
    tracing::info!(%me, "heartbeat stopped");
}

/// The stay asked for when the agent stops; pending until then (or forever).
async fn leaving(leave: &mut Option<watch::Receiver<Option<Duration>>>) -> Option<Duration> {
    let Some(rx) = leave else { return std::future::pending().await };
    loop {
        if let Some(stay) = *rx.borrow_and_update() {
            return Some(stay);
        }
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEAD: Duration = Duration::from_secs(3);

    fn up(n: &str, inc: u64) -> Seen {
        Seen::Fresh(Some(Event::Up { node: n.into(), incarnation: inc }))
    }

    const QUIET: Seen = Seen::Fresh(None);

    #[test]
    fn the_gap_is_a_rolling_maximum_with_the_current_silence() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let g = Gaps::default();
        g.track(["a", "b"], t0);
        for ms in [100, 200, 1700, 1800] {
            g.heard("a", 1, at(ms));
        }
        // b, silent since it was tracked, shows it until it is heard.
        assert_eq!(g.max_at(at(1700))["b"], 1.7);
        g.heard("b", 1, at(1800));
        // a: the 1.5 s gap; b: its first heartbeat ends a wait, not a gap.
        assert_eq!(g.max_at(at(1800)), BTreeMap::from([("a".to_owned(), 1.5), ("b".to_owned(), 0.0)]));
        // Once the window has passed the 1.5 s gap, a's steady 100 ms heartbeats show.
        let mut ms = 1800;
        while ms < 1800 + GAP_WINDOW.as_millis() as u64 + 200 {
            ms += 100;
            g.heard("a", 1, at(ms));
            g.heard("b", 1, at(ms));
        }
        let now = g.max_at(at(ms));
        assert!((now["a"] - 0.1).abs() < 1e-9 && (now["b"] - 0.1).abs() < 1e-9, "{now:?}");
        // A peer that goes silent shows it before its next heartbeat.
        assert!((g.max_at(at(ms + 2500))["a"] - 2.5).abs() < 1e-9);
    }

    #[test]
    fn a_restart_is_no_gap_and_untracked_peers_go() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let g = Gaps::default();
        g.track(["a", "b"], t0);
        g.heard("a", 1, at(100));
        // A new incarnation 5 s later: the agent restarted, its silence was not a gap.
        g.heard("a", 2, at(5100));
        g.heard("a", 2, at(5200));
        assert_eq!(g.max_at(at(5200))["a"], 0.1);
        g.track(["a"], at(5200));
        // A task being replaced cannot bring back a peer that left.
        g.heard("b", 1, at(5300));
        assert_eq!(g.max_at(at(5300)).into_keys().collect::<Vec<_>>(), ["a"]);
    }

    #[test]
    fn up_then_down_after_dead_after_without_heartbeat() {
        let t0 = Instant::now();
        let mut t = PeerTable::new(DEAD);
        assert_eq!(t.observe("a", 7, 1, t0), up("a", 7));
        assert_eq!(t.observe("a", 7, 2, t0 + Duration::from_secs(1)), QUIET);
        // 3 s after the last heartbeat (t0+1), not after the first.
        assert!(t.expire(t0 + Duration::from_millis(3999)).is_empty());
        assert_eq!(t.live(), BTreeSet::from(["a".to_string()]));
        assert_eq!(t.expire(t0 + Duration::from_secs(4)), vec![Event::Down { node: "a".into() }]);
        assert!(t.live().is_empty());
        // Down is reported once.
        assert!(t.expire(t0 + Duration::from_secs(10)).is_empty());
        // Comes back with the same incarnation: Up again.
        assert_eq!(t.observe("a", 7, 3, t0 + Duration::from_secs(11)), up("a", 7));
    }

    #[test]
    fn stale_and_duplicate_seqs_do_not_refresh() {
        let t0 = Instant::now();
        let mut t = PeerTable::new(DEAD);
        t.observe("a", 7, 5, t0);
        assert_eq!(t.observe("a", 7, 5, t0 + Duration::from_secs(2)), Seen::Stale);
        assert_eq!(t.observe("a", 7, 4, t0 + Duration::from_secs(2)), Seen::Stale);
        // Had either refreshed last_seen, "a" would still be alive at t0+3.
        assert_eq!(t.expire(t0 + DEAD).len(), 1);
        // A replayed old seq does not resurrect it either.
        assert_eq!(t.observe("a", 7, 5, t0 + Duration::from_secs(4)), Seen::Stale);
        assert!(t.live().is_empty());
    }

    #[test]
    fn a_leaving_peer_is_down_at_once_stays_a_backend_then_is_gone_or_back() {
        let t0 = Instant::now();
        let mut t = PeerTable::new(DEAD_AFTER);
        t.observe("a", 7, 1, t0);
        let stay = Duration::from_secs(30);
        assert_eq!(t.observe_leaving("a", 7, 2, stay, t0), Seen::Fresh(Some(Event::Leaving { node: "a".into() })));
        assert!(t.live().is_empty(), "its VIPs go to others at once");
        assert_eq!(t.leaving(), ["a".to_owned()].into());
        // A replay of the leaving heartbeat changes nothing.
        assert_eq!(t.observe_leaving("a", 7, 2, stay, t0 + Duration::from_secs(1)), Seen::Stale);
        assert!(t.expire(t0 + Duration::from_secs(29)).is_empty());
        assert_eq!(t.expire(t0 + stay), vec![Event::Gone { node: "a".into() }]);
        assert!(t.leaving().is_empty());
        // Its next agent, within the stay: Up, and no longer leaving.
        t.observe_leaving("a", 7, 3, stay, t0 + stay);
        assert_eq!(t.observe("a", 8, 1, t0 + stay + Duration::from_secs(2)), up("a", 8));
        assert!(t.leaving().is_empty());
        assert_eq!(t.live(), ["a".to_owned()].into());
        // A leaving heartbeat from a peer never heard takes nothing.
        assert_eq!(t.observe_leaving("b", 1, 1, stay, t0), Seen::Fresh(None));
        assert!(t.leaving().is_empty() && !t.live().contains("b"));
    }

    #[test]
    fn restart_before_deadline_is_up_without_down() {
        let t0 = Instant::now();
        let mut t = PeerTable::new(DEAD);
        t.observe("a", 1, 100, t0);
        // New incarnation restarts its seq at 1: accepted and reported as Up.
        assert_eq!(t.observe("a", 2, 1, t0 + Duration::from_secs(1)), up("a", 2));
        assert!(t.expire(t0 + Duration::from_secs(2)).is_empty());
        // A late (or replayed) datagram from the old incarnation is ignored (no flip back).
        assert_eq!(t.observe("a", 1, 101, t0 + Duration::from_secs(2)), Seen::Stale);
        assert_eq!(t.observe("a", 2, 2, t0 + Duration::from_secs(2)), QUIET);
        assert!(t.expire(t0 + Duration::from_millis(4999)).is_empty(), "seq 2 at t0+2 refreshed it");
    }

    /// The wire path a receiver applies: unknown senders, unsigned or badly
    /// signed datagrams and names other than the sender's are refused with their
    /// reason, before the table sees them.
    #[test]
    fn accept_checks_sender_key_and_name() {
        use crate::ha::auth::Keys;
        let keys = Keys::new(&[vec![b'k'; 32]]).unwrap();
        let a: SocketAddr = "198.18.0.11:7473".parse().unwrap();
        let b: SocketAddr = "198.18.0.12:7473".parse().unwrap();
        let known: HashMap<SocketAddr, String> = [(a, "n1".to_owned()), (b, "n2".to_owned())].into();
        let hb = |node: &str| {
            Heartbeat { v: 1, node: node.into(), incarnation: 5, seq: 1, sent_ms: 0, leaving_ms: 0, arp: vec![], settings: String::new() }.encode()
        };
        assert_eq!(accept(&keys.seal(&hb("n1")), a, &known, Some(&keys)).map(|h| h.node), Ok("n1".to_owned()));
        assert_eq!(accept(&keys.seal(&hb("n1")), "198.18.0.99:7473".parse().unwrap(), &known, Some(&keys)).err(), Some(Rejected::UnknownSender));
        assert_eq!(accept(&hb("n1"), a, &known, Some(&keys)).err(), Some(Rejected::Malformed));
        assert_eq!(accept(&keys.seal(&hb("n2")), a, &known, Some(&keys)).err(), Some(Rejected::WrongName));
        assert_eq!(accept(&keys.seal(&hb("n9")), a, &known, Some(&keys)).err(), Some(Rejected::WrongName));
        let other = Keys::new(&[vec![b'o'; 32]]).unwrap();
        assert_eq!(accept(&other.seal(&hb("n1")), a, &known, Some(&keys)).err(), Some(Rejected::UnknownKey));
        // A trusted segment: plain datagrams, the name still bound to the address.
        assert!(accept(&hb("n1"), a, &known, None).is_ok());
        assert_eq!(accept(&hb("n2"), a, &known, None).err(), Some(Rejected::WrongName));
    }

    #[test]
    fn peers_are_independent() {
        let t0 = Instant::now();
        let mut t = PeerTable::new(DEAD);
        t.observe("a", 1, 1, t0);
        t.observe("b", 1, 1, t0 + Duration::from_secs(2));
        assert_eq!(t.expire(t0 + DEAD), vec![Event::Down { node: "a".into() }]);
        assert_eq!(t.live(), BTreeSet::from(["b".to_string()]));
    }

    #[test]
    fn wire_format_round_trips_and_rejects_others() {
        let hb = Heartbeat {
            v: 1,
            node: "node-1".into(),
            incarnation: u64::MAX,
            seq: 3,
            sent_ms: 1_700_000_000_000,
            leaving_ms: 0,
            arp: vec![],
            settings: String::new(),
        };
        assert_eq!(Heartbeat::decode(&hb.encode()), Some(hb.clone()));
        // Only a leaving heartbeat carries leaving_ms: others are what agents of
        // before send and read.
        assert!(!String::from_utf8(hb.encode()).unwrap().contains("leaving"));
        let leaving = Heartbeat { leaving_ms: 30_000, ..hb.clone() };
        assert_eq!(Heartbeat::decode(&leaving.encode()), Some(leaving));
        assert_eq!(Heartbeat::decode(&Heartbeat { v: 2, ..hb }.encode()), None);
        assert_eq!(Heartbeat::decode(b"\x00garbage"), None);
        assert_ne!(new_incarnation(), new_incarnation());
    }

    /// Rolling upgrade: an agent of before (its Heartbeat, without `arp` and
    /// `settings`) takes a new agent's heartbeat that carries findings and
    /// settings (unknown fields are skipped),
    /// and a new agent takes the old one's. A full heartbeat, sealed, fits the
    /// receive buffer.
    #[test]
    fn findings_ride_along_and_agents_of_before_ignore_them() {
        use crate::ha::arpcheck::{Finding, PER_HEARTBEAT};
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Before {
            v: u8,
            node: String,
            incarnation: u64,
            seq: u64,
            sent_ms: u64,
            #[serde(default)]
            leaving_ms: u64,
        }
        let mac = "02:00:00:00:00:01".to_owned();
        let findings: Vec<Finding> =
            (0..PER_HEARTBEAT).map(|i| Finding { vip: std::net::Ipv4Addr::new(255, 255, 255, i as u8), macs: vec![mac.clone(); 4] }).collect();
        let node = "n".repeat(63);
        // The longest settings too (they ride with findings once every SETTINGS_EVERY).
        let mut w = crate::model::World { maglev_seed: u64::MAX, ..Default::default() };
        w.announce.hold_time = Duration::from_nanos(u64::MAX - 1);
        w.failover.dead_after = w.announce.hold_time;
        let settings = crate::model::cluster_settings(&w);
        let new = Heartbeat { v: 1, node: node.clone(), incarnation: u64::MAX, seq: u64::MAX, sent_ms: u64::MAX, leaving_ms: 0, arp: findings, settings };
        let old: Before = serde_json::from_slice(&new.encode()).expect("an agent of before decodes it");
        assert_eq!(old, Before { v: 1, node: node.clone(), incarnation: u64::MAX, seq: u64::MAX, sent_ms: u64::MAX, leaving_ms: 0 });
        let from_old = Heartbeat::decode(&serde_json::to_vec(&old).unwrap()).expect("a new agent decodes an old one's");
        assert!(from_old.arp.is_empty());
        assert_eq!(Heartbeat::decode(&new.encode()), Some(new.clone()));
        let keys = crate::ha::auth::Keys::new(&[vec![b'k'; 32]]).unwrap();
        let sealed = keys.seal(&new.encode());
        assert!(sealed.len() <= 1500, "{} bytes", sealed.len());
        assert_eq!(
            accept(&sealed, "198.18.0.1:7473".parse().unwrap(), &[("198.18.0.1:7473".parse().unwrap(), node)].into(), Some(&keys)).map(|h| h.arp.len()),
            Ok(PER_HEARTBEAT)
        );
    }

    /// Findings queued for a peer reach it in a heartbeat, with the sender's name;
    /// other peers get none.
    #[tokio::test]
    async fn findings_reach_their_holder() {
        use crate::ha::arpcheck::{Finding, Outbox};
        let addrs = free_addrs(3);
        let link = |outbox: Outbox| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            (ArpLink { outbox, reports: tx }, rx)
        };
        let (l0, mut r0) = link(Outbox::default());
        let (l2, mut r2) = link(Outbox::default());
        let out1 = Outbox::default();
        let (l1, _r1) = link(out1.clone());
        let _a = run(Options { arp: Some(l0), ..opts(&addrs, 0) }).await.unwrap();
        let _b = run(Options { arp: Some(l1), ..opts(&addrs, 1) }).await.unwrap();
        let _c = run(Options { arp: Some(l2), ..opts(&addrs, 2) }).await.unwrap();
        let f = Finding { vip: "198.18.1.10".parse().unwrap(), macs: vec!["02:00:00:00:00:bb".into()] };
        out1.push("n0", f.clone());
        let got = tokio::time::timeout(Duration::from_secs(2), r0.recv()).await.expect("a finding within 2 s");
        assert_eq!(got, Some(("n1".to_owned(), vec![f])));
        tokio::time::sleep(INTERVAL * 3).await;
        assert!(r2.try_recv().is_err(), "n2 holds nothing n1 checked");
    }

    /// Each agent's cluster-wide settings reach its peers (in the first
    /// heartbeat, then every SETTINGS_EVERY), a change within SETTINGS_EVERY
    /// intervals; a peer no longer configured is dropped when a task starts.
    #[tokio::test]
    async fn settings_reach_the_peers_and_follow_a_change() {
        let addrs = free_addrs(2);
        let link = |ours: &str| {
            let (tx, rx) = watch::channel(ours.to_owned());
            let (peers, heard) = watch::channel(BTreeMap::from([("gone".to_owned(), "deadAfter=1s".to_owned())]));
            (tx, SettingsLink { ours: rx, peers }, heard)
        };
        let (_ours0, l0, mut heard0) = link("deadAfter=300ms");
        let (ours1, l1, heard1) = link("deadAfter=1s");
        let _a = run(Options { settings: Some(l0), ..opts(&addrs, 0) }).await.unwrap();
        assert!(!heard0.borrow().contains_key("gone"), "not a configured peer");
        let _b = run(Options { settings: Some(l1), ..opts(&addrs, 1) }).await.unwrap();
        let until = |heard: &mut watch::Receiver<BTreeMap<String, String>>, want: &'static str| {
            let mut heard = heard.clone();
            async move {
                let wait = heard.wait_for(|m| m.get("n1").is_some_and(|s| s == want));
                tokio::time::timeout(INTERVAL * SETTINGS_EVERY as u32 * 3, wait).await.map(|_| ()).map_err(|_| heard.borrow().clone())
            }
        };
        until(&mut heard0, "deadAfter=1s").await.expect("n1's settings heard by n0");
        assert!(heard1.borrow().get("n0").is_none_or(|s| s == "deadAfter=300ms"));
        ours1.send_replace("deadAfter=300ms".into());
        until(&mut heard0, "deadAfter=300ms").await.expect("n1's changed settings heard by n0");
    }

    /// Free 127.0.0.1 ports: bound, then released for the tasks to bind.
    fn free_addrs(n: usize) -> Vec<SocketAddr> {
        free_addrs_on("127.0.0.1".parse().unwrap(), n).unwrap()
    }

    /// Free ports on `lo`; an error where it cannot be bound (no IPv6 here).
    fn free_addrs_on(lo: std::net::IpAddr, n: usize) -> io::Result<Vec<SocketAddr>> {
        let socks = (0..n).map(|_| std::net::UdpSocket::bind((lo, 0))).collect::<io::Result<Vec<_>>>()?;
        socks.iter().map(|s| s.local_addr()).collect()
    }

    const INTERVAL: Duration = Duration::from_millis(50);
    const DEAD_AFTER: Duration = Duration::from_millis(200);

    fn opts(addrs: &[SocketAddr], i: usize) -> Options {
        let peers = addrs.iter().enumerate().filter(|(j, _)| *j != i).map(|(j, a)| (format!("n{j}"), *a)).collect();
        Options {
            bind: addrs[i],
            peers,
            dead: BTreeSet::new(),
            me: format!("n{i}"),
            interval: INTERVAL,
            dead_after: DEAD_AFTER,
            gate: None,
            metrics: None,
            keys: None,
            leave: None,
            arp: None,
            settings: None,
        }
    }

    async fn start(addrs: &[SocketAddr], i: usize) -> watch::Receiver<PeerSets> {
        run(opts(addrs, i)).await.unwrap()
    }

    /// Waits (bounded by `limit`) until `rx`'s live set is exactly `want`; returns how long it took.
    async fn wait_for(rx: &mut watch::Receiver<PeerSets>, want: &[&str], limit: Duration) -> Duration {
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        let t0 = tokio::time::Instant::now();
        let reached = tokio::time::timeout(limit, rx.wait_for(|s| s.live == want)).await.is_ok();
        assert!(reached, "live set is {:?}, not {want:?}, after {limit:?}", rx.borrow().live);
        t0.elapsed()
    }

    /// A stopping agent's leaving heartbeats: its peer takes it out of the live
    /// set at once (well before dead_after) and keeps it as leaving.
    #[tokio::test]
    async fn a_stopping_agent_is_out_of_the_live_set_at_once_and_leaving() {
        let addrs = free_addrs(2);
        let mut a = start(&addrs, 0).await;
        let (leave_tx, leave_rx) = watch::channel(None);
        let _b = run(Options { leave: Some(leave_rx), ..opts(&addrs, 1) }).await.unwrap();
        wait_for(&mut a, &["n0", "n1"], Duration::from_secs(1)).await;
        tokio::time::sleep(INTERVAL * 2).await;
        leave_tx.send_replace(Some(Duration::from_secs(30)));
        let took = wait_for(&mut a, &["n0"], Duration::from_secs(1)).await;
        assert!(took < DEAD_AFTER, "taken out after {took:?}: that is silence, not the leaving heartbeat");
        assert_eq!(a.borrow().leaving, BTreeSet::from(["n1".to_owned()]));
    }

    #[test]
    fn presumed_peers_expire_unless_heard() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut t = PeerTable::new(ms(100));
        t.presume("a", t0);
        t.presume("b", t0);
        assert_eq!(t.live(), BTreeSet::from(["a".to_owned(), "b".to_owned()]));
        // Heard for the first time: no change (it was presumed alive).
        assert_eq!(t.observe("a", 7, 1, t0 + ms(50)), QUIET);
        assert_eq!(t.expire(t0 + ms(100)), vec![Event::Down { node: "b".into() }]);
        assert_eq!(t.live(), BTreeSet::from(["a".to_owned()]));
    }

    #[test]
    fn our_own_gap_is_forgiven() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let table = || {
            let mut t = PeerTable::new(ms(100));
            t.observe("a", 1, 1, t0);
            t.observe("b", 1, 1, t0);
            t
        };
        // Without forgiveness, waking up after 500 ms blames the peers.
        assert_eq!(table().expire(t0 + ms(500)).len(), 2);
        // Forgiven: they get a fresh dead_after from the wake-up, then die if still silent.
        let mut t = table();
        t.forgive(t0 + ms(500));
        assert!(t.expire(t0 + ms(550)).is_empty());
        assert_eq!(t.observe("a", 1, 2, t0 + ms(560)), QUIET, "still alive: no event");
        assert_eq!(t.expire(t0 + ms(600)), vec![Event::Down { node: "b".into() }]);
    }

    /// A task that replaces one which saw a peer go down does not presume it
    /// alive, and counts it live once heard.
    #[tokio::test]
    async fn peers_known_dead_are_not_presumed_alive() {
        let addrs = free_addrs(2);
        let mut o = opts(&addrs, 0);
        o.dead = BTreeSet::from(["n1".to_owned()]);
        let mut a = run(o).await.unwrap();
        assert_eq!(a.borrow().live, BTreeSet::from(["n0".to_owned()]));
        let _b = start(&addrs, 1).await;
        wait_for(&mut a, &["n0", "n1"], Duration::from_secs(1)).await;
    }

    #[tokio::test]
    async fn a_stalled_main_loop_stops_the_heartbeats() {
        let addrs = free_addrs(2);
        let mut a = start(&addrs, 0).await;
        let last_turn = Arc::new(AtomicU64::new(crate::clock::monotonic_ns()));
        let mut o = opts(&addrs, 1);
        o.gate = Some((last_turn.clone(), Duration::from_millis(100)));
        let _b = run(o).await.unwrap();
        // Keep the gate open for a while: n0 keeps n1 past the presumption.
        let t0 = tokio::time::Instant::now();
        while t0.elapsed() < DEAD_AFTER * 2 {
            last_turn.store(crate::clock::monotonic_ns(), Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(a.borrow().live, BTreeSet::from(["n0".to_owned(), "n1".to_owned()]));
        // The main loop stops turning: n1's task keeps running but goes silent.
        wait_for(&mut a, &["n0"], Duration::from_secs(2)).await;
    }

    /// The IPv4 tests' exchange between IPv6 nodes, on [::1]: signed heartbeats
    /// taken from the peers' addresses, a stopped one dropped after dead_after, a
    /// sender at another port of the same address refused.
    #[tokio::test]
    async fn ipv6_agents_see_each_other_and_drop_a_stopped_one() {
        let addrs = match free_addrs_on("::1".parse().unwrap(), 3) {
            Ok(a) => a,
            Err(e) => return eprintln!("skipping: no [::1] here ({e})"),
        };
        let keys: super::super::auth::SharedKeys = Arc::new(std::sync::RwLock::new(Arc::new(super::super::auth::Keys::new(&[vec![7; 32]]).unwrap())));
        let mut a = run(Options { keys: Some(keys.clone()), ..opts(&addrs[..2], 0) }).await.unwrap();
        let metrics = Metrics::default();
        let b = run(Options { keys: Some(keys.clone()), metrics: Some(metrics.clone()), ..opts(&addrs[..2], 1) }).await.unwrap();
        wait_for(&mut a, &["n0", "n1"], Duration::from_secs(2)).await;
        let mut b = b;
        wait_for(&mut b, &["n0", "n1"], Duration::from_secs(2)).await;
        // n0's heartbeat from [::1] at a port no peer has: an unknown sender.
        let stranger = std::net::UdpSocket::bind(addrs[2]).unwrap();
        let hb = Heartbeat {
            v: Heartbeat::VERSION,
            node: "n0".into(),
            incarnation: u64::MAX,
            seq: 1,
            sent_ms: 0,
            leaving_ms: 0,
            arp: Vec::new(),
            settings: String::new(),
        };
        stranger.send_to(&keys.read().unwrap().seal(&hb.encode()), addrs[1]).unwrap();
        let unknown = || metrics.rejected.get_or_create(&RejectLabels { reason: Rejected::UnknownSender.name().into() }).get();
        let t0 = Instant::now();
        while unknown() == 0 && t0.elapsed() < Duration::from_secs(2) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(unknown(), 1);
        drop(a);
        let took = wait_for(&mut b, &["n1"], Duration::from_secs(2)).await;
        assert!(took >= DEAD_AFTER - INTERVAL, "dropped after {took:?}");
    }

    #[tokio::test]
    async fn three_agents_see_each_other_drop_and_readmit_a_stopped_one() {
        let addrs = free_addrs(3);
        let mut a = start(&addrs, 0).await;
        let mut b = start(&addrs, 1).await;
        let c = start(&addrs, 2).await;
        let all = ["n0", "n1", "n2"];
        wait_for(&mut a, &all, Duration::from_secs(2)).await;
        wait_for(&mut b, &all, Duration::from_secs(2)).await;
        let mut c = c;
        wait_for(&mut c, &all, Duration::from_secs(2)).await;

        drop(c); // stops n2's task
        let stopped = tokio::time::Instant::now();
        wait_for(&mut a, &["n0", "n1"], Duration::from_secs(2)).await;
        wait_for(&mut b, &["n0", "n1"], Duration::from_secs(2)).await;
        // Its last heartbeat went out at most `INTERVAL` before the stop; allow one
        // tick for the expiry check and scheduling slack.
        let took = stopped.elapsed();
        assert!(took <= DEAD_AFTER + INTERVAL + Duration::from_millis(50), "dropped after {took:?}");
        assert!(took >= DEAD_AFTER - INTERVAL, "dropped after {took:?}, before it could have been silent for dead_after");

        // Restart n2 on the same address (the old socket closes as its task ends).
        let mut c = loop {
            match run(opts(&addrs, 2)).await {
                Ok(rx) => break rx,
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && stopped.elapsed() < Duration::from_secs(2) => {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                Err(e) => panic!("rebinding n2: {e}"),
            }
        };
        wait_for(&mut a, &all, Duration::from_secs(1)).await;
        wait_for(&mut c, &all, Duration::from_secs(1)).await;
    }
}
