//! The data path's capacity at default settings, and what happens at its limits:
//! services with equal rings share one region of `lb4_ring` (5,000 service-ports
//! over one node set take one ring of the default table size), a batch programs
//! each service on its own (a ring that does not fit fails that service only),
//! a re-opened data path finds the sharing in the maps, and a health change on
//! thousands of services writes one ring's changed slots.
use std::{collections::BTreeMap, net::Ipv4Addr};

use vip_agent::{
    dataplane::{monotonic_ns, BackendSpec, Dataplane, DataplaneError, ServiceAddr, ServiceSpec},
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
const XDP_TX: u32 = 3;

fn backend(i: u8) -> BackendSpec {
    BackendSpec { name: format!("node-{i}"), addr: Ipv4Addr::new(198, 18, 0, 10 + i).into(), mac: [0x02, 0, 0, 0, 0x10, i], weight: 1, local: false }
}

/// The `k`th VIP of 198.18.64.0/18.
fn vip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 64 + (k / 250) as u8, 1 + (k % 250) as u8)
}

/// A TCP frame from the client to `addr` forwarded by the data path: to which backend MAC.
fn forwarded_to(dp: &mut Dataplane, addr: ServiceAddr, sport: u16) -> Option<Mac> {
    let std::net::IpAddr::V4(vip) = addr.vip else { panic!("IPv4 services only here") };
    let f = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, sport), (vip, addr.port));
    let (v, out, _) = dp.test_run(&f, 1, None).unwrap();
    (v == XDP_TX).then(|| out[0..6].try_into().unwrap())
}

#[test]
fn five_thousand_service_ports_share_one_ring_at_default_settings() {
    if !privileged() {
        return;
    }
    let pins = PinDir::new().unwrap();
    let mut dp = Dataplane::load(&pins.path, DEFAULT_RING_CAPACITY).unwrap();
    dp.set_iface(IFINDEX, OUR_MAC).unwrap();
    let three = ServiceSpec { backends: vec![backend(1), backend(2), backend(3)], table_size: DEFAULT_TABLE_SIZE, absent: Vec::new() };
    let addrs: Vec<ServiceAddr> = (0..2500).flat_map(|k| [80, 443].map(|port| ServiceAddr { vip: vip(k).into(), port, protocol: Protocol::Tcp })).collect();
    let set: BTreeMap<ServiceAddr, &ServiceSpec> = addrs.iter().map(|a| (*a, &three)).collect();
    let done = dp.apply(&set, &[], 0).unwrap();
    assert!(done.failed.is_empty(), "{} failed, first: {:?}", done.failed.len(), done.failed.iter().next());
    let u = dp.usage();
    assert_eq!((u.services, u.rings, u.ring_slots), (5000, 1, u64::from(DEFAULT_TABLE_SIZE)), "{u:?}");
    assert_eq!(done.written.values().sum::<usize>(), DEFAULT_TABLE_SIZE as usize, "one ring written once");

    // The last service forwards like the first.
    let hour = monotonic_ns() + 3_600_000_000_000;
    let last = *addrs.last().unwrap();
    dp.hold_vip(IFINDEX, last.vip, hour).unwrap();
    let to = forwarded_to(&mut dp, last, 40000).expect("forwarded");
    assert!(three.backends.iter().any(|b| b.mac == to));

    // A re-opened data path (agent restart) finds the one shared ring.
    let again = Dataplane::open(&pins.path).unwrap();
    let u2 = again.usage();
    assert_eq!((u2.services, u2.rings, u2.ring_slots), (5000, 1, u64::from(DEFAULT_TABLE_SIZE)), "after re-open: {u2:?}");
    drop(again);

    // A health change on every service (node-3 down) rewrites the shared ring in
    // place: only node-3's slots, about a third, and nothing per service.
    let two = ServiceSpec { backends: vec![backend(1), backend(2)], table_size: DEFAULT_TABLE_SIZE, absent: Vec::new() };
    let set: BTreeMap<ServiceAddr, &ServiceSpec> = addrs.iter().map(|a| (*a, &two)).collect();
    let done = dp.apply(&set, &[], 0).unwrap();
    assert!(done.failed.is_empty());
    let slots: usize = done.written.values().sum();
    assert!(slots > DEFAULT_TABLE_SIZE as usize / 4 && slots < DEFAULT_TABLE_SIZE as usize / 2, "{slots} slots written");
    assert_eq!(dp.usage().rings, 1);
    let to = forwarded_to(&mut dp, last, 40001).expect("forwarded");
    assert!(to != backend(3).mac && two.backends.iter().any(|b| b.mac == to));
}

#[test]
fn a_ring_that_does_not_fit_fails_its_service_only_and_fits_once_room_appears() {
    if !privileged() {
        return;
    }
    let pins = PinDir::new().unwrap();
    // Room for three rings of 251 slots, not four.
    let mut dp = Dataplane::load(&pins.path, 1000).unwrap();
    dp.set_iface(IFINDEX, OUR_MAC).unwrap();
    let hour = monotonic_ns() + 3_600_000_000_000;
    // Five services, each with its own backend set (externalTrafficPolicy: Local).
    let specs: Vec<ServiceSpec> = (1..=5u8).map(|i| ServiceSpec { backends: vec![backend(i), backend(i + 10)], table_size: 251, absent: Vec::new() }).collect();
    let addrs: Vec<ServiceAddr> = (0..5).map(|k| ServiceAddr { vip: vip(k).into(), port: 80, protocol: Protocol::Tcp }).collect();
    for a in &addrs {
        dp.hold_vip(IFINDEX, a.vip, hour).unwrap();
    }
    let set: BTreeMap<ServiceAddr, &ServiceSpec> = addrs.iter().zip(&specs).map(|(a, s)| (*a, s)).collect();
    let done = dp.apply(&set, &[], 0).unwrap();
    assert_eq!(done.written.len(), 3, "{done:?}");
    assert_eq!(done.failed.len(), 2, "{done:?}");
    for e in done.failed.values() {
        assert!(matches!(e, DataplaneError::RingFull { .. }) && e.is_capacity(), "not a full ring: {e:?}");
        assert!(e.to_string().contains("--ring-capacity"), "the message must say what to raise: {e}");
    }
    // The services that fit forward; those that did not are absent (passed), not half-written.
    for (a, s) in addrs.iter().zip(&specs) {
        match forwarded_to(&mut dp, *a, 41000) {
            Some(mac) => {
                assert!(done.written.contains_key(a));
                assert!(s.backends.iter().any(|b| b.mac == mac));
            }
            None => assert!(done.failed.contains_key(a)),
        }
    }
    // Other changes still apply: a programmed service's health change.
    let fit: Vec<ServiceAddr> = done.written.keys().copied().collect();
    let failed: Vec<ServiceAddr> = done.failed.keys().copied().collect();
    let one = ServiceSpec { backends: vec![backend(9)], table_size: 251, absent: Vec::new() };
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
