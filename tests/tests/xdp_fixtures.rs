//! Packet fixtures through BPF_PROG_TEST_RUN: input frame, expected verdict,
//! expected output frame, byte for byte. Then truncations and random mutations
//! of every fixture: the program must never transmit a frame it did not build.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use rand::{rngs::SmallRng, Rng, SeedableRng};
use vip_agent::{
    dataplane::{monotonic_ns, AttachMode, BackendSpec, Dataplane, ServiceAddr, ServiceSpec},
    model::Protocol,
};
use vip_common::{
    flow_cache_slot, flow_cache_slots_for, flow_hash, flow_hash6, held_slot, map_names, vip_filter_bit, vip_filter_bit6, vip_filter_bit_of, ArpHeldKey,
    HeldVip, Lb4FlowCacheEntry, Lb4FlowKey, Lb4HeldSlot, Lb6HeldSlot, NdpHeldKey, HELD_SLOTS, PROTO_TCP, PROTO_UDP, VIP_FILTER_WORDS,
};
use vip_tests::{
    frames::{self, Ip4, Mac},
    netns::{privileged, NetNs, PinDir},
};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

/// BPF_PROG_TEST_RUN runs the program as if received on the loopback device.
const IFINDEX: u32 = 1;
const OUR_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0xaa];
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const VIP_STALE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 101);
const VIP_NOT_HELD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 102);
const VIP_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 103);
const VIP_EMPTY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 104);
/// Held with HELD_NO_ARP: a pool that announces from lo (routing daemon).
const VIP_LO: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 105);
const OTHER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 200);
/// A VIP of VLAN 42, held on that VLAN's sub-interface (a made-up ifindex: the
/// test runs see frames as received on IFINDEX, the VLAN's parent).
const VIP_VLAN: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 100);
const VLAN: u16 = 42;
const VLAN_IFINDEX: u32 = 4242;
const VLAN_MAC: Mac = [0x02, 0, 0, 0, 0x42, 0x01];
const TABLE: u32 = 251;
// IPv6 VIPs (the lab prefix 2001:2::/48), held as their IPv4 twins above.
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
const CLIENT6_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0xaa);
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x100);
const VIP6_STALE: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x101);
const VIP6_NOT_HELD: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x102);
const VIP6_LO: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x105);
const VIP6_VLAN: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 1, 0, 0, 0, 0, 0x100);
/// A router on the path to clients, which sends ICMP errors to VIPs.
const ROUTER: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 254);
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xfe);
/// The port of an IPv6 VIP's service whose backend is this node.
const LOCAL6_PORT: u16 = 82;
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
const ALL_NODES_MAC: Mac = [0x33, 0x33, 0, 0, 0, 1];
/// Another host's MAC on the segment (a peer holding the same VIPs, or one a
/// switch floods frames for).
const OTHER_HOST_MAC: Mac = [0x02, 0, 0, 0, 0, 0x77];

fn backend(i: u8) -> BackendSpec {
    BackendSpec { name: format!("node-{i}"), addr: Ipv4Addr::new(198, 18, 0, 10 + i).into(), mac: [0x02, 0, 0, 0, 0x10, i], weight: 1, local: false }
}

fn svc(vip: impl Into<IpAddr>, port: u16, proto: u8) -> ServiceAddr {
    ServiceAddr { vip: vip.into(), port, protocol: Protocol::from_number(proto).expect("tcp or udp") }
}

struct World {
    dp: Dataplane,
    pins: PinDir,
}

fn world() -> World {
    let pins = PinDir::new().unwrap();
    let mut dp = Dataplane::load(&pins.path, 1 << 16).unwrap();
    dp.set_iface(IFINDEX, OUR_MAC).unwrap();
    let hour = monotonic_ns() + 3_600_000_000_000;
    for v in [VIP, VIP_LOCAL, VIP_EMPTY] {
        dp.hold_vip(IFINDEX, v, hour).unwrap();
    }
    dp.hold_vip(IFINDEX, VIP_STALE, 1).unwrap();
    dp.held().hold(IFINDEX, VIP_LO.into(), hour, vip_agent::dataplane::HeldMode::Lo).unwrap();
    dp.hold_vip(IFINDEX, VIP6, hour).unwrap();
    dp.hold_vip(IFINDEX, VIP6_STALE, 1).unwrap();
    dp.held().hold(IFINDEX, VIP6_LO.into(), hour, vip_agent::dataplane::HeldMode::Lo).unwrap();
    dp.set_iface(VLAN_IFINDEX, VLAN_MAC).unwrap();
    dp.set_vlan(IFINDEX, VLAN, VLAN_IFINDEX).unwrap();
    dp.hold_vip(VLAN_IFINDEX, VIP_VLAN, hour).unwrap();
    dp.hold_vip(VLAN_IFINDEX, VIP6_VLAN, hour).unwrap();
    let three = [backend(1), backend(2), backend(3)];
    for s in [
        svc(VIP, 80, PROTO_TCP),
        svc(VIP, 53, PROTO_UDP),
        svc(VIP_STALE, 80, PROTO_TCP),
        svc(VIP_NOT_HELD, 80, PROTO_TCP),
        svc(VIP_LO, 80, PROTO_TCP),
        svc(VIP_VLAN, 80, PROTO_TCP),
        svc(VIP6, 80, PROTO_TCP),
        svc(VIP6, 53, PROTO_UDP),
        svc(VIP6_STALE, 80, PROTO_TCP),
        svc(VIP6_NOT_HELD, 80, PROTO_TCP),
        svc(VIP6_VLAN, 80, PROTO_TCP),
    ] {
        dp.set_service(s, &three, TABLE, 0).unwrap();
    }
    let me = BackendSpec { local: true, ..backend(9) };
    dp.set_service(svc(VIP_LOCAL, 80, PROTO_TCP), std::slice::from_ref(&me), TABLE, 0).unwrap();
    dp.set_service(svc(VIP6, LOCAL6_PORT, PROTO_TCP), &[me], TABLE, 0).unwrap();
    dp.set_service(svc(VIP_EMPTY, 80, PROTO_TCP), &[], TABLE, 0).unwrap();
    World { dp, pins }
}

/// The backend MAC the ring gives a new flow, computed from the maps in userspace.
fn ring_choice(dp: &Dataplane, s: ServiceAddr, src: impl Into<IpAddr>, sport: u16, dport: u16) -> Mac {
    let (_, entry, ring) = dp.services().unwrap().into_iter().find(|(a, _, _)| *a == s).unwrap();
    let (sp, dp_, proto) = (sport.to_be_bytes(), dport.to_be_bytes(), s.protocol.number());
    let h = match (src.into(), s.vip) {
        (IpAddr::V4(src), IpAddr::V4(vip)) => flow_hash(src.octets(), vip.octets(), sp, dp_, proto),
        (IpAddr::V6(src), IpAddr::V6(vip)) => flow_hash6(src.octets(), vip.octets(), sp, dp_, proto),
        _ => panic!("a flow's addresses are of one family"),
    };
    let id = ring[(h % entry.ring_size) as usize];
    dp.backends().unwrap()[&id].mac
}

fn forwarded(frame: &[u8], to: Mac) -> Vec<u8> {
    forwarded_from(frame, to, OUR_MAC)
}

/// `frame` forwarded to `to` from our MAC `ours` (that of the VIP's network).
fn forwarded_from(frame: &[u8], to: Mac, ours: Mac) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[0..6].copy_from_slice(&to);
    f[6..12].copy_from_slice(&ours);
    f
}

/// `frame` (with one tag or none) with an outer tag `tpid`/`vid` put in front of
/// its first tag or ethertype: QinQ, or a lone 802.1ad tag.
fn outer_tagged(frame: &[u8], tpid: u16, vid: u16) -> Vec<u8> {
    let mut f = frame[..12].to_vec();
    f.extend_from_slice(&tpid.to_be_bytes());
    f.extend_from_slice(&vid.to_be_bytes());
    f.extend_from_slice(&frame[12..]);
    f
}

struct Case {
    name: &'static str,
    input: Vec<u8>,
    verdict: u32,
    /// None: the frame must come out unchanged.
    output: Option<Vec<u8>>,
}

/// Our MAC on the network of a frame tagged `vlan`: VLAN 42's sub-interface has
/// a MAC of its own, and Linux takes a tagged frame to another MAC for another host.
fn ours(vlan: Option<u16>) -> Mac {
    if vlan == Some(VLAN) {
        VLAN_MAC
    } else {
        OUR_MAC
    }
}

fn cases(dp: &Dataplane) -> Vec<Case> {
    let req = |tpa, vlan| frames::arp_request(CLIENT_MAC, CLIENT, tpa, vlan);
    let tcp = |dst, sport, dport, vlan| frames::tcp(ours(vlan), CLIENT_MAC, vlan, (CLIENT, sport), (dst, dport));
    let fwd_tcp = tcp(VIP, 40000, 80, None);
    let fwd_tcp_vlan = tcp(VIP_VLAN, 40001, 80, Some(VLAN));
    let fwd_tcp_lo = tcp(VIP_LO, 40002, 80, None);
    let fwd_tcp_opts = frames::with_ip_options(&tcp(VIP, 40003, 80, None), 2);
    let fwd_tcp_vlan_opts = frames::with_ip_options(&tcp(VIP_VLAN, 40004, 80, Some(VLAN)), 10);
    // Priority-tagged (VLAN id 0): Linux delivers it to the untagged network.
    let prio_req = req(VIP, Some(0));
    let fwd_udp = frames::udp(OUR_MAC, CLIENT_MAC, (CLIENT, 5353), (VIP, 53), b"query");
    let stale_fwd = |name, input: Vec<u8>, sport| Case {
        name,
        output: Some(forwarded(&input, ring_choice(dp, svc(VIP_STALE, 80, PROTO_TCP), CLIENT, sport, 80))),
        input,
        verdict: XDP_TX,
    };
    // Frames to a group MAC reach every node: only the VIP's fresh holder handles them.
    const MULTICAST: Mac = [0x01, 0x00, 0x5e, 0x00, 0x00, 0x01];
    let bcast_udp = frames::udp(frames::BROADCAST, CLIENT_MAC, (CLIENT, 5354), (VIP, 53), b"query");
    let mcast_tcp = frames::tcp(MULTICAST, CLIENT_MAC, None, (CLIENT, 40005), (VIP, 80));
    let mut frag1 = Ip4::new(CLIENT, VIP, PROTO_UDP);
    frag1.more_fragments = true;
    frag1.id = 77;
    let first_frag = frames::ipv4(OUR_MAC, CLIENT_MAC, None, frag1, &frames::udp_header(5353, 53, &[7u8; 32]));
    let later = Ip4 { frag_offset: 5, more_fragments: false, ..frag1 };
    let last_frag = frames::ipv4(OUR_MAC, CLIENT_MAC, None, later, &[9u8; 24]);
    // Fragments hash with zero ports: both go where (src, dst, proto) points.
    let frag_to = ring_choice(dp, svc(VIP, 53, PROTO_UDP), CLIENT, 0, 0);
    vec![
        Case {
            name: "arp request for held VIP is answered",
            input: req(VIP, None),
            verdict: XDP_TX,
            output: Some(frames::arp_reply_for(&req(VIP, None), OUR_MAC)),
        },
        Case {
            name: "arp request in VLAN 42 for a VIP of VLAN 42 is answered in VLAN 42, with that VLAN's MAC",
            input: req(VIP_VLAN, Some(VLAN)),
            verdict: XDP_TX,
            output: Some(frames::arp_reply_for(&req(VIP_VLAN, Some(VLAN)), VLAN_MAC)),
        },
        Case { name: "arp request in VLAN 42 for a VIP of the untagged network passes", input: req(VIP, Some(VLAN)), verdict: XDP_PASS, output: None },
        Case { name: "arp request in VLAN 4000 (no pool there) for a VIP passes", input: req(VIP, Some(4000)), verdict: XDP_PASS, output: None },
        Case { name: "untagged arp request for a VIP of VLAN 42 passes", input: req(VIP_VLAN, None), verdict: XDP_PASS, output: None },
        Case {
            name: "priority-tagged (VLAN 0) arp request for a VIP of the untagged network is answered, tag kept",
            output: Some(frames::arp_reply_for(&prio_req, OUR_MAC)),
            input: prio_req,
            verdict: XDP_TX,
        },
        Case {
            name: "QinQ arp request (802.1ad outer, VLAN 42 inner) for a VIP of VLAN 42 passes",
            input: outer_tagged(&req(VIP_VLAN, Some(VLAN)), 0x88a8, 7),
            verdict: XDP_PASS,
            output: None,
        },
        Case {
            name: "double 802.1Q-tagged arp request for a VIP of VLAN 42 passes",
            input: outer_tagged(&req(VIP_VLAN, Some(VLAN)), 0x8100, VLAN),
            verdict: XDP_PASS,
            output: None,
        },
        Case { name: "802.1ad-tagged arp request for a VIP passes", input: outer_tagged(&req(VIP, None), 0x88a8, VLAN), verdict: XDP_PASS, output: None },
        Case { name: "arp request for an unheld address passes", input: req(OTHER, None), verdict: XDP_PASS, output: None },
        Case { name: "arp request for a stale VIP passes (fenced)", input: req(VIP_STALE, None), verdict: XDP_PASS, output: None },
        Case { name: "arp request for a VIP announced from lo: dropped, nobody answers", input: req(VIP_LO, None), verdict: XDP_DROP, output: None },
        Case {
            name: "tcp to a VIP announced from lo: balanced all the same",
            output: Some(forwarded(&fwd_tcp_lo, ring_choice(dp, svc(VIP_LO, 80, PROTO_TCP), CLIENT, 40002, 80))),
            input: fwd_tcp_lo,
            verdict: XDP_TX,
        },
        Case { name: "arp reply passes", input: frames::arp(OUR_MAC, None, 2, CLIENT_MAC, CLIENT, OUR_MAC, VIP), verdict: XDP_PASS, output: None },
        Case {
            name: "gratuitous arp for a held VIP passes",
            input: frames::arp(frames::BROADCAST, None, 1, CLIENT_MAC, VIP, [0; 6], VIP),
            verdict: XDP_PASS,
            output: None,
        },
        Case {
            name: "tcp to VIP forwarded to the ring's backend",
            output: Some(forwarded(&fwd_tcp, ring_choice(dp, svc(VIP, 80, PROTO_TCP), CLIENT, 40000, 80))),
            input: fwd_tcp,
            verdict: XDP_TX,
        },
        Case {
            name: "tcp in VLAN 42 to a VIP of VLAN 42 forwarded, tag kept, from that VLAN's MAC",
            output: Some(forwarded_from(&fwd_tcp_vlan, ring_choice(dp, svc(VIP_VLAN, 80, PROTO_TCP), CLIENT, 40001, 80), VLAN_MAC)),
            input: fwd_tcp_vlan,
            verdict: XDP_TX,
        },
        Case { name: "tcp in VLAN 42 to a VIP of the untagged network: passed", input: tcp(VIP, 40008, 80, Some(VLAN)), verdict: XDP_PASS, output: None },
        Case { name: "tcp in VLAN 4000 (no pool there) to a VIP: passed", input: tcp(VIP, 40009, 80, Some(4000)), verdict: XDP_PASS, output: None },
        Case { name: "untagged tcp to a VIP of VLAN 42: passed", input: tcp(VIP_VLAN, 40010, 80, None), verdict: XDP_PASS, output: None },
        Case {
            name: "QinQ tcp to a VIP of VLAN 42: passed",
            input: outer_tagged(&tcp(VIP_VLAN, 40011, 80, Some(VLAN)), 0x88a8, 7),
            verdict: XDP_PASS,
            output: None,
        },
        Case {
            name: "tcp with IP options: ports found past them, forwarded",
            output: Some(forwarded(&fwd_tcp_opts, ring_choice(dp, svc(VIP, 80, PROTO_TCP), CLIENT, 40003, 80))),
            input: fwd_tcp_opts,
            verdict: XDP_TX,
        },
        Case {
            name: "tcp in VLAN 42 with 40 bytes of IP options forwarded",
            output: Some(forwarded_from(&fwd_tcp_vlan_opts, ring_choice(dp, svc(VIP_VLAN, 80, PROTO_TCP), CLIENT, 40004, 80), VLAN_MAC)),
            input: fwd_tcp_vlan_opts,
            verdict: XDP_TX,
        },
        Case {
            name: "udp to VIP forwarded to the ring's backend",
            output: Some(forwarded(&fwd_udp, ring_choice(dp, svc(VIP, 53, PROTO_UDP), CLIENT, 5353, 53))),
            input: fwd_udp,
            verdict: XDP_TX,
        },
        Case {
            name: "udp to a held VIP with a broadcast destination MAC: the holder forwards it",
            output: Some(forwarded(&bcast_udp, ring_choice(dp, svc(VIP, 53, PROTO_UDP), CLIENT, 5354, 53))),
            input: bcast_udp,
            verdict: XDP_TX,
        },
        Case {
            name: "tcp to a held VIP with a multicast destination MAC: the holder forwards it",
            output: Some(forwarded(&mcast_tcp, ring_choice(dp, svc(VIP, 80, PROTO_TCP), CLIENT, 40005, 80))),
            input: mcast_tcp,
            verdict: XDP_TX,
        },
        Case {
            name: "broadcast tcp to a VIP held elsewhere: dropped, not answered by this node's stack",
            input: frames::tcp(frames::BROADCAST, CLIENT_MAC, None, (CLIENT, 40007), (VIP_NOT_HELD, 80)),
            verdict: XDP_DROP,
            output: None,
        },
        Case {
            name: "multicast tcp to a stale VIP: dropped (only a fresh holder handles group frames)",
            input: frames::tcp(MULTICAST, CLIENT_MAC, None, (CLIENT, 40006), (VIP_STALE, 80)),
            verdict: XDP_DROP,
            output: None,
        },
        Case {
            name: "broadcast udp to a non-VIP address: passed (DHCP and the like)",
            input: frames::udp(frames::BROADCAST, CLIENT_MAC, (CLIENT, 68), (OTHER, 67), b"x"),
            verdict: XDP_PASS,
            output: None,
        },
        Case { name: "first fragment hashed on addresses", output: Some(forwarded(&first_frag, frag_to)), input: first_frag, verdict: XDP_TX },
        Case { name: "later fragment follows the first", output: Some(forwarded(&last_frag, frag_to)), input: last_frag, verdict: XDP_TX },
        Case { name: "backend is this node: passed to the stack", input: tcp(VIP_LOCAL, 40000, 80, None), verdict: XDP_PASS, output: None },
        Case { name: "service without backends: dropped", input: tcp(VIP_EMPTY, 40000, 80, None), verdict: XDP_DROP, output: None },
        Case { name: "service of a VIP not held here: passed", input: tcp(VIP_NOT_HELD, 40000, 80, None), verdict: XDP_PASS, output: None },
        // A stale entry (the VIP moved on, or fenced): clients still sending here
        // until they follow the new owner are balanced by the ring, as the new
        // owner would; a frame a node forwarded here is not forwarded again.
        stale_fwd("a client's SYN to a stale VIP: forwarded by the ring", tcp(VIP_STALE, 40000, 80, None), 40000),
        stale_fwd(
            "a client's packet of a flow not pinned here to a stale VIP: forwarded by the ring",
            frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 40001), (VIP_STALE, 80)),
            40001,
        ),
        Case {
            // From a backend node's MAC: a frame another holder forwarded here.
            name: "a node's SYN to a stale VIP: passed, not forwarded again",
            input: frames::tcp(OUR_MAC, backend(2).mac, None, (CLIENT, 40002), (VIP_STALE, 80)),
            verdict: XDP_PASS,
            output: None,
        },
        Case {
            name: "a node's packet of a flow not pinned here to a stale VIP: passed",
            input: frames::tcp_ack(OUR_MAC, backend(2).mac, None, (CLIENT, 40003), (VIP_STALE, 80)),
            verdict: XDP_PASS,
            output: None,
        },
        // A switch floods a frame for a MAC it has not learnt (or whose port went
        // down) to every port: the host it is for balances it, no one else.
        Case {
            name: "tcp to a held VIP addressed to another host's MAC (flooded): passed, not forwarded twice",
            input: frames::tcp(OTHER_HOST_MAC, CLIENT_MAC, None, (CLIENT, 40008), (VIP, 80)),
            verdict: XDP_PASS,
            output: None,
        },
        Case {
            name: "tcp to a VIP held by every node (lo), flooded for another node: passed",
            input: frames::tcp_ack(OTHER_HOST_MAC, CLIENT_MAC, None, (CLIENT, 40009), (VIP_LO, 80)),
            verdict: XDP_PASS,
            output: None,
        },
        Case {
            name: "tcp in VLAN 42 to a VIP of VLAN 42 addressed to another host's MAC: passed",
            input: frames::tcp(OTHER_HOST_MAC, CLIENT_MAC, Some(VLAN), (CLIENT, 40010), (VIP_VLAN, 80)),
            verdict: XDP_PASS,
            output: None,
        },
        Case { name: "tcp to VIP on a port without service: passed", input: tcp(VIP, 40000, 81, None), verdict: XDP_PASS, output: None },
        Case { name: "tcp to a non-VIP address: passed", input: tcp(OTHER, 40000, 80, None), verdict: XDP_PASS, output: None },
        Case { name: "icmp echo to VIP: local stack", input: frames::icmp_echo(OUR_MAC, CLIENT_MAC, CLIENT, VIP), verdict: XDP_PASS, output: None },
    ]
    .into_iter()
    .chain(ndp_cases().into_iter().map(|(c, _)| c))
    .chain(lb6_cases(dp).into_iter().map(|(c, _)| c))
    .chain(icmp_cases(dp).into_iter().map(|(c, _)| c))
    .collect()
}

/// What a backend sends for a TCP flow from `client`:`cport` to `vip`:`vport`
/// (its IP packet, as an ICMP error quotes it).
fn reply4(vip: Ipv4Addr, vport: u16, client: Ipv4Addr, cport: u16) -> Vec<u8> {
    frames::l3(&frames::tcp_ack(CLIENT_MAC, OUR_MAC, None, (vip, vport), (client, cport))).to_vec()
}

fn reply6(vip: Ipv6Addr, vport: u16, client: Ipv6Addr, cport: u16) -> Vec<u8> {
    frames::l3(&frames::tcp6(CLIENT_MAC, OUR_MAC, None, (vip, vport), (client, cport), frames::TCP_ACK)).to_vec()
}

/// Fragmentation needed (next-hop MTU 1280) from the router to `vip`, quoting `quoted`.
fn frag_needed(vip: Ipv4Addr, vlan: Option<u16>, quoted: &[u8]) -> Vec<u8> {
    frames::icmp_error(ours(vlan), CLIENT_MAC, vlan, (ROUTER, vip), (3, 4), 1280, quoted)
}

/// Packet too big (MTU 1280) from the router to `vip`, quoting `quoted`.
fn too_big(vip: Ipv6Addr, vlan: Option<u16>, quoted: &[u8]) -> Vec<u8> {
    frames::icmp6_error(ours(vlan), CLIENT_MAC, vlan, (ROUTER6, vip), (2, 0), 1280, quoted)
}

/// ICMP and ICMPv6 errors to VIPs (and what else ICMP brings), each with the
/// reason it is counted under. Flows none of these runs pinned: the ring decides.
fn icmp_cases(dp: &Dataplane) -> Vec<(Case, &'static str)> {
    let choice = |vip: IpAddr, vport, proto, client: IpAddr, cport| ring_choice(dp, svc(vip, vport, proto), client, cport, vport);
    let fwd = |name, input: Vec<u8>, to, ours| (Case { name, output: Some(forwarded_from(&input, to, ours)), input, verdict: XDP_TX }, "forwarded_icmp_error");
    let pass = |name, input, reason| (Case { name, input, verdict: XDP_PASS, output: None }, reason);
    let udp4 = frames::l3(&frames::udp(CLIENT_MAC, OUR_MAC, (VIP, 53), (CLIENT, 5353), b"answer")).to_vec();
    let udp6 = frames::l3(&frames::udp6(CLIENT_MAC, OUR_MAC, (VIP6, 53), (CLIENT6, 5353), b"answer")).to_vec();
    // The quoted packet a later fragment (no ports), with IP options, cut short.
    let mut later = reply4(VIP, 80, CLIENT, 43010);
    later[6..8].copy_from_slice(&5u16.to_be_bytes());
    let opts = frames::l3(&frames::with_ip_options(&frames::tcp_ack(CLIENT_MAC, OUR_MAC, None, (VIP, 80), (CLIENT, 43011)), 2)).to_vec();
    let fragment6 = frames::l3(&frames::ipv6_ext(
        CLIENT_MAC,
        OUR_MAC,
        None,
        (VIP6, CLIENT6),
        &[(frames::EXT_FRAGMENT, 0, (0, true))],
        PROTO_TCP,
        &frames::tcp_header(80, 43012, frames::TCP_ACK),
    ))
    .to_vec();
    let time_exceeded = frames::icmp_error(OUR_MAC, CLIENT_MAC, None, (ROUTER, VIP), (11, 0), 0, &reply4(VIP, 80, CLIENT, 43013));
    let time_exceeded6 = frames::icmp6_error(OUR_MAC, CLIENT_MAC, None, (ROUTER6, VIP6), (3, 0), 0, &reply6(VIP6, 80, CLIENT6, 43014));
    let behind_ext = frames::ipv6_ext(OUR_MAC, CLIENT_MAC, None, (ROUTER6, VIP6), &[(frames::EXT_DEST_OPTS, 0, (0, false))], 58, &{
        let mut m = vec![2, 0, 0, 0, 0, 0, 5, 0];
        m.extend_from_slice(&reply6(VIP6, 80, CLIENT6, 43015));
        m
    });
    let inner_icmp = frames::l3(&frames::icmp_echo(CLIENT_MAC, OUR_MAC, VIP, CLIENT)).to_vec();
    vec![
        fwd(
            "fragmentation needed about a tcp flow: to the ring's backend",
            frag_needed(VIP, None, &reply4(VIP, 80, CLIENT, 43000)),
            choice(VIP.into(), 80, PROTO_TCP, CLIENT.into(), 43000),
            OUR_MAC,
        ),
        fwd(
            "port unreachable about a udp flow: to the ring's backend",
            frames::icmp_error(OUR_MAC, CLIENT_MAC, None, (ROUTER, VIP), (3, 3), 0, &udp4),
            choice(VIP.into(), 53, PROTO_UDP, CLIENT.into(), 5353),
            OUR_MAC,
        ),
        fwd(
            "fragmentation needed in VLAN 42 about a flow of a VIP of VLAN 42: forwarded, tag kept, from that VLAN's MAC",
            frag_needed(VIP_VLAN, Some(VLAN), &reply4(VIP_VLAN, 80, CLIENT, 43001)),
            choice(VIP_VLAN.into(), 80, PROTO_TCP, CLIENT.into(), 43001),
            VLAN_MAC,
        ),
        fwd(
            "packet too big about an IPv6 tcp flow: to the ring's backend",
            too_big(VIP6, None, &reply6(VIP6, 80, CLIENT6, 43002)),
            choice(VIP6.into(), 80, PROTO_TCP, CLIENT6.into(), 43002),
            OUR_MAC,
        ),
        fwd(
            "ICMPv6 port unreachable about a udp flow: to the ring's backend",
            frames::icmp6_error(OUR_MAC, CLIENT_MAC, None, (ROUTER6, VIP6), (1, 4), 0, &udp6),
            choice(VIP6.into(), 53, PROTO_UDP, CLIENT6.into(), 5353),
            OUR_MAC,
        ),
        fwd(
            "packet too big in VLAN 42 about a flow of an IPv6 VIP of VLAN 42: forwarded from that VLAN's MAC",
            too_big(VIP6_VLAN, Some(VLAN), &reply6(VIP6_VLAN, 80, CLIENT6, 43003)),
            choice(VIP6_VLAN.into(), 80, PROTO_TCP, CLIENT6.into(), 43003),
            VLAN_MAC,
        ),
        pass(
            "fragmentation needed about a flow served by this node: passed",
            frag_needed(VIP_LOCAL, None, &reply4(VIP_LOCAL, 80, CLIENT, 43004)),
            "passed_local_backend",
        ),
        pass(
            "packet too big about a flow served by this node: passed",
            too_big(VIP6, None, &reply6(VIP6, LOCAL6_PORT, CLIENT6, 43004)),
            "passed_local_backend",
        ),
        pass(
            "fragmentation needed for a VIP held elsewhere: passed",
            frag_needed(VIP_NOT_HELD, None, &reply4(VIP_NOT_HELD, 80, CLIENT, 43005)),
            "passed_not_owner",
        ),
        pass(
            "packet too big for an IPv6 VIP held elsewhere: passed",
            too_big(VIP6_NOT_HELD, None, &reply6(VIP6_NOT_HELD, 80, CLIENT6, 43005)),
            "passed_not_owner",
        ),
        fwd(
            "fragmentation needed about an unpinned flow of a stale VIP: to the ring's backend",
            frag_needed(VIP_STALE, None, &reply4(VIP_STALE, 80, CLIENT, 43006)),
            choice(VIP_STALE.into(), 80, PROTO_TCP, CLIENT.into(), 43006),
            OUR_MAC,
        ),
        pass(
            "fragmentation needed from a node about an unpinned flow of a stale VIP: passed",
            frames::icmp_error(OUR_MAC, backend(2).mac, None, (ROUTER, VIP_STALE), (3, 4), 1280, &reply4(VIP_STALE, 80, CLIENT, 43016)),
            "passed_not_owner",
        ),
        (
            Case {
                name: "broadcast fragmentation needed for a VIP held elsewhere: dropped",
                input: frames::icmp_error(frames::BROADCAST, CLIENT_MAC, None, (ROUTER, VIP_NOT_HELD), (3, 4), 1280, &reply4(VIP_NOT_HELD, 80, CLIENT, 43007)),
                verdict: XDP_DROP,
                output: None,
            },
            "drop_group_not_owner",
        ),
        pass("icmp echo to a VIP: the stack's", frames::icmp_echo(OUR_MAC, CLIENT_MAC, CLIENT, VIP), "passed_icmp"),
        pass("time exceeded about a flow: the stack's", time_exceeded, "passed_icmp"),
        pass(
            "fragmentation needed quoting a packet from another address than the VIP",
            frag_needed(VIP, None, &reply4(VIP_LOCAL, 80, CLIENT, 43008)),
            "passed_icmp",
        ),
        pass("fragmentation needed quoting a packet to a port without service", frag_needed(VIP, None, &reply4(VIP, 81, CLIENT, 43009)), "passed_icmp"),
        pass("fragmentation needed quoting a later fragment (no ports)", frag_needed(VIP, None, &later), "passed_icmp"),
        pass("fragmentation needed quoting a packet with IP options", frag_needed(VIP, None, &opts), "passed_icmp"),
        pass("fragmentation needed quoting an ICMP packet", frag_needed(VIP, None, &inner_icmp), "passed_icmp"),
        pass("fragmentation needed quoting its packet's IP header alone", frag_needed(VIP, None, &reply4(VIP, 80, CLIENT, 43016)[..22]), "passed_icmp"),
        pass(
            "fragmentation needed with IP options: the stack's",
            frames::with_ip_options(&frag_needed(VIP, None, &reply4(VIP, 80, CLIENT, 43017)), 1),
            "passed_icmp",
        ),
        pass("packet too big quoting a packet from another address than the VIP", too_big(VIP6, None, &reply6(VIP6_STALE, 80, CLIENT6, 43008)), "passed_other"),
        pass("packet too big quoting its packet's IPv6 header alone", too_big(VIP6, None, &reply6(VIP6, 80, CLIENT6, 43016)[..42]), "passed_other"),
        pass("packet too big quoting a fragment (an extension header)", too_big(VIP6, None, &fragment6), "passed_other"),
        pass("ICMPv6 time exceeded about a flow: the stack's", time_exceeded6, "passed_other"),
        pass("packet too big behind an extension header: the stack's", behind_ext, "passed_icmp"),
    ]
}

/// IPv6 balancing cases, each with the reason it is counted under.
fn lb6_cases(dp: &Dataplane) -> Vec<(Case, &'static str)> {
    use frames::{ipv6_ext, tcp6, udp6, EXT_AH, EXT_DEST_OPTS, EXT_FRAGMENT, EXT_HOP_BY_HOP, EXT_ROUTING, TCP_SYN};
    let tcp = |dst, sport, dport, vlan| tcp6(ours(vlan), CLIENT_MAC, vlan, (CLIENT6, sport), (dst, dport), TCP_SYN);
    let choice = |vip, sport, dport, proto| ring_choice(dp, svc(vip, dport, proto), CLIENT6, sport, dport);
    let fwd = |name, input: Vec<u8>, to| (Case { name, output: Some(forwarded(&input, to)), input, verdict: XDP_TX }, "forwarded");
    let pass = |name, input, reason| (Case { name, input, verdict: XDP_PASS, output: None }, reason);
    let ext = |exts: &[(u8, u8, (u16, bool))], upper, payload: &[u8]| ipv6_ext(OUR_MAC, CLIENT_MAC, None, (CLIENT6, VIP6), exts, upper, payload);
    let tcp_hdr = |sport| frames::tcp_header(sport, 80, TCP_SYN);
    let vlan = tcp(VIP6_VLAN, 41001, 80, Some(VLAN));
    let vlan_to = choice(VIP6_VLAN, 41001, 80, PROTO_TCP);
    let chain = ext(&[(EXT_HOP_BY_HOP, 0, (0, false)), (EXT_ROUTING, 1, (0, false)), (EXT_DEST_OPTS, 2, (0, false))], PROTO_TCP, &tcp_hdr(41002));
    // A jumbogram's hop-by-hop option, payload length 0: the ports are found all the same.
    let mut jumbo = ext(&[(EXT_HOP_BY_HOP, 0, (0, false))], PROTO_TCP, &tcp_hdr(41003));
    jumbo[14 + 4..14 + 6].copy_from_slice(&[0, 0]);
    jumbo[14 + 40 + 2..14 + 40 + 8].copy_from_slice(&[0xc2, 4, 0, 0, 0x01, 0x00]);
    // Fragments hash with zero ports, as IPv4's: both go where (src, dst, proto) points.
    let frag_to = ring_choice(dp, svc(VIP6, 53, PROTO_UDP), CLIENT6, 0, 0);
    let first_frag = ext(&[(EXT_FRAGMENT, 0, (0, true))], PROTO_UDP, &frames::udp_header(5353, 53, &[7u8; 32]));
    let later_frag = ext(&[(EXT_DEST_OPTS, 0, (0, false)), (EXT_FRAGMENT, 0, (5, false))], PROTO_UDP, &[9u8; 24]);
    let seven: Vec<(u8, u8, (u16, bool))> = vec![(EXT_DEST_OPTS, 0, (0, false)); 7];
    let mut cut_ext = ext(&[(EXT_HOP_BY_HOP, 3, (0, false))], PROTO_TCP, &tcp_hdr(41006));
    cut_ext.truncate(14 + 40 + 16); // the header says 32 bytes
    vec![
        fwd("tcp to an IPv6 VIP forwarded to the ring's backend", tcp(VIP6, 41000, 80, None), choice(VIP6, 41000, 80, PROTO_TCP)),
        (
            Case {
                name: "tcp in VLAN 42 to an IPv6 VIP of VLAN 42 forwarded, tag kept, from that VLAN's MAC",
                output: Some(forwarded_from(&vlan, vlan_to, VLAN_MAC)),
                input: vlan,
                verdict: XDP_TX,
            },
            "forwarded",
        ),
        fwd(
            "udp to an IPv6 VIP forwarded to the ring's backend",
            udp6(OUR_MAC, CLIENT_MAC, (CLIENT6, 5353), (VIP6, 53), b"query"),
            choice(VIP6, 5353, 53, PROTO_UDP),
        ),
        fwd("tcp past hop-by-hop, routing and destination options headers: forwarded by its ports", chain, choice(VIP6, 41002, 80, PROTO_TCP)),
        fwd("a jumbogram's hop-by-hop option (payload length 0): forwarded by its ports", jumbo, choice(VIP6, 41003, 80, PROTO_TCP)),
        fwd("first IPv6 fragment hashed on addresses", first_frag, frag_to),
        fwd("later IPv6 fragment, behind destination options, follows the first", later_frag, frag_to),
        pass("tcp behind an authentication header: passed, not walked", ext(&[(EXT_AH, 0, (0, false))], PROTO_TCP, &tcp_hdr(41004)), "passed_ipv6_ext"),
        pass("tcp behind seven extension headers: passed, chain too long", ext(&seven, PROTO_TCP, &tcp_hdr(41005)), "passed_ipv6_ext"),
        (Case { name: "an extension header cut short: dropped", input: cut_ext, verdict: XDP_DROP, output: None }, "drop_malformed"),
        pass("tcp to an IPv6 VIP on a port without service: passed", tcp(VIP6, 41007, 81, None), "passed_not_vip"),
        pass("tcp to an IPv6 VIP held elsewhere: passed", tcp(VIP6_NOT_HELD, 41008, 80, None), "passed_not_owner"),
        fwd("tcp to a stale IPv6 VIP: forwarded by the ring", tcp(VIP6_STALE, 41009, 80, None), choice(VIP6_STALE, 41009, 80, PROTO_TCP)),
        pass(
            "a node's tcp to a stale IPv6 VIP: passed, not forwarded again",
            tcp6(OUR_MAC, backend(2).mac, None, (CLIENT6, 41013), (VIP6_STALE, 80), TCP_SYN),
            "passed_not_owner",
        ),
        pass("tcp to an IPv6 non-VIP address: passed", tcp(CLIENT6, 41010, 80, None), "passed_not_vip"),
        pass(
            "tcp to a held IPv6 VIP addressed to another host's MAC (flooded): passed",
            tcp6(OTHER_HOST_MAC, CLIENT_MAC, None, (CLIENT6, 41014), (VIP6, 80), TCP_SYN),
            "passed_other_host",
        ),
        pass("tcp in VLAN 42 to an IPv6 VIP of the untagged network: passed", tcp(VIP6, 41011, 80, Some(VLAN)), "passed_not_owner"),
        (
            Case {
                name: "broadcast tcp to an IPv6 VIP held elsewhere: dropped",
                input: tcp6(frames::BROADCAST, CLIENT_MAC, None, (CLIENT6, 41012), (VIP6_NOT_HELD, 80), TCP_SYN),
                verdict: XDP_DROP,
                output: None,
            },
            "drop_group_not_owner",
        ),
    ]
}

/// The advertisement owed to a solicitation from (CLIENT_MAC, `to`) for `vip`,
/// built from scratch (not from the solicitation): Solicited and Override.
fn advert(vip: Ipv6Addr, to: Ipv6Addr, ours: Mac, vlan: Option<u16>) -> Vec<u8> {
    frames::neighbor_advertisement(CLIENT_MAC, ours, vlan, (vip, to), frames::NA_SOLICITED | frames::NA_OVERRIDE, vip, Some(ours))
}

/// `frame` with its IPv6 hop limit (untagged) set to `hop`.
fn with_hop_limit(frame: &[u8], hop: u8) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[14 + 7] = hop;
    f
}

/// IPv6 neighbour discovery cases, each with the reason it is counted under.
fn ndp_cases() -> Vec<(Case, &'static str)> {
    use frames::{ipv6, ll_option, nd_message, neighbor_solicitation as ns, solicited_node, ND_NS};
    let slla = ll_option(1, CLIENT_MAC);
    // A solicitation for VIP6 from CLIENT6 to its solicited-node group with `opts`.
    let ns_opts = |opts: &[u8]| {
        ipv6(frames::multicast_mac(solicited_node(VIP6)), CLIENT_MAC, None, (CLIENT6, solicited_node(VIP6)), 255, 58, &nd_message(ND_NS, 0, 0, VIP6, opts))
    };
    let nonce = [14u8, 1, 1, 2, 3, 4, 5, 6];
    let with_nonce: Vec<u8> = slla.iter().chain(&nonce).copied().collect();
    // Past the first two options, the rest are walked another way: three, the
    // eight walked at most, and nine.
    let unknown = [200u8, 1, 9, 9, 9, 9, 9, 9];
    let options = |n: usize| -> Vec<u8> { with_nonce.iter().copied().chain(unknown.iter().copied().cycle().take(8 * (n - 2))).collect() };
    let bad_third = flipped(ns_opts(&options(3)), 14 + 40 + 24 + 16 + 5);
    let unicast_probe = ipv6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, VIP6), 255, 58, &nd_message(ND_NS, 0, 0, VIP6, &slla));
    let prio = ns(CLIENT_MAC, Some(0), CLIENT6, VIP6);
    let mut prio_answer = advert(VIP6, CLIENT6, OUR_MAC, Some(0));
    prio_answer[14..16].copy_from_slice(&prio[14..16]);
    let mut padded = ns_opts(&[]);
    padded.extend_from_slice(&[0; 8]);
    let mut code1 = ns(CLIENT_MAC, None, CLIENT6, VIP6);
    code1[14 + 40 + 1] = 1; // checksum left stale: code is checked first all the same
    let short = ipv6(
        frames::multicast_mac(solicited_node(VIP6)),
        CLIENT_MAC,
        None,
        (CLIENT6, solicited_node(VIP6)),
        255,
        58,
        &nd_message(ND_NS, 0, 0, VIP6, &[])[..20],
    );
    let group_target = ALL_NODES;
    let mcast_target = ipv6(
        frames::multicast_mac(solicited_node(group_target)),
        CLIENT_MAC,
        None,
        (CLIENT6, solicited_node(group_target)),
        255,
        58,
        &nd_message(ND_NS, 0, 0, group_target, &slla),
    );
    let mut ns_cut = ns(CLIENT_MAC, None, CLIENT6, VIP6);
    ns_cut.truncate(ns_cut.len() - 8); // the payload length still counts the option
    let dad_slla = ipv6(
        frames::multicast_mac(solicited_node(VIP6)),
        CLIENT_MAC,
        None,
        (Ipv6Addr::UNSPECIFIED, solicited_node(VIP6)),
        255,
        58,
        &nd_message(ND_NS, 0, 0, VIP6, &slla),
    );
    let dad_unicast = ipv6(OUR_MAC, CLIENT_MAC, None, (Ipv6Addr::UNSPECIFIED, VIP6), 255, 58, &nd_message(ND_NS, 0, 0, VIP6, &[]));
    let to_all_nodes = ipv6(ALL_NODES_MAC, CLIENT_MAC, None, (CLIENT6, ALL_NODES), 255, 58, &nd_message(ND_NS, 0, 0, VIP6, &slla));
    let other_group = ipv6(
        frames::multicast_mac(solicited_node(VIP6_STALE)),
        CLIENT_MAC,
        None,
        (CLIENT6, solicited_node(Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0x1234, 0x5678))),
        255,
        58,
        &nd_message(ND_NS, 0, 0, VIP6, &slla),
    );
    // A checksum off by one in each part it covers: the pseudo-header's source,
    // the message, an option.
    let bad_src = flipped(ns(CLIENT_MAC, None, CLIENT6, VIP6), 14 + 8 + 15);
    let bad_reserved = flipped(ns(CLIENT_MAC, None, CLIENT6, VIP6), 14 + 40 + 5);
    let bad_option = flipped(ns(CLIENT_MAC, None, CLIENT6, VIP6), 14 + 40 + 24 + 7);
    // An option of 16 bytes (SEcure Neighbor Discovery's are): not summed, not answered.
    let long_ns = ns_opts(&[14u8, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
    let echo = ipv6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, VIP6), 64, 58, &[128, 0, 0, 0, 0, 1, 0, 1]);
    let udp6 = ipv6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, VIP6), 64, 17, &frames::udp_header(5353, 5300, b"query"));
    let rs = ipv6(ALL_NODES_MAC, CLIENT_MAC, None, (CLIENT6_LL, Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2)), 255, 58, &[133, 0, 0, 0, 0, 0, 0, 0]);
    let tx = |name, input, output| (Case { name, input, verdict: XDP_TX, output: Some(output) }, "ndp_answered");
    let pass = |name, input, reason| (Case { name, input, verdict: XDP_PASS, output: None }, reason);
    vec![
        tx(
            "ns for a held IPv6 VIP: advertisement, S+O, our MAC as target link-layer address",
            ns(CLIENT_MAC, None, CLIENT6, VIP6),
            advert(VIP6, CLIENT6, OUR_MAC, None),
        ),
        tx("ns from a link-local address: answered to it", ns(CLIENT_MAC, None, CLIENT6_LL, VIP6), advert(VIP6, CLIENT6_LL, OUR_MAC, None)),
        tx("unicast ns to the VIP itself (reachability probe): answered", unicast_probe, advert(VIP6, CLIENT6, OUR_MAC, None)),
        tx("ns without options: the frame grows to the advertisement", ns_opts(&[]), advert(VIP6, CLIENT6, OUR_MAC, None)),
        tx("ns with a nonce option: the frame shrinks to the advertisement", ns_opts(&with_nonce), advert(VIP6, CLIENT6, OUR_MAC, None)),
        tx("ns with Ethernet padding past its payload: answered, padding gone", padded, advert(VIP6, CLIENT6, OUR_MAC, None)),
        tx("ns with three options: answered", ns_opts(&options(3)), advert(VIP6, CLIENT6, OUR_MAC, None)),
        tx("ns with eight options (walked at most): answered", ns_opts(&options(8)), advert(VIP6, CLIENT6, OUR_MAC, None)),
        tx(
            "duplicate address detection (from ::): advertisement to all-nodes, Override only",
            ns(CLIENT_MAC, None, Ipv6Addr::UNSPECIFIED, VIP6),
            frames::neighbor_advertisement(ALL_NODES_MAC, OUR_MAC, None, (VIP6, ALL_NODES), frames::NA_OVERRIDE, VIP6, Some(OUR_MAC)),
        ),
        tx(
            "ns in VLAN 42 for a VIP of VLAN 42: answered in VLAN 42 with its MAC",
            ns(CLIENT_MAC, Some(VLAN), CLIENT6, VIP6_VLAN),
            advert(VIP6_VLAN, CLIENT6, VLAN_MAC, Some(VLAN)),
        ),
        tx("priority-tagged ns for a VIP of the untagged network: answered, tag kept", prio, prio_answer),
        pass("ns in VLAN 42 for a VIP of the untagged network", ns(CLIENT_MAC, Some(VLAN), CLIENT6, VIP6), "ndp_not_held"),
        pass("untagged ns for a VIP of VLAN 42", ns(CLIENT_MAC, None, CLIENT6, VIP6_VLAN), "ndp_not_held"),
        pass("ns for an unheld address", ns(CLIENT_MAC, None, CLIENT6, VIP6_NOT_HELD), "ndp_not_held"),
        pass("ns for a stale VIP (fenced)", ns(CLIENT_MAC, None, CLIENT6, VIP6_STALE), "ndp_stale"),
        pass("ns for a VIP announced from lo", ns(CLIENT_MAC, None, CLIENT6, VIP6_LO), "ndp_not_announced"),
        pass("ns with a bad checksum (source address)", bad_src, "ndp_invalid"),
        pass("ns with a bad checksum (reserved field)", bad_reserved, "ndp_invalid"),
        pass("ns with a bad checksum (source link-layer option)", bad_option, "ndp_invalid"),
        pass("ns with an option of 16 bytes", long_ns, "ndp_invalid"),
        pass("ns with nine options (more than walked)", ns_opts(&options(9)), "ndp_invalid"),
        pass("ns with a bad checksum (third option)", bad_third, "ndp_invalid"),
        pass("ns whose third option runs past its end", ns_opts(&[&with_nonce[..], &[14, 2, 1, 2, 3, 4, 5, 6]].concat()), "ndp_invalid"),
        pass("ns with hop limit 254 (through a router)", with_hop_limit(&ns(CLIENT_MAC, None, CLIENT6, VIP6), 254), "ndp_invalid"),
        pass("ns with code 1", code1, "ndp_invalid"),
        pass("ns of 20 bytes (shorter than 24)", short, "ndp_invalid"),
        pass("ns for a multicast target", mcast_target, "ndp_invalid"),
        pass("ns with a zero-length option", ns_opts(&[1, 0, 2, 0, 0, 0, 0, 0xaa]), "ndp_invalid"),
        pass("ns whose option runs past its end", ns_opts(&[14, 2, 1, 2, 3, 4, 5, 6]), "ndp_invalid"),
        pass("ns whose payload length runs past the frame", ns_cut, "ndp_invalid"),
        pass("duplicate address detection with a source link-layer option", dad_slla, "ndp_invalid"),
        pass("duplicate address detection not to the solicited-node group", dad_unicast, "ndp_invalid"),
        pass("ns to all-nodes", to_all_nodes, "ndp_invalid"),
        pass("ns to another target's solicited-node group", other_group, "ndp_invalid"),
        pass("icmpv6 echo to an IPv6 VIP: the stack's", echo, "passed_other"),
        pass("udp to an IPv6 VIP without a service there: passed", udp6, "passed_not_vip"),
        pass("router solicitation: the kernel's", rs, "ndp_other"),
    ]
}

#[test]
fn fixtures_byte_for_byte() {
    if !privileged() {
        return;
    }
    let mut w = world();
    run_cases(&mut w, "");
    let counters = w.dp.counters().unwrap();
    assert!(counters.reasons["arp_answered"].0 >= 3);
    // ARP in VLAN 4000, QinQ, double 802.1Q, 802.1ad; tcp in VLAN 4000, QinQ tcp.
    assert_eq!(counters.reasons["passed_vlan_other"].0, 6);
    assert!(counters.reasons["forwarded"].0 >= 6);
    assert!(counters.reasons["drop_no_backend"].0 >= 1);
    assert!(counters.reasons["arp_stale"].0 >= 1);
    assert!(counters.reasons["arp_not_announced"].0 >= 1);
    assert!(counters.reasons["passed_local_backend"].0 >= 1);
    assert!(counters.reasons["passed_icmp"].0 >= 1);
    // Group frames to VIPs held elsewhere or stale: two IPv4, one IPv6, one ICMP error.
    assert_eq!(counters.reasons["drop_group_not_owner"].0, 4);
    // Frames flooded for another host: three IPv4 (one in VLAN 42), one IPv6.
    assert_eq!(counters.reasons["passed_other_host"].0, 4);
    assert_eq!(counters.reasons["forwarded_icmp_error"].0, 7);
    // Per-service and per-backend counters saw the forwarded packets.
    assert!(counters.services.values().map(|c| c.0).sum::<u64>() >= 7);
    assert!(counters.backends.values().map(|c| c.0).sum::<u64>() >= 6);
}

/// Each of [`cases`] through the program: its verdict and output frame.
fn run_cases(w: &mut World, context: &str) {
    for c in cases(&w.dp) {
        let (verdict, out, _) = w.dp.test_run(&c.input, 1, None).unwrap();
        assert_eq!(verdict, c.verdict, "{}{context}: verdict", c.name);
        let want = c.output.unwrap_or_else(|| c.input.clone());
        assert_eq!(out, want, "{}{context}: output frame", c.name);
    }
}

/// Whether `lb_held_filter` has `vip`'s bit.
fn held_bit(w: &mut World, vip: IpAddr) -> bool {
    let words = w.dp.held().held_filter().unwrap();
    let bit = vip_filter_bit_of(vip);
    words[(bit / 32) as usize] & (1 << (bit % 32)) != 0
}

/// Every word of `lb_held_filter` set to `word`: 0 as in pins an older agent
/// wrote, !0 as if every VIP were held here.
fn fill_held_filter(w: &World, word: u32) {
    let map = aya::maps::Map::Array(aya::maps::MapData::from_pin(w.pins.path.join(map_names::HELD_FILTER)).unwrap());
    let mut filter: aya::maps::Array<_, [u32; VIP_FILTER_WORDS as usize]> = map.try_into().unwrap();
    filter.set(0, [word; VIP_FILTER_WORDS as usize], 0).unwrap();
}

/// The agent keeps a VIP's `lb_held_filter` bit while it has an entry (fresh or
/// stale), and clears it when the entry goes.
#[test]
fn the_held_filter_follows_the_held_vips() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let held: [IpAddr; 10] = [
        VIP.into(),
        VIP_STALE.into(),
        VIP_LOCAL.into(),
        VIP_LO.into(),
        VIP_VLAN.into(),
        VIP6.into(),
        VIP6_STALE.into(),
        VIP6_LO.into(),
        VIP6_VLAN.into(),
        VIP_EMPTY.into(),
    ];
    for v in held {
        assert!(held_bit(&mut w, v), "{v} held: its bit set");
    }
    for v in [IpAddr::from(VIP_NOT_HELD), VIP6_NOT_HELD.into(), OTHER.into()] {
        assert!(!held_bit(&mut w, v), "{v} not held: its bit clear");
    }
    w.dp.release_vip(IFINDEX, VIP).unwrap();
    assert!(held_bit(&mut w, VIP.into()), "released: a stale entry, its bit kept");
    w.dp.held().forget_all(&[(IFINDEX, VIP.into()), (IFINDEX, VIP6.into())]).unwrap();
    assert!(!held_bit(&mut w, VIP.into()) && !held_bit(&mut w, VIP6.into()), "forgotten together: bits cleared");
    w.dp.forget_vip(IFINDEX, VIP_LOCAL).unwrap();
    assert!(!held_bit(&mut w, VIP_LOCAL.into()), "forgotten alone: bit cleared");
    assert!(held_bit(&mut w, VIP_STALE.into()) && held_bit(&mut w, VIP6_VLAN.into()), "the others' bits kept");
}

/// Pins an older agent wrote, without `lb_held_filter`: a newer agent (or its
/// CLI) opens them, holds and forgets VIPs, and the program still balances them.
#[test]
fn pins_without_the_held_filter_still_open_and_hold() {
    if !privileged() {
        return;
    }
    let mut w = world();
    std::fs::remove_file(w.pins.path.join(map_names::HELD_FILTER)).unwrap();
    let mut dp = Dataplane::open(&w.pins.path).unwrap();
    assert!(dp.held().held_filter().is_err(), "no held filter to read");
    dp.hold_vip(IFINDEX, OTHER, monotonic_ns() + 3_600_000_000_000).unwrap();
    dp.forget_vip(IFINDEX, OTHER).unwrap();
    drop(dp);
    let syn = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 43000), (VIP, 80));
    let ack = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 43000), (VIP, 80));
    let to = ring_choice(&w.dp, svc(VIP, 80, PROTO_TCP), CLIENT, 43000, 80);
    for (f, what) in [(&syn, "first packet"), (&ack, "second packet"), (&ack, "third packet")] {
        let (verdict, out, _) = w.dp.test_run(f, 1, None).unwrap();
        assert_eq!((verdict, out), (XDP_TX, forwarded(f, to)), "{what}");
    }
}

/// `lb4_held_slots` and `lb6_held_slots` of the world's pins, every slot rewritten by `f`.
fn rewrite_held_slots(w: &World, f: impl Fn(u64) -> u64) {
    let open = |name| aya::maps::Map::Array(aya::maps::MapData::from_pin(w.pins.path.join(name)).unwrap());
    let mut v4: aya::maps::Array<_, Lb4HeldSlot> = open(map_names::HELD_SLOTS).try_into().unwrap();
    let mut v6: aya::maps::Array<_, Lb6HeldSlot> = open(map_names::HELD_SLOTS6).try_into().unwrap();
    for i in 0..HELD_SLOTS {
        let s = v4.get(&i, 0).unwrap();
        if s != Lb4HeldSlot::default() {
            v4.set(i, Lb4HeldSlot { held: HeldVip { deadline_ns: f(s.held.deadline_ns), ..s.held }, ..s }, 0).unwrap();
        }
        let s = v6.get(&i, 0).unwrap();
        if s != Lb6HeldSlot::default() {
            v6.set(i, Lb6HeldSlot { held: HeldVip { deadline_ns: f(s.held.deadline_ns), ..s.held }, ..s }, 0).unwrap();
        }
    }
}

/// Every held entry has a copy in its slot (fresh or stale: the entry's
/// deadline, a check word that holds); a release or a removal empties the slot
/// first, and holding again fills it.
#[test]
fn the_held_slots_follow_the_held_entries() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let copies = |w: &mut World| w.dp.held().slot_entries().unwrap();
    let slots = copies(&mut w);
    let entries = w.dp.held().entries().unwrap();
    assert_eq!(slots.len(), entries.len(), "one slot each (no two of the fixture's VIPs share one): {slots:?}");
    for e in &entries {
        assert_eq!(slots.get(&(e.ifindex, e.vip)), Some(&(e.deadline_ns, true)), "{e:?}");
    }
    w.dp.release_vip(IFINDEX, VIP).unwrap();
    assert!(!copies(&mut w).contains_key(&(IFINDEX, VIP.into())), "released: its slot emptied (the entry says stale)");
    let hour = monotonic_ns() + 3_600_000_000_000;
    w.dp.hold_vip(IFINDEX, VIP, hour).unwrap();
    assert_eq!(copies(&mut w).get(&(IFINDEX, VIP.into())).map(|c| c.1), Some(true), "held again: its slot filled");
    w.dp.held().forget_all(&[(IFINDEX, VIP.into()), (IFINDEX, VIP6.into())]).unwrap();
    let left = copies(&mut w);
    assert!(!left.contains_key(&(IFINDEX, VIP.into())) && !left.contains_key(&(IFINDEX, VIP6.into())), "forgotten: slots emptied");
    assert_eq!(left.len(), entries.len() - 2, "the others kept: {left:?}");
}

/// The data path reads a held VIP's slot before its hash map: with VIP's and
/// VIP6's `arp_held` / `ndp_held` entries removed behind the agent's back, their
/// copies alone still answer ARP and balance their flows; with the slots emptied
/// too, neither is held.
#[test]
fn a_held_vip_is_found_in_its_slot_alone() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let open = |name| aya::maps::Map::HashMap(aya::maps::MapData::from_pin(w.pins.path.join(name)).unwrap());
    let mut held4: aya::maps::HashMap<_, ArpHeldKey, HeldVip> = open(map_names::HELD).try_into().unwrap();
    let mut held6: aya::maps::HashMap<_, NdpHeldKey, HeldVip> = open(map_names::HELD6).try_into().unwrap();
    held4.remove(&ArpHeldKey { ifindex: IFINDEX, vip: VIP.octets() }).unwrap();
    held6.remove(&NdpHeldKey { ifindex: IFINDEX, vip: VIP6.octets() }).unwrap();
    let arp = frames::arp_request(CLIENT_MAC, CLIENT, VIP, None);
    let syn = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 43000), (VIP, 80));
    let syn6 = frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, 43000), (VIP6, 80), frames::TCP_SYN);
    let to = ring_choice(&w.dp, svc(VIP, 80, PROTO_TCP), CLIENT, 43000, 80);
    let to6 = ring_choice(&w.dp, svc(VIP6, 80, PROTO_TCP), CLIENT6, 43000, 80);
    let mut run = |f: &[u8]| {
        let (verdict, out, _) = w.dp.test_run(f, 1, None).unwrap();
        (verdict, out)
    };
    assert_eq!(run(&arp), (XDP_TX, frames::arp_reply_for(&arp, OUR_MAC)), "ARP answered from the slot");
    assert_eq!(run(&syn), (XDP_TX, forwarded(&syn, to)), "IPv4 SYN balanced from the slot");
    assert_eq!(run(&syn6), (XDP_TX, forwarded(&syn6, to6)), "IPv6 SYN balanced from the slot");
    let open_array = |name| aya::maps::Map::Array(aya::maps::MapData::from_pin(w.pins.path.join(name)).unwrap());
    let mut v4: aya::maps::Array<_, Lb4HeldSlot> = open_array(map_names::HELD_SLOTS).try_into().unwrap();
    let mut v6: aya::maps::Array<_, Lb6HeldSlot> = open_array(map_names::HELD_SLOTS6).try_into().unwrap();
    v4.set(held_slot(vip_filter_bit(VIP.octets())), Lb4HeldSlot::default(), 0).unwrap();
    v6.set(held_slot(vip_filter_bit6(VIP6.octets())), Lb6HeldSlot::default(), 0).unwrap();
    assert_eq!(run(&arp).0, XDP_PASS, "no entry, no copy: not held");
    assert_eq!(run(&syn).0, XDP_PASS, "IPv4: not held, passed");
    assert_eq!(run(&syn6).0, XDP_PASS, "IPv6: not held, passed");
}

/// Two VIPs with one held slot: the first held keeps it, the other is found in
/// `arp_held`, and both are balanced; released, the first frees the slot for
/// the other's next refresh.
#[test]
fn two_vips_of_one_held_slot_are_both_balanced() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let slot = |v: Ipv4Addr| held_slot(vip_filter_bit(v.octets()));
    let twin = (0..=u16::MAX)
        .map(|i| Ipv4Addr::new(198, 19, (i >> 8) as u8, i as u8))
        .find(|v| slot(*v) == slot(VIP))
        .expect("an address of 198.19.0.0/16 shares VIP's slot");
    let hour = monotonic_ns() + 3_600_000_000_000;
    w.dp.hold_vip(IFINDEX, twin, hour).unwrap();
    w.dp.set_service(svc(twin, 80, PROTO_TCP), &[backend(1), backend(2), backend(3)], TABLE, 0).unwrap();
    let copies = w.dp.held().slot_entries().unwrap();
    assert!(copies.contains_key(&(IFINDEX, VIP.into())) && !copies.contains_key(&(IFINDEX, twin.into())), "{copies:?}");
    for v in [VIP, twin] {
        let syn = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 43000), (v, 80));
        let to = ring_choice(&w.dp, svc(v, 80, PROTO_TCP), CLIENT, 43000, 80);
        assert_eq!(w.dp.test_run(&syn, 1, None).unwrap().0, XDP_TX, "{v}: forwarded");
        assert_eq!(w.dp.test_run(&syn, 1, None).unwrap().1, forwarded(&syn, to), "{v}: to its ring's backend");
    }
    w.dp.release_vip(IFINDEX, VIP).unwrap();
    w.dp.hold_vip(IFINDEX, twin, hour).unwrap();
    assert!(w.dp.held().slot_entries().unwrap().contains_key(&(IFINDEX, twin.into())), "the slot freed goes to the other");
}

/// The held slots are a copy: every fixture gives the same verdict and frame
/// with every slot emptied (pins an older agent wrote) and with every copy
/// torn, its deadline never passing where its check word says otherwise (a read
/// while the agent rewrites it): the lookup then falls back to `arp_held` and `ndp_held`,
/// so a stale VIP stays stale.
#[test]
fn fixtures_byte_for_byte_whatever_the_held_slots() {
    if !privileged() {
        return;
    }
    for (what, f) in [("emptied", None), ("torn", Some(|_| u64::MAX))] {
        let mut w = world();
        match f {
            Some(f) => rewrite_held_slots(&w, f),
            None => {
                let all: Vec<(u32, IpAddr)> = w.dp.held().slot_entries().unwrap().into_keys().collect();
                let entries = w.dp.held().entries().unwrap();
                // Emptied as a release empties them, the entries written back as they were.
                for (ifindex, vip) in all {
                    let e = entries.iter().find(|e| (e.ifindex, e.vip) == (ifindex, vip)).unwrap();
                    w.dp.held().release(ifindex, vip).unwrap();
                    if e.deadline_ns > 0 {
                        rewrite_entry_deadline(&w, ifindex, vip, e.deadline_ns);
                    }
                }
                assert!(w.dp.held().slot_entries().unwrap().is_empty());
            }
        }
        run_cases(&mut w, &format!(" (held slots {what})"));
    }
}

/// `vip`'s held entry written back with `deadline_ns` (as stored), its slot untouched.
fn rewrite_entry_deadline(w: &World, ifindex: u32, vip: IpAddr, deadline_ns: u64) {
    let open = |name| aya::maps::Map::HashMap(aya::maps::MapData::from_pin(w.pins.path.join(name)).unwrap());
    match vip {
        IpAddr::V4(v) => {
            let mut m: aya::maps::HashMap<_, ArpHeldKey, HeldVip> = open(map_names::HELD).try_into().unwrap();
            let k = ArpHeldKey { ifindex, vip: v.octets() };
            let h = m.get(&k, 0).unwrap();
            m.insert(k, HeldVip { deadline_ns, ..h }, 0).unwrap();
        }
        IpAddr::V6(v) => {
            let mut m: aya::maps::HashMap<_, NdpHeldKey, HeldVip> = open(map_names::HELD6).try_into().unwrap();
            let k = NdpHeldKey { ifindex, vip: v.octets() };
            let h = m.get(&k, 0).unwrap();
            m.insert(k, HeldVip { deadline_ns, ..h }, 0).unwrap();
        }
    }
}

/// `lb_held_filter` is a hint: every fixture gives the same verdict and frame,
/// and flows keep their backends across ring changes, with every bit clear
/// (pins an older agent wrote) or every bit set.
#[test]
fn fixtures_byte_for_byte_whatever_the_held_filter() {
    if !privileged() {
        return;
    }
    for word in [0, !0] {
        let mut w = world();
        fill_held_filter(&w, word);
        run_cases(&mut w, &format!(" (held filter words {word:#x})"));
        let syn = |sport| frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
        let ack = |sport| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
        flows_kept_across_ring_changes(Some(word), svc(VIP, 80, PROTO_TCP), CLIENT.into(), syn, ack);
        let syn = |sport| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (VIP6, 80), frames::TCP_SYN);
        let ack = |sport| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (VIP6, 80), frames::TCP_ACK);
        flows_kept_across_ring_changes(Some(word), svc(VIP6, 80, PROTO_TCP), CLIENT6.into(), syn, ack);
    }
}

/// Every NDP case is counted under its reason, with the bytes its headers give.
#[test]
fn ndp_cases_are_counted_by_reason() {
    if !privileged() {
        return;
    }
    let mut w = world();
    counted_by_reason(&mut w, ndp_cases());
}

/// Runs each case and checks its verdict, its output and that it was counted once
/// under its reason with the bytes its headers give: the layer-2 header, then the
/// IPv4 total length, or the IPv6 header and its payload length (a jumbogram's
/// says 0); the frame's when dropped.
fn counted_by_reason(w: &mut World, cases: Vec<(Case, &'static str)>) {
    for (c, reason) in cases {
        let before = w.dp.counters().unwrap().reasons[reason];
        let (verdict, out, _) = w.dp.test_run(&c.input, 1, None).unwrap();
        assert_eq!(verdict, c.verdict, "{}: verdict", c.name);
        assert_eq!(out, c.output.clone().unwrap_or_else(|| c.input.clone()), "{}: output frame", c.name);
        let after = w.dp.counters().unwrap().reasons[reason];
        let l2 = if c.input[12..14] == [0x81, 0x00] { 18 } else { 14 };
        let word = |at: usize| usize::from(u16::from_be_bytes([c.input[l2 + at], c.input[l2 + at + 1]]));
        let l3 = if c.input[l2 - 2..l2] == [0x08, 0x00] { word(2) } else { 40 + word(4) };
        let bytes = if verdict == XDP_DROP { c.input.len() } else { l2 + l3 } as u64;
        assert_eq!((after.0 - before.0, after.1 - before.1), (1, bytes), "{}: {reason} (packets, bytes)", c.name);
    }
}

/// Every IPv6 balancing case is counted under its reason (see [`counted_by_reason`]).
#[test]
fn lb6_cases_are_counted_by_reason() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let cases = lb6_cases(&w.dp);
    counted_by_reason(&mut w, cases);
}

/// Every ICMP case is counted under its reason (see [`counted_by_reason`]).
#[test]
fn icmp_cases_are_counted_by_reason() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let cases = icmp_cases(&w.dp);
    counted_by_reason(&mut w, cases);
}

/// An ICMP error about a flow goes where the flow's packets go: to its pin in the
/// flow table when a ring change moved its slot elsewhere, to the ring's backend
/// when it is not pinned. No error pins or records a flow (see also
/// [`icmp_errors_follow_ipv4_flows_and_refresh_nothing`]).
fn icmp_errors_follow_flows(
    s: ServiceAddr,
    client: IpAddr,
    syn: impl Fn(u16) -> Vec<u8>,
    ack: impl Fn(u16) -> Vec<u8>,
    err: impl Fn(u16) -> Vec<u8>,
) -> (World, Vec<(u16, Mac)>) {
    let mut w = world();
    let pinned: Vec<(u16, Mac)> = (44000..44300u16)
        .map(|p| {
            w.dp.test_run(&syn(p), 1, None).unwrap();
            let (_, out, _) = w.dp.test_run(&ack(p), 1, None).unwrap();
            (p, out[0..6].try_into().unwrap())
        })
        .collect();
    w.dp.set_service(s, &[backend(1), backend(2), backend(3), backend(4)], TABLE, 0).unwrap();
    let moved: Vec<(u16, Mac)> = pinned.into_iter().filter(|(p, m)| ring_choice(&w.dp, s, client, *p, s.port) != *m).collect();
    assert!(!moved.is_empty(), "the fourth backend took no flow of 300: the test proves less");
    let state = |w: &World| (w.dp.flow_count(), w.dp.new_flow_count(), w.dp.counters().unwrap().reasons["forwarded_icmp_error"].0);
    let before = state(&w);
    for (p, pin) in &moved {
        let e = err(*p);
        let (v, out, _) = w.dp.test_run(&e, 1, None).unwrap();
        assert_eq!(
            (v, out),
            (XDP_TX, forwarded(&e, *pin)),
            "error about flow {p}: to its pin, not to the ring's {:?}",
            ring_choice(&w.dp, s, client, *p, s.port)
        );
    }
    let unpinned = 45000..45100u16;
    for p in unpinned.clone() {
        let e = err(p);
        let (v, out, _) = w.dp.test_run(&e, 1, None).unwrap();
        assert_eq!((v, out), (XDP_TX, forwarded(&e, ring_choice(&w.dp, s, client, p, s.port))), "error about unpinned flow {p}: to the ring's backend");
    }
    let after = state(&w);
    assert_eq!((after.0, after.1), (before.0, before.1), "ICMP errors pinned or recorded flows (pinned, recorded)");
    assert_eq!(after.2 - before.2, (moved.len() + unpinned.len()) as u64, "forwarded_icmp_error");
    // The unpinned flows are still new: their next packet is a first one.
    w.dp.test_run(&ack(45000), 1, None).unwrap();
    assert_eq!((w.dp.flow_count(), w.dp.new_flow_count()), (before.0, before.1 + 1), "a flow's first packet after its error");
    (w, moved)
}

#[test]
fn icmp_errors_follow_ipv4_flows_and_refresh_nothing() {
    if !privileged() {
        return;
    }
    stay_on_cpu0();
    let syn = |p| frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, p), (VIP, 80));
    let ack = |p| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, p), (VIP, 80));
    let err = |p| frag_needed(VIP, None, &reply4(VIP, 80, CLIENT, p));
    let (mut w, moved) = icmp_errors_follow_flows(svc(VIP, 80, PROTO_TCP), CLIENT.into(), syn, ack, err);
    // Neither the pin's stamp (made older here) nor the flow cache is written by
    // an error; the flow's own next packet writes both.
    let (p, pin) = moved[0];
    let key = Lb4FlowKey { src: CLIENT.octets(), dst: VIP.octets(), sport: p.to_be_bytes(), dport: 80u16.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
    let old = w.dp.flow(&key).expect("pinned").stamp - 5;
    assert!(w.dp.set_flow_stamp(&key, old));
    assert_eq!(w.dp.test_run(&err(p), 1, None).unwrap().1[0..6], pin);
    assert_eq!(w.dp.flow(&key).map(|e| e.stamp), Some(old), "an error refreshed its flow's stamp");
    assert_eq!(cached_to(&w, CLIENT, p, VIP, 80), None, "an error's answer was memoised");
    assert_eq!(w.dp.test_run(&ack(p), 1, None).unwrap().1[0..6], pin);
    assert_ne!(w.dp.flow(&key).map(|e| e.stamp), Some(old), "the flow's packet did not refresh the stamp: the check above proves nothing");
    assert_eq!(cached_to(&w, CLIENT, p, VIP, 80), Some(pin), "the flow's packet was not memoised: the check above proves nothing");
}

#[test]
fn icmpv6_errors_follow_ipv6_flows() {
    if !privileged() {
        return;
    }
    let syn = |p| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, p), (VIP6, 80), frames::TCP_SYN);
    let ack = |p| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, p), (VIP6, 80), frames::TCP_ACK);
    let err = |p| too_big(VIP6, None, &reply6(VIP6, 80, CLIENT6, p));
    icmp_errors_follow_flows(svc(VIP6, 80, PROTO_TCP), CLIENT6.into(), syn, ack, err);
}

/// The unsolicited advertisement the agent sends on takeover (through the
/// gratuitous ARP sender) is the one RFC 4861 7.2.6 describes, byte for byte.
#[test]
fn the_agents_unsolicited_advertisement_is_well_formed() {
    let got = vip_agent::ha::garp::unsolicited_na_frame(OUR_MAC, VIP6);
    let want = frames::neighbor_advertisement(ALL_NODES_MAC, OUR_MAC, None, (VIP6, ALL_NODES), frames::NA_OVERRIDE, VIP6, Some(OUR_MAC));
    assert_eq!(got.to_vec(), want);
    assert_eq!(vip_agent::ha::garp::announcement_frame(OUR_MAC, VIP6.into()), want);
}

/// `f` with the lowest bit of byte `at` flipped.
fn flipped(mut f: Vec<u8>, at: usize) -> Vec<u8> {
    f[at] ^= 1;
    f
}

/// NDP conflict detection, as ARP's: a Neighbor Advertisement in which another
/// MAC (its target link-layer option, else its source) claims a VIP we hold
/// fresh on that network is counted (`ndp_conflict`, `ndp_conflicts`) and passed.
#[test]
fn ndp_conflicts_are_counted() {
    if !privileged() {
        return;
    }
    const INTRUDER: Mac = [0x02, 0, 0, 0, 0, 0xbb];
    let o = frames::NA_OVERRIDE;
    let na = |src_mac, vip, tlla, vlan, flags| frames::neighbor_advertisement(ALL_NODES_MAC, src_mac, vlan, (CLIENT6_LL, ALL_NODES), flags, vip, tlla);
    // Two unknown options, then the target link-layer address (walked past the first two).
    let opts: Vec<u8> = [[200u8, 1, 9, 9, 9, 9, 9, 9]; 2].concat().into_iter().chain(frames::ll_option(2, INTRUDER)).collect();
    let third_tlla = frames::ipv6(ALL_NODES_MAC, OUR_MAC, None, (CLIENT6_LL, ALL_NODES), 255, 58, &frames::nd_message(frames::ND_NA, 0, o, VIP6, &opts));
    let table: Vec<(&str, Vec<u8>, bool)> = vec![
        ("foreign unsolicited advertisement for a held VIP", na(INTRUDER, VIP6, Some(INTRUDER), None, o), true),
        ("foreign advertisement without target option, from another MAC", na(INTRUDER, VIP6, None, None, o), true),
        ("foreign advertisement in VLAN 42 for its VIP", na(INTRUDER, VIP6_VLAN, Some(INTRUDER), Some(VLAN), o), true),
        ("foreign advertisement in VLAN 42 for a VIP of the untagged network", na(INTRUDER, VIP6, Some(INTRUDER), Some(VLAN), o), false),
        ("advertisement naming our MAC", na(INTRUDER, VIP6, Some(OUR_MAC), None, o), false),
        ("our own advertisement in VLAN 42", na(VLAN_MAC, VIP6_VLAN, Some(VLAN_MAC), Some(VLAN), o), false),
        ("foreign advertisement for a VIP not held here", na(INTRUDER, VIP6_NOT_HELD, Some(INTRUDER), None, o), false),
        ("foreign advertisement for a stale VIP", na(INTRUDER, VIP6_STALE, Some(INTRUDER), None, o), false),
        ("foreign advertisement with hop limit 64 (invalid)", with_hop_limit(&na(INTRUDER, VIP6, Some(INTRUDER), None, o), 64), false),
        ("foreign solicited advertisement to a group (invalid)", na(INTRUDER, VIP6, Some(INTRUDER), None, o | frames::NA_SOLICITED), false),
        ("foreign advertisement with a bad checksum (invalid)", flipped(na(INTRUDER, VIP6, Some(INTRUDER), None, o), 14 + 40 + 2), false),
        ("advertisement from our MAC whose third option names another", third_tlla, true),
    ];
    let mut w = world();
    for (name, frame, conflict) in table {
        let before = w.dp.counters().unwrap().reasons["ndp_conflict"];
        let (verdict, out, _) = w.dp.test_run(&frame, 1, None).unwrap();
        assert_eq!(verdict, XDP_PASS, "{name}: verdict");
        assert_eq!(out, frame, "{name}: frame changed");
        let after = w.dp.counters().unwrap().reasons["ndp_conflict"];
        assert_eq!(after.0, before.0 + u64::from(conflict), "{name}: ndp_conflict counter");
    }
    let held = w.dp.held_ref();
    assert_eq!(held.conflicts(IFINDEX).unwrap().get(&VIP6.into()), Some(&3), "per VIP, untagged");
    assert_eq!(held.conflicts(VLAN_IFINDEX).unwrap().get(&VIP6_VLAN.into()), Some(&1), "per VIP, VLAN 42");
}

/// What the counters count as bytes: the layer-2 header plus the layer-3 length the
/// headers give (IPv4 total length, 28 for ARP), so Ethernet padding is not counted
/// (the program reads no frame length on these paths); other frames, and malformed
/// ones, count whole.
#[test]
fn counters_count_layer2_and_layer3_lengths() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let pad = |f: &[u8], to: usize| -> Vec<u8> { f.iter().copied().chain(std::iter::repeat(0)).take(to.max(f.len())).collect() };
    let tcp = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 41000), (VIP, 80));
    let tcp_vlan_opts = frames::with_ip_options(&frames::tcp(VLAN_MAC, CLIENT_MAC, Some(VLAN), (CLIENT, 41001), (VIP_VLAN, 80)), 3);
    let arp = frames::arp_request(CLIENT_MAC, CLIENT, VIP_VLAN, Some(VLAN));
    let arp_4000 = frames::arp_request(CLIENT_MAC, CLIENT, VIP, Some(4000));
    let udp6 = frames::ipv6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, VIP6), 64, 17, &frames::udp_header(5353, 53, b"q"));
    let table: [(&str, Vec<u8>, &str, u64); 8] = [
        ("padded tcp, first packet", pad(&tcp, 80), "forwarded", tcp.len() as u64),
        ("padded tcp, cached", pad(&tcp, 80), "forwarded", tcp.len() as u64),
        ("tcp in VLAN 42 with options, padded", pad(&tcp_vlan_opts, 100), "forwarded", tcp_vlan_opts.len() as u64),
        ("arp request in VLAN 42, padded", pad(&arp, 64), "arp_answered", arp.len() as u64),
        ("ipv6 frame to an IPv6 VIP, padded", pad(&udp6, 100), "forwarded", udp6.len() as u64),
        ("truncated IPv6 header", udp6[..40].to_vec(), "drop_malformed", 40),
        ("arp request in VLAN 4000, padded", pad(&arp_4000, 64), "passed_vlan_other", 64),
        ("truncated IPv4 header", tcp[..20].to_vec(), "drop_malformed", 20),
    ];
    for (name, frame, reason, bytes) in table {
        let before = w.dp.counters().unwrap().reasons[reason];
        w.dp.test_run(&frame, 1, None).unwrap();
        let after = w.dp.counters().unwrap().reasons[reason];
        assert_eq!((after.0 - before.0, after.1 - before.1), (1, bytes), "{name}: {reason} (packets, bytes)");
    }
}

#[test]
fn ten_thousand_flows_are_stable_and_spread() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let s = svc(VIP, 80, PROTO_TCP);
    let mut per_backend = std::collections::BTreeMap::<Mac, u32>::new();
    for i in 0..10_000u32 {
        let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + i / 50);
        let sport = 20000 + (i % 50) as u16 * 7;
        let f = frames::tcp(OUR_MAC, CLIENT_MAC, None, (src, sport), (VIP, 80));
        let want = ring_choice(&w.dp, s, src, sport, 80);
        for _ in 0..2 {
            let (v, out, _) = w.dp.test_run(&f, 1, None).unwrap();
            assert_eq!(v, XDP_TX);
            assert_eq!(out[0..6], want, "flow {src}:{sport} moved");
        }
        *per_backend.entry(want).or_default() += 1;
    }
    assert_eq!(per_backend.len(), 3);
    for (mac, n) in &per_backend {
        assert!((2900..=3800).contains(n), "backend {mac:?} got {n} of 10000 flows");
    }
}

#[test]
fn flow_table_keeps_flows_across_ring_changes() {
    if !privileged() {
        return;
    }
    let syn = |sport| frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
    let ack = |sport| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
    flows_kept_across_ring_changes(None, svc(VIP, 80, PROTO_TCP), CLIENT.into(), syn, ack);
}

/// The same for IPv6 flows (`lb_flows`, shared, `lb6_first_packets`, `lb6_flow_cache`).
#[test]
fn ipv6_flow_table_keeps_flows_across_ring_changes() {
    if !privileged() {
        return;
    }
    let syn = |sport| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (VIP6, 80), frames::TCP_SYN);
    let ack = |sport| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (VIP6, 80), frames::TCP_ACK);
    flows_kept_across_ring_changes(None, svc(VIP6, 80, PROTO_TCP), CLIENT6.into(), syn, ack);
}

/// A backend out of the ring but drained (its health check failed, its node
/// still runs) keeps its established flows, cached or not, although no ring
/// references it any more; new flows avoid it. When its drain ends with it still
/// out, its flows are evicted and re-hash; the others never move.
#[test]
fn a_drained_backend_keeps_its_flows_until_the_drain_ends() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let s = svc(VIP, 80, PROTO_TCP);
    // Backend 7 is this service's alone: draining must keep its slot too.
    let spec = |backends: Vec<BackendSpec>, draining: Vec<BackendSpec>| ServiceSpec { backends, table_size: TABLE, absent: vec!["node-7".into()], draining };
    w.dp.set_service(s, &[backend(1), backend(2), backend(7)], TABLE, 0).unwrap();
    let ack = |sport| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
    let mut flows = Vec::new();
    for sport in 30000..30300u16 {
        w.dp.test_run(&frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80)), 1, None).unwrap();
        let (_, out, _) = w.dp.test_run(&ack(sport), 1, None).unwrap();
        flows.push((sport, <Mac>::try_from(&out[0..6]).unwrap()));
    }
    let seven = backend(7).mac;
    let to7 = flows.iter().filter(|f| f.1 == seven).count();
    assert!(to7 > 50, "flows on backend 7: {to7} of {}", flows.len());
    let forwarded = |w: &mut World| -> Vec<Mac> {
        flows.iter().map(|(sport, _)| <Mac>::try_from(&w.dp.test_run(&ack(*sport), 1, None).unwrap().1[0..6]).unwrap()).collect()
    };

    let draining = spec(vec![backend(1), backend(2)], vec![backend(7)]);
    let pinned = w.dp.flow_count();
    let done = w.dp.apply(&BTreeMap::from([(s, &draining)]), &[], 0).unwrap();
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    w.dp.sweep(&done.sweep).unwrap();
    assert_eq!(w.dp.flow_count(), pinned, "a drained backend's flows were evicted");
    assert!(w.dp.backends().unwrap().values().any(|b| b.mac == seven), "the drained backend's slot was freed");
    for _ in 0..2 {
        assert_eq!(forwarded(&mut w), flows.iter().map(|f| f.1).collect::<Vec<_>>(), "an established flow moved while its backend drained");
    }
    for sport in 40000..40100u16 {
        let (_, out, _) = w.dp.test_run(&frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80)), 1, None).unwrap();
        assert_ne!(out[0..6], seven, "new flow {sport} went to the drained backend");
    }

    // The drain ends, backend 7 still out: its flows (and only they) re-hash.
    let out = spec(vec![backend(1), backend(2)], Vec::new());
    let done = w.dp.apply(&BTreeMap::from([(s, &out)]), &[], 0).unwrap();
    let pinned = w.dp.flow_count();
    w.dp.sweep(&done.sweep).unwrap();
    assert_eq!(pinned - w.dp.flow_count(), to7, "the drained backend's flows evicted at the drain's end");
    assert!(!w.dp.backends().unwrap().values().any(|b| b.mac == seven), "the backend's slot outlived its drain");
    for ((sport, before), now) in flows.iter().zip(forwarded(&mut w)) {
        if *before == seven {
            assert_ne!(now, seven, "flow {sport} still went to the backend that left");
        } else {
            assert_eq!(now, *before, "flow {sport} on a surviving backend moved");
        }
    }
}

/// Established flows (SYN, then the ACK that pins them; then answered from the
/// flow cache) keep their backend when a backend joins the ring; removing
/// backends evicts their flows alone, which re-hash.
/// `held_filter`: every word of `lb_held_filter` set to it first.
fn flows_kept_across_ring_changes(held_filter: Option<u32>, s: ServiceAddr, client: IpAddr, syn: impl Fn(u16) -> Vec<u8>, ack: impl Fn(u16) -> Vec<u8>) {
    let mut w = world();
    if let Some(word) = held_filter {
        fill_held_filter(&w, word);
    }
    let three = [backend(1), backend(2), backend(3)];
    // Find a flow that a fourth backend would take over.
    let four = [backend(1), backend(2), backend(3), backend(4)];
    let mut flows = Vec::new();
    for sport in 30000..31000u16 {
        w.dp.test_run(&syn(sport), 1, None).unwrap();
        let f = ack(sport);
        let (_, out, _) = w.dp.test_run(&f, 1, None).unwrap();
        flows.push((sport, f, <Mac>::try_from(&out[0..6]).unwrap()));
    }
    assert!(w.dp.flow_count() >= 1000, "second packets pinned their flows: {}", w.dp.flow_count());
    w.dp.set_service(s, &four, TABLE, 0).unwrap();
    let moved: Vec<_> = flows.iter().filter(|(sport, _, before)| ring_choice(&w.dp, s, client, *sport, 80) != *before).collect();
    assert!(!moved.is_empty(), "adding a backend moved no ring slot for 1000 flows");
    for _ in 0..2 {
        for (sport, f, before) in &moved {
            let (_, out, _) = w.dp.test_run(f, 1, None).unwrap();
            assert_eq!(&out[0..6], before, "established flow {sport} followed the new ring");
        }
    }
    // New flows do use the new backend.
    let (_, out, _) = w.dp.test_run(&syn(9), 1, None).unwrap();
    assert_eq!(out[0..6], ring_choice(&w.dp, s, client, 9, 80));

    // Removing backends 3 and 4 evicts their flows: they re-hash, and only they move.
    let pinned = w.dp.flow_count();
    w.dp.set_service(s, &three[..2], TABLE, 0).unwrap();
    let gone = backend(3).mac;
    assert_eq!(w.dp.flow_count(), pinned - flows.iter().filter(|f| f.2 == gone).count(), "the removed backend's flows swept");
    for (sport, f, before) in &flows {
        let (_, out, _) = w.dp.test_run(f, 1, None).unwrap();
        if *before == gone {
            assert_eq!(out[0..6], ring_choice(&w.dp, s, client, *sport, 80), "flow {sport} of the removed backend");
            assert_ne!(out[0..6], gone);
        } else {
            assert_eq!(&out[0..6], before, "flow {sport} on a surviving backend moved");
        }
    }
}

/// Checks one run of a possibly malformed frame: a passed frame is unchanged; a
/// transmitted one is exactly an ARP reply we owe or a forward of a frame to a
/// held VIP service, with only the MACs rewritten.
/// A released (or fenced) VIP: no ARP answer and no new flow, but the flows this
/// node already pinned keep being forwarded (a client still sending to our MAC
/// until the new owner's gratuitous ARP arrives keeps its connection); forgetting
/// the VIP ends that too.
/// With a home interface set (where backends' MACs are valid), frames to VIPs of
/// other networks reach backends out of it, untagged: a VLAN's frame leaves
/// without its tag (XDP_TX when home is the VLAN's parent), a frame of another
/// interface is redirected to home. Frames of home's own network are forwarded
/// as before. Those forwards are never memoised in the flow cache.
#[test]
fn frames_to_vips_of_other_networks_go_to_backends_out_of_home_untagged() {
    if !privileged() {
        return;
    }
    const XDP_REDIRECT: u32 = 4;
    stay_on_cpu0();
    let mut w = world();
    let untag = |f: &[u8]| -> Vec<u8> { f[..12].iter().chain(&f[16..]).copied().collect() };
    // Home is the VLAN's parent (the interface test runs receive on).
    w.dp.set_home(Some((IFINDEX, OUR_MAC))).unwrap();
    let vlan_tcp = frames::tcp(VLAN_MAC, CLIENT_MAC, Some(VLAN), (CLIENT, 42000), (VIP_VLAN, 80));
    let to = ring_choice(&w.dp, svc(VIP_VLAN, 80, PROTO_TCP), CLIENT, 42000, 80);
    for round in 0..3 {
        let before = w.dp.counters().unwrap().reasons["forwarded_home"];
        let (verdict, out, _) = w.dp.test_run(&vlan_tcp, 1, None).unwrap();
        assert_eq!((verdict, out), (XDP_TX, forwarded(&untag(&vlan_tcp), to)), "round {round}: VLAN frame forwarded untagged from home's MAC");
        let after = w.dp.counters().unwrap().reasons["forwarded_home"];
        assert_eq!((after.0 - before.0, after.1 - before.1), (1, vlan_tcp.len() as u64), "round {round}: counted once, tagged length");
    }
    // This node as the backend of a VLAN's VIP: its stack gets the frame untagged
    // (it need not have the VLAN).
    w.dp.set_service(svc(VIP_VLAN, 81, PROTO_TCP), &[BackendSpec { local: true, ..backend(9) }], TABLE, 0).unwrap();
    let local_tcp = frames::tcp(VLAN_MAC, CLIENT_MAC, Some(VLAN), (CLIENT, 42002), (VIP_VLAN, 81));
    let (verdict, out, _) = w.dp.test_run(&local_tcp, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_PASS, untag(&local_tcp)), "a VLAN's frame passed to this node's stack untagged");
    // Home's own network: forwarded as before, tag-free, on the same interface.
    let tcp = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 42001), (VIP, 80));
    let (verdict, out, _) = w.dp.test_run(&tcp, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_TX, forwarded(&tcp, ring_choice(&w.dp, svc(VIP, 80, PROTO_TCP), CLIENT, 42001, 80))));

    // Home is another interface: frames of this one are redirected there.
    const HOME_MAC: Mac = [0x02, 0, 0, 0, 0x77, 0x01];
    w.dp.set_home(Some((77, HOME_MAC))).unwrap();
    let to = ring_choice(&w.dp, svc(VIP, 80, PROTO_TCP), CLIENT, 42001, 80);
    for round in 0..3 {
        let (verdict, out, _) = w.dp.test_run(&tcp, 1, None).unwrap();
        assert_eq!((verdict, out), (XDP_REDIRECT, forwarded_from(&tcp, to, HOME_MAC)), "round {round}: redirected to home, from home's MAC");
    }
    assert_eq!(cached_to(&w, CLIENT, 42001, VIP, 80), None, "a forward out of home is not memoised");
    // An ICMP error about that flow leaves the same way, counted as such.
    let err = frag_needed(VIP, None, &reply4(VIP, 80, CLIENT, 42001));
    let icmp_errors = |w: &World| w.dp.counters().unwrap().reasons["forwarded_icmp_error"].0;
    let before = icmp_errors(&w);
    let (verdict, out, _) = w.dp.test_run(&err, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_REDIRECT, forwarded_from(&err, to, HOME_MAC)), "an ICMP error about a flow redirected to home");
    assert_eq!(icmp_errors(&w) - before, 1, "forwarded_icmp_error");
    let (verdict, out, _) = w.dp.test_run(&vlan_tcp, 1, None).unwrap();
    let to = ring_choice(&w.dp, svc(VIP_VLAN, 80, PROTO_TCP), CLIENT, 42000, 80);
    assert_eq!((verdict, out), (XDP_REDIRECT, forwarded_from(&untag(&vlan_tcp), to, HOME_MAC)), "VLAN frame redirected untagged");
    // ARP is answered on the VIP's own network whatever home is.
    let req = frames::arp_request(CLIENT_MAC, CLIENT, VIP_VLAN, Some(VLAN));
    let (verdict, out, _) = w.dp.test_run(&req, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_TX, frames::arp_reply_for(&req, VLAN_MAC)));
    // Unset: back to forwarding on the frame's own network.
    w.dp.set_home(None).unwrap();
    let (verdict, out, _) = w.dp.test_run(&tcp, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_TX, forwarded(&tcp, ring_choice(&w.dp, svc(VIP, 80, PROTO_TCP), CLIENT, 42001, 80))));
}

#[test]
fn a_released_vip_keeps_its_pins_and_sends_new_client_flows_by_the_ring() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let s = svc(VIP, 80, PROTO_TCP);
    let old = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 41000), (VIP, 80));
    let new = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 41001), (VIP, 80));
    let new_ack = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 41002), (VIP, 80));
    let arp = frames::arp_request(CLIENT_MAC, CLIENT, VIP, None);
    let to = ring_choice(&w.dp, s, CLIENT, 41000, 80);
    assert_eq!(w.dp.test_run(&frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 41000), (VIP, 80)), 1, None).unwrap().0, XDP_TX);
    assert_eq!(w.dp.test_run(&old, 1, None).unwrap().0, XDP_TX, "pins the flow while held");

    w.dp.release_vip(IFINDEX, VIP).unwrap();
    let (verdict, out, _) = w.dp.test_run(&old, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_TX, forwarded(&old, to)), "pinned flow still forwarded after release");
    // A client not yet following the new owner: its new flows go where the
    // ring sends them, as at the new owner; a node's frame is not forwarded again.
    let (verdict, out, _) = w.dp.test_run(&new, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_TX, forwarded(&new, ring_choice(&w.dp, s, CLIENT, 41001, 80))), "a new flow on a released VIP");
    let (verdict, out, _) = w.dp.test_run(&new_ack, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_TX, forwarded(&new_ack, ring_choice(&w.dp, s, CLIENT, 41002, 80))), "a flow picked up mid-connection on a released VIP");
    let from_node = frames::tcp(OUR_MAC, backend(3).mac, None, (CLIENT, 41003), (VIP, 80));
    let (verdict, out, _) = w.dp.test_run(&from_node, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_PASS, from_node.clone()), "a node's new flow on a released VIP");
    let (verdict, out, _) = w.dp.test_run(&arp, 1, None).unwrap();
    assert_eq!((verdict, out), (XDP_PASS, arp.clone()), "a released VIP is not answered");
    let held = w.dp.held_vips().unwrap();
    assert!(held.iter().any(|&(_, v, d)| v == VIP && d == 0), "kept as a stale entry: {held:?}");

    w.dp.forget_vip(IFINDEX, VIP).unwrap();
    assert_eq!(w.dp.test_run(&old, 1, None).unwrap().0, XDP_PASS, "forgotten: not ours at all");
    assert!(!w.dp.held_vips().unwrap().iter().any(|&(_, v, _)| v == VIP));
}

fn check_safe(input: &[u8], verdict: u32, out: &[u8], backend_macs: &[Mac]) -> Result<(), String> {
    match verdict {
        XDP_PASS => (out == input).then_some(()).ok_or("passed frame was modified".into()),
        XDP_DROP => Ok(()),
        XDP_TX => {
            let tagged = input.len() >= 16 && input[12..14] == [0x81, 0x00];
            let off = if tagged { 18 } else { 14 };
            // The network the frame came from decides which VIPs it may reach and
            // which of our MACs answers: untagged (or priority-tagged), or VLAN 42.
            let (ours, arp_vips, ip_vips): (Mac, &[Ipv4Addr], &[Ipv4Addr]) = match tagged.then(|| u16::from_be_bytes([input[14], input[15]]) & 0xfff) {
                // A stale VIP's unicast frames from a client too (not a node's).
                None | Some(0) if stale_balanced(input, backend_macs) => (OUR_MAC, &[VIP, VIP_LOCAL, VIP_EMPTY], &[VIP, VIP_LO, VIP_STALE]),
                None | Some(0) => (OUR_MAC, &[VIP, VIP_LOCAL, VIP_EMPTY], &[VIP, VIP_LO]),
                Some(VLAN) => (VLAN_MAC, &[VIP_VLAN], &[VIP_VLAN]),
                Some(v) => return Err(format!("TX of a frame of VLAN {v}, where no pool lives")),
            };
            let ethertype = input.get(off - 2..off).ok_or("TX of a frame without ethertype")?;
            if ethertype == [0x08, 0x06] {
                let a = input.get(off..off + 28).ok_or("TX of a truncated ARP frame")?;
                let held = arp_vips.iter().map(|v| v.octets()).collect::<Vec<_>>();
                if a[0..8] != [0, 1, 8, 0, 6, 4, 0, 1] || !held.contains(&a[24..28].try_into().unwrap()) || a[14..18] == a[24..28] {
                    return Err("TX of an ARP frame that is not a request for a VIP held on its network".into());
                }
                (out == frames::arp_reply_for(input, ours)).then_some(()).ok_or("ARP reply is not the one owed".into())
            } else if ethertype == [0x08, 0x00] {
                let ip = input.get(off..off + 20).ok_or("TX of a truncated IPv4 frame")?;
                let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
                if ip[0] >> 4 != 4 || !ip_vips.contains(&dst) || !(ip[9] == 6 || ip[9] == 17 || icmp_error_about_flow(&input[off..])) {
                    return Err(format!("TX of IPv4 that is not TCP/UDP (or an ICMP error about it) to a VIP balanced on its network: {dst} proto {}", ip[9]));
                }
                let to: Mac = out[0..6].try_into().unwrap();
                let ok = out.len() == input.len() && out[12..] == input[12..] && out[6..12] == ours && backend_macs.contains(&to);
                ok.then_some(()).ok_or("forwarded frame altered beyond its MACs".into())
            } else if ethertype == [0x86, 0xdd] && (upper6(&input[off..]).is_some() || icmp6_error_about_flow(&input[off..])) {
                let ip = &input[off..];
                let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap());
                let vips: &[Ipv6Addr] = match (ours == VLAN_MAC, stale_balanced(input, backend_macs)) {
                    (true, _) => &[VIP6_VLAN],
                    (false, true) => &[VIP6, VIP6_STALE],
                    (false, false) => &[VIP6],
                };
                if !vips.contains(&dst) {
                    return Err(format!("TX of IPv6 TCP/UDP to {dst}, not a VIP balanced on its network"));
                }
                let to: Mac = out[0..6].try_into().unwrap();
                let ok = out.len() == input.len() && out[12..] == input[12..] && out[6..12] == ours && backend_macs.contains(&to);
                ok.then_some(()).ok_or("forwarded IPv6 frame altered beyond its MACs".into())
            } else if ethertype == [0x86, 0xdd] {
                let ndp_vips: &[Ipv6Addr] = if ours == VLAN_MAC { &[VIP6_VLAN] } else { &[VIP6] };
                let target = owed_solicitation(&input[off..]).ok_or("TX of IPv6 that is not a valid neighbour solicitation")?;
                if !ndp_vips.contains(&target) {
                    return Err(format!("TX of an answer for {target}, not held on its network"));
                }
                (out == frames::neighbor_advertisement_for(input, ours)).then_some(()).ok_or("advertisement is not the one owed".into())
            } else {
                Err("TX of a frame that is neither ARP, IPv4 nor IPv6".into())
            }
        }
        v => Err(format!("unexpected verdict {v}")),
    }
}

/// Whether a stale entry may balance the frame: unicast, from a client (not a
/// node's MAC).
fn stale_balanced(input: &[u8], backend_macs: &[Mac]) -> bool {
    input[0] & 1 == 0 && !backend_macs.iter().any(|m| input[6..12] == m[..])
}

/// Whether `ip` (an IPv4 packet) is a destination unreachable about a TCP or UDP
/// packet from its destination, all at fixed places: no IP options outer or
/// inner, not a fragment, the quoted packet no later fragment and its ports there.
/// The test's own reading of which ICMP may be forwarded.
fn icmp_error_about_flow(ip: &[u8]) -> bool {
    let Some(inner) = ip.get(28..52) else { return false };
    let frag = |h: &[u8], mask: u16| u16::from_be_bytes([h[6], h[7]]) & mask != 0;
    ip[0] == 0x45
        && ip[9] == 1
        && !frag(ip, 0x3fff)
        && ip[20] == 3
        && inner[0] == 0x45
        && !frag(inner, 0x1fff)
        && matches!(inner[9], 6 | 17)
        && inner[12..16] == ip[16..20]
}

/// Whether `ip` (an IPv6 packet) is an ICMPv6 destination unreachable or packet
/// too big right behind its header, about a TCP or UDP packet from its
/// destination without extension headers, its ports there.
fn icmp6_error_about_flow(ip: &[u8]) -> bool {
    let Some(inner) = ip.get(48..92) else { return false };
    ip[0] >> 4 == 6 && ip[6] == 58 && matches!(ip[40], 1 | 2) && inner[0] >> 4 == 6 && matches!(inner[6], 6 | 17) && inner[8..24] == ip[24..40]
}

/// The upper-layer protocol of `ip` (an IPv6 packet) if it is TCP or UDP behind
/// at most six hop-by-hop, routing, destination options and fragment headers,
/// all within the packet: the test's own reading of what may be balanced.
fn upper6(ip: &[u8]) -> Option<u8> {
    if *ip.first()? >> 4 != 6 {
        return None;
    }
    let (mut next, mut off, mut fragment) = (*ip.get(6)?, 40usize, false);
    for _ in 0..=6 {
        match next {
            // A fragment is balanced on its addresses: its ports need not be there.
            6 | 17 => return (fragment || ip.len() >= off + 4).then_some(next),
            0 | 43 | 60 => {
                let h = ip.get(off..off + 8)?;
                (next, off) = (h[0], off + (usize::from(h[1]) + 1) * 8);
            }
            44 => {
                next = *ip.get(off)?;
                off += 8;
                ip.get(off - 1)?;
                fragment = true;
            }
            _ => return None,
        }
    }
    None
}

/// The target of `ip` (an IPv6 packet) if it is a Neighbor Solicitation that
/// RFC 4861 7.1.1 (and vip: to the target or its solicited-node group) accepts:
/// the test's own reading, against which the program's answers are checked.
fn owed_solicitation(ip: &[u8]) -> Option<Ipv6Addr> {
    let addr = |b: &[u8]| Ipv6Addr::from(<[u8; 16]>::try_from(b).unwrap());
    let len = usize::from(u16::from_be_bytes([*ip.get(4)?, *ip.get(5)?]));
    let msg = ip.get(40..40 + len)?;
    if ip[0] >> 4 != 6 || ip[6] != 58 || ip[7] != 255 || len < 24 || msg[0] != 135 || msg[1] != 0 {
        return None;
    }
    let (src, dst, target) = (addr(&ip[8..24]), addr(&ip[24..40]), addr(&msg[8..24]));
    let (mut rest, mut slla, mut n) = (&msg[24..], false, 0);
    while !rest.is_empty() {
        let olen = usize::from(*rest.get(1)?) * 8;
        n += 1;
        if olen == 0 || olen > rest.len() || n > 8 {
            return None;
        }
        slla |= rest[0] == 1;
        rest = &rest[olen..];
    }
    let to_group = dst == frames::solicited_node(target);
    let ok = !target.is_multicast() && if src.is_unspecified() { !slla && to_group } else { to_group || dst == target };
    ok.then_some(target)
}

#[test]
fn truncations_and_mutations_never_mis_forward() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let macs: Vec<Mac> = w.dp.backends().unwrap().values().map(|b| b.mac).collect();
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let (mut runs, mut refused) = (0u32, 0u32);
    for c in cases(&w.dp) {
        // Every truncation. The kernel refuses frames shorter than an Ethernet header.
        for len in 0..=c.input.len() {
            let input = &c.input[..len];
            match w.dp.test_run(input, 1, None) {
                Ok((v, out, _)) => {
                    runs += 1;
                    check_safe(input, v, &out, &macs).unwrap_or_else(|e| panic!("{}: truncated to {len}: {e}", c.name));
                }
                Err(e) => {
                    assert!(len < 14, "{}: truncated to {len} refused: {e:#}", c.name);
                    refused += 1;
                }
            }
        }
        // Random mutations: 1 to 4 bytes flipped, sometimes a length change.
        for _ in 0..2000 {
            let mut m = c.input.clone();
            for _ in 0..rng.random_range(1..=4) {
                let i = rng.random_range(0..m.len());
                m[i] = rng.random();
            }
            if rng.random_ratio(1, 5) {
                m.truncate(rng.random_range(14..=m.len()));
            }
            let (v, out, _) = w.dp.test_run(&m, 1, None).unwrap_or_else(|e| panic!("{}: mutation refused: {e:#}", c.name));
            runs += 1;
            check_safe(&m, v, &out, &macs).unwrap_or_else(|e| panic!("{}: mutation {m:02x?}: {e}", c.name));
        }
    }
    assert!(runs > 5000, "only {runs} runs");
    assert!(refused > 0);
    assert!(w.dp.counters().unwrap().reasons["drop_malformed"].0 > 0, "no truncation counted as malformed");
}

#[test]
fn hold_vip_needs_the_interface_mac_and_follows_its_changes() {
    if !privileged() {
        return;
    }
    let pins = PinDir::new().unwrap();
    let mut dp = Dataplane::load(&pins.path, 1 << 16).unwrap();
    let hour = monotonic_ns() + 3_600_000_000_000;
    let err = dp.hold_vip(IFINDEX, VIP, hour).unwrap_err();
    assert!(format!("{err:#}").contains("set_iface"), "unclear error: {err:#}");
    assert!(dp.held_vips().unwrap().is_empty());
    dp.set_iface(IFINDEX, [0x02, 0, 0, 0, 0, 0x77]).unwrap();
    dp.hold_vip(IFINDEX, VIP, hour).unwrap();
    // A new MAC for the interface reaches the VIPs already held on it.
    dp.set_iface(IFINDEX, OUR_MAC).unwrap();
    let req = frames::arp_request(CLIENT_MAC, CLIENT, VIP, None);
    let (v, out, _) = dp.test_run(&req, 1, None).unwrap();
    assert_eq!(v, XDP_TX);
    assert_eq!(out, frames::arp_reply_for(&req, OUR_MAC));
}

/// ARP conflict detection: a reply or gratuitous ARP in which another MAC claims a
/// VIP we hold fresh on this interface is counted (`arp_conflict`) and passed
/// unchanged; our own announcements and claims on VIPs we do not hold are not.
#[test]
fn arp_conflicts_are_counted() {
    if !privileged() {
        return;
    }
    const INTRUDER: Mac = [0x02, 0, 0, 0, 0, 0xbb];
    let garp = |sha, vip, op, vlan| frames::arp(frames::BROADCAST, vlan, op, sha, vip, [0; 6], vip);
    let reply_from = |sha, vip| frames::arp(CLIENT_MAC, None, 2, sha, vip, CLIENT_MAC, CLIENT);
    let table: Vec<(&str, Vec<u8>, bool)> = vec![
        ("foreign gratuitous request for a held VIP", garp(INTRUDER, VIP, 1, None), true),
        ("foreign gratuitous reply for a held VIP", garp(INTRUDER, VIP, 2, None), true),
        ("foreign gratuitous ARP for a held VIP in its VLAN 42", garp(INTRUDER, VIP_VLAN, 1, Some(VLAN)), true),
        ("foreign gratuitous ARP in VLAN 42 for a VIP of the untagged network", garp(INTRUDER, VIP, 1, Some(VLAN)), false),
        ("foreign reply claiming a held VIP", reply_from(INTRUDER, VIP), true),
        ("our own gratuitous ARP", garp(OUR_MAC, VIP, 1, None), false),
        ("our own gratuitous reply in VLAN 42", garp(VLAN_MAC, VIP_VLAN, 2, Some(VLAN)), false),
        ("our own reply from the VIP", reply_from(OUR_MAC, VIP), false),
        ("foreign gratuitous ARP for a VIP not held here", garp(INTRUDER, VIP_NOT_HELD, 1, None), false),
        ("foreign reply for a VIP not held here", reply_from(INTRUDER, VIP_NOT_HELD), false),
        ("foreign gratuitous ARP for a stale VIP", garp(INTRUDER, VIP_STALE, 1, None), false),
        ("foreign gratuitous ARP for a non-VIP address", garp(INTRUDER, OTHER, 1, None), false),
    ];
    let mut w = world();
    for (name, frame, conflict) in table {
        let before = w.dp.counters().unwrap().reasons["arp_conflict"];
        let (verdict, out, _) = w.dp.test_run(&frame, 1, None).unwrap();
        assert_eq!(verdict, XDP_PASS, "{name}: verdict");
        assert_eq!(out, frame, "{name}: frame changed");
        let after = w.dp.counters().unwrap().reasons["arp_conflict"];
        let want = if conflict { (before.0 + 1, before.1 + frame.len() as u64) } else { before };
        assert_eq!(after, want, "{name}: arp_conflict counter (packets, bytes)");
    }
}

// ---- The per-CPU flow cache (lb4_flow_cache) in front of the flow table ----

/// BPF_PROG_TEST_RUN runs the program on the calling thread's CPU: the cache tests
/// keep to CPU 0 so that they know which CPU's cache their runs use.
fn stay_on_cpu0() {
    // SAFETY: a zeroed cpu_set_t with one bit set, for the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        assert_eq!(libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set), 0);
    }
}

/// Whether CPU 0's flow-cache slot for this TCP flow holds a current answer, and
/// the backend MAC it would write. Read from the pinned map, so that the tests
/// below know they exercised a cache hit rather than the flow table.
fn cached_to(w: &World, src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Option<Mac> {
    use aya::maps::{Map, MapData, PerCpuArray};
    let data = MapData::from_pin(w.pins.path.join(map_names::FLOW_CACHE)).unwrap();
    let cache: PerCpuArray<_, Lb4FlowCacheEntry> = PerCpuArray::try_from(Map::from_map_data(data).unwrap()).unwrap();
    let key = Lb4FlowKey { src: src.octets(), dst: dst.octets(), sport: sport.to_be_bytes(), dport: dport.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
    let words: [u64; 2] = unsafe { std::mem::transmute(key) };
    let cpus = aya::util::nr_cpus().unwrap() as u32;
    let slot = flow_cache_slot(words[0], words[1]) & (flow_cache_slots_for(cpus) - 1);
    let epoch = w.dp.flow_cache_epoch().unwrap();
    let per_cpu = cache.get(&slot, 0).unwrap();
    let e = &per_cpu[0];
    (e.key == key && e.answer.epoch == epoch && e.answer.ifindex == IFINDEX).then(|| e.answer.eth[..6].try_into().unwrap())
}

/// Runs `frame` (flow table or cache; a flow's first packet is not cached, its
/// second is, when it is pinned in `lb_flows`), checks that the answer is now cached,
/// and returns the verdict and frame of one more run: a cache hit.
fn run_cached(w: &mut World, frame: &[u8], flow: (Ipv4Addr, u16, Ipv4Addr, u16)) -> (u32, Vec<u8>) {
    let (v1, out1, _) = w.dp.test_run(frame, 1, None).unwrap();
    if cached_to(w, flow.0, flow.1, flow.2, flow.3).is_none() {
        let (v2, out2, _) = w.dp.test_run(frame, 1, None).unwrap();
        assert_eq!((v1, &out1), (v2, &out2), "flow {flow:?}: its second packet answered unlike its first");
    }
    let to = cached_to(w, flow.0, flow.1, flow.2, flow.3).unwrap_or_else(|| panic!("flow {flow:?} not cached after its second packet"));
    let (v, out, _) = w.dp.test_run(frame, 1, None).unwrap();
    assert_eq!((v1, &out1), (v, &out), "flow {flow:?}: cache hit answered unlike the run that cached it");
    if v == XDP_TX {
        assert_eq!(out[0..6], to, "flow {flow:?}: forwarded elsewhere than cached");
    }
    (v, out)
}

/// A TCP flow's packets past its SYN (ACKs): recorded at the first one seen, pinned at the next.
fn tcp_flow(sport: u16) -> (Vec<u8>, (Ipv4Addr, u16, Ipv4Addr, u16)) {
    (frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80)), (CLIENT, sport, VIP, 80))
}

/// A frame of a cached flow addressed to another host's MAC (a switch flooding
/// it, as when that host's port went down or its entry aged out) is passed as
/// the same flow's frame would be on the slow path, and leaves the cached answer
/// for the frames to our MAC.
#[test]
fn a_cached_flows_frame_flooded_for_another_host_is_not_forwarded() {
    if !privileged() {
        return;
    }
    stay_on_cpu0();
    let mut w = world();
    let (f, flow) = tcp_flow(42500);
    let to = ring_choice(&w.dp, svc(VIP, 80, PROTO_TCP), CLIENT, 42500, 80);
    assert_eq!(run_cached(&mut w, &f, flow), (XDP_TX, forwarded(&f, to)));
    let flooded = frames::tcp_ack(OTHER_HOST_MAC, CLIENT_MAC, None, (CLIENT, 42500), (VIP, 80));
    let before = w.dp.counters().unwrap().reasons["passed_other_host"].0;
    let (v, out, _) = w.dp.test_run(&flooded, 1, None).unwrap();
    assert_eq!((v, out), (XDP_PASS, flooded.clone()), "a flooded frame of a cached flow");
    assert_eq!(w.dp.counters().unwrap().reasons["passed_other_host"].0, before + 1);
    assert_eq!(cached_to(&w, CLIENT, 42500, VIP, 80), Some(to), "the flooded frame dropped the flow's cached answer");
    let (v, out, _) = w.dp.test_run(&f, 1, None).unwrap();
    assert_eq!((v, out), (XDP_TX, forwarded(&f, to)), "the flow's next frame to our MAC");
}

/// A cached flow gives the flow table's answer with the same counters, and after
/// every change that could make the answer wrong it is not used again: backend
/// removed (its flows re-hash, never to it), service removed (nothing forwarded),
/// VIP forgotten, flows evicted, our MAC or a backend's MAC changed.
#[test]
fn flow_cache_answers_like_the_flow_table_and_is_invalidated_by_changes() {
    if !privileged() {
        return;
    }
    stay_on_cpu0();
    let mut w = world();
    let s = svc(VIP, 80, PROTO_TCP);
    let three = [backend(1), backend(2), backend(3)];

    // Hits: same frame, same counters as the slow path.
    let (f, flow) = tcp_flow(42000);
    let to = ring_choice(&w.dp, s, CLIENT, 42000, 80);
    let before = w.dp.counters().unwrap();
    let (v, out) = run_cached(&mut w, &f, flow);
    assert_eq!((v, out), (XDP_TX, forwarded(&f, to)));
    let after = w.dp.counters().unwrap();
    let runs = after.reasons["forwarded"].0 - before.reasons["forwarded"].0;
    assert!(runs >= 2);
    let svc_id = w.dp.services().unwrap().into_iter().find(|(a, _, _)| *a == s).unwrap().1.id;
    let backend_id = *w.dp.backends().unwrap().iter().find(|(_, b)| b.mac == to).unwrap().0;
    assert_eq!(after.services[&svc_id].0 - before.services[&svc_id].0, runs, "service counter on cache hits");
    assert_eq!(after.backends[&backend_id].0 - before.backends[&backend_id].0, runs, "backend counter on cache hits");
    assert_eq!(after.services[&svc_id].1 - before.services[&svc_id].1, runs * f.len() as u64, "service bytes on cache hits");

    // Backend removal: cache every flow of 300, remove backend 3; flows cached on
    // it re-hash to the new ring, all others stay.
    let flows: Vec<_> = (43000..43300u16)
        .map(|sport| {
            let (f, flow) = tcp_flow(sport);
            let (_, out) = run_cached(&mut w, &f, flow);
            (sport, f, <Mac>::try_from(&out[0..6]).unwrap())
        })
        .collect();
    let gone = backend(3).mac;
    assert!(flows.iter().any(|(_, _, m)| *m == gone));
    w.dp.set_service(s, &three[..2], TABLE, 0).unwrap();
    for (sport, f, before) in &flows {
        let (_, out) = run_cached(&mut w, f, (CLIENT, *sport, VIP, 80));
        if *before == gone {
            assert_eq!(out[0..6], ring_choice(&w.dp, s, CLIENT, *sport, 80), "flow {sport} cached on the removed backend");
        } else {
            assert_eq!(&out[0..6], before, "flow {sport} on a surviving backend moved");
        }
    }

    // A backend's MAC changes (same node, new NIC): cached answers follow.
    let (f, flow) = tcp_flow(44000);
    let (_, out) = run_cached(&mut w, &f, flow);
    let node = [backend(1), backend(2)].into_iter().find(|b| out[0..6] == b.mac).unwrap();
    let renamed: Vec<_> =
        [backend(1), backend(2)].into_iter().map(|b| if b.name == node.name { BackendSpec { mac: [0x02, 0, 0, 0, 0x20, 0x01], ..b } } else { b }).collect();
    w.dp.set_service(s, &renamed, TABLE, 0).unwrap();
    assert_eq!(w.dp.test_run(&f, 1, None).unwrap().1[0..6], [0x02, 0, 0, 0, 0x20, 0x01], "cached backend MAC after it changed");
    w.dp.set_service(s, &three, TABLE, 0).unwrap();

    // Our MAC changes: forwards carry the new source MAC at once.
    let (f, flow) = tcp_flow(44001);
    run_cached(&mut w, &f, flow);
    const NEW_MAC: Mac = [0x02, 0, 0, 0, 0, 0x02];
    w.dp.set_iface(IFINDEX, NEW_MAC).unwrap();
    // Clients address the new MAC (announced); a frame to the old one is another host's now.
    let to_new: Vec<u8> = NEW_MAC.iter().chain(&f[6..]).copied().collect();
    assert_eq!(w.dp.test_run(&to_new, 1, None).unwrap().1[6..12], NEW_MAC, "cached source MAC after the interface's changed");
    assert_eq!(w.dp.test_run(&f, 1, None).unwrap().0, XDP_PASS, "a frame to the interface's old MAC");
    w.dp.set_iface(IFINDEX, OUR_MAC).unwrap();

    // Evicted flows re-hash: a cached flow whose ring slot a fourth backend takes.
    let four = [backend(1), backend(2), backend(3), backend(4)];
    let cached: Vec<_> = (45000..45300u16)
        .map(|sport| {
            let (f, flow) = tcp_flow(sport);
            let (_, out) = run_cached(&mut w, &f, flow);
            (sport, f, <Mac>::try_from(&out[0..6]).unwrap())
        })
        .collect();
    w.dp.set_service(s, &four, TABLE, 0).unwrap();
    let (sport, f, pinned) = cached.iter().find(|(sport, _, m)| ring_choice(&w.dp, s, CLIENT, *sport, 80) != *m).expect("no flow moved by the fourth backend");
    let (_, out) = run_cached(&mut w, f, (CLIENT, *sport, VIP, 80));
    assert_eq!(&out[0..6], pinned, "a pinned flow follows the flow table after a ring change");
    let key = Lb4FlowKey { src: CLIENT.octets(), dst: VIP.octets(), sport: sport.to_be_bytes(), dport: 80u16.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
    assert!(w.dp.evict_flow(&key).unwrap(), "the flow was not pinned");
    assert!(!w.dp.evict_flow(&key).unwrap(), "the flow was still pinned after its eviction");
    let (_, out) = run_cached(&mut w, f, (CLIENT, *sport, VIP, 80));
    assert_eq!(out[0..6], ring_choice(&w.dp, s, CLIENT, *sport, 80), "evicted flow still answered from the cache");

    // Released VIP: its pinned flows are still forwarded, from the flow table (a
    // stale entry memoises nothing: every frame meets its checks); forgotten:
    // nothing is forwarded.
    let (f, flow) = tcp_flow(46001);
    let (_, pinned) = run_cached(&mut w, &f, flow);
    w.dp.release_vip(IFINDEX, VIP).unwrap();
    for _ in 0..2 {
        let (v, out, _) = w.dp.test_run(&f, 1, None).unwrap();
        assert_eq!((v, out), (XDP_TX, pinned.clone()), "released VIP: pinned flow");
    }
    assert!(cached_to(&w, flow.0, flow.1, flow.2, flow.3).is_none(), "a stale entry memoised a flow");
    let (new, _) = tcp_flow(46002);
    let (v, out, _) = w.dp.test_run(&new, 1, None).unwrap();
    assert_eq!((v, out), (XDP_TX, forwarded(&new, ring_choice(&w.dp, s, CLIENT, 46002, 80))), "released VIP: a client's new flow by the ring");
    w.dp.forget_vip(IFINDEX, VIP).unwrap();
    let (v, out, _) = w.dp.test_run(&f, 1, None).unwrap();
    assert_eq!((v, out), (XDP_PASS, f.clone()), "a forgotten VIP's cached flow was forwarded");
    w.dp.hold_vip(IFINDEX, VIP, monotonic_ns() + 3_600_000_000_000).unwrap();

    // Service removed: nothing of it is forwarded any more.
    let (f, flow) = tcp_flow(46000);
    run_cached(&mut w, &f, flow);
    w.dp.remove_service(s).unwrap();
    let (v, out, _) = w.dp.test_run(&f, 1, None).unwrap();
    assert_eq!((v, out), (XDP_PASS, f.clone()), "a removed service's cached flow was forwarded");
}

/// Flows sharing one cache slot each get their own answer (the whole key is
/// compared), and the local-backend answer (pass) is cached like a forward.
#[test]
fn flow_cache_slot_collisions_and_local_backends() {
    if !privileged() {
        return;
    }
    stay_on_cpu0();
    let mut w = world();
    let s = svc(VIP, 80, PROTO_TCP);
    let cpus = aya::util::nr_cpus().unwrap() as u32;
    let mask = flow_cache_slots_for(cpus) - 1;
    let slot_of = |sport: u16| {
        let key =
            Lb4FlowKey { src: CLIENT.octets(), dst: VIP.octets(), sport: sport.to_be_bytes(), dport: 80u16.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
        let words: [u64; 2] = unsafe { std::mem::transmute(key) };
        flow_cache_slot(words[0], words[1]) & mask
    };
    // Two flows in one slot with different backends.
    let mut first = std::collections::HashMap::<u32, (u16, Mac)>::new();
    let (a, b) = (20000..u16::MAX)
        .find_map(|p| {
            let to = ring_choice(&w.dp, s, CLIENT, p, 80);
            match first.get(&slot_of(p)) {
                Some(&(q, m)) if m != to => Some((q, p)),
                Some(_) => None,
                None => first.insert(slot_of(p), (p, to)).and(None),
            }
        })
        .expect("no two flows in one slot with different backends");
    let (fa, _) = tcp_flow(a);
    let (fb, _) = tcp_flow(b);
    for _ in 0..20 {
        for (f, sport) in [(&fa, a), (&fb, b)] {
            let (v, out, _) = w.dp.test_run(f, 1, None).unwrap();
            assert_eq!((v, out), (XDP_TX, forwarded(f, ring_choice(&w.dp, s, CLIENT, sport, 80))), "flow {sport} sharing a slot");
        }
    }
    // The local backend: passed unchanged, from the cache too, counted each time.
    let f = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 40000), (VIP_LOCAL, 80));
    let before = w.dp.counters().unwrap().reasons["passed_local_backend"].0;
    let (v, out) = run_cached(&mut w, &f, (CLIENT, 40000, VIP_LOCAL, 80));
    assert_eq!((v, out), (XDP_PASS, f.clone()));
    let runs = w.dp.counters().unwrap().reasons["passed_local_backend"].0 - before;
    assert!(runs >= 2, "local answers counted {runs} times");
}

/// Cache hits do not refresh a flow's stamp in the flow table (that would dirty a
/// cold line), so a cached answer is recomputed from the flow table every
/// FLOW_CACHE_RECHECK_HITS hits, which refreshes it: a busy flow is never the
/// oldest of its set when a new flow needs a way there. Here a cached flow's stamp
/// is set back an hour; it is current again within that many packets.
#[test]
fn flow_cache_rechecks_the_flow_table() {
    if !privileged() {
        return;
    }
    stay_on_cpu0();
    let mut w = world();
    let (f, flow) = tcp_flow(47000);
    run_cached(&mut w, &f, flow);
    let key = Lb4FlowKey { src: CLIENT.octets(), dst: VIP.octets(), sport: 47000u16.to_be_bytes(), dport: 80u16.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
    let now = w.dp.flow(&key).expect("the flow is pinned").stamp;
    let old = now.wrapping_sub(3600);
    assert!(w.dp.set_flow_stamp(&key, old));
    let mut runs = 0;
    while w.dp.flow(&key).expect("the flow stays pinned").stamp == old {
        runs += 1;
        assert!(runs <= u32::from(vip_common::FLOW_CACHE_RECHECK_HITS), "the flow table was not consulted in {runs} hits");
        assert_eq!(w.dp.test_run(&f, 1, None).unwrap().0, XDP_TX);
    }
    assert!(runs > 1, "the first run after the change was not a cache hit: the test proves nothing");
    assert!(w.dp.flow(&key).unwrap().stamp >= now, "the stamp went back");
}

/// Flows first seen with a SYN and flows first seen mid-connection (an ACK: the
/// client was talking to a previous owner) are recorded alike at their first
/// packet and pinned at their next: both stay on their backend when the ring
/// changes in between. (The flows are chosen with distinct `lb4_first_packets`
/// slots: a first-packet record lasts until another flow's first packet takes its
/// slot, see data-path.md.)
#[test]
fn flows_opened_with_and_without_syn_are_pinned() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let s = svc(VIP, 80, PROTO_TCP);
    let ack = |sport: u16| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
    let mut slots = std::collections::HashSet::new();
    let mut flows = Vec::new();
    for sport in (32000..33000u16).filter(|p| slots.insert(first_slot(CLIENT, *p, VIP, 80))) {
        let f = if sport % 2 == 0 { ack(sport) } else { frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80)) };
        let (v, out, _) = w.dp.test_run(&f, 1, None).unwrap();
        assert_eq!((v, &out), (XDP_TX, &forwarded(&f, ring_choice(&w.dp, s, CLIENT, sport, 80))), "new flow {sport}");
        flows.push((sport, <Mac>::try_from(&out[0..6]).unwrap()));
    }
    assert!(flows.len() > 900, "{} flows with distinct slots", flows.len());
    let four = [backend(1), backend(2), backend(3), backend(4)];
    w.dp.set_service(s, &four, TABLE, 0).unwrap();
    let moved: Vec<_> = flows.iter().filter(|(sport, m)| ring_choice(&w.dp, s, CLIENT, *sport, 80) != *m).collect();
    assert!(moved.iter().any(|(p, _)| p % 2 == 0) && moved.iter().any(|(p, _)| p % 2 == 1), "the ring change moved no flow of one kind");
    for (sport, pinned) in &moved {
        for _ in 0..2 {
            let (_, out, _) = w.dp.test_run(&ack(*sport), 1, None).unwrap();
            assert_eq!(&out[0..6], pinned, "flow {sport} (first packet {}) followed the new ring", if sport % 2 == 0 { "ACK" } else { "SYN" });
        }
    }
}

/// The `lb4_first_packets` slot of a TCP flow.
fn first_slot(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> u32 {
    let key = Lb4FlowKey { src: src.octets(), dst: dst.octets(), sport: sport.to_be_bytes(), dport: dport.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
    let w = key.words();
    vip_common::first_packet_slot(w[0], w[1])
}

/// A pin outlives its connection: a 5-tuple reused after a ring change must not
/// go to the old connection's backend. A SYN starts a new connection: it follows
/// the current ring, and its next packet pins that choice over the stale one (the
/// old answer cached on this CPU is dropped too). The old connection's packets
/// kept their backend until then.
#[test]
fn a_syn_repins_a_reused_five_tuple_to_the_current_ring() {
    if !privileged() {
        return;
    }
    stay_on_cpu0();
    let mut w = world();
    let s = svc(VIP, 80, PROTO_TCP);
    let four = [backend(1), backend(2), backend(3), backend(4)];
    // Flows the fourth backend would take over, established (and cached) on three.
    let cached: Vec<(u16, Mac)> = (48000..48300u16)
        .map(|sport| {
            w.dp.test_run(&frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80)), 1, None).unwrap();
            let (f, flow) = tcp_flow(sport);
            let (_, out) = run_cached(&mut w, &f, flow);
            (sport, <Mac>::try_from(&out[0..6]).unwrap())
        })
        .collect();
    w.dp.set_service(s, &four, TABLE, 0).unwrap();
    let moved: Vec<_> = cached.iter().filter(|(p, m)| ring_choice(&w.dp, s, CLIENT, *p, 80) != *m).collect();
    assert!(!moved.is_empty(), "the fourth backend took no flow of 300");
    for (sport, old) in moved {
        let (f, flow) = tcp_flow(*sport);
        assert_eq!(w.dp.test_run(&f, 1, None).unwrap().1[0..6], old[..], "old connection {sport} kept its backend");
        assert!(cached_to(&w, flow.0, flow.1, flow.2, flow.3).is_some(), "flow {sport} not cached: the test proves less");
        // The connection ends; the client reuses the 5-tuple.
        let now = ring_choice(&w.dp, s, CLIENT, *sport, 80);
        let syn = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, *sport), (VIP, 80));
        assert_eq!(w.dp.test_run(&syn, 1, None).unwrap().1[0..6], now, "SYN of reused {sport} went to the stale pin");
        for _ in 0..3 {
            assert_eq!(w.dp.test_run(&f, 1, None).unwrap().1[0..6], now, "reused {sport}: later packets went to the stale pin");
        }
    }
}

/// The per-CPU service caches (`lb4_service_cache`, `lb6_service_cache`) never
/// answer for a service as it was before a change. Each SYN is run twice first,
/// so that the service is cached when the change comes. Moved to one new backend
/// (a new ring region; the old one stays, shared with the world's other
/// services): every SYN goes there. Removed (the VIP's other services keep its
/// filter bit, so its frames reach the lookup): passed. Both families.
#[test]
fn the_service_cache_follows_every_service_change() {
    /// A SYN's frame by its source port.
    type SynFor = dyn Fn(u16) -> Vec<u8>;
    if !privileged() {
        return;
    }
    stay_on_cpu0();
    let mut w = world();
    let syn4 = |sport: u16| frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
    let syn6 = |sport: u16| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (VIP6, 80), frames::TCP_SYN);
    let families: [(ServiceAddr, IpAddr, &SynFor); 2] = [(svc(VIP, 80, PROTO_TCP), CLIENT.into(), &syn4), (svc(VIP6, 80, PROTO_TCP), CLIENT6.into(), &syn6)];
    let sports = 50000..50008u16;
    for (s, client, syn) in families {
        let run = |w: &mut World, sport: u16| {
            let (v, out, _) = w.dp.test_run(&syn(sport), 1, None).unwrap();
            (v, out)
        };
        for sport in sports.clone() {
            for _ in 0..2 {
                assert_eq!(run(&mut w, sport), (XDP_TX, forwarded(&syn(sport), ring_choice(&w.dp, s, client, sport, 80))), "{s:?}: SYN {sport}");
            }
        }
        let four = backend(4);
        w.dp.set_service(s, std::slice::from_ref(&four), TABLE, 0).unwrap();
        for sport in sports.clone() {
            assert_eq!(run(&mut w, sport), (XDP_TX, forwarded(&syn(sport), four.mac)), "{s:?}: SYN {sport} after the service moved to one backend");
        }
        w.dp.remove_service(s).unwrap();
        for sport in sports.clone() {
            assert_eq!(run(&mut w, sport), (XDP_PASS, syn(sport)), "{s:?}: SYN {sport} after the service was removed");
        }
    }
}

/// A connection opened while the client still sends to the VIP's former holder
/// (its entry stale) survives the client's move to the new owner: the former
/// holder sends the SYN where the ring does and pins the flow there at its next
/// packet; the new owner, which never saw the flow, sends its packets to the same
/// backend by the same ring.
#[test]
fn a_connection_opened_through_a_stale_holder_keeps_its_backend_at_the_new_owner() {
    if !privileged() {
        return;
    }
    let (mut former, mut new) = (world(), world());
    new.dp.hold_vip(IFINDEX, VIP_STALE, monotonic_ns() + 3_600_000_000_000).unwrap();
    let mut moved = 0;
    for sport in 44000..44064u16 {
        let syn = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP_STALE, 80));
        let ack = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP_STALE, 80));
        let (v, out, _) = former.dp.test_run(&syn, 1, None).unwrap();
        assert_eq!(v, XDP_TX, "SYN {sport} at the former holder");
        let to: Mac = out[0..6].try_into().unwrap();
        for at in ["the former holder", "the former holder, pinned", "the new owner"] {
            let dp = if at == "the new owner" { &mut new.dp } else { &mut former.dp };
            let (v, out, _) = dp.test_run(&ack, 1, None).unwrap();
            assert_eq!((v, out), (XDP_TX, forwarded(&ack, to)), "ACK {sport} at {at}");
        }
        moved += usize::from(to != backend(1).mac);
    }
    assert!(moved > 0, "every flow went to one backend: the test proves less");
    let c = former.dp.counters().unwrap();
    assert_eq!(c.reasons["passed_not_owner"].0, 0, "the former holder gave a client's flow to its stack");
}

/// `lb_nodes` holds the MACs of the backends in use (this node's own aside), and
/// loses a node's when no service has it any more.
#[test]
fn lb_nodes_follows_the_backends_in_use() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let nodes = |w: &World| -> std::collections::BTreeSet<u64> {
        use aya::maps::{HashMap, Map, MapData};
        let data = MapData::from_pin(w.pins.path.join(map_names::NODES)).unwrap();
        let m: HashMap<_, u64, u32> = HashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
        m.keys().map(|k| k.unwrap()).collect()
    };
    let key = |i| vip_common::node_mac_key(backend(i).mac);
    assert_eq!(nodes(&w), [key(1), key(2), key(3)].into());
    let two = [backend(1), backend(2)];
    let third = *w.dp.backends().unwrap().iter().find(|(_, b)| b.mac == backend(3).mac).unwrap().0;
    let users: Vec<ServiceAddr> = w.dp.services().unwrap().into_iter().filter(|(_, _, ring)| ring.contains(&third)).map(|(a, _, _)| a).collect();
    assert!(users.len() > 1);
    for s in users {
        w.dp.set_service(s, &two, TABLE, 0).unwrap();
    }
    assert_eq!(nodes(&w), [key(1), key(2)].into(), "backend 3 left every service");
    // A restarted agent finds them as they are.
    drop(Dataplane::open(&w.pins.path).unwrap());
    assert_eq!(nodes(&w), [key(1), key(2)].into());
}

/// A pinned `lb_stats` left by an older version with fewer reasons is replaced on
/// load: every reason is counted and readable afterwards.
#[test]
fn an_outgrown_stats_map_from_an_older_version_is_replaced() {
    if !privileged() {
        return;
    }
    let pins = PinDir::new().unwrap();
    let path = pins.path.join(map_names::STATS);
    let old = vip_common::Reason::COUNT - 1;
    let out = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&path)
        .args(["type", "percpu_array", "key", "4", "value", "16", "entries", &old.to_string(), "name", map_names::STATS])
        .output()
        .unwrap();
    assert!(out.status.success(), "bpftool map create: {}", String::from_utf8_lossy(&out.stderr));
    let mut dp = Dataplane::load(&pins.path, 1 << 16).unwrap();
    dp.set_service(svc(VIP, 53, PROTO_UDP), &[backend(1)], TABLE, 0).unwrap();
    let show = std::process::Command::new("bpftool").args(["-j", "map", "show", "pinned"]).arg(&path).output().unwrap();
    let info: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(info["max_entries"], vip_common::Reason::COUNT, "{info}");
    let frame = frames::udp(frames::BROADCAST, CLIENT_MAC, (CLIENT, 5355), (VIP, 53), b"x");
    let (verdict, _, _) = dp.test_run(&frame, 1, None).unwrap();
    assert_eq!(verdict, XDP_DROP, "a group frame to a VIP not held here");
    assert_eq!(dp.counters().unwrap().reasons["drop_group_not_owner"].0, 1);
}

/// A flow's second packet pins it in the way of its set of four that was looked up
/// least recently when all four are taken: silently when that flow was idle for
/// longer than FLOW_LIVE_STAMPS, counted `flow_evicted` when it was not.
#[test]
fn a_full_set_gives_its_oldest_way_to_a_new_flow() {
    if !privileged() {
        return;
    }
    let mut w = world();
    let key = |i: u32| {
        let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + (i & 0x1_ffff));
        Lb4FlowKey {
            src: src.octets(),
            dst: VIP.octets(),
            sport: (1024 + (i >> 17) as u16).to_be_bytes(),
            dport: 80u16.to_be_bytes(),
            proto: PROTO_TCP,
            _pad: [0; 3],
        }
    };
    let set = w.dp.flow_set(&key(0)).unwrap();
    let same: Vec<Lb4FlowKey> = (0..1 << 26).map(key).filter(|k| w.dp.flow_set(k) == Some(set)).take(6).collect();
    assert_eq!(same.len(), 6, "six flows of one set");
    w.dp.insert_flows(&same[..4].iter().map(|k| (*k, 0)).collect::<Vec<_>>()).unwrap();
    let now = w.dp.flow(&same[0]).unwrap().stamp;
    // same[0] idle for 1,000 s; same[1] and same[2] looked up 20 and 10 s ago.
    for (k, age) in [(0, 1000), (1, 20), (2, 10)] {
        assert!(w.dp.set_flow_stamp(&same[k], now.saturating_sub(age)));
    }
    let evicted = |w: &World| w.dp.counters().unwrap().reasons["flow_evicted"].0;
    let open = |w: &mut World, k: &Lb4FlowKey| {
        let (src, sport) = (Ipv4Addr::from(k.src), u16::from_be_bytes(k.sport));
        w.dp.test_run(&frames::tcp(OUR_MAC, CLIENT_MAC, None, (src, sport), (VIP, 80)), 1, None).unwrap();
        assert_eq!(w.dp.test_run(&frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (src, sport), (VIP, 80)), 1, None).unwrap().0, XDP_TX);
    };
    open(&mut w, &same[4]);
    let pinned = |w: &World| same.iter().map(|k| w.dp.flow(k).is_some()).collect::<Vec<_>>();
    assert_eq!(pinned(&w), [false, true, true, true, true, false], "the idle flow gave its way");
    assert_eq!(evicted(&w), 0, "an idle flow's eviction was counted");
    open(&mut w, &same[5]);
    assert_eq!(pinned(&w), [false, false, true, true, true, true], "the oldest live flow gave its way");
    assert_eq!(evicted(&w), 1, "a live flow's eviction was not counted");
}

/// An upgrade from the version whose flow table was the `lb4_flows` LRU hash: the
/// new agent removes that pin, and its program replaces the one running on the
/// pinned link (the same link: no frame goes unhandled), on every later start too.
#[test]
fn an_upgrade_drops_the_old_flow_table_and_replaces_the_running_program() {
    if !privileged() {
        return;
    }
    let pins = PinDir::new().unwrap();
    let old = pins.path.join("lb4_flows");
    let out = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(&old)
        .args(["type", "lru_hash", "key", "16", "value", "8", "entries", "1024", "name", "lb4_flows"])
        .output()
        .unwrap();
    assert!(out.status.success(), "bpftool map create: {}", String::from_utf8_lossy(&out.stderr));
    let ns = NetNs::new("vipup").unwrap();
    ns.ip(&["link", "add", "up0", "type", "veth", "peer", "name", "up1"]).unwrap();
    ns.ip(&["link", "set", "up0", "up"]).unwrap();
    let show = |what: &str, path: std::path::PathBuf| -> serde_json::Value {
        let out = std::process::Command::new("bpftool").args(["-j", what, "show", "pinned"]).arg(&path).output().unwrap();
        assert!(out.status.success(), "bpftool {what} show {}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let mut running = Vec::new();
    for start in 0..2 {
        let dir = pins.path.clone();
        let mode = ns.run(move || Dataplane::load(&dir, 1 << 16).and_then(|mut dp| dp.attach("up0", AttachMode::Generic)).map(|a| a.mode)).unwrap().unwrap();
        assert_eq!(mode.is_none(), start > 0, "start {start}: attached anew ({mode:?})");
        assert!(!old.exists(), "the old flow table's pin is still there");
        let prog = show("prog", pins.path.join(vip_common::PROGRAM_NAME))["id"].clone();
        let link = show("link", pins.path.join("links/up0"));
        assert_eq!(link["prog_id"], prog, "start {start}: the link runs another program than this start loaded: {link}");
        running.push(prog);
    }
    assert_ne!(running[0], running[1], "the second start did not replace the program");
    let mut dp = Dataplane::open(&pins.path).unwrap();
    dp.set_service(svc(VIP, 80, PROTO_TCP), &[backend(1)], TABLE, 0).unwrap();
    let key = Lb4FlowKey { src: CLIENT.octets(), dst: VIP.octets(), sport: 40000u16.to_be_bytes(), dport: 80u16.to_be_bytes(), proto: PROTO_TCP, _pad: [0; 3] };
    dp.insert_flows(&[(key, 0)]).unwrap();
    assert_eq!(dp.flow_count(), 1, "the new flow table in use");
    assert!(dp.flow(&key).is_some());
}

/// A spoofed-SYN flood of twice the flow table's size, then a ring change (a
/// backend added: Maglev moves about a quarter of the slots): established flows
/// (SYN then ACK) keep their backend. One-packet flows only ever overwrite slots of
/// `lb4_first_packets`, so the flood cannot evict them from `lb_flows`.
#[test]
fn a_spoofed_syn_flood_does_not_break_established_flows_on_a_ring_change() {
    if !privileged() {
        return;
    }
    let mut w = world();
    const ESTABLISHED: u32 = 1000;
    let tuple = |i: u32| (Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 64, 0)) + i), 20000 + (i % 40000) as u16);
    let flow = |i: u32| frames::tcp(OUR_MAC, CLIENT_MAC, None, tuple(i), (VIP, 80));
    let ack = |i: u32| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, tuple(i), (VIP, 80));
    let mut before = Vec::new();
    for i in 0..ESTABLISHED {
        w.dp.test_run(&flow(i), 1, None).unwrap();
        let (v, out, _) = w.dp.test_run(&ack(i), 1, None).unwrap();
        assert_eq!(v, XDP_TX);
        before.push(out[0..6].to_vec());
    }
    assert_eq!(w.dp.flow_count(), ESTABLISHED as usize, "established flows are in lb_flows");
    // The flood: one SYN each from 2 × MAX_FLOWS spoofed sources in 198.18.0.0/15.
    let mut syn = flow(0);
    let flood = 2 * vip_common::MAX_FLOWS;
    let t = std::time::Instant::now();
    for i in 0..flood {
        let src = u32::from(Ipv4Addr::new(198, 18, 0, 0)) | (i >> 1 & 0x1_ffff);
        syn[26..30].copy_from_slice(&src.to_be_bytes());
        syn[34..36].copy_from_slice(&(1024 + (i & 1) as u16 * 30000 + (i >> 18) as u16).to_be_bytes());
        let (v, _, _) = w.dp.test_run(&syn, 1, None).unwrap();
        assert_eq!(v, XDP_TX);
    }
    eprintln!("flood of {flood} one-packet flows in {:?}", t.elapsed());
    let slots = vip_common::FIRST_PACKET_SLOTS as usize;
    assert!(w.dp.new_flow_count() <= slots);
    assert!(w.dp.new_flow_count() >= slots / 2, "the flood filled lb4_first_packets: {}", w.dp.new_flow_count());
    assert_eq!(w.dp.flow_count(), ESTABLISHED as usize, "the flood evicted established flows");
    let four = [backend(1), backend(2), backend(3), backend(4)];
    let moved_slots = w.dp.set_service(svc(VIP, 80, PROTO_TCP), &four, TABLE, 0).unwrap().slots_written;
    assert!(moved_slots > TABLE as usize / 8, "the ring change moved {moved_slots} slots");
    let broken = (0..ESTABLISHED)
        .filter(|&i| {
            let (v, out, _) = w.dp.test_run(&ack(i), 1, None).unwrap();
            v != XDP_TX || out[0..6] != before[i as usize][..]
        })
        .count();
    assert!(broken * 100 <= ESTABLISHED as usize, "{broken} of {ESTABLISHED} established flows changed backend (target ≤ 1%)");
    assert_eq!(broken, 0);
}

/// The ARP self-check's recording (`arp_watch`): an ARP reply or gratuitous ARP
/// claiming a VIP the agent watches on the network it arrived on has its sender MAC
/// recorded (distinct MACs, up to four, every claim counted) and is passed
/// unchanged; claims for unwatched VIPs, on another network, for a VIP held here,
/// requests and malformed frames record nothing.
#[test]
fn arp_watch_records_the_macs_that_answer_for_a_watched_vip() {
    if !privileged() {
        return;
    }
    let mac = |i: u8| -> Mac { [0x02, 0, 0, 0, 0x77, i] };
    let reply_from = |sha, vip| frames::arp(CLIENT_MAC, None, 2, sha, vip, CLIENT_MAC, CLIENT);
    let mut w = world();
    let watched = |w: &mut World, vip: Ipv4Addr| w.dp.held().take_arp_watch(IFINDEX, vip).unwrap();
    let count = |w: &World, r: &str| w.dp.counters().unwrap().reasons[r].0;
    // Nothing is recorded for a VIP that is not watched.
    let frame = reply_from(mac(1), VIP_NOT_HELD);
    let (verdict, out, _) = w.dp.test_run(&frame, 1, None).unwrap();
    assert_eq!((verdict, &out), (XDP_PASS, &frame));
    assert_eq!(watched(&mut w, VIP_NOT_HELD), None);

    for vip in [VIP_NOT_HELD, OTHER, VIP] {
        w.dp.held().watch_arp(IFINDEX, vip).unwrap();
    }
    w.dp.held().watch_arp(IFINDEX, VIP_STALE).unwrap();
    let before = count(&w, "arp_watched");
    let mut sent = 0;
    // Six claims from five MACs: 1, 2, 1 again (no new slot), 3, 4, 5 (no slot left).
    for i in [1, 2, 1, 3, 4, 5] {
        let frame = if i == 3 { frames::arp(frames::BROADCAST, None, 1, mac(i), VIP_NOT_HELD, [0; 6], VIP_NOT_HELD) } else { reply_from(mac(i), VIP_NOT_HELD) };
        let (verdict, out, _) = w.dp.test_run(&frame, 1, None).unwrap();
        assert_eq!((verdict, out), (XDP_PASS, frame), "claim from MAC {i}: passed unchanged");
        sent += 1;
    }
    assert_eq!(count(&w, "arp_watched"), before + sent);
    // Not recorded: the watched VIP in VLAN 42 (another network), a request from
    // it (not an answer), a truncated reply, and a VIP held here (a conflict).
    let not = [
        frames::arp(CLIENT_MAC, Some(VLAN), 2, mac(9), VIP_NOT_HELD, CLIENT_MAC, CLIENT),
        frames::arp_request(mac(9), VIP_NOT_HELD, CLIENT, None),
        reply_from(mac(9), VIP_NOT_HELD)[..14 + 20].to_vec(),
        reply_from(mac(9), VIP),
    ];
    for frame in &not {
        w.dp.test_run(frame, 1, None).unwrap();
    }
    assert_eq!(count(&w, "arp_watched"), before + sent, "only the six claims are counted as arp_watched");
    // The stale VIP (held here, past its deadline) is not ours: watched like any.
    w.dp.test_run(&reply_from(mac(6), VIP_STALE), 1, None).unwrap();
    assert_eq!(watched(&mut w, VIP_NOT_HELD), Some((vec![mac(1), mac(2), mac(3), mac(4)], 6)));
    assert_eq!(watched(&mut w, VIP_NOT_HELD), None, "taken: the entry is gone");
    assert_eq!(watched(&mut w, OTHER), Some((vec![], 0)));
    assert_eq!(watched(&mut w, VIP), Some((vec![], 0)), "a claim for a VIP held here is a conflict, not recorded");
    assert_eq!(watched(&mut w, VIP_STALE), Some((vec![mac(6)], 1)));
    // The entry is a byte-for-byte layout shared with the program: check it raw.
    w.dp.held().watch_arp(IFINDEX, OTHER).unwrap();
    w.dp.test_run(&reply_from(mac(7), OTHER), 1, None).unwrap();
    let pinned = aya::maps::MapData::from_pin(w.pins.path.join(map_names::ARP_WATCH)).unwrap();
    let raw: aya::maps::HashMap<_, [u8; 8], [u8; 40]> = aya::maps::HashMap::try_from(aya::maps::Map::HashMap(pinned)).unwrap();
    let mut key = [0u8; 8];
    key[..4].copy_from_slice(&IFINDEX.to_ne_bytes());
    key[4..].copy_from_slice(&OTHER.octets());
    let value = raw.get(&key, 0).unwrap();
    assert_eq!(&value[..6], &mac(7), "first MAC slot");
    assert_eq!(&value[6..24], &[0u8; 18], "other slots empty");
    assert_eq!(&value[24..32], &[1, 0, 0, 0, 1, 0, 0, 0], "seen 1, replies 1 (native-endian u32s)");
    assert_ne!(&value[32..40], &[0u8; 8], "last_ns set");
    w.dp.held().clear_arp_watch().unwrap();
    assert_eq!(watched(&mut w, OTHER), None);
}

/// The MAC of the VIP's previous holder in the handoff tests: node-1's, a
/// backend (so in `lb_nodes`: its data path is taken to run).
fn previous_holder() -> Mac {
    backend(1).mac
}

/// `frame` as an ask: to `to` from `from`, under `ethertype`.
fn as_ask(frame: &[u8], to: Mac, from: Mac, ethertype: u16) -> Vec<u8> {
    let mut f = forwarded_from(frame, to, from);
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    f
}

/// An owner change after a ring change: flows the former holder pinned on the
/// old ring are asked about by the new holder, whose ring differs, and answered
/// by the former holder from its pins: every one reaches the backend it began
/// on. Without the handoff the new holder sends those whose slot moved
/// elsewhere (what broke connections). `syn`, `ack`: a flow's first and later
/// segments by source port; `vip`, the VIP they go to; `ask` its family's EtherType.
fn owner_change_after_ring_change(vip: IpAddr, src: IpAddr, ask: u16, syn: impl Fn(u16) -> Vec<u8>, ack: impl Fn(u16) -> Vec<u8>) {
    let (mut former, mut new) = (world(), world());
    let service = svc(vip, 80, PROTO_TCP);
    let three = [backend(1), backend(2), backend(3)];
    let mut began = BTreeMap::new();
    for sport in 45000..45064u16 {
        former.dp.test_run(&syn(sport), 1, None).unwrap();
        let (v, out, _) = former.dp.test_run(&ack(sport), 1, None).unwrap();
        assert_eq!(v, XDP_TX, "ACK {sport} pinned at the former holder");
        began.insert(sport, <Mac>::try_from(&out[0..6]).unwrap());
    }
    // Every node's ring changes (another table size), then the VIP moves.
    for w in [&mut former, &mut new] {
        w.dp.set_service(service, &three, 257, 0).unwrap();
    }
    former.dp.held().release(IFINDEX, vip).unwrap();
    let moved: Vec<u16> = began.iter().filter(|(sport, to)| ring_choice(&new.dp, service, src, **sport, 80) != **to).map(|(s, _)| *s).collect();
    assert!(!moved.is_empty(), "no flow's slot moved with the ring: the test proves nothing");
    // Before the handoff is recorded: the ring decides (a fresh world, so that
    // nothing is recorded in the new holder's tables).
    let mut unaware = world();
    unaware.dp.set_service(service, &three, 257, 0).unwrap();
    for sport in &moved {
        let (v, out, _) = unaware.dp.test_run(&ack(*sport), 1, None).unwrap();
        assert_eq!((v, out[0..6] != began[sport]), (XDP_TX, true), "{sport} without a handoff goes by the new ring");
    }
    new.dp.held().hand_off(IFINDEX, vip, previous_holder()).unwrap();
    assert_eq!(new.dp.held().handoffs().unwrap(), [((IFINDEX, vip), previous_holder())].into());
    for (sport, to) in &began {
        for round in 0..2 {
            let (v, asked, _) = new.dp.test_run(&ack(*sport), 1, None).unwrap();
            assert_eq!((v, &asked), (XDP_TX, &as_ask(&ack(*sport), previous_holder(), OUR_MAC, ask)), "{sport} asked (round {round})");
            let (v, answered, _) = former.dp.test_run(&asked, 1, None).unwrap();
            assert_eq!((v, answered), (XDP_TX, forwarded_from(&ack(*sport), *to, previous_holder())), "{sport} answered from the pin");
        }
    }
    let (n, f) = (new.dp.counters().unwrap(), former.dp.counters().unwrap());
    assert_eq!(n.reasons["asked_previous"].0, 2 * began.len() as u64);
    assert_eq!(f.reasons["ask_answered_pinned"].0, 2 * began.len() as u64);
    assert_eq!(f.reasons["ask_answered_ring"].0, 0);
    // A new connection is the new holder's own: by its ring, pinned there, never asked.
    let (v, out, _) = new.dp.test_run(&syn(46000), 1, None).unwrap();
    let to = ring_choice(&new.dp, service, src, 46000, 80);
    assert_eq!((v, out), (XDP_TX, forwarded(&syn(46000), to)));
    for _ in 0..2 {
        let (v, out, _) = new.dp.test_run(&ack(46000), 1, None).unwrap();
        assert_eq!((v, out), (XDP_TX, forwarded(&ack(46000), to)), "a flow that began here is not asked about");
    }
    // An ask about a flow the former holder never pinned: by its ring.
    let (v, asked, _) = new.dp.test_run(&ack(47000), 1, None).unwrap();
    assert_eq!(v, XDP_TX);
    let (v, answered, _) = former.dp.test_run(&asked, 1, None).unwrap();
    assert_eq!((v, answered), (XDP_TX, forwarded_from(&ack(47000), ring_choice(&former.dp, service, src, 47000, 80), previous_holder())));
    assert_eq!(former.dp.counters().unwrap().reasons["ask_answered_ring"].0, 1);
    // The former holder's answer that chose the new holder is passed there.
    let from_prev = forwarded_from(&ack(45000), OUR_MAC, previous_holder());
    let (v, out, _) = new.dp.test_run(&from_prev, 1, None).unwrap();
    assert_eq!((v, out), (XDP_PASS, from_prev));
    assert_eq!(new.dp.counters().unwrap().reasons["passed_from_previous"].0, 1);
    // Released: no more asks.
    new.dp.held().release(IFINDEX, vip).unwrap();
    assert!(new.dp.held().handoffs().unwrap().is_empty());
}

#[test]
fn a_flow_pinned_by_the_previous_holder_keeps_its_backend_after_a_ring_change_and_a_takeover() {
    if !privileged() {
        return;
    }
    let syn = |sport| frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
    let ack = |sport| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (VIP, 80));
    owner_change_after_ring_change(VIP.into(), CLIENT.into(), vip_common::ETH_P_ASK4, syn, ack);
}

#[test]
fn an_ipv6_flow_pinned_by_the_previous_holder_keeps_its_backend_after_a_ring_change_and_a_takeover() {
    if !privileged() {
        return;
    }
    let syn = |sport| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (VIP6, 80), frames::TCP_SYN);
    let ack = |sport| frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (VIP6, 80), frames::TCP_ACK);
    owner_change_after_ring_change(VIP6.into(), CLIENT6.into(), vip_common::ETH_P_ASK6, syn, ack);
}

/// What is never asked about, with a previous holder recorded: UDP, a stale
/// holder's frames, a frame another node sent (balanced as before), a frame of
/// a VLAN, and any frame while the previous holder is no backend here (its data
/// path may be gone). And what an ask that is not one to answer does: tagged,
/// it is no IP frame (passed as other); cut short, malformed.
#[test]
fn what_is_not_asked_about_and_asks_that_are_not_answered() {
    if !privileged() {
        return;
    }
    let mut w = world();
    for v in [VIP, VIP_STALE] {
        w.dp.held().hand_off(IFINDEX, v.into(), previous_holder()).unwrap();
    }
    w.dp.held().hand_off(VLAN_IFINDEX, VIP_VLAN.into(), previous_holder()).unwrap();
    let by_ring = |w: &World, frame: &[u8], vip: Ipv4Addr, port: u16, proto: u8, sport: u16| {
        forwarded(frame, ring_choice(&w.dp, svc(vip, port, proto), CLIENT, sport, port))
    };
    let udp = frames::udp(OUR_MAC, CLIENT_MAC, (CLIENT, 45100), (VIP, 53), b"q");
    let want = by_ring(&w, &udp, VIP, 53, PROTO_UDP, 45100);
    let (v, out, _) = w.dp.test_run(&udp, 1, None).unwrap();
    assert_eq!((v, out), (XDP_TX, want), "UDP goes by the ring");
    let stale = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 45101), (VIP_STALE, 80));
    assert_eq!(w.dp.test_run(&stale, 1, None).unwrap().1, by_ring(&w, &stale, VIP_STALE, 80, PROTO_TCP, 45101), "a stale holder asks no one");
    let from_node = frames::tcp_ack(OUR_MAC, backend(2).mac, None, (CLIENT, 45102), (VIP, 80));
    let to = ring_choice(&w.dp, svc(VIP, 80, PROTO_TCP), CLIENT, 45102, 80);
    assert_eq!(w.dp.test_run(&from_node, 1, None).unwrap().1, forwarded(&from_node, to), "another node's frame is balanced as before");
    let tagged = frames::tcp_ack(VLAN_MAC, CLIENT_MAC, Some(VLAN), (CLIENT, 45103), (VIP_VLAN, 80));
    let (v, out, _) = w.dp.test_run(&tagged, 1, None).unwrap();
    assert_eq!((v, out[12..14] == [0x81, 0x00]), (XDP_TX, true), "a VLAN's frame is balanced, not asked about");
    assert_eq!(w.dp.counters().unwrap().reasons["asked_previous"].0, 0);
    // The previous holder is no backend here any more: the ring decides.
    let client = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 45104), (VIP, 80));
    assert_eq!(w.dp.test_run(&client, 1, None).unwrap().1, as_ask(&client, previous_holder(), OUR_MAC, vip_common::ETH_P_ASK4));
    let others = [backend(2), backend(3)];
    for s in w.dp.services().unwrap().into_iter().map(|(a, _, _)| a).filter(|a| a.port == 80 || a.port == 53) {
        w.dp.set_service(s, &others, TABLE, 0).unwrap();
    }
    let client = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 45105), (VIP, 80));
    assert_eq!(w.dp.test_run(&client, 1, None).unwrap().1, by_ring(&w, &client, VIP, 80, PROTO_TCP, 45105), "no ask to a node out of every ring");
    // Asks that are not answered.
    let ask = as_ask(&client, OUR_MAC, backend(2).mac, vip_common::ETH_P_ASK4);
    let tagged_ask = outer_tagged(&ask, 0x8100, VLAN);
    let (v, out, _) = w.dp.test_run(&tagged_ask, 1, None).unwrap();
    assert_eq!((v, out), (XDP_PASS, tagged_ask.clone()), "a tagged ask is no frame of ours");
    let (v, _, _) = w.dp.test_run(&ask[..20], 1, None).unwrap();
    assert_eq!(v, XDP_DROP, "an ask cut short is malformed");
}

/// `vip_xmit` sends what it is run on, except a frame that is only an Ethernet
/// header: the agent's probe of whether the kernel lets it transmit through XDP.
#[test]
fn vip_xmit_sends_frames_and_drops_the_probe() {
    if !privileged() {
        return;
    }
    let mut w = world();
    for (len, verdict) in [(vip_common::XMIT_PROBE_LEN, XDP_DROP), (vip_common::XMIT_PROBE_LEN + 1, XDP_TX), (60, XDP_TX)] {
        let frame = vec![0xab; len];
        let (got, _, _) = w.dp.test_run_program(vip_common::XMIT_PROGRAM_NAME, &frame, 1, None).unwrap();
        assert_eq!(got, verdict, "vip_xmit on a {len}-byte frame");
    }
}
