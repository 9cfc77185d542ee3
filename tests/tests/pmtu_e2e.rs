//! Path MTU discovery through a VIP, with the real agents and real frames, in
//! namespaces this test makes (198.18.0.0/15 and 2001:2::/48 only; removed on
//! Drop, also on failure). The HA lab's three nodes hold and serve one IPv4 and
//! one IPv6 VIP; its client namespace is a router here, between the nodes'
//! segment (MTU 1500) and a client whose link from the router has an MTU of
//! 1280. The client fetches 64 KiB from the VIPs over many connections, which
//! the holder spreads over the nodes. Each backend answers the client directly
//! with full 1500-byte segments the router cannot forward: its "fragmentation
//! needed" / "packet too big" goes to the VIP, so to its holder, whose data path
//! must send it on to the backend that serves the flow. Without that, every
//! connection another node serves stalls on its first full segment.
use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use vip_tests::{
    agent::{agent_bin, wait_for, write_atomic},
    halab::{ha_config, metric, vip, HaLab, HaSpec, Naming, CLIENT as ROUTER},
    lab::wire_host,
    netns::{privileged, veth, NetNs},
};

const PORT: u16 = 8081;
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x80);
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xfe);
/// The client's network, behind the router.
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 2);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 7, 0, 0, 0, 2);
/// The MTU of the router's link to the client (IPv6's minimum); the nodes' is 1500.
const NARROW_MTU: &str = "1280";
const BODY: usize = 64 * 1024;
const FETCHES: usize = 24;

/// Serves its node's name, a newline and BODY bytes to each connection on PORT
/// (both families), until `stop` or 120 s. A thread per connection: a stalled
/// one must not hold up the others.
fn bulk_server(ns: &NetNs, name: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    ns.spawn(move || {
        let l = TcpListener::bind((Ipv6Addr::UNSPECIFIED, PORT)).expect("bind the bulk server");
        l.set_nonblocking(true).expect("nonblocking");
        let deadline = Instant::now() + Duration::from_secs(120);
        while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            match l.accept() {
                Ok((mut s, _)) => {
                    let mut body = format!("{name}\n").into_bytes();
                    body.resize(body.len() + BODY, b'x');
                    std::thread::spawn(move || {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_write_timeout(Some(Duration::from_secs(20)));
                        let _ = s.write_all(&body);
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    })
    .expect("a server thread in the node's namespace")
}

/// One fetch from the client's namespace: the name of the node that served the
/// whole body, else what went wrong (a stall is a read timing out).
fn fetch(to: SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5)).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(15);
    let (mut got, mut buf) = (Vec::new(), [0u8; 16384]);
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(format!("stalled after {} bytes (nothing for 5 s)", got.len()))
            }
            Err(e) => return Err(format!("after {} bytes: {e}", got.len())),
        }
        if Instant::now() > deadline {
            return Err(format!("{} bytes in 15 s", got.len()));
        }
    }
    let nl = got.iter().position(|b| *b == b'\n').ok_or("no name line")?;
    let name = String::from_utf8_lossy(&got[..nl]).into_owned();
    match got.len() - nl - 1 {
        BODY => Ok(name),
        n => Err(format!("{name} sent {n} bytes, not {BODY}")),
    }
}

/// FETCHES concurrent fetches from `vip`: the count per serving node, or the
/// failures with the node each came from when it said.
fn fetch_all(client: &NetNs, vip: IpAddr) -> Result<BTreeMap<String, usize>, Vec<String>> {
    let threads: Vec<_> = (0..FETCHES).map(|_| client.spawn(move || fetch(SocketAddr::from((vip, PORT)))).expect("a client thread")).collect();
    let (mut by, mut failed) = (BTreeMap::new(), Vec::new());
    for t in threads {
        match t.join().unwrap_or_else(|_| Err("fetch thread panicked".into())) {
            Ok(name) => *by.entry(name).or_default() += 1,
            Err(e) => failed.push(e),
        }
    }
    if failed.is_empty() {
        Ok(by)
    } else {
        Err(failed)
    }
}

#[test]
fn path_mtu_discovery_works_through_backends_that_do_not_hold_the_vip() {
    if !privileged() {
        return;
    }
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let spec = HaSpec { nodes: 3, vips: 1, ports: vec![PORT], health_check: false, ..Default::default() };
    let mut lab = HaLab::build(spec, Naming::Unique, Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap();
    // One IPv6 VIP besides the lab's IPv4 one: a pool and a service of its own.
    let cfg = ha_config(&lab.spec).replace(
        "services:\n",
        &format!("  - name: lab6\n    addresses: [\"{VIP6}\"]\n    nodeSelector: {{lab: \"yes\"}}\nservices:\n  - {{name: web6, vip: \"{VIP6}\", ports: [{PORT}]}}\n"),
    );
    write_atomic(&lab.config, &cfg).unwrap();

    // The router: the lab's client namespace, on the segment, with the narrow link.
    let router = &lab.client;
    let client = NetNs::new("vpc").unwrap();
    veth(router, "eth1", &client, "eth0").unwrap();
    wire_host(&client, "eth0").unwrap();
    router.ip(&["link", "set", "eth1", "mtu", NARROW_MTU]).unwrap();
    router.ip(&["addr", "add", "198.19.7.1/24", "dev", "eth1"]).unwrap();
    router.ip(&["-6", "addr", "add", &format!("{ROUTER6}/64"), "dev", "eth0", "nodad"]).unwrap();
    router.ip(&["-6", "addr", "add", "2001:2:0:7::1/64", "dev", "eth1", "nodad"]).unwrap();
    router.sysctl("net.ipv4.ip_forward", "1").unwrap();
    router.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
    // Every error the router owes is sent: no per-destination or global ICMP rate
    // limit (per namespace), which would leave the outcome to timing.
    for (k, v) in [
        ("net.ipv4.icmp_ratelimit", "0"),
        ("net.ipv4.icmp_ratemask", "0"),
        ("net.ipv4.icmp_msgs_per_sec", "100000"),
        ("net.ipv4.icmp_msgs_burst", "100000"),
        ("net.ipv6.icmp.ratelimit", "0"),
        ("net.ipv6.icmp.ratemask", ""),
    ] {
        router.sysctl(k, v).unwrap();
    }
    client.ip(&["addr", "add", &format!("{CLIENT}/24"), "dev", "eth0"]).unwrap();
    client.ip(&["-6", "addr", "add", &format!("{CLIENT6}/64"), "dev", "eth0", "nodad"]).unwrap();
    client.ip(&["route", "add", "198.18.0.0/16", "via", "198.19.7.1"]).unwrap();
    client.ip(&["-6", "route", "add", "2001:2::/64", "via", "2001:2:0:7::1"]).unwrap();

    // The nodes: the IPv6 VIP on lo too, the client's networks through the router,
    // no MTU probing (only ICMP can tell them the path's MTU), a bulk server each.
    let stop = Arc::new(AtomicBool::new(false));
    let mut servers = Vec::new();
    for (i, n) in lab.nodes.iter().enumerate() {
        n.ns.ip(&["-6", "addr", "add", &format!("2001:2::{}/64", 11 + i), "dev", "eth0", "nodad"]).unwrap();
        n.ns.ip(&["-6", "addr", "add", &format!("{VIP6}/128"), "dev", "lo"]).unwrap();
        n.ns.ip(&["route", "add", "198.19.7.0/24", "via", &ROUTER.to_string()]).unwrap();
        n.ns.ip(&["-6", "route", "add", "2001:2:0:7::/64", "via", &ROUTER6.to_string()]).unwrap();
        n.ns.sysctl("net.ipv4.tcp_mtu_probing", "0").unwrap();
        servers.push(bulk_server(&n.ns, n.name.clone(), stop.clone()));
    }
    for i in 0..lab.nodes.len() {
        lab.start_agent(i).unwrap();
    }
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged(&all, Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    // Both services in every node's rings, with every node as a backend.
    let ready = wait_for(Duration::from_secs(20), || {
        all.iter().all(|&i| lab.status(i).is_some_and(|s| s.services.len() == 2 && s.services.iter().all(|x| x.backends.len() == 3))).then_some(())
    });
    assert!(ready.is_some(), "rings not full within 20 s\n{}", lab.agent_logs());
    let holder6 = wait_for(Duration::from_secs(20), || {
        let held: Vec<usize> = all.iter().copied().filter(|&i| lab.status(i).is_some_and(|s| s.held.contains(&IpAddr::V6(VIP6)))).collect();
        (held.len() == 1).then(|| held[0])
    })
    .unwrap_or_else(|| panic!("no single holder of {VIP6}\n{}", lab.agent_logs()));

    for (vip, holder) in [(IpAddr::V4(vip(0)), lab.index_of(&owners[&vip(0)])), (IpAddr::V6(VIP6), holder6)] {
        let counted = || metric(&lab.metrics(holder), "vip_xdp_packets_total{reason=\"forwarded_icmp_error\"}").unwrap_or(0.0);
        let before = counted();
        let by = fetch_all(&client, vip).unwrap_or_else(|failed| {
            panic!("{} of {FETCHES} fetches from {vip} (held by {}) failed: {failed:?}\n{}", failed.len(), lab.nodes[holder].name, lab.agent_logs())
        });
        let others: usize = by.iter().filter(|(name, _)| **name != lab.nodes[holder].name).map(|(_, n)| n).sum();
        assert!(others > 0, "{vip}: every fetch was served by its holder {}: {by:?}; the test proves nothing", lab.nodes[holder].name);
        assert!(counted() > before, "{vip}: the holder forwarded no ICMP error, yet {others} fetches came from other nodes: {by:?}");
        eprintln!(
            "{vip}: {FETCHES} fetches of {BODY} bytes through a {NARROW_MTU}-byte link, served {by:?}; {} ICMP errors forwarded by {}",
            counted() - before,
            lab.nodes[holder].name
        );
    }
    stop.store(true, Ordering::Relaxed);
    for s in servers {
        let _ = s.join();
    }
}
