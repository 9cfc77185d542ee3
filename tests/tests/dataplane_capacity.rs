//! The data path's capacity at default settings, and what happens at its limits:
//! services with equal rings share one region of `lb4_ring` (5,000 service-ports
//! over one node set take one ring of the default table size), a batch programs
//! each service on its own (a ring that does not fit fails that service only),
//! a re-opened data path finds the sharing in the maps, and a health change on
//! thousands of services writes one ring's changed slots. The same for IPv6
//! service-ports (`lb6_services`), alone and beside IPv4 ones on the same ring.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use vip_agent::{
    dataplane::{monotonic_ns, Applied, BackendSpec, Dataplane, DataplaneError, ServiceAddr, ServiceSpec},
    maglev::DEFAULT_TABLE_SIZE,
    model::Protocol,
};
use vip_common::DEFAULT_RING_CAPACITY;
use vip_tests::{
    frames::{self, Mac},
    netns::{privileged, PinDir},
};

const IFINDEX: u32 = 1;
const OUR_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0xaa];
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
const XDP_TX: u32 = 3;

fn backend(i: u8) -> BackendSpec {
    BackendSpec { name: format!("node-{i}"), addr: Ipv4Addr::new(198, 18, 0, 10 + i).into(), mac: [0x02, 0, 0, 0, 0x10, i], weight: 1, local: false }
}

/// The `k`th VIP of 198.18.64.0/18.
fn vip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 64 + (k / 250) as u8, 1 + (k % 250) as u8)
}

/// The `k`th IPv6 VIP of 2001:2:0:40::/64 (in 2001:2::/48).
fn vip6(k: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 2, 0, 0x40, 0, 0, (k >> 16) as u16, 1 + k as u16)
}

/// A TCP SYN from the client (of the service's family) to `addr` forwarded by the
/// data path: to which backend MAC.
fn forwarded_to(dp: &mut Dataplane, addr: ServiceAddr, sport: u16) -> Option<Mac> {
    let f = match addr.vip {
        IpAddr::V4(vip) => frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (vip, addr.port)),
        IpAddr::V6(vip) => frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, sport), (vip, addr.port), frames::TCP_SYN),
    };
    let (v, out, _) = dp.test_run(&f, 1, None).unwrap();
    (v == XDP_TX).then(|| out[0..6].try_into().unwrap())
}

/// A data path loaded on fresh pins with `ring_capacity` ring slots, on
/// [`IFINDEX`], holding the VIPs of `held` for an hour.
fn holding(ring_capacity: u32, held: &[ServiceAddr]) -> (PinDir, Dataplane) {
    let pins = PinDir::new().unwrap();
    let mut dp = Dataplane::load(&pins.path, ring_capacity).unwrap();
    dp.set_iface(IFINDEX, OUR_MAC).unwrap();
    let hour = monotonic_ns() + 3_600_000_000_000;
    for a in held {
        dp.hold_vip(IFINDEX, a.vip, hour).unwrap();
    }
    (pins, dp)
}

/// Each of `addrs` (with its spec) forwards to one of its backends if `done`
/// wrote it, and is absent (passed), not half-written, if `done` failed it.
fn forwarded_if_written(dp: &mut Dataplane, addrs: &[ServiceAddr], specs: &[ServiceSpec], done: &Applied) {
    for (a, s) in addrs.iter().zip(specs) {
        match forwarded_to(dp, *a, 41000) {
            Some(mac) => assert!(done.written.contains_key(a) && s.backends.iter().any(|b| b.mac == mac), "{a:?} to {mac:x?}"),
            None => assert!(done.failed.contains_key(a), "{a:?} not forwarded"),
        }
    }
}

/// Ports 80 and 443 of every VIP in `vips`, TCP.
fn service_ports(vips: impl IntoIterator<Item = IpAddr>) -> Vec<ServiceAddr> {
    vips.into_iter().flat_map(|v| [80, 443].map(|port| ServiceAddr { vip: v, port, protocol: Protocol::Tcp })).collect()
}

/// Programs `addrs` (one node set, default table size) on a data path at default
/// settings: one ring for all, written once, found again on re-open; a health
/// change rewrites that ring in place; `probe` (the first and last of each family)
/// forward to the node set's MACs before and after it.
fn service_ports_share_one_ring(addrs: &[ServiceAddr], probe: &[ServiceAddr]) {
    let n = addrs.len();
    let (pins, mut dp) = holding(DEFAULT_RING_CAPACITY, &[]);
    let three = ServiceSpec { backends: vec![backend(1), backend(2), backend(3)], table_size: DEFAULT_TABLE_SIZE, ..Default::default() };
    let set: BTreeMap<ServiceAddr, &ServiceSpec> = addrs.iter().map(|a| (*a, &three)).collect();
    let done = dp.apply(&set, &[], 0).unwrap();
    assert!(done.failed.is_empty(), "{} failed, first: {:?}", done.failed.len(), done.failed.iter().next());
    let u = dp.usage();
    assert_eq!((u.services, u.rings, u.ring_slots), (n, 1, u64::from(DEFAULT_TABLE_SIZE)), "{u:?}");
    assert_eq!(done.written.values().sum::<usize>(), DEFAULT_TABLE_SIZE as usize, "one ring written once");

    // The last service forwards like the first.
    let hour = monotonic_ns() + 3_600_000_000_000;
    for (i, a) in probe.iter().enumerate() {
        dp.hold_vip(IFINDEX, a.vip, hour).unwrap();
        let to = forwarded_to(&mut dp, *a, 40000 + 2 * i as u16).unwrap_or_else(|| panic!("{a:?} not forwarded"));
        assert!(three.backends.iter().any(|b| b.mac == to), "{a:?}");
    }

    // A re-opened data path (agent restart) finds the one shared ring.
    let again = Dataplane::open(&pins.path).unwrap();
    let u2 = again.usage();
    assert_eq!((u2.services, u2.rings, u2.ring_slots), (n, 1, u64::from(DEFAULT_TABLE_SIZE)), "after re-open: {u2:?}");
    assert_eq!(again.service_addrs(), addrs.iter().copied().collect(), "after re-open: the same service-ports");
    drop(again);

    // A health change on every service (node-3 down) rewrites the shared ring in
    // place: only node-3's slots, about a third, and nothing per service.
    let two = ServiceSpec { backends: vec![backend(1), backend(2)], table_size: DEFAULT_TABLE_SIZE, ..Default::default() };
    let set: BTreeMap<ServiceAddr, &ServiceSpec> = addrs.iter().map(|a| (*a, &two)).collect();
    let done = dp.apply(&set, &[], 0).unwrap();
    assert!(done.failed.is_empty());
    let slots: usize = done.written.values().sum();
    assert!(slots > DEFAULT_TABLE_SIZE as usize / 4 && slots < DEFAULT_TABLE_SIZE as usize / 2, "{slots} slots written");
    assert_eq!(dp.usage().rings, 1);
    for (i, a) in probe.iter().enumerate() {
        let to = forwarded_to(&mut dp, *a, 40001 + 2 * i as u16).unwrap_or_else(|| panic!("{a:?} not forwarded"));
        assert!(to != backend(3).mac && two.backends.iter().any(|b| b.mac == to), "{a:?}");
    }
}

#[test]
fn five_thousand_service_ports_share_one_ring_at_default_settings() {
    if !privileged() {
        return;
    }
    let addrs = service_ports((0..2500).map(|k| vip(k).into()));
    assert_eq!(addrs.len(), 5000);
    service_ports_share_one_ring(&addrs, &[*addrs.last().unwrap()]);
}

#[test]
fn five_thousand_ipv6_service_ports_share_one_ring_at_default_settings() {
    if !privileged() {
        return;
    }
    let addrs = service_ports((0..2500).map(|k| vip6(k).into()));
    assert_eq!(addrs.len(), 5000);
    service_ports_share_one_ring(&addrs, &[addrs[0], *addrs.last().unwrap()]);
}

/// Both families at once, 5,000 service-ports each (10,000 of the 16,384 service
/// ids, which the families share): still one ring.
#[test]
fn five_thousand_service_ports_of_each_family_share_one_ring_at_default_settings() {
    if !privileged() {
        return;
    }
    let v4 = service_ports((0..2500).map(|k| vip(k).into()));
    let v6 = service_ports((0..2500).map(|k| vip6(k).into()));
    let addrs: Vec<ServiceAddr> = v4.iter().chain(&v6).copied().collect();
    assert_eq!(addrs.len(), 10_000);
    service_ports_share_one_ring(&addrs, &[v4[0], *v4.last().unwrap(), v6[0], *v6.last().unwrap()]);
}

#[test]
fn a_ring_that_does_not_fit_fails_its_service_only_and_fits_once_room_appears() {
    if !privileged() {
        return;
    }
    ring_that_does_not_fit((0..5).map(|k| vip(k).into()).collect());
}

#[test]
fn an_ipv6_ring_that_does_not_fit_fails_its_service_only_and_fits_once_room_appears() {
    if !privileged() {
        return;
    }
    ring_that_does_not_fit((0..5).map(|k| vip6(k).into()).collect());
}

/// The families mixed: IPv4 and IPv6 services compete for the same ring room.
#[test]
fn a_ring_that_does_not_fit_fails_its_service_only_whatever_its_family() {
    if !privileged() {
        return;
    }
    ring_that_does_not_fit((0..5).map(|k| if k % 2 == 0 { vip6(k).into() } else { vip(k).into() }).collect());
}

/// Five services on `vips` (port 80), each with its own backend set, in room for
/// three rings: two fail alone, with the error that says what to raise; a health
/// change still applies; a removal makes room for one of them on retry.
fn ring_that_does_not_fit(vips: Vec<IpAddr>) {
    assert_eq!(vips.len(), 5);
    // Five services, each with its own backend set (externalTrafficPolicy: Local).
    let specs: Vec<ServiceSpec> =
        (1..=5u8).map(|i| ServiceSpec { backends: vec![backend(i), backend(i + 10)], table_size: 251, ..Default::default() }).collect();
    let addrs: Vec<ServiceAddr> = vips.iter().map(|&vip| ServiceAddr { vip, port: 80, protocol: Protocol::Tcp }).collect();
    // Room for three rings of 251 slots, not four.
    let (_pins, mut dp) = holding(1000, &addrs);
    let set: BTreeMap<ServiceAddr, &ServiceSpec> = addrs.iter().zip(&specs).map(|(a, s)| (*a, s)).collect();
    let done = dp.apply(&set, &[], 0).unwrap();
    assert_eq!(done.written.len(), 3, "{done:?}");
    assert_eq!(done.failed.len(), 2, "{done:?}");
    for e in done.failed.values() {
        assert!(matches!(e, DataplaneError::RingFull { .. }) && e.is_capacity(), "not a full ring: {e:?}");
        assert!(e.to_string().contains("--ring-capacity"), "the message must say what to raise: {e}");
    }
    // The services that fit forward; those that did not are absent (passed), not half-written.
    forwarded_if_written(&mut dp, &addrs, &specs, &done);
    // Other changes still apply: a programmed service's health change.
    let fit: Vec<ServiceAddr> = done.written.keys().copied().collect();
    let failed: Vec<ServiceAddr> = done.failed.keys().copied().collect();
    let one = ServiceSpec { backends: vec![backend(9)], table_size: 251, ..Default::default() };
    let d2 = dp.apply(&BTreeMap::from([(fit[0], &one)]), &[], 0).unwrap();
    assert!(d2.failed.is_empty(), "{d2:?}");
    assert_eq!(forwarded_to(&mut dp, fit[0], 41001), Some(backend(9).mac));
    // One service goes: its room takes one of the others on retry.
    let d3 = dp.apply(&BTreeMap::new(), &[fit[1]], 0).unwrap();
    assert_eq!(d3.removed, vec![fit[1]]);
    let retry: BTreeMap<ServiceAddr, &ServiceSpec> = failed.iter().map(|a| (*a, &specs[addrs.iter().position(|x| x == a).unwrap()])).collect();
    let d4 = dp.apply(&retry, &[], 0).unwrap();
    assert_eq!((d4.written.len(), d4.failed.len()), (1, 1), "{d4:?}");
}

/// IPv6 flows pinned from user space, as the scale tests fill the flow table
/// (`flows::synthetic6`), are the data path's: their packets go to the pinned
/// backend, not the ring's choice, and a health change that takes that backend
/// out of the ring evicts them.
#[test]
fn ipv6_flows_pinned_from_user_space_are_followed_and_evicted_with_their_backend() {
    if !privileged() {
        return;
    }
    let addr = ServiceAddr { vip: vip6(0).into(), port: 80, protocol: Protocol::Tcp };
    let (_pins, mut dp) = holding(DEFAULT_RING_CAPACITY, &[addr]);
    let three = ServiceSpec { backends: vec![backend(1), backend(2), backend(3)], table_size: DEFAULT_TABLE_SIZE, ..Default::default() };
    assert!(dp.apply(&BTreeMap::from([(addr, &three)]), &[], 0).unwrap().failed.is_empty());
    let id_of = |dp: &Dataplane, mac: Mac| *dp.backends().unwrap().iter().find(|(_, b)| b.mac == mac).unwrap().0;
    let pinned = id_of(&dp, backend(1).mac);
    // 40 flows, all pinned to node-1: the ring alone would send about a third there.
    let flows = vip_tests::flows::synthetic6(40, &[vip6(0)], 80, &[pinned]);
    dp.insert_flows6(&flows).unwrap();
    assert_eq!(dp.flow_count(), flows.len());
    let ack = |key: &vip_common::Lb6FlowKey| {
        let (src, sport) = (Ipv6Addr::from(key.src), u16::from_be_bytes(key.sport));
        frames::tcp6(OUR_MAC, CLIENT_MAC, None, (src, sport), (vip6(0), 80), frames::TCP_ACK)
    };
    for (key, _) in &flows {
        assert!(dp.flow6(key).is_some_and(|e| u32::from(e.backend) == pinned), "{key:?} not pinned");
        let (v, out, _) = dp.test_run(&ack(key), 1, None).unwrap();
        assert_eq!((v, &out[0..6]), (XDP_TX, &backend(1).mac[..]), "{key:?}: not to its pinned backend");
    }
    // node-1 down: its flows go, and their packets follow the new ring.
    let two = ServiceSpec { backends: vec![backend(2), backend(3)], table_size: DEFAULT_TABLE_SIZE, ..Default::default() };
    let done = dp.apply(&BTreeMap::from([(addr, &two)]), &[], 0).unwrap();
    assert!(done.failed.is_empty());
    dp.sweep(&done.sweep).unwrap();
    for (key, _) in &flows {
        assert!(dp.flow6(key).is_none(), "{key:?} still pinned to a backend out of the ring");
        let (v, out, _) = dp.test_run(&ack(key), 1, None).unwrap();
        assert!(v == XDP_TX && two.backends.iter().any(|b| b.mac == out[0..6]), "{key:?}: verdict {v}, to {:x?}", &out[0..6]);
    }
}

/// The `i`th of 4,097 distinct backends (198.18.16.0/20: addresses and MACs unique).
fn many_backend(i: u32) -> BackendSpec {
    let [_, _, hi, lo] = i.to_be_bytes();
    BackendSpec { name: format!("node-{i}"), addr: Ipv4Addr::new(198, 18, 16 + hi, lo).into(), mac: [0x02, 0, 0, 0x20, hi, lo], weight: 1, local: false }
}

/// `lb4_backends` holds 4,096 backends (`BackendIdsExhausted` in
/// docs/operations/capacity-planning.md): a service over all of them, at the
/// default table size, is programmed and forwards to them; a service that needs a
/// 4,097th fails alone, with the error that names the limit, while one over
/// backends already known is programmed beside it; once the first service goes,
/// its ids are free and the refused one is programmed on retry.
#[test]
fn the_4097th_backend_is_refused_for_its_service_only() {
    if !privileged() {
        return;
    }
    let [all, extra, known] = [0, 1, 2].map(|k| ServiceAddr { vip: vip(k).into(), port: 80, protocol: Protocol::Tcp });
    let (_pins, mut dp) = holding(DEFAULT_RING_CAPACITY, &[all, extra, known]);
    let full = ServiceSpec { backends: (0..4096).map(many_backend).collect(), table_size: DEFAULT_TABLE_SIZE, ..Default::default() };
    let one_more = ServiceSpec { backends: vec![many_backend(4096)], table_size: 251, ..Default::default() };
    let some_known = ServiceSpec { backends: (4000..4096).map(many_backend).collect(), table_size: 251, ..Default::default() };
    let done = dp.apply(&BTreeMap::from([(all, &full)]), &[], 0).unwrap();
    assert!(done.failed.is_empty() && done.written.contains_key(&all), "{done:?}");
    let macs: std::collections::BTreeSet<Mac> = (0..2000u16).filter_map(|p| forwarded_to(&mut dp, all, 20000 + p)).collect();
    assert!(macs.len() > 1000, "2,000 flows over 4,096 backends reached only {} of them", macs.len());

    let done = dp.apply(&BTreeMap::from([(extra, &one_more), (known, &some_known)]), &[], 0).unwrap();
    assert_eq!(done.failed.get(&extra), Some(&DataplaneError::BackendIdsExhausted(4096)), "{done:?}");
    let e = &done.failed[&extra];
    assert!(e.is_capacity() && e.to_string().contains("4096 backend ids"), "{e}");
    assert!(done.written.contains_key(&known) && !done.failed.contains_key(&known), "{done:?}");
    assert_eq!(forwarded_to(&mut dp, extra, 41000), None, "a refused service must not be half-written");
    assert!(forwarded_to(&mut dp, known, 41000).is_some_and(|m| some_known.backends.iter().any(|b| b.mac == m)));
    assert!(forwarded_to(&mut dp, all, 41000).is_some(), "the full service forwards on");

    let done = dp.apply(&BTreeMap::new(), &[all], 0).unwrap();
    assert_eq!(done.removed, vec![all]);
    let done = dp.apply(&BTreeMap::from([(extra, &one_more)]), &[], 0).unwrap();
    assert!(done.failed.is_empty(), "{done:?}");
    assert_eq!(forwarded_to(&mut dp, extra, 41001), Some(many_backend(4096).mac));
}

/// At the defaults (`--ring-capacity` 2^20 slots, `tableSize` 16381), `lb4_ring`
/// holds 64 distinct rings (Local Services over different node sets): all 64 are
/// programmed and forward; the 65th fails alone with the error naming
/// `--ring-capacity`.
#[test]
fn the_default_ring_map_holds_64_distinct_default_rings_and_refuses_the_65th() {
    if !privileged() {
        return;
    }
    let fits = DEFAULT_RING_CAPACITY / DEFAULT_TABLE_SIZE;
    assert_eq!(fits, 64);
    let addrs: Vec<ServiceAddr> = (0..=fits as usize).map(|k| ServiceAddr { vip: vip(k).into(), port: 80, protocol: Protocol::Tcp }).collect();
    let (_pins, mut dp) = holding(DEFAULT_RING_CAPACITY, &addrs);
    let specs: Vec<ServiceSpec> = (0..=fits)
        .map(|k| ServiceSpec { backends: vec![many_backend(2 * k), many_backend(2 * k + 1)], table_size: DEFAULT_TABLE_SIZE, ..Default::default() })
        .collect();
    let set: BTreeMap<ServiceAddr, &ServiceSpec> = addrs.iter().zip(&specs).map(|(a, s)| (*a, s)).collect();
    let done = dp.apply(&set, &[], 0).unwrap();
    assert_eq!((done.written.len(), done.failed.len()), (fits as usize, 1), "{:?}", done.failed);
    let e = done.failed.values().next().unwrap();
    assert!(matches!(e, DataplaneError::RingFull { .. }) && e.to_string().contains("--ring-capacity"), "{e}");
    forwarded_if_written(&mut dp, &addrs, &specs, &done);
}
