//! `cargo xtask bench`: data-path cost per packet (BPF_PROG_TEST_RUN) as ratios
//! to a trivial XDP_PASS program measured in the same run, and Maglev build cost
//! and quality. Writes OUT_DIR/bench.json and OUT_DIR/bench.md.
use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use vip_agent::{
    dataplane::{monotonic_ns, BackendSpec, Dataplane, ServiceAddr},
    maglev::{self, Member},
    model::Protocol,
};
use vip_tests::{
    agent::{lb_config, wait_for, Check, LbLab},
    frames,
    halab::{self, ArpWatch, FailoverWatch, HaLab, HaSpec, LongConn, Naming},
    netns::{NetNs, PinDir},
};

const REPEAT: u32 = 100_000;
const ROUNDS: usize = 7;
const MISS_FLOWS: u32 = 100_000;
/// Flows cycled through for a flow-table hit that misses the per-CPU flow cache:
/// 16× its largest size, so a flow's slot has been taken by others (probability
/// 1 − e^-16) before the flow comes round again.
const SPREAD_FLOWS: u32 = 65_536;
const OUR_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xaa];
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median over ROUNDS of ns/packet for `repeat` runs of one frame.
fn per_packet(dp: &mut Dataplane, prog: &str, frame: &[u8], live: bool) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..ROUNDS {
        let (_, _, d) = dp.test_run_program(prog, frame, REPEAT, live.then_some(64))?;
        v.push(d.as_nanos() as f64);
    }
    Ok(median(v))
}

/// Median over ROUNDS of the mean ns/packet of MISS_FLOWS single runs, each a new
/// flow (so each one misses the flow table and walks the ring).
fn per_call(dp: &mut Dataplane, prog: &str, frame_for: &dyn Fn(u32) -> Vec<u8>, round_base: &mut u32) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..ROUNDS {
        let mut total = 0u128;
        for i in 0..MISS_FLOWS {
            let (_, _, d) = dp.test_run_program(prog, &frame_for(*round_base + i), 1, None)?;
            total += d.as_nanos();
        }
        *round_base += MISS_FLOWS;
        v.push(total as f64 / f64::from(MISS_FLOWS));
    }
    Ok(median(v))
}

/// ns per dependent load when chasing pointers through `bytes` of memory in a
/// random cyclic order (one 64-byte line per step, 4 KiB pages): what a map
/// access that misses the caches costs on this machine. The flow-table miss can
/// not cost less than the trivial program plus one such load.
fn memory_latency(bytes: usize) -> f64 {
    let lines = bytes / 64;
    // A random cyclic permutation (Sattolo), from a fixed xorshift seed.
    let mut next: Vec<usize> = (0..lines).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..lines).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        next.swap(i, (x % i as u64) as usize);
    }
    // Line i holds the index of the line after it, at its first word.
    let mut mem = vec![0usize; lines * 8];
    for (i, n) in next.iter().enumerate() {
        mem[i * 8] = *n;
    }
    let steps = 2_000_000;
    let mut at = 0;
    let start = Instant::now();
    for _ in 0..steps {
        at = mem[at * 8];
    }
    let ns = start.elapsed().as_nanos() as f64 / steps as f64;
    std::hint::black_box(at);
    ns
}

/// The program loaded with new, empty maps: one VIP held, TCP 80 and UDP 53 on ten backends.
fn bench_dataplane() -> Result<(Dataplane, PinDir)> {
    let pins = PinDir::new()?;
    let mut dp = Dataplane::load(&pins.path, 1 << 20)?;
    dp.set_iface(1, OUR_MAC)?;
    dp.hold_vip(1, VIP, monotonic_ns() + 3_600_000_000_000)?;
    let backends: Vec<BackendSpec> = (1..=10u8)
        .map(|i| BackendSpec { name: format!("node-{i}"), addr: Ipv4Addr::new(198, 18, 0, 10 + i), mac: [2, 0, 0, 0, 0x10, i], weight: 1, local: false })
        .collect();
    dp.set_service(ServiceAddr { vip: VIP, port: 80, protocol: Protocol::Tcp }, &backends, 16381, 0)?;
    dp.set_service(ServiceAddr { vip: VIP, port: 53, protocol: Protocol::Udp }, &backends, 16381, 0)?;
    Ok((dp, pins))
}

fn xdp_bench(out: &mut String, json: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    let (mut dp, _pins) = bench_dataplane()?;
    let arp = frames::arp_request(CLIENT_MAC, CLIENT, VIP, None);
    let fwd = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 40000), (VIP, 80));
    let other = frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 40000), (Ipv4Addr::new(198, 18, 0, 200), 80));
    let fresh = |i: u32| {
        let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + (i >> 12));
        frames::tcp(OUR_MAC, CLIENT_MAC, None, (src, 1024 + (i & 0xfff) as u16), (VIP, 80))
    };
    // New UDP flows: the miss path for a non-TCP protocol (the TCP rows use SYNs).
    let fresh_udp = |i: u32| {
        let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + (i >> 12));
        frames::udp(OUR_MAC, CLIENT_MAC, (src, 1024 + (i & 0xfff) as u16), (VIP, 53), b"query")
    };
    // Established flows (in the flow table), cycled so that each run misses the cache.
    let spread = |i: u32| {
        let i = i % SPREAD_FLOWS;
        frames::tcp(OUR_MAC, CLIENT_MAC, None, (Ipv4Addr::new(198, 19, 200, (i >> 8) as u8), 1024 + (i & 0xff) as u16), (VIP, 80))
    };
    for i in 0..SPREAD_FLOWS {
        dp.test_run(&spread(i), 1, None)?;
    }
    if std::env::var_os("VIP_BENCH_QUICK").is_some() {
        let base = per_packet(&mut dp, "xdp_baseline_pass", &fwd, false)?;
        let hit = per_packet(&mut dp, "vip_xdp", &fwd, false)?;
        let pass = per_packet(&mut dp, "vip_xdp", &other, false)?;
        let (mut r0, mut r1) = (0, 1 << 24);
        let miss_mode = std::env::var_os("VIP_BENCH_MISS").is_some();
        // Before the misses fill the flow table (see the full run).
        let lru_call = if miss_mode { per_call(&mut dp, "vip_xdp", &spread, &mut 0)? } else { 0.0 };
        let (base_call, miss) = if miss_mode {
            (per_call(&mut dp, "xdp_baseline_pass", &fresh, &mut r0)?, per_call(&mut bench_dataplane()?.0, "vip_xdp", &fresh, &mut r1)?)
        } else {
            (0.0, 0.0)
        };
        let hit_call = if miss_mode { per_call(&mut dp, "vip_xdp", &|_| fwd.clone(), &mut r0)? } else { 0.0 };
        let miss_udp = if miss_mode { per_call(&mut bench_dataplane()?.0, "vip_xdp", &fresh_udp, &mut r1)? } else { 0.0 };
        let floor = if miss_mode { per_call(&mut bench_dataplane()?.0, "xdp_floor_flow_insert", &fresh, &mut r1)? } else { 0.0 };
        writeln!(out, "quick: base {base} hit {hit} pass {pass} base_call {base_call:.1} miss {miss:.1} hit_call {hit_call:.1} lru_call {lru_call:.1} miss_udp {miss_udp:.1} floor {floor:.1} mem_1m {:.1} mem_64m {:.1}", memory_latency(1 << 20), memory_latency(64 << 20))?;
        return Ok(());
    }
    let base_live = per_packet(&mut dp, "xdp_baseline_pass", &fwd, true)?;
    let base = per_packet(&mut dp, "xdp_baseline_pass", &fwd, false)?;
    let mut base_round = 0;
    let base_call = per_call(&mut dp, "xdp_baseline_pass", &fresh, &mut base_round)?;
    // Live frames are not reset between repeats: after one reply the frame is a
    // reply and would take the pass path. Each ARP run gets a fresh request.
    let mut arp_round = 0;
    let arp_ns = per_call(&mut dp, "vip_xdp", &|_| arp.clone(), &mut arp_round)?;
    let hit_ns = per_packet(&mut dp, "vip_xdp", &fwd, true)?;
    // Non-live repeats keep the rewritten frame: still TCP to the VIP, still a hit.
    let hit_prog_ns = per_packet(&mut dp, "vip_xdp", &fwd, false)?;
    let pass_ns = per_packet(&mut dp, "vip_xdp", &other, false)?;
    // Before the misses fill the flow table: every run here must find its flow.
    let pinned = dp.flow_count();
    let mut spread_round = 0;
    let lru_ns = per_call(&mut dp, "vip_xdp", &spread, &mut spread_round)?;
    anyhow::ensure!(dp.flow_count() == pinned, "established flows were not all in the flow table");
    let mut round = 1 << 24;
    // Each miss row gets new maps, as the miss row always had: an empty flow table
    // whose free entries lie in allocation order (after deletions they are scattered,
    // and every insert costs more). 1M entries, but per-CPU LRU lists give each
    // CPU half of them here: runs that stay on one CPU evict in the last rounds,
    // after the median round.
    let mut miss_run = |frame_for: &dyn Fn(u32) -> Vec<u8>| -> Result<f64> {
        let (mut mdp, _pins) = bench_dataplane()?;
        let ns = per_call(&mut mdp, "vip_xdp", frame_for, &mut round)?;
        let forwarded = mdp.counters()?.reasons["forwarded"].0;
        anyhow::ensure!(forwarded == u64::from(MISS_FLOWS) * ROUNDS as u64, "miss path not taken: {forwarded} forwarded");
        Ok(ns)
    };
    let miss_ns = miss_run(&fresh)?;
    let miss_udp_ns = miss_run(&fresh_udp)?;
    // The flow-table lookup and insert alone, on new maps like the miss rows.
    let floor_ns = {
        let (mut fdp, _pins) = bench_dataplane()?;
        let ns = per_call(&mut fdp, "xdp_floor_flow_insert", &fresh, &mut round)?;
        // Per-CPU LRU lists give each CPU 1/nr_cpus of the table, so late rounds
        // on one CPU may evict: check that the inserts landed, not their total.
        anyhow::ensure!(fdp.flow_count() >= MISS_FLOWS as usize, "floor program did not insert the flows: {}", fdp.flow_count());
        ns
    };
    let (lat_l2, lat_dram) = (memory_latency(1 << 20), memory_latency(64 << 20));
    let c = dp.counters()?;
    anyhow::ensure!(c.reasons["arp_answered"].0 >= u64::from(MISS_FLOWS) * ROUNDS as u64, "ARP path not taken: {:?}", c.reasons);
    anyhow::ensure!(c.reasons["forwarded"].0 >= (2 * u64::from(REPEAT) + u64::from(MISS_FLOWS)) * ROUNDS as u64, "forward path not taken: {:?}", c.reasons);

    writeln!(out, "## XDP data path (BPF_PROG_TEST_RUN, ns/packet, median of {ROUNDS} rounds)\n")?;
    writeln!(out, "| path | mode | ns/packet | trivial XDP_PASS, same mode | ratio | target |")?;
    writeln!(out, "|---|---|---:|---:|---:|---|")?;
    let rows = [
        ("ARP reply (XDP_TX)", "100k fresh requests, 1 run each", arp_ns, base_call, "≤ 2×"),
        ("VIP forward, flow-table hit (XDP_TX)", "live frames, 100k repeats", hit_ns, base_live, "≤ 2.5×"),
        ("VIP forward, flow-table hit (XDP_TX)", "100k repeats, not live", hit_prog_ns, base, "≤ 2.5×"),
        ("VIP forward, flow-table hit, not in the flow cache (XDP_TX)", "65,536 established flows in turn, 1 run each", lru_ns, base_call, "—"),
        ("VIP forward, flow-table miss (XDP_TX)", "100k fresh TCP flows (first packet: SYN), 1 run each", miss_ns, base_call, "≤ 4×"),
        ("VIP forward, flow-table miss (XDP_TX)", "100k fresh UDP flows, 1 run each", miss_udp_ns, base_call, "—"),
        ("reference: flow-table lookup + insert alone (`xdp_floor_flow_insert`)", "100k fresh TCP flows, 1 run each", floor_ns, base_call, "—"),
        ("non-VIP pass (XDP_PASS)", "100k repeats", pass_ns, base, "—"),
    ];
    for (name, mode, ns, b, target) in rows {
        writeln!(out, "| {name} | {mode} | {ns:.1} | {b:.1} | {:.2}× | {target} |", ns / b)?;
        json.insert(format!("{name} [{mode}]"), serde_json::json!({"ns_per_packet": ns, "baseline_ns": b, "ratio": ns / b, "mode": mode}));
    }
    writeln!(out, "\nMemory latency (userspace pointer chase, 4 KiB pages): {lat_l2:.1} ns per load within 1 MiB, {lat_dram:.1} ns within 64 MiB.\n")?;
    json.insert("memory latency ns [1 MiB]".into(), serde_json::json!(lat_l2));
    json.insert("memory latency ns [64 MiB]".into(), serde_json::json!(lat_dram));
    Ok(())
}

fn maglev_bench(out: &mut String, json: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    writeln!(out, "\n## Maglev ring build (userspace, median of 15 builds)\n")?;
    writeln!(out, "| M (table) | N (backends) | build time | largest/smallest share |")?;
    writeln!(out, "|---:|---:|---:|---:|")?;
    for (m, n) in [(65537u32, 10usize), (65537, 100), (65537, 1000), (16381, 100)] {
        let members: Vec<Member> = (0..n).map(|i| Member::new(format!("node-{i:05}"))).collect();
        let mut times = Vec::new();
        let mut ring = None;
        for _ in 0..15 {
            let t = Instant::now();
            ring = Some(maglev::build(&members, m, 0)?);
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let shares = ring.unwrap().shares();
        let spread = f64::from(*shares.iter().max().unwrap()) / f64::from(*shares.iter().min().unwrap());
        let ms = median(times);
        writeln!(out, "| {m} | {n} | {ms:.3} ms | {spread:.4} |")?;
        json.insert(format!("maglev_build_m{m}_n{n}"), serde_json::json!({"ms": ms, "max_min_share": spread}));
    }
    let members: Vec<Member> = (0..100).map(|i| Member::new(format!("node-{i:05}"))).collect();
    let before = maglev::build(&members, 65537, 0)?;
    let after = maglev::build(&members[1..], 65537, 0)?;
    let changed = (0..65537).filter(|&i| before.member_at(i) != after.member_at(i)).count();
    let pct = changed as f64 * 100.0 / 65537.0;
    writeln!(
        out,
        "\nOne of N=100 backends removed at M=65537: {changed} slots changed ({pct:.2}%; the removed backend owned {:.2}%). Target ≤ 2%.",
        f64::from(before.shares()[0]) * 100.0 / 65537.0
    )?;
    json.insert("maglev_removal_changed_pct".into(), serde_json::json!(pct));
    Ok(())
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Health change → maps updated, with the real agent in the single-load-balancer
/// lab: a backend's server is stopped and restarted HEALTH_TRIALS times; the agent
/// stamps each decided change and reports the time until every affected ring was
/// written (status `health_to_maps_us`). The bench also times, by polling the
/// status every 5 ms, the fault → out-of-ring interval the health check bounds.
const HEALTH_TRIALS: usize = 20;

fn health_bench(out: &mut String, json: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    let check = Check { interval_ms: 100, timeout_ms: 50, rise: 2, fall: 3 };
    let mut lab = LbLab::start(3, &lb_config(3, "80", check, ""), 9473)?;
    lab.wait_ready(Duration::from_secs(10))?;
    let state = |lab: &LbLab, want: (bool, bool)| wait_for(Duration::from_secs(5), || (lab.backend_state("b2")? == want).then_some(()));
    let mut detect = Vec::new();
    for _ in 0..HEALTH_TRIALS {
        let t = Instant::now();
        lab.backends[1].halt();
        state(&lab, (false, false)).context("b2 never left the ring")?;
        detect.push(t.elapsed().as_secs_f64() * 1e3);
        lab.backends[1].serve()?;
        state(&lab, (true, true)).context("b2 never came back")?;
    }
    lab.agent.check_alive()?;
    let us: Vec<f64> =
        lab.status().context("status")?["health_to_maps_us"].as_array().context("health_to_maps_us")?.iter().filter_map(|v| v.as_f64()).collect();
    anyhow::ensure!(us.len() == 2 * HEALTH_TRIALS, "expected {} health changes, the agent saw {}", 2 * HEALTH_TRIALS, us.len());
    let bound = check.interval_ms * u64::from(check.fall) + check.timeout_ms;
    writeln!(out, "\n## Health change → maps updated (real agent, lab namespaces, {HEALTH_TRIALS} down + {HEALTH_TRIALS} up changes)\n")?;
    writeln!(out, "| figure | median | p95 | max |")?;
    writeln!(out, "|---|---:|---:|---:|")?;
    writeln!(
        out,
        "| health change decided → every affected ring written | {:.0} µs | {:.0} µs | {:.0} µs |",
        percentile(&us, 0.5),
        percentile(&us, 0.95),
        percentile(&us, 1.0)
    )?;
    writeln!(
        out,
        "| server stopped → out of the ring (interval {}ms × fall {} + timeout {}ms = {bound} ms bound; 5 ms polling) | {:.0} ms | {:.0} ms | {:.0} ms |",
        check.interval_ms,
        check.fall,
        check.timeout_ms,
        percentile(&detect, 0.5),
        percentile(&detect, 0.95),
        percentile(&detect, 1.0)
    )?;
    json.insert(
        "health_to_maps_us".into(),
        serde_json::json!({"median": percentile(&us, 0.5), "p95": percentile(&us, 0.95), "max": percentile(&us, 1.0), "samples": us}),
    );
    json.insert(
        "health_detect_ms".into(),
        serde_json::json!({"median": percentile(&detect, 0.5), "p95": percentile(&detect, 0.95), "max": percentile(&detect, 1.0), "bound_ms": bound}),
    );
    Ok(())
}

/// Failover in the HA lab (three nodes, real agents): FAILOVER_TRIALS faults of
/// each kind on the owner of a VIP, with new connections attempted every 10 ms
/// from the client and established connections (to other backends) kept busy.
const FAILOVER_TRIALS: usize = 20;

#[derive(Clone, Copy, Debug)]
enum Fault {
    AgentKill,
    AgentStop,
    LinkDown,
}

struct Trial {
    first_ok_ms: f64,
    failed_attempts: usize,
    takeover_ms: Option<f64>,
    conns: usize,
    broken: usize,
}

fn failover_trial(lab: &mut HaLab, fault: Fault, k: usize) -> Result<Trial> {
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged(&all, Duration::from_secs(10))?;
    // Every node's rings whole again (the previous trial's node re-admitted): the
    // trial measures the owner's failure, not a backend change still in flight.
    lab.wait_rings_full(&all, Duration::from_secs(10))?;
    let v = halab::vip(k % lab.spec.vips);
    let a = lab.index_of(&owners[&v]);
    let a_mac = lab.nodes[a].mac;
    let avoid = lab.nodes[a].name.clone();
    let mut conns = Vec::new();
    for _ in 0..8 {
        let c = LongConn::open(&lab.client, v, 0, Duration::from_secs(2))?;
        if c.backend != avoid {
            conns.push(c);
        }
    }
    // The client must be talking to the owner, or the trial measures something else.
    if wait_for(Duration::from_secs(2), || (lab.client_neigh(v) == Some(a_mac)).then_some(())).is_none() {
        anyhow::bail!("client's neighbour entry for {v} is {:?}, not the owner {}'s {:?}", lab.client_neigh(v), avoid, a_mac);
    }
    let watch = FailoverWatch::start(lab, v, a_mac, conns, Duration::from_millis(1800))?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    match fault {
        Fault::AgentKill => lab.kill_agent(a),
        Fault::AgentStop => lab.signal_agent(a, libc::SIGSTOP),
        Fault::LinkDown => lab.seg.cable(&lab.nodes[a].ns, false)?,
    }
    let done = Instant::now();
    let (o, _, _) = watch.finish(t0, done)?;
    match fault {
        Fault::AgentKill => lab.start_agent(a)?,
        Fault::AgentStop => lab.signal_agent(a, libc::SIGCONT),
        Fault::LinkDown => lab.seg.cable(&lab.nodes[a].ns, true)?,
    }
    Ok(Trial {
        first_ok_ms: ms(o.first_ok.context("no successful connection after the fault")?),
        failed_attempts: o.failed,
        takeover_ms: o.takeover.map(ms),
        conns: o.conns,
        broken: o.broken,
    })
}

/// A healed partition: the owner's cable is pulled until the others took its VIP
/// over (it then holds every VIP alone), then plugged back. From the heal on, the
/// client asks ARP for every VIP every 10 ms for 1 s and captures all ARP for them;
/// any answer or announcement from a MAC other than the VIP's final owner is a
/// wrong answer. Returns when the last wrong one came (None: none at all) and how
/// many came after `bound`.
fn heal_trial(lab: &mut HaLab, k: usize, bound: Duration) -> Result<(Option<f64>, usize)> {
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged(&all, Duration::from_secs(10))?;
    lab.wait_rings_full(&all, Duration::from_secs(10))?;
    let v = halab::vip(k % lab.spec.vips);
    let a = lab.index_of(&owners[&v]);
    lab.seg.cable(&lab.nodes[a].ns, false)?;
    let rest: Vec<usize> = all.iter().copied().filter(|&i| i != a).collect();
    lab.wait_converged(&rest, Duration::from_secs(5))?;
    wait_for(Duration::from_secs(5), || (lab.held_by(a).len() == lab.spec.vips).then_some(())).context("the cut-off node never held every VIP")?;
    let watch = ArpWatch::start(&lab.client)?;
    let vips: Vec<std::net::Ipv4Addr> = (0..lab.spec.vips).map(halab::vip).collect();
    let asker = lab.client.spawn(move || -> Result<()> {
        let (ifindex, mac) = vip_agent::dataplane::iface_info("eth0")?;
        let sock = vip_agent::ha::garp::GarpSocket::new()?;
        for _ in 0..100 {
            for v in &vips {
                sock.send_frame(ifindex, &frames::arp_request(mac, halab::CLIENT, *v, None))?;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    })?;
    let healed = Instant::now();
    lab.seg.cable(&lab.nodes[a].ns, true)?;
    asker.join().map_err(|_| anyhow::anyhow!("ARP asker panicked"))??;
    let frames = watch.finish();
    let final_owners = lab.wait_converged(&all, Duration::from_secs(5))?;
    anyhow::ensure!(final_owners == owners, "owners after the heal differ from before");
    let mac_of = |v: &std::net::Ipv4Addr| lab.nodes[lab.index_of(&final_owners[v])].mac;
    let wrong: Vec<Duration> = frames
        .iter()
        .filter(|(t, sha, spa)| *t >= healed && final_owners.contains_key(spa) && *sha != mac_of(spa))
        .map(|(t, _, _)| t.duration_since(healed))
        .collect();
    Ok((wrong.iter().max().map(|d| ms(*d)), wrong.iter().filter(|d| **d > bound).count()))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn failover_bench(out: &mut String, json: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    let spec = HaSpec::default();
    let mut lab = HaLab::start(spec.clone(), Naming::Unique, &std::env::current_exe()?)?;
    writeln!(
        out,
        "\n## Failover (HA lab: 3 nodes, real agents; heartbeat {} ms, deadAfter {} ms, holdTime {} ms; {FAILOVER_TRIALS} trials each)\n",
        spec.heartbeat_ms, spec.dead_after_ms, spec.hold_ms
    )?;
    writeln!(out, "| fault on the VIP's owner | fault → first new connection: median / p95 / max | new connections failed (all trials) | fault → new owner's gratuitous ARP at the client: median / p95 / max | established connections broken (owner not their backend) |")?;
    writeln!(out, "|---|---|---:|---|---:|")?;
    let faults = std::env::var("VIP_BENCH_FAULTS").unwrap_or_default();
    for fault in [Fault::AgentKill, Fault::AgentStop, Fault::LinkDown] {
        if !faults.is_empty() && !faults.split(',').any(|f| format!("{fault:?}").eq_ignore_ascii_case(f)) {
            continue;
        }
        let mut trials = Vec::new();
        for k in 0..FAILOVER_TRIALS {
            trials.push(failover_trial(&mut lab, fault, k).with_context(|| format!("{fault:?} trial {k}"))?);
        }
        let first: Vec<f64> = trials.iter().map(|t| t.first_ok_ms).collect();
        let take: Vec<f64> = trials.iter().filter_map(|t| t.takeover_ms).collect();
        let failed: usize = trials.iter().map(|t| t.failed_attempts).sum();
        let (conns, broken): (usize, usize) = (trials.iter().map(|t| t.conns).sum(), trials.iter().map(|t| t.broken).sum());
        let dist = |v: &[f64]| {
            if v.is_empty() {
                "—".to_owned()
            } else {
                format!("{:.0} / {:.0} / {:.0} ms", percentile(v, 0.5), percentile(v, 0.95), percentile(v, 1.0))
            }
        };
        let name = match fault {
            Fault::AgentKill => "agent SIGKILL",
            Fault::AgentStop => "agent SIGSTOP (hung)",
            Fault::LinkDown => "link down (bridge port)",
        };
        writeln!(out, "| {name} | {} | {failed} | {} ({} of {FAILOVER_TRIALS} seen) | {broken} of {conns} |", dist(&first), dist(&take), take.len())?;
        json.insert(
            format!("failover_{fault:?}"),
            serde_json::json!({"first_new_connection_ms": first, "takeover_garp_ms": take, "failed_attempts": failed, "connections": conns, "broken": broken}),
        );
    }
    if faults.is_empty() || faults.split(',').any(|f| f.eq_ignore_ascii_case("heal")) {
        // Stated bound: the cut-off node hears a peer within one heartbeat interval of
        // the heal (and resolves its neighbours at once), the peers hear it within one
        // more; 100 ms covers reconciles, the 100 ms conflict poll and delivery.
        let bound = Duration::from_millis(2 * spec.heartbeat_ms + 100);
        let mut last = Vec::new();
        let mut late = 0;
        for k in 0..FAILOVER_TRIALS {
            let (l, n) = heal_trial(&mut lab, k, bound).with_context(|| format!("heal trial {k}"))?;
            last.push(l.unwrap_or(0.0));
            late += n;
        }
        writeln!(
            out,
            "\nPartition heal ({FAILOVER_TRIALS} trials: the owner's cable pulled until it held every VIP alone, then plugged back; the client asks ARP for every VIP every 10 ms for 1 s): last answer or announcement from a MAC other than the final owner's, after the heal: median {:.0} ms, max {:.0} ms; after the stated bound ({} ms = 2 × heartbeat interval + 100 ms): {late}.",
            percentile(&last, 0.5),
            percentile(&last, 1.0),
            bound.as_millis()
        )?;
        json.insert("heal".into(), serde_json::json!({"last_wrong_ms": last, "bound_ms": bound.as_millis() as u64, "wrong_after_bound": late}));
    }
    Ok(())
}

/// Kubernetes: allocation rate of the elected controller for 1,000 Services (stand-in
/// in this process), EndpointSlice change → rings updated on every agent (KubeLab,
/// three real agents), and agent memory with 1,000 Services and 100 Nodes.
fn k8s_bench(out: &mut String, json: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    use serde_json::json;
    use vip_tests::{
        agent::TempDir,
        apiserver::{ApiServer, ResourceSpec},
        kubelab::{endpoint_slice, node_object, ring_backends, KubeLab},
    };
    let lb = |name: &str, ip: Option<String>, local: bool| {
        let mut s = json!({
            "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": "bench" },
            "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }],
                      "externalTrafficPolicy": if local { "Local" } else { "Cluster" } }
        });
        if local {
            s["spec"]["healthCheckNodePort"] = json!(80);
        }
        if let Some(ip) = ip {
            s["status"] = json!({ "loadBalancer": { "ingress": [{ "ip": ip }] } });
        }
        s
    };
    let pool = |addresses: &str| {
        json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "bench" },
        "spec": { "addresses": [addresses], "nodeSelector": { "lab": "yes" }, "tableSize": 251 } })
    };
    writeln!(out, "\n## Kubernetes\n")?;

    // Allocation rate.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let (n, took) = rt.block_on(async {
        let api = ApiServer::builder().resources(ResourceSpec::VIP).start().await?;
        let tmp = TempDir::new("vip-bench-kube-")?;
        let kc = tmp.0.join("kubeconfig");
        std::fs::write(&kc, format!("apiVersion: v1\nkind: Config\nclusters:\n- name: b\n  cluster:\n    server: {}\ncontexts:\n- name: b\n  context:\n    cluster: b\n    user: b\ncurrent-context: b\nusers:\n- name: b\n  user: {{}}\n", api.url()))?;
        let client = vip_agent::k8s::kube_client(Some(&kc)).await?;
        api.insert("vippools.vip.dev", pool("198.18.8.0/22"))?;
        for i in 0..1000 {
            api.insert("services", lb(&format!("s{i:04}"), None, false))?;
        }
        let (_lead, leading) = tokio::sync::watch::channel(true);
        let t = Instant::now();
        let task = tokio::spawn(vip_agent::k8s::controller::run(client, "bench".into(), leading, Duration::from_secs(30), vip_agent::k8s::controller::AgentView::fixed(Default::default()).1));
        let mut done = 0;
        while t.elapsed() < Duration::from_secs(300) {
            let ips: std::collections::BTreeSet<String> =
                api.list("services", None).iter().filter_map(|s| s["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)).collect();
            done = ips.len();
            if done == 1000 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = t.elapsed();
        task.abort();
        anyhow::Ok((done, took))
    })?;
    anyhow::ensure!(n == 1000, "only {n} of 1000 Services got distinct addresses");
    let rate = 1000.0 / took.as_secs_f64();
    writeln!(out, "Allocation: 1,000 LoadBalancer Services, one pool, one elected controller (from its start, including the initial lists): all allocated, distinct, in {:.2} s ({rate:.0} Services/s; each is one status patch with a resourceVersion precondition and one Event).\n", took.as_secs_f64())?;
    json.insert("k8s_allocation".into(), json!({"services": 1000, "seconds": took.as_secs_f64(), "per_second": rate}));

    // Resync after an API server outage (the stand-in stopped, then back with its
    // watch history compacted): the agent's election and controller at default timing.
    let outage = Duration::from_secs(30);
    let o = rt.block_on(vip_tests::kubefix::outage_then_new_service(outage))?;
    writeln!(
        out,
        "API server down {} s (stand-in stopped, then back with its watch history compacted: every resumed watch gets 410) → a Service created at once is addressed {:.2} s after the server is back (target ≤ 5 s); leading and reachable again after {:.2} s.\n",
        outage.as_secs(),
        o.addressed_after.as_secs_f64(),
        o.leading_again_after.as_secs_f64()
    )?;
    json.insert(
        "k8s_resync".into(),
        json!({"outage_s": outage.as_secs(), "addressed_after_s": o.addressed_after.as_secs_f64(), "leading_again_s": o.leading_again_after.as_secs_f64()}),
    );

    // EndpointSlice change → rings on every agent.
    let kl = KubeLab::start(HaSpec::default(), &std::env::current_exe()?)?;
    let (lab, api) = (&kl.lab, &kl.api);
    api.insert("vippools.vip.dev", pool(&format!("{}-{}", halab::vip(0), halab::vip(2))))?;
    let slice = |nodes: &[&str]| endpoint_slice("bench", "web", nodes);
    api.insert("endpointslices.discovery.k8s.io", slice(&["node-1", "node-2"]))?;
    api.insert("services", lb("web", None, true))?;
    let backends_seen = |i: usize| ring_backends(lab, i, "bench/web");
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let want0 = vec!["node-1".to_owned(), "node-2".to_owned()];
    wait_for(Duration::from_secs(20), || all.iter().all(|&i| backends_seen(i).as_ref() == Some(&want0)).then_some(()))
        .with_context(|| format!("agents never saw the Local service\n{}", lab.agent_logs()))?;
    let mut lat = Vec::new();
    for k in 0..20 {
        let nodes: &[&str] = if k % 2 == 0 { &["node-2", "node-3"] } else { &["node-1", "node-2"] };
        let want: Vec<String> = nodes.iter().map(|s| s.to_string()).collect();
        let t = Instant::now();
        api.insert("endpointslices.discovery.k8s.io", slice(nodes))?;
        let mut pending: Vec<usize> = all.clone();
        while !pending.is_empty() && t.elapsed() < Duration::from_secs(10) {
            pending.retain(|&i| {
                let seen = backends_seen(i).as_ref() == Some(&want);
                if seen {
                    lat.push(t.elapsed().as_secs_f64() * 1e3);
                }
                !seen
            });
            std::thread::sleep(Duration::from_millis(2));
        }
        anyhow::ensure!(pending.is_empty(), "agents {pending:?} did not apply EndpointSlice change {k}");
    }
    writeln!(
        out,
        "EndpointSlice change (Local policy: the Service's backend nodes change) → the agent's status shows the new ring written, on each of 3 agents, 20 changes: median {:.0} ms, p95 {:.0} ms, max {:.0} ms (2 ms polling of the status files; target ≤ 100 ms median).\n",
        percentile(&lat, 0.5), percentile(&lat, 0.95), percentile(&lat, 1.0)
    )?;
    json.insert(
        "k8s_endpointslice_to_maps_ms".into(),
        json!({"median": percentile(&lat, 0.5), "p95": percentile(&lat, 0.95), "max": percentile(&lat, 1.0), "samples": lat}),
    );

    // Memory with 1,000 Services and 100 Nodes.
    api.insert("vippools.vip.dev", pool("198.18.8.0/22"))?;
    for i in 0..97 {
        api.insert("nodes", node_object(&format!("node-x{i:02}"), &format!("198.18.2.{}", i + 1)))?;
    }
    for i in 0..1000 {
        api.insert("services", lb(&format!("m{i:04}"), Some(Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 8, 0)) + i).to_string()), false))?;
    }
    wait_for(Duration::from_secs(60), || {
        all.iter().all(|&i| lab.status(i).and_then(|s| s["services"].as_array().map(|a| a.len() >= 1000)).unwrap_or(false)).then_some(())
    })
    .with_context(|| "agents never reached 1,000 services".to_string())?;
    std::thread::sleep(Duration::from_secs(3)); // settle (heartbeats, MAC retries, GARP rounds)
    let rss: Vec<f64> = lab
        .nodes
        .iter()
        .filter_map(|n| {
            let pid = n.agent.as_ref()?.child.id();
            let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let kb: f64 = st.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb / 1024.0)
        })
        .collect();
    anyhow::ensure!(rss.len() == 3, "could not read the agents' RSS");
    let max = rss.iter().cloned().fold(0.0, f64::max);
    writeln!(out, "Agent memory (VmRSS) with 1,000 Services and 100 Nodes (1,024-address pool, rings of 251 slots): {:.1} / {:.1} / {:.1} MiB on the three agents, max {max:.1} MiB (target ≤ 64 MiB).", rss[0], rss[1], rss[2])?;
    json.insert("k8s_rss_mib".into(), json!({"agents": rss, "max": max}));
    Ok(())
}

/// The scale section: the HA lab (three real agents, default timers) with
/// thousands of service-ports at the default table size.
const SCALE_TRIALS: usize = 10;

fn proc_field(pid: u32, file: &str, key: &str) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
    t.lines().find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

/// CPU time (user + system) of `pid` in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = t.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Bytes the kernel charges for the maps pinned under `dir` (bpftool's `bytes_memlock`).
fn bpf_map_bytes(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let o = std::process::Command::new("bpftool").args(["-j", "map", "show", "pinned"]).arg(&path).output()?;
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&o.stdout) {
            total += v["bytes_memlock"].as_u64().unwrap_or(0);
        }
    }
    Ok(total)
}

struct ScaleStart {
    converged_ms: f64,
    rss_mib: f64,
    bpf_mib: f64,
    idle_cpu_pct: f64,
}

/// Starts the lab with `vips` VIPs × 2 ports and measures the start.
fn scale_start(vips: usize) -> Result<(HaLab, ScaleStart)> {
    let spec = HaSpec { vips, ports: vec![80, 8080], table_size: None, default_timers: true, check_interval_ms: 200, ..Default::default() };
    let t = Instant::now();
    let lab = HaLab::start(spec, Naming::Unique, &std::env::current_exe()?)?;
    let all = [0, 1, 2];
    lab.wait_converged(&all, Duration::from_secs(120))?;
    lab.wait_rings_full(&all, Duration::from_secs(120))?;
    let converged_ms = ms(t.elapsed());
    let pids: Vec<u32> = lab.nodes.iter().map(|n| n.agent.as_ref().map(|a| a.child.id())).collect::<Option<_>>().context("agents")?;
    let rss = pids.iter().filter_map(|p| proc_field(*p, "status", "VmRSS:")).max().unwrap_or(0) as f64 / 1024.0;
    let bpf = bpf_map_bytes(&lab.nodes[0].pins.path)? as f64 / (1024.0 * 1024.0);
    let hz = 100.0; // USER_HZ
    let before: Vec<u64> = pids.iter().filter_map(|p| cpu_ticks(*p)).collect();
    let idle = Duration::from_secs(10);
    std::thread::sleep(idle);
    let after: Vec<u64> = pids.iter().filter_map(|p| cpu_ticks(*p)).collect();
    let busiest = before.iter().zip(&after).map(|(b, a)| (a - b) as f64 / hz).fold(0.0, f64::max);
    Ok((lab, ScaleStart { converged_ms, rss_mib: rss, bpf_mib: bpf, idle_cpu_pct: 100.0 * busiest / idle.as_secs_f64() }))
}

/// SCALE_TRIALS health changes (node-3's server stopped, then started) with every
/// flow table refilled to 1M entries before each; `scrape`: /metrics on every
/// agent every second throughout.
fn scale_health(lab: &mut HaLab, scrape_every_s: bool) -> Result<serde_json::Value> {
    let all = [0, 1, 2];
    let vips: Vec<Ipv4Addr> = (0..lab.spec.vips).map(halab::vip).collect();
    let services = lab.spec.vips * lab.spec.ports.len();
    let before: Vec<String> = (0..lab.nodes.len()).map(|i| lab.metrics(i)).collect();
    let logs = |lab: &HaLab| -> Vec<usize> {
        lab.nodes.iter().map(|n| std::fs::read_to_string(&n.log).unwrap_or_default().matches("peer liveness changed").count()).collect()
    };
    let liveness_before = logs(lab);
    let samples_before: Vec<usize> = all.iter().map(|&i| lab.status(i).and_then(|s| Some(s["health_to_maps_us"].as_array()?.len())).unwrap_or(0)).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scrapers = if scrape_every_s { halab::scrape_every(lab, Duration::from_secs(1), &stop) } else { Vec::new() };
    for trial in 0..SCALE_TRIALS {
        for n in &lab.nodes {
            let ids: Vec<u32> = Dataplane::open(&n.pins.path)?.backends()?.into_keys().collect();
            vip_tests::flows::fill(&n.pins.path, &vip_tests::flows::synthetic(vip_common::MAX_FLOWS as usize, &vips, 80, &ids))?;
        }
        let down = trial % 2 == 0;
        if down {
            if let Some(mut s) = lab.nodes[2].server.take() {
                let _ = s.kill();
                let _ = s.wait();
            }
        } else {
            let name = lab.nodes[2].name.clone();
            lab.nodes[2].server = Some(
                lab.nodes[2]
                    .ns
                    .cmd(std::env::current_exe()?.to_str().context("exe")?)
                    .args(["serve", &name, "80"])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()?,
            );
        }
        let want = if down { 2 } else { 3 };
        wait_for(Duration::from_secs(30), || {
            all.iter()
                .all(|&i| {
                    lab.status(i).is_some_and(|s| {
                        s["services"]
                            .as_array()
                            .is_some_and(|v| v.len() == services && v.iter().all(|x| x["backends"].as_array().is_some_and(|b| b.len() == want)))
                    })
                })
                .then_some(())
        })
        .context("the health change did not reach every ring")?;
        std::thread::sleep(Duration::from_secs(2)); // the sweep, and heartbeats after it
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let scrapes: Vec<u32> = scrapers.into_iter().filter_map(|h| h.join().ok()).collect();
    let mut us = Vec::new();
    let (mut gap, mut stalls, mut moved, mut evicted, mut sweep_s, mut sweeps) = (0f64, 0f64, 0f64, 0f64, 0f64, 0f64);
    for i in 0..lab.nodes.len() {
        let s = lab.status(i).context("status")?;
        us.extend(s["health_to_maps_us"].as_array().context("samples")?.iter().skip(samples_before[i]).filter_map(|v| v.as_f64()));
        let m = lab.metrics(i);
        let delta = |family: &str| halab::metric_sum_max(&m, family).0 - halab::metric_sum_max(&before[i], family).0;
        gap = gap.max(halab::metric_sum_max(&m, "vip_heartbeat_gap_max_seconds").1);
        stalls += delta("vip_liveness_stalls_total");
        moved += delta("vip_pool_owner_changes_total");
        evicted += delta("vip_flows_evicted_total");
        sweep_s += delta("vip_flow_sweep_seconds_sum");
        sweeps += delta("vip_flow_sweep_seconds_count");
    }
    let liveness: usize = logs(lab).iter().zip(&liveness_before).map(|(a, b)| a - b).sum();
    anyhow::ensure!(!us.is_empty(), "no health change samples");
    Ok(serde_json::json!({
        "health_to_maps_us": {"median": percentile(&us, 0.5), "p95": percentile(&us, 0.95), "max": percentile(&us, 1.0), "samples": us.len()},
        "heartbeat_gap_max_ms": gap * 1e3,
        "liveness_stalls": stalls,
        "false_liveness_changes": liveness,
        "owner_changes": moved,
        "flows_evicted": evicted,
        "sweep_mean_ms": if sweeps > 0.0 { 1e3 * sweep_s / sweeps } else { 0.0 },
        "scrapes": scrapes,
    }))
}

fn scale_bench(out: &mut String, json: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    writeln!(out, "\n## Scale (HA lab, three real agents, default timers and table size 16381, every service health-checked)\n")?;
    writeln!(
        out,
        "| service-ports | start → converged (owners agreed, every ring full) | agent RSS (largest) | BPF map memory per node | idle CPU (busiest agent) |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|")?;
    let mut starts = serde_json::Map::new();
    // 5,000 service-ports first, then the 2,000 the health figures use.
    let (lab, s) = scale_start(2500)?;
    drop(lab);
    writeln!(out, "| 5,000 (2,500 VIPs × 2) | {:.0} ms | {:.1} MiB | {:.1} MiB | {:.1} % |", s.converged_ms, s.rss_mib, s.bpf_mib, s.idle_cpu_pct)?;
    starts
        .insert("5000".into(), serde_json::json!({"converged_ms": s.converged_ms, "rss_mib": s.rss_mib, "bpf_mib": s.bpf_mib, "idle_cpu_pct": s.idle_cpu_pct}));
    let (mut lab, s) = scale_start(1000)?;
    writeln!(out, "| 2,000 (1,000 VIPs × 2) | {:.0} ms | {:.1} MiB | {:.1} MiB | {:.1} % |", s.converged_ms, s.rss_mib, s.bpf_mib, s.idle_cpu_pct)?;
    starts
        .insert("2000".into(), serde_json::json!({"converged_ms": s.converged_ms, "rss_mib": s.rss_mib, "bpf_mib": s.bpf_mib, "idle_cpu_pct": s.idle_cpu_pct}));
    json.insert("scale_start".into(), starts.into());
    let quiet = scale_health(&mut lab, false)?;
    let scraped = scale_health(&mut lab, true)?;
    writeln!(out, "\n{SCALE_TRIALS} health changes on 1,000 VIPs × 2 ports (node-3's server stopped / started: every ring changes on every agent), each with every flow table refilled to 1M entries; samples from all three agents:\n")?;
    writeln!(out, "| figure | no scrapes | /metrics scraped every second on every agent |")?;
    writeln!(out, "|---|---:|---:|")?;
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let h = |v: &serde_json::Value, k: &str| v["health_to_maps_us"][k].as_f64().unwrap_or(f64::NAN) / 1e3;
    writeln!(out, "| health change decided → every affected ring written, median / p95 / max (target: median ≤ 100 ms) | {:.1} / {:.1} / {:.1} ms | {:.1} / {:.1} / {:.1} ms |", h(&quiet, "median"), h(&quiet, "p95"), h(&quiet, "max"), h(&scraped, "median"), h(&scraped, "p95"), h(&scraped, "max"))?;
    writeln!(
        out,
        "| flow-table sweep after the rings (mean; off the liveness path) | {:.0} ms | {:.0} ms |",
        f(&quiet, "sweep_mean_ms"),
        f(&scraped, "sweep_mean_ms")
    )?;
    writeln!(out, "| flows evicted (pinned to the backend that left), all agents | {:.0} | {:.0} |", f(&quiet, "flows_evicted"), f(&scraped, "flows_evicted"))?;
    writeln!(
        out,
        "| largest heartbeat gap any peer saw (target: below deadAfter = 300 ms) | {:.0} ms | {:.0} ms |",
        f(&quiet, "heartbeat_gap_max_ms"),
        f(&scraped, "heartbeat_gap_max_ms")
    )?;
    writeln!(out, "| liveness stalls (heartbeats held back) | {:.0} | {:.0} |", f(&quiet, "liveness_stalls"), f(&scraped, "liveness_stalls"))?;
    writeln!(
        out,
        "| false liveness changes / owner moves (target: 0) | {:.0} / {:.0} | {:.0} / {:.0} |",
        f(&quiet, "false_liveness_changes"),
        f(&quiet, "owner_changes"),
        f(&scraped, "false_liveness_changes"),
        f(&scraped, "owner_changes")
    )?;
    json.insert("scale_health".into(), serde_json::json!({"no_scrapes": quiet, "scraped": scraped}));
    Ok(())
}

/// Heartbeat authentication: signing and checking one heartbeat (HMAC-SHA256),
/// median of 7 rounds of 100,000.
fn auth_bench(out: &mut String, json: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    use vip_agent::ha::{auth::Keys, heartbeat::Heartbeat};
    let keys = Keys::new(&[halab::random_key().into_bytes()])?;
    let hb =
        Heartbeat { v: Heartbeat::VERSION, node: "node-123".into(), incarnation: 1_795_391_020_187_672_419, seq: 123_456, sent_ms: 1_795_391_020_187 }.encode();
    let n = 100_000u32;
    let (mut seal, mut open) = (Vec::new(), Vec::new());
    let sealed = keys.seal(&hb);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(keys.seal(std::hint::black_box(&hb)));
        }
        seal.push(t.elapsed().as_nanos() as f64 / f64::from(n));
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(keys.open(std::hint::black_box(&sealed)).is_ok());
        }
        open.push(t.elapsed().as_nanos() as f64 / f64::from(n));
    }
    let (s, o) = (median(seal), median(open));
    writeln!(out, "\n## Heartbeat authentication (HMAC-SHA256, {} bytes signed; median of {ROUNDS} rounds of {n})\n", sealed.len())?;
    writeln!(out, "| operation | ns per heartbeat |\n|---|---:|\n| sign (sender, once per interval for all peers) | {s:.0} |\n| check (receiver) | {o:.0} |")?;
    json.insert("heartbeat_auth_ns".into(), serde_json::json!({"seal": s, "open": o, "bytes": sealed.len()}));
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        // The HA lab runs this binary as each node's name server.
        return halab::serve_name(args[3].parse()?, &args[2]);
    }
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "bench-results".into()));
    std::fs::create_dir_all(&dir)?;
    let mut out = String::new();
    let mut json = serde_json::Map::new();
    // VIP_BENCH_ONLY=xdp,maglev,health runs a subset (for quick iteration; BENCHMARKS.md quotes full runs).
    let only = std::env::var("VIP_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == name));
    if wanted("xdp") {
        let run = || -> Result<_> {
            let (mut o, mut j) = (String::new(), serde_json::Map::new());
            xdp_bench(&mut o, &mut j)?;
            Ok((o, j))
        };
        // Live-frames XDP_TX really transmits: do it inside a namespace of our own, on
        // its lo. VIP_BENCH_NETNS=caller: the caller has put us in one (to bench the
        // program as the DaemonSet loads it, with CAP_BPF and CAP_NET_ADMIN only, which
        // cannot make namespaces: `nsenter --net=... setpriv ... vip-bench`).
        let (o, j) = if std::env::var("VIP_BENCH_NETNS").as_deref() == Ok("caller") { run()? } else { NetNs::new("vbench")?.run(run)?? };
        out.push_str(&o);
        json.extend(j);
    }
    if wanted("maglev") {
        maglev_bench(&mut out, &mut json)?;
    }
    if wanted("health") {
        health_bench(&mut out, &mut json)?;
    }
    if wanted("failover") {
        failover_bench(&mut out, &mut json)?;
    }
    if wanted("k8s") {
        k8s_bench(&mut out, &mut json)?;
    }
    if wanted("auth") {
        auth_bench(&mut out, &mut json)?;
    }
    if wanted("scale") {
        scale_bench(&mut out, &mut json)?;
    }
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let header = format!("Run on {} cores, kernel {}\n\n", std::thread::available_parallelism()?.get(), kernel.trim());
    std::fs::write(dir.join("bench.md"), format!("{header}{out}"))?;
    std::fs::write(dir.join("bench.json"), serde_json::to_string_pretty(&json)?)?;
    println!("{header}{out}\nwritten to {}", dir.join("bench.md").display());
    Ok(())
}
