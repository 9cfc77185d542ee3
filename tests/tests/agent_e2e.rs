//! One `vip-agent run --config` drives a load-balancer node in front of three
//! backend namespaces: connections spread over all three; a backend that stops
//! answering leaves the ring (health checks), comes back after recovery; the
//! config file is re-read live, a bad file is rejected and the last good state
//! keeps forwarding. Real packets, real processes, lab addresses only.
use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::Value;
use vip_tests::{
    agent::{agent_bin, wait_for, AgentProc},
    lab::{accept_vip, fetch, name_server, Segment},
    netns::{privileged, unique, NetNs, PinDir},
};

const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 10);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const INTERVAL_MS: u64 = 100;
const TIMEOUT_MS: u64 = 50;
const FALL: u64 = 3;
const RISE: u64 = 2;

fn config(ports: &str, extra_node_key: &str) -> String {
    format!(
        r#"# lab: one load balancer node, three backends
nodes:
  - name: lb
    address: 198.18.0.1
    labels: {{role: lb}}{extra_node_key}
  - {{name: b1, address: 198.18.0.11, labels: {{role: backend}}}}
  - {{name: b2, address: 198.18.0.12, labels: {{role: backend}}}}
  - {{name: b3, address: 198.18.0.13, labels: {{role: backend}}}}
pools:
  - name: lab
    addresses: [198.18.1.10]
    nodeSelector: {{role: lb}}
services:
  - name: web
    vip: 198.18.1.10
    ports: [{ports}]
    tableSize: 251
    backendSelector: {{role: backend}}
    healthCheck: {{type: tcp, port: 80, interval: {INTERVAL_MS}ms, timeout: {TIMEOUT_MS}ms, rise: {RISE}, fall: {FALL}}}
announce:
  holdTime: 900ms
"#
    )
}

fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn status(path: &Path) -> Option<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// (healthy, in_ring) of `node` in the agent's status.
fn backend_state(path: &Path, node: &str) -> Option<(bool, bool)> {
    let s = status(path)?;
    let b = s["backends"].as_array()?.iter().find(|b| b["node"] == node)?.clone();
    Some((b["healthy"].as_bool()?, b["in_ring"].as_bool()?))
}

/// `count` connections from the client (source ports from `first_port`): answers by backend name.
fn spread(client: &NetNs, first_port: u16, count: u16) -> BTreeMap<String, u32> {
    client
        .run(move || {
            let mut seen = BTreeMap::new();
            for i in 0..count {
                let who = fetch(CLIENT, first_port + i, SocketAddr::from((VIP, 80))).unwrap_or_else(|e| format!("error: {e}"));
                *seen.entry(who).or_insert(0) += 1;
            }
            seen
        })
        .unwrap()
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

struct Backend {
    ns: NetNs,
    stop: Arc<AtomicBool>,
}

impl Backend {
    fn serve(&mut self, name: &str) {
        self.stop = Arc::new(AtomicBool::new(false));
        name_server(&self.ns, 80, name.to_owned(), self.stop.clone()).unwrap();
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn agent_spreads_tracks_health_and_reloads_live() {
    if !privileged() {
        return;
    }
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let tmp = TempDir(std::env::temp_dir().join(unique("vip-agent-e2e-")));
    std::fs::create_dir_all(&tmp.0).unwrap();
    let (cfg, status_file, log) = (tmp.0.join("vip.yaml"), tmp.0.join("status.json"), tmp.0.join("agent.log"));
    write_atomic(&cfg, &config("80", ""));

    let seg = Segment::new().unwrap();
    let lb = seg.host("vlb", "198.18.0.1/24").unwrap();
    let client = seg.host("vcl", "198.18.0.100/24").unwrap();
    // VIPs are on-link for the client: it ARPs for them on the segment.
    client.ip(&["route", "add", "198.18.1.0/24", "dev", "eth0"]).unwrap();
    let mut backends: Vec<Backend> = (1..=3)
        .map(|i| {
            let ns = seg.host(&format!("vb{i}"), &format!("198.18.0.1{i}/24")).unwrap();
            accept_vip(&ns, VIP).unwrap();
            let mut b = Backend { ns, stop: Arc::new(AtomicBool::new(true)) };
            b.serve(&format!("b{i}"));
            b
        })
        .collect();
    let pins = PinDir::new().unwrap();
    let pin_dir = pins.path.to_str().unwrap().to_owned();
    let mut agent = AgentProc::start(
        &lb,
        &[
            "--config", cfg.to_str().unwrap(), "--node-name", "lb", "--iface", "eth0", "--mode", "generic",
            "--pin-dir", &pin_dir, "--status-file", status_file.to_str().unwrap(), "--reload-interval", "100ms",
            "--metrics-addr", "127.0.0.1:9472",
        ],
        &log,
    )
    .unwrap();

    // Up: the VIP held, all three backends resolved (MACs from the neighbour table) and in the ring.
    let ready = wait_for(Duration::from_secs(10), || {
        let s = status(&status_file)?;
        let ok = s["held"].as_array()?.len() == 1 && s["services"][0]["backends"].as_array()?.len() == 3;
        ok.then_some(())
    });
    agent.check_alive().unwrap();
    assert!(ready.is_some(), "agent not ready in 10 s; status {:?}; log:\n{}", status(&status_file), agent.log_text());

    let seen = spread(&client, 40000, 30);
    assert_eq!(seen.keys().map(String::as_str).collect::<Vec<_>>(), ["b1", "b2", "b3"], "30 connections: {seen:?}");

    // b2 stops answering: it leaves the ring within interval × fall (+ the probe timeout).
    let down_at = Instant::now();
    backends[1].stop.store(true, Ordering::Relaxed);
    let bound = Duration::from_millis(INTERVAL_MS * FALL + TIMEOUT_MS);
    let left = wait_for(bound + Duration::from_secs(3), || (backend_state(&status_file, "b2")? == (false, false)).then_some(()));
    let took = down_at.elapsed();
    assert!(left.is_some(), "b2 still in the ring after {took:?}; log:\n{}", agent.log_text());
    eprintln!("b2 left the ring {took:?} after its server stopped (bound {bound:?} + polling)");
    // The margin covers the server thread's 2 ms accept poll, the status write and this poll.
    assert!(took <= bound + Duration::from_millis(500), "took {took:?}, bound {bound:?}");
    let seen = spread(&client, 41000, 30);
    assert_eq!(seen.keys().map(String::as_str).collect::<Vec<_>>(), ["b1", "b3"], "with b2 down: {seen:?}");

    // inspect shows it, from the pinned maps and the status file.
    let out = std::process::Command::new(agent_bin().unwrap())
        .args(["--pin-dir", &pin_dir, "inspect", "--json", "--status-file", status_file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "inspect: {}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = report["agent"]["backends"].as_array().unwrap();
    let row = |n: &str| rows.iter().find(|r| r["node"] == n).unwrap().clone();
    assert_eq!((row("b2")["healthy"].as_bool(), row("b2")["ring_share_pct"].as_f64()), (Some(false), Some(0.0)));
    let shares = row("b1")["ring_share_pct"].as_f64().unwrap() + row("b3")["ring_share_pct"].as_f64().unwrap();
    assert!((shares - 100.0).abs() < 1e-6, "b1 + b3 hold the whole ring: {shares}");
    let text = std::process::Command::new(agent_bin().unwrap())
        .args(["--pin-dir", &pin_dir, "inspect", "--status-file", status_file.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.lines().any(|l| l.contains("b2") && l.contains("DOWN")), "inspect table:\n{text}");

    // Metrics and probes.
    let m = http_get(&lb, 9472, "/metrics");
    assert!(m.contains(r#"vip_backend_healthy{service="web",node="b2"} 0"#), "{m}");
    assert!(m.contains(r#"vip_backend_healthy{service="web",node="b1"} 1"#), "{m}");
    assert!(m.contains(r#"vip_owner{vip="198.18.1.10",node="lb"} 1"#), "{m}");
    assert!(m.lines().any(|l| l.starts_with(r#"vip_xdp_packets_total{reason="forwarded"}"#)), "{m}");
    assert!(m.contains("vip_health_to_maps_seconds_count 1"), "one health change so far: {m}");
    assert!(http_get(&lb, 9472, "/healthz").starts_with("HTTP/1.1 200"));
    assert!(http_get(&lb, 9472, "/readyz").starts_with("HTTP/1.1 200"));

    // b2 recovers: back after `rise` successes.
    backends[1].serve("b2");
    let back = wait_for(Duration::from_millis(INTERVAL_MS * (RISE + 1)) + Duration::from_secs(3), || {
        (backend_state(&status_file, "b2")? == (true, true)).then_some(())
    });
    assert!(back.is_some(), "b2 did not come back; log:\n{}", agent.log_text());
    let seen = spread(&client, 42000, 30);
    assert_eq!(seen.keys().map(String::as_str).collect::<Vec<_>>(), ["b1", "b2", "b3"], "b2 back: {seen:?}");

    // Live reload: a second port appears in the maps without a restart.
    write_atomic(&cfg, &config("80, 8080", ""));
    let added = wait_for(Duration::from_secs(5), || {
        let s = status(&status_file)?;
        s["services"].as_array()?.iter().any(|v| v["port"] == 8080).then_some(s["config"]["generation"].as_u64()?)
    });
    assert_eq!(added, Some(2), "port 8080 not applied; log:\n{}", agent.log_text());

    // A bad file is rejected with its field path and line; the last good state keeps forwarding.
    write_atomic(&cfg, &config("80, 8080", "\n    colour: red"));
    let err = wait_for(Duration::from_secs(5), || status(&status_file)?["config"]["error"].as_str().map(str::to_owned));
    let err = err.unwrap_or_else(|| panic!("bad config not reported; log:\n{}", agent.log_text()));
    assert_eq!(err, "line 6: nodes[0].colour: unknown field `colour`, expected one of `name`, `address`, `mac`, `labels`");
    assert!(agent.log_text().contains("config rejected; the last good config keeps running"));
    assert!(http_get(&lb, 9472, "/metrics").contains("vip_config_valid 0"));
    assert_eq!(status(&status_file).unwrap()["config"]["generation"], 2);
    let seen = spread(&client, 43000, 12);
    assert!(seen.keys().all(|k| k.starts_with('b')), "still forwarding on the last good state: {seen:?}");

    // Fixed again: the error clears.
    write_atomic(&cfg, &config("80", ""));
    let fixed = wait_for(Duration::from_secs(5), || {
        let s = status(&status_file)?;
        (s["config"]["error"].is_null() && s["config"]["generation"] == 3 && s["services"].as_array()?.len() == 1).then_some(())
    });
    assert!(fixed.is_some(), "fixed config not applied; log:\n{}", agent.log_text());
    agent.check_alive().unwrap();
    drop(backends);
}
