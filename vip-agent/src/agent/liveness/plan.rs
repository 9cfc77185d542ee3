//! The liveness decision, pure: from the model, the live set, where each pool
//! lives here and what `arp_held` holds now, what this node holds, releases and
//! announces. The thread ([`super::Liveness`]) applies a [`Plan`]: map writes,
//! ARP orders, logs, metrics. Kept free of all that so that the unit tests below
//! and the model check (`model_check.rs`) run the very decision the agent runs.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::{
    agent::desired::{ownership, Ownership},
    dataplane::{HeldEntry, HeldMode},
    model::World,
};

/// What `arp_held` holds for this node: VIP → how it is announced, and the
/// ifindex it is held under.
pub type Held = BTreeMap<IpAddr, (HeldMode, u32)>;

/// One decision: the changes that take `arp_held` from what it holds to `want`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The owner of every VIP; `held` without the unplaced VIPs.
    pub ownership: Ownership,
    /// VIPs this node owns whose pool has no interface here: they cannot be
    /// answered, so they are not held (the host problems say why).
    pub unplaced: BTreeSet<IpAddr>,
    /// What `arp_held` holds once the plan is applied.
    pub want: Held,
    /// Entries written fresh: newly owned, or announced or placed differently.
    pub take: BTreeSet<IpAddr>,
    /// Entries released (VIP, ifindex): no longer owned, or now held under
    /// another interface. Released before `take` is written.
    pub release: Vec<(IpAddr, u32)>,
    /// Released VIPs no longer held at all: their pending announcements are cancelled.
    pub cancel: BTreeSet<IpAddr>,
    /// VIPs announced as a takeover (each pool's count of gratuitous ARP):
    /// those taken, or every held one on a reassert.
    pub announce: BTreeSet<IpAddr>,
}

/// The decision. `placed` gives the ifindex a VIP's pool is answered on here
/// (None: the pool has no interface here). `reassert`: membership changed, so
/// every held VIP is announced again (while the segment was split, others may
/// have taken ours and moved clients).
pub fn plan(world: &World, me: &str, live: &BTreeSet<String>, placed: impl Fn(IpAddr) -> Option<u32>, held: &Held, reassert: bool) -> Plan {
    let mut ownership = ownership(world, me, live);
    let unplaced: BTreeSet<IpAddr> = ownership.held.iter().filter(|v| placed(**v).is_none()).copied().collect();
    ownership.held.retain(|v| !unplaced.contains(v));
    let want: Held = ownership
        .held
        .iter()
        .filter_map(|v| {
            let announce = if ownership.on_lo.contains(v) { HeldMode::Lo } else { HeldMode::Arp };
            Some((*v, (announce, placed(*v)?)))
        })
        .collect();
    let take: BTreeSet<IpAddr> = want.iter().filter(|(v, a)| held.get(v) != Some(a)).map(|(v, _)| *v).collect();
    let release: Vec<(IpAddr, u32)> = held.iter().filter(|(v, (_, i))| want.get(v).is_none_or(|(_, wi)| wi != i)).map(|(v, (_, i))| (*v, *i)).collect();
    let cancel: BTreeSet<IpAddr> = release.iter().map(|(v, _)| *v).filter(|v| !want.contains_key(v)).collect();
    let announce = if reassert { want.keys().copied().collect() } else { take.clone() };
    Plan { ownership, unplaced, want, take, release, cancel, announce }
}

/// The `arp_held` entries to remove entirely: VIPs in no pool (also those left
/// from before a restart), and released entries under an interface their VIP
/// no longer lives on.
pub fn forget(world: &World, placed: impl Fn(IpAddr) -> Option<u32>, entries: &[HeldEntry]) -> Vec<HeldEntry> {
    entries
        .iter()
        .filter(|e| match world.pool_of(e.vip) {
            None => true,
            Some(_) => placed(e.vip).is_some_and(|i| i != e.ifindex) && e.deadline_ns == 0,
        })
        .copied()
        .collect()
}

/// `held` with `p` applied the way the thread writes it: `release` removed,
/// then `take` written. Equal to `p.want` for every plan (checked below and in
/// the model check, which keeps its nodes' `arp_held` this way).
pub fn applied(held: &Held, p: &Plan) -> Held {
    let mut out = held.clone();
    for (v, i) in &p.release {
        if out.get(v).is_some_and(|(_, hi)| hi == i) {
            out.remove(v);
        }
    }
    for v in &p.take {
        out.insert(*v, p.want[v]);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::model::{AnnounceMode, Distribution, Node, Pool};

    fn node(name: &str, i: u8) -> Node {
        Node { name: name.into(), addr: Ipv4Addr::new(198, 18, 0, 10 + i).into(), mac: None, labels: BTreeMap::new(), taints: vec![] }
    }

    fn pool(name: &str, first: u8, n: u8, announce: AnnounceMode) -> Pool {
        Pool {
            name: name.into(),
            addresses: (first..first + n).map(|k| IpAddr::from(Ipv4Addr::new(198, 19, 0, k))).collect(),
            node_selector: BTreeMap::new(),
            tolerations: vec![],
            announce,
            distribution: Distribution::One,
            garp: None,
            interfaces: vec![],
            vlan: None,
            bgp: Default::default(),
        }
    }

    fn world(nodes: &[&str], pools: Vec<Pool>) -> World {
        World { nodes: nodes.iter().enumerate().map(|(i, n)| node(n, i as u8)).collect(), pools, ..World::default() }
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn everywhere(_: IpAddr) -> Option<u32> {
        Some(7)
    }

    /// Checks what every plan must satisfy, then returns it.
    fn checked(w: &World, me: &str, live: &BTreeSet<String>, placed: impl Fn(IpAddr) -> Option<u32> + Copy, held: &Held, reassert: bool) -> Plan {
        let p = plan(w, me, live, placed, held, reassert);
        assert_eq!(applied(held, &p), p.want, "applying the plan to {held:?} gives what it wants");
        assert!(p.take.iter().all(|v| p.announce.contains(v)), "every VIP taken is announced");
        assert!(p.cancel.iter().all(|v| !p.want.contains_key(v)), "a VIP still held is not cancelled");
        assert!(
            p.want.keys().all(|v| p.ownership.owners.get(v).map(String::as_str) == Some(me) || p.ownership.everywhere.contains(v)),
            "only owned VIPs, and those every node holds, are held"
        );
        assert!(p.ownership.everywhere.is_subset(&p.ownership.on_lo), "only VIPs on lo are held everywhere");
        p
    }

    #[test]
    fn a_lone_live_node_takes_every_vip_and_announces_each_as_a_takeover() {
        let w = world(&["a", "b"], vec![pool("p", 1, 4, AnnounceMode::Arp)]);
        let p = checked(&w, "a", &set(&["a"]), everywhere, &Held::new(), false);
        assert_eq!(p.want.len(), 4);
        assert!(p.want.values().all(|a| *a == (HeldMode::Arp, 7)));
        assert_eq!(p.take, p.want.keys().copied().collect());
        assert_eq!(p.announce, p.take);
        assert!(p.release.is_empty() && p.cancel.is_empty());
    }

    #[test]
    fn a_peer_coming_back_takes_its_share_and_the_rest_stays_unannounced() {
        let w = world(&["a", "b"], vec![pool("p", 1, 8, AnnounceMode::Arp)]);
        let alone = checked(&w, "a", &set(&["a"]), everywhere, &Held::new(), false);
        let both = checked(&w, "a", &set(&["a", "b"]), everywhere, &alone.want, false);
        let theirs: BTreeSet<IpAddr> = both.ownership.owners.iter().filter(|(_, o)| *o == "b").map(|(v, _)| *v).collect();
        assert!(!theirs.is_empty(), "b owns some of 8 VIPs");
        assert_eq!(both.release.iter().map(|(v, _)| *v).collect::<BTreeSet<_>>(), theirs);
        assert_eq!(both.cancel, theirs);
        assert!(both.take.is_empty() && both.announce.is_empty(), "VIPs kept are neither re-written nor re-announced");
        // Membership changed: every VIP kept is announced again.
        let reasserted = checked(&w, "a", &set(&["a", "b"]), everywhere, &alone.want, true);
        assert_eq!(reasserted.announce, reasserted.want.keys().copied().collect());
        assert!(reasserted.take.is_empty());
    }

    #[test]
    fn a_vip_whose_pool_moves_interface_is_released_there_and_taken_here_without_a_cancel() {
        let w = world(&["a"], vec![pool("p", 1, 2, AnnounceMode::Arp)]);
        let before = checked(&w, "a", &set(&["a"]), |_| Some(3), &Held::new(), false);
        let after = checked(&w, "a", &set(&["a"]), |_| Some(4), &before.want, false);
        assert_eq!(after.release.len(), 2);
        assert!(after.release.iter().all(|(_, i)| *i == 3));
        assert!(after.cancel.is_empty(), "still held, under ifindex 4: its announcements go on");
        assert_eq!(after.take.len(), 2);
    }

    #[test]
    fn an_owned_vip_whose_pool_has_no_interface_here_is_not_held() {
        let w = world(&["a"], vec![pool("here", 1, 2, AnnounceMode::Arp), pool("elsewhere", 10, 2, AnnounceMode::Arp)]);
        let here: BTreeSet<IpAddr> = w.pools[0].addresses.iter().copied().collect();
        let p = checked(&w, "a", &set(&["a"]), |v| here.contains(&v).then_some(1), &Held::new(), false);
        assert_eq!(p.unplaced, w.pools[1].addresses.iter().copied().collect());
        assert_eq!(p.want.keys().copied().collect::<BTreeSet<_>>(), here);
        assert_eq!(p.ownership.owners.len(), 4, "the unplaced VIPs are still owned by this node: no peer answers them either");
    }

    #[test]
    fn lo_pools_are_held_for_the_loopback_task_and_a_mode_change_rewrites_them() {
        let mut w = world(&["a"], vec![pool("p", 1, 1, AnnounceMode::Lo)]);
        let lo = checked(&w, "a", &set(&["a"]), everywhere, &Held::new(), false);
        assert_eq!(lo.ownership.on_lo.len(), 1);
        assert!(lo.want.values().all(|(a, _)| *a == HeldMode::Lo));
        w.pools[0].announce = AnnounceMode::Arp;
        let arp = checked(&w, "a", &set(&["a"]), everywhere, &lo.want, false);
        assert_eq!(arp.take.len(), 1, "the entry is written again with its new announcement");
        assert!(arp.release.is_empty() && arp.cancel.is_empty());
    }

    #[test]
    fn a_distribution_all_pool_is_held_on_lo_by_every_live_eligible_node_and_released_by_the_dead() {
        let mut w = world(&["a", "b", "c"], vec![pool("p", 1, 4, AnnounceMode::Lo), pool("one", 20, 4, AnnounceMode::Lo)]);
        w.pools[0].distribution = Distribution::All;
        // c is not eligible for "p": it holds none of its VIPs.
        w.pools[0].node_selector = [("ecmp".to_owned(), "yes".to_owned())].into();
        for n in &mut w.nodes[..2] {
            n.labels.insert("ecmp".into(), "yes".into());
        }
        let spread: BTreeSet<IpAddr> = w.pools[0].addresses.iter().copied().collect();
        let all = set(&["a", "b", "c"]);
        let [a, b, c] = ["a", "b", "c"].map(|me| checked(&w, me, &all, everywhere, &Held::new(), false));
        for p in [&a, &b] {
            assert!(p.want.keys().copied().collect::<BTreeSet<_>>().is_superset(&spread), "every eligible node holds every VIP of the pool");
            assert_eq!(p.ownership.everywhere, spread);
            assert!(spread.iter().all(|v| p.want[v].0 == HeldMode::Lo));
        }
        assert!(c.want.keys().all(|v| !spread.contains(v)) && c.ownership.everywhere.is_empty(), "an ineligible node holds none");
        // The other pool keeps one holder per VIP.
        let one: BTreeSet<IpAddr> = w.pools[1].addresses.iter().copied().collect();
        let holders = |v: &IpAddr| [&a, &b, &c].iter().filter(|p| p.want.contains_key(v)).count();
        assert!(one.iter().all(|v| holders(v) == 1), "distribution: one stays one holder per VIP");
        // Every node names the same owner for status, an eligible one.
        assert!(spread.iter().all(|v| a.ownership.owners[v] == b.ownership.owners[v] && ["a", "b"].contains(&a.ownership.owners[v].as_str())));
        // b dies: a still holds every VIP (nothing to take over), b's own plan releases them.
        let without_b = checked(&w, "a", &set(&["a", "c"]), everywhere, &a.want, false);
        assert!(spread.iter().all(|v| without_b.want.contains_key(v) && !without_b.take.contains(v)), "the VIPs stay held, not taken again");
        let b_cut_off = checked(&w, "b", &BTreeSet::new(), everywhere, &b.want, false);
        assert!(spread.is_subset(&b_cut_off.cancel), "a node that is not live holds none");
    }

    #[test]
    fn a_node_not_live_holds_nothing_and_releases_what_it_held() {
        let w = world(&["a", "b"], vec![pool("p", 1, 3, AnnounceMode::Arp)]);
        let held = checked(&w, "a", &set(&["a"]), everywhere, &Held::new(), false).want;
        let p = checked(&w, "a", &BTreeSet::new(), everywhere, &held, false);
        assert!(p.want.is_empty() && p.take.is_empty());
        assert_eq!(p.cancel, held.keys().copied().collect());
    }

    #[test]
    fn entries_in_no_pool_and_stale_entries_on_a_former_interface_are_forgotten() {
        let w = world(&["a"], vec![pool("p", 1, 2, AnnounceMode::Arp)]);
        let [v1, v2] = [w.pools[0].addresses[0], w.pools[0].addresses[1]];
        let stray = IpAddr::from(Ipv4Addr::new(198, 19, 9, 9));
        let entries = [
            HeldEntry { vip: stray, ifindex: 3, deadline_ns: 5, announce: HeldMode::Arp },
            HeldEntry { vip: v1, ifindex: 3, deadline_ns: 0, announce: HeldMode::Arp },
            HeldEntry { vip: v1, ifindex: 4, deadline_ns: 5, announce: HeldMode::Arp },
            HeldEntry { vip: v2, ifindex: 3, deadline_ns: 5, announce: HeldMode::Arp },
        ];
        let gone = forget(&w, |_| Some(4), &entries);
        // v2 under 3 is still fresh: released first (by a plan), forgotten at the next pass.
        assert_eq!(gone, entries[..2]);
    }
}
