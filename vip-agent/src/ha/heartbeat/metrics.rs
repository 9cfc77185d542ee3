//! What the heartbeat task measures: rejected datagrams, stalls, and each peer's
//! longest gap between heartbeats.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant},
};

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
