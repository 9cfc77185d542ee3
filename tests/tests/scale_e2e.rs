//! Liveness at real scale, with the defaults a new user gets: three real agents,
//! 1,000 VIPs × 2 ports (default table size 16381, default timers), every flow
//! table full (1M entries), `/metrics` scraped five times a second on every
//! agent. One backend's server stops: every service's ring changes on every
//! agent. Nothing of that may reach liveness: no heartbeat stall, no peer
//! declared dead, no VIP moved, one ARP answer per VIP.
use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    path::Path,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use vip_agent::dataplane::Dataplane;
use vip_common::MAX_FLOWS;
use vip_tests::{
    agent::{agent_bin, wait_for},
    flows,
    halab::{metric, metric_sum_max, scrape_every, vip, HaLab, HaSpec, Naming, CLIENT},
    netns::privileged,
};

#[test]
fn a_health_change_on_2000_services_with_full_flow_tables_never_touches_liveness() {
    if !privileged() {
        return;
    }
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let spec = HaSpec { vips: 1000, ports: vec![80, 8080], table_size: None, default_timers: true, check_interval_ms: 200, ..Default::default() };
    let t0 = Instant::now();
    let mut lab = HaLab::start(spec, Naming::Unique, Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap();
    let all = [0, 1, 2];
    let owners = lab.wait_converged(&all, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e:#}"));
    lab.wait_rings_full(&all, Duration::from_secs(60)).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("1,000 VIPs × 2 ports converged on three agents {:?} after start", t0.elapsed());

    // Every flow table full: flows of every service, pinned to every backend.
    let vips: Vec<Ipv4Addr> = (0..1000).map(vip).collect();
    for n in &lab.nodes {
        // Read until all three are there: once, on a loaded machine, a read right
        // after the status showed full rings found two (not understood yet).
        let ids = wait_for(Duration::from_secs(10), || {
            let ids: Vec<u32> = Dataplane::open(&n.pins.path).unwrap().backends().unwrap().into_keys().collect();
            (ids.len() == 3).then_some(ids)
        })
        .unwrap_or_else(|| panic!("{}: three backends in lb4_backends", n.name));
        let count = flows::fill(&n.pins.path, &flows::synthetic(MAX_FLOWS as usize, &vips, 80, &ids)).unwrap();
        // Four ways a set: as many random flows as entries fill about 80% (see flows::fill).
        assert!(count as u32 >= MAX_FLOWS * 3 / 4, "flow table of {} not full: {count}", n.name);
    }

    let before: Vec<String> = (0..3).map(|i| lab.metrics(i)).collect();
    let logs_before: Vec<usize> = lab.nodes.iter().map(|n| std::fs::read_to_string(&n.log).unwrap().matches("peer liveness changed").count()).collect();
    // Scrapers: every agent's /metrics five times a second until the end.
    let stop = Arc::new(AtomicBool::new(false));
    let scrapers = scrape_every(&lab, Duration::from_millis(200), &stop);

    // node-3's server stops: its health check fails on every agent, and every
    // service's ring loses it.
    std::thread::sleep(Duration::from_secs(1));
    if let Some(mut s) = lab.nodes[2].server.take() {
        let _ = s.kill();
        let _ = s.wait();
    }
    let out = wait_for(Duration::from_secs(30), || {
        all.iter().all(|&i| lab.status(i).is_some_and(|s| s.services.len() == 2000 && s.services.iter().all(|x| x.backends.len() == 2))).then_some(())
    });
    assert!(out.is_some(), "node-3 did not leave every ring within 30 s\n{}", lab.agent_logs());
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let scrapes: Vec<u32> = scrapers.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(scrapes.iter().all(|&n| n >= 5), "scrapes that succeeded: {scrapes:?}");

    for (i, n) in lab.nodes.iter().enumerate() {
        let m = lab.metrics(i);
        let stalls = metric(&m, "vip_liveness_stalls_total").unwrap();
        let gap = metric_sum_max(&m, "vip_heartbeat_gap_max_seconds").1;
        let evicted = metric(&m, "vip_flows_evicted_total").unwrap();
        let to_maps = lab.status(i).unwrap().health_to_maps_us.into_iter().max().unwrap_or(0);
        eprintln!(
            "{}: health change → rings written {to_maps} µs; flows evicted {evicted}; largest heartbeat gap {:.0} ms; stalls {stalls}",
            n.name,
            gap * 1000.0
        );
        assert_eq!(stalls, metric(&before[i], "vip_liveness_stalls_total").unwrap(), "{}: liveness stalled\n{}", n.name, lab.agent_logs());
        // deadAfter is 300 ms by default.
        assert!(gap < 0.3, "{}: a peer's heartbeats were {gap} s apart", n.name);
        assert!(evicted > 0.0, "{}: flows pinned to node-3 were not evicted", n.name);
        let log = std::fs::read_to_string(&n.log).unwrap();
        for l in log.lines().filter(|l| l.contains("services written") || l.contains("flow table swept")).rev().take(2) {
            eprintln!("  {}", l.split_once("INFO ").map_or(l, |x| x.1));
        }
        let changes = log.matches("peer liveness changed").count();
        assert_eq!(changes, logs_before[i], "{}: a peer was declared dead or came back\n{}", n.name, lab.agent_logs());
        let moved = |m: &str| metric_sum_max(m, "vip_pool_owner_changes_total").0;
        assert_eq!(moved(&m), moved(&before[i]), "{}: VIPs moved", n.name);
    }
    assert_eq!(lab.wait_converged(&all, Duration::from_secs(5)).unwrap(), owners, "owners changed");
    // A sample of VIPs: each answered by its owner alone.
    for k in [0, 333, 999] {
        let v = vip(k);
        let o = lab.client.cmd("arping").args(["-c", "2", "-w", "2", "-I", "eth0", &v.to_string()]).output().unwrap();
        let macs: BTreeSet<String> =
            String::from_utf8_lossy(&o.stdout).split(['[', ']']).filter(|w| w.len() == 17 && w.matches(':').count() == 5).map(str::to_owned).collect();
        assert_eq!(macs.len(), 1, "ARP for {v} from {CLIENT}: {macs:?}");
    }
    for a in lab.nodes.iter_mut().filter_map(|n| n.agent.as_mut()) {
        a.check_alive().unwrap();
    }
}
