//! Real packets in namespaces this test makes: ARP answers seen by arping, and a
//! TCP connection through a VIP reaching the backend the ring chose (L2 DSR).
//! Addresses are from 198.18.0.0/15 only; everything is removed on Drop.
use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use vip_agent::{
    dataplane::{self, monotonic_ns, AttachMode, BackendSpec, Dataplane, ServiceAddr},
    model::Protocol,
};
use vip_common::{flow_hash, PROTO_TCP};
use vip_tests::{
    lab::{accept_vip, attach_node, fetch, name_server, wire_port, xdp_mode, Segment},
    netns::{arping, hex_mac, privileged, sh, veth, NetNs, PinDir},
};

fn in_ten_s() -> u64 {
    monotonic_ns() + 10_000_000_000
}

#[test]
fn arping_gets_our_mac_only_for_held_fresh_vips() {
    if !privileged() {
        return;
    }
    let client = NetNs::new("vcl").unwrap();
    let node = NetNs::new("vnd").unwrap();
    veth(&client, "c0", &node, "n0").unwrap();
    wire_port(&client, "c0").unwrap();
    client.ip(&["addr", "add", "198.18.1.1/24", "dev", "c0"]).unwrap();
    node.ip(&["addr", "add", "198.18.1.2/24", "dev", "n0"]).unwrap();
    let pins = PinDir::new().unwrap();
    let dir = pins.path.clone();
    let mode = xdp_mode();
    let (mut dp, ifindex) = node
        .run(move || {
            let mut dp = Dataplane::load(&dir, 1 << 16).unwrap();
            let a = dp.attach("n0", mode).unwrap();
            assert_eq!(a.mode, Some(mode));
            (dp, a.ifindex)
        })
        .unwrap();
    let vip = Ipv4Addr::new(198, 18, 1, 100);
    let node_mac = hex_mac(node.mac("n0").unwrap());
    dp.hold_vip(ifindex, vip, in_ten_s()).unwrap();

    let (ok, out) = arping(&client, "c0", vip);
    assert!(ok && out.contains(&node_mac), "no ARP answer with {node_mac} for held {vip}: {out}");
    let (ok, out) = arping(&client, "c0", Ipv4Addr::new(198, 18, 1, 101));
    assert!(!ok && !out.contains(&node_mac), "answered for an unheld address: {out}");

    // bpftool reads the pinned maps: the held VIP (c6 12 01 64) is in arp_held.
    let dump = sh(&["bpftool", "map", "dump", "pinned", pins.path.join("arp_held").to_str().unwrap()]).unwrap();
    assert!(String::from_utf8_lossy(&dump.stdout).contains("c6 12 01 64"), "bpftool dump lacks the VIP");

    // Agent restart: drop everything this "process" held, re-open from the pins.
    drop(dp);
    let mut dp = Dataplane::open(&pins.path).unwrap();
    assert_eq!(dp.held_vips().unwrap().len(), 1);
    let (ok, _) = arping(&client, "c0", vip);
    assert!(ok, "ARP answers stopped after the agent let go of its handles");
    let dir = pins.path.clone();
    let again = node.run(move || Dataplane::load(&dir, 1 << 16).unwrap().attach("n0", AttachMode::Auto).unwrap().mode).unwrap();
    assert_eq!(again, None, "a restarted agent must keep the pinned attachment");

    // Fencing: a deadline in the past is not answered.
    dp.hold_vip(ifindex, vip, monotonic_ns() - 1).unwrap();
    let (ok, _) = arping(&client, "c0", vip);
    assert!(!ok, "answered ARP for a stale VIP");
    assert!(dp.counters().unwrap().reasons["arp_stale"].0 > 0);

    // Detach removes the program from the interface.
    let link = String::from_utf8_lossy(&node.ip(&["link", "show", "n0"]).unwrap().stdout).into_owned();
    assert!(link.contains("xdp"), "{link}");
    assert!(dataplane::detach(&pins.path, "n0").unwrap());
    let link = String::from_utf8_lossy(&node.ip(&["link", "show", "n0"]).unwrap().stdout).into_owned();
    assert!(!link.contains("xdp"), "still attached after detach: {link}");
}

#[test]
fn tcp_through_the_vip_reaches_the_ring_choice() {
    if !privileged() {
        return;
    }
    let seg = Segment::new().unwrap();
    let client = seg.host("vcl", "198.18.2.1/24").unwrap();
    let lb = seg.host("vlb", "198.18.2.2/24").unwrap();
    let k1 = seg.host("vk1", "198.18.2.11/24").unwrap();
    let k2 = seg.host("vk2", "198.18.2.12/24").unwrap();
    let vip = Ipv4Addr::new(198, 18, 2, 100);
    accept_vip(&k1, vip).unwrap();
    accept_vip(&k2, vip).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let servers = [name_server(&k1, 8080, "k1".into(), stop.clone()).unwrap(), name_server(&k2, 8080, "k2".into(), stop.clone()).unwrap()];

    let pins = PinDir::new().unwrap();
    let (mut dp, ifindex) = attach_node(&lb, &pins.path).unwrap();
    dp.hold_vip(ifindex, vip, monotonic_ns() + 60_000_000_000).unwrap();
    let spec = |name: &str, ns: &NetNs, last: u8| BackendSpec {
        name: name.into(),
        addr: Ipv4Addr::new(198, 18, 2, last).into(),
        mac: ns.mac("eth0").unwrap(),
        weight: 1,
        local: false,
    };
    let s = ServiceAddr { vip: vip.into(), port: 8080, protocol: Protocol::Tcp };
    dp.set_service(s, &[spec("k1", &k1, 11), spec("k2", &k2, 12)], 251, 0).unwrap();
    let (_, entry, ring) = dp.services().unwrap().into_iter().find(|(a, _, _)| *a == s).unwrap();
    let backends = dp.backends().unwrap();

    let client_ip = Ipv4Addr::new(198, 18, 2, 1);
    let mut seen = std::collections::BTreeMap::<String, u32>::new();
    for sport in 41000..41020u16 {
        let h = flow_hash(client_ip.octets(), vip.octets(), sport.to_be_bytes(), 8080u16.to_be_bytes(), PROTO_TCP);
        let chosen = backends[&ring[(h % entry.ring_size) as usize]].addr;
        let want = if chosen == [198, 18, 2, 11] { "k1" } else { "k2" };
        let got = client.run(move || fetch(client_ip, sport, SocketAddr::from((vip, 8080)))).unwrap();
        let got = got.unwrap_or_else(|e| panic!("connection from port {sport} to the VIP failed: {e}"));
        assert_eq!(got, want, "port {sport}");
        *seen.entry(got).or_default() += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let served: u32 = servers.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(served, 20);
    assert_eq!(seen.len(), 2, "all 20 connections went to one backend: {seen:?}");
    let c = dp.counters().unwrap();
    assert!(c.reasons["arp_answered"].0 >= 1);
    assert!(c.reasons["forwarded"].0 >= 20 * 3, "{:?}", c.reasons);
}

/// A kind-style link: a veth whose peer runs no XDP program (nor GRO). Native XDP
/// answers leave nothing there (the peer's NAPI never runs); `--mode auto` must
/// pick generic, and the answers must arrive.
#[test]
fn auto_mode_on_a_veth_without_xdp_on_its_peer_answers_arp() {
    if !privileged() {
        return;
    }
    let client = NetNs::new("vcl").unwrap();
    let node = NetNs::new("vnd").unwrap();
    veth(&client, "c0", &node, "n0").unwrap();
    client.ip(&["addr", "add", "198.18.1.1/24", "dev", "c0"]).unwrap();
    node.ip(&["addr", "add", "198.18.1.2/24", "dev", "n0"]).unwrap();
    // Nothing on the peer that would make native XDP_TX deliver.
    vip_tests::netns::ethtool_features(&client, "c0", &["gro", "off"]).unwrap();
    let pins = PinDir::new().unwrap();
    let dir = pins.path.clone();
    let (mut dp, ifindex, mode) = node
        .run(move || {
            let mut dp = Dataplane::load(&dir, 1 << 16).unwrap();
            let a = dp.attach("n0", AttachMode::Auto).unwrap();
            (dp, a.ifindex, a.mode)
        })
        .unwrap();
    assert_eq!(mode, Some(AttachMode::Generic), "auto on a veth");
    let vip = Ipv4Addr::new(198, 18, 1, 100);
    dp.hold_vip(ifindex, vip, in_ten_s()).unwrap();
    let node_mac = hex_mac(node.mac("n0").unwrap());
    let (ok, out) = arping(&client, "c0", vip);
    assert!(ok && out.contains(&node_mac), "no ARP answer with {node_mac} through auto mode on a bare veth: {out}");
}
