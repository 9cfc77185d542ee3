use super::*;
use crate::model::{AnnounceMode, Selector};

fn iface(name: &str, ifindex: u32, nets: &[(&str, u8)], vlan: Option<(&str, u16)>) -> HostIface {
    HostIface {
        name: name.into(),
        ifindex,
        mac: [2, 0, 0, 0, 0, ifindex as u8],
        nets: nets.iter().map(|&(a, l)| (a.parse().unwrap(), l)).collect(),
        vlan: vlan.map(|(p, v)| (p.into(), v)),
        up: true,
    }
}

/// A host with every case: the node's address on eth0, a VLAN on it, a VLAN on
/// that VLAN, a VLAN whose parent is gone, nested prefixes, two interfaces on one
/// network, a VIP on lo, and an interface that is down; in both families.
fn host() -> Vec<HostIface> {
    let mut down = iface("eth3", 9, &[("198.18.8.1", 24)], None);
    down.up = false;
    vec![
        iface("lo", 1, &[("127.0.0.1", 8), ("198.18.7.1", 32), ("::1", 128), ("2001:2:0:77::1", 128)], None),
        iface("eth0", 2, &[("198.18.0.11", 24), ("2001:2::11", 64)], None),
        iface("eth1", 3, &[("198.18.1.2", 24), ("2001:2:0:1::2", 64)], None),
        // 2001:2::/60 holds eth0's, eth1's, br0's and the VLAN's /64s.
        iface("eth2", 4, &[("198.18.2.2", 24), ("2001:2:0:2::2", 60)], None),
        iface("br0", 5, &[("198.18.2.130", 25), ("2001:2:0:2::82", 64)], None),
        iface("ens5", 6, &[("198.18.4.5", 24), ("2001:2:0:4::5", 64)], None),
        iface("ens4", 7, &[("198.18.4.4", 24), ("2001:2:0:4::4", 64)], None),
        iface("eth0.100", 8, &[("198.18.3.1", 24), ("2001:2:0:3::1", 64)], Some(("eth0", 100))),
        down,
        iface("eth0.100.7", 10, &[("198.18.5.1", 24)], Some(("eth0.100", 7))),
        iface("orphan.9", 11, &[("198.18.6.1", 24)], Some(("gone", 9))),
        iface("dummy0", 12, &[], None),
    ]
}

fn pool(name: &str, first: &str, interfaces: &[&str], role: &str) -> Pool {
    let first: IpAddr = first.parse().unwrap();
    let next = match first {
        IpAddr::V4(a) => Ipv4Addr::from(u32::from(a) + 1).into(),
        IpAddr::V6(a) => Ipv6Addr::from(u128::from(a) + 1).into(),
    };
    Pool {
        name: name.into(),
        addresses: vec![first, next],
        node_selector: Selector::from([("role".to_owned(), role.to_owned())]),
        tolerations: Vec::new(),
        announce: AnnounceMode::Arp,
        distribution: Default::default(),
        garp: None,
        interfaces: interfaces.iter().map(|s| s.to_string()).collect(),
        vlan: None,
        bgp: Default::default(),
    }
}

/// A node's home: `--iface` when given, else the interface holding its address
/// (never `lo`, which holds a VIP here).
#[test]
fn a_nodes_home() {
    let host = host();
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert_eq!(home(ip("198.18.0.11"), None, &host).map(|l| l.name), Ok("eth0".into()));
    assert_eq!(home(ip("2001:2::11"), None, &host).map(|l| l.name), Ok("eth0".into()), "an IPv6 node");
    assert_eq!(home(ip("2001:2:0:3::1"), None, &host).map(|l| (l.xdp_iface, l.vlan)), Ok(("eth0".into(), Some(100))));
    assert_eq!(home(ip("2001:2:0:77::1"), None, &host).unwrap_err(), LinkError::NoHome(ip("2001:2:0:77::1")));
    assert_eq!(home(ip("198.18.0.11"), Some("eth1"), &host).map(|l| l.name), Ok("eth1".into()));
    assert_eq!(home(ip("198.18.3.1"), None, &host).map(|l| (l.xdp_iface, l.vlan)), Ok(("eth0".into(), Some(100))), "a VLAN sub-interface");
    let no_home = home(ip("198.18.7.1"), None, &host).unwrap_err();
    assert_eq!(no_home.to_string(), "no interface of this node holds its address 198.18.7.1; set the agent's --iface");
    let no_iface = home(ip("198.18.0.11"), Some("eth9"), &host).unwrap_err();
    assert_eq!(no_iface.to_string(), r#"the agent's interface "eth9" (--iface) is not on this node"#);
}

/// A pool naming a VLAN: on that VLAN of the interface the rules choose, under
/// an id of its own that no interface has; a sub-interface of the same VLAN is
/// taken as it is, one of another VLAN is a contradiction.
#[test]
fn a_pool_naming_a_vlan() {
    let host = host();
    let on = |first: &str, interfaces: &[&str], vlan: u16| {
        let mut p = pool("p", first, interfaces, "lb");
        p.vlan = Some(vlan);
        resolve(&world(vec![p]), "n1", None, &host)
    };
    let got = on("198.18.9.10", &[], 30);
    let eth0 = find(&host, "eth0").unwrap();
    let want = Link {
        name: "eth0.30".into(),
        ifindex: vlan_net(eth0.ifindex, 30),
        mac: eth0.mac,
        xdp_iface: "eth0".into(),
        xdp_ifindex: eth0.ifindex,
        vlan: Some(30),
    };
    assert_eq!(got.by_pool["p"], want, "rule 4's interface, on VLAN 30");
    assert!(is_vlan_net(want.ifindex) && host.iter().all(|i| !is_vlan_net(i.ifindex) && i.ifindex != want.ifindex));
    assert_ne!(vlan_net(eth0.ifindex, 31), want.ifindex, "one id per VLAN");
    assert_eq!((network_name(vlan_net(1, 30)), network_name(1)), ("lo VLAN 30".to_owned(), "lo".to_owned()), "ifindex 1 is lo");
    assert_eq!(on("198.18.3.50", &[], 100).by_pool["p"].name, "eth0.100", "the sub-interface of that VLAN");
    let got = on("198.18.3.50", &[], 30);
    assert!(got.by_pool.is_empty() && got.problems[0].contains("vlan 30 contradicts \"eth0.100\""), "{got:?}");
}

fn world(pools: Vec<Pool>) -> World {
    let node = |name: &str, addr: &str| Node {
        name: name.into(),
        addr: addr.parse().unwrap(),
        mac: None,
        labels: [("role".to_owned(), "lb".to_owned())].into(),
        taints: Vec::new(),
    };
    // n2's and n4's addresses are on no interface of the host: rule 4 finds
    // nothing for them. n3 is an IPv6 node on eth0.
    let nodes = vec![node("n1", "198.18.0.11"), node("n2", "198.18.9.9"), node("n3", "2001:2::11"), node("n4", "2001:2:0:98::9")];
    World { nodes, pools, ..World::default() }
}

/// What one pool resolves to: (name, xdp_iface, vlan), or a problem containing the text.
#[derive(Debug)]
enum Want {
    On(&'static str, &'static str, Option<u16>),
    Problem(&'static str),
}
use Want::{On, Problem};

/// (what, pool's first address, pool.interfaces, --iface, node, expected)
type Case = (&'static str, &'static str, &'static [&'static str], Option<&'static str>, &'static str, Want);

#[test]
fn each_rule_in_turn() {
    #[rustfmt::skip]
        let cases: &[Case] = &[
            ("rule 1: the first listed name present", "198.18.2.10", &["ens9", "eth1", "eth0"], None, "n1", On("eth1", "eth1", None)),
            ("rule 1 over --iface and addresses", "198.18.2.10", &["eth0"], Some("eth1"), "n1", On("eth0", "eth0", None)),
            ("rule 1: lo when named", "198.18.7.1", &["lo"], None, "n1", On("lo", "lo", None)),
            ("rule 1: none present", "198.18.2.10", &["ens9", "ens10"], None, "n1", Problem("pool \"p\": none of its interfaces (ens9, ens10) is on this node")),
            ("rule 1: a VLAN sub-interface", "198.18.2.10", &["eth0.100"], None, "n1", On("eth0.100", "eth0", Some(100))),
            ("rule 2: --iface over addresses", "198.18.2.10", &[], Some("eth1"), "n1", On("eth1", "eth1", None)),
            ("rule 2: --iface missing", "198.18.2.10", &[], Some("eth9"), "n1", Problem("pool \"p\": the agent's interface \"eth9\" (--iface) is not on this node")),
            ("rule 3: the network of the pool", "198.18.1.50", &[], None, "n1", On("eth1", "eth1", None)),
            ("rule 3: the longest prefix (/25 in the /24)", "198.18.2.200", &[], None, "n1", On("br0", "br0", None)),
            ("rule 3: only the /24 contains it", "198.18.2.10", &[], None, "n1", On("eth2", "eth2", None)),
            ("rule 3: a tie goes to the first name", "198.18.4.100", &[], None, "n1", On("ens4", "ens4", None)),
            ("rule 3: a VLAN's network", "198.18.3.50", &[], None, "n1", On("eth0.100", "eth0", Some(100))),
            ("rule 3: down, chosen all the same", "198.18.8.20", &[], None, "n1", On("eth3", "eth3", None)),
            ("rule 3 never takes lo: rule 4", "198.18.7.1", &[], None, "n1", On("eth0", "eth0", None)),
            ("rule 4: the node's address", "198.19.0.1", &[], None, "n1", On("eth0", "eth0", None)),
            ("rule 5: nothing", "198.19.0.1", &[], None, "n2", Problem("no interface of this node has a network containing 198.19.0.1 or the node's address 198.18.9.9")),
            ("rule 3 (IPv6): the network of the pool", "2001:2:0:1::50", &[], None, "n1", On("eth1", "eth1", None)),
            ("rule 3 (IPv6): the longest prefix (/64 in the /60)", "2001:2:0:2::50", &[], None, "n1", On("br0", "br0", None)),
            ("rule 3 (IPv6): only the /60 contains it", "2001:2:0:5::50", &[], None, "n1", On("eth2", "eth2", None)),
            ("rule 3 (IPv6): a tie goes to the first name", "2001:2:0:4::100", &[], None, "n1", On("ens4", "ens4", None)),
            ("rule 3 (IPv6): a VLAN's network", "2001:2:0:3::50", &[], None, "n1", On("eth0.100", "eth0", Some(100))),
            ("rule 3 (IPv6) never takes lo: rule 4", "2001:2:0:77::1", &[], None, "n1", On("eth0", "eth0", None)),
            ("rule 3 (IPv6) for an IPv6 node", "2001:2:0:1::50", &[], None, "n3", On("eth1", "eth1", None)),
            ("rule 4: an IPv6 node's address", "2001:2:0:99::1", &[], None, "n3", On("eth0", "eth0", None)),
            ("rule 4: an IPv4 pool, an IPv6 node", "198.19.0.1", &[], None, "n3", On("eth0", "eth0", None)),
            ("rule 5 (IPv6): nothing", "2001:2:0:99::1", &[], None, "n4", Problem("no interface of this node has a network containing 2001:2:0:99::1 or the node's address 2001:2:0:98::9")),
            ("QinQ by name", "198.18.2.10", &["eth0.100.7"], None, "n1", Problem("\"eth0.100.7\" is a VLAN on the VLAN interface \"eth0.100\" (stacked tags): QinQ is not supported")),
            ("QinQ by address", "198.18.5.9", &[], None, "n1", Problem("QinQ is not supported")),
            ("a VLAN's parent missing", "198.18.6.9", &[], None, "n1", Problem("the parent \"gone\" of VLAN interface \"orphan.9\" is not on this node")),
        ];
    let host = host();
    for (what, first, interfaces, default_iface, me, want) in cases {
        let w = world(vec![pool("p", first, interfaces, "lb")]);
        let got = resolve(&w, me, *default_iface, &host);
        match want {
            On(name, xdp, vlan) => {
                assert!(got.problems.is_empty(), "{what}: {got:?}");
                let l = &got.by_pool["p"];
                let (chosen, parent) = (find(&host, name).unwrap(), find(&host, xdp).unwrap());
                let expected = Link {
                    name: name.to_string(),
                    ifindex: chosen.ifindex,
                    mac: chosen.mac,
                    xdp_iface: xdp.to_string(),
                    xdp_ifindex: parent.ifindex,
                    vlan: *vlan,
                };
                assert_eq!(l, &expected, "{what}");
            }
            Problem(text) => {
                assert!(got.by_pool.is_empty(), "{what}: {got:?}");
                assert_eq!(got.problems.len(), 1, "{what}: {got:?}");
                assert!(got.problems[0].starts_with("pool \"p\": ") && got.problems[0].contains(text), "{what}: {:?}", got.problems);
            }
        }
    }
}

/// Several pools at once, each on its own link; a pool that does not admit the
/// node has neither a link nor a problem; an unknown node gets nothing.
#[test]
fn pools_of_a_node_only() {
    let w = world(vec![
        pool("web", "198.18.1.10", &[], "lb"),
        pool("tagged", "198.18.3.10", &[], "lb"),
        pool("elsewhere", "198.18.2.10", &["ens9"], "other"),
        pool("lost", "198.18.2.10", &["ens9"], "lb"),
    ]);
    let host = host();
    let got = resolve(&w, "n1", None, &host);
    let summary: Vec<(&str, &str, &str, Option<u16>)> = got.by_pool.iter().map(|(p, l)| (p.as_str(), l.name.as_str(), l.xdp_iface.as_str(), l.vlan)).collect();
    assert_eq!(summary, [("tagged", "eth0.100", "eth0", Some(100)), ("web", "eth1", "eth1", None)]);
    assert_eq!(got.by_pool["tagged"].mac, find(&host, "eth0.100").unwrap().mac, "the chosen interface's own MAC");
    assert_eq!(got.problems, ["pool \"lost\": none of its interfaces (ens9) is on this node"]);
    assert_eq!(resolve(&w, "nobody", Some("eth0"), &host), Links::default());
    assert_eq!(resolve(&w, "n1", None, &[]).by_pool.len(), 0, "no interfaces at all: problems only");
    assert_eq!(resolve(&w, "n1", None, &[]).problems.len(), 3);
}

#[test]
fn prefixes_contain_addresses() {
    let a = |s: &str| s.parse::<IpAddr>().unwrap();
    assert!(contains((a("198.18.2.130"), 25), a("198.18.2.255")));
    assert!(!contains((a("198.18.2.130"), 25), a("198.18.2.127")));
    assert!(contains((a("198.18.0.1"), 32), a("198.18.0.1")) && !contains((a("198.18.0.1"), 32), a("198.18.0.2")));
    assert!(contains((a("10.0.0.1"), 0), a("198.18.0.1")));
    assert!(!contains((a("10.0.0.1"), 33), a("10.0.0.1")), "no such prefix");
    assert!(contains((a("2001:2::11"), 64), a("2001:2::ffff:1")) && !contains((a("2001:2::11"), 64), a("2001:2:0:1::11")));
    assert!(contains((a("2001:2::11"), 128), a("2001:2::11")) && !contains((a("2001:2::11"), 128), a("2001:2::12")));
    assert!(contains((a("2001:2::"), 0), a("::1")) && !contains((a("2001:2::"), 129), a("2001:2::")));
    assert!(!contains((a("0.0.0.0"), 0), a("::1")) && !contains((a("::"), 0), a("198.18.0.1")), "never across families");
    assert!(is_link_local("fe80::1".parse().unwrap()) && is_link_local("febf::1".parse().unwrap()) && !is_link_local("fec0::1".parse().unwrap()));
}

#[test]
fn vlan_config_as_the_kernel_writes_it() {
    // vlan_seq_show: "%-15s| %d  | %s\n" after two header lines.
    let text = "VLAN Dev name\t | VLAN ID\nName-Type: VLAN_NAME_TYPE_RAW_PLUS_VID_NO_PAD\neth0.100       | 100  | eth0\nabcdefghijklmno| 4094  | eth0.100\n";
    let v = parse_vlan_config(text);
    assert_eq!(v.len(), 2, "{v:?}");
    assert_eq!(v["eth0.100"], ("eth0".to_owned(), 100));
    assert_eq!(v["abcdefghijklmno"], ("eth0.100".to_owned(), 4094));
    assert!(parse_vlan_config("").is_empty());
}

/// The real list, in this test's namespace (getifaddrs needs no privilege).
#[test]
fn read_host_finds_the_loopback() {
    let host = read_host().unwrap();
    let lo = find(&host, "lo").unwrap_or_else(|| panic!("no lo in {host:?}"));
    assert!(lo.nets.contains(&("127.0.0.1".parse().unwrap(), 8)), "{lo:?}");
    let link_local = |a: &IpAddr| matches!(a, IpAddr::V6(v) if is_link_local(*v));
    assert!(host.iter().flat_map(|i| &i.nets).all(|(a, _)| !link_local(a)), "no link-local network: {host:?}");
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(c"lo".as_ptr()) };
    assert_eq!((lo.ifindex, lo.mac, &lo.vlan), (index, [0; 6], &None), "{lo:?}");
    let mut names: Vec<&str> = host.iter().map(|i| i.name.as_str()).collect();
    names.dedup();
    assert_eq!(names.len(), host.len(), "one entry per interface: {host:?}");
    assert!(host.windows(2).all(|w| w[0].ifindex < w[1].ifindex), "sorted by ifindex, unique: {host:?}");
}
