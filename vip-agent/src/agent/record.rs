//! How each ownership decision of the liveness thread shows in the metrics:
//! owners, held VIPs, pools' held and unowned VIPs, owner changes, peers' liveness.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Instant,
};

use super::desired::Ownership;
use crate::ha::heartbeat::PeerLabels;
use crate::metrics::{HeldLabels, LivenessMetrics, PoolLabels, VipLabels};

/// What the liveness thread knows of the membership when it decides.
pub struct Members<'a> {
    pub me: &'a str,
    /// This node and the peers it exchanges heartbeats with.
    pub tracked: &'a BTreeSet<String>,
    pub live: &'a BTreeSet<String>,
}

impl LivenessMetrics {
    /// Records a new ownership decision (`before`: the owners of the last one).
    pub fn record(&self, world: &crate::model::World, before: &BTreeMap<std::net::IpAddr, String>, o: &Ownership, m: &Members) {
        self.vip_owner.set_all(o.owners.iter().map(|(vip, owner)| (VipLabels { vip: vip.to_string(), node: owner.clone() }, 1)));
        self.vips_held.set(o.held.len() as i64);
        self.vip_held.set_all(o.held.iter().filter_map(|v| Some((HeldLabels { vip: v.to_string(), pool: world.pool_of(*v)?.name.clone() }, 1))));
        self.pool_held
            .set_all(world.pools.iter().map(|p| (PoolLabels { pool: p.name.clone() }, p.addresses.iter().filter(|a| o.held.contains(a)).count() as i64)));
        // A node that is no member (not in the model, its link down) sees no owner
        // anywhere: its view says nothing about the pools, except those no node of
        // the model may hold (every agent knows those are unowned).
        let member = m.live.contains(m.me);
        self.pool_unowned.set_all(
            world
                .pools
                .iter()
                .filter(|p| member || world.eligible(p).is_empty())
                .map(|p| (PoolLabels { pool: p.name.clone() }, p.addresses.iter().filter(|a| !o.owners.contains_key(a)).count() as i64)),
        );
        for pool in &world.pools {
            let moved = pool.addresses.iter().filter(|a| matches!((before.get(a), o.owners.get(a)), (Some(x), Some(y)) if x != y)).count();
            self.pool_owner_changes.with(&PoolLabels { pool: pool.name.clone() }, |c| c.inc_by(moved as u64));
        }
        let pools: BTreeSet<&str> = world.pools.iter().map(|p| p.name.as_str()).collect();
        self.pool_owner_changes.retain(|l| pools.contains(l.pool.as_str()));
        let peers = || m.tracked.iter().filter(|n| *n != m.me);
        self.peer_live.set_all(peers().map(|n| (PeerLabels { peer: n.clone() }, m.live.contains(n) as i64)));
        self.heartbeat.gaps.track(peers().map(String::as_str), Instant::now());
        self.dead_after.set(world.failover.dead_after.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        agent::desired::ownership,
        config::parse,
        metrics::{
            testing::{scrape, series},
            Metrics, Mode,
        },
    };

    const CFG: &str = r#"
nodes:
  - {name: lb1, address: 198.18.0.1, mac: "02:00:00:00:00:01"}
  - {name: lb2, address: 198.18.0.2, mac: "02:00:00:00:00:02"}
pools:
  - {name: a, addresses: [198.18.1.1-198.18.1.2]}
  - {name: b, addresses: [198.18.2.1]}
services: []
"#;

    #[test]
    fn series_of_pools_vips_and_peers_that_went_are_removed() {
        let m = Metrics::new(Mode::File);
        let l = &m.liveness;
        let both = parse(CFG).unwrap();
        let live: BTreeSet<String> = ["lb1".to_owned(), "lb2".to_owned()].into();
        let o = ownership(&both, "lb1", &live);
        l.record(&both, &BTreeMap::new(), &o, &Members { me: "lb1", tracked: &live, live: &live });
        let t = scrape(&m.registry);
        assert_eq!(series(&t, "vip_owner").len(), 3, "{t}");
        assert_eq!(series(&t, "vip_pool_owner_changes_total"), [r#"pool="a""#, r#"pool="b""#], "{t}");
        assert_eq!(series(&t, "vip_peer_live"), [r#"peer="lb2""#], "{t}");
        assert!(t.contains(r#"vip_peer_live{peer="lb2"} 1"#), "{t}");
        let held = o.held.len();
        assert!(held > 0 && series(&t, "vip_held").len() == held, "{t}");
        assert!(t.contains(r#"vip_pool_vips_unowned{pool="a"} 0"#), "{t}");

        // Pool b goes, lb2 dies: every VIP left is lb1's, one owner change counted
        // for each that lb2 held; b's series go, lb2 stays a peer (dead).
        let one = parse(&CFG.replace("  - {name: b, addresses: [198.18.2.1]}\n", "")).unwrap();
        let me: BTreeSet<String> = ["lb1".to_owned()].into();
        let o2 = ownership(&one, "lb1", &me);
        l.record(&one, &o.owners, &o2, &Members { me: "lb1", tracked: &live, live: &me });
        let t = scrape(&m.registry);
        assert_eq!(series(&t, "vip_owner"), [r#"vip="198.18.1.1",node="lb1""#, r#"vip="198.18.1.2",node="lb1""#], "{t}");
        let moved_a = o.owners.iter().filter(|(v, n)| one.pool_of(**v).is_some() && *n == "lb2").count();
        assert!(t.contains(&format!(r#"vip_pool_owner_changes_total{{pool="a"}} {moved_a}"#)), "{t}");
        assert_eq!(series(&t, "vip_pool_owner_changes_total"), [r#"pool="a""#], "{t}");
        assert_eq!(series(&t, "vip_pool_vips_held"), [r#"pool="a""#], "{t}");
        assert!(t.contains(r#"vip_peer_live{peer="lb2"} 0"#), "{t}");
        assert!(series(&t, "vip_held").iter().all(|s| s.ends_with(r#"pool="a""#)) && series(&t, "vip_held").len() == 2, "{t}");

        // lb2 leaves the model: no longer a peer, nor a series (of liveness or gaps).
        let alone = parse(&CFG.replace("  - {name: lb2, address: 198.18.0.2, mac: \"02:00:00:00:00:02\"}\n", "")).unwrap();
        l.record(&alone, &o2.owners, &ownership(&alone, "lb1", &me), &Members { me: "lb1", tracked: &me, live: &me });
        let t = scrape(&m.registry);
        assert!(series(&t, "vip_peer_live").is_empty() && series(&t, "vip_heartbeat_gap_max_seconds").is_empty(), "{t}");
    }

    #[test]
    fn a_node_that_is_no_member_says_only_what_the_model_tells_of_unowned_vips() {
        let m = Metrics::new(Mode::Kubernetes);
        let w = parse(CFG).unwrap();
        let none = BTreeSet::new();
        let tracked: BTreeSet<String> = ["lb1".to_owned()].into();
        m.liveness.record(&w, &BTreeMap::new(), &ownership(&w, "lb1", &none), &Members { me: "lb1", tracked: &tracked, live: &none });
        assert!(series(&scrape(&m.registry), "vip_pool_vips_unowned").is_empty());
        // A member whose pools have no eligible live node: all of them unowned.
        let only_me: BTreeSet<String> = ["lb1".to_owned()].into();
        let w2 = parse(&CFG.replace("[198.18.2.1]}", "[198.18.2.1], nodeSelector: {role: none}}")).unwrap();
        m.liveness.record(&w2, &BTreeMap::new(), &ownership(&w2, "lb1", &only_me), &Members { me: "lb1", tracked: &tracked, live: &only_me });
        let t = scrape(&m.registry);
        assert!(t.contains(r#"vip_pool_vips_unowned{pool="b"} 1"#) && t.contains(r#"vip_pool_vips_unowned{pool="a"} 0"#), "{t}");
        // No member (excluded itself, say), but pool b admits no node of the model:
        // every agent knows b's VIPs are unowned, and says so.
        m.liveness.record(&w2, &BTreeMap::new(), &ownership(&w2, "lb1", &none), &Members { me: "lb1", tracked: &tracked, live: &none });
        let t = scrape(&m.registry);
        assert_eq!(series(&t, "vip_pool_vips_unowned"), [r#"pool="b""#], "{t}");
        assert!(t.contains(r#"vip_pool_vips_unowned{pool="b"} 1"#), "{t}");
    }
}
