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
    net::{IpAddr, Ipv4Addr},
    path::Path,
    sync::Mutex,
    time::Duration,
};

use serde_json::json;
use vip_tests::{
    agent::{agent_bin, wait_for, write_atomic},
    halab::{ask_from, ha_config_of, node_addr6, vip, vip6, HaSpec},
    kubelab::{lb_service, KubeLab},
    netns::privileged,
    routed::{broken, Frr, Ingress, RoutedLab, Speaker, COMMUNITY, FAR_CLIENT, FAR_CLIENT6, ROUTER, ROUTER6, ROUTE_WAIT},
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
    drop(r);
    // The same with `announce: bgp`: node-3's agent withdraws through its FRR.
    let mut b = RoutedLab::start_bgp(HaSpec { vips: 1, ..Default::default() }, false, false, lab_exe()).unwrap();
    let bgp = b.agent_churn(24000, CONNS).unwrap_or_else(|e| panic!("announce: bgp: {e:#}\n{}", b.lab.agent_logs()));
    eprintln!(
        "announce: bgp: node-3 leaving broke {:?} of {CONNS} (withdrawn {:?} after SIGTERM), rejoining {:?} of {CONNS}",
        bgp.leave, bgp.withdrawn, bgp.join
    );
    assert_eq!(
        (bgp.leave, bgp.join),
        ((0, 0), (0, 0)),
        "announce: bgp: no connection breaks when a node leaves or rejoins the ECMP set\n{}",
        b.lab.agent_logs()
    );
}

/// BIRD on the nodes (`announce: lo`) with and without BFD, then the agents'
/// own FRR (`announce: bgp`) with BFD and without.
#[test]
fn a_dead_node_is_withdrawn_by_its_session_ending_with_or_without_bfd() {
    for (bgp, bfd) in [(false, false), (false, true), (true, true), (true, false)] {
        let Some(_g) = serial() else { return };
        let spec = HaSpec { vips: 1, ..Default::default() };
        let mut r = if bgp { RoutedLab::start_bgp(spec, true, bfd, lab_exe()) } else { RoutedLab::start_spec(spec, true, bfd, lab_exe()) }.unwrap();
        let d = r.node_death(25000, 24).unwrap_or_else(|e| panic!("bgp {bgp}, bfd {bfd}: {e:#}\n{}", r.lab.agent_logs()));
        eprintln!("bgp {bgp}, bfd {bfd}: {d:?}");
        // Once the router has dropped it (and the rings have: its health checks
        // failed long before), every new connection is served.
        assert_eq!(d.failed_after, 0, "bgp {bgp}, bfd {bfd}: new connections failed after the router dropped the dead node: {d:?}");
        assert!(d.attempts > 20, "bgp {bgp}, bfd {bfd}: the load ran: {d:?}");
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

/// `announce: bgp`, dual-stack: each node's agent drives an FRR of its own
/// (rendered from the file's `bgp` section, applied by `frr-reload.py`), which
/// peers with the router over IPv4 and IPv6. Every node is a next hop of every
/// VIP with the pool's community, and connections from behind the router reach
/// every backend. Then what an agent does resets no session: a VIP leaving and
/// rejoining the pool, a node leaving the model (only its own sessions close),
/// an agent SIGKILLed and started again (FRR keeps its routes meanwhile, no
/// connection breaks), an agent stopped with SIGTERM (it withdraws its routes
/// while its sessions stay up; no connection breaks) and started again.
#[test]
fn a_bgp_pool_is_announced_by_every_agents_frr_and_nothing_an_agent_does_resets_a_session() {
    let vips = 2;
    let Some(_g) = serial() else { return };
    let spec = HaSpec { vips, ipv6: true, ..Default::default() };
    let mut r = RoutedLab::start_bgp(spec, true, false, lab_exe()).unwrap();
    let logs = |r: &RoutedLab| format!("{}\nrouter: {}", r.lab.agent_logs(), r.router.vtysh("show bgp summary").unwrap_or_default());
    r.lab.wait_converged(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&r)));
    r.lab.wait_rings_full(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&r)));
    let took = hops(&r, vips, &[0, 1, 2], "at start");
    eprintln!("router: every VIP with 3 next hops {took:?} after the agents converged");
    let every: BTreeSet<Ipv4Addr> = (0..vips).map(vip).collect();
    for i in 0..3 {
        assert_eq!(r.on_lo(i).unwrap(), every, "node-{} holds every VIP on lo", i + 1);
    }
    for k in 0..vips {
        for v in [IpAddr::from(vip(k)), vip6(k).into()] {
            assert_eq!(r.router.communities(v).unwrap(), BTreeSet::from([COMMUNITY.to_owned()]), "the pool's community on {v}");
        }
    }
    // Two sessions a node (IPv4 and IPv6), each established once.
    let established = r.router.wait_sessions(6).unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&r)));
    assert!(established.values().all(|n| *n == 1), "each session established once: {established:?}");
    // Each agent reads its sessions back into its metrics.
    for i in 0..3 {
        let want = [
            format!("vip_bgp_session_up{{peer=\"{ROUTER}\"}} 1"),
            format!("vip_bgp_session_up{{peer=\"{ROUTER6}\"}} 1"),
            format!("vip_bgp_routes {}", 2 * vips),
        ];
        let seen = wait_for(Duration::from_secs(15), || {
            let m = r.lab.metrics(i);
            want.iter().all(|w| m.contains(w.as_str())).then_some(())
        });
        assert!(seen.is_some(), "node-{}'s metrics lack {want:?}:\n{}", i + 1, r.lab.metrics(i));
        // And into its status (what `vip-agent inspect` shows).
        let bgp = wait_for(Duration::from_secs(10), || {
            let b = r.lab.status(i)?.bgp?;
            (b.sessions.len() == 2 && b.sessions.iter().all(|s| s.state == "Established" && s.prefixes_sent == vips as u64)).then_some(b)
        });
        let bgp = bgp.unwrap_or_else(|| panic!("node-{}'s status: {:?}", i + 1, r.lab.status(i).map(|s| s.bgp)));
        let peers: Vec<IpAddr> = bgp.sessions.iter().map(|s| s.peer).collect();
        assert_eq!((peers, bgp.routes, bgp.reload_error), (vec![ROUTER.into(), ROUTER6.into()], 2 * vips, None), "node-{}'s BGP status", i + 1);
    }
    for (from, v, base) in [(FAR_CLIENT.into(), IpAddr::from(vip(0)), 27000), (FAR_CLIENT6.into(), vip6(0).into(), 27100)] {
        let mut backends: BTreeMap<String, usize> = BTreeMap::new();
        for p in 0..CONNS {
            let b = ask_from(&r.router.client, from, v, base + p, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{v} from port {p}: {e:#}\n{}", logs(&r)));
            *backends.entry(b).or_default() += 1;
        }
        assert_eq!(backends.len(), 3, "{v}: every backend serves some of {CONNS} connections: {backends:?}");
    }
    let unchanged = |r: &RoutedLab, peers: &[IpAddr], when: &str| {
        let now = r.router.wait_sessions(established.len()).unwrap_or_else(|e| panic!("{when}: {e:#}\n{}", logs(r)));
        for p in peers {
            assert_eq!(now.get(p), established.get(p), "{when}: the session of {p} was reset: {now:?} (before: {established:?})");
        }
    };
    let all: Vec<IpAddr> = established.keys().copied().collect();
    let lab_spec = r.lab.spec.clone();

    // VIP 1 leaves the pool: withdrawn by every node; VIP 0 stays; back.
    write_atomic(&r.lab.config, &ha_config_of(&HaSpec { vips: 1, ..lab_spec.clone() }, &[0, 1, 2])).unwrap();
    for v in [IpAddr::from(vip(1)), vip6(1).into()] {
        r.router.wait_next_hops(v, BTreeSet::is_empty, ROUTE_WAIT).unwrap_or_else(|e| panic!("VIP 1 out of the pool: {e:#}\n{}", logs(&r)));
    }
    hops(&r, 1, &[0, 1, 2], "VIP 1 out of the pool");
    write_atomic(&r.lab.config, &ha_config_of(&lab_spec, &[0, 1, 2])).unwrap();
    let took = hops(&r, vips, &[0, 1, 2], "VIP 1 back");
    eprintln!("VIP 1 back in the pool: announced by every node {took:?} after the file changed");
    unchanged(&r, &all, "a VIP out of the pool and back");

    // Node-3 out of the model: its sessions close (nothing of it in the model
    // says it peers), the others' stay.
    let node3: BTreeSet<IpAddr> = [r.lab.nodes[2].addr, node_addr6(2).into()].into();
    write_atomic(&r.lab.config, &ha_config_of(&lab_spec, &[0, 1])).unwrap();
    hops(&r, vips, &[0, 1], "node-3 out of the model");
    let closed = wait_for(ROUTE_WAIT, || {
        let s = r.router.sessions().ok()?;
        node3.iter().all(|a| s.get(a).is_none_or(|(st, _)| st != "Established")).then_some(())
    });
    assert!(closed.is_some(), "node-3's sessions stay up out of the model: {:?}", r.router.sessions());
    let others: Vec<IpAddr> = all.iter().filter(|a| !node3.contains(a)).copied().collect();
    for p in &others {
        assert_eq!(r.router.sessions().unwrap().get(p).map(|s| s.1), established.get(p).copied(), "node-3 leaving the model reset {p}'s session");
    }
    write_atomic(&r.lab.config, &ha_config_of(&lab_spec, &[0, 1, 2])).unwrap();
    hops(&r, vips, &[0, 1, 2], "node-3 back in the model");
    let established = r.router.wait_sessions(6).unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&r)));

    // Node-2's agent SIGKILLed: its FRR keeps announcing and its data path
    // keeps forwarding; started again, it gives FRR the same configuration.
    let mut conns = r.open(vip(0), 27200, CONNS).unwrap();
    let mut conns6 = r.open(vip6(0), 27300, CONNS).unwrap();
    r.lab.kill_agent(1);
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(200));
        let h = r.router.rib_next_hops(vip(0).into()).unwrap();
        assert_eq!(h.len(), 3, "the router lost a next hop while node-2's agent was down: {h:?}\n{}", logs(&r));
    }
    assert_eq!(broken(&mut conns, "node-2"), (0, 0), "node-2's agent down broke connections\n{}", logs(&r));
    r.lab.start_agent(1).unwrap();
    r.lab.wait_converged(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", logs(&r)));
    // Its first reload has run once the metrics count its routes.
    let reloaded = wait_for(Duration::from_secs(15), || r.lab.metrics(1).contains("vip_bgp_reloads_total{result=\"ok\"} ").then_some(()));
    assert!(reloaded.is_some(), "node-2's restarted agent never gave FRR its configuration:\n{}\n{}", r.lab.metrics(1), logs(&r));
    hops(&r, vips, &[0, 1, 2], "node-2's agent back");
    assert_eq!((broken(&mut conns, "node-2"), broken(&mut conns6, "node-2")), ((0, 0), (0, 0)), "node-2's agent restart broke connections\n{}", logs(&r));
    let now = r.router.wait_sessions(6).unwrap();
    assert_eq!(now, established, "node-2's agent restart reset sessions");

    // Node-3's agent stops with SIGTERM: it withdraws its routes first, while
    // its sessions stay up (FRR outlives it), and keeps forwarding what the
    // router still sends; started again, it announces them again.
    r.lab.stop_agent(2, libc::SIGTERM);
    let took = hops(&r, vips, &[0, 1], "node-3's agent stopped");
    eprintln!("node-3's agent stopped: its routes withdrawn {took:?} after it exited");
    let now = r.router.wait_sessions(6).unwrap_or_else(|e| panic!("node-3's agent stopped: {e:#}\n{}", logs(&r)));
    assert_eq!(now, established, "node-3's agent stopping reset sessions");
    assert_eq!((broken(&mut conns, "node-3"), broken(&mut conns6, "node-3")), ((0, 0), (0, 0)), "node-3's agent stopping broke connections\n{}", logs(&r));
    r.lab.start_agent(2).unwrap();
    hops(&r, vips, &[0, 1, 2], "node-3's agent back");
    assert_eq!((broken(&mut conns, "node-3"), broken(&mut conns6, "node-3")), ((0, 0), (0, 0)), "node-3's agent back broke connections\n{}", logs(&r));
    assert_eq!(r.router.wait_sessions(6).unwrap(), established, "node-3's agent back reset sessions");
    assert_eq!(conns.len() + conns6.len(), 2 * usize::from(CONNS));

    // Node-1's FRR restarts with nothing (as FRR does from a file of its own):
    // the router drops node-1; its agent finds FRR without its sessions and
    // gives it the configuration again.
    drop(std::mem::replace(&mut r.speakers[0], Speaker::Frr(Frr::start(&r.lab.nodes[0].ns, &r.lab.frr_dir(0), &[]).unwrap())));
    hops(&r, vips, &[1, 2], "node-1's FRR killed");
    let t = std::time::Instant::now();
    r.speakers[0] = Speaker::Frr(Frr::start(&r.lab.nodes[0].ns, &r.lab.frr_dir(0), Frr::daemons(false)).unwrap());
    // Found within 5 s, then a session to set up: a longer wait than a route change's.
    let wait = Duration::from_secs(30);
    for v in (0..vips).flat_map(|k| [IpAddr::from(vip(k)), vip6(k).into()]) {
        r.router.wait_next_hops(v, |h| h.len() == 3, wait).unwrap_or_else(|e| panic!("node-1's FRR started again: {e:#}\n{}", logs(&r)));
    }
    eprintln!("node-1's FRR restarted empty: announced again {:?} after it started", t.elapsed());
}
