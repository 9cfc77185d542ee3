//! Data-path cost per packet (BPF_PROG_TEST_RUN) as ratios to a trivial XDP_PASS
//! program measured in the same run, and the machine's memory latency beside them.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::Instant,
};

use anyhow::Result;
use vip_agent::{
    dataplane::{monotonic_ns, BackendSpec, Dataplane, ServiceAddr},
    model::Protocol,
};
use vip_tests::{
    frames,
    netns::{NetNs, PinDir},
};

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
/// New flows whose first packets are sent before their second ones: about what
/// one round trip holds at a high connection rate.
const PAIR_CHUNK: u32 = 256;
const OUR_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 0xaa];
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0x100);
/// IPv6 flows cycled through for the not-cached row: as many as IPv4's (both
/// families share `lb_flows`).
const SPREAD_FLOWS6: u32 = SPREAD_FLOWS;
/// The hit rows' port (see [`bench_dataplane`]).
const HIT_PORT: u16 = 8080;

/// Median over ROUNDS of ns/packet for `repeat` runs of one frame.
fn per_packet(dp: &mut Dataplane, prog: &str, frame: &[u8], live: bool) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..ROUNDS {
        let (_, _, d) = dp.test_run_program(prog, frame, REPEAT, live.then_some(64))?;
        v.push(d.as_nanos() as f64);
    }
    Ok(median(v))
}

/// [`per_packet`] in live-frames mode, or None where the kernel refuses that mode
/// (BPF_PROG_RUN answers EPERM, even to root, on some kernel builds): its row is
/// then left out.
fn per_packet_live(dp: &mut Dataplane, prog: &str, frame: &[u8]) -> Result<Option<f64>> {
    match per_packet(dp, prog, frame, true) {
        Ok(ns) => Ok(Some(ns)),
        Err(e) if e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.raw_os_error() == Some(libc::EPERM))) => {
            eprintln!("xdp: the kernel refuses live frames ({e:#}): the live-frames row is left out");
            Ok(None)
        }
        Err(e) => Err(e),
    }
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

/// Median over ROUNDS of the mean ns of MISS_FLOWS new flows' `first` then
/// `second` packet: in chunks of PAIR_CHUNK flows, first their first packets, then
/// their second ones (each chunk stays within one round trip's worth of flows);
/// `timed` says which of the two are timed (both: the sum per flow).
fn per_pair(dp: &mut Dataplane, first: &dyn Fn(u32) -> Vec<u8>, second: &dyn Fn(u32) -> Vec<u8>, timed: (bool, bool), round_base: &mut u32) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..ROUNDS {
        let mut total = 0u128;
        for chunk in (0..MISS_FLOWS).step_by(PAIR_CHUNK as usize) {
            let flows = chunk..(chunk + PAIR_CHUNK).min(MISS_FLOWS);
            for (frame_for, t) in [(first, timed.0), (second, timed.1)] {
                for i in flows.clone() {
                    let (_, _, d) = dp.test_run(&frame_for(*round_base + i), 1, None)?;
                    total += if t { d.as_nanos() } else { 0 };
                }
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
    dp.hold_vip(1, VIP6, monotonic_ns() + 3_600_000_000_000)?;
    let backends: Vec<BackendSpec> = (1..=10u8)
        .map(|i| BackendSpec { name: format!("node-{i}"), addr: Ipv4Addr::new(198, 18, 0, 10 + i).into(), mac: [2, 0, 0, 0, 0x10, i], weight: 1, local: false })
        .collect();
    dp.set_service(ServiceAddr { vip: VIP.into(), port: 80, protocol: Protocol::Tcp }, &backends, 16381, 0)?;
    dp.set_service(ServiceAddr { vip: VIP.into(), port: 53, protocol: Protocol::Udp }, &backends, 16381, 0)?;
    dp.set_service(ServiceAddr { vip: VIP6.into(), port: 80, protocol: Protocol::Tcp }, &backends, 16381, 0)?;
    // The hit rows' services: runs that are not live keep the rewritten frame, and
    // the data path balances only frames to our MAC, so their one backend has our
    // MAC (not local): each repeat is still a hit. A hit does the same work
    // whatever the backend's MAC.
    let ours = [BackendSpec { mac: OUR_MAC, ..backends[0].clone() }];
    dp.set_service(ServiceAddr { vip: VIP.into(), port: HIT_PORT, protocol: Protocol::Tcp }, &ours, 16381, 0)?;
    dp.set_service(ServiceAddr { vip: VIP6.into(), port: HIT_PORT, protocol: Protocol::Tcp }, &ours, 16381, 0)?;
    Ok((dp, pins))
}

/// One measured path: its name, how it is timed, ns, the trivial program's ns in
/// the same mode, and its target.
type Row = (&'static str, &'static str, f64, f64, &'static str);

/// A flow's frame by flow number.
type FrameFor<'a> = &'a dyn Fn(u32) -> Vec<u8>;

/// The section, as root in a namespace of our own, and beside it the same rows
/// measured by this binary run again with CAP_BPF and CAP_NET_ADMIN only (the
/// DaemonSet's load mode; see [`reduced_caps_rows`]). VIP_BENCH_NETNS=caller: the
/// caller has put us in a namespace and chosen our capabilities; one mode only.
pub fn section() -> Result<Section> {
    if std::env::var("VIP_BENCH_NETNS").as_deref() == Ok("caller") {
        return Ok(table(&rows()?, None));
    }
    let ns = NetNs::new("vbench")?;
    let root = ns.run(rows)??;
    let reduced = reduced_caps_rows(&ns)?;
    Ok(table(&root, Some(&reduced)))
}

/// VIP_BENCH_XDP_ROWS=FILE: measure the rows only and write them to FILE as JSON
/// (ns, trivial ns per row), for the parent run that reports both load modes.
pub fn write_rows(path: &str) -> Result<()> {
    let r: Vec<(f64, f64)> = rows()?.iter().map(|r| (r.2, r.3)).collect();
    std::fs::write(path, serde_json::to_string(&r)?)?;
    Ok(())
}

/// The rows measured by this binary in `ns` under `setpriv` with CAP_BPF and
/// CAP_NET_ADMIN only: the verifier adds its Spectre mitigations (no CAP_PERFMON).
fn reduced_caps_rows(ns: &NetNs) -> Result<Vec<(f64, f64)>> {
    let out = std::env::temp_dir().join(format!("vip-bench-xdp-{}.json", std::process::id()));
    let caps = "-all,+bpf,+net_admin";
    let status = ns
        .cmd("setpriv")
        .args(["--bounding-set", caps, "--inh-caps", caps, "--ambient-caps", caps, "--"])
        .arg(std::env::current_exe()?)
        .env("VIP_BENCH_XDP_ROWS", &out)
        .env("VIP_BENCH_NETNS", "caller")
        .status()?;
    anyhow::ensure!(status.success(), "the reduced-capabilities run failed: {status}");
    let rows = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    Ok(serde_json::from_slice(&rows?)?)
}

fn table(rows: &[Row], reduced: Option<&[(f64, f64)]>) -> Section {
    let (lat_l2, lat_dram) = (memory_latency(1 << 20), memory_latency(64 << 20));
    let mut s = Section::new(line!("XDP data path (BPF_PROG_TEST_RUN, ns/packet, median of {ROUNDS} rounds)"));
    let mut t = match reduced {
        Some(_) => Table::new(
            "| path | mode | as root: ns | trivial | ratio | CAP_BPF + CAP_NET_ADMIN only: ns | trivial | ratio | target |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ),
        None => Table::new("| path | mode | ns/packet | trivial XDP_PASS, same mode | ratio | target |", "|---|---|---:|---:|---:|---|"),
    };
    for (i, &(name, mode, ns, b, target)) in rows.iter().enumerate() {
        let a = at(format!("{name} [{mode}]"));
        match reduced.map(|r| r[i]) {
            Some((rns, rb)) => t.row(line!(
                "| {name} | {} | {} | {} | {}× | {} | {} | {}× | {target} |",
                a.f("mode").show(mode),
                a.f("ns_per_packet").num(ns, 1),
                a.f("baseline_ns").num(b, 1),
                a.f("ratio").num(ns / b, 2),
                a.f("reduced_caps_ns_per_packet").num(rns, 1),
                a.f("reduced_caps_baseline_ns").num(rb, 1),
                a.f("reduced_caps_ratio").num(rns / rb, 2)
            )),
            None => t.row(line!(
                "| {name} | {} | {} | {} | {}× | {target} |",
                a.f("mode").show(mode),
                a.f("ns_per_packet").num(ns, 1),
                a.f("baseline_ns").num(b, 1),
                a.f("ratio").num(ns / b, 2)
            )),
        }
    }
    s.table(t);
    s.para(line!(
        "Memory latency (userspace pointer chase, 4 KiB pages): {} ns per load within 1 MiB, {} ns within 64 MiB.",
        at("memory latency ns [1 MiB]").num(lat_l2, 1),
        at("memory latency ns [64 MiB]").num(lat_dram, 1)
    ));
    s
}

/// Measures every row in this process's namespace and capabilities.
fn rows() -> Result<Vec<Row>> {
    let (mut dp, _pins) = bench_dataplane()?;
    let arp = frames::arp_request(CLIENT_MAC, CLIENT, VIP, None);
    let fwd = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 40000), (VIP, HIT_PORT));
    let other = frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, (CLIENT, 40000), (Ipv4Addr::new(198, 18, 0, 200), 80));
    let tuple = |i: u32| (Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + (i >> 12)), 1024 + (i & 0xfff) as u16);
    let syn = |i: u32| frames::tcp(OUR_MAC, CLIENT_MAC, None, tuple(i), (VIP, 80));
    let ack = |i: u32| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, tuple(i), (VIP, 80));
    let udp = |i: u32| frames::udp(OUR_MAC, CLIENT_MAC, tuple(i), (VIP, 53), b"query");
    // Established flows (SYN, then the ACK that pins them), cycled so that each
    // run misses the per-CPU flow cache.
    let spread_tuple = |i: u32| {
        let i = i % SPREAD_FLOWS;
        (Ipv4Addr::new(198, 19, 200, (i >> 8) as u8), 1024 + (i & 0xff) as u16)
    };
    let spread = |i: u32| frames::tcp_ack(OUR_MAC, CLIENT_MAC, None, spread_tuple(i), (VIP, 80));
    for i in 0..SPREAD_FLOWS {
        dp.test_run(&frames::tcp(OUR_MAC, CLIENT_MAC, None, spread_tuple(i), (VIP, 80)), 1, None)?;
        dp.test_run(&spread(i), 1, None)?;
    }
    // The hit rows' flow, established.
    dp.test_run(&frames::tcp(OUR_MAC, CLIENT_MAC, None, (CLIENT, 40000), (VIP, HIT_PORT)), 1, None)?;
    dp.test_run(&fwd, 1, None)?;
    let base_live = per_packet_live(&mut dp, "xdp_baseline_pass", &fwd)?;
    let base = per_packet(&mut dp, "xdp_baseline_pass", &fwd, false)?;
    let mut base_round = 0;
    let base_call = per_call(&mut dp, "xdp_baseline_pass", &syn, &mut base_round)?;
    // Live frames are not reset between repeats: after one reply the frame is a
    // reply and would take the pass path. Each ARP run gets a fresh request.
    let mut arp_round = 0;
    let arp_ns = per_call(&mut dp, "vip_xdp", &|_| arp.clone(), &mut arp_round)?;
    let hit_ns = match base_live {
        Some(_) => per_packet_live(&mut dp, "vip_xdp", &fwd)?,
        None => None,
    };
    // Non-live repeats keep the rewritten frame: still TCP to the VIP, still a hit.
    let forwarded = |dp: &Dataplane| -> Result<u64> { Ok(dp.counters()?.reasons["forwarded"].0) };
    let before = forwarded(&dp)?;
    let hit_prog_ns = per_packet(&mut dp, "vip_xdp", &fwd, false)?;
    anyhow::ensure!(forwarded(&dp)? - before == u64::from(REPEAT) * ROUNDS as u64, "the hit row's repeats were not all forwarded");
    let pass_ns = per_packet(&mut dp, "vip_xdp", &other, false)?;
    let pinned = dp.flow_count();
    // All but a few: with 65,537 flows a set of four ways overflows now and then.
    anyhow::ensure!(pinned * 1000 > SPREAD_FLOWS as usize * 999, "established flows were not pinned: {pinned} in lb_flows");
    let mut spread_round = 0;
    let lru_ns = per_call(&mut dp, "vip_xdp", &spread, &mut spread_round)?;
    anyhow::ensure!(dp.flow_count() == pinned, "established flows were not all in the flow table");

    // IPv6: the same paths, beside their IPv4 twins.
    let ns6 = frames::neighbor_solicitation(CLIENT_MAC, None, CLIENT6, VIP6);
    let ns6_ns = per_call(&mut dp, "vip_xdp", &|_| ns6.clone(), &mut arp_round)?;
    let fwd6 = frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, 40000), (VIP6, HIT_PORT), frames::TCP_ACK);
    dp.test_run(&frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, 40000), (VIP6, HIT_PORT), frames::TCP_SYN), 1, None)?;
    dp.test_run(&fwd6, 1, None)?;
    let before = forwarded(&dp)?;
    let hit6_ns = per_packet(&mut dp, "vip_xdp", &fwd6, false)?;
    anyhow::ensure!(forwarded(&dp)? - before == u64::from(REPEAT) * ROUNDS as u64, "the IPv6 hit row's repeats were not all forwarded");
    let other6 = frames::tcp6(OUR_MAC, CLIENT_MAC, None, (CLIENT6, 40000), (CLIENT6, 80), frames::TCP_ACK);
    let pass6_ns = per_packet(&mut dp, "vip_xdp", &other6, false)?;
    let tuple6 = |i: u32| (Ipv6Addr::from(u128::from(Ipv6Addr::new(0x2001, 2, 0x19, 0, 0, 0, 0, 0)) + u128::from(i >> 12)), 1024 + (i & 0xfff) as u16);
    let spread6 = |i: u32| frames::tcp6(OUR_MAC, CLIENT_MAC, None, tuple6(i % SPREAD_FLOWS6 + (1 << 24)), (VIP6, 80), frames::TCP_ACK);
    for i in 0..SPREAD_FLOWS6 {
        dp.test_run(&frames::tcp6(OUR_MAC, CLIENT_MAC, None, tuple6(i + (1 << 24)), (VIP6, 80), frames::TCP_SYN), 1, None)?;
        dp.test_run(&spread6(i), 1, None)?;
    }
    // Counted with IPv4's: an IPv6 flow may take the way of an IPv4 one.
    let all = dp.flow_count();
    let both = SPREAD_FLOWS as usize + SPREAD_FLOWS6 as usize;
    anyhow::ensure!(all * 1000 > both * 998, "IPv6 flows were not pinned: {all} in lb_flows ({pinned} before them)");
    let lru6_ns = per_call(&mut dp, "vip_xdp", &spread6, &mut spread_round)?;
    anyhow::ensure!(dp.flow_count() == all, "the flow table changed while its IPv6 flows were looked up");
    let c6 = dp.counters()?;
    anyhow::ensure!(c6.reasons["ndp_answered"].0 >= u64::from(MISS_FLOWS) * ROUNDS as u64, "NDP path not taken: {:?}", c6.reasons);
    let syn6 = |i: u32| frames::tcp6(OUR_MAC, CLIENT_MAC, None, tuple6(i), (VIP6, 80), frames::TCP_SYN);
    let ack6 = |i: u32| frames::tcp6(OUR_MAC, CLIENT_MAC, None, tuple6(i), (VIP6, 80), frames::TCP_ACK);
    let c = dp.counters()?;
    anyhow::ensure!(c.reasons["arp_answered"].0 >= u64::from(MISS_FLOWS) * ROUNDS as u64, "ARP path not taken: {:?}", c.reasons);
    let hit_runs = if hit_ns.is_some() { 2 } else { 1 };
    anyhow::ensure!(
        c.reasons["forwarded"].0 >= (hit_runs * u64::from(REPEAT) + u64::from(MISS_FLOWS)) * ROUNDS as u64,
        "forward path not taken: {:?}",
        c.reasons
    );

    let mut round = 1 << 24;
    // Each new-flow row gets new maps, as the miss row always had: an empty flow
    // table whose free entries lie in allocation order (after deletions they are
    // scattered, and every insert costs more). Every packet must be forwarded.
    let mut new_flows = |first: FrameFor, second: Option<(FrameFor, (bool, bool))>| -> Result<f64> {
        let (mut mdp, _pins) = bench_dataplane()?;
        let (ns, packets) = match second {
            None => (per_call(&mut mdp, "vip_xdp", first, &mut round)?, 1),
            Some((second, timed)) => {
                let ns = per_pair(&mut mdp, first, second, timed, &mut round)?;
                // Pinned at their second packet (a few, whose first-packet record
                // another flow of their chunk overwrote, at their third).
                anyhow::ensure!(mdp.flow_count() * 100 >= MISS_FLOWS as usize * 95, "second packets did not pin their flows: {}", mdp.flow_count());
                (ns, 2)
            }
        };
        let forwarded = mdp.counters()?.reasons["forwarded"].0;
        anyhow::ensure!(forwarded == packets * u64::from(MISS_FLOWS) * ROUNDS as u64, "new-flow path not taken: {forwarded} forwarded");
        Ok(ns)
    };
    let syn_ns = new_flows(&syn, None)?;
    let ack_ns = new_flows(&syn, Some((&ack, (false, true))))?;
    let tcp_both = new_flows(&syn, Some((&ack, (true, true))))?;
    let udp_ns = new_flows(&udp, None)?;
    let udp2_ns = new_flows(&udp, Some((&udp, (false, true))))?;
    let udp_both = new_flows(&udp, Some((&udp, (true, true))))?;
    let syn6_ns = new_flows(&syn6, None)?;
    let tcp6_both = new_flows(&syn6, Some((&ack6, (true, true))))?;
    let live = hit_ns.zip(base_live).map(|(ns, b)| ("VIP forward, flow-table hit (XDP_TX)", "live frames, 100k repeats", ns, b, "≤ 2.5×"));
    let mut rows = vec![("ARP reply (XDP_TX)", "100k fresh requests, 1 run each", arp_ns, base_call, "≤ 2×")];
    rows.extend(live);
    rows.extend([
        ("VIP forward, flow-table hit (XDP_TX)", "100k repeats, not live", hit_prog_ns, base, "≤ 2.5×"),
        ("VIP forward, established flow not in the flow cache (XDP_TX)", "65,536 established flows in turn, 1 run each", lru_ns, base_call, "≤ 3.5×"),
        ("new TCP flow, first packet (SYN)", "100k fresh flows, 1 run each", syn_ns, base_call, "≤ 7.3×"),
        ("new TCP flow, second packet (ACK after its SYN)", "100k flows, SYNs of 256 then their ACKs, ACKs timed", ack_ns, base_call, "—"),
        ("new TCP flow, first two packets together (per flow)", "as above, both timed", tcp_both, base_call, "≤ 10×"),
        ("new UDP flow, first packet", "100k fresh flows, 1 run each", udp_ns, base_call, "≤ 7.3×"),
        ("new UDP flow, second packet", "100k flows, 256 first packets then their second ones", udp2_ns, base_call, "—"),
        ("new UDP flow, first two packets together (per flow)", "as above, both timed", udp_both, base_call, "≤ 10×"),
        ("non-VIP pass (XDP_PASS)", "100k repeats, not live", pass_ns, base, "≤ 1.5× (DaemonSet's mode)"),
        ("IPv6: Neighbor Solicitation answered (XDP_TX)", "100k fresh solicitations, 1 run each", ns6_ns, base_call, "≤ 1.2× ARP's"),
        ("IPv6: VIP forward, flow-table hit (XDP_TX)", "100k repeats, not live", hit6_ns, base, "≤ 1.2× IPv4's"),
        ("IPv6: established flow not in the flow cache (XDP_TX)", "65,536 established flows in turn, 1 run each", lru6_ns, base_call, "≤ 1.2× IPv4's"),
        ("IPv6: new TCP flow, first packet (SYN)", "100k fresh flows, 1 run each", syn6_ns, base_call, "≤ 1.2× IPv4's"),
        ("IPv6: new TCP flow, first two packets together (per flow)", "SYNs of 256 then their ACKs, both timed", tcp6_both, base_call, "≤ 1.2× IPv4's"),
        ("IPv6: non-VIP pass (XDP_PASS)", "100k repeats, not live", pass6_ns, base, "≤ 1.2× IPv4's"),
    ]);
    Ok(rows)
}
