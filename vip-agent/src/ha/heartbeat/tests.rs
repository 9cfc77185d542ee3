use serde::{Deserialize, Serialize};

use super::*;

const DEAD: Duration = Duration::from_secs(3);

fn up(n: &str, inc: u64) -> Seen {
    Seen::Fresh(Some(Event::Up { node: n.into(), incarnation: inc }))
}

const QUIET: Seen = Seen::Fresh(None);

#[test]
fn the_gap_is_a_rolling_maximum_with_the_current_silence() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let g = Gaps::default();
    g.track(["a", "b"], t0);
    for ms in [100, 200, 1700, 1800] {
        g.heard("a", 1, at(ms));
    }
    // b, silent since it was tracked, shows it until it is heard.
    assert_eq!(g.max_at(at(1700))["b"], 1.7);
    g.heard("b", 1, at(1800));
    // a: the 1.5 s gap; b: its first heartbeat ends a wait, not a gap.
    assert_eq!(g.max_at(at(1800)), BTreeMap::from([("a".to_owned(), 1.5), ("b".to_owned(), 0.0)]));
    // Once the window has passed the 1.5 s gap, a's steady 100 ms heartbeats show.
    let mut ms = 1800;
    while ms < 1800 + GAP_WINDOW.as_millis() as u64 + 200 {
        ms += 100;
        g.heard("a", 1, at(ms));
        g.heard("b", 1, at(ms));
    }
    let now = g.max_at(at(ms));
    assert!((now["a"] - 0.1).abs() < 1e-9 && (now["b"] - 0.1).abs() < 1e-9, "{now:?}");
    // A peer that goes silent shows it before its next heartbeat.
    assert!((g.max_at(at(ms + 2500))["a"] - 2.5).abs() < 1e-9);
}

#[test]
fn a_restart_is_no_gap_and_untracked_peers_go() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let g = Gaps::default();
    g.track(["a", "b"], t0);
    g.heard("a", 1, at(100));
    // A new incarnation 5 s later: the agent restarted, its silence was not a gap.
    g.heard("a", 2, at(5100));
    g.heard("a", 2, at(5200));
    assert_eq!(g.max_at(at(5200))["a"], 0.1);
    g.track(["a"], at(5200));
    // A task being replaced cannot bring back a peer that left.
    g.heard("b", 1, at(5300));
    assert_eq!(g.max_at(at(5300)).into_keys().collect::<Vec<_>>(), ["a"]);
}

#[test]
fn up_then_down_after_dead_after_without_heartbeat() {
    let t0 = Instant::now();
    let mut t = PeerTable::new(DEAD);
    assert_eq!(t.observe("a", 7, 1, t0), up("a", 7));
    assert_eq!(t.observe("a", 7, 2, t0 + Duration::from_secs(1)), QUIET);
    // 3 s after the last heartbeat (t0+1), not after the first.
    assert!(t.expire(t0 + Duration::from_millis(3999)).is_empty());
    assert_eq!(t.live(), BTreeSet::from(["a".to_string()]));
    assert_eq!(t.expire(t0 + Duration::from_secs(4)), vec![Event::Down { node: "a".into() }]);
    assert!(t.live().is_empty());
    // Down is reported once.
    assert!(t.expire(t0 + Duration::from_secs(10)).is_empty());
    // Comes back with the same incarnation: Up again.
    assert_eq!(t.observe("a", 7, 3, t0 + Duration::from_secs(11)), up("a", 7));
}

#[test]
fn stale_and_duplicate_seqs_do_not_refresh() {
    let t0 = Instant::now();
    let mut t = PeerTable::new(DEAD);
    t.observe("a", 7, 5, t0);
    assert_eq!(t.observe("a", 7, 5, t0 + Duration::from_secs(2)), Seen::Stale);
    assert_eq!(t.observe("a", 7, 4, t0 + Duration::from_secs(2)), Seen::Stale);
    // Had either refreshed last_seen, "a" would still be alive at t0+3.
    assert_eq!(t.expire(t0 + DEAD).len(), 1);
    // A replayed old seq does not resurrect it either.
    assert_eq!(t.observe("a", 7, 5, t0 + Duration::from_secs(4)), Seen::Stale);
    assert!(t.live().is_empty());
}

#[test]
fn a_leaving_peer_is_down_at_once_stays_a_backend_then_is_gone_or_back() {
    let t0 = Instant::now();
    let mut t = PeerTable::new(DEAD_AFTER);
    t.observe("a", 7, 1, t0);
    let stay = Duration::from_secs(30);
    assert_eq!(t.observe_leaving("a", 7, 2, stay, t0), Seen::Fresh(Some(Event::Leaving { node: "a".into() })));
    assert!(t.live().is_empty(), "its VIPs go to others at once");
    assert_eq!(t.leaving(), ["a".to_owned()].into());
    // A replay of the leaving heartbeat changes nothing.
    assert_eq!(t.observe_leaving("a", 7, 2, stay, t0 + Duration::from_secs(1)), Seen::Stale);
    assert!(t.expire(t0 + Duration::from_secs(29)).is_empty());
    assert_eq!(t.expire(t0 + stay), vec![Event::Gone { node: "a".into() }]);
    assert!(t.leaving().is_empty());
    // Its next agent, within the stay: Up, and no longer leaving.
    t.observe_leaving("a", 7, 3, stay, t0 + stay);
    assert_eq!(t.observe("a", 8, 1, t0 + stay + Duration::from_secs(2)), up("a", 8));
    assert!(t.leaving().is_empty());
    assert_eq!(t.live(), ["a".to_owned()].into());
    // A leaving heartbeat from a peer never heard takes nothing.
    assert_eq!(t.observe_leaving("b", 1, 1, stay, t0), Seen::Fresh(None));
    assert!(t.leaving().is_empty() && !t.live().contains("b"));
}

#[test]
fn restart_before_deadline_is_up_without_down() {
    let t0 = Instant::now();
    let mut t = PeerTable::new(DEAD);
    t.observe("a", 1, 100, t0);
    // New incarnation restarts its seq at 1: accepted and reported as Up.
    assert_eq!(t.observe("a", 2, 1, t0 + Duration::from_secs(1)), up("a", 2));
    assert!(t.expire(t0 + Duration::from_secs(2)).is_empty());
    // A late (or replayed) datagram from the old incarnation is ignored (no flip back).
    assert_eq!(t.observe("a", 1, 101, t0 + Duration::from_secs(2)), Seen::Stale);
    assert_eq!(t.observe("a", 2, 2, t0 + Duration::from_secs(2)), QUIET);
    assert!(t.expire(t0 + Duration::from_millis(4999)).is_empty(), "seq 2 at t0+2 refreshed it");
}

/// The wire path a receiver applies: unknown senders, unsigned or badly
/// signed datagrams and names other than the sender's are refused with their
/// reason, before the table sees them.
#[test]
fn accept_checks_sender_key_and_name() {
    use crate::ha::auth::Keys;
    let keys = Keys::new(&[vec![b'k'; 32]]).unwrap();
    let a: SocketAddr = "198.18.0.11:7473".parse().unwrap();
    let b: SocketAddr = "198.18.0.12:7473".parse().unwrap();
    let known: HashMap<SocketAddr, String> = [(a, "n1".to_owned()), (b, "n2".to_owned())].into();
    let hb =
        |node: &str| Heartbeat { v: 1, node: node.into(), incarnation: 5, seq: 1, sent_ms: 0, leaving_ms: 0, arp: vec![], settings: String::new() }.encode();
    assert_eq!(accept(&keys.seal(&hb("n1")), a, &known, Some(&keys)).map(|h| h.node), Ok("n1".to_owned()));
    assert_eq!(accept(&keys.seal(&hb("n1")), "198.18.0.99:7473".parse().unwrap(), &known, Some(&keys)).err(), Some(Rejected::UnknownSender));
    assert_eq!(accept(&hb("n1"), a, &known, Some(&keys)).err(), Some(Rejected::Malformed));
    assert_eq!(accept(&keys.seal(&hb("n2")), a, &known, Some(&keys)).err(), Some(Rejected::WrongName));
    assert_eq!(accept(&keys.seal(&hb("n9")), a, &known, Some(&keys)).err(), Some(Rejected::WrongName));
    let other = Keys::new(&[vec![b'o'; 32]]).unwrap();
    assert_eq!(accept(&other.seal(&hb("n1")), a, &known, Some(&keys)).err(), Some(Rejected::UnknownKey));
    // A trusted segment: plain datagrams, the name still bound to the address.
    assert!(accept(&hb("n1"), a, &known, None).is_ok());
    assert_eq!(accept(&hb("n2"), a, &known, None).err(), Some(Rejected::WrongName));
}

#[test]
fn peers_are_independent() {
    let t0 = Instant::now();
    let mut t = PeerTable::new(DEAD);
    t.observe("a", 1, 1, t0);
    t.observe("b", 1, 1, t0 + Duration::from_secs(2));
    assert_eq!(t.expire(t0 + DEAD), vec![Event::Down { node: "a".into() }]);
    assert_eq!(t.live(), BTreeSet::from(["b".to_string()]));
}

#[test]
fn wire_format_round_trips_and_rejects_others() {
    let hb = Heartbeat {
        v: 1,
        node: "node-1".into(),
        incarnation: u64::MAX,
        seq: 3,
        sent_ms: 1_700_000_000_000,
        leaving_ms: 0,
        arp: vec![],
        settings: String::new(),
    };
    assert_eq!(Heartbeat::decode(&hb.encode()), Some(hb.clone()));
    // Only a leaving heartbeat carries leaving_ms: others are what agents of
    // before send and read.
    assert!(!String::from_utf8(hb.encode()).unwrap().contains("leaving"));
    let leaving = Heartbeat { leaving_ms: 30_000, ..hb.clone() };
    assert_eq!(Heartbeat::decode(&leaving.encode()), Some(leaving));
    assert_eq!(Heartbeat::decode(&Heartbeat { v: 2, ..hb }.encode()), None);
    assert_eq!(Heartbeat::decode(b"\x00garbage"), None);
    assert_ne!(new_incarnation(), new_incarnation());
}

/// Rolling upgrade: an agent of before (its Heartbeat, without `arp` and
/// `settings`) takes a new agent's heartbeat that carries findings and
/// settings (unknown fields are skipped),
/// and a new agent takes the old one's. A full heartbeat, sealed, fits the
/// receive buffer.
#[test]
fn findings_ride_along_and_agents_of_before_ignore_them() {
    use crate::ha::arpcheck::{Finding, PER_HEARTBEAT};
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Before {
        v: u8,
        node: String,
        incarnation: u64,
        seq: u64,
        sent_ms: u64,
        #[serde(default)]
        leaving_ms: u64,
    }
    let mac = "02:00:00:00:00:01".to_owned();
    let findings: Vec<Finding> =
        (0..PER_HEARTBEAT).map(|i| Finding { vip: std::net::Ipv4Addr::new(255, 255, 255, i as u8), macs: vec![mac.clone(); 4] }).collect();
    let node = "n".repeat(63);
    // The longest settings too (they ride with findings once every SETTINGS_EVERY).
    let mut w = crate::model::World { maglev_seed: u64::MAX, ..Default::default() };
    w.announce.hold_time = Duration::from_nanos(u64::MAX - 1);
    w.failover.dead_after = w.announce.hold_time;
    let settings = crate::model::cluster_settings(&w);
    let new = Heartbeat { v: 1, node: node.clone(), incarnation: u64::MAX, seq: u64::MAX, sent_ms: u64::MAX, leaving_ms: 0, arp: findings, settings };
    let old: Before = serde_json::from_slice(&new.encode()).expect("an agent of before decodes it");
    assert_eq!(old, Before { v: 1, node: node.clone(), incarnation: u64::MAX, seq: u64::MAX, sent_ms: u64::MAX, leaving_ms: 0 });
    let from_old = Heartbeat::decode(&serde_json::to_vec(&old).unwrap()).expect("a new agent decodes an old one's");
    assert!(from_old.arp.is_empty());
    assert_eq!(Heartbeat::decode(&new.encode()), Some(new.clone()));
    let keys = crate::ha::auth::Keys::new(&[vec![b'k'; 32]]).unwrap();
    let sealed = keys.seal(&new.encode());
    assert!(sealed.len() <= 1500, "{} bytes", sealed.len());
    assert_eq!(
        accept(&sealed, "198.18.0.1:7473".parse().unwrap(), &[("198.18.0.1:7473".parse().unwrap(), node)].into(), Some(&keys)).map(|h| h.arp.len()),
        Ok(PER_HEARTBEAT)
    );
}

/// Findings queued for a peer reach it in a heartbeat, with the sender's name;
/// other peers get none.
#[tokio::test]
async fn findings_reach_their_holder() {
    use crate::ha::arpcheck::{Finding, Outbox};
    let addrs = free_addrs(3);
    let link = |outbox: Outbox| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (ArpLink { outbox, reports: tx }, rx)
    };
    let (l0, mut r0) = link(Outbox::default());
    let (l2, mut r2) = link(Outbox::default());
    let out1 = Outbox::default();
    let (l1, _r1) = link(out1.clone());
    let _a = run(Options { arp: Some(l0), ..opts(&addrs, 0) }).await.unwrap();
    let _b = run(Options { arp: Some(l1), ..opts(&addrs, 1) }).await.unwrap();
    let _c = run(Options { arp: Some(l2), ..opts(&addrs, 2) }).await.unwrap();
    let f = Finding { vip: "198.18.1.10".parse().unwrap(), macs: vec!["02:00:00:00:00:bb".into()] };
    out1.push("n0", f.clone());
    let got = tokio::time::timeout(Duration::from_secs(2), r0.recv()).await.expect("a finding within 2 s");
    assert_eq!(got, Some(("n1".to_owned(), vec![f])));
    tokio::time::sleep(INTERVAL * 3).await;
    assert!(r2.try_recv().is_err(), "n2 holds nothing n1 checked");
}

/// Each agent's cluster-wide settings reach its peers (in the first
/// heartbeat, then every SETTINGS_EVERY), a change within SETTINGS_EVERY
/// intervals; a peer no longer configured is dropped when a task starts.
#[tokio::test]
async fn settings_reach_the_peers_and_follow_a_change() {
    let addrs = free_addrs(2);
    let link = |ours: &str| {
        let (tx, rx) = watch::channel(ours.to_owned());
        let (peers, heard) = watch::channel(BTreeMap::from([("gone".to_owned(), "deadAfter=1s".to_owned())]));
        (tx, SettingsLink { ours: rx, peers }, heard)
    };
    let (_ours0, l0, mut heard0) = link("deadAfter=300ms");
    let (ours1, l1, heard1) = link("deadAfter=1s");
    let _a = run(Options { settings: Some(l0), ..opts(&addrs, 0) }).await.unwrap();
    assert!(!heard0.borrow().contains_key("gone"), "not a configured peer");
    let _b = run(Options { settings: Some(l1), ..opts(&addrs, 1) }).await.unwrap();
    let until = |heard: &mut watch::Receiver<BTreeMap<String, String>>, want: &'static str| {
        let mut heard = heard.clone();
        async move {
            let wait = heard.wait_for(|m| m.get("n1").is_some_and(|s| s == want));
            tokio::time::timeout(INTERVAL * SETTINGS_EVERY as u32 * 3, wait).await.map(|_| ()).map_err(|_| heard.borrow().clone())
        }
    };
    until(&mut heard0, "deadAfter=1s").await.expect("n1's settings heard by n0");
    assert!(heard1.borrow().get("n0").is_none_or(|s| s == "deadAfter=300ms"));
    ours1.send_replace("deadAfter=300ms".into());
    until(&mut heard0, "deadAfter=300ms").await.expect("n1's changed settings heard by n0");
}

/// Free 127.0.0.1 ports: bound, then released for the tasks to bind.
fn free_addrs(n: usize) -> Vec<SocketAddr> {
    free_addrs_on("127.0.0.1".parse().unwrap(), n).unwrap()
}

/// Free ports on `lo`; an error where it cannot be bound (no IPv6 here).
fn free_addrs_on(lo: std::net::IpAddr, n: usize) -> io::Result<Vec<SocketAddr>> {
    let socks = (0..n).map(|_| std::net::UdpSocket::bind((lo, 0))).collect::<io::Result<Vec<_>>>()?;
    socks.iter().map(|s| s.local_addr()).collect()
}

const INTERVAL: Duration = Duration::from_millis(50);
const DEAD_AFTER: Duration = Duration::from_millis(200);

fn opts(addrs: &[SocketAddr], i: usize) -> Options {
    let peers = addrs.iter().enumerate().filter(|(j, _)| *j != i).map(|(j, a)| (format!("n{j}"), *a)).collect();
    Options {
        bind: addrs[i],
        peers,
        dead: BTreeSet::new(),
        silent: BTreeSet::new(),
        me: format!("n{i}"),
        interval: INTERVAL,
        dead_after: DEAD_AFTER,
        gate: None,
        metrics: None,
        keys: None,
        leave: None,
        arp: None,
        settings: None,
    }
}

async fn start(addrs: &[SocketAddr], i: usize) -> watch::Receiver<PeerSets> {
    run(opts(addrs, i)).await.unwrap()
}

/// Waits (bounded by `limit`) until `rx`'s live set is exactly `want`; returns how long it took.
async fn wait_for(rx: &mut watch::Receiver<PeerSets>, want: &[&str], limit: Duration) -> Duration {
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    let t0 = tokio::time::Instant::now();
    let reached = tokio::time::timeout(limit, rx.wait_for(|s| s.live == want)).await.is_ok();
    assert!(reached, "live set is {:?}, not {want:?}, after {limit:?}", rx.borrow().live);
    t0.elapsed()
}

/// A stopping agent's leaving heartbeats: its peer takes it out of the live
/// set at once (well before dead_after) and keeps it as leaving.
#[tokio::test]
async fn a_stopping_agent_is_out_of_the_live_set_at_once_and_leaving() {
    let addrs = free_addrs(2);
    let mut a = start(&addrs, 0).await;
    let (leave_tx, leave_rx) = watch::channel(None);
    let _b = run(Options { leave: Some(leave_rx), ..opts(&addrs, 1) }).await.unwrap();
    wait_for(&mut a, &["n0", "n1"], Duration::from_secs(1)).await;
    tokio::time::sleep(INTERVAL * 2).await;
    leave_tx.send_replace(Some(Duration::from_secs(30)));
    let took = wait_for(&mut a, &["n0"], Duration::from_secs(1)).await;
    assert!(took < DEAD_AFTER, "taken out after {took:?}: that is silence, not the leaving heartbeat");
    assert_eq!(a.borrow().leaving, BTreeSet::from(["n1".to_owned()]));
}

#[test]
fn presumed_peers_expire_unless_heard() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let mut t = PeerTable::new(ms(100));
    t.presume("a", t0);
    t.presume("b", t0);
    assert_eq!(t.live(), BTreeSet::from(["a".to_owned(), "b".to_owned()]));
    // Heard for the first time: no change (it was presumed alive).
    assert_eq!(t.observe("a", 7, 1, t0 + ms(50)), QUIET);
    assert_eq!(t.expire(t0 + ms(100)), vec![Event::Down { node: "b".into() }]);
    assert_eq!(t.live(), BTreeSet::from(["a".to_owned()]));
}

#[test]
fn our_own_gap_is_forgiven() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let table = || {
        let mut t = PeerTable::new(ms(100));
        t.observe("a", 1, 1, t0);
        t.observe("b", 1, 1, t0);
        t
    };
    // Without forgiveness, waking up after 500 ms blames the peers.
    assert_eq!(table().expire(t0 + ms(500)).len(), 2);
    // Forgiven: they get a fresh dead_after from the wake-up, then die if still silent.
    let mut t = table();
    t.forgive(t0 + ms(500));
    assert!(t.expire(t0 + ms(550)).is_empty());
    assert_eq!(t.observe("a", 1, 2, t0 + ms(560)), QUIET, "still alive: no event");
    assert_eq!(t.expire(t0 + ms(600)), vec![Event::Down { node: "b".into() }]);
}

/// A task that replaces one which saw a peer go down does not presume it
/// alive, and counts it live once heard.
#[tokio::test]
async fn peers_known_dead_are_not_presumed_alive() {
    let addrs = free_addrs(2);
    let mut o = opts(&addrs, 0);
    o.dead = BTreeSet::from(["n1".to_owned()]);
    let mut a = run(o).await.unwrap();
    assert_eq!(a.borrow().live, BTreeSet::from(["n0".to_owned()]));
    let _b = start(&addrs, 1).await;
    wait_for(&mut a, &["n0", "n1"], Duration::from_secs(1)).await;
}

#[tokio::test]
async fn a_stalled_main_loop_stops_the_heartbeats() {
    let addrs = free_addrs(2);
    let mut a = start(&addrs, 0).await;
    let last_turn = Arc::new(AtomicU64::new(crate::clock::monotonic_ns()));
    let mut o = opts(&addrs, 1);
    o.gate = Some((last_turn.clone(), Duration::from_millis(100)));
    let _b = run(o).await.unwrap();
    // Keep the gate open for a while: n0 keeps n1 past the presumption.
    let t0 = tokio::time::Instant::now();
    while t0.elapsed() < DEAD_AFTER * 2 {
        last_turn.store(crate::clock::monotonic_ns(), Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(a.borrow().live, BTreeSet::from(["n0".to_owned(), "n1".to_owned()]));
    // The main loop stops turning: n1's task keeps running but goes silent.
    wait_for(&mut a, &["n0"], Duration::from_secs(2)).await;
}

/// The IPv4 tests' exchange between IPv6 nodes, on [::1]: signed heartbeats
/// taken from the peers' addresses, a stopped one dropped after dead_after, a
/// sender at another port of the same address refused.
#[tokio::test]
async fn ipv6_agents_see_each_other_and_drop_a_stopped_one() {
    let addrs = match free_addrs_on("::1".parse().unwrap(), 3) {
        Ok(a) => a,
        Err(e) => return eprintln!("skipping: no [::1] here ({e})"),
    };
    let keys: super::super::auth::SharedKeys = Arc::new(std::sync::RwLock::new(Arc::new(super::super::auth::Keys::new(&[vec![7; 32]]).unwrap())));
    let mut a = run(Options { keys: Some(keys.clone()), ..opts(&addrs[..2], 0) }).await.unwrap();
    let metrics = Metrics::default();
    let b = run(Options { keys: Some(keys.clone()), metrics: Some(metrics.clone()), ..opts(&addrs[..2], 1) }).await.unwrap();
    wait_for(&mut a, &["n0", "n1"], Duration::from_secs(2)).await;
    let mut b = b;
    wait_for(&mut b, &["n0", "n1"], Duration::from_secs(2)).await;
    // n0's heartbeat from [::1] at a port no peer has: an unknown sender.
    let stranger = std::net::UdpSocket::bind(addrs[2]).unwrap();
    let hb = Heartbeat {
        v: Heartbeat::VERSION,
        node: "n0".into(),
        incarnation: u64::MAX,
        seq: 1,
        sent_ms: 0,
        leaving_ms: 0,
        arp: Vec::new(),
        settings: String::new(),
    };
    stranger.send_to(&keys.read().unwrap().seal(&hb.encode()), addrs[1]).unwrap();
    let unknown = || metrics.rejected.get_or_create(&RejectLabels { reason: Rejected::UnknownSender.name().into() }).get();
    let t0 = Instant::now();
    while unknown() == 0 && t0.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(unknown(), 1);
    drop(a);
    let took = wait_for(&mut b, &["n1"], Duration::from_secs(2)).await;
    assert!(took >= DEAD_AFTER - INTERVAL, "dropped after {took:?}");
}

#[tokio::test]
async fn three_agents_see_each_other_drop_and_readmit_a_stopped_one() {
    let addrs = free_addrs(3);
    let mut a = start(&addrs, 0).await;
    let mut b = start(&addrs, 1).await;
    let c = start(&addrs, 2).await;
    let all = ["n0", "n1", "n2"];
    wait_for(&mut a, &all, Duration::from_secs(2)).await;
    wait_for(&mut b, &all, Duration::from_secs(2)).await;
    let mut c = c;
    wait_for(&mut c, &all, Duration::from_secs(2)).await;

    drop(c); // stops n2's task
    let stopped = tokio::time::Instant::now();
    wait_for(&mut a, &["n0", "n1"], Duration::from_secs(2)).await;
    wait_for(&mut b, &["n0", "n1"], Duration::from_secs(2)).await;
    // Its last heartbeat went out at most `INTERVAL` before the stop; allow one
    // tick for the expiry check and scheduling slack.
    let took = stopped.elapsed();
    assert!(took <= DEAD_AFTER + INTERVAL + Duration::from_millis(50), "dropped after {took:?}");
    assert!(took >= DEAD_AFTER - INTERVAL, "dropped after {took:?}, before it could have been silent for dead_after");

    // Restart n2 on the same address (the old socket closes as its task ends).
    let mut c = loop {
        match run(opts(&addrs, 2)).await {
            Ok(rx) => break rx,
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && stopped.elapsed() < Duration::from_secs(2) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => panic!("rebinding n2: {e}"),
        }
    };
    wait_for(&mut a, &all, Duration::from_secs(1)).await;
    wait_for(&mut c, &all, Duration::from_secs(1)).await;
}

#[test]
fn a_peer_silent_for_half_of_dead_after_is_late_until_heard_and_a_leaving_one_never() {
    let t0 = Instant::now();
    let ms = |m: u64| t0 + Duration::from_millis(m);
    let mut t = PeerTable::new(DEAD);
    t.observe("a", 7, 1, t0);
    t.observe("b", 7, 1, t0);
    assert!(t.mark_late(ms(1499)).is_empty());
    assert_eq!(t.mark_late(ms(1500)), vec![Event::Late { node: "a".into() }, Event::Late { node: "b".into() }]);
    // Reported once; still alive, and silent, until declared dead.
    assert!(t.mark_late(ms(2000)).is_empty());
    assert_eq!(t.silent(), BTreeSet::from(["a".to_owned(), "b".to_owned()]));
    assert_eq!(t.live().len(), 2);
    // b heard in time: no longer silent. a dead: silent still.
    assert_eq!(t.observe("b", 7, 2, ms(2500)), Seen::Fresh(Some(Event::OnTime { node: "b".into() })));
    assert_eq!(t.expire(ms(3000)), vec![Event::Down { node: "a".into() }]);
    assert_eq!(t.silent(), BTreeSet::from(["a".to_owned()]));
    // A restart (a new incarnation) ends it.
    assert_eq!(t.observe("a", 8, 1, ms(4000)), up("a", 8));
    assert!(t.silent().is_empty());
    // A leaving peer stays out of it: it said it stops, and is a backend anyway.
    t.observe_leaving("b", 7, 3, Duration::from_secs(30), ms(4000));
    assert!(t.mark_late(ms(9000)).iter().all(|e| *e != Event::Late { node: "b".into() }));
    assert!(!t.silent().contains("b"));
}

#[test]
fn a_silent_peer_carried_into_a_new_table_stays_silent_until_heard() {
    let t0 = Instant::now();
    let mut t = PeerTable::new(DEAD);
    // Dead in the replaced table (not presumed), and late but alive.
    t.carry_silent("a", t0);
    t.presume("b", t0);
    t.carry_silent("b", t0);
    assert_eq!(t.silent(), BTreeSet::from(["a".to_owned(), "b".to_owned()]));
    assert_eq!(t.live(), BTreeSet::from(["b".to_owned()]));
    // Not reported late again; heard, it is alive and no longer silent.
    assert!(t.mark_late(t0 + DEAD).is_empty());
    assert_eq!(t.observe("a", 9, 1, t0 + DEAD), up("a", 9));
    assert_eq!(t.silent(), BTreeSet::from(["b".to_owned()]));
}
