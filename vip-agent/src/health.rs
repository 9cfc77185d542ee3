//! Health checks of backend nodes: TCP connect or HTTP GET, with interval,
//! timeout and rise/fall thresholds. One probe task per (node, check); state
//! changes go to the agent loop as events stamped with the moment they happened,
//! so the agent can measure health change → maps updated.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    sync::mpsc,
    task::JoinHandle,
};
use tracing::{info, warn};

use crate::model::{HealthCheck, Probe};

/// What is probed: a node (by name and address) with one check.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target {
    pub node: String,
    pub addr: IpAddr,
    pub check: HealthCheck,
}

/// A backend went up or down, at `at` (when the deciding probe finished), as the
/// probe task `task` found (see [`Monitor::current`]).
#[derive(Clone, Debug)]
pub struct HealthChange {
    pub target: Target,
    pub up: bool,
    pub at: Instant,
    pub detail: String,
    pub task: u64,
}

/// Rise/fall thresholds over consecutive probe results. The targets of an agent's
/// first model start up, so that a restart does not empty rings while the first
/// probes run, and so do targets whose node and probe were already probed (a
/// reload that changes only timings); `fall` failures take them out. A node newly
/// probed later (a `Local` Service's new endpoint, a new node) starts down and
/// joins after `rise` successes: until kube-proxy there has programmed the
/// endpoint, its health port says no and traffic sent there would be dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thresholds {
    pub up: bool,
    /// Consecutive results disagreeing with `up`.
    streak: u32,
}

impl Thresholds {
    pub fn new() -> Self {
        Self { up: true, streak: 0 }
    }

    /// A target that joins: down until `rise` successes.
    pub fn joining() -> Self {
        Self { up: false, streak: 0 }
    }

    /// Records one probe result; returns the new state when it flips.
    pub fn record(&mut self, ok: bool, rise: u32, fall: u32) -> Option<bool> {
        if ok == self.up {
            self.streak = 0;
            return None;
        }
        self.streak += 1;
        let needed = if self.up { fall } else { rise };
        if self.streak >= needed {
            self.up = ok;
            self.streak = 0;
            return Some(ok);
        }
        None
    }
}

impl Default for Thresholds {
    fn default() -> Self {
        Self::new()
    }
}

/// Why a probe failed (the last one is shown in the status's health detail).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("connect {addr}: {source}")]
    Connect { addr: SocketAddr, source: std::io::Error },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: SocketAddr, timeout: Duration },
    #[error("send: {0}")]
    Send(std::io::Error),
    #[error("read: {0}")]
    Read(std::io::Error),
    #[error("GET {path}: status {code}")]
    Status { path: String, code: u16 },
    #[error("GET {path}: not an HTTP response: {line:?}")]
    NotHttp { path: String, line: String },
}

/// One probe: Ok, or why it failed.
pub async fn probe(addr: IpAddr, check: &HealthCheck) -> Result<(), ProbeError> {
    let (port, path) = match &check.probe {
        Probe::Tcp { port } => (*port, None),
        Probe::Http { port, path } => (*port, Some(path.as_str())),
    };
    let sa = SocketAddr::from((addr, port));
    let attempt = async {
        let mut s = TcpStream::connect(sa).await.map_err(|source| ProbeError::Connect { addr: sa, source })?;
        let Some(path) = path else { return Ok(()) };
        http_get_status(&mut s, &host_header(sa), path).await
    };
    match tokio::time::timeout(check.timeout, attempt).await {
        Ok(r) => r,
        Err(_) => Err(ProbeError::Timeout { addr: sa, timeout: check.timeout }),
    }
}

/// The Host header's value for a probe of `sa`: the IPv4 address alone, as ever;
/// an IPv6 address in brackets (RFC 3986's IP-literal) with the port.
fn host_header(sa: SocketAddr) -> String {
    match sa {
        SocketAddr::V4(v4) => v4.ip().to_string(),
        SocketAddr::V6(_) => sa.to_string(),
    }
}

/// HTTP/1.1 GET: success is a 2xx or 3xx status line. Hand-written on purpose: a
/// probe needs only the status line (no TLS, no body, no redirects followed), and
/// a client library would add a connection pool whose reuse hides a dead server.
async fn http_get_status(s: &mut TcpStream, host: &str, path: &str) -> Result<(), ProbeError> {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: vip-agent\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.map_err(ProbeError::Send)?;
    let mut buf = [0u8; 64];
    let mut n = 0;
    // Up to the end of the status line ("HTTP/1.1 200 OK\r\n").
    while n < buf.len() && !buf[..n].contains(&b'\n') {
        let r = s.read(&mut buf[n..]).await.map_err(ProbeError::Read)?;
        if r == 0 {
            break;
        }
        n += r;
    }
    let line = String::from_utf8_lossy(&buf[..n]);
    let line = line.lines().next().unwrap_or("");
    let code = line.strip_prefix("HTTP/1.").and_then(|r| r.get(2..5)).and_then(|c| c.parse::<u16>().ok());
    match code {
        Some(c) if (200..400).contains(&c) => Ok(()),
        Some(code) => Err(ProbeError::Status { path: path.to_owned(), code }),
        None => Err(ProbeError::NotHttp { path: path.to_owned(), line: line.to_owned() }),
    }
}

/// Runs one probe task per target; `sync` starts and stops them as the
/// configuration changes. Targets kept across a sync keep their state. Each task
/// has a number of its own, which its events carry.
pub struct Monitor {
    events: mpsc::UnboundedSender<HealthChange>,
    tasks: BTreeMap<Target, (u64, JoinHandle<()>)>,
    next_task: u64,
    synced: bool,
}

impl Monitor {
    pub fn new(events: mpsc::UnboundedSender<HealthChange>) -> Self {
        Self { events, tasks: BTreeMap::new(), next_task: 0, synced: false }
    }

    /// Whether `ev` comes from its target's running task. An event a stopped
    /// task queued before it stopped is not: its target may since have been
    /// removed, or added again to join down, and the old task's word would put
    /// it in the rings before the new one's `rise` successes.
    pub fn current(&self, ev: &HealthChange) -> bool {
        self.tasks.get(&ev.target).is_some_and(|(task, _)| *task == ev.task)
    }

    /// Makes the running probes exactly `targets`; returns the new ones that
    /// join down (see [`Thresholds`]): after the first sync, those whose node,
    /// address and probe no running target had.
    pub fn sync(&mut self, targets: BTreeSet<Target>) -> BTreeSet<Target> {
        self.sync_taking_over(targets, &BTreeSet::new())
    }

    /// [`Self::sync`], where the new targets in `taking_over` start up rather than
    /// joining (they replace a check their node passed: see
    /// agent::desired::taking_over).
    pub fn sync_taking_over(&mut self, targets: BTreeSet<Target>, taking_over: &BTreeSet<Target>) -> BTreeSet<Target> {
        let probed: BTreeSet<(&str, IpAddr, &Probe)> = self.tasks.keys().map(|t| (t.node.as_str(), t.addr, &t.check.probe)).collect();
        let joining: BTreeSet<Target> = if self.synced {
            targets
                .iter()
                .filter(|t| !self.tasks.contains_key(*t) && !probed.contains(&(t.node.as_str(), t.addr, &t.check.probe)) && !taking_over.contains(*t))
                .cloned()
                .collect()
        } else {
            BTreeSet::new()
        };
        self.synced = true;
        self.tasks.retain(|t, (_, h)| {
            let keep = targets.contains(t);
            if !keep {
                h.abort();
            }
            keep
        });
        for t in targets {
            if self.tasks.contains_key(&t) {
                continue;
            }
            let tx = self.events.clone();
            let target = t.clone();
            let join = joining.contains(&t);
            let task = self.next_task;
            self.next_task += 1;
            let h = tokio::spawn(async move { run_target(target, task, join, tx).await });
            self.tasks.insert(t, (task, h));
        }
        joining
    }

    pub fn targets(&self) -> impl Iterator<Item = &Target> {
        self.tasks.keys()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        for (_, h) in self.tasks.values() {
            h.abort();
        }
    }
}

async fn run_target(target: Target, task: u64, joining: bool, tx: mpsc::UnboundedSender<HealthChange>) {
    let check = &target.check;
    let mut state = if joining { Thresholds::joining() } else { Thresholds::new() };
    // A joining target that fails its first `fall` probes is reported down once,
    // so that the status says why it has not joined.
    let mut join_failures = joining.then_some(0);
    let mut tick = tokio::time::interval(check.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = probe(target.addr, check).await;
        let mut flip = state.record(result.is_ok(), check.rise, check.fall);
        if let Some(n) = &mut join_failures {
            *n = if result.is_ok() { 0 } else { *n + 1 };
            if *n == check.fall {
                flip = Some(false);
            }
            if flip.is_some() {
                join_failures = None;
            }
        }
        if let Some(up) = flip {
            let detail = match &result {
                Ok(()) => format!("{} successes", check.rise),
                Err(e) => format!("{} failures, last: {e}", check.fall),
            };
            if up {
                info!(node = %target.node, addr = %target.addr, %detail, "backend up");
            } else {
                warn!(node = %target.node, addr = %target.addr, %detail, "backend down");
            }
            if tx.send(HealthChange { target: target.clone(), up, at: Instant::now(), detail, task }).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    #[test]
    fn fall_and_rise_need_consecutive_results() {
        let mut t = Thresholds::new();
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(true, 2, 3), None, "a success resets the failure streak");
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(false, 2, 3), None);
        assert_eq!(t.record(false, 2, 3), Some(false), "third consecutive failure");
        assert!(!t.up);
        assert_eq!(t.record(false, 2, 3), None, "already down");
        assert_eq!(t.record(true, 2, 3), None);
        assert_eq!(t.record(false, 2, 3), None, "a failure resets the success streak");
        assert_eq!(t.record(true, 2, 3), None);
        assert_eq!(t.record(true, 2, 3), Some(true));
        assert!(t.up);
    }

    #[test]
    fn thresholds_of_one_flip_at_once() {
        let mut t = Thresholds::new();
        assert_eq!(t.record(false, 1, 1), Some(false));
        assert_eq!(t.record(true, 1, 1), Some(true));
    }

    fn check(probe: Probe) -> HealthCheck {
        HealthCheck { probe, interval: Duration::from_millis(50), timeout: Duration::from_millis(300), rise: 1, fall: 1 }
    }

    /// A one-shot HTTP server on IPv4 loopback answering `status_line`.
    async fn server(status_line: &'static str) -> u16 {
        server_on(IpAddr::from(Ipv4Addr::LOCALHOST), status_line).await.0
    }

    /// A one-shot HTTP server on `lo` answering `status_line`, and the request it read.
    async fn server_on(lo: IpAddr, status_line: &'static str) -> (u16, tokio::sync::oneshot::Receiver<String>) {
        let l = tokio::net::TcpListener::bind((lo, 0)).await.unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            if let Ok((mut s, _)) = l.accept().await {
                let mut buf = [0u8; 512];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = s.write_all(status_line.as_bytes()).await;
            }
        });
        (port, rx)
    }

    /// Where IPv6 is off (a container without it), the IPv6 probes cannot run.
    fn ipv6_loopback() -> Option<IpAddr> {
        let lo = IpAddr::from(Ipv6Addr::LOCALHOST);
        match std::net::TcpListener::bind((lo, 0)) {
            Ok(_) => Some(lo),
            Err(e) => {
                eprintln!("skipping the IPv6 probes: no [::1] here ({e})");
                None
            }
        }
    }

    /// HTTP and TCP probes of an IPv6 node: the Host header is `[addr]:port`;
    /// an IPv4 node's stays the address alone.
    #[tokio::test]
    async fn probes_reach_ipv6_nodes() {
        let v4 = IpAddr::from(Ipv4Addr::LOCALHOST);
        let (port, req) = server_on(v4, "HTTP/1.1 200 OK\r\n\r\n").await;
        probe(v4, &check(Probe::Http { port, path: "/healthz".into() })).await.unwrap();
        assert!(req.await.unwrap().contains("\r\nHost: 127.0.0.1\r\n"));
        let Some(lo) = ipv6_loopback() else { return };
        let (port, req) = server_on(lo, "HTTP/1.1 204 No Content\r\n\r\n").await;
        probe(lo, &check(Probe::Http { port, path: "/healthz".into() })).await.unwrap();
        let req = req.await.unwrap();
        assert!(req.starts_with("GET /healthz HTTP/1.1\r\n") && req.contains(&format!("\r\nHost: [::1]:{port}\r\n")), "{req:?}");
        let (port, _) = server_on(lo, "HTTP/1.1 500 Oops\r\n\r\n").await;
        let e = probe(lo, &check(Probe::Http { port, path: "/".into() })).await.unwrap_err();
        assert!(matches!(e, ProbeError::Status { code: 500, .. }), "{e}");
        let (port, _) = server_on(lo, "").await;
        probe(lo, &check(Probe::Tcp { port })).await.unwrap();
        let closed = std::net::TcpListener::bind((lo, 0)).unwrap().local_addr().unwrap().port();
        let e = probe(lo, &check(Probe::Tcp { port: closed })).await.unwrap_err();
        assert!(e.to_string().starts_with(&format!("connect [::1]:{closed}: ")), "{e}");
    }

    #[tokio::test]
    async fn probes_tell_up_from_down() {
        let lo = IpAddr::from(Ipv4Addr::LOCALHOST);
        let port = server("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await;
        probe(lo, &check(Probe::Http { port, path: "/healthz".into() })).await.unwrap();
        let port = server("HTTP/1.0 302 Found\r\n\r\n").await;
        probe(lo, &check(Probe::Http { port, path: "/".into() })).await.unwrap();
        let port = server("HTTP/1.1 503 Service Unavailable\r\n\r\n").await;
        let e = probe(lo, &check(Probe::Http { port, path: "/".into() })).await.unwrap_err();
        assert_eq!(e.to_string(), "GET /: status 503");
        let port = server("SSH-2.0-OpenSSH\r\n").await;
        let e = probe(lo, &check(Probe::Http { port, path: "/".into() })).await.unwrap_err();
        assert_eq!(e.to_string(), r#"GET /: not an HTTP response: "SSH-2.0-OpenSSH""#);
        let port = server("").await;
        probe(lo, &check(Probe::Tcp { port })).await.unwrap();

        // Nothing listening: refused.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = probe(lo, &check(Probe::Tcp { port: closed })).await.unwrap_err();
        assert!(matches!(e, ProbeError::Connect { ref source, .. } if source.kind() == std::io::ErrorKind::ConnectionRefused), "{e}");

        // Accepts but never answers: the timeout decides.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let start = Instant::now();
        let e = probe(lo, &check(Probe::Http { port, path: "/".into() })).await.unwrap_err();
        assert!(matches!(e, ProbeError::Timeout { .. }), "{e}");
        assert!(start.elapsed() >= Duration::from_millis(300));
        drop(l);
    }

    #[tokio::test]
    async fn monitor_reports_a_down_and_an_up() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut m = Monitor::new(tx);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = HealthCheck { probe: Probe::Tcp { port }, interval: Duration::from_millis(20), timeout: Duration::from_millis(20), rise: 2, fall: 2 };
        let t = Target { node: "n1".into(), addr: Ipv4Addr::LOCALHOST.into(), check: c };
        m.sync([t.clone()].into());
        drop(l);
        let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!((ev.target.clone(), ev.up), (t.clone(), false));
        let _l = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
        let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!((ev.target, ev.up), (t, true));
        m.sync(Default::default());
        assert_eq!(m.targets().count(), 0);
    }

    /// An event that a stopped task queued is not its target's once the target
    /// is probed by a new task (removed, then added again to join down): taken,
    /// a stale `up` would put the target in the rings before its `rise` successes.
    #[tokio::test]
    async fn events_of_stopped_tasks_are_not_current() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut m = Monitor::new(tx);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let c = HealthCheck { probe: Probe::Tcp { port: closed }, interval: Duration::from_millis(20), timeout: Duration::from_millis(100), rise: 1, fall: 1 };
        let t = Target { node: "n1".into(), addr: Ipv4Addr::LOCALHOST.into(), check: c };
        m.sync([t.clone()].into());
        let old = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert!(!old.up && m.current(&old), "{old:?}");
        m.sync(Default::default());
        assert!(!m.current(&old), "its target is no longer probed");
        assert_eq!(m.sync([t.clone()].into()), [t.clone()].into(), "added again, it joins");
        assert!(!m.current(&old), "the new task's target, but not its event");
        let new = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert!(m.current(&new) && new.task != old.task && new.target == t, "{new:?}");
    }

    #[tokio::test]
    async fn a_probe_taking_over_from_one_its_node_passed_starts_up() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut m = Monitor::new(tx);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let open = HealthCheck {
            probe: Probe::Tcp { port: l.local_addr().unwrap().port() },
            interval: Duration::from_millis(20),
            timeout: Duration::from_millis(100),
            rise: 2,
            fall: 2,
        };
        let closed =
            HealthCheck { probe: Probe::Tcp { port: std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port() }, ..open.clone() };
        let t = |node: &str, c: &HealthCheck| Target { node: node.into(), addr: Ipv4Addr::LOCALHOST.into(), check: c.clone() };
        assert!(m.sync([t("n1", &open), t("n2", &open)].into()).is_empty());
        // n1's probe moves to a closed port, taking over: it starts up, so that its
        // failures are reported; n2's moves without taking over: it joins down.
        let joining = m.sync_taking_over([t("n1", &closed), t("n2", &closed)].into(), &[t("n1", &closed)].into());
        assert_eq!(joining, [t("n2", &closed)].into());
        let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!((ev.target, ev.up), (t("n1", &closed), false), "reported down after `fall` failures");
    }

    #[tokio::test]
    async fn nodes_probed_after_the_first_sync_join_down() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut m = Monitor::new(tx);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let c = HealthCheck { probe: Probe::Tcp { port }, interval: Duration::from_millis(20), timeout: Duration::from_millis(100), rise: 2, fall: 2 };
        let t = |node: &str, c: &HealthCheck| Target { node: node.into(), addr: Ipv4Addr::LOCALHOST.into(), check: c.clone() };
        assert!(m.sync([t("n1", &c)].into()).is_empty(), "the first model's targets start up");
        // A new node joins down and comes up after `rise` successes.
        assert_eq!(m.sync([t("n1", &c), t("n2", &c)].into()), [t("n2", &c)].into());
        let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
        assert_eq!((ev.target, ev.up, ev.detail.as_str()), (t("n2", &c), true, "2 successes"));
        // New timings of the same probe: no node joins.
        let slower = HealthCheck { interval: Duration::from_millis(30), ..c.clone() };
        assert!(m.sync([t("n1", &slower), t("n2", &slower)].into()).is_empty());
        // A node that joins while its probe fails is reported down after `fall`
        // failures, so that the status says why.
        drop(l);
        assert_eq!(m.sync([t("n1", &slower), t("n2", &slower), t("n3", &slower)].into()), [t("n3", &slower)].into());
        let mut downs = BTreeSet::new();
        while downs.len() < 3 {
            let ev = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap();
            assert!(!ev.up && ev.detail.starts_with("2 failures"), "{ev:?}");
            assert!(downs.insert(ev.target.node), "one down report per target");
        }
    }
}
