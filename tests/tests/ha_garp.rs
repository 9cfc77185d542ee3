//! Gratuitous ARP from `vip_agent::ha::garp` corrects a neighbour's stale entry for
//! the VIP. Two namespaces joined by a veth, 198.18.0.0/15 only, removed on Drop.
use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use vip_agent::ha::garp::send_garp;
use vip_tests::netns::{privileged, veth, NetNs};

fn lladdr(peer: &NetNs, vip: Ipv4Addr) -> String {
    let o = peer.ip(&["neigh", "show", &vip.to_string(), "dev", "p0"]).unwrap();
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn garp_replaces_a_peers_wrong_neighbour_entry() {
    if !privileged() {
        return;
    }
    let sender = NetNs::new("vgs").unwrap();
    let peer = NetNs::new("vgp").unwrap();
    veth(&sender, "s0", &peer, "p0").unwrap();
    sender.ip(&["addr", "add", "198.18.2.1/24", "dev", "s0"]).unwrap();
    peer.ip(&["addr", "add", "198.18.2.2/24", "dev", "p0"]).unwrap();
    let vip = Ipv4Addr::new(198, 18, 2, 100);
    // What the peer learned from the previous owner.
    let old = "02:00:00:00:00:01";
    peer.ip(&["neigh", "replace", &vip.to_string(), "lladdr", old, "dev", "p0", "nud", "stale"]).unwrap();
    assert!(lladdr(&peer, vip).contains(old));

    let mac = sender.mac("s0").unwrap();
    let (count, interval) = (3, Duration::from_millis(20));
    let took = sender
        .run(move || {
            // SAFETY: NUL-terminated name.
            let ifindex = unsafe { libc::if_nametoindex(c"s0".as_ptr()) };
            assert_ne!(ifindex, 0, "s0 not found in the sender namespace");
            let t0 = Instant::now();
            send_garp(ifindex, mac, vip, count, interval).unwrap();
            t0.elapsed()
        })
        .unwrap();
    assert!(took >= interval * (count - 1), "{count} frames went out in {took:?}");

    let want = mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut seen = lladdr(&peer, vip);
    while !seen.contains(&want) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        seen = lladdr(&peer, vip);
    }
    assert!(seen.contains(&want), "peer still has {seen:?}, not the sender's {want}");
}
