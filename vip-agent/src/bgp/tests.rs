use super::*;

fn peer(address: &str, asn: u32) -> Peer {
    Peer::new(address.parse().unwrap(), asn, 64513)
}

fn fast() -> Bfd {
    Bfd { name: "fast".into(), receive_interval: Duration::from_millis(300), transmit_interval: Duration::from_millis(300), detect_multiplier: 3 }
}

/// Two sessions (IPv4 with BFD, timers and a password; IPv6 through a source
/// address), two advertisements (one with communities and local preference).
pub(crate) fn sample() -> Speaker {
    let v4 = Peer {
        hold_time: Some(Duration::from_secs(3)),
        keepalive_time: Some(Duration::from_secs(1)),
        password: Some("s3cret".into()),
        bfd: Some(fast()),
        ..peer("198.18.0.1", 64512)
    };
    let v6 = Peer { source: Some("2001:2::11".parse().unwrap()), port: Some(1179), ebgp_multihop: true, ..peer("2001:2::1", 64512) };
    Speaker {
        router_id: "198.18.0.11".parse().unwrap(),
        peers: vec![v4, v6],
        retiring: vec![],
        advertisements: vec![
            Advertisement {
                addresses: vec!["203.0.113.1".parse().unwrap(), "2001:db8::1".parse().unwrap()],
                attributes: Attributes { communities: vec!["64512:100".into()], large_communities: vec!["64512:1:2".into()], local_pref: Some(200) },
            },
            Advertisement { addresses: vec!["203.0.113.2".parse().unwrap()], ..Advertisement::default() },
        ],
        graceful_restart: true,
    }
}

#[test]
fn renders_frr_configuration_byte_for_byte() {
    let want = "\
frr defaults traditional
hostname vip
log stdout informational
service integrated-vtysh-config
!
bfd
 profile fast
  receive-interval 300
  transmit-interval 300
  detect-multiplier 3
 exit
exit
!
router bgp 64513
 bgp router-id 198.18.0.11
 no bgp ebgp-requires-policy
 no bgp default ipv4-unicast
 no bgp network import-check
 bgp graceful-restart
 bgp graceful-restart preserve-fw-state
 neighbor 198.18.0.1 remote-as 64512
 neighbor 198.18.0.1 timers 1 3
 neighbor 198.18.0.1 password s3cret
 neighbor 198.18.0.1 bfd profile fast
 neighbor 2001:2::1 remote-as 64512
 neighbor 2001:2::1 port 1179
 neighbor 2001:2::1 update-source 2001:2::11
 neighbor 2001:2::1 ebgp-multihop
 !
 address-family ipv4 unicast
  network 203.0.113.1/32 route-map vip-adv-0
  network 203.0.113.2/32 route-map vip-adv-1
  neighbor 198.18.0.1 activate
  neighbor 198.18.0.1 route-map vip-in in
 exit-address-family
 !
 address-family ipv6 unicast
  network 2001:db8::1/128 route-map vip-adv-0
  neighbor 2001:2::1 activate
  neighbor 2001:2::1 route-map vip-in in
 exit-address-family
exit
!
route-map vip-in deny 10
exit
!
route-map vip-adv-0 permit 10
 set community 64512:100
 set large-community 64512:1:2
 set local-preference 200
exit
!
route-map vip-adv-1 permit 10
exit
!
";
    assert_eq!(frr_config(&sample()).unwrap(), want);
}

#[test]
fn no_peers_render_no_bgp_instance() {
    let s = Speaker { peers: vec![], advertisements: vec![], ..sample() };
    let c = frr_config(&s).unwrap();
    assert!(!c.contains("router bgp"), "{c}");
}

/// Dropping a session that carries routes goes through a step where it stays
/// with nothing sent on it, until its wait is over, through further changes;
/// dropping one with nothing announced, or keeping every session, goes
/// straight; a new AS retires every session first.
#[test]
fn sessions_that_carry_routes_retire_before_they_go() {
    let now = sample();
    let (v4, v6) = (now.peers[0].clone(), now.peers[1].clone());
    let one = Speaker { peers: vec![v4.clone()], ..sample() };
    let waiting = |_| false;
    let step = now.step_towards(one.clone(), waiting);
    assert_eq!((step.peers.clone(), step.retiring.clone()), (vec![v4.clone()], vec![v6.clone()]));
    assert_eq!(step.advertisements, one.advertisements);
    let c = frr_config(&step).unwrap();
    assert!(c.contains("  neighbor 2001:2::1 activate\n  neighbor 2001:2::1 route-map vip-in in\n  neighbor 2001:2::1 route-map vip-none out\n"), "{c}");
    assert!(c.contains("route-map vip-none deny 10\n") && !c.contains("198.18.0.1 route-map vip-none"), "{c}");
    // A second change while it waits: the first session keeps retiring, the
    // second joins it (the node leaves BGP altogether: the old router id stays).
    let gone = step.step_towards(Speaker::silent(), waiting);
    assert_eq!((gone.peers.len(), gone.retiring.clone(), gone.router_id), (0, vec![v4.clone(), v6.clone()], now.router_id));
    assert!(frr_config(&gone).unwrap().contains("router bgp 64513\n"));
    // Its wait over, only the other stays; both over, nothing is left.
    let later = gone.step_towards(Speaker::silent(), |a| a == v6.address);
    assert_eq!(later.retiring, vec![v4.clone()]);
    assert_eq!(later.step_towards(Speaker::silent(), |_| true), Speaker::silent());
    // A retiring session that comes back is a session again.
    let back = step.step_towards(sample(), waiting);
    assert_eq!(back, sample());
    // Nothing announced, or nothing dropped: no step.
    let quiet = Speaker { advertisements: vec![Advertisement::default()], ..sample() };
    assert_eq!(quiet.step_towards(one.clone(), waiting), one);
    assert_eq!(now.step_towards(sample(), waiting), sample());
    let mut other_as = sample();
    other_as.peers.iter_mut().for_each(|p| p.my_asn = 65000);
    let step = now.step_towards(other_as.clone(), waiting);
    assert_eq!((step.peers.len(), step.retiring), (0, now.peers.clone()));
    assert_eq!(now.step_towards(other_as.clone(), |_| true), other_as);
}

#[test]
fn what_frr_would_refuse_is_refused_naming_the_field() {
    let with = |f: &dyn Fn(&mut Speaker)| {
        let mut s = sample();
        f(&mut s);
        frr_config(&s).unwrap_err().to_string()
    };
    assert_eq!(with(&|s| s.peers[1].my_asn = 65000), "peers[1].myASN: 65000 differs from peers[0]'s 64513: a node speaks with one AS");
    assert_eq!(with(&|s| s.peers[1].address = s.peers[0].address), "peers[1].address: 198.18.0.1 is given twice");
    assert_eq!(with(&|s| s.retiring = vec![s.peers[0].clone()]), "peers[2].address: 198.18.0.1 is given twice");
    assert!(with(&|s| s.peers[0].hold_time = None).starts_with("peers[0].holdTime: "));
    assert!(with(&|s| s.peers[0].hold_time = Some(Duration::from_secs(2))).starts_with("peers[0].holdTime: "));
    assert!(with(&|s| s.peers[0].password = Some("two words".into())).starts_with("peers[0].password: "));
    assert!(with(&|s| s.peers[0].bfd.as_mut().unwrap().detect_multiplier = 1).starts_with("peers[0].bfd: "));
    assert!(with(&|s| s.peers[0].bfd.as_mut().unwrap().name = "a b".into()).starts_with("peers[0].bfd: "));
    assert!(with(&|s| s.advertisements[0].attributes.communities = vec!["65536:1".into()]).starts_with("advertisements[0].communities: \"65536:1\""));
    assert!(with(&|s| s.advertisements[0].attributes.large_communities = vec!["1:2".into()]).starts_with("advertisements[0].largeCommunities: "));
    // A hold time of 0 (no keepalives) is BGP's own choice.
    let mut s = sample();
    (s.peers[0].keepalive_time, s.peers[0].hold_time) = (Some(Duration::ZERO), Some(Duration::ZERO));
    assert!(frr_config(&s).unwrap().contains(" neighbor 198.18.0.1 timers 0 0\n"));
}
