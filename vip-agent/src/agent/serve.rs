//! The agent's loops, entered by [`super::run`] once it has built everything: the
//! wait of a node the model leaves out, then the agent loop (what it waits on:
//! [`Inputs`]) and its orderly stop.
use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    net::IpAddr,
    pin::Pin,
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use anyhow::Result;
use tokio::{
    signal::unix,
    sync::{mpsc, watch},
};
use tracing::{info, warn};

use super::{
    feed::{next_world, Feed},
    keys::KeyUpdates,
    Agent, Membership, LEAVING_STAY,
};
use crate::{clock::monotonic_ns, ha, health::HealthChange, model::AnnounceMode};

/// What the agent loop waits on, built once by [`super::run`].
pub(super) struct Inputs {
    /// The source's models.
    pub(super) feed: Feed,
    /// The probe tasks' health changes.
    pub(super) health: mpsc::UnboundedReceiver<HealthChange>,
    /// What silent peers' health targets answered (`silent`).
    pub(super) serving: mpsc::UnboundedReceiver<super::silent::Answer>,
    /// The liveness thread's decisions; closed once it has ended.
    pub(super) members: watch::Receiver<Membership>,
    /// Each peer's cluster-wide settings, as its heartbeats carry them.
    pub(super) peer_settings: watch::Receiver<BTreeMap<String, String>>,
    /// The heartbeat keys (None: a trusted segment), and where their rotations
    /// come from.
    pub(super) keys: Option<ha::auth::KeyText>,
    pub(super) key_updates: KeyUpdates,
    /// How often the config file is read again (file source).
    pub(super) reload_interval: Duration,
    /// Set when the agent stops: the liveness thread tells the peers, and ends.
    pub(super) leave: watch::Sender<Option<Duration>>,
}

impl Agent {
    /// Whether the program is attached nowhere and the model leaves this node out.
    fn left_out(&self) -> bool {
        self.interfaces.attached_count() == 0 && self.world.node(&self.me).is_none()
    }

    /// Waits until the model has this node; false when `shutdown` came first.
    ///
    /// A node the model leaves out (its Node not Ready, tainted not-ready or
    /// network-unavailable, labelled exclude-from-external-load-balancers, or not
    /// registered yet) has nowhere to attach to yet: it waits to be let in. Exiting
    /// would crash-loop a DaemonSet's pod, whose back-off then delays it for minutes
    /// once the Node is Ready. (The file source refuses an unlisted node when it starts.)
    pub(super) async fn wait_until_in_model(&mut self, feed: &mut Feed, mut shutdown: Pin<&mut impl Future<Output = ()>>) -> bool {
        if !self.left_out() {
            return true;
        }
        info!(node = %self.me, "this node is not in the cluster's model (its Node not Ready, tainted, excluded from load balancers, or not registered yet): waiting for it");
        // Alive meanwhile (/healthz: a liveness probe must not restart it) and
        // ready as idle (/readyz): `kubectl rollout status` and a rolling update
        // must not wait on a node vip does not serve, such as kubeadm's and kind's
        // control planes, which are labelled exclude-from-external-load-balancers.
        let mut alive = tokio::time::interval(Duration::from_secs(1));
        self.metrics.idle.store(true, Ordering::Relaxed);
        while self.left_out() {
            tokio::select! {
                Some(world) = next_world(feed) => self.adopt(Arc::new(world)),
                _ = alive.tick() => self.metrics.liveness.last_turn_ns.store(monotonic_ns(), Ordering::Relaxed),
                _ = shutdown.as_mut() => return false,
            }
        }
        self.metrics.idle.store(false, Ordering::Relaxed);
        info!("this node is in the cluster's model now");
        true
    }

    /// The agent loop: programs the data path on every input until `shutdown`
    /// completes, then tells the peers this node leaves and returns, leaving the
    /// data path running on the last state.
    pub(super) async fn serve(mut self, inputs: Inputs, mut shutdown: Pin<&mut impl Future<Output = ()>>) -> Result<()> {
        let Inputs { mut feed, mut health, mut serving, mut members, mut peer_settings, mut keys, mut key_updates, reload_interval, leave } = inputs;
        // Backends without a known MAC and services that did not fit are retried.
        let mut retry = tokio::time::interval(Duration::from_secs(1));
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut resolve = tokio::time::interval(Duration::from_millis(250));
        resolve.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reload = tokio::time::interval(reload_interval);
        // The key file (a mounted Secret is updated in place) is re-read for rotations.
        let mut rekey = tokio::time::interval(Duration::from_secs(5));
        // The host may be set up (or broken) after the agent starts. The status is
        // rewritten then too: its timestamp tells `inspect` the agent is alive.
        let mut host_check = tokio::time::interval(crate::status::REFRESH_INTERVAL);
        let mut hup = unix::signal(unix::SignalKind::hangup())?;
        let mut bgp = self.speaker.status();
        loop {
            tokio::select! {
                Some(ev) = health.recv() => {
                    // Drain what else is queued: one map update for a burst of changes,
                    // timed from the first change that counted.
                    let mut at = self.take_health(ev);
                    while let Ok(more) = health.try_recv() {
                        at = at.or(self.take_health(more));
                    }
                    if let Some(at) = at {
                        self.reconcile(Some(at));
                    }
                }
                Some(a) = serving.recv() => self.take_serving(a),
                Ok(()) = peer_settings.changed() => {
                    self.peer_settings = peer_settings.borrow_and_update().clone();
                    self.check_settings();
                    // The peers' versions in the status.
                    self.publish();
                }
                Ok(()) = members.changed() => {
                    let m = members.borrow_and_update().clone();
                    self.take_membership(m);
                }
                Some(world) = next_world(&mut feed) => {
                    info!("the cluster's model changed; applying");
                    self.status.config.generation += 1;
                    self.adopt(Arc::new(world));
                    self.reconcile(None);
                }
                _ = reload.tick(), if self.config_file.is_some() => self.reload(false),
                _ = hup.recv(), if self.config_file.is_some() => self.reload(true),
                _ = resolve.tick(), if !self.unresolved.is_empty() => self.reconcile(None),
                _ = retry.tick(), if !self.failed.is_empty() => self.reconcile(None),
                Some(text) = key_updates.next(&mut rekey) => {
                    if let Some(k) = keys.as_mut() {
                        match k.update(text) {
                            Ok(true) => info!("heartbeat keys changed: {}", key_updates.origin()),
                            Ok(false) => {}
                            Err(e) => warn!("heartbeat keys from {}: {e:#}; keeping the keys read before", key_updates.origin()),
                        }
                    }
                }
                Ok(()) = bgp.changed() => self.publish(),
                _ = host_check.tick() => {
                    self.place();
                    self.check_host();
                    self.publish();
                }
                _ = shutdown.as_mut() => break,
            }
        }
        // Tell the peers: they take this node's VIPs at once (rather than after
        // deadAfter of silence) and keep it a backend while the next agent starts, so
        // that a rolling update breaks none of the connections it carries.
        leave.send_replace(Some(LEAVING_STAY));
        // The liveness thread sends them, releases the VIPs peers take, and ends
        // (its membership sender dropped): bounded, a stop must not hang.
        let ended = tokio::time::timeout(Duration::from_millis(500), async { while members.changed().await.is_ok() {} }).await;
        if ended.is_err() {
            warn!("the liveness thread did not end within 500 ms of the stop");
        }
        self.withdraw_bgp().await;
        // Program and maps stay: VIPs no peer took keep being answered until their
        // deadline, so that an agent restarted within the hold time takes over
        // without a gap; released ones keep balancing clients that still send here.
        info!("stopping; the data path keeps running on the last state");
        Ok(())
    }

    /// Has FRR withdraw the `announce: bgp` VIPs that live peers hold (all of
    /// those of a pool with another live eligible node), so that the routers
    /// move their flows to them while this data path still forwards; the others
    /// stay announced, as `lo` keeps them. Bounded: a stop must not hang on FRR.
    async fn withdraw_bgp(&mut self) {
        if self.world.bgp.is_none() {
            return;
        }
        let bgp_vips = self.membership.on_lo.iter().filter(|v| self.world.announce_mode(**v) == AnnounceMode::Bgp);
        let taken = super::desired::owners_without(&self.world, &self.me, &self.membership.live);
        let (gone, keep): (BTreeSet<IpAddr>, BTreeSet<IpAddr>) = bgp_vips.copied().partition(|v| taken.contains_key(v));
        if gone.is_empty() {
            return;
        }
        if self.speaker.leave(keep, BGP_WITHDRAW_WAIT).await {
            info!(withdrawn = gone.len(), "BGP routes of the VIPs peers hold withdrawn");
        } else {
            warn!(
                vips = gone.len(),
                "FRR did not withdraw the VIPs peers hold within {BGP_WITHDRAW_WAIT:?}; the routers keep sending them here until the sessions' hold time"
            );
        }
    }
}

/// How long a stop waits for FRR to withdraw (a reload takes under a second).
const BGP_WITHDRAW_WAIT: Duration = Duration::from_secs(5);
