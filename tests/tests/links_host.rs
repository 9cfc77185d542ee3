//! `links::read_host` on real devices, in a namespace of the test's own: names,
//! ifindexes, MACs, link state, IPv4 networks (an address label such as `d0:7`
//! counted on its device) and IPv6 ones (link-local ones left out), 802.1Q sub-interfaces and their parents, read from a
//! thread that entered the namespace; then `links::resolve` on what it read. The
//! VLAN checks need a kernel with 802.1Q devices and are skipped, saying so, without.
use std::net::IpAddr;

use vip_agent::{
    links::{read_host, resolve, HostIface},
    model::{AnnounceMode, Node, Pool, World},
};
use vip_tests::netns::{privileged, NetNs};

fn get<'a>(host: &'a [HostIface], name: &str) -> &'a HostIface {
    host.iter().find(|i| i.name == name).unwrap_or_else(|| panic!("no {name} in {host:#?}"))
}

fn net(a: &str, len: u8) -> (IpAddr, u8) {
    (a.parse().unwrap(), len)
}

#[test]
fn read_host_sees_addresses_labels_and_vlans_of_its_namespace() {
    if !privileged() {
        return;
    }
    let ns = NetNs::new("vlnk").unwrap();
    let ip = |cmd: &str| ns.ip(&cmd.split(' ').collect::<Vec<_>>());
    for cmd in [
        "link add d0 type veth peer name p0",
        "link set p0 up",
        "link set d0 up",
        "addr add 198.18.10.1/24 dev d0",
        "addr add 198.18.11.1/25 dev d0 label d0:7",
        "addr add 2001:2:0:10::1/64 dev d0 nodad",
        // d1 stays down.
        "link add d1 type veth peer name p1",
    ] {
        ip(cmd).unwrap();
    }
    // 802.1Q sub-interfaces, where the kernel has them (CONFIG_VLAN_8021Q).
    let vlans = match ip("link add link d0 name d0.100 type vlan id 100") {
        Ok(_) => true,
        Err(e) if e.to_string().contains("Unknown device type") => {
            eprintln!("skipping the VLAN checks: this kernel has no 802.1Q devices (CONFIG_VLAN_8021Q)");
            false
        }
        Err(e) => panic!("{e:#}"),
    };
    if vlans {
        for cmd in ["link set d0.100 up", "addr add 198.18.12.1/24 dev d0.100", "link add link d0.100 name d0.100.7 type vlan id 7"] {
            ip(cmd).unwrap();
        }
    }
    // Read from a thread inside the namespace: its VLANs are not in the namespace
    // of the test process's main thread (/proc/self/net would show those).
    let host = ns.run(read_host).unwrap().unwrap();

    let lo = get(&host, "lo");
    assert!(lo.nets.contains(&net("127.0.0.1", 8)) && lo.up, "{lo:?}");
    let d0 = get(&host, "d0");
    assert_eq!((d0.mac, d0.up, &d0.vlan), (ns.mac("d0").unwrap(), true, &None), "{d0:?}");
    let mut nets = d0.nets.clone();
    nets.sort();
    // d0 is up with its peer: the kernel gave it a link-local address too, left out.
    assert_eq!(nets, [net("198.18.10.1", 24), net("198.18.11.1", 25), net("2001:2:0:10::1", 64)], "the labelled address is d0's");
    let d1 = get(&host, "d1");
    assert!(!d1.up && d1.nets.is_empty() && d1.vlan.is_none() && d1.mac == ns.mac("d1").unwrap(), "{d1:?}");
    assert!(host.iter().all(|i| i.name != "d0:7"), "a label is not an interface: {host:#?}");
    assert_eq!(host.len(), if vlans { 7 } else { 5 }, "lo, d0, p0, d1, p1 (and the VLANs): {host:#?}");
    assert!(host.windows(2).all(|w| w[0].ifindex < w[1].ifindex), "distinct ifindexes, sorted: {host:#?}");
    if vlans {
        let vlan = get(&host, "d0.100");
        assert_eq!((&vlan.vlan, &vlan.nets, vlan.mac), (&Some(("d0".to_owned(), 100)), &vec![net("198.18.12.1", 24)], ns.mac("d0.100").unwrap()));
        let qinq = get(&host, "d0.100.7");
        assert_eq!((&qinq.vlan, qinq.up), (&Some(("d0.100".to_owned(), 7)), false), "created down: {qinq:?}");
    }

    // What the resolver makes of it: the labelled network and the IPv6 one → d0; the VLAN's network
    // → XDP on d0 with VLAN 100; the stacked VLAN → a problem.
    let pool = |name: &str, first: &str, interfaces: &[&str]| Pool {
        name: name.into(),
        addresses: vec![first.parse().unwrap()],
        node_selector: Default::default(),
        tolerations: Vec::new(),
        announce: AnnounceMode::Arp,
        distribution: Default::default(),
        garp: None,
        interfaces: interfaces.iter().map(|s| s.to_string()).collect(),
        vlan: None,
        bgp: Default::default(),
    };
    let node = Node { name: "n1".into(), addr: "198.18.10.1".parse().unwrap(), mac: None, labels: Default::default(), taints: Vec::new() };
    let mut world = World {
        nodes: vec![node],
        pools: vec![pool("alias", "198.18.11.50", &[]), pool("down", "198.18.13.1", &["d1"]), pool("v6", "2001:2:0:10::50", &[])],
        ..World::default()
    };
    if vlans {
        world.pools.extend([pool("tagged", "198.18.12.50", &[]), pool("qinq", "198.18.14.1", &["d0.100.7"])]);
    }
    let links = resolve(&world, "n1", None, &host);
    assert_eq!((links.by_pool["alias"].name.as_str(), links.by_pool["alias"].ifindex, links.by_pool["alias"].vlan), ("d0", d0.ifindex, None));
    assert_eq!((links.by_pool["down"].name.as_str(), links.by_pool["down"].mac), ("d1", d1.mac), "down, chosen all the same");
    assert_eq!(links.by_pool["v6"].name, "d0", "by its IPv6 network");
    if vlans {
        let tagged = &links.by_pool["tagged"];
        assert_eq!(
            (tagged.name.as_str(), tagged.ifindex, tagged.xdp_iface.as_str(), tagged.xdp_ifindex, tagged.vlan),
            ("d0.100", get(&host, "d0.100").ifindex, "d0", d0.ifindex, Some(100))
        );
        assert_eq!(links.problems.len(), 1, "{links:?}");
        assert!(links.problems[0].starts_with("pool \"qinq\": ") && links.problems[0].contains("QinQ is not supported"), "{links:?}");
    } else {
        assert_eq!(links.problems, Vec::<String>::new());
    }
}
