//! Data-path cost per packet (BPF_PROG_TEST_RUN) as ratios to a trivial XDP_PASS
//! program measured in the same run, and the machine's memory latency beside them.
use std::{net::Ipv4Addr, time::Instant};

use anyhow::Result;
use vip_agent::{
    dataplane::{monotonic_ns, BackendSpec, Dataplane, ServiceAddr},
    model::Protocol,
};
use vip_tests::{frames, netns::PinDir};

use crate::{
    measure::median,
    report::{at, line, Section, Table},
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

/// Median over ROUNDS of the mean ns/packet of the second packet of MISS_FLOWS new
/// flows: in chunks that fit `lb4_flows_new`'s per-CPU share, first their first
/// packets (not timed; they enter `lb4_flows_new`), then their second ones, timed
/// (each moves its flow to `lb4_flows`).
fn per_second_packet(dp: &mut Dataplane, frame_for: &dyn Fn(u32) -> Vec<u8>, round_base: &mut u32) -> Result<f64> {
    const CHUNK: u32 = 8192;
    let mut v = Vec::new();
    for _ in 0..ROUNDS {
        let mut total = 0u128;
        for chunk in (0..MISS_FLOWS).step_by(CHUNK as usize) {
            let flows = chunk..(chunk + CHUNK).min(MISS_FLOWS);
            for i in flows.clone() {
                dp.test_run(&frame_for(*round_base + i), 1, None)?;
            }
            for i in flows {
                let (_, _, d) = dp.test_run(&frame_for(*round_base + i), 1, None)?;
                total += d.as_nanos();
            }
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

/// Runs in a network namespace: live-frames XDP_TX really transmits (see main).
pub fn section() -> Result<Section> {
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
    // Two packets each: a flow is in lb4_flows from its second packet on.
    for i in 0..SPREAD_FLOWS {
        dp.test_run(&spread(i), 1, None)?;
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
        let (mem_1m, mem_64m) = (memory_latency(1 << 20), memory_latency(64 << 20));
        let mut s = Section::new(line!("XDP data path (VIP_BENCH_QUICK: a quick look, not recorded)"));
        s.para(line!("quick: base {base} hit {hit} pass {pass} base_call {base_call:.1} miss {miss:.1} hit_call {hit_call:.1} lru_call {lru_call:.1} miss_udp {miss_udp:.1} floor {floor:.1} mem_1m {mem_1m:.1} mem_64m {mem_64m:.1}"));
        return Ok(s);
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
    let second_ns = {
        let (mut sdp, _pins) = bench_dataplane()?;
        let ns = per_second_packet(&mut sdp, &fresh, &mut round)?;
        anyhow::ensure!(sdp.flow_count() >= MISS_FLOWS as usize, "second packets did not move their flows to lb4_flows: {}", sdp.flow_count());
        ns
    };
    // The flow-table lookup and insert alone, on new maps like the miss rows.
    let floor_ns = {
        let (mut fdp, _pins) = bench_dataplane()?;
        let ns = per_call(&mut fdp, "xdp_floor_flow_insert", &fresh, &mut round)?;
        anyhow::ensure!(fdp.flow_count() >= MISS_FLOWS as usize, "floor program did not insert the flows: {}", fdp.flow_count());
        ns
    };
    let (lat_l2, lat_dram) = (memory_latency(1 << 20), memory_latency(64 << 20));
    let c = dp.counters()?;
    anyhow::ensure!(c.reasons["arp_answered"].0 >= u64::from(MISS_FLOWS) * ROUNDS as u64, "ARP path not taken: {:?}", c.reasons);
    anyhow::ensure!(c.reasons["forwarded"].0 >= (2 * u64::from(REPEAT) + u64::from(MISS_FLOWS)) * ROUNDS as u64, "forward path not taken: {:?}", c.reasons);

    let mut s = Section::new(line!("XDP data path (BPF_PROG_TEST_RUN, ns/packet, median of {ROUNDS} rounds)"));
    let mut t = Table::new("| path | mode | ns/packet | trivial XDP_PASS, same mode | ratio | target |", "|---|---|---:|---:|---:|---|");
    let rows = [
        ("ARP reply (XDP_TX)", "100k fresh requests, 1 run each", arp_ns, base_call, "≤ 2×"),
        ("VIP forward, flow-table hit (XDP_TX)", "live frames, 100k repeats", hit_ns, base_live, "≤ 2.5×"),
        ("VIP forward, flow-table hit (XDP_TX)", "100k repeats, not live", hit_prog_ns, base, "≤ 2.5×"),
        ("VIP forward, flow-table hit, not in the flow cache (XDP_TX)", "65,536 established flows in turn, 1 run each", lru_ns, base_call, "—"),
        ("VIP forward, flow-table miss (XDP_TX)", "100k fresh TCP flows (first packet: SYN), 1 run each", miss_ns, base_call, "≤ 4×"),
        ("VIP forward, flow-table miss (XDP_TX)", "100k fresh UDP flows, 1 run each", miss_udp_ns, base_call, "—"),
        ("VIP forward, a flow's second packet: moved to lb4_flows (XDP_TX)", "100k TCP flows after their first packet, 1 run each", second_ns, base_call, "—"),
        ("reference: the flow tables' lookups + insert alone (`xdp_floor_flow_insert`)", "100k fresh TCP flows, 1 run each", floor_ns, base_call, "—"),
        ("non-VIP pass (XDP_PASS)", "100k repeats", pass_ns, base, "—"),
    ];
    for (name, mode, ns, b, target) in rows {
        let a = at(format!("{name} [{mode}]"));
        t.row(line!(
            "| {name} | {} | {} | {} | {}× | {target} |",
            a.f("mode").show(mode),
            a.f("ns_per_packet").num(ns, 1),
            a.f("baseline_ns").num(b, 1),
            a.f("ratio").num(ns / b, 2)
        ));
    }
    s.table(t);
    s.para(line!(
        "Memory latency (userspace pointer chase, 4 KiB pages): {} ns per load within 1 MiB, {} ns within 64 MiB.",
        at("memory latency ns [1 MiB]").num(lat_l2, 1),
        at("memory latency ns [64 MiB]").num(lat_dram, 1)
    ));
    Ok(s)
}
