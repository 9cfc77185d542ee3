//! How a holder draws a VIP's traffic, with the real agent in namespaces this test
//! makes (198.18.0.0/15 only, removed on Drop):
//! - the agent runs with CAP_BPF and CAP_NET_ADMIN only (no CAP_PERFMON, no
//!   CAP_NET_RAW): the verifier accepts the XDP program, and its gratuitous ARP
//!   goes out through that program, not a packet socket; on a kernel that refuses
//!   to transmit through XDP, the agent says so and stops, as it cannot announce;
//! - with every capability, `--arp-sender auto` on a native attachment sends
//!   through XDP where the kernel allows it and through a packet socket where it
//!   refuses, saying why;
//! - `announce: lo` puts held VIPs on the loopback for a routing daemon, answers no
//!   ARP for them, and follows live edits of the pool's mode.
use std::{net::Ipv4Addr, path::Path, time::Duration};

use vip_tests::{
    agent::{agent_bin, wait_for, write_atomic, AgentProc, TempDir},
    lab::{wire_port, xdp_mode_arg},
    netns::{arping, hex_mac, privileged, veth, xdp_transmit_refused, NetNs, PinDir},
};

/// A node and a client namespace joined by a veth, `net`.1 and `net`.2 on it.
fn pair(net: u8) -> (NetNs, NetNs) {
    let node = NetNs::new("van").unwrap();
    let client = NetNs::new("vac").unwrap();
    veth(&node, "eth0", &client, "eth0").unwrap();
    // The client's end as a switch port: the node's native XDP_TX gets delivered.
    wire_port(&client, "eth0").unwrap();
    node.ip(&["addr", "add", &format!("198.18.{net}.1/24"), "dev", "eth0"]).unwrap();
    client.ip(&["addr", "add", &format!("198.18.{net}.2/24"), "dev", "eth0"]).unwrap();
    (node, client)
}

fn neighbour(ns: &NetNs, addr: Ipv4Addr) -> String {
    let o = ns.ip(&["neigh", "show", &addr.to_string(), "dev", "eth0"]).unwrap();
    String::from_utf8_lossy(&o.stdout).to_lowercase()
}

fn lo_addresses(ns: &NetNs) -> String {
    String::from_utf8_lossy(&ns.ip(&["addr", "show", "dev", "lo"]).unwrap().stdout).into_owned()
}

/// The line of `ip -6 addr show dev lo` for `addr`, with the one after it (flags).
fn lo_v6(ns: &NetNs, addr: &str) -> Option<String> {
    let out = String::from_utf8_lossy(&ns.ip(&["-6", "-d", "addr", "show", "dev", "lo"]).unwrap().stdout).into_owned();
    let lines: Vec<&str> = out.lines().collect();
    let i = lines.iter().position(|l| l.contains(&format!("inet6 {addr}/")))?;
    Some(lines[i..(i + 2).min(lines.len())].join("\n"))
}

fn agent_args<'a>(dir: &'a Path, pins: &'a PinDir, mode: &'a str) -> Vec<String> {
    [
        "--config",
        dir.join("vip.yaml").to_str().unwrap(),
        "--node-name",
        "n1",
        "--iface",
        "eth0",
        "--mode",
        mode,
        "--pin-dir",
        pins.path.to_str().unwrap(),
        "--metrics-addr",
        "off",
        "--status-file",
        dir.join("status.json").to_str().unwrap(),
        "--reload-interval",
        "100ms",
    ]
    .map(String::from)
    .to_vec()
}

/// A node whose stale entry at the client only our gratuitous ARP corrects, and
/// the agent's config for it: one VIP, `198.18.NET.100`.
fn garp_setup(net: u8) -> (NetNs, NetNs, Ipv4Addr, TempDir) {
    let (node, client) = pair(net);
    let vip = Ipv4Addr::new(198, 18, net, 100);
    client.ip(&["neigh", "replace", &vip.to_string(), "lladdr", "02:00:00:00:00:01", "dev", "eth0", "nud", "stale"]).unwrap();
    let dir = TempDir::new("vip-caps").unwrap();
    let cfg = format!(
        "nodes:\n  - {{name: n1, address: 198.18.{net}.1}}\npools:\n  - name: p\n    addresses: [{vip}]\n    gratuitousArp: {{count: 3, interval: 50ms}}\n"
    );
    write_atomic(&dir.0.join("vip.yaml"), &cfg).unwrap();
    (node, client, vip, dir)
}

/// Waits until the client's entry for `vip` names the node's MAC, then checks
/// that the node answers ARP for it.
fn assert_announced(node: &NetNs, client: &NetNs, vip: Ipv4Addr, agent: &mut AgentProc) {
    let node_mac = node.mac("eth0").unwrap();
    let want = hex_mac(node_mac).to_lowercase();
    let seen = wait_for(Duration::from_secs(10), || neighbour(client, vip).contains(&want).then_some(()));
    agent.check_alive().unwrap();
    assert!(seen.is_some(), "the client's entry for {vip} is still {:?}; agent log:\n{}", neighbour(client, vip), agent.log_text());
    let (_, out) = arping(client, "eth0", vip);
    assert!(out.contains(&format!("reply from {vip} [{}]", hex_mac(node_mac))), "no ARP answer from {} for {vip}: {out}", hex_mac(node_mac));
}

fn sender_line(log: &str) -> Option<&str> {
    log.lines().find(|l| l.contains("go out through this sender"))
}

#[test]
fn agent_without_cap_net_raw_announces_through_xdp() {
    if !privileged() {
        return;
    }
    let refused = xdp_transmit_refused();
    let (node, client, vip, dir) = garp_setup(4);
    let pins = PinDir::new().unwrap();
    let args = agent_args(&dir.0, &pins, "native");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // As root with the bounding set cut to these two, exec leaves exactly them.
    // Without CAP_PERFMON the verifier applies its Spectre rules: no variable
    // packet offsets, no pointer arithmetic between packet pointers (vip-ebpf).
    let mut agent = AgentProc::start_wrapped(&node, &["setpriv", "--bounding-set", "-all,+bpf,+net_admin", "--"], &args, &dir.0.join("agent.log")).unwrap();
    if let Some(why) = refused {
        // No way to send a frame: the agent must stop and say what to grant, not
        // run on without gratuitous ARP (clients would keep a dead owner's MAC).
        let exited = wait_for(Duration::from_secs(10), || agent.check_alive().err());
        let log = agent.log_text();
        assert!(exited.is_some(), "this kernel refuses XDP transmit ({why}), yet the agent without CAP_NET_RAW runs on:\n{log}");
        assert!(
            log.contains("the kernel refused to transmit through XDP") && log.contains("CAP_NET_RAW"),
            "the agent's exit does not say that XDP transmit was refused and a packet socket needs CAP_NET_RAW:\n{log}"
        );
        eprintln!("this kernel refuses XDP transmit ({why}): checked that the agent without CAP_NET_RAW stops and says why");
        return;
    }
    assert_announced(&node, &client, vip, &mut agent);
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.child.id())).unwrap();
    let cap_eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim().to_owned();
    // CAP_BPF is bit 39, CAP_NET_ADMIN 12 (CAP_PERFMON, 38, and CAP_NET_RAW, 13, are not there).
    assert_eq!(u64::from_str_radix(&cap_eff, 16).unwrap(), 1 << 39 | 1 << 12, "agent capabilities");
    let log = agent.log_text();
    assert!(sender_line(&log).is_some_and(|l| l.contains("Xdp")), "auto did not choose the XDP sender on a native attachment:\n{log}");
}

#[test]
fn auto_sender_follows_what_the_kernel_allows() {
    if !privileged() {
        return;
    }
    let refused = xdp_transmit_refused();
    let (node, client, vip, dir) = garp_setup(6);
    let pins = PinDir::new().unwrap();
    let args = agent_args(&dir.0, &pins, "native");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = AgentProc::start(&node, &args, &dir.0.join("agent.log")).unwrap();
    assert_announced(&node, &client, vip, &mut agent);
    let log = agent.log_text();
    let line = sender_line(&log).unwrap_or_else(|| panic!("no sender chosen:\n{log}"));
    match refused {
        None => assert!(line.contains("Xdp"), "the kernel allows XDP transmit but auto chose otherwise:\n{log}"),
        Some(why) => {
            assert!(line.contains("Packet"), "the kernel refuses XDP transmit ({why}) but auto did not fall back to the packet socket:\n{log}");
            assert!(log.contains("the kernel refused to transmit through XDP"), "the fallback is not explained in the log:\n{log}");
        }
    }
}

#[test]
fn announce_lo_puts_held_vips_on_lo_answers_no_arp_and_follows_edits() {
    if !privileged() {
        return;
    }
    let (node, client) = pair(5);
    let (arp_vip, lo_vip) = (Ipv4Addr::new(198, 18, 5, 100), Ipv4Addr::new(198, 18, 5, 110));
    // An IPv6 VIP of the same pool: on lo as a /128 marked by its address protocol
    // (IPv6 addresses have no label), without duplicate address detection.
    let lo_vip6 = "2001:2::5:110";
    let dir = TempDir::new("vip-lo").unwrap();
    let pins = PinDir::new().unwrap();
    let cfg = |mode: &str| {
        format!("nodes:\n  - {{name: n1, address: 198.18.5.1}}\npools:\n  - {{name: l2, addresses: [198.18.5.100]}}\n  - {{name: routed, addresses: [198.18.5.110, '{lo_vip6}'], announce: {mode}}}\n")
    };
    write_atomic(&dir.0.join("vip.yaml"), &cfg("lo")).unwrap();
    let args = agent_args(&dir.0, &pins, xdp_mode_arg());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut agent = AgentProc::start(&node, &args, &dir.0.join("agent.log")).unwrap();
    let node_mac = hex_mac(node.mac("eth0").unwrap());
    let ours = format!("{lo_vip}/32 scope global lo:vip");

    let on_lo = wait_for(Duration::from_secs(10), || lo_addresses(&node).contains(&ours).then_some(()));
    agent.check_alive().unwrap();
    assert!(on_lo.is_some(), "{lo_vip} not on lo with our label:\n{}\nlog:\n{}", lo_addresses(&node), agent.log_text());
    // inspect decodes the held entries' announce mode from the pinned map.
    let o = node.cmd(agent_bin().unwrap().to_str().unwrap()).args(["--pin-dir", pins.path.to_str().unwrap(), "inspect", "--json"]).output().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("inspect --json: {e}: {}", String::from_utf8_lossy(&o.stderr)));
    let modes: Vec<(String, String)> =
        report["held"].as_array().unwrap().iter().map(|h| (h["vip"].as_str().unwrap().to_owned(), h["announce"].as_str().unwrap().to_owned())).collect();
    assert_eq!(modes, [(arp_vip.to_string(), "arp".to_owned()), (lo_vip.to_string(), "lo".to_owned()), (lo_vip6.to_owned(), "lo".to_owned())]);
    let v6 = wait_for(Duration::from_secs(10), || lo_v6(&node, lo_vip6)).unwrap_or_else(|| panic!("{lo_vip6} not on lo:\n{}", lo_addresses(&node)));
    // Its mark (the address protocol) is what lets the agent remove it below while
    // it leaves the one added by hand (Debian 12's iproute2 does not print it).
    assert!(v6.contains(&format!("inet6 {lo_vip6}/128")) && v6.contains("nodad"), "{lo_vip6} on lo, but not as the agent adds it: {v6}");
    assert!(!v6.contains("tentative"), "{lo_vip6} is tentative (duplicate address detection ran): {v6}");
    let (ok, out) = arping(&client, "eth0", arp_vip);
    assert!(ok && out.contains(&node_mac), "the ARP pool's VIP is not answered: {out}");
    // The node's kernel would answer for an address on lo; the data path drops the request.
    let (ok, out) = arping(&client, "eth0", lo_vip);
    assert!(!ok && !out.contains(&node_mac), "a VIP announced from lo was answered over ARP: {out}");

    // Live edit: the pool now announces by ARP; the address leaves lo, ARP answers.
    write_atomic(&dir.0.join("vip.yaml"), &cfg("arp")).unwrap();
    let gone = wait_for(Duration::from_secs(10), || (!lo_addresses(&node).contains(&lo_vip.to_string()) && lo_v6(&node, lo_vip6).is_none()).then_some(()));
    assert!(gone.is_some(), "{lo_vip} or {lo_vip6} still on lo after the pool moved to ARP:\n{}", lo_addresses(&node));
    let (ok, out) = arping(&client, "eth0", lo_vip);
    assert!(ok && out.contains(&node_mac), "not answered once announced by ARP: {out}");

    // And back; an address someone else put on lo is left alone when the pool goes.
    write_atomic(&dir.0.join("vip.yaml"), &cfg("lo")).unwrap();
    assert!(wait_for(Duration::from_secs(10), || lo_addresses(&node).contains(&ours).then_some(())).is_some(), "not back on lo");
    node.ip(&["addr", "add", "198.18.5.111/32", "dev", "lo"]).unwrap();
    node.ip(&["addr", "add", "2001:2::5:111/128", "dev", "lo", "nodad"]).unwrap();
    write_atomic(&dir.0.join("vip.yaml"), "nodes:\n  - {name: n1, address: 198.18.5.1}\npools:\n  - {name: l2, addresses: [198.18.5.100]}\n").unwrap();
    let gone = wait_for(Duration::from_secs(10), || (!lo_addresses(&node).contains(&lo_vip.to_string()) && lo_v6(&node, lo_vip6).is_none()).then_some(()));
    assert!(gone.is_some(), "{lo_vip} or {lo_vip6} still on lo after its pool was removed:\n{}", lo_addresses(&node));
    assert!(lo_addresses(&node).contains("198.18.5.111/32"), "an address the agent did not add was removed");
    assert!(lo_v6(&node, "2001:2::5:111").is_some(), "an IPv6 address the agent did not add was removed");
    agent.check_alive().unwrap();
}
