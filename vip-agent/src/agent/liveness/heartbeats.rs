//! The heartbeat task: (re)started when its settings change, and told when the
//! agent leaves.
use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use tokio::sync::watch;
use tracing::{error, info, warn};

use super::{replace_if_changed, Liveness};
use crate::{
    agent::desired::owners_without,
    ha::{garp::Order, heartbeat},
};

/// How long a stopping agent waits for its leaving heartbeats to be sent before
/// it releases the VIPs its peers take ([`Liveness::leave`]): 3 datagrams 1 ms apart.
const LEAVE_SEND_WAIT: Duration = Duration::from_millis(100);

/// How long a stopping agent waits for the kernel to take the VIPs its peers
/// took off `lo` (a few netlink round trips).
const LEAVE_LO_WAIT: Duration = Duration::from_millis(200);

impl Liveness {
    /// The agent stops: once its leaving heartbeats are out (peers take its VIPs
    /// at once), the VIPs a live peer takes are released here (stale: no more
    /// ARP answers; clients still sending here are balanced, frames from other
    /// nodes passed). Left fresh until their deadline, they would make this node
    /// and their new holder both fresh holders for that time, and two fresh
    /// holders whose rings differ on a flow (this node's last state, the
    /// peer's with this node leaving) forward its frames to each other, with no
    /// hop limit at layer 2. A VIP no live peer takes stays answered until its
    /// deadline, for the next agent.
    pub(super) async fn leave(&mut self) {
        if let Some((_, rx)) = self.heartbeat.as_mut() {
            // The task ends once it has sent them.
            let sent = tokio::time::timeout(LEAVE_SEND_WAIT, async { while rx.changed().await.is_ok() {} }).await;
            if sent.is_err() {
                warn!("leaving heartbeats not sent within {LEAVE_SEND_WAIT:?}; releasing the VIPs peers take anyway");
            }
        }
        let taken = owners_without(&self.world, &self.s.me, &self.live);
        let released: Vec<(IpAddr, u32)> = self.held.iter().filter(|(v, _)| taken.contains_key(v)).map(|(v, (_, i))| (*v, *i)).collect();
        let _ = self.arp_tx.send(Order::Cancel(released.iter().map(|(v, _)| *v).collect()));
        for (vip, ifindex) in &released {
            match self.s.held.release(*ifindex, *vip) {
                Ok(()) => info!(%vip, ifindex, new_holder = %taken[vip], "released VIP on leaving (its pinned flows keep being forwarded)"),
                Err(e) => error!(%vip, "releasing VIP on leaving: {e:#}"),
            }
        }
        // Off `lo` too: the routing daemon withdraws them, and routers send their
        // flows to the nodes that took them while this data path still forwards.
        let on_lo: BTreeSet<IpAddr> = released.iter().map(|(v, _)| *v).filter(|v| self.world.announce_mode(*v).on_lo()).collect();
        if !on_lo.is_empty() {
            match tokio::time::timeout(LEAVE_LO_WAIT, crate::ha::loopback::withdraw(&on_lo)).await {
                Ok(Ok(gone)) => info!(vips = gone.len(), "VIPs taken by peers removed from lo"),
                Ok(Err(e)) => error!("removing the VIPs peers took from lo: {e:#}"),
                Err(_) => error!("removing the VIPs peers took from lo: no answer within {LEAVE_LO_WAIT:?}"),
            }
        }
    }

    /// (Re)starts heartbeats when their settings (our address, the peers eligible
    /// to hold VIPs, timers) changed. With no peer there are none, and every node
    /// counts as alive.
    pub(super) async fn sync_heartbeat(&mut self) {
        let me = self.s.me.clone();
        let f = &self.world.failover;
        if !self.link_up {
            // Nothing can be answered or forwarded here: leave the membership
            // (peers stop hearing us and take our VIPs, and we leave their rings),
            // whatever network the heartbeats use.
            self.heartbeat = None;
            self.tracked = BTreeSet::from([me]);
            self.live = BTreeSet::new();
            self.silent.clear();
            return;
        }
        let Some(my) = self.world.node(&me) else {
            // Not in the model (removed from the file, Node gone): not a member, so
            // no heartbeats and no VIP; peers take ours.
            if self.heartbeat.take().is_some() || !self.live.is_empty() {
                warn!(node = %me, "this node is not in the model: it sends no heartbeats and holds no VIP");
            }
            self.tracked = BTreeSet::from([me]);
            self.live = BTreeSet::new();
            self.silent.clear();
            return;
        };
        self.settings.send_if_modified(|cur| replace_if_changed(cur, &crate::model::announced_settings(&self.world)));
        let peers: Vec<(String, SocketAddr)> =
            self.world.holders().into_iter().filter(|n| n.name != me).map(|n| (n.name.clone(), SocketAddr::from((n.addr, f.heartbeat_port)))).collect();
        // Peers the running task has seen go down stay down in its replacement
        // until heard (only a new agent presumes every peer alive).
        let dead = self.heartbeat.as_ref().map_or_else(BTreeSet::new, |(cur, rx)| {
            let sets = rx.borrow();
            cur.peers.iter().map(|(n, _)| n).filter(|n| !sets.live.contains(*n)).cloned().collect()
        });
        let want = heartbeat::Options {
            bind: SocketAddr::from((my.addr, f.heartbeat_port)),
            peers,
            dead,
            silent: self.silent.clone(),
            me: me.clone(),
            interval: f.heartbeat_interval,
            dead_after: f.dead_after,
            gate: Some((self.s.metrics.last_turn_ns.clone(), self.world.announce.hold_time / 2)),
            metrics: Some(self.s.metrics.heartbeat.clone()),
            keys: self.s.keys.clone(),
            leave: Some(self.s.leave.clone()),
            arp: Some(self.arp.link()),
            settings: Some(heartbeat::SettingsLink { ours: self.settings.subscribe(), peers: self.s.peer_settings.clone() }),
        };
        let same =
            |a: &heartbeat::Options, b: &heartbeat::Options| (a.bind, &a.peers, a.interval, a.dead_after) == (b.bind, &b.peers, b.interval, b.dead_after);
        if self.heartbeat.as_ref().is_some_and(|(cur, _)| same(cur, &want)) {
            return;
        }
        // Dropping the receiver stops the old task, which then releases the port.
        // Its late peers go with it: the next task says who is silent.
        self.heartbeat = None;
        self.silent.clear();
        if want.peers.is_empty() {
            self.tracked = BTreeSet::from([me]);
            self.live = self.world.nodes.iter().map(|n| n.name.clone()).collect();
            return;
        }
        self.tracked = want.peers.iter().map(|(n, _)| n.clone()).chain([me]).collect();
        for attempt in 0..50 {
            match heartbeat::run(want.clone()).await {
                Ok(rx) => {
                    self.live = rx.borrow().live.clone();
                    self.leaving = rx.borrow().leaving.clone();
                    self.silent = rx.borrow().silent.clone();
                    info!(bind = %want.bind, peers = want.peers.len(), "heartbeats running");
                    self.heartbeat = Some((want, rx));
                    return;
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempt < 49 => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => {
                    // Peers cannot hear us (the address is not ours, or the port is
                    // taken): they count us dead and take our VIPs, so we hold none.
                    // Retried every second.
                    error!(bind = %want.bind, "cannot start heartbeats: {e}; peers see this node as dead, so it holds no VIP until they can hear it");
                    self.live = BTreeSet::new();
                    return;
                }
            }
        }
    }
}

/// The next live set from the heartbeat task (pending forever without one).
pub(super) async fn next_live(hb: &mut Option<(heartbeat::Options, watch::Receiver<heartbeat::PeerSets>)>) -> Option<heartbeat::PeerSets> {
    match hb {
        Some((_, rx)) => match rx.changed().await {
            Ok(()) => Some(rx.borrow_and_update().clone()),
            Err(_) => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}
