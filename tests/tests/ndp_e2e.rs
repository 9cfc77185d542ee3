//! IPv6 neighbour answers with the real agent, in namespaces this test makes
//! (198.18.0.0/15 for heartbeats in the first test, 2001:2::/48 and link-local for
//! IPv6; removed on Drop). The hosts hang on macvlans of one parent in bridge mode,
//! which deliver a multicast frame only to the macvlans that joined its group:
//! a solicitation reaches the holder only through the solicited-node group its
//! agent joins (a veth would let everything through).
//! - two agents, one IPv6 VIP with a TCP service on both nodes (the VIP on their
//!   `lo`, as a backend has it): the client's `ip -6 neigh` resolves it to the
//!   holder's MAC (the data path answers), the VIP is on no interface the
//!   solicitations arrive on, and only the holder is in the group; connections to
//!   the VIP are balanced over both nodes (lb6, real frames);
//! - the holder is killed: the other takes the VIP over and its unsolicited
//!   Neighbor Advertisement (Override) moves the client's entry, without the
//!   client asking; connections reach the live node alone.
//! - IPv6-only nodes (no IPv4 address anywhere in the lab, no `--iface`: each
//!   agent finds its home and the pool's interface by IPv6 network): heartbeats,
//!   HTTP health checks and forwarding over IPv6, the peer's MAC from the kernel's
//!   neighbour table; a node whose check fails leaves the ring and comes back
//!   when it passes; connections spread over both nodes; the holder killed, the
//!   other takes over.
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    time::Duration,
};

use vip_tests::{
    agent::{wait_for, write_atomic, AgentProc, TempDir},
    halab::serve_name_on,
    netns::{hex_mac, privileged, NetNs, PinDir},
};

const VIP: &str = "2001:2::100";
const PORT: u16 = 8080;

/// `n` connections from the client to the VIP's service, each with a port of its
/// own: how many each backend answered (None: a connection failed, with why).
fn spread(client: &NetNs, n: usize) -> Result<BTreeMap<String, usize>, String> {
    let mut by = BTreeMap::new();
    for _ in 0..n {
        let name = client
            .run(|| -> std::io::Result<String> {
                let to = SocketAddr::from((VIP.parse::<Ipv6Addr>().unwrap(), PORT));
                let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2))?;
                s.set_read_timeout(Some(Duration::from_secs(2)))?;
                s.write_all(b"hello\n")?;
                let mut line = String::new();
                BufReader::new(s).read_line(&mut line)?;
                Ok(line.trim().to_owned())
            })
            .map_err(|e| format!("{e:#}"))?
            .map_err(|e| e.to_string())?;
        *by.entry(name).or_default() += 1;
    }
    Ok(by)
}
/// `host`'s eth0: a bridge-mode macvlan of `wire`'s parent d0, with
/// `v4` (if any) and `v6` (CIDR), duplicate address detection off (no waiting for
/// tentative addresses: MLD reports go out from the link-local at once).
fn plug(wire: &NetNs, host: &NetNs, n: usize, v4: Option<&str>, v6: &str) {
    let tmp = format!("mv{n}");
    wire.ip(&["link", "add", &tmp, "link", "d0", "type", "macvlan", "mode", "bridge"]).unwrap();
    wire.ip(&["link", "set", &tmp, "netns", &host.name]).unwrap();
    host.ip(&["link", "set", &tmp, "name", "eth0"]).unwrap();
    for k in ["all", "default", "eth0"] {
        host.sysctl(&format!("net.ipv6.conf.{k}.accept_dad"), "0").unwrap();
    }
    host.ip(&["link", "set", "eth0", "up"]).unwrap();
    if let Some(v4) = v4 {
        host.ip(&["addr", "add", v4, "dev", "eth0"]).unwrap();
    }
    host.ip(&["-6", "addr", "add", v6, "dev", "eth0", "nodad"]).unwrap();
}

/// The lab: `wire` (holding the macvlans' parent, one end of a veth pair with both
/// ends in it), two nodes (2001:2::1 and ::2) and a client (::10) on it, each
/// also on 198.18.8.0/24 (.1, .2, .10) with `v4`. Keep `wire` alive with the rest.
fn macvlan_lab(v4: bool) -> (NetNs, [NetNs; 2], NetNs) {
    let wire = NetNs::new("vnw").unwrap();
    wire.ip(&["link", "add", "d0", "type", "veth", "peer", "name", "d1"]).unwrap();
    wire.ip(&["link", "set", "d1", "up"]).unwrap();
    wire.ip(&["link", "set", "d0", "up"]).unwrap();
    let nodes = [NetNs::new("vnn").unwrap(), NetNs::new("vnn").unwrap()];
    let client = NetNs::new("vnc").unwrap();
    for (n, (host, h)) in [(&nodes[0], 1), (&nodes[1], 2), (&client, 10)].into_iter().enumerate() {
        let a4 = v4.then(|| format!("198.18.8.{h}/24"));
        plug(&wire, host, n, a4.as_deref(), &format!("2001:2::{h}/64"));
    }
    (wire, nodes, client)
}

/// Both nodes serve the VIP's port, the VIP on lo (never answered there: Linux
/// answers solicitations only for the receiving interface's addresses).
fn serve_vip(nodes: &[NetNs; 2]) {
    for (n, name) in nodes.iter().zip(["n1", "n2"]) {
        n.ip(&["-6", "addr", "add", &format!("{VIP}/128"), "dev", "lo"]).unwrap();
        let l = n.run(|| TcpListener::bind(("::", PORT))).unwrap().unwrap();
        std::thread::spawn(move || serve_name_on(l, name));
    }
}

/// The agents' logs, for a failure's message.
fn logs(agents: &[AgentProc]) -> String {
    agents.iter().map(|a| a.log_text()).collect::<Vec<_>>().join("\n----\n")
}

fn out(ns: &NetNs, args: &[&str]) -> String {
    String::from_utf8_lossy(&ns.ip(args).unwrap().stdout).to_lowercase()
}

/// The client's neighbour entry for the VIP.
fn neighbour(client: &NetNs) -> String {
    out(client, &["-6", "neigh", "show", VIP, "dev", "eth0"])
}

/// The agent of node `name`; with `--iface eth0`, or (`by_address`) finding its
/// interfaces by address.
fn agent(node: &NetNs, name: &str, dir: &TempDir, pins: &PinDir, by_address: bool) -> AgentProc {
    let d = &dir.0;
    let (config, status) = (d.join("vip.yaml"), d.join(format!("{name}.json")));
    let iface: &[&str] = if by_address { &[] } else { &["--iface", "eth0"] };
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--node-name",
        name,
        "--mode",
        "generic", // a macvlan has no native XDP
        "--pin-dir",
        pins.path.to_str().unwrap(),
        "--metrics-addr",
        "off",
        "--status-file",
        status.to_str().unwrap(),
    ];
    AgentProc::start(node, &[iface, &args].concat(), &d.join(format!("{name}.log"))).unwrap()
}

/// Whether `ns`'s eth0 is in the VIP's solicited-node group.
fn in_group(ns: &NetNs) -> bool {
    let group = vip_agent::ha::groups::solicited_node(VIP.parse::<Ipv6Addr>().unwrap());
    out(ns, &["-6", "maddr", "show", "dev", "eth0"]).contains(&group.to_string())
}

#[test]
fn an_ipv6_vip_is_answered_through_its_group_and_a_takeover_moves_the_client() {
    if !privileged() {
        return;
    }
    let (_wire, nodes, client) = macvlan_lab(true);
    let dir = TempDir::new("vip-ndp").unwrap();
    let cfg = format!(
        "nodes:\n  - {{name: n1, address: 198.18.8.1}}\n  - {{name: n2, address: 198.18.8.2}}\n\
         pools:\n  - name: v6\n    addresses: [{VIP}]\n    gratuitousArp: {{count: 3, interval: 50ms}}\n\
         services:\n  - {{name: web6, vip: \"{VIP}\", ports: [{PORT}]}}\n\
         announce:\n  holdTime: 600ms\nfailover:\n  heartbeatInterval: 100ms\n  deadAfter: 900ms\n"
    );
    write_atomic(&dir.0.join("vip.yaml"), &cfg).unwrap();
    serve_vip(&nodes);
    let pins = [PinDir::new().unwrap(), PinDir::new().unwrap()];
    let mut agents = vec![agent(&nodes[0], "n1", &dir, &pins[0], false), agent(&nodes[1], "n2", &dir, &pins[1], false)];
    // Both running and agreed: exactly one holds it.
    let holder = wait_for(Duration::from_secs(15), || {
        let held: Vec<usize> = (0..2).filter(|&i| in_group(&nodes[i])).collect();
        (held.len() == 1).then(|| held[0])
    });
    let Some(h) = holder else { panic!("no single holder in the VIP's group; agents:\n{}", logs(&agents)) };
    let (h_mac, other) = (hex_mac(nodes[h].mac("eth0").unwrap()).to_lowercase(), 1 - h);
    assert!(!out(&nodes[h], &["-6", "addr", "show", "dev", "eth0"]).contains(VIP), "the VIP must not be on eth0 (no kernel answer, no DAD)");

    // The client resolves the VIP: its solicitation (to the group) reaches the
    // holder's XDP program alone, whose advertisement completes the entry.
    // Bounded attempts.
    let resolved = wait_for(Duration::from_secs(10), || {
        let _ = client.cmd("ping").args(["-6", "-c1", "-W1", VIP]).output();
        let n = neighbour(&client);
        (n.contains(&h_mac) && (n.contains("reachable") || n.contains("stale") || n.contains("delay"))).then_some(n)
    });
    assert!(resolved.is_some(), "the client's entry for {VIP}: {:?}; agents:\n{}", neighbour(&client), logs(&agents));
    agents.iter_mut().for_each(|a| a.check_alive().unwrap());
    // Balanced over both nodes: the holder forwards about half to the other.
    let names = ["n1", "n2"];
    let both = wait_for(Duration::from_secs(10), || spread(&client, 40).ok().filter(|by| by.len() == 2));
    assert!(both.is_some(), "connections to [{VIP}]:{PORT} not spread over both nodes: {:?}; agents:\n{}", spread(&client, 40), logs(&agents));

    // Takeover: the holder's agent dies; once its peer counts it dead, the peer
    // joins the group and announces. The client sends nothing: only the
    // unsolicited advertisement (Override) can change its entry's MAC.
    agents[h].signal(libc::SIGKILL);
    let o_mac = hex_mac(nodes[other].mac("eth0").unwrap()).to_lowercase();
    let moved = wait_for(Duration::from_secs(10), || neighbour(&client).contains(&o_mac).then_some(()));
    assert!(moved.is_some(), "the client's entry still {:?} after the takeover; agents:\n{}", neighbour(&client), logs(&agents));
    assert!(in_group(&nodes[other]), "the new holder is not in the VIP's group");
    // The killed agent's socket closed with it: its interface left the group.
    assert!(!in_group(&nodes[h]), "the dead holder's interface is still in the VIP's group");
    // And the new holder answers solicitations too.
    client.ip(&["-6", "neigh", "flush", "dev", "eth0"]).unwrap();
    let again = wait_for(Duration::from_secs(10), || {
        let _ = client.cmd("ping").args(["-6", "-c1", "-W1", VIP]).output();
        neighbour(&client).contains(&o_mac).then_some(())
    });
    assert!(again.is_some(), "the new holder does not answer: {:?}; agents:\n{}", neighbour(&client), logs(&agents));
    // Its ring no longer has the dead node: every connection reaches the live one.
    let live = wait_for(Duration::from_secs(10), || spread(&client, 20).ok().filter(|by| by.keys().eq([names[other]])));
    assert!(live.is_some(), "after the takeover: {:?}; agents:\n{}", spread(&client, 20), logs(&agents));
}

const HEALTH_PORT: u16 = 8081;

/// A node's HTTP health endpoint on `HEALTH_PORT` (serve_name_on answers GETs).
fn serve_health(n: &NetNs, name: &'static str) {
    let l = n.run(|| TcpListener::bind(("::", HEALTH_PORT))).unwrap().unwrap();
    std::thread::spawn(move || serve_name_on(l, name));
}

/// Node `name`'s status file, as its agent wrote it last.
fn status(dir: &TempDir, name: &str) -> Option<vip_agent::status::Status> {
    serde_json::from_str(&std::fs::read_to_string(dir.0.join(format!("{name}.json"))).ok()?).ok()
}

#[test]
fn ipv6_only_nodes_heartbeat_check_forward_and_take_over() {
    if !privileged() {
        return;
    }
    let (_wire, nodes, client) = macvlan_lab(false);
    for ns in [&nodes[0], &nodes[1], &client] {
        assert!(!out(ns, &["-4", "addr", "show", "dev", "eth0"]).contains("inet "), "an IPv4 address in an IPv6-only lab");
    }
    let dir = TempDir::new("vip-ndp6").unwrap();
    // No MACs: each agent reads its peer's from the neighbour table.
    let cfg = format!(
        "nodes:\n  - {{name: n1, address: \"2001:2::1\"}}\n  - {{name: n2, address: \"2001:2::2\"}}\n\
         pools:\n  - name: v6\n    addresses: [{VIP}]\n    gratuitousArp: {{count: 3, interval: 50ms}}\n\
         services:\n  - name: web6\n    vip: \"{VIP}\"\n    ports: [{PORT}]\n    healthCheck: {{type: http, port: {HEALTH_PORT}, path: /healthz, interval: 100ms, timeout: 100ms, rise: 2, fall: 2}}\n\
         announce:\n  holdTime: 600ms\nfailover:\n  heartbeatInterval: 100ms\n  deadAfter: 900ms\n"
    );
    write_atomic(&dir.0.join("vip.yaml"), &cfg).unwrap();
    serve_vip(&nodes);
    // n2's health endpoint is not up yet: its check fails.
    serve_health(&nodes[0], "n1");
    let pins = [PinDir::new().unwrap(), PinDir::new().unwrap()];
    let started = std::time::Instant::now();
    let mut agents = vec![agent(&nodes[0], "n1", &dir, &pins[0], true), agent(&nodes[1], "n2", &dir, &pins[1], true)];
    // Heartbeats over IPv6: both agree on the VIP's owner (each would take it if it
    // did not hear the other), and exactly one holds it.
    let names = ["n1", "n2"];
    let vip: std::net::IpAddr = VIP.parse().unwrap();
    let owner_seen_by = |i: usize| status(&dir, names[i]).and_then(|s| s.owners.get(&vip).cloned());
    let holder = wait_for(Duration::from_secs(15), || {
        let held: Vec<usize> = (0..2).filter(|&i| in_group(&nodes[i])).collect();
        let agreed = owner_seen_by(0).is_some() && owner_seen_by(0) == owner_seen_by(1);
        (agreed && held.len() == 1 && owner_seen_by(0).as_deref() == Some(names[held[0]])).then(|| held[0])
    });
    let Some(h) = holder else { panic!("no single holder both agents agree on; agents:\n{}", logs(&agents)) };
    let other = 1 - h;
    agents.iter_mut().for_each(|a| a.check_alive().unwrap());
    // n2 fails its check (over IPv6, HTTP) and n1 passes: connections reach n1 alone.
    let health = |i: usize, node: &str| status(&dir, names[i])?.health.iter().find(|c| c.node == node).map(|c| c.healthy);
    let checked = wait_for(Duration::from_secs(10), || (health(h, "n1") == Some(true) && health(h, "n2") == Some(false)).then_some(()));
    assert!(checked.is_some(), "the holder's checks: {:?}; agents:\n{}", status(&dir, names[h]).map(|s| s.health), logs(&agents));
    let only_n1 = wait_for(Duration::from_secs(10), || spread(&client, 20).ok().filter(|by| by.keys().eq(["n1"])));
    assert!(only_n1.is_some(), "n2's failing check: {:?}; agents:\n{}", spread(&client, 20), logs(&agents));
    // Its check passes: back in the ring; the holder forwards over IPv6 to the other node's MAC.
    serve_health(&nodes[1], "n2");
    let both = wait_for(Duration::from_secs(10), || spread(&client, 40).ok().filter(|by| by.len() == 2));
    assert!(both.is_some(), "connections to [{VIP}]:{PORT} not spread over both nodes: {:?}; agents:\n{}", spread(&client, 40), logs(&agents));
    // The holder knows its peer by its IPv6 address and the MAC the neighbour table gave.
    // The status file is written every so often: the check's success may reach the
    // ring before it reaches the file.
    let healthy = wait_for(Duration::from_secs(5), || status(&dir, names[h]).filter(|s| s.health.iter().all(|c| c.healthy)));
    let st = healthy.unwrap_or_else(|| panic!("the holder's checks after n2's passed: {:?}", status(&dir, names[h]).map(|s| s.health)));
    let peer = st.nodes.iter().find(|n| n.node == names[other]).unwrap_or_else(|| panic!("{:?}", st.nodes));
    let o_mac = hex_mac(nodes[other].mac("eth0").unwrap()).to_lowercase();
    assert_eq!((peer.addr.to_string(), peer.mac.as_deref().map(str::to_lowercase)), (format!("2001:2::{}", other + 1), Some(o_mac.clone())));
    // Still one holder, agreed on, well past the dead_after for which agents presume
    // their peers alive: the agreement is the heartbeats'.
    std::thread::sleep(Duration::from_secs(3).saturating_sub(started.elapsed()));
    assert!(in_group(&nodes[h]) && !in_group(&nodes[other]), "the holder changed; agents:\n{}", logs(&agents));
    assert_eq!((owner_seen_by(0), owner_seen_by(1)), (Some(names[h].to_owned()), Some(names[h].to_owned())), "agents:\n{}", logs(&agents));

    // Takeover: the holder's agent dies; the other, hearing no heartbeat, holds
    // the VIP and serves every connection, and the former holder's node stays a
    // backend: its health target answers, its data path and stack serve on.
    agents[h].signal(libc::SIGKILL);
    let moved = wait_for(Duration::from_secs(10), || neighbour(&client).contains(&o_mac).then_some(()));
    assert!(moved.is_some(), "the client's entry still {:?} after the takeover; agents:\n{}", neighbour(&client), logs(&agents));
    assert!(in_group(&nodes[other]), "the new holder is not in the VIP's group");
    let live = wait_for(Duration::from_secs(10), || spread(&client, 20).ok().filter(|by| by.keys().eq(names)));
    assert!(live.is_some(), "after the takeover: {:?}; agents:\n{}", spread(&client, 20), logs(&agents));
    // The status file follows the takeover when it is next written.
    let owned = wait_for(Duration::from_secs(5), || (owner_seen_by(other).as_deref() == Some(names[other])).then_some(()));
    assert!(owned.is_some(), "the new holder's status names {:?} as owner; agents:\n{}", owner_seen_by(other), logs(&agents));
}
