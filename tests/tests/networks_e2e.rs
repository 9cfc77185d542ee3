//! Pools on several networks: two nodes on two L2 segments (`eth0`, `eth1`), a
//! pool on each found by its addresses (no `--iface`, no `interfaces:`), and a
//! third pool on VLAN 30 of the first segment (`vlan: 30`), one VIP each. Every
//! VIP is answered on its own network only (one MAC, the owner's interface
//! there), by no other, and requests tagged for a VLAN no pool lives on get no
//! answer; connections to each VIP spread over both nodes, forwards reaching
//! backends untagged over the nodes' home segment. The lab kernel has no 802.1Q
//! interfaces (CONFIG_VLAN_8021Q is off), so the VLAN's client is a raw-frame
//! tap, and backends answer its connections on the untagged segment, as a router
//! between the VLANs would carry them. Real agents, real packets, lab addresses only.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddr},
    sync::{atomic::AtomicBool, Arc},
    time::Duration,
};

use vip_agent::status::Status;
use vip_tests::{
    agent::{agent_bin, wait_for, write_atomic, AgentProc},
    frames,
    lab::{accept_vip, fetch, name_server, xdp_mode_arg, Segment},
    netns::{arping, hex_mac, privileged, NetNs, PinDir},
    tap::Tap,
};

const VIP_A: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 200);
const VIP_B: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 200);
const VIP_V: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 200);
const VLAN: u16 = 30;
const CLIENT_V: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 100);

const CONFIG: &str = "\
nodes:
  - {name: n1, address: 198.18.0.11}
  - {name: n2, address: 198.18.0.12}
pools:
  - {name: a, addresses: [198.18.0.200-198.18.0.201]}
  - {name: b, addresses: [198.18.1.200-198.18.1.201]}
  - {name: v, addresses: [198.18.3.200-198.18.3.201], vlan: 30}
services:
  - {name: sa, vip: 198.18.0.200, ports: [80], tableSize: 251}
  - {name: sb, vip: 198.18.1.200, ports: [80], tableSize: 251}
  - {name: sv, vip: 198.18.3.200, ports: [80], tableSize: 251}
";

/// The MACs answering ARP for `vip` from `ns` out of `iface` (as arping prints them).
fn answers(ns: &NetNs, iface: &str, vip: Ipv4Addr) -> BTreeSet<String> {
    let (_, out) = arping(ns, iface, vip);
    out.lines().filter(|l| l.contains("reply from")).filter_map(|l| Some(l.split('[').nth(1)?.split(']').next()?.to_owned())).collect()
}

fn mac(ns: &NetNs, iface: &str) -> String {
    hex_mac(ns.mac(iface).unwrap())
}

/// Node names answering `count` connections from `ns` (source `src`) to `vip`:80.
fn spread(ns: &NetNs, src: Ipv4Addr, vip: Ipv4Addr, first_port: u16, count: u16) -> BTreeMap<String, u32> {
    ns.run(move || {
        let mut seen = BTreeMap::new();
        for p in first_port..first_port + count {
            let name = fetch(src, p, SocketAddr::from((vip, 80))).unwrap_or_else(|e| format!("error: {e}"));
            *seen.entry(name).or_insert(0) += 1;
        }
        seen
    })
    .unwrap()
}

struct Node {
    agent: Option<AgentProc>,
    ns: NetNs,
    status: std::path::PathBuf,
    _pins: PinDir,
}

#[test]
fn vips_live_on_their_own_segment_or_vlan_and_spread_over_every_node() {
    if !privileged() {
        return;
    }
    let exe = agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let tmp = std::env::temp_dir().join(vip_tests::netns::unique("vip-networks-"));
    std::fs::create_dir_all(&tmp).unwrap();
    let config = tmp.join("vip.yaml");
    write_atomic(&config, CONFIG).unwrap();

    let (seg_a, seg_b) = (Segment::new().unwrap(), Segment::new().unwrap());
    let client_a = seg_a.host("vca", "198.18.0.100/24").unwrap();
    // The VLAN client's address, for the backends' answers on the untagged segment.
    client_a.ip(&["addr", "add", &format!("{CLIENT_V}/32"), "dev", "eth0"]).unwrap();
    let client_b = seg_b.host("vcb", "198.18.1.100/24").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut nodes = Vec::new();
    let mut servers = Vec::new();
    for i in 0..2u8 {
        let name = format!("n{}", i + 1);
        let ns = seg_a.host("vn", &format!("198.18.0.{}/24", 11 + i)).unwrap();
        let ns = seg_b.plug_as(ns, "eth1", &format!("198.18.1.{}/24", 11 + i)).unwrap();
        ns.ip(&["route", "add", &format!("{CLIENT_V}/32"), "dev", "eth0"]).unwrap();
        for v in [VIP_A, VIP_B, VIP_V] {
            accept_vip(&ns, v).unwrap();
        }
        servers.push(name_server(&ns, 80, name.clone(), stop.clone()).unwrap());
        let pins = PinDir::new().unwrap();
        let status = tmp.join(format!("{name}.status.json"));
        let log = tmp.join(format!("{name}.log"));
        let args = [
            "--node-name",
            &name,
            "--mode",
            xdp_mode_arg(),
            "--pin-dir",
            pins.path.to_str().unwrap(),
            "--status-file",
            status.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--trusted-segment",
            "--metrics-addr",
            "off",
        ];
        let agent = AgentProc::start(&ns, &args, &log).unwrap();
        nodes.push(Node { agent: Some(agent), ns, status, _pins: pins });
    }
    let logs = |nodes: &[Node]| nodes.iter().filter_map(|n| n.agent.as_ref()).map(|a| a.log_text()).collect::<Vec<_>>().join("\n---\n");
    let status = |n: &Node| -> Option<Status> { serde_json::from_str(&std::fs::read_to_string(&n.status).ok()?).ok() };
    // Converged: each pool address (two per pool) held by exactly one node.
    let owners = wait_for(Duration::from_secs(15), || {
        let mut owner = BTreeMap::new();
        for (i, n) in nodes.iter().enumerate() {
            let s = status(n)?;
            if s.host_problems.iter().any(|p| p.contains("interface")) {
                return None;
            }
            for v in s.held {
                if owner.insert(v, i).is_some() {
                    return None;
                }
            }
        }
        (owner.len() == 6).then_some(owner)
    });
    let owners = owners.unwrap_or_else(|| panic!("VIPs not held once each within 15 s; logs:\n{}", logs(&nodes)));
    for n in &nodes {
        let s = status(n).unwrap();
        assert!(s.host_problems.is_empty(), "host problems: {:?}", s.host_problems);
    }
    let owner = |v: Ipv4Addr| &nodes[owners[&v.into()]].ns;

    // Each VIP is answered on its own network, by its owner's interface there, only.
    assert_eq!(answers(&client_a, "eth0", VIP_A), BTreeSet::from([mac(owner(VIP_A), "eth0")]), "VIP a on segment A");
    assert_eq!(answers(&client_b, "eth0", VIP_B), BTreeSet::from([mac(owner(VIP_B), "eth1")]), "VIP b on segment B");
    for (ns, iface, vip, what) in [
        (&client_a, "eth0", VIP_B, "VIP b on segment A"),
        (&client_a, "eth0", VIP_V, "VIP v untagged on segment A"),
        (&client_b, "eth0", VIP_A, "VIP a on segment B"),
    ] {
        assert_eq!(answers(ns, iface, vip), BTreeSet::new(), "{what}: answered");
    }
    // Tagged requests: VIP v is answered in VLAN 30 alone, by its owner; nothing
    // else is answered in a VLAN (VLAN 4000: no pool lives there).
    let me = client_a.mac("eth0").unwrap();
    let owner_v = owner(VIP_V).mac("eth0").unwrap();
    let tagged_replies = client_a
        .run(move || {
            let tap = Tap::open("eth0").unwrap();
            let mut out = Vec::new();
            for (vlan, vip) in [(VLAN, VIP_V), (VLAN, VIP_A), (4000, VIP_A), (4000, VIP_V)] {
                for _ in 0..2 {
                    tap.send(&frames::arp_request(me, CLIENT_V, vip, Some(vlan))).unwrap();
                }
                let replies = tap.collect(Duration::from_millis(500), |s| s.frame.len() >= 42 && s.frame[12..14] == [0x08, 0x06] && s.frame[20..22] == [0, 2]);
                let from: BTreeSet<([u8; 6], Option<u16>)> = replies.iter().map(|s| (s.frame[22..28].try_into().unwrap(), s.vlan)).collect();
                out.push((vlan, vip, from));
            }
            out
        })
        .unwrap();
    for (vlan, vip, from) in tagged_replies {
        let want = if (vlan, vip) == (VLAN, VIP_V) { BTreeSet::from([(owner_v, Some(VLAN))]) } else { BTreeSet::new() };
        assert_eq!(from, want, "ARP for {vip} in VLAN {vlan}: (MAC, VLAN) of the replies");
    }
    // The agent turned receive VLAN stripping off where it attached.
    for n in &nodes {
        let o = n.ns.cmd("ethtool").args(["-k", "eth0"]).output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.lines().any(|l| l.trim() == "rx-vlan-offload: off"), "rx VLAN stripping left on:\n{text}");
    }

    // Connections to each VIP spread over both nodes.
    for (ns, src, vip, port) in [(&client_a, Ipv4Addr::new(198, 18, 0, 100), VIP_A, 40000), (&client_b, Ipv4Addr::new(198, 18, 1, 100), VIP_B, 41000)] {
        let seen = spread(ns, src, vip, port, 24);
        assert_eq!(seen.keys().map(String::as_str).collect::<Vec<_>>(), ["n1", "n2"], "{vip}: {seen:?}; logs:\n{}", logs(&nodes));
    }
    // SYNs tagged VLAN 30 to VIP v reach both nodes' stacks: each answers its
    // share with a SYN-ACK from its own MAC.
    let node_macs: BTreeSet<[u8; 6]> = nodes.iter().map(|n| n.ns.mac("eth0").unwrap()).collect();
    let owner_mac = owner_v;
    let syn_acks = client_a
        .run(move || {
            let tap = Tap::open("eth0").unwrap();
            for p in 42000..42024u16 {
                tap.send(&frames::tcp(owner_mac, me, Some(VLAN), (CLIENT_V, p), (VIP_V, 80))).unwrap();
            }
            let is_syn_ack = |s: &vip_tests::tap::Seen| {
                let f = &s.frame;
                f.len() >= 54 && f[12..14] == [0x08, 0x00] && f[23] == 6 && f[26..30] == VIP_V.octets() && f[47] & 0x12 == 0x12
            };
            tap.collect(Duration::from_secs(2), is_syn_ack).into_iter().map(|s| (<[u8; 6]>::try_from(&s.frame[6..12]).unwrap(), s.vlan)).collect::<Vec<_>>()
        })
        .unwrap();
    let from: BTreeSet<[u8; 6]> = syn_acks.iter().map(|(m, _)| *m).collect();
    assert_eq!(from, node_macs, "SYN-ACKs for VIP v came from {from:?}; logs:\n{}", logs(&nodes));
    assert!(syn_acks.len() >= 24, "{} SYN-ACKs for 24 SYNs", syn_acks.len());
    // Forwards of VIPs b and v left their owner by its home segment (eth0), untagged.
    let home_forwards: f64 = nodes
        .iter()
        .map(|n| {
            let o = n.ns.cmd(exe.to_str().unwrap()).args(["--pin-dir", n._pins.path.to_str().unwrap(), "inspect", "--json"]).output().unwrap();
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            let rows = v["reasons"].as_array().cloned().unwrap_or_default();
            rows.iter().find(|r| r["reason"] == "forwarded_home").and_then(|r| r["packets"].as_f64()).unwrap_or(0.0)
        })
        .sum();
    assert!(home_forwards > 0.0, "no forward counted forwarded_home");
    // inspect names the networks VIPs are held on.
    let n = &nodes[owners[&VIP_V.into()]];
    let o = n.ns.cmd(exe.to_str().unwrap()).args(["--pin-dir", n._pins.path.to_str().unwrap(), "inspect"]).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.lines().any(|l| l.contains("eth0 VLAN 30") && l.contains(&VIP_V.to_string())), "inspect:\n{text}");

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for mut n in nodes {
        drop(n.agent.take());
    }
    for s in servers {
        let _ = s.join();
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
