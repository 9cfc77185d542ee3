//! One `vip-agent run --config` drives a load-balancer node in front of three
//! backend namespaces: connections spread over all three; a backend that stops
//! answering leaves the ring (health checks), comes back after recovery; the
//! config file is re-read live, a bad file is rejected and the last good state
//! keeps forwarding. Real packets, lab addresses only; the first test runs the
//! agent in this process (`agent::run` with its shutdown future), the second
//! the binary.
use std::{
    io::{Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use serde_json::Value;
use vip_tests::{
    agent::{agent_bin, lb_config, wait_for, write_atomic, Check, LabAgent, LbLab},
    netns::{privileged, NetNs},
};

const CHECK: Check = Check { interval_ms: 100, timeout_ms: 50, rise: 2, fall: 3 };

fn names(seen: &std::collections::BTreeMap<String, u32>) -> Vec<&str> {
    seen.keys().map(String::as_str).collect()
}

fn http_get(ns: &NetNs, port: u16, path: &'static str) -> String {
    ns.run(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the agent's HTTP port");
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
    .unwrap()
}

#[test]
fn agent_spreads_tracks_health_and_reloads_live() {
    if !privileged() {
        return;
    }
    let mut lab = LbLab::start_with(3, &lb_config(3, "80", CHECK, ""), 9472, true).unwrap();
    // Up: the VIP held, all three backends resolved (MACs from the neighbour table) and in the ring.
    lab.wait_ready(Duration::from_secs(10)).unwrap();
    let seen = lab.spread(40000, 30).unwrap();
    assert_eq!(names(&seen), ["b1", "b2", "b3"], "30 connections: {seen:?}");

    // b2 stops answering: it leaves the ring within interval × fall (+ the probe timeout).
    let down_at = Instant::now();
    lab.backends[1].halt();
    let bound = Duration::from_millis(CHECK.interval_ms * u64::from(CHECK.fall) + CHECK.timeout_ms);
    let left = wait_for(bound + Duration::from_secs(3), || (lab.backend_state("b2")? == (false, false)).then_some(()));
    let took = down_at.elapsed();
    assert!(left.is_some(), "b2 still in the ring after {took:?}; log:\n{}", lab.agent.log_text());
    eprintln!("b2 left the ring {took:?} after its server stopped (bound {bound:?} + polling)");
    // The margin covers the server thread's 2 ms accept poll, the status write and this poll.
    assert!(took <= bound + Duration::from_millis(500), "took {took:?}, bound {bound:?}");
    let seen = lab.spread(41000, 30).unwrap();
    assert_eq!(names(&seen), ["b1", "b3"], "with b2 down: {seen:?}");

    // inspect shows it, from the pinned maps and the status file.
    let pin_dir = lab.pins.path.to_str().unwrap().to_owned();
    let status_file = lab.status_file.to_str().unwrap().to_owned();
    let inspect = |json: bool| {
        let mut c = std::process::Command::new(agent_bin().unwrap());
        c.args(["--pin-dir", &pin_dir, "inspect", "--status-file", &status_file]);
        if json {
            c.arg("--json");
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "inspect: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let report: Value = serde_json::from_str(&inspect(true)).unwrap();
    let rows = report["agent"]["backends"].as_array().unwrap();
    let row = |n: &str| rows.iter().find(|r| r["node"] == n).unwrap().clone();
    assert_eq!((row("b2")["healthy"].as_bool(), row("b2")["ring_share_pct"].as_f64()), (Some(false), Some(0.0)));
    let shares = row("b1")["ring_share_pct"].as_f64().unwrap() + row("b3")["ring_share_pct"].as_f64().unwrap();
    assert!((shares - 100.0).abs() < 1e-6, "b1 + b3 hold the whole ring: {shares}");
    let text = inspect(false);
    assert!(text.lines().any(|l| l.contains("b2") && l.contains("DOWN")), "inspect table:\n{text}");

    // Metrics and probes.
    let m = http_get(&lab.lb, 9472, "/metrics");
    assert!(m.contains(r#"vip_backend_healthy{node="b2",check="tcp:80"} 0"#), "{m}");
    assert!(m.contains(r#"vip_backend_healthy{node="b1",check="tcp:80"} 1"#), "{m}");
    assert!(m.contains(r#"vip_owner{vip="198.18.1.10",node="lb"} 1"#), "{m}");
    assert!(m.lines().any(|l| l.starts_with(r#"vip_xdp_packets_total{reason="forwarded"}"#)), "{m}");
    assert!(m.contains("vip_health_to_maps_seconds_count 1"), "one health change so far: {m}");
    // The data path's counters by what they count, never by id.
    assert!(m.lines().any(|l| l.starts_with(r#"vip_service_packets_total{service="web",vip="198.18.1.10",port="80",protocol="tcp"} "#)), "{m}");
    for b in ["b1", "b3"] {
        assert!(m.lines().any(|l| l.starts_with(&format!(r#"vip_backend_packets_total{{node="{b}"}} "#))), "{m}");
    }
    // b2 is in no ring now: its backend entry, and so its series, are gone.
    assert!(!m.contains(r#"vip_backend_packets_total{node="b2"}"#), "{m}");
    assert!(m.contains("vip_build_info{version=") && m.contains("vip_config_valid 1") && !m.contains("vip_kube_api"), "file mode: {m}");
    assert!(http_get(&lab.lb, 9472, "/healthz").starts_with("HTTP/1.1 200"));
    assert!(http_get(&lab.lb, 9472, "/readyz").starts_with("HTTP/1.1 200"));

    // b2 recovers: back after `rise` successes.
    lab.backends[1].serve().unwrap();
    let back = wait_for(Duration::from_millis(CHECK.interval_ms * u64::from(CHECK.rise + 1)) + Duration::from_secs(3), || {
        (lab.backend_state("b2")? == (true, true)).then_some(())
    });
    assert!(back.is_some(), "b2 did not come back; log:\n{}", lab.agent.log_text());
    let seen = lab.spread(42000, 30).unwrap();
    assert_eq!(names(&seen), ["b1", "b2", "b3"], "b2 back: {seen:?}");

    // Live reload: a second port appears in the maps without a restart.
    write_atomic(&lab.config, &lb_config(3, "80, 8080", CHECK, "")).unwrap();
    let added = wait_for(Duration::from_secs(5), || {
        let s = lab.status()?;
        s.services.iter().any(|v| v.port == 8080).then_some(s.config.generation)
    });
    assert_eq!(added, Some(2), "port 8080 not applied; log:\n{}", lab.agent.log_text());
    let m = http_get(&lab.lb, 9472, "/metrics");
    assert!(m.contains(r#"vip_ring_updates_total{service="web",vip="198.18.1.10",port="8080",protocol="tcp"} 1"#), "{m}");

    // A bad file is rejected with its field path and line; the last good state keeps forwarding.
    write_atomic(&lab.config, &lb_config(3, "80, 8080", CHECK, "\n    colour: red")).unwrap();
    let err = wait_for(Duration::from_secs(5), || lab.status()?.config.error);
    let err = err.unwrap_or_else(|| panic!("bad config not reported; log:\n{}", lab.agent.log_text()));
    assert_eq!(err, "line 6: nodes[0].colour: unknown field `colour`, expected one of `name`, `address`, `mac`, `labels`");
    assert!(lab.agent.log_text().contains("config rejected; the last good config keeps running"));
    assert!(http_get(&lab.lb, 9472, "/metrics").contains("vip_config_valid 0"));
    assert_eq!(lab.status().unwrap().config.generation, 2);
    let seen = lab.spread(43000, 12).unwrap();
    assert!(seen.keys().all(|k| k.starts_with('b')), "still forwarding on the last good state: {seen:?}");

    // Fixed again: the error clears.
    write_atomic(&lab.config, &lb_config(3, "80", CHECK, "")).unwrap();
    let fixed = wait_for(Duration::from_secs(5), || {
        let s = lab.status()?;
        (s.config.error.is_none() && s.config.generation == 3 && s.services.len() == 1).then_some(())
    });
    assert!(fixed.is_some(), "fixed config not applied; log:\n{}", lab.agent.log_text());
    // Port 8080 is gone, and so are its series.
    let m = http_get(&lab.lb, 9472, "/metrics");
    assert!(!m.contains(r#"port="8080""#) && m.contains(r#"port="80""#), "{m}");
    lab.agent.check_alive().unwrap();

    // Stopped through its shutdown future: `run` returns Ok, having told its
    // (absent) peers; the data path keeps forwarding on the last state.
    let LabAgent::InProcess(agent) = &mut lab.agent else { unreachable!("started in-process") };
    let stop_at = Instant::now();
    agent.stop().unwrap();
    eprintln!("run returned {:?} after its shutdown future completed", stop_at.elapsed());
    assert!(agent.log_text().contains("stopping; the data path keeps running on the last state"), "{}", agent.log_text());
    let seen = lab.spread(43100, 30).unwrap();
    assert_eq!(names(&seen), ["b1", "b2", "b3"], "forwarding after the agent stopped: {seen:?}");
}

/// Every backend's health check fails (it probes a port nothing listens on, as when
/// kube-proxy's health server is down everywhere) while the service port still
/// answers: by default the service fails open and connections still reach all
/// three; with `noHealthyBackend: Drop` its ring is empty and they are dropped.
#[test]
fn every_check_down_fails_open_or_drops_as_configured() {
    if !privileged() {
        return;
    }
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let config =
        |extra: &str| lb_config(3, "80", CHECK, "").replace("healthCheck: {type: tcp, port: 80,", &format!("{extra}healthCheck: {{type: tcp, port: 81,"));
    let mut lab = LbLab::start(3, &config(""), 9473).unwrap();
    let failing_open = wait_for(Duration::from_secs(10), || {
        let s = lab.status()?;
        let web = s.services.first()?;
        (web.failing_open && web.backends.len() == 3 && s.held.len() == 1).then_some(())
    });
    assert!(failing_open.is_some(), "not failing open; status {:?}; log:\n{}", lab.status(), lab.agent.log_text());
    let seen = lab.spread(44000, 30).unwrap();
    assert_eq!(names(&seen), ["b1", "b2", "b3"], "every check down, failing open: {seen:?}");
    let m = http_get(&lab.lb, 9473, "/metrics");
    assert!(m.contains(r#"vip_service_failing_open{service="web",vip="198.18.1.10",port="80",protocol="tcp"} 1"#), "{m}");
    assert!(m.contains(r#"vip_backend_healthy{node="b1",check="tcp:81"} 0"#), "{m}");
    assert!(lab.agent.log_text().contains("failing open"), "{}", lab.agent.log_text());

    // Drop: the ring empties and connections are dropped in XDP.
    write_atomic(&lab.config, &config("noHealthyBackend: Drop\n    ")).unwrap();
    let dropping = wait_for(Duration::from_secs(5), || {
        let s = lab.status()?;
        let web = s.services.first()?;
        (s.config.generation == 2 && !web.failing_open && web.backends.is_empty()).then_some(())
    });
    assert!(dropping.is_some(), "ring not emptied; status {:?}; log:\n{}", lab.status(), lab.agent.log_text());
    let seen = lab.spread(45000, 2).unwrap();
    assert!(seen.keys().all(|k| k.starts_with("error")), "dropped: {seen:?}");
    let m = http_get(&lab.lb, 9473, "/metrics");
    assert!(!m.contains("vip_service_failing_open{"), "{m}");
    let dropped = m.lines().find_map(|l| l.strip_prefix(r#"vip_xdp_packets_total{reason="drop_no_backend"} "#)).and_then(|v| v.parse::<f64>().ok());
    assert!(dropped.is_some_and(|n| n >= 2.0), "drop_no_backend counted: {m}");
    lab.agent.check_alive().unwrap();
}
