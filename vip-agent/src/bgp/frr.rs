//! The agent's side of FRR: a task that renders the node's speaker
//! ([`super::speaker`]) whenever the model or the held VIPs change, writes it to
//! FRR's integrated configuration file and has `frr-reload.py` apply the
//! difference (sessions whose settings did not change stay up; a new or gone
//! VIP is one `network` line), and reads the sessions back from `vtysh`'s JSON
//! for the metrics. FRR runs beside the agent (the DaemonSet's `frr`
//! container, or FRR's own systemd unit): it outlives an agent that crashes or
//! restarts, so routes stay while the XDP program keeps forwarding; an agent
//! that stops ([`Speaker::leave`]) withdraws what its peers hold before it ends.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{anyhow, bail, Context as _, Result};
use prometheus_client::metrics::{counter::Counter, family::Family, gauge::Gauge};
use tokio::{process::Command, sync::watch};
use tracing::{info, warn};

use crate::{
    ha::heartbeat::PeerLabels,
    metrics::Tracked,
    model::World,
    status::{BgpSessionStatus, BgpStatus},
};

/// Where FRR is: the paths `vip-agent run` is given (`--frr-*`).
#[derive(Clone, Debug)]
pub struct Paths {
    /// The integrated configuration (frr.conf) the agent writes; its directory is
    /// FRR's configuration directory.
    pub config: PathBuf,
    /// The directory of the daemons' vty sockets.
    pub vty_dir: PathBuf,
    /// FRR's `frr-reload.py`.
    pub reload: PathBuf,
    /// `vtysh`.
    pub vtysh: PathBuf,
}

/// A reload that takes longer has hung (one takes well under a second).
const RELOAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Reading the sessions waits no longer: a stop waits behind it.
const READ_TIMEOUT: Duration = Duration::from_secs(3);
/// A failed reload is tried again this often, as are the sessions read back.
const RETRY: Duration = Duration::from_secs(5);
/// How long retiring sessions stay after FRR was told to send nothing on them:
/// the withdrawals go out at once.
const RETIRE_WAIT: Duration = Duration::from_secs(1);

/// The BGP metrics (registered by `metrics::Metrics`).
#[derive(Clone, Default)]
pub struct Metrics {
    /// 1 for a session in state Established, 0 for the others, per peer.
    pub session_up: Tracked<PeerLabels, Gauge>,
    /// Prefixes this node sends the peer.
    pub prefixes_sent: Tracked<PeerLabels, Gauge>,
    /// Prefixes the peer sent that FRR accepted (none: nothing is imported).
    pub prefixes_received: Tracked<PeerLabels, Gauge>,
    /// Routes this node announces (its held VIPs of `announce: bgp` pools).
    pub advertised: Gauge,
    pub reloads: Family<crate::metrics::ResultLabels, Counter>,
}

/// The running task's handle: the model goes in; [`Speaker::leave`] withdraws.
pub struct Speaker {
    go: watch::Sender<bool>,
    world: watch::Sender<Arc<World>>,
    leave: watch::Sender<Option<BTreeSet<IpAddr>>>,
    left: watch::Receiver<bool>,
    status: watch::Receiver<Option<BgpStatus>>,
}

impl Speaker {
    /// Starts the task of node `me`: it renders from the latest model and the
    /// VIPs on `lo` (`held`: the liveness thread's, those of `announce: bgp`
    /// pools are announced) once [`Speaker::start`]ed. Idle while the model has
    /// no BGP settings.
    pub fn spawn(paths: Paths, me: String, world: Arc<World>, held: watch::Receiver<BTreeSet<IpAddr>>, metrics: Metrics) -> Self {
        let (go, mut go_rx) = watch::channel(false);
        let (world_tx, world_rx) = watch::channel(world);
        let (leave, leave_rx) = watch::channel(None);
        let (left_tx, left) = watch::channel(false);
        let (status_tx, status) = watch::channel(None);
        let task = Task {
            paths,
            me,
            world: world_rx,
            held,
            leave: leave_rx,
            left: left_tx,
            status: status_tx,
            metrics,
            applied: None,
            retiring_since: BTreeMap::new(),
        };
        tokio::spawn(async move {
            if go_rx.wait_for(|g| *g).await.is_ok() {
                task.run().await;
            }
        });
        Self { go, world: world_tx, leave, left, status }
    }

    /// What FRR does, for the status: changes when a reload or a read of the
    /// sessions finds something new.
    pub fn status(&self) -> watch::Receiver<Option<BgpStatus>> {
        self.status.clone()
    }

    /// Lets the task render: called once the liveness thread has said what this
    /// node holds. Before, `held` is empty, and a restarted agent would withdraw
    /// every route its predecessor's FRR still announces.
    pub fn start(&self) {
        self.go.send_replace(true);
    }

    pub fn set_world(&self, world: Arc<World>) {
        self.world.send_replace(world);
    }

    /// Announces only `keep` from now on (the VIPs no peer holds: a stopping
    /// agent's peers keep the others announced) and waits, up to `limit`, until
    /// FRR has it. False when it did not (FRR down, a hung reload).
    pub async fn leave(&mut self, keep: BTreeSet<IpAddr>, limit: Duration) -> bool {
        self.leave.send_replace(Some(keep));
        tokio::time::timeout(limit, self.left.wait_for(|l| *l)).await.is_ok_and(|r| r.is_ok())
    }
}

struct Task {
    paths: Paths,
    me: String,
    world: watch::Receiver<Arc<World>>,
    held: watch::Receiver<BTreeSet<IpAddr>>,
    leave: watch::Receiver<Option<BTreeSet<IpAddr>>>,
    left: watch::Sender<bool>,
    status: watch::Sender<Option<BgpStatus>>,
    metrics: Metrics,
    /// What FRR was last given successfully.
    applied: Option<(String, super::Speaker)>,
    /// When FRR was first told to send nothing on each retiring session.
    retiring_since: BTreeMap<IpAddr, tokio::time::Instant>,
}

impl Task {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(RETRY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut held_open = true;
        loop {
            let want = self.render();
            // Rendered again after a failed reload, and once retiring sessions
            // have had their routes withdrawn.
            let mut again = None;
            if let Some((text, speaker, count)) = want {
                if self.applied.as_ref().map(|a| &a.0) != Some(&text) {
                    match reload(&self.paths, &text).await {
                        Ok(()) => {
                            info!(routes = count, retiring = speaker.retiring.len(), "FRR configuration applied");
                            self.metrics.reloads.get_or_create(&crate::metrics::ResultLabels { result: "ok".into() }).inc();
                            self.metrics.advertised.set(count as i64);
                            let now = tokio::time::Instant::now();
                            let retiring: BTreeSet<IpAddr> = speaker.retiring.iter().map(|p| p.address).collect();
                            self.retiring_since.retain(|p, _| retiring.contains(p));
                            for p in retiring {
                                self.retiring_since.entry(p).or_insert(now);
                            }
                            self.applied = Some((text.clone(), speaker));
                            self.update_status(|s| (s.routes, s.reload_error) = (count, None));
                        }
                        Err(e) => {
                            warn!("applying FRR's configuration: {e:#}; trying again in {RETRY:?}");
                            self.update_status(|s| s.reload_error = Some(format!("{e:#}")));
                            self.metrics.reloads.get_or_create(&crate::metrics::ResultLabels { result: "error".into() }).inc();
                            again = Some(RETRY);
                        }
                    }
                }
                // Woken when the first retiring session's wait is over.
                if let Some(first) = self.retiring_since.values().min().filter(|_| again.is_none()) {
                    again = Some(RETIRE_WAIT.saturating_sub(first.elapsed()).max(Duration::from_millis(10)));
                }
                if self.leave.borrow().is_some() && self.applied.as_ref().map(|a| a.0.as_str()) == Some(text.as_str()) {
                    self.left.send_replace(true);
                }
            } else if self.leave.borrow().is_some() && self.applied.is_none() {
                // FRR was never given anything of ours: nothing to withdraw.
                self.left.send_replace(true);
            }
            // Rendered again on a change too; the sessions are read back meanwhile.
            let wake = tokio::time::sleep(again.unwrap_or(Duration::MAX / 4));
            tokio::pin!(wake);
            loop {
                tokio::select! {
                    r = self.world.changed() => if r.is_err() { return } else { break },
                    // The liveness thread ends before a stopping agent leaves:
                    // what it last said stays.
                    r = self.held.changed(), if held_open => if r.is_err() { held_open = false } else { break },
                    r = self.leave.changed() => if r.is_err() { return } else { break },
                    _ = &mut wake, if again.is_some() => break,
                    _ = tick.tick() => if self.read_sessions().await { break },
                }
            }
        }
    }

    /// FRR's configuration for now and the routes in it. None while FRR was
    /// never given one and the model has no BGP settings or not this node;
    /// once it was, a model without either renders no sessions. Sessions the
    /// model drops go in two steps ([`super::Speaker::step_towards`]):
    /// kept with nothing sent on them until [`RETIRE_WAIT`] after FRR first had
    /// that for each.
    fn render(&self) -> Option<(String, super::Speaker, usize)> {
        let world = self.world.borrow().clone();
        let mut held = self.held.borrow().clone();
        if let Some(keep) = self.leave.borrow().as_ref() {
            held.retain(|v| keep.contains(v));
        }
        let mut speaker = super::speaker(&world, &self.me, &held).or_else(|| self.applied.is_some().then(super::Speaker::silent))?;
        if let Some((_, last)) = &self.applied {
            speaker = last.step_towards(speaker, |p| self.retiring_since.get(&p).is_some_and(|t| t.elapsed() >= RETIRE_WAIT));
        }
        let count = speaker.advertisements.iter().map(|a| a.addresses.len()).sum();
        match super::frr_config(&speaker) {
            Ok(text) => Some((text, speaker, count)),
            Err(e) => {
                // The config's validation refuses what FRR would: not reached.
                warn!("not giving FRR this node's speaker: {e}");
                None
            }
        }
    }

    /// Changes the published status; its readers are told only of a change.
    fn update_status(&self, f: impl FnOnce(&mut BgpStatus)) {
        self.status.send_if_modified(|cur| {
            let mut next = cur.clone().unwrap_or_default();
            f(&mut next);
            let changed = cur.as_ref() != Some(&next);
            *cur = Some(next);
            changed
        });
    }

    /// The sessions' state into the metrics and the status (skipped while FRR
    /// is not ours yet). True when a session FRR was given is missing: FRR lost
    /// its configuration (it restarted from a file of its own), and is given it
    /// again.
    async fn read_sessions(&mut self) -> bool {
        let Some((_, given)) = &self.applied else { return false };
        let given: Vec<IpAddr> = given.peers.iter().chain(&given.retiring).map(|p| p.address).collect();
        let label = |p: &IpAddr| PeerLabels { peer: p.to_string() };
        match sessions(&self.paths).await {
            Ok(s) => {
                // Sessions FRR has beside ours are not ours to judge.
                let lost = given.iter().any(|p| !s.contains_key(p));
                self.metrics.session_up.set_all(s.iter().map(|(p, st)| (label(p), i64::from(st.established()))));
                self.metrics.prefixes_sent.set_all(s.iter().map(|(p, st)| (label(p), st.prefixes_sent as i64)));
                self.metrics.prefixes_received.set_all(s.iter().map(|(p, st)| (label(p), st.prefixes_received as i64)));
                let sessions = s
                    .into_iter()
                    .map(|(peer, st)| BgpSessionStatus {
                        peer,
                        state: st.state,
                        prefixes_sent: st.prefixes_sent,
                        prefixes_received: st.prefixes_received,
                        last_reset: st.last_reset,
                    })
                    .collect();
                self.update_status(|s| s.sessions = sessions);
                if lost {
                    warn!("FRR's sessions are not those it was given (it restarted?): giving it this node's configuration again");
                    self.applied = None;
                }
                lost
            }
            Err(e) => {
                // Not known to be up: FRR may be down (the alert then fires).
                warn!("reading BGP sessions from FRR: {e:#}");
                self.metrics.session_up.set_all(given.iter().map(|p| (label(p), 0)));
                let unknown =
                    |peer| BgpSessionStatus { peer, state: "Unknown".into(), prefixes_sent: 0, prefixes_received: 0, last_reset: Some(format!("{e:#}")) };
                self.update_status(|s| s.sessions = given.iter().copied().map(unknown).collect());
                false
            }
        }
    }
}

/// Writes `text` as FRR's configuration (a whole file or none: renamed into
/// place) and has `frr-reload.py` apply the difference to the running daemons.
pub async fn reload(p: &Paths, text: &str) -> Result<()> {
    let dir = p.config.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = dir.join(".frr.conf.vip");
    tokio::fs::write(&tmp, text).await.with_context(|| format!("writing {}", tmp.display()))?;
    tokio::fs::rename(&tmp, &p.config).await.with_context(|| format!("renaming {} to {}", tmp.display(), p.config.display()))?;
    let bindir = p.vtysh.parent().ok_or_else(|| anyhow!("--vtysh {} has no directory", p.vtysh.display()))?;
    let mut cmd = Command::new(&p.reload);
    cmd.arg("--reload").arg("--stdout").arg("--bindir").arg(bindir).arg("--confdir").arg(dir).arg("--rundir").arg(&p.vty_dir);
    cmd.arg("--vty_socket").arg(&p.vty_dir).arg(&p.config).kill_on_drop(true);
    let out = tokio::time::timeout(RELOAD_TIMEOUT, cmd.output())
        .await
        .map_err(|_| anyhow!("{} did not finish within {RELOAD_TIMEOUT:?}", p.reload.display()))?
        .with_context(|| format!("running {} (is FRR installed? the image has it)", p.reload.display()))?;
    if !out.status.success() {
        let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let tail: Vec<&str> = all.lines().rev().take(5).collect();
        bail!("{} failed ({}): {}", p.reload.display(), out.status, tail.into_iter().rev().collect::<Vec<_>>().join(" | "));
    }
    Ok(())
}

/// One session as FRR reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionState {
    pub state: String,
    pub prefixes_sent: u64,
    /// Routes the peer sent that were accepted (none: the agent's FRR imports nothing).
    pub prefixes_received: u64,
    pub last_reset: Option<String>,
}

impl SessionState {
    pub fn established(&self) -> bool {
        self.state == "Established"
    }
}

/// The sessions of FRR's default instance (`show bgp neighbors json`).
pub async fn sessions(p: &Paths) -> Result<BTreeMap<IpAddr, SessionState>> {
    let out = tokio::time::timeout(
        READ_TIMEOUT,
        Command::new(&p.vtysh).arg("--vty_socket").arg(&p.vty_dir).args(["-c", "show bgp neighbors json"]).kill_on_drop(true).output(),
    )
    .await
    .map_err(|_| anyhow!("vtysh did not answer within {READ_TIMEOUT:?}"))?
    .with_context(|| format!("running {}", p.vtysh.display()))?;
    if !out.status.success() {
        bail!("vtysh: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    parse_sessions(&out.stdout)
}

/// `show bgp neighbors json`: an object by peer address (FRR adds keys that are
/// not addresses, such as `vrfName` in some versions: skipped).
pub fn parse_sessions(json: &[u8]) -> Result<BTreeMap<IpAddr, SessionState>> {
    let v: serde_json::Value = serde_json::from_slice(json).context("vtysh's JSON")?;
    let obj = v.as_object().ok_or_else(|| anyhow!("vtysh's JSON is not an object"))?;
    let mut out = BTreeMap::new();
    for (k, n) in obj {
        let Ok(addr) = k.parse::<IpAddr>() else { continue };
        let state = n.get("bgpState").and_then(|s| s.as_str()).unwrap_or("").to_owned();
        let count = |key: &str| -> u64 {
            let afs = n.get("addressFamilyInfo").and_then(|a| a.as_object());
            afs.map(|afs| afs.values().filter_map(|af| af.get(key).and_then(|c| c.as_u64())).sum()).unwrap_or(0)
        };
        let last_reset = n.get("lastResetDueTo").and_then(|s| s.as_str()).map(str::to_owned);
        let (prefixes_sent, prefixes_received) = (count("sentPrefixCounter"), count("acceptedPrefixCounter"));
        out.insert(addr, SessionState { state, prefixes_sent, prefixes_received, last_reset });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What FRR 8.4.4 said in the routed lab (`show bgp neighbors json` on a
    /// node with an IPv4 and an IPv6 session, two routes on each).
    #[test]
    fn reads_sessions_from_frr_json() {
        let s = parse_sessions(include_bytes!("testdata/neighbors-frr-8.4.4.json")).unwrap();
        let v4: IpAddr = "198.18.0.1".parse().unwrap();
        let v6: IpAddr = "2001:2::1".parse().unwrap();
        assert_eq!(s.keys().copied().collect::<Vec<_>>(), [v4, v6]);
        for st in s.values() {
            assert_eq!((st.state.as_str(), st.established(), st.prefixes_sent, st.prefixes_received), ("Established", true, 2, 0));
        }
        assert_eq!(s[&v4].last_reset.as_deref(), Some("Waiting for peer OPEN"));
        // A session down, and keys that are not addresses.
        let down = br#"{"198.18.0.9": {"bgpState": "Active", "lastResetDueTo": "No AFI/SAFI activated for peer"}, "vrfName": "default"}"#;
        let d = parse_sessions(down).unwrap();
        assert_eq!(d.len(), 1);
        let st = &d[&"198.18.0.9".parse::<IpAddr>().unwrap()];
        assert_eq!((st.established(), st.prefixes_sent, st.last_reset.as_deref()), (false, 0, Some("No AFI/SAFI activated for peer")));
        assert!(parse_sessions(b"[]").is_err(), "not an object");
    }
}
