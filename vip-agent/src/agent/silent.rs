//! Silent peers: is a node whose agent went quiet still serving?
//!
//! An agent that crashes, is OOM-killed or SIGKILLed, or waits in a crash-loop
//! back-off sends no heartbeats, yet its node's data path (pinned program and
//! maps) and stack (kube-proxy, the pods) serve on: dropping the node from the
//! rings would break every connection it carries. A node that is really gone
//! (power, link, kernel) must still leave them as fast as before. So when a peer
//! has been silent for half of `deadAfter` (`heartbeat::PeerSets::silent`), this
//! node asks the peer's health targets (the probes its services already use:
//! kube-proxy's health server in a cluster) at once, and again every
//! [`every`] while the peer stays silent. A peer whose target answered after it
//! went silent is **serving**: once declared dead its VIPs still move (the
//! fencing deadline stands), but it stays a backend, its services' own health
//! checks deciding as for any node. A peer that never answers is never
//! serving, so it leaves the rings at `deadAfter` as before; one that stops
//! answering leaves after [`FALL`] rounds. A peer none of whose services has a
//! health check cannot be asked, and leaves at `deadAfter`.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use tokio::{sync::mpsc, task::JoinHandle};

use crate::{
    health,
    model::{HealthCheck, World},
};

/// Failed rounds in a row that end a peer's serving: one lost SYN must not
/// break the connections of a node that serves.
pub const FALL: u32 = 2;

/// How often a silent peer's targets are asked: three times per `deadAfter`.
pub fn every(dead_after: Duration) -> Duration {
    dead_after / 3
}

/// How long one round may take: an answer arrives within a LAN's round trip, so
/// a round started when the peer goes late ends well before it would be declared
/// dead (at twice the time it has been silent then).
pub fn budget(dead_after: Duration) -> Duration {
    dead_after / 4
}

/// A silent peer's round: whether any of its targets answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub node: String,
    pub serving: bool,
}

/// One task per silent peer, asking its targets until it is heard again.
pub struct SilentChecks {
    tasks: BTreeMap<String, JoinHandle<()>>,
    tx: mpsc::UnboundedSender<Answer>,
}

impl SilentChecks {
    pub fn new(tx: mpsc::UnboundedSender<Answer>) -> Self {
        Self { tasks: BTreeMap::new(), tx }
    }

    /// Starts a task for each peer of `silent` with targets and none yet, and
    /// stops those of peers heard again.
    pub fn sync(&mut self, silent: &BTreeSet<String>, world: &World) {
        self.tasks.retain(|node, task| {
            let keep = silent.contains(node);
            if !keep {
                task.abort();
            }
            keep
        });
        for node in silent {
            if self.tasks.contains_key(node) {
                continue;
            }
            let Some((addr, checks)) = targets_of(world, node) else { continue };
            let (tx, name) = (self.tx.clone(), node.clone());
            let (every, budget) = (every(world.failover.dead_after), budget(world.failover.dead_after));
            tracing::info!(node = %name, targets = checks.len(), "peer silent: asking its health targets whether its node still serves");
            self.tasks.insert(node.clone(), tokio::spawn(ask(name, addr, checks, every, budget, tx)));
        }
    }
}

impl Drop for SilentChecks {
    fn drop(&mut self) {
        for task in self.tasks.values() {
            task.abort();
        }
    }
}

/// The node's address and the distinct health checks of the services it backs,
/// each with the round's budget as its timeout; None when it has none.
fn targets_of(world: &World, node: &str) -> Option<(IpAddr, Vec<HealthCheck>)> {
    let n = world.node(node)?;
    let mut checks: Vec<HealthCheck> = Vec::new();
    for svc in &world.services {
        let Some(check) = &svc.health else { continue };
        if !checks.iter().any(|c| c.probe == check.probe) && world.backend_candidates(svc).iter().any(|c| c.name == node) {
            checks.push(check.clone());
        }
    }
    (!checks.is_empty()).then_some((n.addr, checks))
}

/// Asks every round until aborted; reports the first round and every change.
async fn ask(node: String, addr: IpAddr, checks: Vec<HealthCheck>, every: Duration, budget: Duration, tx: mpsc::UnboundedSender<Answer>) {
    let checks: Vec<HealthCheck> = checks.into_iter().map(|c| HealthCheck { timeout: c.timeout.min(budget), ..c }).collect();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut serving, mut failed) = (None, 0u32);
    loop {
        tick.tick().await;
        let answered = futures::future::join_all(checks.iter().map(|c| health::probe(addr, c))).await.iter().any(Result::is_ok);
        let now = next_serving(serving, &mut failed, answered);
        if now != serving {
            serving = now;
            if tx.send(Answer { node: node.clone(), serving: now == Some(true) }).is_err() {
                return;
            }
        }
    }
}

/// Serving after a round in which some target `answered`: from the first answer
/// until [`FALL`] rounds in a row without one (`failed` counts them); never
/// serving before a first answer.
fn next_serving(serving: Option<bool>, failed: &mut u32, answered: bool) -> Option<bool> {
    if answered {
        *failed = 0;
        return Some(true);
    }
    *failed += 1;
    match serving {
        Some(true) if *failed < FALL => Some(true),
        _ => Some(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_starts_at_an_answer_and_ends_after_fall_rounds_without_one() {
        let mut failed = 0;
        // Never answered: not serving from the first round on.
        assert_eq!(next_serving(None, &mut failed, false), Some(false));
        assert_eq!(next_serving(Some(false), &mut failed, false), Some(false));
        // An answer: serving; one lost round keeps it, FALL in a row end it.
        let s = next_serving(Some(false), &mut failed, true);
        assert_eq!(s, Some(true));
        let s = next_serving(s, &mut failed, false);
        assert_eq!(s, Some(true));
        let s = next_serving(s, &mut failed, true);
        assert_eq!((s, failed), (Some(true), 0));
        let mut s = s;
        for _ in 0..FALL {
            s = next_serving(s, &mut failed, false);
        }
        assert_eq!(s, Some(false));
    }

    #[test]
    fn a_round_ends_before_a_late_peer_is_declared_dead() {
        let dead_after = crate::model::Failover::default().dead_after;
        // Late at half of deadAfter; the round's answer (or its timeout) before deadAfter.
        assert!(dead_after / 2 + budget(dead_after) < dead_after);
        assert!(every(dead_after) + budget(dead_after) < dead_after);
    }
}
