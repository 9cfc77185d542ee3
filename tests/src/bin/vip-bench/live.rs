//! The data path with real frames, in generic and in native XDP mode in one run:
//! a lab segment with a client, one backend and a load-balancer namespace whose
//! eth0 has the program attached (the Dataplane facade, no agent). Through the VIP
//! (every packet from the client passes the program and is forwarded with XDP_TX):
//! ARP request → reply, new TCP connections, round trips on an established one, a
//! bulk upload; the same to the backend's own address (no load balancer on the
//! way) and ARP for the load balancer's own address (answered by its kernel) as
//! references. Modes alternate (generic, native, generic, native), each half of
//! the samples, so drift during the run does not favour either.
//!
//! Every thread of the client and the servers runs on one CPU ([`one_cpu`]), so the
//! kernel's work for a packet (softirqs, NAPI polls) runs there too, synchronously:
//! the figures are the path's cost, not a VM's latency in waking an idle vCPU,
//! which otherwise adds ~40 µs to whichever round trips happen to cross CPUs.
use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};
use vip_agent::{
    dataplane::{monotonic_ns, AttachMode, BackendSpec, Dataplane, ServiceAddr},
    model::Protocol,
};
use vip_tests::{
    frames, halab,
    lab::{accept_vip, attach_node_in, Segment},
    netns::{NetNs, PinDir},
};

use crate::{
    measure::{percentile, Dist},
    report::{at, line, Section, Table},
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 1);
const LB: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
const BACKEND: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 11);
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 100);
const ECHO: u16 = 7001;
const SINK: u16 = 7002;
/// Samples per mode, split over the alternating halves.
const ARPS: usize = 2000;
const CONNS: usize = 1000;
const PINGS: usize = 10_000;
const UPLOADS: usize = 16;
const UPLOAD_BYTES: usize = 64 << 20;
const HALVES: usize = 2;

/// One lab with the program attached in one mode; removed on Drop.
struct Wire {
    stop: Arc<AtomicBool>,
    dp: Dataplane,
    _pins: PinDir,
    client: NetNs,
    backend: NetNs,
    _lb: NetNs,
    _seg: Segment,
}

/// Binds the calling thread (and the threads it spawns later) to the first CPU
/// this process may use.
fn one_cpu() -> Result<()> {
    // SAFETY: cpu_set_t is plain data; the calls get its size and a valid pointer.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        ensure!(libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) == 0, "sched_getaffinity");
        let cpu = (0..libc::CPU_SETSIZE as usize).find(|&c| libc::CPU_ISSET(c, &set)).context("no CPU allowed")?;
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        ensure!(libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) == 0, "sched_setaffinity: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// The backend's servers: an echo on ECHO (each connection echoes until EOF) and
/// a sink on SINK (reads to EOF, answers the byte count), until `stop` is set and
/// one more connection comes.
fn serve(backend: &NetNs, stop: &Arc<AtomicBool>) -> Result<()> {
    for (port, sink) in [(ECHO, false), (SINK, true)] {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = stop.clone();
        backend.spawn(move || {
            let l = one_cpu().and_then(|()| Ok(TcpListener::bind(("0.0.0.0", port))?));
            let _ = tx.send(l.as_ref().map(|_| ()).map_err(|e| e.to_string()));
            let Ok(l) = l else { return };
            let mut buf = vec![0u8; 64 << 10];
            for s in l.incoming() {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                // One connection at a time (the client is sequential): served on
                // this thread, no thread start in the connection's time.
                let Ok(mut s) = s else { continue };
                let _ = s.set_nodelay(true);
                // Short: a connection whose client gave up (its reset lost) must not
                // hold the next ones for long.
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut total = 0u64;
                while let Ok(k) = s.read(&mut buf) {
                    if k == 0 || (!sink && s.write_all(&buf[..k]).is_err()) {
                        break;
                    }
                    total += k as u64;
                }
                if sink {
                    let _ = s.write_all(&total.to_le_bytes());
                }
            }
        })?;
        rx.recv()?.map_err(|e| anyhow::anyhow!("binding port {port}: {e}"))?;
    }
    Ok(())
}

impl Wire {
    fn build(mode: AttachMode) -> Result<Self> {
        let seg = Segment::new()?;
        let client = seg.host("vwc", &format!("{CLIENT}/24"))?;
        let lb = seg.host("vwl", &format!("{LB}/24"))?;
        let backend = seg.host("vwb", &format!("{BACKEND}/24"))?;
        accept_vip(&backend, VIP)?;
        let stop = Arc::new(AtomicBool::new(false));
        serve(&backend, &stop)?;
        let pins = PinDir::new()?;
        let (mut dp, ifindex) = attach_node_in(&lb, &pins.path, mode)?;
        dp.hold_vip(ifindex, VIP, monotonic_ns() + 3_600_000_000_000)?;
        let b = BackendSpec { name: "b1".into(), addr: BACKEND.into(), mac: backend.mac("eth0")?, weight: 1, local: false };
        for port in [ECHO, SINK] {
            dp.set_service(ServiceAddr { vip: VIP.into(), port, protocol: Protocol::Tcp }, std::slice::from_ref(&b), 251, 0)?;
        }
        Ok(Self { stop, dp, _pins: pins, client, backend, _lb: lb, _seg: seg })
    }

    /// Runs `f` in the client namespace.
    fn client<T: Send + 'static>(&self, f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
        self.client.run(f)?
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for port in [ECHO, SINK] {
            let _ = self.backend.run(move || TcpStream::connect((Ipv4Addr::LOCALHOST, port)));
        }
    }
}

/// µs from each ARP request for `target` sent on the client's eth0 to its reply.
fn arp_rtts(target: Ipv4Addr, n: usize) -> Result<Vec<f64>> {
    let (ifindex, mac) = vip_agent::dataplane::iface_info("eth0")?;
    let rx = halab::arp_socket()?;
    let tx = vip_agent::ha::garp::GarpSocket::new()?;
    let request = frames::arp_request(mac, CLIENT, target, None);
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        tx.send_frame(ifindex, &request)?;
        loop {
            ensure!(t.elapsed() < Duration::from_secs(1), "no ARP reply for {target} within 1 s");
            if let Some((2, _, spa, tpa)) = halab::recv_arp(&rx) {
                if spa == target && tpa == CLIENT {
                    break;
                }
            }
        }
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

/// µs for each of `n` new connections to `dst`: connect, one byte there and back.
fn connect_rtts(dst: Ipv4Addr, n: usize) -> Result<Vec<f64>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut s = TcpStream::connect_timeout(&SocketAddr::from((dst, ECHO)), Duration::from_secs(2))?;
        s.set_nodelay(true)?;
        s.write_all(b"x")?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

/// µs for each of `n` one-byte round trips on one connection to `dst`.
fn ping_rtts(dst: Ipv4Addr, n: usize) -> Result<Vec<f64>> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::from((dst, ECHO)), Duration::from_secs(2))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut b = [0u8; 1];
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        s.write_all(b"x")?;
        s.read_exact(&mut b)?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

/// MB/s of each of `n` uploads of UPLOAD_BYTES to `dst`, from connect to the
/// sink's count of what it received (checked).
fn uploads(dst: Ipv4Addr, n: usize) -> Result<Vec<f64>> {
    let chunk = vec![0x5au8; 64 << 10];
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut s = TcpStream::connect_timeout(&SocketAddr::from((dst, SINK)), Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        for _ in 0..UPLOAD_BYTES / chunk.len() {
            s.write_all(&chunk)?;
        }
        s.shutdown(std::net::Shutdown::Write)?;
        let mut count = [0u8; 8];
        s.read_exact(&mut count)?;
        ensure!(u64::from_le_bytes(count) == UPLOAD_BYTES as u64, "the sink got {} of {UPLOAD_BYTES} bytes", u64::from_le_bytes(count));
        v.push(UPLOAD_BYTES as f64 / 1e6 / t.elapsed().as_secs_f64());
    }
    Ok(v)
}

/// The figures measured, in table order: (row, unit, key).
const ROWS: [(&str, &str, &str); 8] = [
    ("ARP request → reply for the VIP (answered by XDP_TX)", "µs", "arp_vip_us"),
    ("reference: ARP for the load balancer's own address (its kernel answers)", "µs", "arp_node_us"),
    ("new TCP connection through the VIP: connect + 1 byte echoed (SYN on the miss path)", "µs", "connect_vip_us"),
    ("reference: the same to the backend's own address (no load balancer)", "µs", "connect_direct_us"),
    ("round trip on an established connection through the VIP (1 byte; flow-table hit)", "µs", "rtt_vip_us"),
    ("reference: the same to the backend's own address", "µs", "rtt_direct_us"),
    ("bulk upload through the VIP (64 MiB, every segment forwarded)", "MB/s", "upload_vip_mbps"),
    ("reference: the same to the backend's own address", "MB/s", "upload_direct_mbps"),
];

/// One half of one mode's samples, in ROWS order.
fn measure(mode: AttachMode) -> Result<Vec<Vec<f64>>> {
    let w = Wire::build(mode)?;
    let before = w.dp.counters()?;
    let out = w.client(|| {
        one_cpu()?;
        Ok(vec![
            arp_rtts(VIP, ARPS / HALVES)?,
            arp_rtts(LB, ARPS / HALVES)?,
            connect_rtts(VIP, CONNS / HALVES)?,
            connect_rtts(BACKEND, CONNS / HALVES)?,
            ping_rtts(VIP, PINGS / HALVES)?,
            ping_rtts(BACKEND, PINGS / HALVES)?,
            uploads(VIP, UPLOADS / HALVES)?,
            uploads(BACKEND, UPLOADS / HALVES)?,
        ])
    })?;
    // The VIP figures went through the program: its counters saw every ARP and
    // at least a SYN, a byte and its ACK per connection and round trip.
    let after = w.dp.counters()?;
    let grew = |r: &str| after.reasons[r].0 - before.reasons.get(r).map_or(0, |c| c.0);
    let (answered, forwarded) = (grew("arp_answered"), grew("forwarded"));
    ensure!(answered >= (ARPS / HALVES) as u64, "{mode:?}: {answered} ARP requests answered by XDP, {} sent", ARPS / HALVES);
    let least = (3 * CONNS / HALVES + PINGS / HALVES) as u64;
    if forwarded < least {
        bail!("{mode:?}: {forwarded} packets forwarded by XDP, fewer than the {least} sent through the VIP");
    }
    Ok(out)
}

pub fn section() -> Result<Section> {
    let modes = [AttachMode::Generic, AttachMode::Native];
    let mut samples: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); ROWS.len()]; modes.len()];
    for _ in 0..HALVES {
        for (m, mode) in modes.iter().enumerate() {
            for (all, half) in samples[m].iter_mut().zip(measure(*mode)?) {
                all.extend(half);
            }
        }
    }
    let mut s = Section::new(line!("XDP data path with real frames (lab namespaces, veth + bridge; generic and native attach alternated in one run)"));
    s.para(line!(
        "Per mode: {ARPS} ARP requests each, {CONNS} new connections each, {PINGS} round trips each, {UPLOADS} uploads each; the client's and the servers' threads all on one CPU; median and p95 (uploads: median and slowest), and the native median over the generic one."
    ));
    let mut t = Table::new(
        "| path (client → load balancer → backend, replies direct) | unit | generic: median | p95 | native: median | p95 | native / generic |",
        "|---|---|---:|---:|---:|---:|---:|",
    );
    for (k, (name, unit, key)) in ROWS.iter().enumerate() {
        let (g, n) = (&samples[0][k], &samples[1][k]);
        let a = at("live").f(*key);
        let throughput = *unit == "MB/s";
        // For throughput the second column is the slowest upload.
        let tail = |v: &[f64]| if throughput { percentile(v, 0.0) } else { Dist::of(v).p95 };
        let (gm, nm) = (percentile(g, 0.5), percentile(n, 0.5));
        let d = if throughput { 0 } else { 1 };
        let mut row = line!(
            "| {name} | {unit} | {} | {} | {} | {} | {}× |",
            a.f("generic").f("median").num(gm, d),
            a.f("generic").f("tail").num(tail(g), d),
            a.f("native").f("median").num(nm, d),
            a.f("native").f("tail").num(tail(n), d),
            a.f("native_over_generic").num(nm / gm, 2)
        );
        if throughput {
            row = row.with(a.f("generic").f("samples").data(g)).with(a.f("native").f("samples").data(n));
        }
        t.row(row);
    }
    s.table(t);
    Ok(s)
}

/// Seconds of each measured span of the connections-per-second section, and spans.
const CPS_SPAN: Duration = Duration::from_secs(3);
const CPS_ROUNDS: usize = 3;
/// Spoofed sources of the SYN flood: 198.19.0.0/16, which no lab host has a route
/// to, so the backend's SYN-ACKs to them go nowhere.
const FLOOD_SOURCES: u32 = 1 << 16;
/// The flood's rate, SYNs per second: well past what the client opens, and below
/// what saturates this 2-core machine's kernel (about 120,000 with one thread
/// sending as fast as it can, when nothing else got a CPU).
const FLOOD_RATE: u64 = 50_000;

/// New connections to `dst` completed in `span`, one after another (connect, one
/// byte echoed, closed with a reset so that no TIME_WAIT exhausts the ports), and
/// those that failed (not connected or not echoed within 1 s).
fn conns_in(dst: Ipv4Addr, span: Duration) -> (u32, u32) {
    let (mut ok, mut failed) = (0, 0);
    let end = Instant::now() + span;
    while Instant::now() < end {
        let one = || -> Result<()> {
            let mut s = TcpStream::connect_timeout(&SocketAddr::from((dst, ECHO)), Duration::from_secs(1))?;
            s.set_read_timeout(Some(Duration::from_secs(1)))?;
            s.set_nodelay(true)?;
            s.write_all(b"x")?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b)?;
            let linger = libc::linger { l_onoff: 1, l_linger: 0 };
            // SAFETY: a valid socket and option of the stated size.
            unsafe {
                use std::os::fd::AsRawFd as _;
                libc::setsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, (&raw const linger).cast(), std::mem::size_of::<libc::linger>() as u32);
            }
            Ok(())
        };
        match one() {
            Ok(()) => ok += 1,
            Err(_) => failed += 1,
        }
    }
    (ok, failed)
}

/// Spoofed TCP SYNs to the VIP from the client's eth0, as fast as one thread sends
/// them, until `stop`: how many were sent.
fn flood(w: &Wire, stop: Arc<AtomicBool>) -> Result<std::thread::JoinHandle<Result<u64>>> {
    let (lb_mac, client_mac) = (w._lb.mac("eth0")?, w.client.mac("eth0")?);
    w.client.spawn(move || {
        let tap = vip_tests::tap::Tap::open("eth0")?;
        let syns: Vec<Vec<u8>> = (0..FLOOD_SOURCES)
            .map(|i| frames::tcp(lb_mac, client_mac, None, (Ipv4Addr::from(0xc613_0000 | i), 1024 + (i % 60000) as u16), (VIP, ECHO)))
            .collect();
        let (mut sent, mut i) = (0u64, 0usize);
        // Bounded: by `stop`, and by 10 minutes.
        let t0 = Instant::now();
        while !stop.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(600) {
            // A full transmit queue (ENOBUFS) is the flood's own limit: try the next.
            if tap.send(&syns[i % syns.len()]).is_ok() {
                sent += 1;
            }
            i += 1;
            // Paced to FLOOD_RATE, in bursts of 100.
            if i % 100 == 0 {
                let due = Duration::from_secs_f64(i as f64 / FLOOD_RATE as f64);
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        Ok(sent)
    })
}

/// Connections per second through the VIP with the program attached in native
/// mode, alone and with a spoofed-SYN flood beside it, alternated.
pub fn cps_section() -> Result<Section> {
    let w = Wire::build(AttachMode::Native)?;
    let (mut quiet, mut flooded, mut rates) = (Vec::new(), Vec::new(), Vec::new());
    let (mut quiet_failed, mut flooded_failed) = (0, 0);
    let before = w.dp.counters()?;
    for _ in 0..CPS_ROUNDS {
        let (ok, failed) = w.client(|| {
            one_cpu()?;
            Ok(conns_in(VIP, CPS_SPAN))
        })?;
        quiet.push(f64::from(ok) / CPS_SPAN.as_secs_f64());
        quiet_failed += failed;
        let stop = Arc::new(AtomicBool::new(false));
        let f = flood(&w, stop.clone())?;
        std::thread::sleep(Duration::from_millis(200));
        let (ok, failed) = w.client(|| {
            one_cpu()?;
            Ok(conns_in(VIP, CPS_SPAN))
        })?;
        stop.store(true, Ordering::Relaxed);
        let sent = f.join().map_err(|_| anyhow::anyhow!("the flood thread panicked"))??;
        flooded.push(f64::from(ok) / CPS_SPAN.as_secs_f64());
        flooded_failed += failed;
        rates.push(sent as f64 / (CPS_SPAN.as_secs_f64() + 0.2));
    }
    let after = w.dp.counters()?;
    let forwarded = after.reasons["forwarded"].0 - before.reasons.get("forwarded").map_or(0, |c| c.0);
    let a = at("cps");
    let mut s = Section::new(line!("New connections per second through the VIP (lab, native XDP on veth)"));
    s.para(line!(
        "One client thread opening connections one after another (connect, 1 byte echoed, reset) for {} s, {CPS_ROUNDS} times alone and {CPS_ROUNDS} times with a second thread sending spoofed SYNs to the VIP from {FLOOD_SOURCES} sources at up to {FLOOD_RATE} per second; median of the spans. The program forwarded {} packets in all.",
        a.f("span_s").show(CPS_SPAN.as_secs()),
        a.f("forwarded").show(forwarded)
    ));
    let mut t = Table::new("| load | connections/s (median) | spans | failed | flood, SYNs/s (median) |", "|---|---:|---|---:|---:|");
    let spans = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(" / ");
    t.row(line!(
        "| alone | {} | {} | {} | — |",
        a.f("quiet").f("median").num(percentile(&quiet, 0.5), 0),
        a.f("quiet").f("spans").show(spans(&quiet)),
        a.f("quiet").f("failed").num(f64::from(quiet_failed), 0)
    ));
    t.row(line!(
        "| with a SYN flood | {} | {} | {} | {} |",
        a.f("flooded").f("median").num(percentile(&flooded, 0.5), 0),
        a.f("flooded").f("spans").show(spans(&flooded)),
        a.f("flooded").f("failed").num(f64::from(flooded_failed), 0),
        a.f("flood_syns_per_s").num(percentile(&rates, 0.5), 0)
    ));
    s.table(t);
    Ok(s)
}
