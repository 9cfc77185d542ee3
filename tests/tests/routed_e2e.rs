//! Routed networks, in the lab: a pool `announce: lo, distribution: all` puts
//! every VIP on the `lo` of every live eligible node, each node's own BGP speaker
//! (BIRD exporting `lo`, as the seed's Calico does) announces it to an upstream
//! router (FRR, `fib_multipath_hash_policy=1`), and the router spreads a client's
//! flows over every node by ECMP. Checked from the router's RIB and FIB, the
//! frames it sends each node, and the backends that answer; then the headline:
//! long-lived connections while a node leaves and rejoins the ECMP set, against
//! plain ECMP to nodes that serve what reaches them (no rings), in the same run.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::Path,
    sync::Mutex,
    time::Duration,
};

use serde_json::json;
use vip_tests::{
    agent::{agent_bin, wait_for, write_atomic},
    halab::{ask_from, ha_config_of, vip, vip6, HaSpec},
    kubelab::{lb_service, KubeLab},
    netns::privileged,
    routed::{broken, Ingress, RoutedLab, FAR_CLIENT, FAR_CLIENT6},
};

static SERIAL: Mutex<()> = Mutex::new(());

/// Long-lived connections per step: enough that a rehash moves some for sure
/// (plain ECMP breaks about half of them when one of three next hops goes).
const CONNS: u16 = 48;

/// One scenario at a time: the routed lab (None without root).
fn routed(vips: usize, agents: bool, bfd: bool) -> Option<(std::sync::MutexGuard<'static, ()>, RoutedLab)> {
    routed_spec(HaSpec { vips, ..Default::default() }, agents, bfd)
}

fn routed_spec(spec: HaSpec, agents: bool, bfd: bool) -> Option<(std::sync::MutexGuard<'static, ()>, RoutedLab)> {
    let serial = serial()?;
    Some((serial, RoutedLab::start_spec(spec, agents, bfd, lab_exe()).unwrap()))
}

/// One scenario at a time, once the agent is built (None without root).
fn serial() -> Option<std::sync::MutexGuard<'static, ()>> {
    if !privileged() {
        return None;
    }
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    Some(serial)
}

fn lab_exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_vip-lab"))
}

fn hops<L: vip_tests::routed::Lab>(r: &RoutedLab<L>, vips: usize, nodes: &[usize], when: &str) -> Duration {
    r.wait_hops(vips, nodes).unwrap_or_else(|e| panic!("{when}: {e:#}\n{}", r.lab.ha().agent_logs()))
}

/// Dual-stack: each IPv4 VIP has an IPv6 twin in the pool, announced over IPv6
/// sessions of their own.
#[test]
fn every_node_announces_every_vip_and_the_router_spreads_flows_over_all_of_them() {
    let vips = 2;
    let Some((_g, r)) = routed_spec(HaSpec { vips, ipv6: true, ..Default::default() }, true, false) else { return };
    let lab = &r.lab;
    lab.wait_converged(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    lab.wait_rings_full(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let took = hops(&r, vips, &[0, 1, 2], "at start");
    eprintln!("router: every VIP with 3 next hops {took:?} after the agents converged");
    let every: BTreeSet<Ipv4Addr> = (0..vips).map(vip).collect();
    for i in 0..3 {
        assert_eq!(r.on_lo(i).unwrap(), every, "node-{} holds every VIP on lo", i + 1);
    }
    // Flows from one client, by port: the router sends some to each node, and
    // the nodes' shared rings send each to one backend; every backend answers.
    let ingress = Ingress::count(lab, &r.router, "198.18.1.0/24").unwrap();
    let mut backends: BTreeMap<String, usize> = BTreeMap::new();
    for k in 0..vips {
        for p in 0..CONNS {
            let b = ask_from(&r.router.client, FAR_CLIENT.into(), vip(k).into(), 21000 + 100 * k as u16 + p, Duration::from_secs(3))
                .unwrap_or_else(|e| panic!("{} from port {p}: {e:#}\n{}", vip(k), lab.agent_logs()));
            *backends.entry(b).or_default() += 1;
        }
    }
    let mut backends6: BTreeMap<String, usize> = BTreeMap::new();
    for k in 0..vips {
        for p in 0..CONNS {
            let b = ask_from(&r.router.client, FAR_CLIENT6.into(), vip6(k).into(), 23000 + 100 * k as u16 + p, Duration::from_secs(3))
                .unwrap_or_else(|e| panic!("{} from port {p}: {e:#}\n{}", vip6(k), lab.agent_logs()));
            *backends6.entry(b).or_default() += 1;
        }
    }
    assert_eq!(backends6.len(), 3, "IPv6: every backend serves some of {} connections: {backends6:?}", 2 * CONNS);
    let frames = ingress.per_node().unwrap();
    eprintln!("frames from the router per node: {frames:?}; connections per backend: {backends:?}");
    assert!(frames.values().all(|n| *n > 0), "the router's ECMP sends flows to every node: {frames:?}");
    assert_eq!(backends.len(), 3, "every backend serves some of {} connections: {backends:?}", 2 * CONNS);

    // A node the model leaves out (its label gone) holds nothing: off its lo,
    // out of the router's next hops; back in, announced again.
    write_atomic(&lab.config, &ha_config_of(&lab.spec, &[0, 1])).unwrap();
    let took = hops(&r, vips, &[0, 1], "node-3 out of the model");
    assert!(r.on_lo(2).unwrap().is_empty(), "node-3 withdrew every VIP from lo");
    eprintln!("node-3 out of the model: withdrawn from the router in {took:?}");
    write_atomic(&lab.config, &ha_config_of(&lab.spec, &[0, 1, 2])).unwrap();
    hops(&r, vips, &[0, 1, 2], "node-3 back");
    assert_eq!(r.on_lo(2).unwrap(), every);
}

#[test]
fn a_node_leaving_and_rejoining_the_ecmp_set_breaks_no_connection_unlike_plain_ecmp() {
    let Some((_g, mut r)) = routed(1, false, false) else { return };
    let plain = r.plain_churn(22000, CONNS).unwrap_or_else(|e| panic!("plain ECMP: {e:#}"));
    eprintln!("plain ECMP: node-3 leaving broke {:?} of {CONNS} (its own, others'), rejoining {:?} of {CONNS}", plain.leave, plain.join);
    let vip = r.agent_churn(24000, CONNS).unwrap_or_else(|e| panic!("vip: {e:#}\n{}", r.lab.agent_logs()));
    eprintln!("vip: node-3 leaving broke {:?} of {CONNS} (withdrawn {:?} after SIGTERM), rejoining {:?} of {CONNS}", vip.leave, vip.withdrawn, vip.join);
    assert_eq!((vip.leave, vip.join), ((0, 0), (0, 0)), "vip: no connection breaks when a node leaves or rejoins the ECMP set\n{}", r.lab.agent_logs());
    // The baseline moved flows both times, so the zeros above are not for want of a rehash.
    let moved = |(a, b): (usize, usize)| a + b > 0;
    assert!(moved(plain.leave) && moved(plain.join), "plain ECMP broke none at some step ({plain:?}): the router did not rehash");
}

#[test]
fn a_dead_node_is_withdrawn_by_its_session_ending_with_or_without_bfd() {
    for bfd in [false, true] {
        let Some((_g, mut r)) = routed(1, true, bfd) else { return };
        let d = r.node_death(25000, 24).unwrap_or_else(|e| panic!("bfd {bfd}: {e:#}\n{}", r.lab.agent_logs()));
        eprintln!("bfd {bfd}: {d:?}");
        // Once the router has dropped it (and the rings have: its health checks
        // failed long before), every new connection is served.
        assert_eq!(d.failed_after, 0, "bfd {bfd}: new connections failed after the router dropped the dead node: {d:?}");
        assert!(d.attempts > 20, "bfd {bfd}: the load ran: {d:?}");
    }
}

/// Kubernetes mode against the stand-in, the agents as the DaemonSet runs them:
/// a VipPool `announce: lo, distribution: all` and a LoadBalancer Service. The
/// allocated address is on every node's `lo` (the pool's free ones on none), the
/// router has every node as its next hops, connections from behind it reach every
/// backend; then every agent restarts in rollout order (SIGTERM, started again
/// once the router dropped it, the next once it is back): no connection breaks.
#[test]
fn a_vippool_on_every_node_is_routed_to_all_and_a_rollout_breaks_no_connection() {
    let Some(_g) = serial() else { return };
    let kl = KubeLab::start(HaSpec { vips: 3, lo_everywhere: true, ..Default::default() }, lab_exe()).unwrap();
    let mut r = RoutedLab::around(kl, false).unwrap();
    let logs = |r: &RoutedLab<KubeLab>| r.lab.lab.agent_logs();
    let api = &r.lab.api;
    api.insert(
        "vippools.vip.dev",
        json!({
            "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "lab" },
            "spec": { "addresses": [format!("{}-{}", vip(0), vip(2))], "nodeSelector": { "lab": "yes" }, "tableSize": 251,
                      "announce": "lo", "distribution": "all" }
        }),
    )
    .unwrap();
    api.insert("services", lb_service("shop", "web", false)).unwrap();
    let ip = wait_for(Duration::from_secs(20), || {
        api.get("services", Some("shop"), "web")?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
    });
    assert_eq!(ip.unwrap_or_else(|| panic!("no address allocated\n{}", logs(&r))), vip(0).to_string());
    let pool = api.get("vippools.vip.dev", None, "lab").unwrap();
    assert_eq!(pool["spec"]["distribution"], "all", "the API server kept the field: {pool}");
    hops(&r, 1, &[0, 1, 2], "the allocated address");
    for i in 0..3 {
        assert_eq!(r.on_lo(i).unwrap(), BTreeSet::from([vip(0)]), "node-{} holds the allocated address, not the free ones", i + 1);
    }
    // One VipStatus writer, the named owner, though every node holds the VIP:
    // the status names it with its backends, and stays unwritten while nothing
    // changes (each of three writers would rewrite it every MIN_INTERVAL).
    let name = vip_agent::k8s::crd::vip_status_name(vip(0).into());
    let owner = r.lab.lab.owner_seen_by(0, vip(0).into()).expect("an owner");
    let status = wait_for(Duration::from_secs(10), || {
        let o = api.get("vipstatuses.vip.dev", None, &name)?;
        (o["status"]["holder"] == owner.as_str() && o["status"]["backends"].as_array()?.len() == 3).then_some(o)
    });
    let status = status.unwrap_or_else(|| panic!("VipStatus {name} never named the owner {owner}: {:?}", api.get("vipstatuses.vip.dev", None, &name)));
    std::thread::sleep(vip_agent::k8s::vipstatus::MIN_INTERVAL * 2 + Duration::from_millis(500));
    let later = api.get("vipstatuses.vip.dev", None, &name).unwrap();
    assert_eq!(later["metadata"]["resourceVersion"], status["metadata"]["resourceVersion"], "VipStatus {name} rewritten while nothing changed: {later}");
    let mut conns = r.open(vip(0), 26000, CONNS).unwrap();
    let served: BTreeSet<&str> = conns.iter().map(|c| c.backend.as_str()).collect();
    assert_eq!(served.len(), 3, "every backend serves: {served:?}");
    for i in 0..3 {
        r.lab.lab.stop_agent(i, libc::SIGTERM);
        let others: Vec<usize> = (0..3).filter(|j| *j != i).collect();
        hops(&r, 1, &others, "an agent stopped in the rollout");
        r.lab.lab.start_agent(i).unwrap();
        hops(&r, 1, &[0, 1, 2], "the agent back");
        let b = broken(&mut conns, &r.lab.lab.nodes[i].name);
        assert_eq!(b, (0, 0), "node-{}'s restart broke connections\n{}", i + 1, logs(&r));
    }
    assert_eq!(conns.len(), usize::from(CONNS));
}
