//! The decision applied: `arp_held` written (VIPs held, released, forgotten, their
//! deadlines refreshed), announcements and ARP requests ordered from the sender,
//! and what was decided told to the rest of the agent.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::{Duration, Instant, SystemTime},
};

use tracing::{error, info, warn};

use super::{plan, replace_if_changed, selfcheck, Liveness, Membership};
use crate::{
    agent::record::Members,
    clock::monotonic_ns,
    dataplane::HeldMode,
    ha::{
        self,
        garp::{Job, Order},
        HeldVip,
    },
};

impl Liveness {
    /// Applies the decision ([`plan::plan`]) to `arp_held`: taken VIPs held and
    /// announced, lost ones released (their pending announcements cancelled),
    /// VIPs in no pool forgotten; then tells the status, the loopback task, the
    /// metrics and the programmer. `reassert`: see [`plan::plan`].
    pub(super) fn decide(&mut self, reassert: bool) {
        let (world, uplinks) = (self.world.clone(), self.uplinks.clone());
        let placed = |v: IpAddr| uplinks.by_pool.get(&world.pool_of(v)?.name).map(|l| l.ifindex);
        let p = plan::plan(&self.world, &self.s.me, &self.live, placed, &self.held, reassert);
        for v in p.unplaced.difference(&self.unplaced) {
            error!(vip = %v, "this node owns the VIP but its pool has no interface here: not answered (see the host problems)");
        }
        if !p.cancel.is_empty() {
            let _ = self.arp_tx.send(Order::Cancel(p.cancel.clone()));
        }
        for (vip, ifindex) in &p.release {
            match self.s.held.release(*ifindex, *vip) {
                Ok(()) => info!(%vip, ifindex, "released VIP (its pinned flows keep being forwarded)"),
                Err(e) => error!(%vip, "releasing VIP: {e:#}"),
            }
        }
        let deadline = monotonic_ns() + self.world.announce.hold_time.as_nanos() as u64;
        // A VIP of no owner we saw (this agent's first decision): whoever holds
        // it while we are away, as the peers compute it.
        let without_me =
            p.take.iter().any(|v| !self.owners.contains_key(v)).then(|| crate::agent::desired::owners_without(&self.world, &self.s.me, &self.live));
        for vip in &p.take {
            let (announce, ifindex) = p.want[vip];
            // A VIP every node holds has no previous holder: a flow that reaches
            // this node first was balanced by whichever node the router chose.
            let prev = self.owners.get(vip).or_else(|| without_me.as_ref()?.get(vip)).filter(|_| !p.ownership.everywhere.contains(vip)).cloned();
            self.hand_off(*vip, ifindex, prev, None);
            if let Err(e) = self.s.held.hold(ifindex, *vip, deadline, announce) {
                error!(%vip, "holding VIP: {e:#}");
            } else {
                info!(%vip, ifindex, on_lo = announce == HeldMode::Lo, "holding VIP");
            }
        }
        match self.s.held.entries() {
            Ok(entries) => {
                let drop = plan::forget(&self.world, placed, &entries);
                if !drop.is_empty() {
                    let gone: Vec<(u32, IpAddr)> = drop.iter().map(|e| (e.ifindex, e.vip)).collect();
                    if let Err(err) = self.s.held.forget_all(&gone) {
                        error!("forgetting VIPs: {err:#}");
                    }
                    for e in drop {
                        info!(vip = %e.vip, ifindex = e.ifindex, "forgot VIP (in no pool, or moved to another interface)");
                    }
                }
            }
            Err(e) => error!("reading arp_held: {e:#}"),
        }
        let now = SystemTime::now();
        let plan::Plan { ownership: o, unplaced, want, take, announce, .. } = p;
        self.unplaced = unplaced;
        // A VIP taken (again) is no longer the one found held at start.
        let kept = |v: &IpAddr| want.contains_key(v) && !take.contains(v);
        self.adopted.retain(kept);
        self.arp.keep(kept, &self.s.metrics);
        self.since.retain(|v, _| kept(v));
        for v in want.keys() {
            self.since.entry(*v).or_insert(now);
        }
        self.held = want;
        let held = &self.held;
        self.pending_handoff.retain(|v, _| held.contains_key(v));
        self.sync_groups();
        self.announce(announce, true);
        self.last_garp.retain(|v, _| o.held.contains(v));
        self.others_to_report = o.everywhere.iter().filter(|v| o.owners.get(v) != Some(&self.s.me)).copied().collect();
        self.tell_held();
        self.s.on_lo.send_if_modified(|cur| replace_if_changed(cur, &o.on_lo));
        self.s.metrics.record(&self.world, &self.owners, &o, &Members { me: &self.s.me, tracked: &self.tracked, live: &self.live });
        self.owners = o.owners.clone();
        let m = Membership {
            tracked: self.tracked.clone(),
            live: self.live.clone(),
            leaving: self.leaving.clone(),
            silent: self.silent.clone(),
            owners: o.owners,
            held: o.held,
            on_lo: o.on_lo,
        };
        self.out.send_if_modified(|cur| replace_if_changed(cur, &m));
        // Last: O(VIPs × nodes) hashing, after everything a failover waits for.
        if self.arp.enabled() {
            let mine = selfcheck::checked_here(&self.world, &self.s.me, &self.live, &self.owners, |p| self.uplinks.by_pool.contains_key(p));
            self.arp.check_for(mine);
        }
    }

    /// Before `vip` is held on `ifindex`: records `prev`, the node that held it
    /// until now (as this node saw it), as its previous holder, whom the data path
    /// asks about flows it never saw; forgets an older one when there is none or
    /// its heartbeats say its data path cannot answer (0.1.0's). A peer not heard
    /// from yet (this agent just started) is taken to answer: an ask it drops costs
    /// a retransmission until its heartbeat says so, a flow hashed on a changed
    /// ring its connection. A previous holder whose MAC is not known yet is
    /// recorded once it is ([`Self::retry_handoffs`]).
    fn hand_off(&mut self, vip: IpAddr, ifindex: u32, prev: Option<String>, neighbours: Option<&crate::neighbour::Table>) {
        self.pending_handoff.remove(&vip);
        let prev = prev.filter(|o| *o != self.s.me);
        let asks = prev.as_ref().is_some_and(|p| self.s.peer_settings.borrow().get(p).is_none_or(|s| crate::model::answers_asks(s)));
        let r = match prev.filter(|_| asks) {
            None => self.s.held.end_handoff(ifindex, vip),
            Some(prev) => match self.mac_of(&prev, neighbours) {
                Some(mac) => self.s.held.hand_off(ifindex, vip, mac),
                None => {
                    self.pending_handoff.insert(vip, (prev, ifindex));
                    self.s.held.end_handoff(ifindex, vip)
                }
            },
        };
        if let Err(e) = r {
            error!(%vip, "recording the VIP's previous holder: {e:#}");
        }
    }

    /// Node `name`'s MAC: from the model, as the agent resolved it, or from the
    /// kernel's neighbour table when read (`neighbours`).
    fn mac_of(&self, name: &str, neighbours: Option<&crate::neighbour::Table>) -> Option<[u8; 6]> {
        let node = self.world.nodes.iter().find(|n| n.name == name)?;
        node.mac.or_else(|| self.s.node_macs.borrow().get(name).copied()).or_else(|| neighbours?.get(&node.addr).copied())
    }

    /// Records the previous holders whose MACs were not known when their VIPs
    /// were taken, with the kernel's neighbour table read once (a node just
    /// started knows its peers' MACs from its first heartbeats to them, before
    /// the agent resolves them). On every deadline refresh while any is left.
    pub(super) fn retry_handoffs(&mut self) {
        let table = crate::neighbour::table();
        for (vip, (prev, ifindex)) in std::mem::take(&mut self.pending_handoff) {
            self.hand_off(vip, ifindex, Some(prev), Some(&table));
        }
    }

    /// Joins the solicited-node group of every IPv6 VIP answered here on the
    /// interface the program sees its solicitations on, and leaves the others
    /// (see ha::groups). A failed join is retried at the next refresh.
    pub(super) fn sync_groups(&mut self) {
        let want: BTreeSet<(u32, std::net::Ipv6Addr)> = self
            .held
            .iter()
            .filter(|(_, (a, _))| *a == HeldMode::Arp)
            .filter_map(|(v, _)| match v {
                IpAddr::V6(v6) => Some((self.link_of(*v)?.xdp_ifindex, *v6)),
                IpAddr::V4(_) => None,
            })
            .collect();
        for (ifindex, vip, e) in self.groups.sync(&want) {
            error!(%vip, ifindex, "joining the VIP's solicited-node multicast group: {e}; solicitations may not reach this node");
        }
    }

    /// Re-writes the deadline of every held VIP (fencing: if this stops, they go stale).
    pub(super) fn refresh(&mut self) {
        let now = monotonic_ns();
        let last = self.deadline;
        let lapsed = last != 0 && now > last;
        let deadline = now + self.world.announce.hold_time.as_nanos() as u64;
        let mut by_ifindex: BTreeMap<u32, Vec<(IpAddr, HeldMode)>> = BTreeMap::new();
        for (v, (a, i)) in &self.held {
            by_ifindex.entry(*i).or_default().push((*v, *a));
        }
        for (ifindex, all) in by_ifindex {
            if let Err(e) = self.s.held.hold_all(ifindex, &all, deadline) {
                error!(ifindex, "refreshing held VIPs: {e:#}");
            }
        }
        self.deadline = deadline;
        self.sync_groups();
        if lapsed && !self.held.is_empty() {
            // We were not running (stopped, starved) and our VIPs went stale; peers
            // may have taken them and moved clients away. Taking them back is a
            // takeover like any other: announce it.
            warn!(stale_ms = (now - last) / 1_000_000, "held VIPs had gone stale; re-announcing them");
            self.announce(self.held.keys().copied().collect(), true);
        }
        // After the deadlines: they never wait for a neighbour table read.
        if !self.pending_handoff.is_empty() {
            self.retry_handoffs();
        }
    }

    /// Gratuitous ARP for those of `vips` announced by ARP, an unsolicited Neighbor
    /// Advertisement for IPv6 ones (in the background, through the same sender): on
    /// a `takeover` each pool's count of frames, its interval apart, so switches and
    /// neighbours learn the new owner at once; else one frame (refresh, conflict).
    pub(super) fn announce(&mut self, vips: BTreeSet<IpAddr>, takeover: bool) {
        let now = (Instant::now(), SystemTime::now());
        let mut by_settings: BTreeMap<crate::model::Garp, Vec<_>> = BTreeMap::new();
        for v in vips {
            if self.world.announce_mode(v).on_lo() {
                continue;
            }
            let Some(l) = self.link_of(v) else { continue };
            let frame = ha::garp::tagged(&ha::garp::announcement_frame(l.mac, v), l.vlan);
            by_settings.entry(self.world.garp(v)).or_default().push((v, l.xdp_ifindex, frame));
            self.last_garp.insert(v, now);
        }
        let announced = !by_settings.is_empty();
        for (g, frames) in by_settings {
            let rounds = if takeover { g.count } else { 1 };
            let _ = self.arp_tx.send(Order::Send(Job { frames, rounds, gap: g.interval, what: "gratuitous ARP or unsolicited neighbour advertisement" }));
        }
        if announced {
            self.tell_held();
        }
    }

    /// Sends the held VIPs to their status writer (a `watch`: never waits). A VIP
    /// every node holds goes only from its named owner: one writer per status
    /// (several would each rewrite it every few seconds).
    pub(super) fn tell_held(&self) {
        let vips: BTreeMap<IpAddr, HeldVip> = self
            .held
            .iter()
            .filter(|(v, _)| !self.others_to_report.contains(v))
            .filter_map(|(v, (_, ifindex))| {
                let l = self.link_of(*v)?;
                // A pool's `vlan` is no interface of the host: its parent is.
                let interface = if crate::links::is_vlan_net(*ifindex) { l.xdp_iface.clone() } else { l.name.clone() };
                let since = *self.since.get(v)?;
                Some((
                    *v,
                    HeldVip {
                        since,
                        last_garp: self.last_garp.get(v).map(|(_, t)| *t),
                        interface,
                        vlan: l.vlan,
                        adopted: self.adopted.contains(v),
                        arp: self.arp.check_of(v),
                    },
                ))
            })
            .collect();
        self.s.held_vips.send_if_modified(|cur| replace_if_changed(cur, &vips));
    }

    /// One gratuitous ARP for each held VIP whose pool's refresh has passed since
    /// it was last announced (switch FDB and neighbour entries age out).
    pub(super) fn refresh_garp(&mut self) {
        let now = Instant::now();
        let due: BTreeSet<IpAddr> =
            self.held.keys().filter(|v| self.last_garp.get(v).is_none_or(|(t, _)| now.duration_since(*t) >= self.world.garp(**v).refresh)).copied().collect();
        if !due.is_empty() {
            self.announce(due, false);
        }
    }

    /// Asks ARP for the addresses of nodes that just came back. After our link was
    /// down the kernel's neighbour entries for them sit INCOMPLETE until its next
    /// retry (up to a second): their heartbeats reach us, ours would not reach them.
    /// The reply to this request completes the entries at once. IPv6 nodes get a
    /// datagram instead, which has the kernel solicit them now.
    pub(super) fn resolve(&self, addrs: Vec<IpAddr>) {
        let Some(me) = self.world.node(&self.s.me).map(|n| n.addr) else { return };
        let Some(home) = &self.uplinks.home else { return };
        let mut frames = Vec::new();
        for a in addrs {
            match (me, a) {
                (IpAddr::V4(me), IpAddr::V4(a)) => {
                    frames.push((a.into(), home.xdp_ifindex, ha::garp::tagged(&ha::garp::arp_request_frame(home.mac, me, a), home.vlan)))
                }
                (_, IpAddr::V6(_)) => crate::neighbour::solicit(a),
                // An IPv4 peer of an IPv6 node: no address of ours to ask from.
                (IpAddr::V6(_), IpAddr::V4(_)) => {}
            }
        }
        if !frames.is_empty() {
            let _ = self.arp_tx.send(Order::Send(Job { frames, rounds: 1, gap: Duration::ZERO, what: "ARP request" }));
        }
    }
}
