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
//!
//! Here the task; `wire` the datagram and its checks, `table` the [`PeerTable`],
//! `metrics` what the task measures.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io,
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::{net::UdpSocket, sync::watch};

mod metrics;
mod table;
mod wire;

pub use metrics::{Gaps, Metrics, PeerLabels, RejectLabels, GAP_WINDOW};
pub use table::{Event, PeerSets, PeerTable, Seen};
use wire::{accept, plain, unix_ms};
pub use wire::{new_incarnation, Heartbeat, Rejected, SETTINGS_EVERY};

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
    /// Peers the replaced task knew silent (`PeerSets::silent`): silent in this
    /// one from the start, so that a node kept a backend while its agent is away
    /// (`agent::silent`) is not dropped from the rings by a change of settings.
    pub silent: BTreeSet<String>,
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
    for (name, _) in o.peers.iter().filter(|(n, _)| o.silent.contains(n)) {
        table.carry_silent(name, now);
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
                let now = Instant::now();
                let mut ev = table.expire(now);
                ev.extend(table.mark_late(now));
                ev
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
                ev.extend(table.mark_late(now));
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
