//! Load on a lab while its agents crash, restart or roll out: new connections
//! through the VIPs at a steady rate and long-lived connections kept busy, each
//! counted. A new connection fails when it does not name its backend within its
//! timeout; a long-lived one breaks when a round trip on it fails (a reset, or no
//! answer within its read timeout).
use std::{
    fmt,
    io::BufReader,
    net::{IpAddr, SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Result};

use crate::{
    halab::{hello, LongConn, Probes, SERVICE_PORT},
    netns::NetNs,
};

/// New connections from `client`, one every `every` to each of `vips` in turn,
/// each given `timeout`, while `keep_going` says so: join for (start, when it
/// named its backend) per attempt, in start order.
pub fn connect_loop(client: &NetNs, vips: Vec<IpAddr>, every: Duration, timeout: Duration, keep_going: impl Fn() -> bool + Send + 'static) -> Result<Probes> {
    client.spawn(move || {
        let mut attempts = Vec::new();
        for vip in vips.iter().cycle() {
            if !keep_going() {
                break;
            }
            let (start, vip) = (Instant::now(), *vip);
            attempts.push((
                start,
                std::thread::spawn(move || -> Option<Instant> {
                    let s = TcpStream::connect_timeout(&SocketAddr::from((vip, SERVICE_PORT)), timeout).ok()?;
                    let _ = s.set_read_timeout(Some(timeout));
                    let mut r = BufReader::new(s.try_clone().ok()?);
                    hello(&s, &mut r).ok().map(|_| Instant::now())
                }),
            ));
            std::thread::sleep(every.saturating_sub(start.elapsed()));
        }
        attempts.into_iter().map(|(t, h)| (t, h.join().unwrap_or(None))).collect()
    })
}

/// Long-lived connections, each pinged every `every` on a thread of its own until
/// [`Pinger::finish`]; one whose ping fails is counted broken and left alone.
pub struct Pinger {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(Vec<LongConn>, Vec<bool>)>,
}

impl Pinger {
    pub fn start(mut conns: Vec<LongConn>, every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut broken = vec![false; conns.len()];
            let round = |conns: &mut Vec<LongConn>, broken: &mut Vec<bool>| {
                for (c, b) in conns.iter_mut().zip(broken.iter_mut()) {
                    if !*b && c.ping().is_err() {
                        *b = true;
                    }
                }
            };
            while !flag.load(Ordering::Relaxed) {
                round(&mut conns, &mut broken);
                std::thread::sleep(every);
            }
            round(&mut conns, &mut broken);
            (conns, broken)
        });
        Self { stop, thread }
    }

    /// One last round; the connections and whether each broke.
    pub fn finish(self) -> Result<(Vec<LongConn>, Vec<bool>)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().map_err(|_| anyhow!("ping thread panicked"))
    }
}

/// New connections and long-lived ones at once, until [`Load::finish`].
pub struct Load {
    stop: Arc<AtomicBool>,
    news: Probes,
    pinger: Pinger,
    started: Instant,
}

/// What a [`Load`] saw.
#[derive(Clone, Debug)]
pub struct LoadReport {
    pub seconds: f64,
    pub attempted: usize,
    pub failed: usize,
    /// The longest a new connection that succeeded took (a lost SYN shows as ≥ 1 s).
    pub slowest: Duration,
    pub long: usize,
    /// Long-lived connections broken, by the backend they were on.
    pub broken: Vec<String>,
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.0} s: {} of {} new connections failed (slowest {} ms), {} of {} long-lived connections broken",
            self.seconds,
            self.failed,
            self.attempted,
            self.slowest.as_millis(),
            self.broken.len(),
            self.long
        )?;
        if !self.broken.is_empty() {
            write!(f, " (on {:?})", self.broken)?;
        }
        Ok(())
    }
}

impl Load {
    /// New connections to `vips` in turn every `every` (each with `timeout`), and
    /// `conns` pinged every 50 ms.
    pub fn start(client: &NetNs, vips: Vec<IpAddr>, every: Duration, timeout: Duration, conns: Vec<LongConn>) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let news = connect_loop(client, vips, every, timeout, move || !flag.load(Ordering::Relaxed))?;
        Ok(Self { stop, news, pinger: Pinger::start(conns, Duration::from_millis(50)), started: Instant::now() })
    }

    /// Stops the load (waiting for the connections in flight); the counts and the
    /// long-lived connections, for more load.
    pub fn finish(self) -> Result<(LoadReport, Vec<LongConn>)> {
        self.stop.store(true, Ordering::Relaxed);
        let attempts = self.news.join().map_err(|_| anyhow!("connect thread panicked"))?;
        let (conns, broken) = self.pinger.finish()?;
        let report = LoadReport {
            seconds: self.started.elapsed().as_secs_f64(),
            attempted: attempts.len(),
            failed: attempts.iter().filter(|(_, d)| d.is_none()).count(),
            slowest: attempts.iter().filter_map(|(s, d)| Some(d.as_ref()?.duration_since(*s))).max().unwrap_or_default(),
            long: conns.len(),
            broken: conns.iter().zip(&broken).filter(|(_, b)| **b).map(|(c, _)| format!("{}:{}", c.backend, c.sport)).collect(),
        };
        let alive = conns.into_iter().zip(broken).filter(|(_, b)| !b).map(|(c, _)| c).collect();
        Ok((report, alive))
    }
}
