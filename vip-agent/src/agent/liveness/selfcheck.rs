//! The ARP self-check (`ha::arpcheck`) as the liveness thread runs it. As a
//! checker, a node asks for the VIPs of other nodes it was chosen to check and
//! sends what answered to their holder (on the next heartbeat); as a holder, it
//! compares those findings with its own MAC: each VIP's ARP check (its status
//! condition), `vip_arp_foreign_answers` and a log line when a foreign MAC
//! appears or goes. Its state is its own: the liveness decision only tells it
//! which VIPs are still held ([`SelfCheck::keep`]) and who holds the others.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant, SystemTime},
};

use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{plan::Held, Uplinks};
use crate::{
    dataplane::HeldVips,
    ha::{
        self,
        arpcheck::{self, ArpCheck, Finding},
        garp::{Job, Order},
        heartbeat::ArpLink,
    },
    links::Link,
    metrics::{self, LivenessMetrics},
    model::{AnnounceMode, World},
};

pub(super) struct SelfCheck {
    /// How often each checked VIP is asked for; zero: no self-check.
    interval: Duration,
    /// As a checker: the VIPs of other nodes this node checks (→ their holder),
    /// when each is due, and the requests awaiting answers.
    mine: BTreeMap<Ipv4Addr, String>,
    schedule: arpcheck::Schedule,
    inflight: Vec<InFlight>,
    /// As a holder: findings from the checkers (by heartbeat), and the last check
    /// of each held VIP.
    link: ArpLink,
    reports: mpsc::UnboundedReceiver<(String, Vec<Finding>)>,
    checks: BTreeMap<IpAddr, ArpCheck>,
}

/// An ARP self-check request sent, awaiting answers.
struct InFlight {
    vip: Ipv4Addr,
    ifindex: u32,
    holder: String,
    sent: Instant,
}

/// What a turn of the self-check uses of the liveness thread's.
pub(super) struct Ctx<'a> {
    pub held: &'a mut HeldVips,
    pub metrics: &'a LivenessMetrics,
    pub frames: &'a mpsc::UnboundedSender<Order>,
    pub world: &'a World,
    pub uplinks: &'a Uplinks,
}

impl Ctx<'_> {
    /// Where `vip` is answered on this node: its pool's link.
    fn link_of(&self, vip: IpAddr) -> Option<Link> {
        self.uplinks.link_of(self.world, vip).cloned()
    }
}

impl SelfCheck {
    pub fn new(interval: Duration) -> Self {
        let (reports, rx) = mpsc::unbounded_channel();
        Self {
            interval,
            mine: BTreeMap::new(),
            schedule: arpcheck::Schedule::new(interval),
            inflight: Vec::new(),
            link: ArpLink { outbox: Default::default(), reports },
            reports: rx,
            checks: BTreeMap::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        !self.interval.is_zero()
    }

    /// The heartbeat task's end of it: findings out, findings in.
    pub fn link(&self) -> ArpLink {
        self.link.clone()
    }

    /// The next checker's findings for VIPs this node holds: (checker, findings).
    pub async fn report(&mut self) -> Option<(String, Vec<Finding>)> {
        self.reports.recv().await
    }

    /// The last check of a VIP held here, for its status.
    pub fn check_of(&self, vip: &IpAddr) -> Option<ArpCheck> {
        self.checks.get(vip).cloned()
    }

    /// Forgets the checks of VIPs no longer held here (or taken anew).
    pub fn keep(&mut self, kept: impl Fn(&IpAddr) -> bool, metrics: &LivenessMetrics) {
        self.checks.retain(|v, _| kept(v));
        self.sync_metric(metrics);
    }

    fn sync_metric(&self, metrics: &LivenessMetrics) {
        metrics.arp_foreign.retain(|l| l.vip.parse().is_ok_and(|v: IpAddr| self.checks.contains_key(&v)));
    }

    /// Sets the VIPs this node checks as a checker (see [`checked_here`]).
    pub fn check_for(&mut self, mine: BTreeMap<Ipv4Addr, String>) {
        self.mine = mine;
    }

    /// One turn as a checker: the answers to requests sent [`arpcheck::WAIT`] ago
    /// go to their holders (next heartbeat), and the VIP most overdue is asked
    /// for: an `arp_watch` entry, then a broadcast request from this node's MAC
    /// and address on the VIP's network (0.0.0.0, an ARP probe, where it has
    /// none), through the frame sender. Whether a held VIP's check was forgotten
    /// (its status changes).
    pub fn turn(&mut self, cx: &mut Ctx) -> bool {
        let now = Instant::now();
        let (done, waiting): (Vec<InFlight>, Vec<InFlight>) = std::mem::take(&mut self.inflight).into_iter().partition(|p| now >= p.sent + arpcheck::WAIT);
        self.inflight = waiting;
        for p in done {
            match cx.held.take_arp_watch(p.ifindex, p.vip) {
                Ok(Some((macs, _))) => {
                    let f = Finding { vip: p.vip, macs: macs.iter().map(arpcheck::mac_text).collect() };
                    tracing::debug!(vip = %p.vip, holder = %p.holder, macs = ?f.macs, "ARP self-check: answers seen");
                    self.link.outbox.push(&p.holder, f);
                }
                Ok(None) => {}
                Err(e) => warn!(vip = %p.vip, "ARP self-check: {e:#}"),
            }
        }
        // Checks this node's holder sent long ago (its checker left) are forgotten.
        let before = self.checks.len();
        self.checks.retain(|_, c| c.at.elapsed().unwrap_or_default() < arpcheck::FORGET_AFTER);
        let forgot = self.checks.len() != before;
        if forgot {
            self.sync_metric(cx.metrics);
        }
        let mine: BTreeSet<Ipv4Addr> = self.mine.keys().copied().collect();
        for vip in self.schedule.next(&mine, now, 1) {
            if self.inflight.iter().any(|p| p.vip == vip) {
                continue;
            }
            let Some(l) = cx.link_of(vip.into()) else { continue };
            if let Err(e) = cx.held.watch_arp(l.ifindex, vip) {
                warn!(%vip, "ARP self-check: {e:#}");
                continue;
            }
            let frame = ha::garp::tagged(&ha::garp::arp_request_frame(l.mac, source_address(&l, vip), vip), l.vlan);
            let _ = cx.frames.send(Order::Send(Job {
                frames: vec![(vip.into(), l.xdp_ifindex, frame)],
                rounds: 1,
                gap: Duration::ZERO,
                what: "ARP self-check request",
            }));
            cx.metrics.arp_checks.inc();
            self.inflight.push(InFlight { vip, ifindex: l.ifindex, holder: self.mine[&vip].clone(), sent: now });
        }
        forgot
    }

    /// Findings of a checker (`from`) for VIPs this node holds (`held`, each
    /// since `since`): compared with our MAC there, they become each VIP's ARP
    /// check, the metric and, when a foreign MAC appears or goes, a log line.
    /// Findings for VIPs no longer held here are dropped. Whether a check changed.
    pub fn findings(&mut self, from: &str, findings: Vec<Finding>, held: &Held, since: &BTreeMap<IpAddr, SystemTime>, cx: &mut Ctx) -> bool {
        let now = SystemTime::now();
        let mut changed = false;
        for f in findings {
            let vip = IpAddr::V4(f.vip);
            // Not ours any more, or just taken (see arpcheck::SETTLE).
            if !held.contains_key(&vip) || since.get(&vip).is_some_and(|t| t.elapsed().unwrap_or_default() < arpcheck::SETTLE) {
                continue;
            }
            let Some(mine) = cx.link_of(vip).map(|l| l.mac) else { continue };
            let prev = self.checks.get(&vip);
            let Some(c) = ArpCheck::update(prev, &f, mine, from, now) else {
                warn!(%vip, node = %from, macs = ?f.macs, "ARP self-check: a finding with a malformed MAC, ignored");
                continue;
            };
            let was = prev.map(|p| p.foreign.clone()).unwrap_or_default();
            if !c.foreign.is_empty() && c.foreign != was {
                warn!(%vip, node = %from, foreign = %c.foreign_text(), holder_answered = c.holder_answered, "ARP self-check: another MAC answers ARP for a VIP this node holds (a second responder on the segment, or a switch or proxy answering from a stale cache); clients may be sent there");
            } else if c.foreign.is_empty() && !was.is_empty() {
                info!(%vip, node = %from, "ARP self-check: only this node answers ARP for the VIP again");
            }
            cx.metrics.arp_foreign.with(&metrics::ArpLabels { vip: vip.to_string() }, |g| g.set(c.foreign.len() as i64));
            changed |= prev != Some(&c);
            self.checks.insert(vip, c);
        }
        changed
    }
}

/// This node's IPv4 address on `l`'s network for a request about `vip` (the
/// first on the interface where none contains it; 0.0.0.0, an ARP probe, where
/// the interface has none).
fn source_address(l: &Link, vip: Ipv4Addr) -> Ipv4Addr {
    crate::links::read_host()
        .ok()
        .and_then(|host| {
            let nets = host.into_iter().find(|i| i.ifindex == l.ifindex)?.nets;
            let v4 = || nets.iter().filter_map(|&(a, len)| if let IpAddr::V4(a) = a { Some((a, len)) } else { None });
            v4().find(|&(a, len)| crate::links::contains((a.into(), len), vip.into())).or(v4().next()).map(|(a, _)| a)
        })
        .unwrap_or(Ipv4Addr::UNSPECIFIED)
}

/// The IPv4 VIPs of ARP pools that other nodes hold and `me` checks
/// (`arpcheck::checker`), with their holder: none while `me` is no live member,
/// or where the VIP's pool has no interface here (`placed`).
pub(super) fn checked_here(
    world: &World,
    me: &str,
    live: &BTreeSet<String>,
    owners: &BTreeMap<IpAddr, String>,
    placed: impl Fn(&str) -> bool,
) -> BTreeMap<Ipv4Addr, String> {
    let mut out = BTreeMap::new();
    if !live.contains(me) {
        return out;
    }
    for pool in world.pools.iter().filter(|p| p.announce == AnnounceMode::Arp && placed(&p.name)) {
        let live: Vec<&str> = world.eligible(pool).into_iter().map(|n| n.name.as_str()).filter(|n| live.contains(*n)).collect();
        if !live.contains(&me) || live.len() < 2 {
            continue;
        }
        for v in pool.addresses.iter() {
            let (IpAddr::V4(v4), Some(holder)) = (v, owners.get(v)) else { continue };
            if holder != me && arpcheck::checker(*v4, holder, live.iter().copied()) == Some(me) {
                out.insert(*v4, holder.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    const CFG: &str = r#"
nodes:
  - {name: lb1, address: 198.18.0.11, mac: "02:00:00:00:00:01"}
  - {name: lb2, address: 198.18.0.12, mac: "02:00:00:00:00:02"}
  - {name: lb3, address: 198.18.0.13, mac: "02:00:00:00:00:03"}
pools:
  - {name: arp, addresses: [198.18.1.1-198.18.1.20]}
  - {name: lo, addresses: [198.18.2.1-198.18.2.5], announce: lo}
services:
  - {name: web, vip: 198.18.1.1, ports: [80]}
"#;

    /// Every VIP held by a live node is checked by exactly one other live node,
    /// the one `arpcheck::checker` names; `announce: lo` pools, a pool without an
    /// interface here, and a node that is no live member check nothing.
    #[test]
    fn each_vip_is_checked_by_one_other_live_node() {
        let w = parse(CFG).unwrap();
        let all: BTreeSet<String> = ["lb1", "lb2", "lb3"].map(String::from).into();
        let owners: BTreeMap<IpAddr, String> =
            w.pools.iter().flat_map(|p| p.addresses.iter()).enumerate().map(|(i, v)| (*v, format!("lb{}", i % 3 + 1))).collect();
        let by: Vec<BTreeMap<Ipv4Addr, String>> = ["lb1", "lb2", "lb3"].iter().map(|me| checked_here(&w, me, &all, &owners, |_| true)).collect();
        let arp_vips: Vec<IpAddr> = w.pools[0].addresses.clone();
        for v in &arp_vips {
            let IpAddr::V4(v4) = v else { unreachable!("an IPv4 pool") };
            let checkers: Vec<usize> = (0..3).filter(|i| by[*i].contains_key(v4)).collect();
            assert_eq!(checkers.len(), 1, "{v}: checked by {checkers:?}");
            let me = format!("lb{}", checkers[0] + 1);
            assert_ne!(owners[v], me, "{v}: a holder does not check itself");
            assert_eq!(by[checkers[0]][v4], owners[v], "{v}: the finding goes to its holder");
            assert_eq!(arpcheck::checker(*v4, &owners[v], all.iter().map(String::as_str)), Some(me.as_str()));
        }
        assert_eq!(by.iter().map(BTreeMap::len).sum::<usize>(), arp_vips.len(), "nothing of the lo pool is checked");
        assert!(checked_here(&w, "lb1", &all, &owners, |p| p != "arp").is_empty(), "no interface here for the pool");
        let others: BTreeSet<String> = ["lb2", "lb3"].map(String::from).into();
        assert!(checked_here(&w, "lb1", &others, &owners, |_| true).is_empty(), "no live member");
        let alone: BTreeSet<String> = ["lb1"].map(String::from).into();
        assert!(checked_here(&w, "lb1", &alone, &owners, |_| true).is_empty(), "no peer to check");
    }
}
