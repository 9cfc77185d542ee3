//! The kubelet and the DaemonSet controller over a lab's agents, so that the
//! suite restarts agents as a cluster does:
//!
//! - a container that exits is restarted after the kubelet's delay: the first time
//!   after its next pod sync ([`RESTART_DELAY`], as measured on a real node), then
//!   in CrashLoopBackOff, 10 s doubling up to 5 min, forgotten once the container
//!   has run 10 minutes (the kubelet's `backOff`);
//! - a container is Ready once its readiness probe answers 200, probed as
//!   deploy/20-daemonset.yaml says (path, port, `initialDelaySeconds`,
//!   `periodSeconds`) from the node itself (host network);
//! - a rolling update deletes up to the DaemonSet's `maxUnavailable` old pods at a
//!   time, in node order (SIGTERM, SIGKILL after `terminationGracePeriodSeconds`),
//!   starts a node's new pod once its old one is gone (maxSurge 0) and goes on
//!   when the new ones are Ready.
use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};

use crate::{
    daemonset::{kubelet_probe, AgentPod},
    halab::HaLab,
};

/// From a container's exit (or a pod's creation) to its container's start, when
/// no back-off applies: the kubelet's pod sync (seen at about 0.7 s on a node).
pub const RESTART_DELAY: Duration = Duration::from_millis(700);
/// CrashLoopBackOff's first wait, its doubling's cap, and how long a container
/// must run for its back-off to be forgotten.
pub const BACKOFF_INITIAL: Duration = Duration::from_secs(10);
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);
pub const BACKOFF_RESET: Duration = Duration::from_secs(600);
/// How long a started container may take to turn Ready before the stand-in gives up.
const READY_LIMIT: Duration = Duration::from_secs(60);

/// One node's agent pod.
#[derive(Default)]
struct Pod {
    /// When its running container started.
    started: Option<Instant>,
    /// When its last container exited.
    exited: Option<Instant>,
    /// The wait before its next restart after this one, once it crashed.
    backoff: Option<Duration>,
    restarts: u32,
}

/// One restart of a container, as the kubelet did it.
#[derive(Clone, Copy, Debug)]
pub struct Restart {
    /// Exit → start.
    pub delay: Duration,
    /// Start → Ready.
    pub ready_after: Duration,
}

pub struct Kubelet {
    pub pod: AgentPod,
    pods: Vec<Pod>,
}

impl Kubelet {
    /// Takes over the lab's agents as running pods (its spec must bind their HTTP
    /// port as the DaemonSet does: `metrics_on_segment`).
    pub fn new(lab: &HaLab) -> Result<Self> {
        if !lab.spec.metrics_on_segment {
            bail!("the kubelet probes the agents on their node's address: start the lab with metrics_on_segment");
        }
        let pod = AgentPod::load()?;
        let pods = lab.nodes.iter().map(|n| Pod { started: n.agent.as_ref().map(|_| Instant::now()), ..Pod::default() }).collect();
        Ok(Self { pod, pods })
    }

    /// Restarts of node `i`'s container so far.
    pub fn restarts(&self, i: usize) -> u32 {
        self.pods[i].restarts
    }

    /// Node `i`'s container is killed (SIGKILL: an OOM kill, a crash) and reaped;
    /// returns when the kubelet will start it again ([`Self::restart_at`]).
    pub fn crash(&mut self, lab: &mut HaLab, i: usize) -> Instant {
        lab.kill_agent(i);
        let exited = Instant::now();
        let p = &mut self.pods[i];
        if p.started.is_some_and(|s| s.elapsed() >= BACKOFF_RESET) {
            p.backoff = None;
        }
        let delay = p.backoff.unwrap_or(RESTART_DELAY);
        p.backoff = Some(p.backoff.map_or(BACKOFF_INITIAL, |b| (b * 2).min(BACKOFF_MAX)));
        (p.started, p.exited) = (None, Some(exited));
        exited + delay
    }

    /// Starts node `i`'s container at `at` (sleeping until then) and waits until it
    /// is Ready.
    pub fn restart_at(&mut self, lab: &mut HaLab, i: usize, at: Instant) -> Result<Restart> {
        let start = self.start_at(lab, i, at)?;
        let exited = self.pods[i].exited.unwrap_or(start);
        Ok(Restart { delay: start.saturating_duration_since(exited), ready_after: self.wait_ready(lab, i, start, READY_LIMIT)? })
    }

    /// Starts node `i`'s container at `at` (sleeping until then), not waiting for
    /// it to turn Ready ([`Self::wait_ready`]); when it started.
    pub fn start_at(&mut self, lab: &mut HaLab, i: usize, at: Instant) -> Result<Instant> {
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        let start = self.start(lab, i)?;
        self.pods[i].restarts += 1;
        Ok(start)
    }

    fn start(&mut self, lab: &mut HaLab, i: usize) -> Result<Instant> {
        lab.start_agent(i)?;
        let now = Instant::now();
        self.pods[i].started = Some(now);
        Ok(now)
    }

    /// Probes node `i`'s container as the kubelet does (first at
    /// `initialDelaySeconds` after `started`, then every `periodSeconds`) until
    /// Ready, for at most `limit` from now; how long after its start.
    pub fn wait_ready(&self, lab: &HaLab, i: usize, started: Instant, limit: Duration) -> Result<Duration> {
        let n = &lab.nodes[i];
        let probe = &self.pod.readiness;
        let give_up = Instant::now() + limit;
        let mut next = started + probe.initial_delay;
        loop {
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            let answer = kubelet_probe(&n.ns, n.addr, probe);
            if matches!(answer, Ok((200, _))) {
                return Ok(started.elapsed());
            }
            if Instant::now() > give_up {
                bail!("{}'s agent not Ready {:?} after its start (last probe: {answer:?})\n{}", n.name, started.elapsed(), lab.agent_logs());
            }
            next += probe.period;
        }
    }

    /// Deletes node `i`'s pod as the API server and the kubelet do: SIGTERM, then
    /// SIGKILL once `terminationGracePeriodSeconds` have passed; how long it took
    /// to exit.
    fn delete(&mut self, lab: &mut HaLab, i: usize) -> Result<Duration> {
        if lab.nodes[i].agent.is_none() {
            bail!("{} has no agent to delete", lab.nodes[i].name);
        }
        let took = lab.stop_agent_within(i, libc::SIGTERM, self.pod.grace);
        self.pods[i] = Pod::default();
        Ok(took)
    }

    /// Node `i`'s pod deleted (`kubectl delete pod`): the DaemonSet controller
    /// makes a new one, whose container starts after [`RESTART_DELAY`] with no
    /// back-off; waits until it is Ready.
    pub fn delete_pod(&mut self, lab: &mut HaLab, i: usize) -> Result<Restart> {
        self.delete(lab, i)?;
        let exited = Instant::now();
        std::thread::sleep(RESTART_DELAY);
        let start = self.start(lab, i)?;
        self.pods[i].restarts += 1;
        Ok(Restart { delay: start.duration_since(exited), ready_after: self.wait_ready(lab, i, start, READY_LIMIT)? })
    }

    /// One rolling update of every node's pod (`maxUnavailable` at a time, node
    /// order), each new pod from the same image: for each node, how long its old
    /// pod took to stop and its new one to turn Ready after its start.
    pub fn rollout(&mut self, lab: &mut HaLab) -> Result<Vec<(Duration, Duration)>> {
        self.roll(lab, None, |_, _| Ok(()))
    }

    /// A rolling update to another image: each node's new pod runs the agent
    /// binary `bin` (None: this build's). `between` runs after each batch of new
    /// pods is Ready, with the batch's nodes, while images are mixed.
    pub fn rollout_to(
        &mut self,
        lab: &mut HaLab,
        bin: Option<&Path>,
        between: impl FnMut(&mut HaLab, &[usize]) -> Result<()>,
    ) -> Result<Vec<(Duration, Duration)>> {
        self.roll(lab, Some(bin), between)
    }

    fn roll(
        &mut self,
        lab: &mut HaLab,
        image: Option<Option<&Path>>,
        mut between: impl FnMut(&mut HaLab, &[usize]) -> Result<()>,
    ) -> Result<Vec<(Duration, Duration)>> {
        let mut took = Vec::new();
        let nodes: Vec<usize> = (0..lab.nodes.len()).collect();
        for batch in nodes.chunks(self.pod.max_unavailable.max(1)) {
            let stopped: Vec<Duration> = batch.iter().map(|&i| self.delete(lab, i)).collect::<Result<_>>()?;
            std::thread::sleep(RESTART_DELAY);
            if let Some(bin) = image {
                for &i in batch {
                    lab.nodes[i].agent_bin = bin.map(Path::to_owned);
                }
            }
            let starts: Vec<Instant> = batch.iter().map(|&i| self.start(lab, i)).collect::<Result<_>>()?;
            for ((&i, start), stop) in batch.iter().zip(starts).zip(stopped) {
                took.push((stop, self.wait_ready(lab, i, start, READY_LIMIT)?));
            }
            between(lab, batch)?;
        }
        Ok(took)
    }
}
