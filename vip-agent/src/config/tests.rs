//! Config validation: the accepted example, and every rejected case with its
//! field path, line and message.
use std::{net::Ipv4Addr, time::Duration};

use super::{parse, ConfigError};
use crate::model::{Probe, Protocol};

const GOOD: &str = r#"
nodes:
  - name: n2
    address: 198.18.0.12
    labels: {role: backend}
  - name: n1
    address: 198.18.0.11
    mac: "02:00:00:00:00:11"
    labels: {role: lb}
pools:
  - name: web
    addresses: [198.18.1.10, 198.18.1.16/30, 198.18.1.20-198.18.1.22]
    excludedIPs: [198.18.1.17]
    nodeSelector: {role: lb}
services:
  - name: web
    vip: 198.18.1.10
    ports: [80, 443]
    tableSize: 251
    backendSelector: {role: backend}
    healthCheck:
      type: http
      path: /healthz
      interval: 200ms
      timeout: 100ms
      rise: 2
      fall: 3
  - name: dns
    vip: 198.18.1.16
    ports: [53]
    protocol: udp
announce:
  holdTime: 900ms
failover:
  heartbeatInterval: 100ms
  deadAfter: 1200ms
"#;

#[test]
fn accepts_the_example_and_fills_the_model() {
    let w = parse(GOOD).unwrap();
    assert_eq!(w.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1", "n2"], "nodes sorted by name");
    assert_eq!(w.nodes[0].mac, Some([2, 0, 0, 0, 0, 0x11]));
    assert_eq!(w.nodes[1].mac, None);
    let want: Vec<Ipv4Addr> =
        ["198.18.1.10", "198.18.1.16", "198.18.1.18", "198.18.1.19", "198.18.1.20", "198.18.1.21", "198.18.1.22"].iter().map(|s| s.parse().unwrap()).collect();
    assert_eq!(w.pools[0].addresses, want);
    let web = &w.services[0];
    assert_eq!(web.addrs().count(), 2);
    assert_eq!(web.table_size, 251);
    let h = web.health.as_ref().unwrap();
    assert_eq!(h.probe, Probe::Http { port: 80, path: "/healthz".into() });
    assert_eq!((h.interval, h.timeout, h.rise, h.fall), (Duration::from_millis(200), Duration::from_millis(100), 2, 3));
    assert_eq!(w.backend_candidates(web).iter().map(|n| &n.name[..]).collect::<Vec<_>>(), ["n2"]);
    let dns = &w.services[1];
    assert_eq!((dns.protocol, dns.table_size, dns.health.is_none()), (Protocol::Udp, 16381, true));
    assert_eq!(w.backend_candidates(dns).iter().map(|n| &n.name[..]).collect::<Vec<_>>(), ["n1"], "defaults to the pool's selector");
    assert_eq!(w.announce.hold_time, Duration::from_millis(900));
}

/// `GOOD` with `from` replaced by `to` must be rejected at `path`, on the line
/// of the edited text where `at` first appears, with a message containing `msg`.
fn rejects(from: &str, to: &str, path: &str, at: &str, msg: &str) {
    assert!(GOOD.contains(from), "fixture text {from:?} not in GOOD");
    let text = GOOD.replacen(from, to, 1);
    let line = line_with(&text, at);
    let err: ConfigError = parse(&text).expect_err(&format!("accepted with {to:?}"));
    assert_eq!(err.path, path, "path of {err}");
    assert_eq!(err.line, Some(line), "line of {err}");
    assert!(err.message.contains(msg), "message of {err:?} lacks {msg:?}");
    assert!(err.to_string().starts_with(&format!("line {line}: {path}: ")), "display: {err}");
}

fn line_with(text: &str, at: &str) -> usize {
    let i = text.find(at).unwrap_or_else(|| panic!("{at:?} not in the edited text"));
    text[..i].matches('\n').count() + 1
}

#[test]
fn unknown_keys_are_errors() {
    rejects("    labels: {role: backend}", "    labels: {role: backend}\n    colour: red", "nodes[0].colour", "colour: red", "unknown field `colour`");
    rejects("announce:\n  holdTime: 900ms", "announce:\n  holdTime: 900ms\n  holdtime: 1s", "announce.holdtime", "holdtime: 1s", "unknown field `holdtime`");
    rejects("      fall: 3", "      fall: 3\n      retries: 3", "services[0].healthCheck.retries", "retries: 3", "unknown field `retries`");
}

#[test]
fn malformed_values_name_their_field() {
    rejects("address: 198.18.0.12", "address: 198.18.0.300", "nodes[0].address", "198.18.0.300", "invalid IP address syntax");
    rejects("address: 198.18.0.12", "address: 2001:2::zz", "nodes[0].address", "2001:2::zz", "invalid IP address syntax");
    rejects("mac: \"02:00:00:00:00:11\"", "mac: \"02:00:00:00:11\"", "nodes[1].mac", "02:00:00:00:11", "is not a MAC address");
    rejects("198.18.1.16/30", "198.18.1.17/30", "pools[0].addresses[1]", "198.18.1.17/30", "has host bits set; did you mean 198.18.1.16/30?");
    rejects("198.18.1.20-198.18.1.22", "198.18.1.22-198.18.1.20", "pools[0].addresses[2]", "198.18.1.22-198.18.1.20", "ends before it starts");
    // IPv6 entries are held (neighbour discovery): a pool is counted before it is expanded.
    rejects("198.18.1.20-198.18.1.22", "2001:2::/64", "pools[0].addresses", "addresses: [198.18.1.10", "all pools together exceed 4096 addresses");
    rejects("198.18.1.20-198.18.1.22", "198.18.1.20..22", "pools[0].addresses[2]", "198.18.1.20..22", "is not an IPv4 or IPv6 address, CIDR");
    rejects("protocol: udp", "protocol: sctp", "services[1].protocol", "sctp", "unknown variant `sctp`");
    rejects("interval: 200ms", "interval: 200 parsecs", "services[0].healthCheck.interval", "parsecs", "expected a duration");
    rejects("rise: 2", "rise: -2", "services[0].healthCheck.rise", "rise: -2", "invalid type: integer `-2`, expected u32");
    rejects("ports: [53]", "ports: [70000]", "services[1].ports[0]", "70000", "invalid value");
}

#[test]
fn missing_required_fields() {
    rejects("  - name: n1\n    address: 198.18.0.11\n", "  - name: n1\n", "nodes[1]", "  - name: n1", "missing field `address`");
    rejects("    ports: [53]\n", "", "services[1]", "name: dns", "missing field `ports`");
}

#[test]
fn node_errors() {
    rejects("name: n2", "name: n1", "nodes[1].name", "name: n1\n    address: 198.18.0.11", "node \"n1\" is already defined at nodes[0]");
    rejects(
        "address: 198.18.0.11",
        "address: 198.18.0.12",
        "nodes[1].address",
        "address: 198.18.0.12\n    mac",
        "198.18.0.12 is already the address of nodes[0]",
    );
    rejects("name: n2", "name: \"\"", "nodes[0].name", "name: \"\"", "must not be empty");
    rejects("address: 198.18.0.12", "address: \"fe80::12\"", "nodes[0].address", "fe80::12", "fe80::12 is link-local (fe80::/10)");
    rejects("address: 198.18.0.12", "address: \"::\"", "nodes[0].address", "address: \"::\"", ":: is not a node's address");
    rejects("address: 198.18.0.12", "address: 0.0.0.0", "nodes[0].address", "0.0.0.0", "0.0.0.0 is not a node's address");
    rejects("address: 198.18.0.12", "address: \"ff02::1\"", "nodes[0].address", "ff02::1", "ff02::1 is not a node's address");
    let err = parse("nodes: []\n").unwrap_err();
    assert_eq!((err.path.as_str(), err.message.as_str()), ("nodes", "at least one node is needed"));
}

#[test]
fn pool_errors() {
    rejects(
        "excludedIPs: [198.18.1.17]",
        "excludedIPs: [198.18.1.99]",
        "pools[0].excludedIPs[0]",
        "198.18.1.99",
        "198.18.1.99 is not in this pool's addresses",
    );
    rejects(
        "addresses: [198.18.1.10, 198.18.1.16/30, 198.18.1.20-198.18.1.22]\n    excludedIPs: [198.18.1.17]",
        "addresses: [198.18.1.10]\n    excludedIPs: [198.18.1.10]",
        "pools[0].addresses",
        "addresses: [198.18.1.10]",
        "no address left after exclusions",
    );
    rejects("198.18.1.16/30", "198.18.0.0/16", "pools[0].addresses[1]", "198.18.0.0/16", "would exceed 4096 IPv4 addresses");
    let overlap = GOOD.replace("services:", "  - name: other\n    addresses: [198.18.1.21-198.18.1.30]\nservices:");
    let err = parse(&overlap).unwrap_err();
    assert_eq!((err.path.as_str(), err.line), ("pools[1].addresses", Some(super::tests::line_with(&overlap, "[198.18.1.21-"))));
    assert!(err.message.contains("198.18.1.21 is also in pools[0] (\"web\"); pools must not overlap"), "{err}");
}

/// IPv6 nodes, quoted or not, alone or beside IPv4 ones.
#[test]
fn ipv6_node_addresses_are_accepted() {
    let text = GOOD.replacen("address: 198.18.0.12", "address: 2001:2::12", 1).replacen("address: 198.18.0.11", "address: \"2001:2:0::11\"", 1);
    let w = parse(&text).unwrap();
    let addrs: Vec<String> = w.nodes.iter().map(|n| n.addr.to_string()).collect();
    assert_eq!(addrs, ["2001:2::11", "2001:2::12"]);
    assert!(super::warnings(&w).is_empty());
    let mixed = parse(&GOOD.replacen("address: 198.18.0.12", "address: 2001:2::12", 1)).unwrap();
    assert_eq!((mixed.nodes[0].addr.is_ipv4(), mixed.nodes[1].addr.is_ipv6()), (true, true));
    assert_eq!(
        super::warnings(&mixed),
        ["nodes: \"n1\" has an IPv4 address and \"n2\" an IPv6 one: heartbeats do not pass between families, so such nodes count each other dead"]
    );
    // One address spelled two ways is still one node's.
    let twice = text.replacen("\"2001:2:0::11\"", "\"2001:2:0::12\"", 1);
    let err = parse(&twice).unwrap_err();
    assert_eq!((err.path.as_str(), err.line), ("nodes[1].address", Some(line_with(&twice, "2001:2:0::12"))));
    assert!(err.message.contains("2001:2::12 is already the address of nodes[0]"), "{err}");
}

#[test]
fn ipv6_pool_addresses_are_held() {
    let text = GOOD.replacen("198.18.1.20-198.18.1.22]", "198.18.1.20-198.18.1.22, 2001:2::/126]\n    excludedIPs: [198.18.1.17, 2001:2::2]", 1).replacen(
        "    excludedIPs: [198.18.1.17]\n",
        "",
        1,
    );
    let w = parse(&text).unwrap();
    let v6: Vec<std::net::IpAddr> = w.pools[0].addresses.iter().copied().filter(|a| a.is_ipv6()).collect();
    // The subnet-router anycast address (2001:2::) is never a VIP; 2001:2::2 is excluded.
    assert_eq!(v6, ["2001:2::1".parse::<std::net::IpAddr>().unwrap(), "2001:2::3".parse().unwrap()]);
    assert_eq!(w.pool_of("2001:2::3".parse::<std::net::IpAddr>().unwrap()).map(|p| p.name.as_str()), Some("web"));
}

#[test]
fn service_errors() {
    rejects("vip: 198.18.1.16", "vip: 198.18.1.17", "services[1].vip", "vip: 198.18.1.17", "198.18.1.17 is in no pool");
    rejects("ports: [80, 443]", "ports: []", "services[0].ports", "ports: []", "at least one port");
    rejects("ports: [80, 443]", "ports: [80, 0]", "services[0].ports[1]", "ports: [80, 0]", "port 0 is not a service port");
    rejects("ports: [80, 443]", "ports: [80, 80]", "services[0].ports[1]", "ports: [80, 80]", "198.18.1.10:80/tcp is already served by services[0]");
    // An IPv6 VIP is a VIP like any other: it must be in a pool.
    rejects("vip: 198.18.1.16", "vip: 2001:2::16", "services[1].vip", "vip: 2001:2::16", "2001:2::16 is in no pool");
    rejects("tableSize: 251", "tableSize: 1000", "services[0].tableSize", "tableSize: 1000", "table size 1000 is not a prime between 251 and 131071");
    rejects("tableSize: 251", "tableSize: 131101", "services[0].tableSize", "tableSize: 131101", "table size 131101 is not a prime between 251 and 131071");
    rejects("name: dns", "name: web", "services[1].name", "name: web\n    vip: 198.18.1.16", "service \"web\" is already defined at services[0]");
}

#[test]
fn no_healthy_backend_defaults_to_fail_open() {
    use crate::model::NoHealthyBackend;
    assert_eq!(parse(GOOD).unwrap().services[0].no_healthy_backend, NoHealthyBackend::FailOpen);
    let w = parse(&GOOD.replacen("tableSize: 251", "tableSize: 251\n    noHealthyBackend: Drop", 1)).unwrap();
    assert_eq!(w.services[0].no_healthy_backend, NoHealthyBackend::Drop);
    rejects("tableSize: 251", "tableSize: 251\n    noHealthyBackend: Close", "services[0].noHealthyBackend", "Close", "unknown variant `Close`");
}

#[test]
fn health_check_errors() {
    rejects("rise: 2", "rise: 0", "services[0].healthCheck.rise", "rise: 0", "must be at least 1");
    rejects("fall: 3", "fall: 0", "services[0].healthCheck.fall", "fall: 0", "must be at least 1");
    rejects("timeout: 100ms", "timeout: 300ms", "services[0].healthCheck.timeout", "timeout: 300ms", "at most the interval");
    rejects("interval: 200ms", "interval: 1ms", "services[0].healthCheck.interval", "interval: 1ms", "at least 10ms");
    rejects("path: /healthz", "path: healthz", "services[0].healthCheck.path", "path: healthz", "not an absolute URL path");
    rejects("type: http", "type: tcp", "services[0].healthCheck.path", "path: /healthz", "a path only applies to type: http");
    rejects("type: http", "type: icmp", "services[0].healthCheck.type", "icmp", "unknown variant `icmp`");
}

#[test]
fn announce_errors() {
    rejects("holdTime: 900ms", "holdTime: 50ms", "announce.holdTime", "holdTime: 50ms", "at least 100ms");
    rejects("holdTime: 900ms", "holdTime: 900ms\n  garpRefresh: 0s", "announce.garpRefresh", "garpRefresh: 0s", "at least 1s");
}

#[test]
fn failover_errors() {
    rejects("deadAfter: 1200ms", "deadAfter: 1100ms", "failover.deadAfter", "deadAfter: 1100ms", "must be at least announce.holdTime × 4/3 (1.2s)");
    rejects("deadAfter: 1200ms", "deadAfter: 250ms", "failover.deadAfter", "deadAfter: 250ms", "must be at least 3 heartbeat intervals (300ms)");
    rejects("heartbeatInterval: 100ms", "heartbeatInterval: 1ms", "failover.heartbeatInterval", "heartbeatInterval: 1ms", "at least 5ms");
    rejects("heartbeatInterval: 100ms", "heartbeatInterval: 100ms\n  heartbeatPort: 0", "failover.heartbeatPort", "heartbeatPort: 0", "port 0");
    let w = parse(GOOD).unwrap();
    assert_eq!((w.failover.heartbeat_port, w.failover.dead_after), (7473, Duration::from_millis(1200)));
}

#[test]
fn not_yaml_at_all() {
    let err = parse("nodes: [\n").unwrap_err();
    assert!(err.line.is_some(), "{err}");
    let err = parse("- just\n- a list\n").unwrap_err();
    assert!(err.message.contains("expected struct File"), "{err}");
}

#[test]
fn pool_announce_mode_and_gratuitous_arp() {
    let w = parse(GOOD).unwrap();
    assert_eq!((w.pools[0].announce, w.pools[0].garp), (crate::model::AnnounceMode::Arp, None), "defaults");
    let vip: Ipv4Addr = "198.18.1.10".parse().unwrap();
    assert_eq!(w.garp(vip), crate::model::Garp::default(), "a pool without settings uses announce's");
    let text =
        GOOD.replacen("    nodeSelector: {role: lb}", "    nodeSelector: {role: lb}\n    announce: lo\n    gratuitousArp: {count: 5, interval: 20ms}", 1);
    let w = parse(&text).unwrap();
    assert_eq!(w.announce_mode(vip), crate::model::AnnounceMode::Lo);
    let g = w.garp(vip);
    assert_eq!((g.count, g.interval, g.refresh), (5, Duration::from_millis(20), Duration::from_secs(30)), "unset keys default");
    assert_eq!(w.announce_mode("198.18.9.9".parse::<Ipv4Addr>().unwrap()), crate::model::AnnounceMode::Arp, "outside every pool");
    assert_eq!(w.pools[0].distribution, crate::model::Distribution::One, "one holder per VIP by default");
    let all = GOOD.replacen("    nodeSelector: {role: lb}", "    nodeSelector: {role: lb}\n    announce: lo\n    distribution: all", 1);
    assert_eq!(parse(&all).unwrap().pools[0].distribution, crate::model::Distribution::All);
    rejects(
        "    nodeSelector: {role: lb}",
        "    nodeSelector: {role: lb}\n    distribution: all",
        "pools[0].distribution",
        "distribution: all",
        "`all` needs `announce: lo`",
    );
}

#[test]
fn pool_announce_errors() {
    let at = "    nodeSelector: {role: lb}";
    rejects(at, &format!("{at}\n    announce: ospf"), "pools[0].announce", "announce: ospf", "unknown variant `ospf`");
    rejects(at, &format!("{at}\n    gratuitousArp: {{count: 0}}"), "pools[0].gratuitousArp.count", "gratuitousArp: {count: 0}", "from 1 to 100");
    rejects(at, &format!("{at}\n    gratuitousArp:\n      refresh: 10ms"), "pools[0].gratuitousArp.refresh", "refresh: 10ms", "at least 1s");
    rejects(at, &format!("{at}\n    gratuitousArp:\n      interval: 0s"), "pools[0].gratuitousArp.interval", "interval: 0s", "from 1ms to 10s");
    rejects(at, &format!("{at}\n    gratuitousArp:\n      every: 1s"), "pools[0].gratuitousArp.every", "every: 1s", "unknown field `every`");
}

#[test]
fn pool_interfaces() {
    assert!(parse(GOOD).unwrap().pools[0].interfaces.is_empty(), "default: none (chosen by address)");
    let at = "    nodeSelector: {role: lb}";
    let w = parse(&GOOD.replacen(at, &format!("{at}\n    interfaces: [eth0, ens3, eth0.100, enp0s31f6]"), 1)).unwrap();
    assert_eq!(w.pools[0].interfaces, ["eth0", "ens3", "eth0.100", "enp0s31f6"]);
    // 15 bytes is the longest name the kernel takes.
    let w = parse(&GOOD.replacen(at, &format!("{at}\n    interfaces: [abcdefghijklmno]"), 1)).unwrap();
    assert_eq!(w.pools[0].interfaces, ["abcdefghijklmno"]);
}

#[test]
fn pool_interface_errors() {
    let at = "    nodeSelector: {role: lb}";
    let bad = |list: &str, path: &str, msg: &str| {
        let line = format!("interfaces: {list}");
        rejects(at, &format!("{at}\n    {line}"), path, &line, msg)
    };
    bad("[eth0, \"\"]", "pools[0].interfaces[1]", "\"\" is not an interface name: 1 to 15 bytes");
    bad("[abcdefghijklmnop]", "pools[0].interfaces[0]", "\"abcdefghijklmnop\" is not an interface name: 1 to 15 bytes");
    // 8 characters but 16 bytes: the kernel counts bytes.
    bad("[éééééééé]", "pools[0].interfaces[0]", "1 to 15 bytes");
    bad("[eth0/1]", "pools[0].interfaces[0]", "it contains '/'");
    bad("[\"eth 0\"]", "pools[0].interfaces[0]", "it contains ' '");
    bad("[\"eth0\\t\"]", "pools[0].interfaces[0]", "it contains '\\t'");
    bad("[\"eth0:1\"]", "pools[0].interfaces[0]", "it contains ':'");
    bad("[.]", "pools[0].interfaces[0]", "\".\" is not an interface name");
    bad("[eth0, \"..\"]", "pools[0].interfaces[1]", "\"..\" is not an interface name");
    bad("[eth0, ens3, eth0]", "pools[0].interfaces[2]", "\"eth0\" is already listed at pools[0].interfaces[0]");
    bad("eth0", "pools[0].interfaces", "invalid type: string \"eth0\", expected a sequence");
    // The second pool's path.
    let two = GOOD.replacen("services:", "  - name: other\n    addresses: [198.18.2.1]\n    interfaces: [eth1, eth1]\nservices:", 1);
    let err = parse(&two).unwrap_err();
    assert_eq!((err.path.as_str(), err.line), ("pools[1].interfaces[1]", Some(line_with(&two, "interfaces: [eth1, eth1]"))), "{err}");
}

#[test]
fn pool_vlan() {
    assert_eq!(parse(GOOD).unwrap().pools[0].vlan, None, "default: untagged");
    let at = "    nodeSelector: {role: lb}";
    for v in [1u16, 30, 4094] {
        assert_eq!(parse(&GOOD.replacen(at, &format!("{at}\n    vlan: {v}"), 1)).unwrap().pools[0].vlan, Some(v));
    }
    rejects(at, &format!("{at}\n    vlan: 0"), "pools[0].vlan", "vlan: 0", "0 is not a VLAN id: 1 to 4094");
    rejects(at, &format!("{at}\n    vlan: 4095"), "pools[0].vlan", "vlan: 4095", "4095 is not a VLAN id: 1 to 4094");
}

/// `GOOD` with its pool `announce: bgp` (communities on its routes) and a `bgp`
/// section: two peers, one with BFD and timers, one for nodes labelled lb.
const BGP_POOL: &str = "    nodeSelector: {role: lb}\n    announce: bgp\n    bgp: {communities: [\"64512:100\"], localPref: 200}";
const BGP: &str = "announce:\n  holdTime: 900ms\nbgp:\n  myASN: 64513\n  bfdProfiles:\n    - name: fast\n      detectMultiplier: 4\n  peers:\n    - address: 198.18.0.1\n      asn: 64512\n      holdTime: 3s\n      keepaliveTime: 1s\n      bfdProfile: fast\n    - address: 198.18.0.2\n      asn: 64512\n      nodeSelector: {role: lb}\n";

fn with_bgp(pool: &str, section: &str) -> String {
    GOOD.replacen("    nodeSelector: {role: lb}", pool, 1).replacen("announce:\n  holdTime: 900ms\n", section, 1)
}

#[test]
fn a_bgp_pool_takes_its_sessions_from_the_bgp_section() {
    let w = parse(&with_bgp(BGP_POOL, BGP)).unwrap();
    let vip: std::net::IpAddr = "198.18.1.10".parse().unwrap();
    assert_eq!(w.announce_mode(vip), crate::model::AnnounceMode::Bgp);
    assert_eq!(w.pools[0].bgp.communities, ["64512:100"]);
    assert_eq!(w.pools[0].bgp.local_pref, Some(200));
    let b = w.bgp.as_ref().unwrap();
    assert!(!b.graceful_restart, "no graceful restart by default");
    let p0 = &b.sessions[0].peer;
    assert_eq!((p0.asn, p0.my_asn, p0.hold_time, p0.keepalive_time), (64512, 64513, Some(Duration::from_secs(3)), Some(Duration::from_secs(1))));
    let bfd = p0.bfd.as_ref().unwrap();
    assert_eq!((bfd.receive_interval, bfd.detect_multiplier), (Duration::from_millis(300), 4), "FRR's interval by default");
    // n1 (role lb) opens both sessions, n2 only the first; every bgp pool VIP n1
    // holds is one route, with the pool's communities.
    let held = [vip].into_iter().collect();
    let n1 = crate::bgp::speaker(&w, "n1", &held).unwrap();
    assert_eq!(n1.peers.len(), 2);
    assert_eq!(n1.router_id, Ipv4Addr::new(198, 18, 0, 11));
    assert_eq!(n1.advertisements[0].addresses, [vip]);
    assert_eq!(n1.advertisements[0].attributes.local_pref, Some(200));
    assert_eq!(crate::bgp::speaker(&w, "n2", &Default::default()).unwrap().peers.len(), 1);
    assert!(crate::bgp::speaker(&w, "nobody", &held).is_none());
}

#[test]
fn bgp_errors_name_the_field() {
    let bgp_rejects = |pool: &str, section: &str, path: &str, msg: &str| {
        let err = parse(&with_bgp(pool, section)).expect_err(&format!("accepted {section}"));
        assert_eq!(err.path, path, "{err}");
        assert!(err.message.contains(msg), "{err:?} lacks {msg:?}");
        assert!(err.line.is_some(), "{err}");
    };
    let none = "announce:\n  holdTime: 900ms\n";
    bgp_rejects(BGP_POOL, none, "pools[0].announce", "top-level `bgp` section");
    bgp_rejects("    nodeSelector: {role: lb}\n    bgp: {localPref: 1}", BGP, "pools[0].bgp", "only for `announce: bgp`");
    bgp_rejects(&BGP_POOL.replace("64512:100", "64512:65536"), BGP, "pools[0].bgp.communities", "\"64512:65536\" is not a community");
    bgp_rejects(BGP_POOL, &BGP.replace("bfdProfile: fast", "bfdProfile: slow"), "bgp.peers[0].bfdProfile", "no profile \"slow\"");
    bgp_rejects(BGP_POOL, &BGP.replace("holdTime: 3s", "holdTime: 2s"), "bgp.peers[0].holdTime", "at least 3 s");
    bgp_rejects(BGP_POOL, &BGP.replace("198.18.0.2", "198.18.0.1"), "bgp.peers[1].address", "given twice");
    bgp_rejects(BGP_POOL, &BGP.replace("detectMultiplier: 4", "detectMultiplier: 1"), "bgp.peers[0].bfdProfile", "detectMultiplier");
    bgp_rejects(
        BGP_POOL,
        &BGP.replace("      asn: 64512\n      nodeSelector", "      asm: 64512\n      nodeSelector"),
        "bgp.peers[1].asm",
        "unknown field `asm`",
    );
}
