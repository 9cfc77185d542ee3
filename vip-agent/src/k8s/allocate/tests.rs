//! The allocator's decisions, table-driven where the cases are many.
use k8s_openapi::{
    api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, ServicePort, ServiceSpec, ServiceStatus},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};

use super::*;

fn set(ranges: &[(&str, &str)]) -> AddrSet {
    let mut s = AddrSet::default();
    for (a, b) in ranges {
        s.insert_range(a.parse().unwrap(), b.parse().unwrap());
    }
    s
}

fn pool(name: &str, first: u8, n: u8, auto: bool) -> PoolView {
    PoolView {
        name: name.into(),
        addresses: set(&[(&format!("198.18.1.{first}"), &format!("198.18.1.{}", first + n - 1))]),
        auto_assign: auto,
        service_selector: None,
        namespace_selector: None,
    }
}

fn svc(name: &str, t: i64, ports: &[i32]) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            creation_timestamp: Some(Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + t).unwrap())),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            ports: Some(ports.iter().map(|&p| ServicePort { port: p, protocol: Some("TCP".into()), ..Default::default() }).collect()),
            ..Default::default()
        }),
        status: None,
    }
}

fn with_ip(mut s: Service, ip: &str) -> Service {
    s.status = Some(ServiceStatus {
        load_balancer: Some(LoadBalancerStatus { ingress: Some(vec![LoadBalancerIngress { ip: Some(ip.into()), ..Default::default() }]) }),
        ..Default::default()
    });
    s
}

fn annotate(mut s: Service, k: &str, v: &str) -> Service {
    s.metadata.annotations.get_or_insert_with(Default::default).insert(k.into(), v.into());
    s
}

fn alloc(d: &[Decision]) -> Vec<(String, String)> {
    d.iter()
        .filter_map(|x| match x {
            Decision::Allocate { service, addr, .. } => Some((service.clone(), addr.to_string())),
            _ => None,
        })
        .collect()
}

#[test]
fn lowest_free_in_creation_order_and_existing_kept() {
    let pools = [pool("a", 10, 3, true)];
    let svcs = [svc("late", 5, &[80]), with_ip(svc("old", 9, &[80]), "198.18.1.10"), svc("early", 1, &[80])];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    assert_eq!(alloc(&d), [("default/early".into(), "198.18.1.11".into()), ("default/late".into(), "198.18.1.12".into())]);
    // Order of the input does not matter.
    let rev: Vec<Service> = svcs.iter().rev().cloned().collect();
    assert_eq!(allocate(&pools, &rev, &BTreeMap::new()), d);
}

#[test]
fn an_address_still_held_is_never_given_to_a_service_earlier_in_the_order() {
    // "early" lost its address (its pool went); "late" holds the pool's only one.
    let pools = [pool("a", 30, 1, true)];
    let svcs = [with_ip(svc("early", 0, &[80]), "198.18.1.12"), with_ip(svc("late", 1, &[80]), "198.18.1.30")];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    assert!(alloc(&d).is_empty(), "{d:?}");
    assert!(d.iter().any(|x| matches!(x, Decision::Release { service, .. } if service == "default/early")), "{d:?}");
    assert!(!d.iter().any(|x| matches!(x, Decision::Release { service, .. } if service == "default/late")), "{d:?}");
    assert!(d.iter().any(|x| matches!(x, Decision::Pending { service, .. } if service == "default/early")), "{d:?}");
    // An address asked for is no different.
    let svcs = [annotate(svcs[0].clone(), ANNOTATION_ADDRESS, "198.18.1.30"), svcs[1].clone()];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    assert!(alloc(&d).is_empty(), "{d:?}");
    assert!(!d.iter().any(|x| matches!(x, Decision::Release { service, .. } if service == "default/late")), "{d:?}");
    // Nor is one of a family: "early" holds its IPv4 address and lacks its IPv6
    // one, "late" holds the IPv6 pool's lowest.
    let v6 = PoolView { addresses: set(&[("2001:2::1", "2001:2::2")]), ..pool("v6", 0, 1, true) };
    let dual = |s| families(s, "RequireDualStack", &["IPv4", "IPv6"]);
    let svcs = [dual(with_ip(svc("early", 0, &[80]), "198.18.1.30")), families(with_ip(svc("late", 1, &[80]), "2001:2::1"), "SingleStack", &["IPv6"])];
    let d = allocate(&[pools[0].clone(), v6], &svcs, &BTreeMap::new());
    assert_eq!(alloc(&d), [("default/early".into(), "2001:2::2".into())], "{d:?}");
    assert!(!d.iter().any(|x| matches!(x, Decision::Release { .. })), "{d:?}");
}

#[test]
fn exhausted_pool_and_requests() {
    let pools = [pool("a", 10, 1, true), pool("manual", 20, 2, false)];
    let svcs = [
        with_ip(svc("has", 0, &[80]), "198.18.1.10"),
        svc("none-left", 1, &[80]),
        annotate(svc("asks", 2, &[80]), ANNOTATION_ADDRESS, "198.18.1.21"),
        annotate(svc("asks-taken", 3, &[80]), ANNOTATION_ADDRESS, "198.18.1.10"),
        annotate(svc("asks-outside", 4, &[80]), ANNOTATION_ADDRESS, "198.18.9.9"),
    ];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    assert_eq!(alloc(&d), [("default/asks".into(), "198.18.1.21".into())], "manual pool only by request: {d:?}");
    let pending: Vec<String> = d.iter().filter_map(|x| if let Decision::Pending { why, .. } = x { Some(why.to_string()) } else { None }).collect();
    assert_eq!(pending.len(), 3, "{d:?}");
    assert!(pending[0].contains("no VipPool with autoAssign"));
    assert!(pending[1].contains("in use by another Service"));
    assert!(pending[2].contains("in no VipPool"));
}

#[test]
fn sharing_key_shares_one_address_when_ports_differ() {
    let pools = [pool("a", 10, 2, true)];
    let k = ANNOTATION_SHARING_KEY;
    let svcs = [
        annotate(with_ip(svc("web", 0, &[80]), "198.18.1.10"), k, "front"),
        annotate(svc("tls", 1, &[443]), k, "front"),
        annotate(svc("clash", 2, &[80]), k, "front"),
    ];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    assert_eq!(alloc(&d), [("default/tls".into(), "198.18.1.10".into()), ("default/clash".into(), "198.18.1.11".into())]);
}

#[test]
fn released_when_no_longer_ours_or_outside_pools() {
    let pools = [pool("a", 10, 2, true)];
    let mut cluster_ip = with_ip(svc("was-lb", 0, &[80]), "198.18.1.10");
    cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    let mut other_class = with_ip(svc("other", 1, &[80]), "198.18.1.11");
    other_class.spec.as_mut().unwrap().load_balancer_class = Some("example.com/other".into());
    let foreign = with_ip(svc("foreign", 2, &[80]), "203.0.113.5");
    let d = allocate(&pools, &[cluster_ip, other_class, foreign], &BTreeMap::new());
    let released: Vec<String> =
        d.iter().filter_map(|x| if let Decision::Release { addr, why, .. } = x { Some(format!("{addr} {why}")) } else { None }).collect();
    assert_eq!(
        released,
        [
            "198.18.1.10 no longer a LoadBalancer of ours (type ClusterIP)",
            "198.18.1.11 no longer a LoadBalancer of ours (loadBalancerClass example.com/other)",
            "203.0.113.5 the address is in no VipPool"
        ]
    );
    // Ours with an address in no pool: that one goes, one of ours comes.
    assert_eq!(alloc(&d), [("default/foreign".into(), "198.18.1.10".into())]);
}

#[test]
fn selectors_choose_the_pool() {
    let mut only_prod = pool("prod", 10, 1, true);
    only_prod.namespace_selector = Some(LabelSelector { match_labels: Some([("env".to_owned(), "prod".to_owned())].into()), ..Default::default() });
    let pools = [only_prod, pool("rest", 20, 1, true)];
    let mut s = svc("web", 0, &[80]);
    s.metadata.namespace = Some("shop".into());
    let ns: BTreeMap<String, BTreeMap<String, String>> = [("shop".to_owned(), [("env".to_owned(), "prod".to_owned())].into())].into();
    assert_eq!(alloc(&allocate(&pools, &[s.clone()], &ns)), [("shop/web".into(), "198.18.1.10".into())]);
    assert_eq!(alloc(&allocate(&pools, &[s], &BTreeMap::new())), [("shop/web".into(), "198.18.1.20".into())]);
}

#[test]
fn narrowed_selectors_keep_a_running_services_address() {
    let mut only_prod = pool("prod", 10, 2, true);
    only_prod.namespace_selector = Some(LabelSelector { match_labels: Some([("env".to_owned(), "prod".to_owned())].into()), ..Default::default() });
    let pools = [only_prod];
    let running = with_ip(svc("running", 0, &[80]), "198.18.1.10");
    let d = allocate(&pools, &[running.clone(), svc("new", 1, &[80])], &BTreeMap::new());
    assert!(
        matches!(&d[0], Decision::Stale { service, addr, pool, why } if service == "default/running" && addr.to_string() == "198.18.1.10" && pool == "prod" && why.contains("no longer admit")),
        "{d:?}"
    );
    assert!(!d.iter().any(|x| matches!(x, Decision::Release { .. })), "{d:?}");
    assert!(matches!(&d[1], Decision::Pending { service, .. } if service == "default/new"), "{d:?}");
    // Admitted again: nothing to say.
    let ns: BTreeMap<String, BTreeMap<String, String>> = [("default".to_owned(), [("env".to_owned(), "prod".to_owned())].into())].into();
    assert!(allocate(&pools, &[running], &ns).is_empty());
}

fn pending(d: &[Decision]) -> Vec<(String, String)> {
    d.iter().filter_map(|x| if let Decision::Pending { service, why } = x { Some((service.clone(), why.to_string())) } else { None }).collect()
}

#[test]
fn metallb_load_balancer_ips_are_honoured_vip_wins() {
    let pools = [pool("a", 10, 5, true)];
    let svcs = [
        annotate(svc("new-form", 0, &[80]), METALLB_ADDRESSES[0], "198.18.1.12"),
        annotate(svc("old-form", 1, &[80]), METALLB_ADDRESSES[1], "198.18.1.13"),
        annotate(svc("dual", 2, &[80]), METALLB_ADDRESSES[0], "2001:2::5, 198.18.1.14"),
        annotate(annotate(svc("both", 3, &[80]), METALLB_ADDRESSES[0], "198.18.1.10"), ANNOTATION_ADDRESS, "198.18.1.11"),
        annotate(svc("v6-only", 4, &[80]), METALLB_ADDRESSES[0], "2001:2::6"),
        annotate(svc("two-v4", 5, &[80]), METALLB_ADDRESSES[0], "198.18.1.10,198.18.1.10"),
        annotate(svc("junk", 6, &[80]), METALLB_ADDRESSES[1], "198.18.1.x"),
    ];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    assert_eq!(
        alloc(&d),
        [
            ("default/new-form".into(), "198.18.1.12".into()),
            ("default/old-form".into(), "198.18.1.13".into()),
            ("default/dual".into(), "198.18.1.14".into()),
            ("default/both".into(), "198.18.1.11".into()),
        ]
    );
    let p = pending(&d);
    assert_eq!(p.len(), 3, "{d:?}");
    assert_eq!(p[0].0, "default/v6-only");
    assert_eq!(p[0].1, "requested address 2001:2::6 is in no VipPool");
    assert!(p[1].1.contains("more than one address of a family"), "{}", p[1].1);
    assert_eq!(p[2].1, "metallb.universe.tf/loadBalancerIPs: \"198.18.1.x\" is not an IP address");
    // The Warnings' notes: honoured or overridden.
    assert_eq!(metallb_note(&svcs[0]).unwrap(), "MetalLB annotations: metallb.io/loadBalancerIPs is honoured: use vip.dev/address instead");
    assert_eq!(metallb_note(&svcs[2]).unwrap(), "MetalLB annotations: metallb.io/loadBalancerIPs is honoured: use vip.dev/address instead");
    assert_eq!(metallb_note(&svcs[3]).unwrap(), "MetalLB annotations: metallb.io/loadBalancerIPs is ignored: vip.dev/address is set too and wins");
    assert_eq!(metallb_note(&svc("plain", 0, &[80])), None);
    assert_eq!(metallb_note(&annotate(svc("x", 0, &[80]), ANNOTATION_ADDRESS, "198.18.1.10")), None, "vip's own alone: nothing to say");
}

#[test]
fn metallb_address_pool_names_the_pool_even_without_auto_assign() {
    let pools = [pool("auto", 10, 2, true), pool("manual", 20, 2, false)];
    let svcs = [
        annotate(svc("named", 0, &[80]), METALLB_POOL[0], "manual"),
        annotate(svc("old-form", 1, &[80]), METALLB_POOL[1], "manual"),
        annotate(annotate(svc("vip-wins", 2, &[80]), METALLB_POOL[0], "manual"), ANNOTATION_POOL, "auto"),
        annotate(svc("full", 3, &[80]), METALLB_POOL[0], "manual"),
        annotate(svc("missing", 4, &[80]), METALLB_POOL[0], "gold"),
        annotate(annotate(svc("wrong-pool", 5, &[80]), METALLB_POOL[0], "manual"), METALLB_ADDRESSES[0], "198.18.1.11"),
        // A held address outside the named pool is not kept: it moves to that pool.
        annotate(with_ip(svc("moves", 6, &[80]), "198.18.1.10"), ANNOTATION_POOL, "manual"),
    ];
    let d = allocate(&pools, &svcs[..6], &BTreeMap::new());
    assert_eq!(
        alloc(&d),
        [("default/named".into(), "198.18.1.20".into()), ("default/old-form".into(), "198.18.1.21".into()), ("default/vip-wins".into(), "198.18.1.10".into()),]
    );
    let p = pending(&d);
    assert_eq!(
        p.iter().map(|(s, w)| format!("{s}: {w}")).collect::<Vec<_>>(),
        [
            "default/full: VipPool \"manual\" (metallb.io/address-pool) has no free address",
            "default/missing: no valid VipPool named \"gold\" (metallb.io/address-pool)",
            "default/wrong-pool: requested address 198.18.1.11 is in VipPool \"auto\", not in \"manual\" (metallb.io/address-pool)",
        ]
    );
    let d = allocate(&pools, &svcs[6..], &BTreeMap::new());
    assert!(
        d.contains(&Decision::Allocate {
            service: "default/moves".into(),
            addr: "198.18.1.20".parse().unwrap(),
            pool: "manual".into(),
            ingress: vec!["198.18.1.20".parse().unwrap()]
        }),
        "{d:?}"
    );
    assert!(matches!(&d[0], Decision::Release { addr, .. } if addr.to_string() == "198.18.1.10"), "{d:?}");
    assert_eq!(metallb_note(&svcs[2]).unwrap(), "MetalLB annotations: metallb.io/address-pool is ignored: vip.dev/pool is set too and wins");
}

#[test]
fn metallb_allow_shared_ip_shares_like_the_sharing_key() {
    let pools = [pool("a", 10, 2, true)];
    let svcs = [
        annotate(with_ip(svc("web", 0, &[80]), "198.18.1.11"), METALLB_SHARING_KEY[0], "front"),
        annotate(with_ip(svc("tls", 1, &[443]), "198.18.1.11"), METALLB_SHARING_KEY[1], "front"),
        annotate(svc("quic", 2, &[8443]), METALLB_SHARING_KEY[0], "front"),
        annotate(svc("other-key", 3, &[9000]), METALLB_SHARING_KEY[0], "back"),
    ];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    // web and tls keep their shared address, quic joins them, other-key gets its own.
    assert_eq!(alloc(&d), [("default/quic".into(), "198.18.1.11".into()), ("default/other-key".into(), "198.18.1.10".into())], "{d:?}");
    assert_eq!(d.len(), 2, "nothing released: {d:?}");
    assert_eq!(metallb_note(&svcs[1]).unwrap(), "MetalLB annotations: metallb.universe.tf/allow-shared-ip is honoured: use vip.dev/sharing-key instead");
}

/// What switching from MetalLB looks like to the allocator: Services already
/// hold addresses MetalLB gave them (not the lowest, some shared, some in a pool
/// without autoAssign, some asked for by MetalLB's annotations); none moves, and
/// a new Service gets a free one.
#[test]
fn addresses_another_implementation_gave_are_kept() {
    let pools = [pool("a", 10, 4, true), pool("manual", 20, 2, false)];
    let svcs = [
        with_ip(svc("high", 0, &[80]), "198.18.1.13"),
        annotate(with_ip(svc("asked", 1, &[80]), "198.18.1.12"), METALLB_ADDRESSES[0], "198.18.1.12"),
        annotate(with_ip(svc("pinned", 2, &[80]), "198.18.1.21"), METALLB_POOL[1], "manual"),
        with_ip(svc("no-auto", 3, &[80]), "198.18.1.20"),
        annotate(with_ip(svc("s1", 4, &[80]), "198.18.1.10"), METALLB_SHARING_KEY[0], "k"),
        annotate(with_ip(svc("s2", 5, &[443]), "198.18.1.10"), METALLB_SHARING_KEY[0], "k"),
        svc("new", 6, &[80]),
    ];
    let d = allocate(&pools, &svcs, &BTreeMap::new());
    assert_eq!(
        d,
        [Decision::Allocate {
            service: "default/new".into(),
            addr: "198.18.1.11".parse().unwrap(),
            pool: "a".into(),
            ingress: vec!["198.18.1.11".parse().unwrap()]
        }]
    );
    // The same after a restart, whatever order the watch lists them in.
    let mut shuffled = svcs.to_vec();
    shuffled.reverse();
    shuffled.swap(1, 4);
    assert_eq!(allocate(&pools, &shuffled, &BTreeMap::new()), d);
}

fn families(mut s: Service, policy: &str, fams: &[&str]) -> Service {
    let spec = s.spec.as_mut().unwrap();
    spec.ip_family_policy = Some(policy.into());
    spec.ip_families = Some(fams.iter().map(|f| f.to_string()).collect());
    s
}

fn v6_pool(name: &str, auto: bool) -> PoolView {
    // A /64 less its subnet-router anycast address, as `crd::validate` makes it.
    PoolView { addresses: set(&[("2001:2::1", "2001:2::ffff:ffff:ffff:ffff")]), ..pool(name, 0, 1, auto) }
}

/// Every family policy against single- and dual-family pools: the addresses
/// written (in the Service's family order) or why none is.
#[test]
fn family_policies_get_one_or_two_addresses_never_half() {
    let v4 = || pool("v4", 10, 2, true);
    let v6 = || v6_pool("v6", true);
    let dual = || PoolView { addresses: set(&[("198.18.1.10", "198.18.1.11"), ("2001:2::1", "2001:2::ffff")]), ..pool("dual", 0, 1, true) };
    type Case<'a> = (&'a str, Vec<PoolView>, &'a str, &'a [&'a str], Result<&'a [&'a str], &'a str>);
    let cases: Vec<Case> = vec![
        ("single v4", vec![dual()], "SingleStack", &["IPv4"], Ok(&["198.18.1.10"])),
        ("single v6", vec![dual()], "SingleStack", &["IPv6"], Ok(&["2001:2::1"])),
        ("single v6, v4 pool only", vec![v4()], "SingleStack", &["IPv6"], Err("no VipPool with autoAssign admits this Service and has a free IPv6 address")),
        ("prefer, dual pool", vec![dual()], "PreferDualStack", &["IPv6", "IPv4"], Ok(&["2001:2::1", "198.18.1.10"])),
        ("prefer, two pools", vec![v4(), v6()], "PreferDualStack", &["IPv4", "IPv6"], Ok(&["198.18.1.10", "2001:2::1"])),
        ("prefer, v4 pool only", vec![v4()], "PreferDualStack", &["IPv4", "IPv6"], Ok(&["198.18.1.10"])),
        ("prefer on a single-stack cluster", vec![dual()], "PreferDualStack", &["IPv4"], Ok(&["198.18.1.10"])),
        ("require, dual pool", vec![dual()], "RequireDualStack", &["IPv4", "IPv6"], Ok(&["198.18.1.10", "2001:2::1"])),
        (
            "require, v4 pool only",
            vec![v4()],
            "RequireDualStack",
            &["IPv4", "IPv6"],
            Err("RequireDualStack needs an address of each family (IPv4, IPv6), none allocated until both can be: no VipPool with autoAssign admits this Service and has a free IPv6 address"),
        ),
    ];
    for (what, pools, policy, fams, want) in cases {
        let d = allocate(&pools, &[families(svc("web", 0, &[80]), policy, fams)], &BTreeMap::new());
        match want {
            Ok(addrs) => {
                let got: Vec<String> = alloc(&d).into_iter().map(|(_, a)| a).collect();
                assert_eq!(got, addrs, "{what}: {d:?}");
                let Decision::Allocate { ingress, .. } = &d[0] else { panic!("{what}: {d:?}") };
                assert_eq!(ingress.iter().map(|a| a.to_string()).collect::<Vec<_>>(), addrs, "{what}: the status lists each");
            }
            Err(why) => assert_eq!((d.len(), pending(&d)), (1, vec![("default/web".to_owned(), why.to_owned())]), "{what}: {d:?}"),
        }
    }
}

#[test]
fn requests_name_one_address_per_family() {
    let pools = [pool("v4", 10, 3, true), v6_pool("v6", true)];
    let dual = |s| families(s, "RequireDualStack", &["IPv4", "IPv6"]);
    type Case<'a> = (Service, Result<&'a [&'a str], &'a str>);
    let cases: Vec<Case> = vec![
        (dual(annotate(svc("both", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9, 198.18.1.12")), Ok(&["198.18.1.12", "2001:2::9"])),
        (
            dual(annotate(svc("one", 0, &[80]), ANNOTATION_ADDRESS, "198.18.1.12")),
            Err("RequireDualStack needs an address of each family (IPv4, IPv6), none allocated until both can be: RequireDualStack: the requested addresses name no IPv6 address"),
        ),
        (families(annotate(svc("prefer", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9"), "PreferDualStack", &["IPv4", "IPv6"]), Ok(&["2001:2::9"])),
        (
            families(annotate(svc("wrong-family", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9"), "SingleStack", &["IPv4"]),
            Err("requested address 2001:2::9 is IPv6, not of the Service's families (spec.ipFamilies: IPv4)"),
        ),
        (
            dual(annotate(svc("two-v6", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9,2001:2::8")),
            Err("RequireDualStack needs an address of each family (IPv4, IPv6), none allocated until both can be: vip.dev/address: \"2001:2::9,2001:2::8\" names more than one address of a family (one IPv4 and one IPv6 at most)"),
        ),
        (
            families(svc("lbip", 0, &[80]), "SingleStack", &["IPv6"]),
            Ok(&["2001:2::1"]),
        ),
        (
            {
                let mut s = families(svc("lbip", 0, &[80]), "SingleStack", &["IPv6"]);
                s.spec.as_mut().unwrap().load_balancer_ip = Some("2001:2::abc".into());
                s
            },
            Ok(&["2001:2::abc"]),
        ),
        (
            families(annotate(svc("anycast", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::"), "SingleStack", &["IPv6"]),
            Err("requested address 2001:2:: is in no VipPool"),
        ),
    ];
    for (s, want) in cases {
        let d = allocate(&pools, std::slice::from_ref(&s), &BTreeMap::new());
        match want {
            Ok(addrs) => assert_eq!(alloc(&d).into_iter().map(|(_, a)| a).collect::<Vec<_>>(), addrs, "{}: {d:?}", key(&s)),
            Err(why) => assert_eq!(pending(&d), [(key(&s), why.to_owned())], "{}", key(&s)),
        }
    }
}

/// A dual-stack Service that holds its IPv4 address gets its IPv6 one added in
/// one write of both; one that can no longer have both keeps what it holds.
#[test]
fn a_held_family_is_kept_and_the_other_added() {
    let pools = [pool("v4", 10, 3, true), v6_pool("v6", true)];
    let s = families(with_ip(svc("web", 0, &[80]), "198.18.1.11"), "RequireDualStack", &["IPv4", "IPv6"]);
    let d = allocate(&pools, std::slice::from_ref(&s), &BTreeMap::new());
    let ingress: Vec<IpAddr> = vec!["198.18.1.11".parse().unwrap(), "2001:2::1".parse().unwrap()];
    assert_eq!(d, [Decision::Allocate { service: "default/web".into(), addr: "2001:2::1".parse().unwrap(), pool: "v6".into(), ingress }]);
    let d = allocate(&pools[..1], &[s], &BTreeMap::new());
    assert!(matches!(&d[..], [Decision::Pending { why: AllocError::NotBothFamilies { .. }, .. }]), "kept, nothing written: {d:?}");
    // A huge pool costs nothing: the next free address of a /64 in use.
    let used: Vec<Service> =
        (0..3).map(|i| with_ip(families(svc(&format!("s{i}"), i, &[80]), "SingleStack", &["IPv6"]), &format!("2001:2::{}", i + 1))).collect();
    let mut all = used.clone();
    all.push(families(svc("new", 9, &[80]), "SingleStack", &["IPv6"]));
    assert_eq!(alloc(&allocate(&pools, &all, &BTreeMap::new())), [("default/new".into(), "2001:2::4".into())]);
    let u = pool_usage(&pools, &used);
    assert_eq!(u["v6"], (3, u32::MAX), "counts beyond u32 saturate");
}

#[test]
fn usage_counts() {
    let pools = [pool("a", 10, 3, true)];
    let u = pool_usage(&pools, &[with_ip(svc("x", 0, &[80]), "198.18.1.11")]);
    assert_eq!(u["a"], (1, 2));
}
