//! IPv6 neighbour answers with the real agent, in namespaces this test makes
//! (198.18.0.0/15 for heartbeats, 2001:2::/48 and link-local for IPv6 only;
//! removed on Drop). The hosts hang on macvlans of one parent in bridge mode,
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
/// `v4` and `v6` (CIDR), duplicate address detection off (no waiting for
/// tentative addresses: MLD reports go out from the link-local at once).
fn plug(wire: &NetNs, host: &NetNs, n: usize, v4: &str, v6: &str) {
    let tmp = format!("mv{n}");
    wire.ip(&["link", "add", &tmp, "link", "d0", "type", "macvlan", "mode", "bridge"]).unwrap();
    wire.ip(&["link", "set", &tmp, "netns", &host.name]).unwrap();
    host.ip(&["link", "set", &tmp, "name", "eth0"]).unwrap();
    for k in ["all", "default", "eth0"] {
        host.sysctl(&format!("net.ipv6.conf.{k}.accept_dad"), "0").unwrap();
    }
    host.ip(&["link", "set", "eth0", "up"]).unwrap();
    host.ip(&["addr", "add", v4, "dev", "eth0"]).unwrap();
    host.ip(&["-6", "addr", "add", v6, "dev", "eth0", "nodad"]).unwrap();
}

fn out(ns: &NetNs, args: &[&str]) -> String {
    String::from_utf8_lossy(&ns.ip(args).unwrap().stdout).to_lowercase()
}

/// The client's neighbour entry for the VIP.
fn neighbour(client: &NetNs) -> String {
    out(client, &["-6", "neigh", "show", VIP, "dev", "eth0"])
}

fn agent(node: &NetNs, name: &str, dir: &TempDir, pins: &PinDir) -> AgentProc {
    let d = &dir.0;
    let (config, status) = (d.join("vip.yaml"), d.join(format!("{name}.json")));
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--node-name",
        name,
        "--iface",
        "eth0",
        "--mode",
        "generic", // a macvlan has no native XDP
        "--pin-dir",
        pins.path.to_str().unwrap(),
        "--metrics-addr",
        "off",
        "--status-file",
        status.to_str().unwrap(),
    ];
    AgentProc::start(node, &args, &d.join(format!("{name}.log"))).unwrap()
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
    let wire = NetNs::new("vnw").unwrap();
    // The macvlans' parent: one end of a veth pair, both ends in `wire`.
    wire.ip(&["link", "add", "d0", "type", "veth", "peer", "name", "d1"]).unwrap();
    wire.ip(&["link", "set", "d1", "up"]).unwrap();
    wire.ip(&["link", "set", "d0", "up"]).unwrap();
    let nodes = [NetNs::new("vnn").unwrap(), NetNs::new("vnn").unwrap()];
    let client = NetNs::new("vnc").unwrap();
    plug(&wire, &nodes[0], 0, "198.18.8.1/24", "2001:2::1/64");
    plug(&wire, &nodes[1], 1, "198.18.8.2/24", "2001:2::2/64");
    plug(&wire, &client, 2, "198.18.8.10/24", "2001:2::10/64");
    let dir = TempDir::new("vip-ndp").unwrap();
    let cfg = format!(
        "nodes:\n  - {{name: n1, address: 198.18.8.1}}\n  - {{name: n2, address: 198.18.8.2}}\n\
         pools:\n  - name: v6\n    addresses: [{VIP}]\n    gratuitousArp: {{count: 3, interval: 50ms}}\n\
         services:\n  - {{name: web6, vip: \"{VIP}\", ports: [{PORT}]}}\n\
         announce:\n  holdTime: 600ms\nfailover:\n  heartbeatInterval: 100ms\n  deadAfter: 900ms\n"
    );
    write_atomic(&dir.0.join("vip.yaml"), &cfg).unwrap();
    // Both nodes serve the VIP's port, the VIP on lo (never answered there: Linux
    // answers solicitations only for the receiving interface's addresses).
    for (n, name) in nodes.iter().zip(["n1", "n2"]) {
        n.ip(&["-6", "addr", "add", &format!("{VIP}/128"), "dev", "lo"]).unwrap();
        let l = n.run(|| TcpListener::bind(("::", PORT))).unwrap().unwrap();
        std::thread::spawn(move || serve_name_on(l, name));
    }
    let pins = [PinDir::new().unwrap(), PinDir::new().unwrap()];
    let mut agents = vec![agent(&nodes[0], "n1", &dir, &pins[0]), agent(&nodes[1], "n2", &dir, &pins[1])];
    let logs = |agents: &[AgentProc]| agents.iter().map(|a| a.log_text()).collect::<Vec<_>>().join("\n----\n");
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
