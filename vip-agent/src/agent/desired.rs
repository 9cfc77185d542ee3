//! What the data path of one node should hold, computed from the model, the
//! live nodes and the health of backends. Pure: the agent loop diffs its result
//! against what it last wrote and writes only the difference.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::Arc,
};

use crate::{
    dataplane::{BackendSpec, ServiceAddr, ServiceSpec},
    health::Target,
    model::{Candidates, NoHealthyBackend, NoHolder, World},
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredService {
    pub name: String,
    /// Shared by every service-port planned from the same inputs.
    pub spec: Arc<ServiceSpec>,
    /// Every backend's health check is down and the service fails open: its ring
    /// holds them all (`NoHealthyBackend::FailOpen`).
    pub failing_open: bool,
}

/// Who holds which VIP, as this node sees it: decided by the liveness thread
/// from the pools and the live set alone, so that a takeover never waits for
/// ring programming.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ownership {
    /// Owner of every VIP that has one (a live eligible node).
    pub owners: BTreeMap<IpAddr, String>,
    /// The VIPs this node holds (answers ARP or neighbour solicitations for and
    /// balances).
    pub held: BTreeSet<IpAddr>,
    /// Those of `held` announced from `lo` (no ARP answers, no gratuitous ARP).
    pub on_lo: BTreeSet<IpAddr>,
    /// Those of `held` that every live eligible node holds (`distribution: all`):
    /// their owner is only the one the status names; no node takes them over
    /// from another.
    pub everywhere: BTreeSet<IpAddr>,
}

/// The owner of each pool's VIPs among its live eligible nodes, and what `me`
/// holds: the VIPs it owns, and every VIP of a `distribution: all` pool it is a
/// live eligible node of.
pub fn ownership(world: &World, me: &str, live: &BTreeSet<String>) -> Ownership {
    let mut d = Ownership::default();
    for pool in &world.pools {
        let eligible: Vec<String> = world.eligible(pool).into_iter().filter(|n| live.contains(&n.name)).map(|n| n.name.clone()).collect();
        let everywhere = pool.announce.everywhere(pool.distribution) && eligible.iter().any(|n| n == me);
        for (vip, owner) in crate::ha::ownership::assign(&pool.addresses, &eligible) {
            if owner == me || everywhere {
                d.held.insert(vip);
                if pool.announce.on_lo() {
                    d.on_lo.insert(vip);
                }
                if everywhere {
                    d.everywhere.insert(vip);
                }
            }
            d.owners.insert(vip, owner);
        }
    }
    d
}

/// The owner of each VIP among `live` once `me` is gone: who takes what this
/// node holds when it leaves, or held before it came.
pub fn owners_without(world: &World, me: &str, live: &BTreeSet<String>) -> BTreeMap<IpAddr, String> {
    let others: BTreeSet<String> = live.iter().filter(|n| *n != me).cloned().collect();
    ownership(world, me, &others).owners
}

/// The VIPs of every pool that no node holds, with why, as this node can tell:
/// a pool that no node of the model may hold (the node selector and tolerations
/// admit none; nodes excluded from load balancers or not ready are not in the
/// model) is known to every agent; one whose eligible nodes are all dead is said
/// only by a live member (a node cut off sees every peer dead).
pub fn unheld(world: &World, me: &str, live: &BTreeSet<String>, owners: &BTreeMap<IpAddr, String>) -> BTreeMap<IpAddr, NoHolder> {
    let mut out = BTreeMap::new();
    for pool in &world.pools {
        let eligible: Vec<String> = world.eligible(pool).into_iter().map(|n| n.name.clone()).collect();
        let why = if eligible.is_empty() {
            let left_out = world.left_out.iter().map(|(n, r)| (n.clone(), r.clone())).collect();
            NoHolder::NoEligibleNode { pool: pool.name.clone(), nodes: world.nodes.len(), left_out }
        } else if live.contains(me) {
            NoHolder::NoneAlive { pool: pool.name.clone(), eligible }
        } else {
            continue;
        };
        for a in pool.addresses.iter().filter(|a| !owners.contains_key(a)) {
            out.insert(*a, why.clone());
        }
    }
    out
}

/// What the service maps of one node should hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub services: BTreeMap<ServiceAddr, DesiredService>,
    /// Backend candidates left out because their MAC is not known yet.
    pub unresolved: BTreeSet<String>,
}

/// What this node knows besides the model.
pub struct Observed<'a> {
    pub me: &'a str,
    /// Nodes whose agents exchange heartbeats with this one (itself included):
    /// their liveness is known.
    pub tracked: &'a BTreeSet<String>,
    /// Those of `tracked` alive now. A tracked node that is not is in no ring,
    /// health check or not: its agent is gone, and so, most likely, the node...
    pub live: &'a BTreeSet<String>,
    /// ...unless its agent said it was leaving to restart: it stays a backend
    /// (as its health check says) while its next agent starts...
    pub leaving: &'a BTreeSet<String>,
    /// ...or its agent went silent while its node still answers its health
    /// targets (`agent::silent`): crashed, killed or in back-off, not gone.
    pub serving: &'a BTreeSet<String>,
    /// Probe state of each health target; absent = not probed yet = up.
    pub health: &'a BTreeMap<Target, bool>,
    /// Those down because they are joining (see `health::Thresholds`).
    pub joining: &'a BTreeSet<Target>,
    /// MACs of nodes the config leaves without one, as resolved so far.
    pub macs: &'a BTreeMap<String, [u8; 6]>,
}

pub fn desired(world: &World, seen: &Observed) -> Desired {
    let mut d = Desired::default();
    // Services with the same inputs plan the same spec: every Cluster Service of
    // a pool (thousands, over every node) shares one, so planning and the specs'
    // memory grow with the distinct backend sets, not with Services × nodes.
    let mut planned: HashMap<PlanInputs, (Arc<ServiceSpec>, bool)> = HashMap::new();
    let candidates = Candidates::new(world);
    for svc in &world.services {
        let inputs = PlanInputs {
            selector: &svc.backend_selector,
            nodes: svc.backend_nodes.as_ref(),
            health: svc.health.as_ref(),
            table_size: svc.table_size,
            no_healthy_backend: svc.no_healthy_backend,
        };
        let (spec, failing_open) = planned.entry(inputs).or_insert_with(|| plan(&candidates, svc, seen, &mut d.unresolved)).clone();
        for addr in svc.addrs() {
            d.services.insert(addr, DesiredService { name: svc.name.clone(), spec: spec.clone(), failing_open });
        }
    }
    d
}

/// The service-ports of `want` that differ from `applied`: new ones and those
/// whose spec, name or fail-open state changed. Specs are compared once per
/// pair of allocations, not once per port (one changed spec shared by thousands
/// of ports costs one comparison).
pub fn changed<'a>(applied: &BTreeMap<ServiceAddr, DesiredService>, want: &'a BTreeMap<ServiceAddr, DesiredService>) -> Vec<(ServiceAddr, &'a DesiredService)> {
    let mut equal: HashMap<(*const ServiceSpec, *const ServiceSpec), bool> = HashMap::new();
    want.iter()
        .filter(|(a, d)| {
            let Some(old) = applied.get(a) else { return true };
            old.name != d.name
                || old.failing_open != d.failing_open
                || !*equal.entry((Arc::as_ptr(&old.spec), Arc::as_ptr(&d.spec))).or_insert_with(|| old.spec == d.spec)
        })
        .map(|(a, d)| (*a, d))
        .collect()
}

/// What [`plan`] reads of a Service.
#[derive(PartialEq, Eq, Hash)]
struct PlanInputs<'a> {
    selector: &'a crate::model::Selector,
    nodes: Option<&'a BTreeSet<String>>,
    health: Option<&'a crate::model::HealthCheck>,
    table_size: u32,
    no_healthy_backend: NoHealthyBackend,
}

/// The spec of `svc`'s ports and whether it fails open; backends whose MAC is
/// unknown go to `unresolved`.
fn plan(candidates: &Candidates, svc: &crate::model::Service, seen: &Observed, unresolved: &mut BTreeSet<String>) -> (Arc<ServiceSpec>, bool) {
    let (mut backends, mut absent, mut down, mut draining) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut all_joining = true;
    for node in candidates.of(svc) {
        let kept = seen.leaving.contains(&node.name) || seen.serving.contains(&node.name);
        let tracked = seen.tracked.contains(&node.name);
        if tracked && !seen.live.contains(&node.name) && !kept {
            absent.push(node.name.clone());
            continue;
        }
        let (healthy, joining) = match &svc.health {
            Some(check) => {
                let t = Target { node: node.name.clone(), addr: node.addr, check: check.clone() };
                (seen.health.get(&t).copied().unwrap_or(true), seen.joining.contains(&t))
            }
            None => (true, false),
        };
        let local = node.name == seen.me;
        let mac = match node.mac.or_else(|| seen.macs.get(&node.name).copied()) {
            Some(m) => m,
            // Our own frames are passed to the stack, never rewritten: no MAC needed.
            None if local => [0; 6],
            None => {
                unresolved.insert(node.name.clone());
                absent.push(node.name.clone());
                continue;
            }
        };
        let b = BackendSpec { name: node.name.clone(), addr: node.addr, mac, weight: 1, local };
        if healthy {
            backends.push(b);
        } else {
            all_joining &= joining;
            absent.push(b.name.clone());
            // A failed check on a node whose agent runs (or is known to be
            // away, not gone): its established connections may still be
            // served (kube-proxy restarting keeps its rules), so their flows
            // stay; a node that is gone leaves through its heartbeats. A node
            // without an agent has only its check to tell: its flows re-hash.
            if tracked && !joining {
                draining.push(b.clone());
            }
            down.push(b);
        }
    }
    // Every backend's check down: fail open to all of them (the alive ones)
    // unless the service drops instead. Backends that are only joining (a new
    // Service's first endpoints) get its traffic as before, but that is no failure.
    let open = backends.is_empty() && !down.is_empty() && svc.no_healthy_backend == NoHealthyBackend::FailOpen;
    if open {
        absent.retain(|n| !down.iter().any(|b| b.name == *n));
        backends = down;
        draining.clear();
    }
    let failing_open = open && !all_joining;
    (Arc::new(ServiceSpec { backends, table_size: svc.table_size, absent, draining }), failing_open)
}

/// Every (node, check) pair some service needs probed.
pub fn health_targets(world: &World) -> BTreeSet<Target> {
    let candidates = Candidates::new(world);
    // Services with the same candidates and check add the same targets: each
    // such group is expanded once (all Cluster Services of a pool are one).
    let mut groups = std::collections::HashSet::new();
    world
        .services
        .iter()
        .filter_map(|s| s.health.as_ref().map(|h| (s, h)))
        .filter(|(s, h)| groups.insert((&s.backend_selector, s.backend_nodes.as_ref(), *h)))
        .flat_map(|(s, h)| candidates.of(s).into_iter().map(move |n| Target { node: n.name.clone(), addr: n.addr, check: h.clone() }))
        .collect()
}

/// The targets of `world` that take over from another check of the same Service
/// on a node that was serving it in `before` (its check changed: a Service switched
/// to externalTrafficPolicy Local is checked on its healthCheckNodePort, or a pool's
/// check was edited). `up` tells whether a target of `before` is up. Such a target
/// starts up instead of joining: were it joining, the first of the Service's nodes
/// to pass the new check would take its whole ring, and the flows pinned to the
/// others would be evicted, breaking their connections, until they passed too.
pub fn taking_over(before: &World, world: &World, up: impl Fn(&Target) -> bool) -> BTreeSet<Target> {
    let mut out = BTreeSet::new();
    for svc in &world.services {
        let Some(check) = &svc.health else { continue };
        let Some(old) = before.services.iter().find(|o| o.name == svc.name) else { continue };
        if old.health.as_ref() == Some(check) {
            continue;
        }
        let served: BTreeSet<&str> = before
            .backend_candidates(old)
            .into_iter()
            .filter(|n| old.health.as_ref().is_none_or(|c| up(&Target { node: n.name.clone(), addr: n.addr, check: c.clone() })))
            .map(|n| n.name.as_str())
            .collect();
        for n in world.backend_candidates(svc) {
            if served.contains(n.name.as_str()) {
                out.insert(Target { node: n.name.clone(), addr: n.addr, check: check.clone() });
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
  - {name: lb1, address: 198.18.0.1, mac: "02:00:00:00:00:01", labels: {role: lb}}
  - {name: lb2, address: 198.18.0.2, mac: "02:00:00:00:00:02", labels: {role: lb}}
  - {name: b1, address: 198.18.0.11, mac: "02:00:00:00:00:11"}
  - {name: b2, address: 198.18.0.12}
pools:
  - {name: p, addresses: [198.18.1.1-198.18.1.4], nodeSelector: {role: lb}}
services:
  - name: web
    vip: 198.18.1.1
    ports: [80, 8080]
    backendSelector: {}
    healthCheck: {type: tcp, rise: 1, fall: 1}
"#;

    #[test]
    fn a_services_new_check_takes_over_on_the_nodes_that_passed_the_old_one() {
        let before = parse(CFG).unwrap();
        let old = before.services[0].health.clone().unwrap();
        let target =
            |w: &World, node: &str, check: &crate::model::HealthCheck| Target { node: node.into(), addr: w.node(node).unwrap().addr, check: check.clone() };
        // Its check moved to another port (as a Service switched to Local does).
        let after = parse(&CFG.replace("healthCheck: {type: tcp, rise: 1, fall: 1}", "healthCheck: {type: tcp, port: 10256, rise: 1, fall: 1}")).unwrap();
        let new = after.services[0].health.clone().unwrap();
        assert_ne!(old, new);
        // b2 was down on the old check: it joins; the others take over up.
        let up = |t: &Target| t.node != "b2";
        let got = taking_over(&before, &after, up);
        let want: BTreeSet<Target> = ["lb1", "lb2", "b1"].iter().map(|n| target(&after, n, &new)).collect();
        assert_eq!(got, want);
        assert!(got.iter().all(|t| t.check == new), "the new check's targets");
        // The same check, or a Service that is new: nothing takes over.
        assert!(taking_over(&before, &before, |_| true).is_empty());
        let renamed = parse(
            &CFG.replace("name: web", "name: shop")
                .replace("healthCheck: {type: tcp, rise: 1, fall: 1}", "healthCheck: {type: tcp, port: 10256, rise: 1, fall: 1}"),
        )
        .unwrap();
        assert!(taking_over(&before, &renamed, |_| true).is_empty());
        // A Service that had no check: every candidate was serving it.
        let unchecked = parse(&CFG.replace("    healthCheck: {type: tcp, rise: 1, fall: 1}\n", "")).unwrap();
        assert!(unchecked.services[0].health.is_none());
        assert_eq!(taking_over(&unchecked, &after, |_| false).len(), 4);
    }

    #[test]
    fn every_backend_down_fails_open_unless_the_service_drops() {
        let mut w = parse(CFG).unwrap();
        let live: BTreeSet<String> = w.nodes.iter().map(|n| n.name.clone()).collect();
        let tracked: BTreeSet<String> = ["lb1".to_owned(), "lb2".to_owned()].into();
        let macs = [("b2".to_owned(), [2, 0, 0, 0, 0, 0x12])].into();
        let check = w.services[0].health.clone().unwrap();
        let mut health: BTreeMap<Target, bool> = w.nodes.iter().map(|n| (Target { node: n.name.clone(), addr: n.addr, check: check.clone() }, false)).collect();
        // lb2's agent is dead: out in any case.
        let alive: BTreeSet<String> = live.iter().filter(|n| *n != "lb2").cloned().collect();
        let seen = |health: &BTreeMap<Target, bool>| desired(&w, &observed(&tracked, &alive, health, &macs)).services;
        let web = seen(&health).into_values().next().unwrap();
        assert!(web.failing_open);
        assert_eq!(names(&web), ["b1", "b2", "lb1"], "every alive candidate, down as they are");
        assert_eq!(web.spec.absent, ["lb2"]);
        // Down only because they are joining (a new Service's first endpoints):
        // the same backends, and no failure. One truly down among them: failing open.
        let targets: BTreeSet<Target> = health.keys().cloned().collect();
        let joined = |joining: &BTreeSet<Target>| desired(&w, &Observed { joining, ..observed(&tracked, &alive, &health, &macs) }).services;
        let web = joined(&targets).into_values().next().unwrap();
        assert!(!web.failing_open);
        assert_eq!(names(&web), ["b1", "b2", "lb1"]);
        let some: BTreeSet<Target> = targets.iter().filter(|t| t.node != "b1").cloned().collect();
        assert!(joined(&some).into_values().next().unwrap().failing_open);
        // One backend back: only it.
        health.insert(Target { node: "b2".into(), addr: w.node("b2").unwrap().addr, check: check.clone() }, true);
        let web = seen(&health).into_values().next().unwrap();
        assert!(!web.failing_open);
        assert_eq!(names(&web), ["b2"]);
        assert_eq!(web.spec.absent, ["b1", "lb1", "lb2"]);
        // Drop: every backend down means an empty ring.
        health.insert(Target { node: "b2".into(), addr: w.node("b2").unwrap().addr, check }, false);
        w.services[0].no_healthy_backend = NoHealthyBackend::Drop;
        let seen = desired(&w, &observed(&tracked, &alive, &health, &macs)).services;
        let web = seen.into_values().next().unwrap();
        assert!(!web.failing_open && web.spec.backends.is_empty());
        assert_eq!(web.spec.absent, ["b1", "b2", "lb1", "lb2"]);
    }

    /// A failed check takes a backend out of the ring; its flows stay (draining)
    /// while its node's agent runs or is only away, not when the node is gone,
    /// has no agent to tell (only its check speaks for it), is joining, or the
    /// service fails open.
    #[test]
    fn a_failed_check_drains_a_node_whose_agent_runs() {
        let w = parse(CFG).unwrap();
        let live: BTreeSet<String> = w.nodes.iter().map(|n| n.name.clone()).collect();
        let tracked: BTreeSet<String> = ["lb1".to_owned(), "lb2".to_owned()].into();
        let macs = [("b2".to_owned(), [2, 0, 0, 0, 0, 0x12])].into();
        let check = w.services[0].health.clone().unwrap();
        let target = |n: &str| Target { node: n.into(), addr: w.node(n).unwrap().addr, check: check.clone() };
        let health: BTreeMap<Target, bool> = [(target("lb2"), false), (target("b1"), false)].into();
        let web = |o: &Observed| desired(&w, o).services.into_values().next().unwrap();
        let drained = |d: &DesiredService| d.spec.draining.iter().map(|b| b.name.clone()).collect::<Vec<_>>();
        let d = web(&observed(&tracked, &live, &health, &macs));
        assert_eq!(names(&d), ["b2", "lb1"]);
        assert_eq!(d.spec.absent, ["b1", "lb2"]);
        assert_eq!(drained(&d), ["lb2"], "lb2 runs an agent; b1 has only its check");
        // lb2 dead: out, nothing drained; away (left to restart, or silent and
        // serving): drained as when its agent runs.
        let alive: BTreeSet<String> = live.iter().filter(|n| *n != "lb2").cloned().collect();
        assert!(drained(&web(&observed(&tracked, &alive, &health, &macs))).is_empty());
        let lb2: BTreeSet<String> = ["lb2".to_owned()].into();
        assert_eq!(drained(&web(&Observed { serving: &lb2, ..observed(&tracked, &alive, &health, &macs) })), ["lb2"]);
        assert_eq!(drained(&web(&Observed { leaving: &lb2, ..observed(&tracked, &alive, &health, &macs) })), ["lb2"]);
        // Joining: never in the ring, no flows to keep.
        let joining: BTreeSet<Target> = [target("lb2")].into();
        assert!(drained(&web(&Observed { joining: &joining, ..observed(&tracked, &live, &health, &macs) })).is_empty());
        // Every check down: failing open, every one in the ring, none drained.
        let all_down: BTreeMap<Target, bool> = w.nodes.iter().map(|n| (target(&n.name), false)).collect();
        let d = web(&observed(&tracked, &live, &all_down, &macs));
        assert!(d.failing_open && d.spec.draining.is_empty(), "{d:?}");
    }

    #[test]
    fn unheld_vips_say_why() {
        let mut w = parse(CFG).unwrap();
        let all: BTreeSet<String> = w.nodes.iter().map(|n| n.name.clone()).collect();
        let o = ownership(&w, "b1", &all);
        assert!(unheld(&w, "b1", &all, &o.owners).is_empty(), "every VIP has an owner");
        // Both eligible nodes dead, as a live member sees it.
        let only_b1: BTreeSet<String> = ["b1".to_owned()].into();
        let o = ownership(&w, "b1", &only_b1);
        let u = unheld(&w, "b1", &only_b1, &o.owners);
        assert_eq!(u.len(), 4);
        assert_eq!(u[&"198.18.1.1".parse().unwrap()].to_string(), r#"none of VipPool "p"'s eligible nodes (lb1, lb2) is alive: no heartbeats heard"#);
        // A node that is no member cannot tell dead from cut off: it says nothing...
        assert!(unheld(&w, "b1", &BTreeSet::new(), &BTreeMap::new()).is_empty());
        // ...but a pool no node of the model may hold is known to everyone.
        w.nodes.retain(|n| !n.name.starts_with("lb"));
        w.left_out = [("lb1".to_owned(), "labelled node.kubernetes.io/exclude-from-external-load-balancers".to_owned())].into();
        let u = unheld(&w, "b1", &BTreeSet::new(), &BTreeMap::new());
        assert_eq!(u.len(), 4);
        assert_eq!(
            u[&"198.18.1.4".parse().unwrap()].to_string(),
            r#"no node may hold VipPool "p"'s addresses: none of the 2 node(s) in use matches its nodeSelector and tolerations; left out: lb1 (labelled node.kubernetes.io/exclude-from-external-load-balancers)"#
        );
    }

    static NO_NODES: BTreeSet<String> = BTreeSet::new();
    static NO_TARGETS: BTreeSet<Target> = BTreeSet::new();

    /// What lb1 sees: nobody leaving, serving while silent or joining.
    fn observed<'a>(
        tracked: &'a BTreeSet<String>,
        live: &'a BTreeSet<String>,
        health: &'a BTreeMap<Target, bool>,
        macs: &'a BTreeMap<String, [u8; 6]>,
    ) -> Observed<'a> {
        Observed { me: "lb1", tracked, live, leaving: &NO_NODES, serving: &NO_NODES, health, joining: &NO_TARGETS, macs }
    }

    fn names(d: &DesiredService) -> Vec<&str> {
        d.spec.backends.iter().map(|b| b.name.as_str()).collect()
    }

    #[test]
    fn services_with_the_same_inputs_share_one_spec_and_others_get_their_own() {
        let cfg = format!(
            "{CFG}  - {{name: api, vip: 198.18.1.2, ports: [80], backendSelector: {{}}, healthCheck: {{type: tcp, rise: 1, fall: 1}}}}\n  - {{name: lbs, vip: 198.18.1.3, ports: [443], backendSelector: {{role: lb}}, healthCheck: {{type: tcp, rise: 1, fall: 1}}}}\n"
        );
        let w = parse(&cfg).unwrap();
        let live: BTreeSet<String> = w.nodes.iter().map(|n| n.name.clone()).collect();
        let (health, macs) = (BTreeMap::new(), [("b2".to_owned(), [2, 0, 0, 0, 0, 0x12])].into());
        let d = desired(&w, &observed(&live, &live, &health, &macs));
        let spec = |vip: &str, port: u16| d.services[&ServiceAddr { vip: vip.parse().unwrap(), port, protocol: crate::model::Protocol::Tcp }].spec.clone();
        // web's two ports and api: the same selector and check (a tcp check
        // probes the first port, 80 for both), one allocation.
        assert!(Arc::ptr_eq(&spec("198.18.1.1", 80), &spec("198.18.1.1", 8080)));
        assert!(Arc::ptr_eq(&spec("198.18.1.1", 80), &spec("198.18.1.2", 80)));
        // lbs selects other nodes: its own spec, with only them.
        assert!(!Arc::ptr_eq(&spec("198.18.1.1", 80), &spec("198.18.1.3", 443)));
        assert_eq!(spec("198.18.1.3", 443).backends.iter().map(|b| b.name.as_str()).collect::<Vec<_>>(), ["lb1", "lb2"]);
        // Shared or not, each is what planning that Service alone gives, and
        // the targets are those of every Service alone.
        let mut targets = BTreeSet::new();
        for svc in &w.services {
            let alone = World { services: vec![svc.clone()], ..w.clone() };
            let one = desired(&alone, &observed(&live, &live, &health, &macs));
            for (addr, want) in one.services {
                assert_eq!(d.services[&addr], want, "{}", svc.name);
            }
            targets.extend(health_targets(&alone));
        }
        assert_eq!(health_targets(&w), targets);
        assert!(targets.len() > w.nodes.len(), "two checks (ports 80 and 443) over the nodes");
    }

    #[test]
    fn changed_ports_are_new_or_differ_in_spec_name_or_failing_open() {
        let w = parse(CFG).unwrap();
        let live: BTreeSet<String> = w.nodes.iter().map(|n| n.name.clone()).collect();
        let (health, macs) = (BTreeMap::new(), BTreeMap::new());
        let before = desired(&w, &observed(&live, &live, &health, &macs)).services;
        // Planned again: other allocations with equal content are no change.
        let again = desired(&w, &observed(&live, &live, &health, &macs)).services;
        assert!(!Arc::ptr_eq(&before.values().next().unwrap().spec, &again.values().next().unwrap().spec));
        assert!(changed(&before, &again).is_empty());
        assert_eq!(changed(&BTreeMap::new(), &again).len(), 2, "new ports");
        // b1 dead (tracked, not live): both ports' shared spec changed.
        let fewer: BTreeSet<String> = live.iter().filter(|n| *n != "b1").cloned().collect();
        let after = desired(&w, &observed(&live, &fewer, &health, &macs)).services;
        assert_eq!(changed(&before, &after).len(), 2);
        let mut renamed = again.clone();
        renamed.values_mut().next().unwrap().name = "other".into();
        assert_eq!(changed(&before, &renamed).len(), 1);
    }

    #[test]
    fn spreads_ownership_and_filters_backends() {
        let w = parse(CFG).unwrap();
        let live: BTreeSet<String> = w.nodes.iter().map(|n| n.name.clone()).collect();
        let mut health = BTreeMap::new();
        let macs = BTreeMap::new();
        let tracked: BTreeSet<String> = ["lb1".to_owned(), "lb2".to_owned()].into();
        let o = ownership(&w, "lb1", &live);
        assert_eq!(o.owners.len(), 4);
        assert_eq!(o.owners.values().filter(|o| *o == "lb1").count(), 2, "4 VIPs over 2 eligible nodes");
        assert!(o.owners.values().all(|o| o == "lb1" || o == "lb2"), "only eligible nodes own");
        assert_eq!(o.held, o.owners.iter().filter(|(_, o)| *o == "lb1").map(|(v, _)| *v).collect());
        let d = desired(&w, &observed(&tracked, &live, &health, &macs));
        assert_eq!(d.services.len(), 2, "one per port");
        let web = d.services.values().next().unwrap();
        assert_eq!(names(web), ["b1", "lb1", "lb2"], "b2 has no MAC yet");
        assert!(web.spec.backends.iter().find(|b| b.name == "lb1").unwrap().local);
        assert_eq!(d.unresolved, ["b2".to_owned()].into());

        // b2 resolved, b1 down: b1 leaves, b2 joins.
        let macs = [("b2".to_owned(), [2, 0, 0, 0, 0, 0x12])].into();
        let check = w.services[0].health.clone().unwrap();
        health.insert(Target { node: "b1".into(), addr: "198.18.0.11".parse().unwrap(), check }, false);
        let d = desired(&w, &observed(&tracked, &live, &health, &macs));
        assert_eq!(names(d.services.values().next().unwrap()), ["b2", "lb1", "lb2"]);

        // lb2 dead: lb1 owns every VIP, and lb2 (tracked by heartbeats, no health
        // check needed) leaves the rings; b2 (not tracked) stays.
        let live: BTreeSet<String> = live.into_iter().filter(|n| n != "lb2").collect();
        assert_eq!(ownership(&w, "lb1", &live).held.len(), 4);
        let d = desired(&w, &observed(&tracked, &live, &health, &macs));
        assert_eq!(names(d.services.values().next().unwrap()), ["b2", "lb1"]);
        assert_eq!(health_targets(&w).len(), 4, "every candidate of the checked service");

        // lb2's agent left to restart: lb1 still owns every VIP, lb2 stays a
        // backend, unless its health check fails.
        // So does a silent one whose node still answers its health targets
        // (crashed, killed, in back-off): the same two cases.
        let lb2: BTreeSet<String> = ["lb2".to_owned()].into();
        let none = BTreeSet::new();
        for (leaving, serving) in [(&lb2, &none), (&none, &lb2)] {
            let mut health = health.clone();
            let seen = |health: &BTreeMap<Target, bool>| -> Vec<String> {
                let o = Observed { leaving, serving, ..observed(&tracked, &live, health, &macs) };
                names(desired(&w, &o).services.values().next().unwrap()).into_iter().map(str::to_owned).collect()
            };
            assert_eq!(seen(&health), ["b2", "lb1", "lb2"], "leaving {leaving:?}, serving {serving:?}");
            let check = w.services[0].health.clone().unwrap();
            health.insert(Target { node: "lb2".into(), addr: w.node("lb2").unwrap().addr, check }, false);
            assert_eq!(seen(&health), ["b2", "lb1"], "leaving {leaving:?}, serving {serving:?}, its check down");
        }
    }
}
