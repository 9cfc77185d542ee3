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

use vip_tests::{
    agent::{agent_bin, write_atomic},
    halab::{ask_from, ha_config_of, vip, vip_nets, HaLab, HaSpec, LongConn, Naming},
    netns::privileged,
    routed::{Ingress, Router, Speaker, FAR_CLIENT},
};

static SERIAL: Mutex<()> = Mutex::new(());

/// Long-lived connections per phase: enough that a rehash moves some for sure
/// (plain ECMP breaks about half of them when one of three next hops goes).
const CONNS: u16 = 48;
/// Bound on the router learning a change (BIRD and FRR send and apply updates
/// at once; the hold timer is not involved).
const ROUTE_WAIT: Duration = Duration::from_secs(15);

struct Routed {
    // Drop order: speakers and router before the lab's namespaces.
    _speakers: Vec<Speaker>,
    router: Router,
    lab: HaLab,
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// The lab with a router and a speaker on every node; agents started when `agents`.
fn routed(vips: usize, agents: bool) -> Option<Routed> {
    if !privileged() {
        return None;
    }
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let spec = HaSpec { vips, lo_everywhere: true, ..Default::default() };
    let server = Path::new(env!("CARGO_BIN_EXE_vip-lab"));
    let lab = if agents { HaLab::start(spec, Naming::Unique, server) } else { HaLab::build(spec, Naming::Unique, server) }.unwrap();
    let router = Router::start(&lab).unwrap();
    let nets = vip_nets(vips);
    let speakers = lab.nodes.iter().map(|n| Speaker::start(n, &lab.dir, &nets).unwrap()).collect();
    Some(Routed { _speakers: speakers, router, lab, _serial: serial })
}

impl Routed {
    fn node_addrs(&self, nodes: &[usize]) -> BTreeSet<Ipv4Addr> {
        nodes
            .iter()
            .map(|i| match self.lab.nodes[*i].addr {
                IpAddr::V4(a) => a,
                IpAddr::V6(a) => panic!("IPv4 lab, node address {a}"),
            })
            .collect()
    }

    /// Waits for the router to have exactly `nodes` as next hops of every VIP.
    fn wait_hops(&self, vips: usize, nodes: &[usize], when: &str) -> Duration {
        let want = self.node_addrs(nodes);
        let mut longest = Duration::ZERO;
        for k in 0..vips {
            let took = self.router.wait_next_hops(vip(k), &want, ROUTE_WAIT).unwrap_or_else(|e| panic!("{when}: {e:#}\n{}", self.lab.agent_logs()));
            longest = longest.max(took);
        }
        longest
    }

    /// `CONNS` connections from the far client to `v`, from ports `first..`.
    fn open(&self, v: Ipv4Addr, first: u16) -> Vec<LongConn> {
        (0..CONNS).map(|i| LongConn::open_from(&self.router.client, FAR_CLIENT.into(), v, first + i, Duration::from_secs(3)).unwrap()).collect()
    }

    /// The VIPs on node `i`'s `lo` with the agent's label.
    fn on_lo(&self, i: usize) -> BTreeSet<Ipv4Addr> {
        let o = self.lab.nodes[i].ns.ip(&["-j", "-4", "addr", "show", "dev", "lo"]).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v.as_array()
            .into_iter()
            .flatten()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .filter(|a| a["label"] == "lo:vip")
            .map(|a| a["local"].as_str().unwrap().parse().unwrap())
            .collect()
    }
}

/// Pings every connection; removes and counts those that broke, by whether
/// their backend is `leaver` (the node leaving or joining the set).
fn broken(conns: &mut Vec<LongConn>, leaver: &str) -> (usize, usize) {
    let (mut of_leaver, mut others) = (0, 0);
    conns.retain_mut(|c| {
        let ok = c.ping().is_ok();
        if !ok {
            if c.backend == leaver {
                of_leaver += 1;
            } else {
                others += 1;
            }
        }
        ok
    });
    (of_leaver, others)
}

#[test]
fn every_node_announces_every_vip_and_the_router_spreads_flows_over_all_of_them() {
    let vips = 2;
    let Some(r) = routed(vips, true) else { return };
    let lab = &r.lab;
    lab.wait_converged(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    lab.wait_rings_full(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let took = r.wait_hops(vips, &[0, 1, 2], "at start");
    eprintln!("router: every VIP with 3 next hops {took:?} after the agents converged");
    let every: BTreeSet<Ipv4Addr> = (0..vips).map(vip).collect();
    for i in 0..3 {
        assert_eq!(r.on_lo(i), every, "node-{} holds every VIP on lo", i + 1);
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
    let frames = ingress.per_node().unwrap();
    eprintln!("frames from the router per node: {frames:?}; connections per backend: {backends:?}");
    assert!(frames.values().all(|n| *n > 0), "the router's ECMP sends flows to every node: {frames:?}");
    assert_eq!(backends.len(), 3, "every backend serves some of {} connections: {backends:?}", 2 * CONNS);

    // A node the model leaves out (its label gone) holds nothing: off its lo,
    // out of the router's next hops; back in, announced again.
    write_atomic(&lab.config, &ha_config_of(&lab.spec, &[0, 1])).unwrap();
    let took = r.wait_hops(vips, &[0, 1], "node-3 out of the model");
    assert!(r.on_lo(2).is_empty(), "node-3 withdrew every VIP from lo");
    eprintln!("node-3 out of the model: withdrawn from the router in {took:?}");
    write_atomic(&lab.config, &ha_config_of(&lab.spec, &[0, 1, 2])).unwrap();
    r.wait_hops(vips, &[0, 1, 2], "node-3 back");
    assert_eq!(r.on_lo(2), every);
}

/// Connections broken while node-3 leaves the ECMP set (`set(r, false)`) and
/// rejoins it (`set(r, true)`): of `CONNS` opened before it leaves, and of
/// `CONNS` more opened while it is out (those that stayed on their node when it
/// left would stay there when it rejoins too). Each count is (whose backend is
/// node-3, whose backend is another node).
fn leave_and_rejoin(r: &mut Routed, first_port: u16, set: &mut dyn FnMut(&mut Routed, bool)) -> [(usize, usize); 2] {
    let v = vip(0);
    r.wait_hops(1, &[0, 1, 2], "before node-3 leaves");
    let mut before = r.open(v, first_port);
    assert_eq!(before.iter().map(|c| c.backend.as_str()).collect::<BTreeSet<_>>().len(), 3, "flows reach every backend");
    set(r, false);
    let took = r.wait_hops(1, &[0, 1], "node-3 left");
    let leave = broken(&mut before, "node-3");
    let mut during = r.open(v, first_port + CONNS);
    set(r, true);
    r.wait_hops(1, &[0, 1, 2], "node-3 back");
    let join = broken(&mut during, "node-3");
    let after_join = broken(&mut before, "node-3");
    assert_eq!(after_join, (0, 0), "connections that stayed on their node when node-3 left stay there when it rejoins");
    eprintln!("withdrawn {took:?} after node-3 left");
    [leave, join]
}

#[test]
fn a_node_leaving_and_rejoining_the_ecmp_set_breaks_no_connection_unlike_plain_ecmp() {
    let Some(mut r) = routed(1, false) else { return };
    let v = vip(0);
    let vip_lo = |r: &Routed, i: usize, add: bool| {
        r.lab.nodes[i].ns.ip(&["addr", if add { "add" } else { "del" }, &format!("{v}/32"), "dev", "lo", "label", "lo:vip"]).unwrap();
    };

    // Plain ECMP: the VIP on every node's lo by hand, each node serving what
    // reaches it (kube-proxy without vip's rings); node-3 withdraws it, then
    // announces it again.
    for i in 0..3 {
        vip_lo(&r, i, true);
    }
    let plain = leave_and_rejoin(&mut r, 22000, &mut |r, up| vip_lo(r, 2, up));
    eprintln!("plain ECMP: node-3 leaving broke {:?} of {CONNS} (its own, others'), rejoining {:?} of {CONNS}", plain[0], plain[1]);
    for i in 0..3 {
        vip_lo(&r, i, false);
    }
    r.wait_hops(1, &[], "plain ECMP taken down");

    // vip: the agents hold the VIP on every lo and balance what reaches each
    // node by the shared ring. Node-3's agent stops (SIGTERM: it withdraws the
    // VIP and stays a backend, as in a rolling update), then starts again.
    for i in 0..3 {
        r.lab.start_agent(i).unwrap();
    }
    r.lab.wait_converged(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", r.lab.agent_logs()));
    r.lab.wait_rings_full(&[0, 1, 2], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", r.lab.agent_logs()));
    let with_vip = leave_and_rejoin(&mut r, 24000, &mut |r, up| if up { r.lab.start_agent(2).unwrap() } else { r.lab.stop_agent(2, libc::SIGTERM) });
    eprintln!("vip: node-3 leaving broke {:?} of {CONNS}, rejoining {:?} of {CONNS}", with_vip[0], with_vip[1]);
    assert_eq!(with_vip, [(0, 0); 2], "vip: no connection breaks when a node leaves or rejoins the ECMP set\n{}", r.lab.agent_logs());
    // The baseline moved flows both times, so the zeros above are not for want of a rehash.
    assert!(plain.iter().all(|(a, b)| a + b > 0), "plain ECMP broke none at some step ({plain:?}): the router did not rehash");
}
