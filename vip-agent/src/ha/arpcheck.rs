//! The ARP self-check: a peer asks, now and then, who answers ARP for a VIP
//! another node holds, and tells the holder; a MAC other than the holder's is a
//! second responder on the segment (another speaker, a host with the VIP
//! configured, a switch or proxy answering from a stale cache), which the holder
//! cannot see itself: answers go to whoever asked.
//!
//! Who asks: every agent knows which node holds each VIP (ownership is computed
//! alike everywhere), so no request travels: for each IPv4 VIP of an ARP pool, the
//! live eligible node other than the holder with the highest rendezvous score
//! ([`checker`]; the node most likely to take the VIP over, so on its network)
//! checks it on its own schedule ([`Schedule`]: each VIP every `interval`, spread
//! over it, at most [`RATE`] requests a second per node, the interval stretched
//! beyond that). The checker writes an `arp_watch` entry, sends a broadcast ARP
//! request from its own MAC and address on the VIP's network through the agent's
//! frame sender, reads the MACs the data path recorded [`WAIT`] later, and sends
//! them to the holder in its next heartbeat ([`Finding`]: an optional field, which
//! agents of before ignore). The holder compares them with its own MAC
//! ([`ArpCheck::update`]): the VipStatus condition `ArpConflict`, the metric
//! `vip_arp_foreign_answers`, a log line.
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    net::Ipv4Addr,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use serde::{Deserialize, Serialize};

/// How often each VIP is checked by default (`run --arp-check-interval`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(45);
/// At most this many ARP requests a second per node: with more VIPs to check
/// than `RATE × interval`, each is checked less often.
pub const RATE: u32 = 5;
/// How long answers are waited for after a request.
pub const WAIT: Duration = Duration::from_secs(1);
/// Findings per heartbeat datagram (each at most ~110 bytes of JSON).
pub const PER_HEARTBEAT: usize = 8;
/// Findings queued for the holders at most; older ones go first.
const OUTBOX_MAX: usize = 256;
/// Findings for a VIP the holder took less than this long ago are ignored: the
/// previous holder may still have answered the request (until its hold time ran
/// out, or while a node coming back takes its VIPs back), which is a takeover, not
/// a second responder.
pub const SETTLE: Duration = Duration::from_secs(5);
/// A holder forgets a check that was not renewed for this long (its checker left,
/// or stopped checking): the condition and the metric go rather than go stale.
pub const FORGET_AFTER: Duration = Duration::from_secs(20 * 60);

/// What a checker saw for one VIP: the distinct MACs that answered its ARP
/// request (at most four; none: no answer). On the heartbeat wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    pub vip: Ipv4Addr,
    /// `aa:bb:cc:dd:ee:ff`.
    pub macs: Vec<String>,
}

pub fn mac_text(m: &[u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut m = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut m {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(m)
}

/// Findings waiting for the next heartbeat to their holder, by holder name;
/// shared by the liveness thread (which fills it) and the heartbeat task.
#[derive(Clone, Debug, Default)]
pub struct Outbox(Arc<Mutex<BTreeMap<String, VecDeque<Finding>>>>);

impl Outbox {
    pub fn push(&self, holder: &str, f: Finding) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let q = all.entry(holder.to_owned()).or_default();
        q.retain(|x| x.vip != f.vip);
        q.push_back(f);
        while q.len() > OUTBOX_MAX {
            q.pop_front();
        }
    }

    /// Up to [`PER_HEARTBEAT`] findings for `holder`, taken off the queue.
    pub fn take(&self, holder: &str) -> Vec<Finding> {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(q) = all.get_mut(holder) else { return Vec::new() };
        let n = q.len().min(PER_HEARTBEAT);
        let out = q.drain(..n).collect();
        if q.is_empty() {
            all.remove(holder);
        }
        out
    }
}

/// The node that checks `vip`, held by `holder`, among `candidates` (the live
/// nodes that may hold it): the one other than the holder with the highest
/// rendezvous score, ties by name; None when the holder is alone.
pub fn checker<'a>(vip: Ipv4Addr, holder: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates.into_iter().filter(|n| *n != holder).max_by_key(|n| (super::ownership::score(vip.into(), n), *n))
}

/// When each VIP this node checks is due.
#[derive(Debug)]
pub struct Schedule {
    interval: Duration,
    due: BTreeMap<Ipv4Addr, Instant>,
}

impl Schedule {
    pub fn new(interval: Duration) -> Self {
        Self { interval, due: BTreeMap::new() }
    }

    /// How often each of `n` VIPs is checked: the interval, or longer when
    /// checking them all that often would pass [`RATE`].
    pub fn period(&self, n: usize) -> Duration {
        self.interval.max(Duration::from_millis(n as u64 * 1000 / u64::from(RATE)))
    }

    /// The VIPs to check at `now`, at most `budget`, the longest due first, among
    /// `mine` (those this node checks now). A VIP new to the schedule is first due
    /// at a point of the period its address picks, so that checks spread over it.
    pub fn next(&mut self, mine: &BTreeSet<Ipv4Addr>, now: Instant, budget: usize) -> Vec<Ipv4Addr> {
        let period = self.period(mine.len());
        self.due.retain(|v, _| mine.contains(v));
        for v in mine {
            self.due.entry(*v).or_insert_with(|| now + spread(*v, period));
        }
        let mut ready: Vec<(Instant, Ipv4Addr)> = self.due.iter().filter(|(_, t)| **t <= now).map(|(v, t)| (*t, *v)).collect();
        ready.sort();
        ready.truncate(budget);
        for (_, v) in &ready {
            self.due.insert(*v, now + period);
        }
        ready.into_iter().map(|(_, v)| v).collect()
    }
}

/// A point of `period` picked by `vip` (a multiplicative hash: neighbouring
/// addresses land far apart).
fn spread(vip: Ipv4Addr, period: Duration) -> Duration {
    let h = u64::from(u32::from(vip).wrapping_mul(0x9e37_79b1));
    Duration::from_millis((h * period.as_millis() as u64) >> 32)
}

/// What the holder of a VIP knows from its last check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArpCheck {
    /// The node that checked, and when its finding arrived.
    pub by: String,
    pub at: SystemTime,
    /// Whether the holder's own MAC answered.
    pub holder_answered: bool,
    /// The other MACs that answered.
    pub foreign: Vec<[u8; 6]>,
    /// Since when `foreign` is empty, or not (the condition's transition time).
    pub since: SystemTime,
}

impl ArpCheck {
    /// The check after `finding` from `by`, for a VIP answered here with `mine`;
    /// `prev`: the last one. A finding with a malformed MAC is refused.
    pub fn update(prev: Option<&ArpCheck>, finding: &Finding, mine: [u8; 6], by: &str, now: SystemTime) -> Option<ArpCheck> {
        let macs: Vec<[u8; 6]> = finding.macs.iter().map(|m| parse_mac(m)).collect::<Option<_>>()?;
        let foreign: Vec<[u8; 6]> = macs.iter().filter(|m| **m != mine).copied().collect();
        let since = match prev {
            Some(p) if p.foreign.is_empty() == foreign.is_empty() => p.since,
            _ => now,
        };
        Some(ArpCheck { by: by.to_owned(), at: now, holder_answered: macs.contains(&mine), foreign, since })
    }

    /// The foreign MACs as text, comma-separated.
    pub fn foreign_text(&self) -> String {
        self.foreign.iter().map(mac_text).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(i: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 1, i)
    }

    #[test]
    fn macs_as_text_round_trip_and_bad_ones_are_refused() {
        let m = [0x02, 0, 0x5e, 0xab, 0xcd, 0xef];
        assert_eq!(mac_text(&m), "02:00:5e:ab:cd:ef");
        assert_eq!(parse_mac("02:00:5e:ab:cd:ef"), Some(m));
        for bad in ["", "02:00:5e:ab:cd", "02:00:5e:ab:cd:ef:01", "02:00:5e:ab:cd:zz", "0200:5e:ab:cd:ef"] {
            assert_eq!(parse_mac(bad), None, "{bad:?}");
        }
    }

    /// One checker per VIP, never its holder, the same on every node whatever the
    /// order; none when the holder is alone.
    #[test]
    fn one_checker_per_vip_never_the_holder() {
        let nodes = ["node-1", "node-2", "node-3"];
        let mut by = BTreeMap::new();
        for i in 0..60 {
            let holder = nodes[i % 3];
            let c = checker(v(i as u8), holder, nodes).unwrap();
            assert_ne!(c, holder);
            assert_eq!(checker(v(i as u8), holder, nodes.iter().rev().copied()), Some(c), "order does not matter");
            *by.entry(c).or_insert(0) += 1;
        }
        assert_eq!(by.len(), 3, "checks spread over the nodes: {by:?}");
        assert_eq!(checker(v(1), "node-1", ["node-1"]), None);
    }

    /// Each VIP once per interval, spread over it; at most `budget` at a time;
    /// with more VIPs than the rate allows, the period stretches.
    #[test]
    fn checks_are_spread_rate_limited_and_each_vip_comes_back() {
        let t0 = Instant::now();
        let every = Duration::from_secs(45);
        let mut s = Schedule::new(every);
        let mine: BTreeSet<Ipv4Addr> = (1..=100).map(v).collect();
        let mut when: BTreeMap<Ipv4Addr, Vec<Duration>> = BTreeMap::new();
        let tick = Duration::from_millis(200);
        let mut t = Duration::ZERO;
        while t < Duration::from_secs(100) {
            let got = s.next(&mine, t0 + t, 1);
            assert!(got.len() <= 1);
            for g in got {
                when.entry(g).or_default().push(t);
            }
            t += tick;
        }
        assert_eq!(when.len(), 100, "every VIP checked within 100 s");
        // Spread: the first checks fall over the whole first period.
        let firsts: Vec<Duration> = when.values().map(|w| w[0]).collect();
        assert!(firsts.iter().any(|f| *f < Duration::from_secs(10)) && firsts.iter().any(|f| *f > Duration::from_secs(35)), "{firsts:?}");
        for (vip, w) in &when {
            for pair in w.windows(2) {
                let gap = pair[1] - pair[0];
                assert!(gap >= every && gap < every + Duration::from_secs(5), "{vip} checked {gap:?} apart");
            }
        }
        // 1,000 VIPs: 5 a second would take 200 s, so each comes back every 200 s.
        assert_eq!(s.period(1000), Duration::from_secs(200));
        assert_eq!(s.period(10), every);
        // A VIP no longer ours is forgotten.
        let fewer: BTreeSet<Ipv4Addr> = [v(1)].into();
        s.next(&fewer, t0 + t, 1);
        assert_eq!(s.due.len(), 1);
    }

    #[test]
    fn outbox_keeps_the_latest_finding_per_vip_and_sends_a_few_at_a_time() {
        let o = Outbox::default();
        for i in 0..20 {
            o.push("node-2", Finding { vip: v(i % 10), macs: vec![format!("02:00:00:00:00:{i:02x}")] });
        }
        let first = o.take("node-2");
        assert_eq!(first.len(), PER_HEARTBEAT);
        assert_eq!(first[0].macs, ["02:00:00:00:00:0a"], "the later finding of a VIP replaces the earlier");
        assert_eq!(o.take("node-2").len(), 10 - PER_HEARTBEAT);
        assert!(o.take("node-2").is_empty() && o.take("node-3").is_empty());
    }

    /// The holder's view: foreign MACs, its own answer, and the time the
    /// conflict started or ended (kept while it lasts).
    #[test]
    fn the_holder_tells_foreign_macs_and_keeps_the_transition_time() {
        let mine = [2, 0, 0, 0, 0, 1];
        let t = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let f = |macs: &[&str]| Finding { vip: v(10), macs: macs.iter().map(|m| m.to_string()).collect() };
        let clean = ArpCheck::update(None, &f(&["02:00:00:00:00:01"]), mine, "node-2", t(10)).unwrap();
        assert!(clean.holder_answered && clean.foreign.is_empty() && clean.since == t(10));
        let bad = ArpCheck::update(Some(&clean), &f(&["02:00:00:00:00:01", "02:00:00:00:00:bb"]), mine, "node-2", t(55)).unwrap();
        assert_eq!((bad.foreign.clone(), bad.since, bad.foreign_text()), (vec![[2, 0, 0, 0, 0, 0xbb]], t(55), "02:00:00:00:00:bb".to_owned()));
        // Only the rogue answered (the holder's reply lost, or a switch answering).
        let still = ArpCheck::update(Some(&bad), &f(&["02:00:00:00:00:bb"]), mine, "node-3", t(100)).unwrap();
        assert_eq!((still.since, still.holder_answered, still.by.as_str()), (t(55), false, "node-3"));
        let over = ArpCheck::update(Some(&still), &f(&["02:00:00:00:00:01"]), mine, "node-2", t(145)).unwrap();
        assert_eq!((over.foreign.len(), over.since), (0, t(145)));
        assert_eq!(ArpCheck::update(None, &f(&["nonsense"]), mine, "node-2", t(1)), None);
    }
}
