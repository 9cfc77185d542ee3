//! route_guard on a real stack, in namespaces of the test's own: a node (`b`,
//! forwarding on) gets VIP frames from a peer (`p`) that its stack does not take,
//! and its neighbour entry for the VIP names the peer, as a holder's would. Without
//! the guard the node routes them back (the peer counts them, TTL one less); with
//! it they are dropped, while what the node sends to the VIP itself still leaves;
//! `remove_ours` takes the rules and routes away again. Both families.
use std::{net::IpAddr, thread::sleep, time::Duration};

use vip_agent::route_guard::{self, Guard};
use vip_tests::netns::{hex_mac, nft_packets, privileged, veth, NetNs};

const VIP4: &str = "198.18.20.200";
const VIP6: &str = "2001:2:0:20::200";

/// Packets counted by the peer's rule `name` (its comment).
fn counted(p: &NetNs, name: &str) -> u64 {
    let text = p.nft(&["list", "chain", "inet", "vipguard", "in"]).unwrap();
    let line = text.lines().find(|l| l.contains(&format!("comment \"{name}\""))).unwrap_or_else(|| panic!("no rule {name} in {text}"));
    nft_packets(line).unwrap_or_else(|| panic!("no count in {line}"))
}

/// Sends `n` UDP datagrams to the VIP from `src` inside `ns`.
fn send(ns: &NetNs, src: &str, vip: &str, n: usize) {
    let (src, vip): (IpAddr, IpAddr) = (src.parse().unwrap(), vip.parse().unwrap());
    ns.run(move || {
        let s = std::net::UdpSocket::bind((src, 0)).unwrap();
        for _ in 0..n {
            s.send_to(b"vip", (vip, 9)).unwrap();
        }
    })
    .unwrap();
    sleep(Duration::from_millis(200));
}

fn guard(b: &NetNs, want: Option<Guard>) -> (usize, usize) {
    b.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let h = route_guard::handle().unwrap();
            match want {
                Some(g) => route_guard::sync(&h, &g).await.map(|()| (0, 0)),
                None => route_guard::remove_ours(&h).await,
            }
        })
    })
    .unwrap()
    .unwrap()
}

#[test]
fn vip_frames_the_stack_does_not_take_are_dropped_not_routed_back() {
    if !privileged() {
        return;
    }
    let b = NetNs::new("vgb").unwrap();
    let p = NetNs::new("vgp").unwrap();
    veth(&b, "b0", &p, "p0").unwrap();
    for (ns, dev, a4, a6) in [(&b, "b0", "198.18.20.2/24", "2001:2:0:20::2/64"), (&p, "p0", "198.18.20.1/24", "2001:2:0:20::1/64")] {
        ns.ip(&["addr", "add", a4, "dev", dev]).unwrap();
        ns.ip(&["addr", "add", a6, "dev", dev, "nodad"]).unwrap();
        ns.ip(&["link", "set", dev, "up"]).unwrap();
    }
    b.sysctl("net.ipv4.ip_forward", "1").unwrap();
    b.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
    // The peer sends the VIP's frames to the node; the node resolves the VIP to the peer.
    let (bmac, pmac) = (hex_mac(b.mac("b0").unwrap()), hex_mac(p.mac("p0").unwrap()));
    for vip in [VIP4, VIP6] {
        p.ip(&["neigh", "replace", vip, "lladdr", &bmac, "dev", "p0", "nud", "permanent"]).unwrap();
        b.ip(&["neigh", "replace", vip, "lladdr", &pmac, "dev", "b0", "nud", "permanent"]).unwrap();
    }
    // What reaches the peer for the VIP: routed back by the node (TTL 63) or sent by it (64).
    p.nft(&["add", "table", "inet", "vipguard"]).unwrap();
    p.nft(&["add", "chain", "inet", "vipguard", "in", "{ type filter hook prerouting priority -300 ; }"]).unwrap();
    for (rule, name) in [
        (format!("ip daddr {VIP4} ip ttl 63"), "back4"),
        (format!("ip daddr {VIP4} ip ttl 64"), "own4"),
        (format!("ip6 daddr {VIP6} ip6 hoplimit 63"), "back6"),
        (format!("ip6 daddr {VIP6} ip6 hoplimit 64"), "own6"),
    ] {
        let comment = format!("\"{name}\"");
        let args: Vec<&str> = ["add", "rule", "inet", "vipguard", "in"].into_iter().chain(rule.split(' ')).chain(["counter", "comment", &comment]).collect();
        p.nft(&args).unwrap();
    }

    // Without the guard: routed back, the loop's first hop.
    send(&p, "198.18.20.1", VIP4, 3);
    send(&p, "2001:2:0:20::1", VIP6, 3);
    assert_eq!((counted(&p, "back4"), counted(&p, "back6")), (3, 3), "the node routes VIP frames back without the guard");

    let want = Guard { ifaces: ["b0".to_owned()].into(), vips: [VIP4.parse().unwrap(), VIP6.parse().unwrap()].into() };
    guard(&b, Some(want.clone()));
    guard(&b, Some(want)); // again: nothing added twice
    let rules = String::from_utf8_lossy(&b.ip(&["-4", "rule", "show"]).unwrap().stdout).into_owned()
        + &String::from_utf8_lossy(&b.ip(&["-6", "rule", "show"]).unwrap().stdout);
    assert_eq!(rules.matches("iif b0 lookup 7473 proto 118").count(), 2, "one rule per family: {rules}");
    let routes = String::from_utf8_lossy(&b.ip(&["route", "show", "table", "7473"]).unwrap().stdout).into_owned()
        + &String::from_utf8_lossy(&b.ip(&["-6", "route", "show", "table", "7473"]).unwrap().stdout);
    assert!(routes.contains(&format!("blackhole {VIP4}")) && routes.contains(&format!("blackhole {VIP6}")), "{routes}");

    send(&p, "198.18.20.1", VIP4, 3);
    send(&p, "2001:2:0:20::1", VIP6, 3);
    assert_eq!((counted(&p, "back4"), counted(&p, "back6")), (3, 3), "the guard drops VIP frames the stack would route back");
    // The node's own traffic to the VIP has no input interface: it still leaves.
    send(&b, "198.18.20.2", VIP4, 2);
    send(&b, "2001:2:0:20::2", VIP6, 2);
    assert_eq!((counted(&p, "own4"), counted(&p, "own6")), (2, 2), "the node's own traffic to the VIP");

    // One VIP less: its route goes, the other family's rule with it.
    guard(&b, Some(Guard { ifaces: ["b0".to_owned()].into(), vips: [VIP4.parse().unwrap()].into() }));
    send(&p, "2001:2:0:20::1", VIP6, 1);
    assert_eq!(counted(&p, "back6"), 4, "IPv6 routed again once its VIP is gone");
    assert_eq!(guard(&b, None), (1, 1), "remove_ours: the IPv4 rule and route left");
    send(&p, "198.18.20.1", VIP4, 1);
    assert_eq!(counted(&p, "back4"), 4, "routed again once removed");
}
