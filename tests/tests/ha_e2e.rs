//! High availability end to end, in the lab: three nodes each running the real
//! agent, every node a backend. Even spread of VIP ownership; failover on agent
//! SIGKILL, SIGSTOP and link down with the client's neighbour entry moved by
//! gratuitous ARP and established connections kept; partition heal leaving one
//! answer per VIP; ARP conflicts counted; agent restart without loss.
//! The scenarios are timing-sensitive, so they run one at a time.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use vip_tests::{
    agent::{agent_bin, wait_for},
    halab::{ask, metric, vip, FailoverWatch, HaLab, HaSpec, LongConn, Naming},
    netns::privileged,
};

static SERIAL: Mutex<()> = Mutex::new(());

/// The health servers' port (kube-proxy's is 10256).
const HEALTH_PORT: u16 = 10256;

fn lab(spec: HaSpec) -> HaLab {
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    HaLab::start(spec, Naming::Unique, Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap()
}

fn all(lab: &HaLab) -> Vec<usize> {
    (0..lab.nodes.len()).collect()
}

fn hex(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02X}")).collect::<Vec<_>>().join(":")
}

/// MACs answering ARP for `ip` from the client (arping, 3 requests).
fn arp_answerers(lab: &HaLab, ip: Ipv4Addr) -> BTreeSet<String> {
    let o = lab.client.cmd("arping").args(["-c", "3", "-w", "2", "-I", "eth0", &ip.to_string()]).output().unwrap();
    String::from_utf8_lossy(&o.stdout).split(['[', ']']).filter(|w| w.len() == 17 && w.matches(':').count() == 5).map(str::to_owned).collect()
}

/// Long-lived connections to `v` from the client whose backend is not `avoid`.
fn long_conns(lab: &HaLab, v: impl Into<std::net::IpAddr>, first_port: u16, avoid: &str) -> Vec<LongConn> {
    let v = v.into();
    let conns: Vec<LongConn> =
        (0..12).map(|i| LongConn::open(&lab.client, v, first_port + i, Duration::from_secs(2)).unwrap()).filter(|c| c.backend != avoid).collect();
    assert!(conns.len() >= 3, "too few connections avoid {avoid}: {}", conns.len());
    conns
}

fn owner_index(lab: &HaLab, owners: &BTreeMap<Ipv4Addr, String>, v: Ipv4Addr) -> usize {
    lab.index_of(&owners[&v])
}

/// One scenario at a time: the lab started and converged (None without root).
fn setup(spec: HaSpec) -> Option<(std::sync::MutexGuard<'static, ()>, HaLab, BTreeMap<Ipv4Addr, String>)> {
    if !privileged() {
        return None;
    }
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lab = lab(spec);
    let owners = lab.wait_converged(&all(&lab), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    // Every ring whole (backend MACs resolved): connections can reach every node.
    lab.wait_rings_full(&all(&lab), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    Some((g, lab, owners))
}

/// Every VIP answered by exactly its owner's MAC.
fn one_answer_each(lab: &HaLab, owners: &BTreeMap<Ipv4Addr, String>, when: &str) {
    for (v, o) in owners {
        assert_eq!(arp_answerers(lab, *v), BTreeSet::from([hex(lab.nodes[lab.index_of(o)].mac)]), "ARP for {v} {when}");
    }
}

fn ping_all(conns: &mut [LongConn], when: &str) {
    for c in conns {
        c.ping().unwrap_or_else(|e| panic!("connection to {} broke {when}: {e:#}", c.backend));
    }
}

#[test]
fn vips_spread_evenly_traffic_over_every_node_and_nothing_flaps() {
    let Some((_g, lab, owners)) = setup(HaSpec { vips: 6, ..Default::default() }) else { return };
    for n in &lab.nodes {
        assert_eq!(owners.values().filter(|o| **o == n.name).count(), 2, "⌈6/3⌉ = 2 VIPs each: {owners:?}");
    }
    one_answer_each(&lab, &owners, "at start");
    // Connections to each VIP spread over all three nodes.
    let mut seen = BTreeMap::<String, u32>::new();
    for k in 0..6 {
        for p in 0..15 {
            *seen.entry(ask(&lab.client, vip(k), 40000 + (k as u16) * 100 + p, Duration::from_secs(2)).unwrap()).or_default() += 1;
        }
    }
    assert_eq!(seen.keys().map(String::as_str).collect::<Vec<_>>(), ["node-1", "node-2", "node-3"], "{seen:?}");
    assert!(seen.values().all(|&n| n >= 15), "90 connections, each node at least 15: {seen:?}");
    // Nothing changes, nothing moves.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(1)).unwrap(), owners, "owners moved while nothing changed");
    let holds = lab.agent_logs().matches("holding VIP").count();
    assert_eq!(holds, 6, "each VIP taken exactly once:\n{}", lab.agent_logs());
}

#[test]
fn owner_sigkill_moves_vip_garp_updates_client_and_connections_survive() {
    let Some((_g, mut lab, owners)) = setup(HaSpec::default()) else { return };
    let v = vip(0);
    let a = owner_index(&lab, &owners, v);
    let mut conns = long_conns(&lab, v, 41000, &lab.nodes[a].name.clone());
    assert_eq!(lab.client_neigh(v), Some(lab.nodes[a].mac));

    lab.kill_agent(a);
    let rest: Vec<usize> = all(&lab).into_iter().filter(|&i| i != a).collect();
    let moved = lab.wait_converged(&rest, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let b = owner_index(&lab, &moved, v);
    assert_ne!(a, b);
    // The client sent nothing: only the new owner's gratuitous ARP can have moved its entry.
    let new_mac = lab.nodes[b].mac;
    let t = vip_tests::halab::time_until(Duration::from_secs(2), || lab.client_neigh(v) == Some(new_mac));
    assert!(t.is_some(), "client's neighbour entry for {v} still {:?}, want {:?}", lab.client_neigh(v), new_mac);
    ping_all(&mut conns, "after the failover");
    ask(&lab.client, v, 41100, Duration::from_secs(2)).unwrap();

    // The agent comes back: ownership returns to the full assignment, once.
    lab.start_agent(a).unwrap();
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap(), owners);
    ping_all(&mut conns, "on the return");
}

/// The dual-stack lab: IPv6 VIPs are spread over every node as IPv4 ones are, and
/// a dead owner's IPv6 VIP moves with an unsolicited Neighbor Advertisement
/// (Override) that corrects the client's entry unasked, with established
/// connections through the other nodes kept, as gratuitous ARP does for IPv4.
#[test]
fn ipv6_vips_spread_over_every_node_and_fail_over_with_an_advertisement() {
    let Some((_g, mut lab, _)) = setup(HaSpec { ipv6: true, ..Default::default() }) else { return };
    let v = std::net::IpAddr::V6(vip_tests::halab::vip6(0));
    let mut seen = BTreeMap::new();
    for i in 0..30 {
        let name = ask(&lab.client, v, 44000 + i, Duration::from_secs(2)).unwrap_or_else(|e| panic!("connection {i} to {v}: {e:#}\n{}", lab.agent_logs()));
        *seen.entry(name).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), lab.nodes.len(), "30 connections to {v} reached {seen:?}, not every node");
    let a = lab.index_of(&lab.owner_seen_by(0, v).unwrap());
    assert_eq!(lab.client_neigh(v), Some(lab.nodes[a].mac), "the client resolved {v} to its owner {}", lab.nodes[a].name);
    let conns = long_conns(&lab, v, 44100, &lab.nodes[a].name.clone());
    let watch = FailoverWatch::start(&lab, v, lab.nodes[a].mac, conns, Duration::from_secs(2)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    lab.kill_agent(a);
    let done = Instant::now();
    let (o, mut conns, _) = watch.finish(t0, done).unwrap();
    eprintln!("IPv6 owner killed: advertisement from the new owner after {:?}, first new connection after {:?}", o.takeover, o.first_ok);
    assert!(o.takeover.is_some(), "no Neighbor Advertisement for {v} from a new owner within 2 s\n{}", lab.agent_logs());
    assert!(o.first_ok.is_some(), "no new connection to {v} within 2 s of the owner's death\n{}", lab.agent_logs());
    assert_eq!(o.broken, 0, "{} of {} established connections broke", o.broken, o.conns);
    ping_all(&mut conns, "after the IPv6 failover");
    let rest: Vec<usize> = all(&lab).into_iter().filter(|&i| i != a).collect();
    lab.wait_converged(&rest, Duration::from_secs(3)).unwrap();
    let b = lab.index_of(&lab.owner_seen_by(rest[0], v).unwrap());
    assert_ne!(a, b);
    assert_eq!(lab.client_neigh(v), Some(lab.nodes[b].mac), "the client's entry for {v} moved to the new owner {}", lab.nodes[b].name);
}

#[test]
fn owner_sigstop_is_fenced_and_taken_over_then_rejoins() {
    let Some((_g, lab, owners)) = setup(HaSpec::default()) else { return };
    let v = vip(1);
    let a = owner_index(&lab, &owners, v);
    let mut conns = long_conns(&lab, v, 42000, &lab.nodes[a].name.clone());
    lab.signal_agent(a, libc::SIGSTOP);
    let rest: Vec<usize> = all(&lab).into_iter().filter(|&i| i != a).collect();
    let moved = lab.wait_converged(&rest, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let b = owner_index(&lab, &moved, v);
    // The hung agent's entries went stale: only the new owner answers.
    assert_eq!(arp_answerers(&lab, v), BTreeSet::from([hex(lab.nodes[b].mac)]));
    ping_all(&mut conns, "after the failover");
    lab.signal_agent(a, libc::SIGCONT);
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap(), owners);
    one_answer_each(&lab, &owners, "after the rejoin");
}

/// A client that still sends to a VIP's former owner (its entry stale since the
/// VIP moved back to its usual owner) keeps the connections it opens there when it
/// follows the owner: the former owner balances them by the ring, as the owner
/// does, rather than giving them to its own stack. The client's neighbour entry is
/// pinned to each node's MAC in turn, so the window is as long as the test needs.
#[test]
fn connections_opened_through_the_former_owner_survive_the_clients_move() {
    let Some((_g, lab, owners)) = setup(HaSpec::default()) else { return };
    let v = vip(1);
    let a = owner_index(&lab, &owners, v);
    // The VIP moves to another node and back: that node keeps a stale entry.
    lab.signal_agent(a, libc::SIGSTOP);
    let rest: Vec<usize> = all(&lab).into_iter().filter(|&i| i != a).collect();
    let moved = lab.wait_converged(&rest, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let b = owner_index(&lab, &moved, v);
    lab.signal_agent(a, libc::SIGCONT);
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap(), owners);
    lab.wait_rings_full(&all(&lab), Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let pin = |i: usize| {
        let o = lab.client.ip(&["neigh", "replace", &v.to_string(), "lladdr", &hex(lab.nodes[i].mac), "dev", "eth0", "nud", "permanent"]).unwrap();
        assert!(o.status.success(), "ip neigh replace: {}", String::from_utf8_lossy(&o.stderr));
    };
    pin(b);
    let mut conns: Vec<LongConn> = (0..12).map(|i| LongConn::open(&lab.client, v, 43000 + i, Duration::from_secs(2)).unwrap()).collect();
    let served: BTreeSet<&str> = conns.iter().map(|c| c.backend.as_str()).collect();
    assert!(served.len() > 1, "every connection through the former owner went to {served:?}: given to its stack, not balanced");
    pin(a);
    ping_all(&mut conns, "once the client followed the owner");
}

#[test]
fn link_down_fails_over_and_partition_heal_leaves_one_answer() {
    let Some((_g, lab, owners)) = setup(HaSpec::default()) else { return };
    let v = vip(2);
    let a = owner_index(&lab, &owners, v);
    let conns = long_conns(&lab, v, 43000, &lab.nodes[a].name.clone());
    let watch = FailoverWatch::start(&lab, v, lab.nodes[a].mac, conns, Duration::from_secs(2)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    lab.seg.cable(&lab.nodes[a].ns, false).unwrap();
    let done = Instant::now();
    let (o, mut conns, _) = watch.finish(t0, done).unwrap();
    eprintln!("link down: takeover seen after {:?}, first new connection after {:?}", o.takeover, o.first_ok);
    assert!(o.takeover.is_some(), "no gratuitous ARP from a new owner within 2 s\n{}", lab.agent_logs());
    assert!(o.first_ok.is_some(), "no new connection within 2 s of the link going down\n{}", lab.agent_logs());
    assert_eq!(o.broken, 0, "{} of {} established connections broke", o.broken, o.conns);
    ping_all(&mut conns, "after the link went down");
    // Without a carrier the node holds nothing (it cannot answer anyway), so
    // nothing is answered twice when the link comes back.
    let cut = lab.nodes[a].name.clone();
    let none = vip_tests::halab::time_until(Duration::from_secs(1), || lab.held_by(a).is_empty());
    assert!(none.is_some(), "{cut} holds VIPs without a carrier: {:?}", lab.held_by(a));
    let back = Instant::now();
    lab.seg.cable(&lab.nodes[a].ns, true).unwrap();
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(3)).unwrap(), owners);
    eprintln!("link back: converged after {:?}", back.elapsed());
    one_answer_each(&lab, &owners, "after the link came back");

    // A partition (the link up, the network silent): the cut-off node believes it
    // is alone and holds every VIP, its peers share them.
    lab.seg.isolate(&lab.nodes[a].ns, true).unwrap();
    let alone = vip_tests::halab::time_until(Duration::from_secs(3), || lab.held_by(a).len() == 3);
    assert!(alone.is_some(), "{cut} should hold all VIPs while partitioned: {:?}", lab.held_by(a));
    let others: Vec<usize> = all(&lab).into_iter().filter(|&i| i != a).collect();
    lab.wait_converged(&others, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));

    // Heal: within a bound, one owner per VIP again, and one ARP answer each.
    let healed = Instant::now();
    lab.seg.isolate(&lab.nodes[a].ns, false).unwrap();
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(3)).unwrap(), owners);
    eprintln!("partition healed: converged after {:?}", healed.elapsed());
    one_answer_each(&lab, &owners, "after the heal");
}

#[test]
fn foreign_gratuitous_arp_for_a_held_vip_is_a_counted_conflict() {
    // Six VIPs: the owner of the contested one holds another, which it must not
    // re-announce.
    let Some((_g, lab, owners)) = setup(HaSpec { vips: 6, ..Default::default() }) else { return };
    let v = vip(0);
    let a = owner_index(&lab, &owners, v);
    let intruder = [0x02, 0xde, 0xad, 0, 0, 1];
    let metrics = || lab.metrics(a);
    let conflicts = || metric(&metrics(), "vip_arp_conflicts_total").unwrap_or(0.0) as u64;
    // Start-up may have counted conflicts of its own: a VIP that moved while the
    // agents came up, its previous holder's gratuitous ARP still in flight (the
    // takeover rounds are not cancelled on release). Count from a quiet baseline,
    // and read only what the logs gained from here on.
    let mut base = conflicts();
    let quiet = vip_tests::halab::time_until(Duration::from_secs(5), || {
        std::thread::sleep(Duration::from_millis(500));
        let prev = std::mem::replace(&mut base, conflicts());
        prev == base
    });
    assert!(quiet.is_some(), "{}'s conflict counter kept moving before any foreign frame:\n{}", lab.nodes[a].name, lab.agent_logs());
    let offsets: Vec<usize> = lab.nodes.iter().map(|n| std::fs::metadata(&n.log).map_or(0, |m| m.len() as usize)).collect();
    let new_log = |i: usize| String::from_utf8_lossy(std::fs::read(&lab.nodes[i].log).unwrap_or_default().get(offsets[i]..).unwrap_or_default()).into_owned();
    let watch = vip_tests::halab::ArpWatch::start(&lab.client).unwrap();
    lab.client
        .run(move || {
            let ifindex = vip_agent::dataplane::iface_info("eth0").unwrap().0;
            vip_agent::ha::garp::send_garp(ifindex, intruder, v, 2, Duration::from_millis(10)).unwrap()
        })
        .unwrap();
    let seen = vip_tests::halab::time_until(Duration::from_secs(3), || new_log(a).contains("ARP conflict"));
    assert!(seen.is_some(), "no conflict logged by {}:\n{}", lab.nodes[a].name, lab.agent_logs());
    // Both frames counted (the agent polls the data path's counter every 100 ms)...
    let counted = vip_tests::halab::time_until(Duration::from_secs(3), || conflicts() == base + 2);
    assert!(counted.is_some(), "want {} + 2 conflicts:\n{}\n{}", base, metrics(), lab.agent_logs());
    // ...each once: nothing more follows (our re-announcement draws no answer).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(conflicts(), base + 2, "conflicts counted after the two frames:\n{}", lab.agent_logs());
    // The owner re-announced the contested VIP, and only it.
    let owner_mac = lab.nodes[a].mac;
    let announced: BTreeSet<Ipv4Addr> = watch.finish().into_iter().filter(|(_, m, _)| *m == owner_mac).map(|(_, _, ip)| ip).collect();
    assert_eq!(announced, BTreeSet::from([v]), "{} re-announced {announced:?} after a conflict on {v}", lab.nodes[a].name);
    // The other nodes do not hold the VIP: nothing to count there.
    for i in (0..lab.nodes.len()).filter(|i| *i != a) {
        assert!(!new_log(i).contains("ARP conflict"), "node {i} logged a conflict:\n{}", lab.agent_logs());
    }
}

#[test]
fn agent_restart_keeps_answering_and_forwarding() {
    let Some((_g, mut lab, owners)) = setup(HaSpec::default()) else { return };
    let v = vip(0);
    let a = owner_index(&lab, &owners, v);
    let mut conns = long_conns(&lab, v, 44000, "");
    assert!(conns.iter().any(|c| c.backend == lab.nodes[a].name), "no long-lived connection served by the restarting node");
    let took_so_far = |lab: &HaLab| -> usize {
        lab.nodes
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != a)
            .map(|(_, n)| std::fs::read_to_string(&n.log).unwrap_or_default().matches("holding VIP").count())
            .sum()
    };
    // SIGTERM, then a restart that takes longer than deadAfter (a pod's restart):
    // the stopping agent's leaving heartbeats hand its VIPs to peers at once and
    // keep its node in the rings, so no connection it serves breaks. SIGKILL with
    // an immediate restart: back before its peers notice, nothing moves.
    for (sig, name, down_for) in [(libc::SIGTERM, "SIGTERM", Duration::from_millis(1500)), (libc::SIGKILL, "SIGKILL", Duration::ZERO)] {
        let before = took_so_far(&lab);
        let t = Instant::now();
        lab.signal_agent(a, sig);
        if let Some(mut old) = lab.nodes[a].agent.take() {
            let _ = old.child.wait();
        }
        if sig == libc::SIGTERM {
            // It released what a peer took before it exited: its entry is stale
            // at once, not at its deadline, so that it and the new holder are
            // never both fresh holders (whose different rings could pass a
            // flow's frames between them).
            let dp = vip_agent::dataplane::Dataplane::open(&lab.nodes[a].pins.path).unwrap();
            let entry = dp.held_ref().entries().unwrap().into_iter().find(|e| e.vip == std::net::IpAddr::from(v));
            assert_eq!(entry.map(|e| e.deadline_ns), Some(0), "{name}: the stopped agent's entry for {v}: {entry:?}\n{}", lab.agent_logs());
        }
        std::thread::sleep(down_for);
        for c in &mut conns {
            c.ping().unwrap_or_else(|e| panic!("{name}: connection to {} broke while the agent was down: {e:#}", c.backend));
        }
        lab.start_agent(a).unwrap();
        // New connections and the open ones work right through the restart.
        for p in 0..10 {
            ask(&lab.client, v, 44100 + p, Duration::from_secs(1)).unwrap_or_else(|e| panic!("{name}: new connection failed: {e:#}"));
        }
        for c in &mut conns {
            c.ping().unwrap_or_else(|e| panic!("{name}: connection to {} broke: {e:#}", c.backend));
        }
        assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap(), owners, "{name}: owners changed");
        let took = took_so_far(&lab) - before;
        if sig == libc::SIGTERM {
            assert!(took >= 1, "{name}: no peer took the stopping agent's VIPs\n{}", lab.agent_logs());
        } else {
            assert_eq!(took, 0, "{name}: peers took a VIP during the restart ({:?} after the signal)\n{}", t.elapsed(), lab.agent_logs());
        }
        assert_eq!(arp_answerers(&lab, v), BTreeSet::from([hex(lab.nodes[a].mac)]), "{name}: ARP after restart");
    }
}

/// Node `i`'s services whose ring has `node` in it, as its status says.
fn services_with_backend(lab: &HaLab, i: usize, node: &str) -> Option<usize> {
    Some(lab.status(i)?.services.iter().filter(|x| x.backends.iter().any(|n| n == node)).count())
}

#[test]
fn a_dead_node_leaves_every_ring_without_a_health_check() {
    let spec = HaSpec { health_check: false, ..Default::default() };
    let dead_after = Duration::from_millis(spec.dead_after_ms);
    let Some((_g, lab, _)) = setup(spec) else { return };
    let d = 2;
    let name = lab.nodes[d].name.clone();
    let t0 = Instant::now();
    lab.seg.cable(&lab.nodes[d].ns, false).unwrap();
    let left = vip_tests::halab::time_until(Duration::from_secs(3), || (0..2).all(|i| services_with_backend(&lab, i, &name) == Some(0)));
    let took = left.unwrap_or_else(|| panic!("{name} still in rings 3 s after its cable was pulled\n{}", lab.agent_logs()));
    eprintln!("{name} left every ring {took:?} after its cable was pulled (deadAfter {dead_after:?})");
    // Heartbeats are checked every interval: deadAfter, one interval, and the
    // status poll's slack.
    assert!(took <= dead_after + Duration::from_millis(500), "took {took:?}");
    // No new connection is sent to it.
    for k in 0..3 {
        for p in 0..10 {
            let got = ask(&lab.client, vip(k), 45000 + (k as u16) * 100 + p, Duration::from_secs(2)).unwrap_or_else(|e| panic!("connection failed: {e:#}"));
            assert_ne!(got, name);
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(30));
    // Back: every ring has it again.
    lab.seg.cable(&lab.nodes[d].ns, true).unwrap();
    lab.wait_rings_full(&all(&lab), Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
}

/// Long-lived connections `name` serves through the VIPs the other nodes hold
/// (from ports `first_port` on).
fn served_through_others(lab: &HaLab, owners: &BTreeMap<Ipv4Addr, String>, name: &str, first_port: u16) -> Vec<LongConn> {
    let mut served = Vec::new();
    for (k, v) in (0..lab.spec.vips).map(|k| (k as u16, vip(k))) {
        if owners[&v] == name {
            continue;
        }
        for p in 0..12 {
            let c = LongConn::open(&lab.client, v, first_port + k * 100 + p, Duration::from_secs(2)).unwrap();
            if c.backend == name {
                served.push(c);
            }
        }
    }
    assert!(served.len() >= 3, "too few connections served by {name}: {}", served.len());
    served
}

/// A node's health target restarting (kube-proxy's health server, restarted
/// with kube-proxy, which keeps its rules and connections meanwhile): once its
/// checks fail the node is out of every ring for new flows, but the connections
/// it serves through VIPs the others hold live on (their flows stay pinned to
/// it: drained, since its agent runs), and it is back in the rings when the
/// target answers again. Nothing moves: no VIP, no peer declared dead.
#[test]
fn a_health_targets_restart_breaks_no_connection_its_node_serves() {
    let spec = HaSpec { health_port: Some(HEALTH_PORT), ..Default::default() };
    let Some((_g, mut lab, owners)) = setup(spec) else { return };
    let d = 2;
    let name = lab.nodes[d].name.clone();
    // Every node's rings, the node's own too: it balances the VIPs it holds,
    // and probes its own target on its own schedule.
    let every = all(&lab);
    let mut served = served_through_others(&lab, &owners, &name, 43000);
    let changes = |lab: &HaLab| lab.agent_logs().matches("peer liveness changed").count();
    let changes_before = changes(&lab);
    let before: Vec<Option<usize>> = every.iter().map(|&i| services_with_backend(&lab, i, &name)).collect();
    assert!(before.iter().all(|n| n.is_some_and(|n| n > 0)), "{before:?}");

    lab.stop_health(d);
    let out = vip_tests::halab::time_until(Duration::from_secs(5), || every.iter().all(|&i| services_with_backend(&lab, i, &name) == Some(0)));
    let took = out.unwrap_or_else(|| panic!("{name} still in a ring 5 s after its health server stopped\n{}", lab.agent_logs()));
    ping_all(&mut served, "when its node's health target stopped");
    for &i in &every {
        let s = lab.status(i).unwrap();
        let drained = s.services.iter().filter(|x| x.draining.contains(&name)).count();
        assert_eq!(drained, s.services.len(), "{}: services draining {name}: {drained} of {}", lab.nodes[i].name, s.services.len());
    }
    // New connections avoid it, the established ones live on.
    for p in 0..30u16 {
        let got = ask(&lab.client, vip((p % 3) as usize), 44000 + p, Duration::from_secs(2)).unwrap_or_else(|e| panic!("connection failed: {e:#}"));
        assert_ne!(got, name, "a new connection reached {name} while its health check failed");
    }
    std::thread::sleep(Duration::from_secs(1));
    ping_all(&mut served, "while its node's health target was down");

    lab.start_health(d).unwrap();
    let back = vip_tests::halab::time_until(Duration::from_secs(5), || every.iter().map(|&i| services_with_backend(&lab, i, &name)).eq(before.iter().copied()));
    back.unwrap_or_else(|| panic!("{name} not back in the rings 5 s after its health server started\n{}", lab.agent_logs()));
    ping_all(&mut served, "after its node's health target came back");
    let reached = (0..30u16)
        .filter(|&p| ask(&lab.client, vip((p % 3) as usize), 45000 + p, Duration::from_secs(2)).unwrap_or_else(|e| panic!("connection failed: {e:#}")) == name)
        .count();
    assert!(reached > 0, "no new connection reached {name} once its health target answered");
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(2)).unwrap(), owners, "VIPs moved");
    assert_eq!(changes(&lab), changes_before, "a peer's liveness changed\n{}", lab.agent_logs());
    eprintln!("{name}: out of every ring {took:?} after its health server stopped; {} connections it serves kept", served.len());
}

/// An agent SIGKILLed (a crash, an OOM kill, a container in back-off) leaves its
/// node serving: the peers ask its health target once it is late, keep it a
/// backend when that answers (its VIPs move all the same), and the connections
/// it serves through VIPs other nodes hold live on, new ones still reach it.
/// Its cable pulled then, it leaves every ring; back with its agent, a cable
/// pulled while the agent runs takes it out as fast as before.
#[test]
fn a_killed_agents_node_stays_a_backend_while_it_serves_and_a_cut_one_leaves() {
    let spec = HaSpec::default();
    let dead_after = Duration::from_millis(spec.dead_after_ms);
    let Some((_g, mut lab, owners)) = setup(spec) else { return };
    let d = 2;
    let name = lab.nodes[d].name.clone();
    let rest = [0, 1];
    let mut served = served_through_others(&lab, &owners, &name, 46000);
    let before: Vec<Option<usize>> = rest.iter().map(|&i| services_with_backend(&lab, i, &name)).collect();
    assert!(before.iter().all(|n| n.is_some_and(|n| n > 0)), "{before:?}");

    lab.kill_agent(d);
    let moved = lab.wait_converged(&rest, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert!(moved.values().all(|o| *o != name), "{name}'s VIPs did not move: {moved:?}");
    std::thread::sleep(dead_after * 2);
    let during: Vec<Option<usize>> = rest.iter().map(|&i| services_with_backend(&lab, i, &name)).collect();
    assert_eq!(during, before, "{name} left rings while its node serves\n{}", lab.agent_logs());
    ping_all(&mut served, "with its agent killed");
    let reached = (0..30u16)
        .filter(|&p| ask(&lab.client, vip((p % 3) as usize), 47000 + p, Duration::from_secs(2)).unwrap_or_else(|e| panic!("connection failed: {e:#}")) == name)
        .count();
    assert!(reached > 0, "no new connection reached {name}");

    // Really gone now: out of every ring.
    lab.seg.cable(&lab.nodes[d].ns, false).unwrap();
    let left = vip_tests::halab::time_until(Duration::from_secs(3), || rest.iter().all(|&i| services_with_backend(&lab, i, &name) == Some(0)));
    let took = left.unwrap_or_else(|| panic!("{name} still in rings 3 s after its cable was pulled\n{}", lab.agent_logs()));
    eprintln!("{name} (agent killed, node serving) left every ring {took:?} after its cable was pulled");

    lab.seg.cable(&lab.nodes[d].ns, true).unwrap();
    lab.start_agent(d).unwrap();
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap(), owners);
    lab.wait_rings_full(&all(&lab), Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    // Its agent running, a pulled cable takes it out at deadAfter, asked or not.
    lab.seg.cable(&lab.nodes[d].ns, false).unwrap();
    let left = vip_tests::halab::time_until(Duration::from_secs(3), || rest.iter().all(|&i| services_with_backend(&lab, i, &name) == Some(0)));
    let took = left.unwrap_or_else(|| panic!("{name} still in rings 3 s after its cable was pulled\n{}", lab.agent_logs()));
    eprintln!("{name} (agent running) left every ring {took:?} after its cable was pulled (deadAfter {dead_after:?})");
    assert!(took <= dead_after + Duration::from_millis(500), "took {took:?}");
    lab.seg.cable(&lab.nodes[d].ns, true).unwrap();
}

#[test]
fn a_restarted_agent_sweeps_services_deleted_while_it_was_down() {
    let Some((_g, mut lab, _)) = setup(HaSpec { vips: 6, ..Default::default() }) else { return };
    lab.kill_agent(0);
    // Two services (and their VIPs) are deleted while node-1's agent is down.
    lab.spec.vips = 4;
    vip_tests::agent::write_atomic(&lab.config, &vip_tests::halab::ha_config(&lab.spec)).unwrap();
    lab.wait_converged(&[1, 2], Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    lab.start_agent(0).unwrap();
    lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    // From node-1's maps themselves: only the four services and held entries of
    // the four VIPs are left.
    let dp = vip_agent::dataplane::Dataplane::open(&lab.nodes[0].pins.path).unwrap();
    let want: BTreeSet<Ipv4Addr> = (0..4).map(vip).collect();
    let services: BTreeSet<Ipv4Addr> = dp
        .service_addrs()
        .iter()
        .filter_map(|a| match a.vip {
            std::net::IpAddr::V4(v) => Some(v),
            std::net::IpAddr::V6(_) => None,
        })
        .collect();
    assert_eq!(services, want, "lb4_services after the restart");
    assert_eq!(dp.usage().services, 4);
    let held: BTreeSet<std::net::IpAddr> = dp.held_ref().entries().unwrap().into_iter().map(|e| e.vip).collect();
    assert!(held.is_subset(&want.iter().map(|v| (*v).into()).collect()), "arp_held keeps deleted VIPs: {held:?}");
}

#[test]
fn a_full_ring_map_is_reported_isolated_and_never_stops_failover() {
    if !privileged() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // Six services with rings of six different sizes from 251 up, room for three.
    let spec = HaSpec { vips: 6, distinct_tables: true, ring_capacity: Some(1000), ..Default::default() };
    let mut lab = lab(spec);
    let owners = lab.wait_converged(&all(&lab), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let unprogrammed = |lab: &HaLab, i: usize| lab.status(i).map(|s| (s.services.len(), s.unprogrammed));
    for i in all(&lab) {
        let r = vip_tests::agent::wait_for(Duration::from_secs(5), || unprogrammed(&lab, i).filter(|(n, u)| *n == 3 && u.len() == 3));
        let (_, u) = r.unwrap_or_else(|| panic!("node {i}: {:?}\n{}", unprogrammed(&lab, i), lab.agent_logs()));
        for row in &u {
            let e = &row.error;
            assert!(e.contains("lb4_ring is full") && e.contains("--ring-capacity"), "unclear error: {e}");
        }
    }
    // The services that fit forward.
    let programmed: Vec<Ipv4Addr> = lab
        .status(0)
        .unwrap()
        .services
        .iter()
        .filter_map(|s| match s.vip {
            std::net::IpAddr::V4(v) => Some(v),
            std::net::IpAddr::V6(_) => None,
        })
        .collect();
    for (p, v) in programmed.iter().enumerate() {
        ask(&lab.client, *v, 46000 + p as u16, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{v}: {e:#}"));
    }
    // Failover still works: the owner of a VIP dies, its peers take over.
    let v = vip(0);
    let a = owner_index(&lab, &owners, v);
    lab.kill_agent(a);
    let rest: Vec<usize> = all(&lab).into_iter().filter(|&i| i != a).collect();
    lab.wait_converged(&rest, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    // The agent restarts without exiting on the full ring, and everything converges.
    lab.start_agent(a).unwrap();
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap(), owners);
    std::thread::sleep(Duration::from_secs(2)); // two retries
    lab.nodes[a].agent.as_mut().unwrap().check_alive().unwrap();
    assert_eq!(unprogrammed(&lab, a).map(|(n, u)| (n, u.len())), Some((3, 3)));
    // Reported once per service, not on every retry.
    let logs = std::fs::read_to_string(&lab.nodes[(a + 1) % 3].log).unwrap();
    assert_eq!(logs.matches("service not programmed").count(), 3, "{logs}");
}

/// A reload that lowers `holdTime` takes effect on the deadlines at once: the
/// liveness thread re-writes them with the new hold time and refreshes at the
/// new rate (a third of it), so held VIPs never run further ahead than the new
/// hold time, nor go stale.
#[test]
fn a_lower_hold_time_applies_to_deadlines_and_their_refresh_at_once() {
    let spec = HaSpec { hold_ms: 1500, dead_after_ms: 2000, ..Default::default() };
    let Some((_g, mut lab, owners)) = setup(spec) else { return };
    let v = vip(0);
    let a = owner_index(&lab, &owners, v);
    let ahead_ms = |lab: &HaLab| -> Option<i64> {
        let dp = vip_agent::dataplane::Dataplane::open(&lab.nodes[a].pins.path).ok()?;
        let e = dp.held_ref().entries().ok()?.into_iter().find(|e| e.vip == v)?;
        Some((e.deadline_ns as i64 - vip_agent::clock::monotonic_ns() as i64) / 1_000_000)
    };
    let slow = vip_tests::agent::wait_for(Duration::from_secs(3), || ahead_ms(&lab).filter(|ms| *ms > 600));
    assert!(slow.is_some(), "deadline not ahead by more than 600 ms with holdTime 1500 ms: {:?}", ahead_ms(&lab));
    lab.spec.hold_ms = 180;
    lab.spec.dead_after_ms = 250;
    vip_tests::agent::write_atomic(&lab.config, &vip_tests::halab::ha_config(&lab.spec)).unwrap();
    // The reload is polled every 200 ms; then every sample is within the new hold
    // time (plus the coarse clock's slack) and fresh.
    let applied = vip_tests::agent::wait_for(Duration::from_secs(3), || ahead_ms(&lab).filter(|ms| *ms <= 200));
    assert!(applied.is_some(), "deadline still {:?} ms ahead after the reload\n{}", ahead_ms(&lab), lab.agent_logs());
    for _ in 0..40 {
        let ms = ahead_ms(&lab).expect("held");
        assert!((1..=200).contains(&ms), "deadline {ms} ms ahead with holdTime 180 ms\n{}", lab.agent_logs());
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(2)).unwrap(), owners);
}

/// Heartbeats are signed with the cluster key and bound to the sender's address:
/// spoofed datagrams from the segment (unsigned, another key, an altered tag, a
/// name that is not the sender's, an unknown sender, a replayed older
/// incarnation) change nothing and are each counted; forged heartbeats for a dead
/// node do not keep it alive; the key is rotated under traffic without moving a VIP.
#[test]
fn forged_and_replayed_heartbeats_change_nothing_and_keys_rotate_without_a_move() {
    use vip_agent::ha::{auth::Keys, heartbeat::Heartbeat};
    let Some((_g, mut lab, owners)) = setup(HaSpec::default()) else { return };
    let key_path = lab.dir.join(vip_tests::halab::HEARTBEAT_KEY);
    let lab_keys = Keys::from_file(&key_path).unwrap();
    let other_keys = Keys::new(&[vip_tests::halab::random_key().into_bytes()]).unwrap();
    let node_addr = |i: usize| vip_tests::halab::node_addr(i);
    let (target_mac, target) = (lab.nodes[0].mac, node_addr(0));
    let client_mac = lab.client.mac("eth0").unwrap();
    // Frames from the client with a spoofed source address, to node-1's heartbeat port.
    let send = |from: std::net::Ipv4Addr, payload: Vec<u8>| {
        let frame = vip_tests::frames::udp(target_mac, client_mac, (from, 7473), (target, 7473), &payload);
        lab.client
            .run(move || {
                let ifindex = vip_agent::dataplane::iface_info("eth0").unwrap().0;
                vip_agent::ha::garp::GarpSocket::new().unwrap().send_frame(ifindex, &frame).unwrap();
            })
            .unwrap();
    };
    let hb = |node: &str, incarnation: u64, seq: u64| {
        Heartbeat { v: Heartbeat::VERSION, node: node.into(), incarnation, seq, sent_ms: 0, leaving_ms: 0, arp: vec![], settings: String::new() }.encode()
    };
    let far_future = u64::MAX / 2;
    let changes = |lab: &HaLab| lab.agent_logs().matches("peer liveness changed").count();
    let before = changes(&lab);
    send(node_addr(2), hb("node-3", far_future, 1)); // unsigned: malformed
    send(node_addr(2), other_keys.seal(&hb("node-3", far_future, 1))); // unknown key
    let mut altered = lab_keys.seal(&hb("node-3", far_future, 1));
    let last = altered.len() - 2;
    altered[last] ^= 1;
    send(node_addr(2), altered); // bad tag
    send(node_addr(1), lab_keys.seal(&hb("node-3", far_future, 1))); // node-2's address, node-3's name
    send(std::net::Ipv4Addr::new(198, 18, 0, 99), lab_keys.seal(&hb("node-9", far_future, 1))); // unknown sender
    send(node_addr(2), lab_keys.seal(&hb("node-3", 1, u64::MAX))); // an old incarnation: a replay
    let metrics = || lab.metrics(0);
    let counted = |m: &str, reason: &str| metric(m, &format!("vip_heartbeats_rejected_total{{reason=\"{reason}\"}}")).unwrap_or(0.0) as u64;
    let reasons = ["malformed", "unknown_key", "bad_tag", "wrong_name", "unknown_sender", "stale"];
    let all_counted = vip_tests::agent::wait_for(Duration::from_secs(3), || {
        let m = metrics();
        reasons.iter().all(|r| counted(&m, r) >= 1).then_some(())
    });
    assert!(all_counted.is_some(), "rejections not all counted:\n{}", metrics());
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(changes(&lab), before, "a forged datagram changed liveness\n{}", lab.agent_logs());
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(1)).unwrap(), owners);

    // Rotation under traffic: both keys everywhere, then the new one signs, then
    // the old one goes; each step waits for every agent's re-read (every 5 s).
    let old = std::fs::read_to_string(&key_path).unwrap().trim().to_owned();
    let new = vip_tests::halab::random_key();
    for step in [format!("{old}\n{new}\n"), format!("{new}\n{old}\n"), format!("{new}\n")] {
        vip_tests::agent::write_atomic(&key_path, &step).unwrap();
        std::thread::sleep(Duration::from_secs(6));
        assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(1)).unwrap(), owners, "owners moved during the rotation");
    }
    assert_eq!(changes(&lab), before, "a liveness change during the rotation\n{}", lab.agent_logs());
    assert_eq!(counted(&metrics(), "unknown_key"), 1, "heartbeats refused during the rotation");

    // node-3 dies; heartbeats forged for it (unsigned, and under the retired key)
    // do not keep it alive.
    if let Some(mut a) = lab.nodes[2].agent.take() {
        let _ = a.child.kill();
        let _ = a.child.wait();
    }
    let retired = Keys::new(&[old.into_bytes()]).unwrap();
    let rest = [0, 1];
    let t0 = Instant::now();
    let mut seq = 1;
    while lab.wait_converged(&rest, Duration::from_millis(50)).is_err() && t0.elapsed() < Duration::from_secs(5) {
        seq += 1;
        send(node_addr(2), hb("node-3", far_future, seq));
        send(node_addr(2), retired.seal(&hb("node-3", far_future, seq)));
    }
    let moved = lab.wait_converged(&rest, Duration::from_secs(1)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert!(moved.values().all(|o| o != "node-3"), "node-3 kept alive by forged heartbeats: {moved:?}");
}

/// A node removed from the model while its agent runs stops holding VIPs (it
/// does not keep the last model and answer beside the new owners); a node whose
/// configured address is not on its host (its peers cannot hear it) holds none.
#[test]
fn a_node_out_of_the_model_or_off_its_address_holds_nothing() {
    let Some((_g, mut lab, _)) = setup(HaSpec::default()) else { return };
    // node-3 leaves the file every agent reads.
    lab.spec.nodes = 2;
    vip_tests::agent::write_atomic(&lab.config, &vip_tests::halab::ha_config(&lab.spec)).unwrap();
    let owners = lab.wait_converged(&[0, 1], Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let empty = vip_tests::halab::time_until(Duration::from_secs(3), || lab.held_by(2).is_empty());
    assert!(empty.is_some(), "node-3 still holds {:?}\n{}", lab.held_by(2), lab.agent_logs());
    std::thread::sleep(Duration::from_millis(500));
    assert!(lab.held_by(2).is_empty(), "node-3 took VIPs back: {:?}", lab.held_by(2));
    one_answer_each(&lab, &owners, "with node-3 out of the model");
    assert!(lab.status(2).unwrap().config.error.unwrap_or_default().contains("not listed"), "node-3 does not say why");

    // Back in the model, but its agent restarts on a host without its address.
    lab.kill_agent(2);
    lab.spec.nodes = 3;
    vip_tests::agent::write_atomic(&lab.config, &vip_tests::halab::ha_config(&lab.spec)).unwrap();
    let ns = &lab.nodes[2].ns;
    ns.ip(&["addr", "del", "198.18.0.13/24", "dev", "eth0"]).unwrap();
    ns.ip(&["addr", "add", "198.18.0.23/24", "dev", "eth0"]).unwrap();
    lab.start_agent(2).unwrap();
    let owners = lab.wait_converged(&[0, 1], Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert!(owners.values().all(|o| o != "node-3"));
    std::thread::sleep(Duration::from_secs(1));
    assert!(lab.held_by(2).is_empty(), "node-3 holds {:?} without its address\n{}", lab.held_by(2), lab.agent_logs());
    one_answer_each(&lab, &owners, "with node-3 off its address");
}

/// Scale-out while running: two agents on a two-node file, a third started on the
/// three-node file, then the first two get the three-node file; and back in. After
/// each step every agent agrees on the owners, each VIP held by exactly its owner
/// and answered by its MAC alone.
#[test]
fn scale_out_and_back_in_leave_one_answer_per_vip() {
    let Some((_g, mut lab, owners3)) = setup(HaSpec { vips: 6, ..Default::default() }) else { return };
    for i in all(&lab) {
        lab.kill_agent(i);
    }
    let three_nodes = vip_tests::halab::ha_config(&lab.spec);
    let two_nodes = vip_tests::halab::ha_config(&HaSpec { nodes: 2, ..lab.spec.clone() });
    let file = lab.dir.join("first-two.yaml");
    vip_tests::agent::write_atomic(&file, &two_nodes).unwrap();
    lab.start_agent_with(0, &file).unwrap();
    lab.start_agent_with(1, &file).unwrap();
    let owners2 = lab.wait_converged(&[0, 1], Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    one_answer_each(&lab, &owners2, "with two nodes");
    // node-3 joins on the three-node file (the lab's shared one); the first two
    // still have the two-node file: node-3 sees them, they do not see it.
    lab.start_agent(2).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // Now the first two get the three-node file.
    vip_tests::agent::write_atomic(&file, &three_nodes).unwrap();
    let owners = lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert_eq!(owners, owners3, "the same owners as a three-node start");
    one_answer_each(&lab, &owners, "after the scale-out");
    // Back in: node-3 leaves every file.
    vip_tests::agent::write_atomic(&file, &two_nodes).unwrap();
    vip_tests::agent::write_atomic(&lab.config, &two_nodes).unwrap();
    let back = lab.wait_converged(&[0, 1], Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert_eq!(back, owners2);
    assert!(vip_tests::halab::time_until(Duration::from_secs(3), || lab.held_by(2).is_empty()).is_some(), "node-3 still holds VIPs");
    one_answer_each(&lab, &back, "after the scale-in");
}

/// Who answers ARP for each VIP from the client (three rounds), as MACs.
fn answerers(lab: &HaLab, owners: &BTreeMap<Ipv4Addr, String>) -> BTreeMap<Ipv4Addr, BTreeSet<[u8; 6]>> {
    let vips: Vec<Ipv4Addr> = owners.keys().copied().collect();
    let claims = vip_tests::halab::arp_probe(&lab.client, &vips, 3, Duration::from_millis(100)).unwrap();
    claims.into_iter().map(|(v, c)| (v, c.answered)).collect()
}

fn owners_macs(lab: &HaLab, owners: &BTreeMap<Ipv4Addr, String>) -> BTreeMap<Ipv4Addr, BTreeSet<[u8; 6]>> {
    owners.iter().map(|(v, o)| (*v, BTreeSet::from([lab.nodes[lab.index_of(o)].mac]))).collect()
}

/// Heartbeats on a network of their own: a node whose uplink (where VIPs are
/// answered) loses its carrier while its heartbeats could still reach its peers
/// leaves the membership at once: it holds nothing, its VIPs are answered by their
/// new owners, and when the link returns they come back with one answerer each.
#[test]
fn a_lost_uplink_moves_its_vips_though_heartbeats_could_still_get_through() {
    let spec = HaSpec { vips: 6, heartbeat_net: true, ..Default::default() };
    let dead_after = Duration::from_millis(spec.dead_after_ms);
    let Some((_g, lab, owners)) = setup(spec) else { return };
    assert_eq!(answerers(&lab, &owners), owners_macs(&lab, &owners), "before");
    let d = 1;
    let name = lab.nodes[d].name.clone();
    assert!(owners.values().any(|o| *o == name), "{name} owns nothing: {owners:?}");
    let others: Vec<usize> = all(&lab).into_iter().filter(|&i| i != d).collect();
    let t0 = Instant::now();
    lab.seg.cable(&lab.nodes[d].ns, false).unwrap();
    let moved = lab.wait_converged(&others, Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let took = t0.elapsed();
    eprintln!("uplink of {name} down: its VIPs moved in {took:?} (deadAfter {dead_after:?})");
    assert!(moved.values().all(|o| *o != name), "{moved:?}");
    assert!(lab.held_by(d).is_empty(), "{name} holds VIPs without an uplink");
    assert!(lab.nodes[d].agent.as_ref().is_some_and(|a| a.log_text().contains("uplink down")), "{name} does not say why");
    assert_eq!(answerers(&lab, &moved), owners_macs(&lab, &moved), "with {name}'s uplink down");
    lab.seg.cable(&lab.nodes[d].ns, true).unwrap();
    let back = lab.wait_converged(&all(&lab), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert_eq!(back, owners, "ownership after the uplink came back");
    assert_eq!(answerers(&lab, &back), owners_macs(&lab, &back), "after the uplink came back");
}

/// The ARP self-check: a host on the segment with a held VIP configured (a second
/// responder) answers ARP for it besides the holder. The holder cannot see those
/// answers (they go to whoever asked); its peer's check does, and the holder says
/// so: `vip_arp_foreign_answers{vip}` 1, a log line naming the MAC. The rogue
/// gone, the next check brings both back.
#[test]
fn a_second_responder_is_found_by_a_peers_arp_check() {
    let Some((_g, lab, owners)) = setup(HaSpec { arp_check_ms: Some(1000), ..Default::default() }) else { return };
    let v = vip(0);
    let h = owner_index(&lab, &owners, v);
    let series = format!(r#"vip_arp_foreign_answers{{vip="{v}"}}"#);
    let foreign = || metric(&lab.metrics(h), &series);
    let waited = |want: f64, what: &str| {
        let got = vip_tests::halab::time_until(Duration::from_secs(15), || foreign() == Some(want));
        assert!(got.is_some(), "{what}: {series} is {:?} on {}, not {want}\n{}", foreign(), lab.nodes[h].name, lab.agent_logs());
    };
    // A peer checked: only the holder answers.
    waited(0.0, "before any rogue");
    let checks: f64 = (0..lab.nodes.len()).filter(|i| *i != h).filter_map(|i| metric(&lab.metrics(i), "vip_arp_checks_total")).sum();
    assert!(checks >= 1.0, "no peer of {} counts a check", lab.nodes[h].name);
    let offset = std::fs::metadata(&lab.nodes[h].log).map_or(0, |m| m.len() as usize);
    let new_log = || String::from_utf8_lossy(std::fs::read(&lab.nodes[h].log).unwrap_or_default().get(offset..).unwrap_or_default()).into_owned();

    let rogue = lab.seg.plug(vip_tests::netns::NetNs::new("vrogue").unwrap(), "198.18.0.99/24").unwrap();
    let rogue_mac = vip_agent::ha::arpcheck::mac_text(&rogue.mac("eth0").unwrap());
    rogue.ip(&["addr", "add", &format!("{v}/32"), "dev", "eth0"]).unwrap();
    waited(1.0, "with a second responder");
    let log = new_log();
    assert!(log.contains("another MAC answers ARP") && log.contains(&rogue_mac), "the holder's log names the rogue's MAC {rogue_mac}:\n{log}");

    rogue.ip(&["addr", "del", &format!("{v}/32"), "dev", "eth0"]).unwrap();
    waited(0.0, "once the rogue stopped answering");
    assert!(new_log().contains("only this node answers ARP for the VIP again"), "{}", new_log());
    // The other VIPs, held elsewhere, were never answered twice.
    for (other, owner) in owners.iter().filter(|(o, _)| **o != v) {
        let series = format!(r#"vip_arp_foreign_answers{{vip="{other}"}}"#);
        assert_ne!(metric(&lab.metrics(lab.index_of(owner)), &series), Some(1.0), "{other}");
    }
}

/// An agent set apart from its peers (here its file's `garpRefresh`; in
/// Kubernetes a flag set on one DaemonSet pod only) is reported by every agent:
/// each peer's status and `vip_settings_mismatched_peers` name it and the
/// setting, and it names them. Restarted with the shared settings, all agree
/// again and the reports clear.
#[test]
fn agents_whose_cluster_settings_differ_are_reported_until_they_agree() {
    let Some((_g, mut lab, owners)) = setup(HaSpec::default()) else { return };
    let shared = std::fs::read_to_string(&lab.config).unwrap();
    assert!(shared.contains("garpInterval: 50ms\n") && !shared.contains("garpRefresh"), "{shared}");
    let apart = lab.dir.join("apart.yaml");
    std::fs::write(&apart, shared.replace("garpInterval: 50ms\n", "garpInterval: 50ms\n  garpRefresh: 20s\n")).unwrap();
    let mismatch = |lab: &HaLab, i: usize| lab.status(i).map(|s| s.settings_mismatch).unwrap_or_default();
    for i in 0..3 {
        assert!(mismatch(&lab, i).is_empty(), "node {i} before: {:?}", mismatch(&lab, i));
    }
    lab.signal_agent(2, libc::SIGTERM);
    if let Some(mut old) = lab.nodes[2].agent.take() {
        let _ = old.child.wait();
    }
    lab.start_agent_with(2, &apart).unwrap();
    let want = |i: usize| -> Vec<String> {
        match i {
            2 => vec!["node-1: garpRefresh 30s there, 20s here".into(), "node-2: garpRefresh 30s there, 20s here".into()],
            _ => vec!["node-3: garpRefresh 20s there, 30s here".into()],
        }
    };
    // Settings ride in every 20th heartbeat: within a second at the lab's interval.
    for i in 0..3 {
        wait_for(Duration::from_secs(5), || (mismatch(&lab, i) == want(i)).then_some(()))
            .unwrap_or_else(|| panic!("node {i}: {:?}, want {:?}\n{}", mismatch(&lab, i), want(i), lab.agent_logs()));
        assert_eq!(metric(&lab.metrics(i), "vip_settings_mismatched_peers"), Some(want(i).len() as f64), "node {i}");
    }
    assert!(std::fs::read_to_string(&lab.nodes[0].log).unwrap().contains("a peer's cluster-wide settings differ from this node's"));
    // A different garpRefresh changes no owner.
    assert_eq!(lab.wait_converged(&all(&lab), Duration::from_secs(5)).unwrap(), owners);
    lab.signal_agent(2, libc::SIGTERM);
    if let Some(mut old) = lab.nodes[2].agent.take() {
        let _ = old.child.wait();
    }
    lab.start_agent(2).unwrap();
    for i in 0..3 {
        wait_for(Duration::from_secs(5), || mismatch(&lab, i).is_empty().then_some(()))
            .unwrap_or_else(|| panic!("node {i} after the shared settings came back: {:?}", mismatch(&lab, i)));
        assert_eq!(metric(&lab.metrics(i), "vip_settings_mismatched_peers"), Some(0.0), "node {i}");
    }
    // Each agent's release, as its heartbeats say, in every status: the same here.
    let versions = |i: usize| -> Vec<Option<String>> { lab.status(i).map(|s| s.nodes.into_iter().map(|n| n.version).collect()).unwrap_or_default() };
    for i in 0..3 {
        let want = vec![Some(env!("CARGO_PKG_VERSION").to_owned()); 3];
        wait_for(Duration::from_secs(5), || (versions(i) == want).then_some(())).unwrap_or_else(|| panic!("node {i}: versions {:?}", versions(i)));
    }
}

/// Every ring size in node `i`'s `lb4_services`, read from its pin (reads only:
/// its agent runs).
fn ring_sizes(lab: &HaLab, i: usize) -> BTreeSet<u32> {
    use aya::maps::{HashMap, Map, MapData};
    let Ok(data) = MapData::from_pin(lab.nodes[i].pins.path.join(vip_common::map_names::SERVICES)) else { return BTreeSet::new() };
    let Ok(m) = HashMap::<_, vip_common::Lb4ServiceKey, vip_common::LbService>::try_from(Map::from_map_data(data).unwrap()) else { return BTreeSet::new() };
    m.iter().filter_map(|kv| kv.ok()).map(|(_, s)| s.ring_size).collect()
}

/// An owner change after a ring change (the reliability issue's reproduction):
/// long-lived connections through a VIP's owner, every service's `tableSize`
/// changed (a new ring on every node; the owner keeps its pins), then the owner
/// SIGKILLed. Its node serves on, so it stays a backend, and its data path runs:
/// the new owner asks it about the flows it never saw, and every connection
/// keeps its backend. With `VIP_HA_AGENT_BIN` naming an agent of before the
/// handoff (0.2.0's, from `cargo xtask previous-release`), connections break.
#[test]
fn an_owner_killed_after_a_ring_change_breaks_no_connection() {
    let spec = HaSpec { agent_bin: std::env::var_os("VIP_HA_AGENT_BIN").map(Into::into), ..Default::default() };
    let Some((_g, mut lab, owners)) = setup(spec) else { return };
    let v = vip(0);
    let o = owner_index(&lab, &owners, v);
    let name = lab.nodes[o].name.clone();
    let mut conns: Vec<LongConn> = (0..16).map(|i| LongConn::open(&lab.client, v, 48000 + i, Duration::from_secs(2)).unwrap()).collect();
    let elsewhere = conns.iter().filter(|c| c.backend != name).count();
    assert!(elsewhere >= 6, "too few connections through {name} to other nodes: {elsewhere} of 16");

    lab.spec.table_size = Some(257);
    vip_tests::agent::write_atomic(&lab.config, &vip_tests::halab::ha_config(&lab.spec)).unwrap();
    let every = all(&lab);
    let changed = wait_for(Duration::from_secs(10), || every.iter().all(|&i| ring_sizes(&lab, i) == BTreeSet::from([257])).then_some(()));
    changed.unwrap_or_else(|| panic!("rings not rebuilt at 257 slots within 10 s\n{}", lab.agent_logs()));
    ping_all(&mut conns, "after the ring change (the owner's pins)");

    lab.kill_agent(o);
    let rest: Vec<usize> = every.iter().copied().filter(|&i| i != o).collect();
    let moved = lab.wait_converged(&rest, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let new = lab.index_of(&moved[&v]);
    assert_ne!(new, o, "{v} did not move");
    std::thread::sleep(Duration::from_millis(lab.spec.dead_after_ms * 2));
    let broken: Vec<String> = conns.iter_mut().filter_map(|c| c.ping().err().map(|e| format!("{} ({e:#})", c.backend))).collect();
    let asked = metric(&lab.metrics(new), "vip_xdp_packets_total{reason=\"asked_previous\"}").unwrap_or(0.0);
    eprintln!(
        "owner {name} killed after a ring change: {} of {} long-lived connections broken; the new owner asked about {asked} segments",
        broken.len(),
        conns.len()
    );
    assert!(broken.is_empty(), "{} of {} connections broken: {broken:?}\n{}", broken.len(), conns.len(), lab.agent_logs());
    assert!(asked > 0.0, "the new owner asked nothing: the ring change moved no slot of these flows?");

    lab.start_agent(o).unwrap();
    lab.wait_converged(&every, Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    ping_all(&mut conns, "after the owner's agent came back");
}

/// A node rebooted: its link down, then its agent, its servers and its data path
/// gone (bpffs emptied), back a few seconds later with a fresh agent. What breaks
/// is only what must: the connections its own servers carried (the reboot ended
/// them), and of the connections it balanced to other nodes, those whose pins
/// went with it and whose ring slot moved when it left the rings. Every other
/// connection lives on, also through the VIPs that return to it: it asks the
/// nodes that held them meanwhile about the flows it never saw.
#[test]
fn a_rebooted_node_breaks_only_the_connections_that_must_break() {
    let Some((_g, mut lab, owners)) = setup(HaSpec::default()) else { return };
    let d = 2;
    let name = lab.nodes[d].name.clone();
    let mut conns: Vec<(Ipv4Addr, LongConn)> = Vec::new();
    for k in 0..lab.spec.vips {
        for p in 0..10u16 {
            conns.push((vip(k), LongConn::open(&lab.client, vip(k), 49000 + k as u16 * 100 + p, Duration::from_secs(2)).unwrap()));
        }
    }
    let (served, through, others): (Vec<_>, Vec<_>, Vec<_>) = {
        let (served, rest): (Vec<_>, Vec<_>) = conns.into_iter().partition(|(_, c)| c.backend == name);
        let (through, others): (Vec<_>, Vec<_>) = rest.into_iter().partition(|(v, _)| owners[v] == name);
        (served, through, others)
    };
    assert!(!through.is_empty() && !others.is_empty() && !served.is_empty(), "{} / {} / {}", served.len(), through.len(), others.len());
    let mut through: Vec<LongConn> = through.into_iter().map(|(_, c)| c).collect();
    let mut others: Vec<LongConn> = others.into_iter().map(|(_, c)| c).collect();

    lab.power_off(d).unwrap();
    let rest = [0, 1];
    let moved = lab.wait_converged(&rest, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert!(moved.values().all(|o| *o != name));
    let out = vip_tests::halab::time_until(Duration::from_secs(3), || rest.iter().all(|&i| services_with_backend(&lab, i, &name) == Some(0)));
    out.unwrap_or_else(|| panic!("{name} still in a ring 3 s after its power-off\n{}", lab.agent_logs()));
    ping_all(&mut others, "while a node was off (VIPs it did not hold, backends it is not)");
    let lost: Vec<usize> = through.iter_mut().enumerate().filter_map(|(i, c)| c.ping().is_err().then_some(i)).collect();
    let mut kept: Vec<LongConn> = through.into_iter().enumerate().filter(|(i, _)| !lost.contains(i)).map(|(_, c)| c).collect();

    std::thread::sleep(Duration::from_secs(2));
    lab.power_on(d).unwrap();
    let back = lab.wait_converged(&all(&lab), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert_eq!(back, owners, "the VIPs did not return to their owners");
    lab.wait_rings_full(&all(&lab), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    ping_all(&mut others, "after the rebooted node came back");
    ping_all(&mut kept, "after the VIPs returned to the rebooted node (it asks their holders of meanwhile)");
    let ended = served.into_iter().map(|(_, mut c)| c.ping().is_err()).filter(|e| *e).count();
    let asked = metric(&lab.metrics(d), "vip_xdp_packets_total{reason=\"asked_previous\"}").unwrap_or(0.0);
    eprintln!(
        "{name} rebooted: {} of {} connections through other VIPs to other nodes kept; through its VIPs to other nodes {} of {} kept (the rest lost with its pins), {} kept after its VIPs returned ({asked} segments asked about); its own {ended} ended",
        others.len(),
        others.len(),
        kept.len(),
        kept.len() + lost.len(),
        kept.len()
    );
    assert!(asked > 0.0, "the rebooted node asked nothing about the flows through its returned VIPs");
}
