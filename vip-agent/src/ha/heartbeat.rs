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
mod tests;
