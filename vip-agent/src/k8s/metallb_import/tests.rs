//! The inputs cover the fields MetalLB's documentation shows in its examples
//! (written here, with addresses of 198.18.0.0/15).
use std::{collections::BTreeMap, net::Ipv4Addr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::*;
use crate::{
    k8s::{
        allocate::label_selector_matches,
        crd::{validate, VipPoolSpec},
    },
    model::{AnnounceMode, Distribution},
};

fn run(yaml: &str) -> Import {
    import(&documents(yaml).unwrap())
}

fn pool<'a>(i: &'a Import, name: &str) -> &'a VipPoolSpec {
    &i.pools.iter().find(|p| p.metadata.name.as_deref() == Some(name)).unwrap_or_else(|| panic!("no VipPool {name}: {:?}", i.pools)).spec
}

/// Warnings about `object` (e.g. "IPAddressPool metallb-system/gold") at `field`.
fn warned<'a>(i: &'a Import, object: &str, field: &str) -> Vec<&'a str> {
    i.warnings.iter().filter(|w| w.object == object && w.field == field).map(|w| w.message.as_str()).collect()
}

fn ip_pool(name: &str, spec: &str) -> String {
    format!("apiVersion: metallb.io/v1beta1\nkind: IPAddressPool\nmetadata: {{name: {name}, namespace: metallb-system}}\nspec:\n{spec}\n---\n")
}

/// What MetalLB hands out, computed here from the entries' bounds.
fn metallb_set(bounds: &[(&str, &str)], avoid_buggy: bool) -> Vec<Ipv4Addr> {
    let mut v: Vec<Ipv4Addr> = bounds
        .iter()
        .flat_map(|(lo, hi)| u32::from(lo.parse::<Ipv4Addr>().unwrap())..=u32::from(hi.parse::<Ipv4Addr>().unwrap()))
        .map(Ipv4Addr::from)
        .filter(|a| !avoid_buggy || (a.octets()[3] != 0 && a.octets()[3] != 255))
        .collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn a_pool_hands_out_exactly_the_addresses_metallb_did() {
    // (the pool's spec, the bounds of what MetalLB hands out, avoidBuggyIPs)
    type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], bool);
    let cases: [Case; 8] = [
        // A CIDR without avoidBuggyIPs: MetalLB hands out its network and broadcast addresses too.
        ("addresses: [198.18.20.64/30]", &[("198.18.20.64", "198.18.20.67")], false),
        ("addresses: [198.18.10.0/24]", &[("198.18.10.0", "198.18.10.255")], false),
        ("addresses: [198.18.10.0/24]\n  avoidBuggyIPs: true", &[("198.18.10.0", "198.18.10.255")], true),
        // Across a /23, .255 and .0 in the middle are avoided too.
        ("addresses: [198.18.12.0/23]\n  avoidBuggyIPs: true", &[("198.18.12.0", "198.18.13.255")], true),
        ("addresses: [\"198.18.11.250 - 198.18.12.4\"]\n  avoidBuggyIPs: true", &[("198.18.11.250", "198.18.12.4")], true),
        ("addresses: [198.18.11.250-198.18.12.4]", &[("198.18.11.250", "198.18.12.4")], false),
        // Host bits: MetalLB takes the whole block.
        (
            "addresses: [198.18.30.5/29, 198.18.31.7/32, 198.18.31.9]",
            &[("198.18.30.0", "198.18.30.7"), ("198.18.31.7", "198.18.31.7"), ("198.18.31.9", "198.18.31.9")],
            false,
        ),
        ("addresses: [198.18.40.0/31, 198.18.40.8/30]\n  avoidBuggyIPs: true", &[("198.18.40.0", "198.18.40.1"), ("198.18.40.8", "198.18.40.11")], true),
    ];
    for (spec, bounds, avoid) in cases {
        let i = run(&(ip_pool("p", &format!("  {spec}")) + &l2("all", "  {}")));
        assert!(i.warnings.is_empty(), "{spec}: {:?}", i.warnings);
        let got = validate(pool(&i, "p"), 80).unwrap_or_else(|e| panic!("{spec}: {e}")).addresses.v4().collect::<Vec<_>>();
        assert_eq!(got, metallb_set(bounds, avoid), "{spec}: {:?}", pool(&i, "p"));
    }
    // The flags that say it: vip's default already skips a /24's .0 and .255.
    let i = run(&ip_pool("p", "  addresses: [198.18.10.0/24]\n  avoidBuggyIPs: true"));
    assert_eq!((pool(&i, "p").include_network_and_broadcast, pool(&i, "p").excluded_ips.len()), (false, 0));
    let i = run(&ip_pool("p", "  addresses: [198.18.12.0/23]\n  avoidBuggyIPs: true"));
    assert_eq!(pool(&i, "p").excluded_ips, ["198.18.12.255", "198.18.13.0"]);
    let i = run(&ip_pool("p", "  addresses: [198.18.10.0/24]"));
    assert!(pool(&i, "p").include_network_and_broadcast);
    assert_eq!(pool(&i, "p").addresses, ["198.18.10.0/24"]);
}

/// The addresses a pool's VipPool hands out, as ranges (`a-b`, or `a` alone).
fn handed_out(i: &Import, name: &str) -> Vec<String> {
    let v = validate(pool(i, name), 80).unwrap_or_else(|e| panic!("{name}: {e}"));
    v.addresses.ranges().map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect()
}

#[test]
fn an_ipv6_cidr_is_written_as_a_range_that_keeps_its_first_address() {
    // MetalLB hands out an IPv6 CIDR from its first address on (the network
    // address, a VipPool CIDR's subnet-router anycast address); host bits are
    // cleared as MetalLB's parser clears them.
    for (entry, range) in [
        ("2001:2::/124", "2001:2::-2001:2::f"),
        ("2001:2:0:1::5/120", "2001:2:0:1::-2001:2:0:1::ff"),
        ("2001:2:0:2::/64", "2001:2:0:2::-2001:2:0:2:ffff:ffff:ffff:ffff"),
    ] {
        let i = run(&(ip_pool("p", &format!("  addresses: [\"{entry}\"]")) + &l2("all", "  {}")));
        assert_eq!(pool(&i, "p").addresses, [range], "{entry}");
        assert_eq!(handed_out(&i, "p"), [range], "{entry}: every address, the first included");
        let first = range.split('-').next().unwrap();
        assert_eq!(
            warned(&i, "IPAddressPool metallb-system/p", "spec.addresses[0]"),
            [format!(
                "{entry:?} written as the range {range}: MetalLB hands out an IPv6 CIDR's first address ({first}) too, which a VipPool \
                     leaves out of a CIDR (the subnet-router anycast address); the range keeps it for the Service MetalLB may have given it"
            )]
        );
        assert_eq!(i.warnings.len(), 1, "{:?}", i.warnings);
    }
}

#[test]
fn an_ipv6_range_a_128_and_a_127_are_taken_as_written() {
    let i = run(&(ip_pool("p", "  addresses: [\"2001:2::10 - 2001:2::1f\", \"2001:2::100/128\", \"2001:2::200/127\", \"2001:2::300\"]") + &l2("all", "  {}")));
    assert!(i.warnings.is_empty(), "a /127 and a /128 have no subnet-router anycast address to skip: {:?}", i.warnings);
    assert_eq!(pool(&i, "p").addresses, ["2001:2::10-2001:2::1f", "2001:2::100/128", "2001:2::200/127", "2001:2::300"]);
    assert_eq!(handed_out(&i, "p"), ["2001:2::10-2001:2::1f", "2001:2::100", "2001:2::200-2001:2::201", "2001:2::300"]);
    // avoidBuggyIPs concerns IPv4 only (MetalLB: an IPv4 address ending in .0 or .255).
    let i = run(&ip_pool("p", "  addresses: [\"2001:2::ff00-2001:2::ffff\"]\n  avoidBuggyIPs: true"));
    assert_eq!(pool(&i, "p").excluded_ips, Vec::<String>::new());
    assert_eq!(handed_out(&i, "p"), ["2001:2::ff00-2001:2::ffff"]);
}

#[test]
fn metallbs_sample_pool_keeps_every_address_of_both_families() {
    // MetalLB's documentation's first IPAddressPool, verbatim (as data: no
    // traffic is sent to these addresses).
    let sample = "apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata:
  name: first-pool
  namespace: metallb-system
spec:
  addresses:
  - 192.168.10.0/24
  - 192.168.9.1-192.168.9.5
  - fc00:f853:ccd:e799::/124
---
apiVersion: metallb.io/v1beta1
kind: L2Advertisement
metadata:
  name: example
  namespace: metallb-system
";
    let i = run(sample);
    let p = pool(&i, "first-pool");
    assert_eq!(p.addresses, ["192.168.10.0/24", "192.168.9.1-192.168.9.5", "fc00:f853:ccd:e799::-fc00:f853:ccd:e799::f"]);
    assert!(p.include_network_and_broadcast, "MetalLB hands out 192.168.10.0 and .255 without avoidBuggyIPs");
    assert_eq!(p.excluded_ips, Vec::<String>::new());
    assert_eq!(handed_out(&i, "first-pool"), ["192.168.9.1-192.168.9.5", "192.168.10.0-192.168.10.255", "fc00:f853:ccd:e799::-fc00:f853:ccd:e799::f"]);
    assert_eq!(i.warnings.len(), 1, "the IPv6 CIDR's note only: {:?}", i.warnings);
    assert!(warned(&i, "IPAddressPool metallb-system/first-pool", "spec.addresses[2]")[0]
        .starts_with("\"fc00:f853:ccd:e799::/124\" written as the range fc00:f853:ccd:e799::-fc00:f853:ccd:e799::f"));
    // What MetalLB gives a dual-stack Service first, vip keeps.
    let v = validate(p, 80).unwrap();
    for a in ["192.168.10.0", "fc00:f853:ccd:e799::"] {
        assert!(v.addresses.contains(a.parse().unwrap()), "{a}");
    }
    // avoidBuggyIPs: the IPv4 .0 and .255 go, every IPv6 address stays.
    let i = run(&sample.replace("  - fc00:f853:ccd:e799::/124\n", "  - fc00:f853:ccd:e799::/124\n  avoidBuggyIPs: true\n"));
    let p = pool(&i, "first-pool");
    assert_eq!((p.include_network_and_broadcast, p.excluded_ips.len()), (false, 0), "vip's default skips the /24's .0 and .255");
    assert_eq!(handed_out(&i, "first-pool"), ["192.168.9.1-192.168.9.5", "192.168.10.1-192.168.10.254", "fc00:f853:ccd:e799::-fc00:f853:ccd:e799::f"]);
}

#[test]
fn mixed_families_in_one_pool_and_bad_entries() {
    let i = run(&(ip_pool(
        "dual",
        "  addresses: [198.18.1.0/28, \"2001:2::/124\", \"2001:2::10-2001:2::1f\", nonsense, 7, \"198.18.1.20-2001:2::30\", \"2001:2::40-2001:2::3f\"]",
    ) + &ip_pool("v6", "  addresses: [\"2001:2:0:1::/126\"]")
        + &ip_pool("later", "  addresses: [\"2001:2::18/125\"]")
        + &l2("all", "  {}")));
    let dual = pool(&i, "dual");
    assert_eq!(dual.addresses, ["198.18.1.0/28", "2001:2::-2001:2::f", "2001:2::10-2001:2::1f"]);
    assert!(dual.include_network_and_broadcast, "198.18.1.0 and .15: MetalLB hands them out");
    assert_eq!(handed_out(&i, "dual"), ["198.18.1.0-198.18.1.15", "2001:2::-2001:2::1f"]);
    assert!(warned(&i, "IPAddressPool metallb-system/dual", "spec.addresses[1]")[0].contains("written as the range 2001:2::-2001:2::f"));
    assert!(warned(&i, "IPAddressPool metallb-system/dual", "spec.addresses[2]").is_empty(), "a range is taken as written");
    assert_eq!(
        warned(&i, "IPAddressPool metallb-system/dual", "spec.addresses[3]"),
        ["not imported: \"nonsense\" is not an IPv4 or IPv6 address, CIDR or range"]
    );
    assert_eq!(warned(&i, "IPAddressPool metallb-system/dual", "spec.addresses[4]"), ["not imported: 7 is not a string"]);
    for k in [5, 6] {
        assert!(warned(&i, "IPAddressPool metallb-system/dual", &format!("spec.addresses[{k}]"))[0].contains("is not an IPv4 or IPv6 address"), "{k}");
    }
    // A pool of IPv6 only is a VipPool too.
    assert_eq!(handed_out(&i, "v6"), ["2001:2:0:1::-2001:2:0:1::3"]);
    // Overlaps across families' entries are found as for IPv4 (MetalLB refuses them).
    let w = warned(&i, "IPAddressPool metallb-system/later", "spec.addresses");
    assert!(w.len() == 1 && w[0].starts_with("Overlap: ") && w[0].contains("2001:2::18 is also in VipPool \"dual\""), "{w:?}");
    assert_eq!(i.pools.len(), 3);
    // A pool whose every entry is refused is not written.
    let i = run(&ip_pool("none", "  addresses: [nonsense]"));
    assert!(i.pools.is_empty());
    assert_eq!(warned(&i, "IPAddressPool metallb-system/none", "spec.addresses"), ["not imported: no address; no VipPool written"]);
}

#[test]
fn service_allocation_becomes_the_pools_selectors() {
    let i = run(&(ip_pool("first", "  addresses: [198.18.2.0/24]\n  autoAssign: false\n  serviceAllocation:\n    priority: 50\n    namespaces: [team-a, team-b]\n    serviceSelectors:\n    - matchExpressions:\n      - {key: app, operator: In, values: [web]}")
            + &ip_pool("merged", "  addresses: [198.18.3.0/24]\n  serviceAllocation:\n    namespaces: [team-a]\n    namespaceSelectors:\n    - matchLabels: {kubernetes.io/metadata.name: team-c}\n    serviceSelectors:\n    - matchLabels: {app: web}\n    - matchExpressions: [{key: app, operator: In, values: [api, web]}]")
            + &ip_pool("either", "  addresses: [198.18.4.0/24]\n  serviceAllocation:\n    priority: 10\n    namespaces: [team-a]\n    namespaceSelectors:\n    - matchLabels: {foo: bar}\n    serviceSelectors:\n    - matchLabels: {app: web}\n    - {}")
            + &ip_pool("zz-last", "  addresses: [198.18.5.0/24]\n  serviceAllocation:\n    namespaceSelectors:\n    - matchExpressions: [{key: env, operator: NotIn, values: [dev]}]")
            + &l2("all", "  {}")));
    // MetalLB's order: priority (lowest first), pools without one last.
    let names: Vec<&str> = i.pools.iter().map(|p| p.metadata.name.as_deref().unwrap()).collect();
    assert_eq!(names, ["either", "first", "merged", "zz-last"]);
    let labels = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>();
    let admits = |sel: &Option<LabelSelector>, l: &BTreeMap<String, String>| sel.as_ref().is_none_or(|s| label_selector_matches(s, l));

    let first = pool(&i, "first");
    assert!(!first.auto_assign);
    for (ns, want) in [("team-a", true), ("team-b", true), ("team-c", false)] {
        assert_eq!(admits(&first.namespace_selector, &labels(&[(NAMESPACE_NAME_LABEL, ns)])), want, "{ns}");
    }
    assert!(admits(&first.service_selector, &labels(&[("app", "web")])) && !admits(&first.service_selector, &labels(&[("app", "db")])));
    assert!(warned(&i, "IPAddressPool metallb-system/first", "spec.serviceAllocation.priority")[0].starts_with("50: no equivalent"));

    // Alternatives on one key merge: nothing lost, no warning.
    let merged = pool(&i, "merged");
    for (ns, want) in [("team-a", true), ("team-c", true), ("team-b", false)] {
        assert_eq!(admits(&merged.namespace_selector, &labels(&[(NAMESPACE_NAME_LABEL, ns)])), want, "{ns}");
    }
    for (app, want) in [("web", true), ("api", true), ("db", false)] {
        assert_eq!(admits(&merged.service_selector, &labels(&[("app", app)])), want, "{app}");
    }
    assert!(i.warnings.iter().all(|w| w.object != "IPAddressPool metallb-system/merged"), "{:?}", i.warnings);

    // Not mergeable: the first alternative, the others listed. `{}` selects every Service.
    let either = pool(&i, "either");
    assert!(admits(&either.namespace_selector, &labels(&[(NAMESPACE_NAME_LABEL, "team-a")])));
    assert!(!admits(&either.namespace_selector, &labels(&[(NAMESPACE_NAME_LABEL, "team-x"), ("foo", "bar")])), "narrowed to the namespaces");
    let w = warned(&i, "IPAddressPool metallb-system/either", "spec.serviceAllocation.namespaceSelectors[0]");
    assert!(w.len() == 1 && w[0].contains("admits only namespaces matching spec.serviceAllocation.namespaces"), "{w:?}");
    assert_eq!(either.service_selector, None);

    let last = pool(&i, "zz-last");
    assert!(admits(&last.namespace_selector, &labels(&[("env", "prod")])) && !admits(&last.namespace_selector, &labels(&[("env", "dev")])));
}

const POOLS: &str = "apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata: {name: first-pool, namespace: metallb-system, labels: {zone: east}}
spec: {addresses: [198.18.6.10-198.18.6.20]}
---
apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata: {name: second-pool, namespace: metallb-system, labels: {zone: west}}
spec: {addresses: [198.18.7.10-198.18.7.20]}
---
apiVersion: metallb.io/v1beta1
kind: IPAddressPool
metadata: {name: third-pool, namespace: metallb-system}
spec: {addresses: [198.18.8.10-198.18.8.20]}
---
";

fn l2(name: &str, spec: &str) -> String {
    format!("apiVersion: metallb.io/v1beta1\nkind: L2Advertisement\nmetadata: {{name: {name}, namespace: metallb-system}}\nspec:\n{spec}\n---\n")
}

#[test]
fn l2_advertisements_give_node_selectors_and_interfaces() {
    let i = run(&(POOLS.to_owned()
            + &l2("east", "  ipAddressPoolSelectors: [{matchLabels: {zone: east}}]\n  nodeSelectors:\n  - matchLabels: {kubernetes.io/hostname: node-a}\n  - matchLabels: {kubernetes.io/hostname: node-b}")
            + &l2("west", "  ipAddressPools: [second-pool]\n  nodeSelectors: [{matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [node-c]}]}]\n  interfaces: [eth0, ens3, eth0]")
            + &l2("third", "  ipAddressPools: [third-pool, no-such-pool]\n  nodeSelectors: [{matchExpressions: [{key: edge, operator: Exists}]}]\n  interfaces: [\"bad/name\"]")));
    // first-pool: node-a or node-b in MetalLB; narrowed to node-a, node-b listed.
    assert_eq!(pool(&i, "first-pool").node_selector, BTreeMap::from([("kubernetes.io/hostname".to_owned(), "node-a".to_owned())]));
    let w = warned(&i, "L2Advertisement metallb-system/east", "spec.nodeSelectors[1]");
    assert!(w.len() == 1 && w[0].contains("only nodes labelled kubernetes.io/hostname=node-a hold its VIPs"), "{w:?}");
    assert!(pool(&i, "first-pool").interfaces.is_empty(), "no interfaces: MetalLB's every interface, vip's found one");
    // second-pool: exact.
    let second = pool(&i, "second-pool");
    assert_eq!(second.node_selector, BTreeMap::from([("kubernetes.io/hostname".to_owned(), "node-c".to_owned())]));
    assert_eq!(second.interfaces, ["eth0", "ens3"]);
    assert!(warned(&i, "IPAddressPool metallb-system/second-pool", "")[0].contains("each node answers for the pool on the first of them it has"));
    // third-pool: Exists has no equivalent: every node, said.
    assert!(pool(&i, "third-pool").node_selector.is_empty());
    assert!(warned(&i, "L2Advertisement metallb-system/third", "spec.nodeSelectors[0]")[0].contains("has no equivalent in a VipPool's nodeSelector"));
    assert!(warned(&i, "L2Advertisement metallb-system/third", "spec.interfaces[0]")[0].contains("\"bad/name\" is not an interface name"));
    assert!(pool(&i, "third-pool").interfaces.is_empty());
    assert_eq!(warned(&i, "L2Advertisement metallb-system/third", "spec.ipAddressPools[1]"), ["no IPAddressPool \"no-such-pool\" among the objects read"]);
    assert!(i.pools.iter().all(|p| p.spec.announce == AnnounceMode::Arp));

    // An advertisement naming no pool announces them all; one without node
    // selectors makes every node eligible, whatever another one says.
    let i = run(&(POOLS.to_owned()
        + &l2("all", "  interfaces: [eth1]")
        + &l2("some", "  ipAddressPools: [first-pool]\n  nodeSelectors: [{matchLabels: {rack: r1}}]")));
    assert!(i.warnings.is_empty(), "{:?}", i.warnings);
    for p in &i.pools {
        assert!(p.spec.node_selector.is_empty(), "{p:?}");
    }
    assert!(pool(&i, "first-pool").interfaces.is_empty(), "`some` names no interface: every one");
    assert_eq!(pool(&i, "second-pool").interfaces, ["eth1"]);
    // Equal selectors of two advertisements are one.
    let i = run(&(POOLS.to_owned() + &l2("a", "  nodeSelectors: [{matchLabels: {rack: r1}}]") + &l2("b", "  nodeSelectors: [{matchLabels: {rack: r1}}]")));
    assert!(i.warnings.is_empty(), "{:?}", i.warnings);
    assert_eq!(pool(&i, "third-pool").node_selector, BTreeMap::from([("rack".to_owned(), "r1".to_owned())]));
}

#[test]
fn bgp_and_what_has_no_equivalent_is_listed_never_dropped() {
    let i = run(&(POOLS.to_owned()
        + &l2("l2", "  ipAddressPools: [first-pool]")
        + "apiVersion: metallb.io/v1beta1
kind: BGPAdvertisement
metadata: {name: bgp, namespace: metallb-system}
spec:
  ipAddressPools: [first-pool, second-pool]
  aggregationLength: 32
  localPref: 100
  communities: [\"65535:65282\"]
  peers: [peer-1]
---
apiVersion: metallb.io/v1beta2
kind: BGPPeer
metadata: {name: peer-1, namespace: metallb-system}
spec: {myASN: 64500, peerASN: 64501, peerAddress: 198.18.0.1}
---
apiVersion: metallb.io/v1beta1
kind: Community
metadata: {name: communities, namespace: metallb-system}
spec: {communities: [{name: NO_ADVERTISE, value: \"65535:65282\"}]}
---
apiVersion: metallb.io/v1beta1
kind: BFDProfile
metadata: {name: fast, namespace: metallb-system}
spec: {receiveInterval: 380}
---
apiVersion: metallb.io/v1beta1
kind: ServiceL2Status
metadata: {name: l2-abc, namespace: metallb-system}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: config, namespace: metallb-system}
"));
    assert_eq!(pool(&i, "first-pool").announce, AnnounceMode::Arp, "L2 and BGP: answered over ARP");
    assert_eq!(pool(&i, "second-pool").announce, AnnounceMode::Lo, "BGP only: for a routing daemon");
    assert_eq!(pool(&i, "second-pool").distribution, Distribution::All, "BGP only: from every node, as MetalLB's speakers announce it");
    assert_eq!(pool(&i, "third-pool").announce, AnnounceMode::Lo, "announced by nothing");
    assert_eq!(pool(&i, "first-pool").distribution, Distribution::One, "answered over ARP: one node per VIP");
    let bgp = warned(&i, "BGPAdvertisement metallb-system/bgp", "");
    assert!(
        bgp.len() == 1
            && bgp[0].contains("aggregationLength, localPref, communities, peers")
            && bgp[0].contains("first-pool also in an L2Advertisement")
            && bgp[0].contains("second-pool: `announce: lo`"),
        "{bgp:?}"
    );
    assert!(warned(&i, "IPAddressPool metallb-system/third-pool", "")[0].starts_with("no L2Advertisement or BGPAdvertisement selects it"));
    for o in ["BGPPeer metallb-system/peer-1", "Community metallb-system/communities", "BFDProfile metallb-system/fast"] {
        assert!(warned(&i, o, "")[0].starts_with("not imported: vip's BGP speaker (announce: bgp) is file mode only so far"), "{o}: {:?}", i.warnings);
    }
    assert_eq!(warned(&i, "ConfigMap metallb-system/config", ""), ["skipped: not a MetalLB object (v1 ConfigMap)"]);
    assert!(i.warnings.iter().all(|w| !w.object.contains("ServiceL2Status")), "MetalLB's status objects are not configuration");
    assert_eq!((i.objects, i.warnings.len()), (8, 6), "{:#?}", i.warnings);
}

#[test]
fn unknown_fields_duplicates_overlaps_and_lists() {
    // `kubectl get -o yaml` gives a List; names are cluster-wide in vip.
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "metallb.io/v1beta1", "kind": "IPAddressPool", "metadata": {"name": "a", "namespace": "metallb-system"},
         "spec": {"addresses": ["198.18.9.0/28"], "futureField": 1, "serviceAllocation": {"priority": 1, "nodeAffinity": "x"}}},
        {"apiVersion": "metallb.io/v1beta1", "kind": "IPAddressPool", "metadata": {"name": "a", "namespace": "other"}, "spec": {"addresses": ["198.18.9.64/28"]}},
        {"apiVersion": "metallb.io/v1beta1", "kind": "IPAddressPool", "metadata": {"name": "b", "namespace": "metallb-system"}, "spec": {"addresses": ["198.18.9.8-198.18.9.20"]}},
        {"apiVersion": "metallb.io/v1beta1", "kind": "L2Advertisement", "metadata": {"name": "l2", "namespace": "metallb-system"}, "spec": {"nodeSelectors": [{"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}], "lbClass": "x"}},
    ]});
    let i = import(&[list]);
    assert_eq!(i.objects, 4);
    assert_eq!(warned(&i, "IPAddressPool metallb-system/a", "spec.futureField"), ["not imported: a field this import does not know"]);
    assert_eq!(warned(&i, "IPAddressPool metallb-system/a", "spec.serviceAllocation.nodeAffinity"), ["not imported: a field this import does not know"]);
    assert!(warned(&i, "IPAddressPool other/a", "metadata.name")[0].contains("comes from IPAddressPool metallb-system/a already"));
    assert_eq!(warned(&i, "L2Advertisement metallb-system/l2", "spec.lbClass"), ["not imported: a field this import does not know"]);
    assert!(warned(&i, "L2Advertisement metallb-system/l2", "spec.nodeSelectors[0]")[0].contains("operator \"Gt\""));
    // a and b overlap (MetalLB refuses that): b, the later by name, is the one vip leaves out.
    let w = warned(&i, "IPAddressPool metallb-system/b", "spec.addresses");
    assert!(w.len() == 1 && w[0].starts_with("Overlap: ") && w[0].contains("is also in VipPool \"a\""), "{w:?}");
    assert_eq!(i.pools.len(), 2);
}

#[test]
fn documents_and_yaml_out() {
    assert!(documents("a: [").is_err());
    assert_eq!(documents("---\n---\na: 1\n---\n").unwrap().len(), 1);
    let i = run(&(POOLS.to_owned() + &l2("l2", "  interfaces: [eth0]")));
    let text = to_yaml(&i);
    assert!(text.starts_with("# 3 VipPool(s) imported from MetalLB's configuration"), "{text}");
    assert!(!text.contains("excludedIPs") && !text.contains("announce") && !text.contains("status"), "defaults left out:\n{text}");
    let back: Vec<VipPool> = documents(&text).unwrap().into_iter().map(|v| serde_json::from_value(v).unwrap()).collect();
    let names_specs = |ps: &[VipPool]| ps.iter().map(|p| (p.metadata.name.clone(), p.spec.clone())).collect::<Vec<_>>();
    assert_eq!(names_specs(&back), names_specs(&i.pools));
    assert_eq!(
        Warning { object: "L2Advertisement ns/x".into(), field: "spec.y".into(), message: "m".into() }.to_string(),
        "# warning: L2Advertisement ns/x: spec.y: m"
    );
}
