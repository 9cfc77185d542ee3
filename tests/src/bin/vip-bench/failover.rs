//! Failover in the HA lab (three nodes, real agents, dual-stack VIPs): TRIALS
//! faults of each kind on the owner of an IPv4 VIP and as many, alternated with
//! them, on the owner of an IPv6 one, with new connections attempted every 10 ms
//! from the client and established connections (to other backends) kept busy;
//! then healed partitions.
use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use vip_agent::dataplane::AttachMode;
use vip_tests::{
    agent::wait_for,
    frames,
    halab::{self, ArpWatch, FailoverWatch, HaLab, HaSpec, LongConn, Naming},
};

use crate::{
    measure::{ms, percentile, Dist},
    report::{at, line, Section, Table},
};

const TRIALS: usize = 20;

#[derive(Clone, Copy, Debug)]
enum Fault {
    AgentKill,
    AgentStop,
    LinkDown,
}

struct Trial {
    first_ok_ms: f64,
    failed_attempts: usize,
    /// How long the fault command itself took (SIGKILL: until the agent was reaped).
    fault_ms: f64,
    takeover_ms: Option<f64>,
    conns: usize,
    broken: usize,
}

/// One fault on the owner of VIP `k`, the IPv4 one or (`ipv6`) its IPv6 twin.
fn failover_trial(lab: &mut HaLab, fault: Fault, k: usize, ipv6: bool) -> Result<Trial> {
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    lab.wait_converged(&all, Duration::from_secs(10))?;
    // Every node's rings whole again (the previous trial's node re-admitted): the
    // trial measures the owner's failure, not a backend change still in flight.
    lab.wait_rings_full(&all, Duration::from_secs(10))?;
    let v: IpAddr = if ipv6 { halab::vip6(k % lab.spec.vips).into() } else { halab::vip(k % lab.spec.vips).into() };
    let a = lab.index_of(&lab.owner_seen_by(0, v).with_context(|| format!("no owner of {v}"))?);
    let a_mac = lab.nodes[a].mac;
    let avoid = lab.nodes[a].name.clone();
    // A client entry still naming another node (the previous trial's interim
    // owner) would take the connections there: wait for the owner's first.
    if lab.client_neigh(v).is_some_and(|m| m != a_mac) {
        let settled = wait_for(Duration::from_secs(3), || (lab.client_neigh(v) == Some(a_mac)).then_some(()));
        eprintln!("failover: {v}: the client's entry named another node than the owner {avoid} (settled: {})", settled.is_some());
    }
    let mut conns = Vec::new();
    let mut served = Vec::new();
    for _ in 0..8 {
        let c = LongConn::open(&lab.client, v, 0, Duration::from_secs(2))?;
        served.push(c.backend.clone());
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
    // Per trial, on stderr: which trials lost connections or attempts.
    eprintln!(
        "failover: {fault:?} on {v} (owner {avoid}): first new connection {:?}, {} attempts failed, {} of {} established broke (the 8 opened served by {served:?})",
        o.first_ok, o.failed, o.broken, o.conns
    );
    Ok(Trial {
        first_ok_ms: ms(o.first_ok.context("no successful connection after the fault")?),
        failed_attempts: o.failed,
        takeover_ms: o.takeover.map(ms),
        conns: o.conns,
        broken: o.broken,
        fault_ms: ms(done - t0),
    })
}

/// A healed partition: the owner is isolated with its link up (bridge port
/// disabled; a lost carrier would make it hold nothing) until the others took its
/// VIP over (it then holds every VIP alone), then joined again. From the heal on, the
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
    lab.seg.isolate(&lab.nodes[a].ns, true)?;
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
    lab.seg.isolate(&lab.nodes[a].ns, false)?;
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

/// "median / p95 / max ms" of samples, or "—" without any.
fn dist_text(v: &[f64]) -> String {
    if v.is_empty() {
        return "—".to_owned();
    }
    let d = Dist::of(v);
    format!("{:.0} / {:.0} / {:.0} ms", d.median, d.p95, d.max)
}

/// `VIP_BENCH_FAULTS=agentkill,agentstop,linkdown,heal` runs some of them. Each
/// runs twice: the agents attaching XDP in generic mode, then in native mode
/// (`VIP_BENCH_XDP_MODES=native` runs one of them).
pub fn section() -> Result<Section> {
    let spec = HaSpec { ipv6: true, ..HaSpec::default() };
    let HaSpec { heartbeat_ms, dead_after_ms, hold_ms, .. } = spec;
    let mut s = Section::new(line!(
        "Failover (HA lab: 3 nodes, real agents, dual-stack VIPs; heartbeat {heartbeat_ms} ms, deadAfter {dead_after_ms} ms, holdTime {hold_ms} ms; {TRIALS} trials each on an IPv4 VIP's owner and as many on an IPv6 VIP's, alternated; XDP generic, then native)"
    ));
    let modes = std::env::var("VIP_BENCH_XDP_MODES").unwrap_or_default();
    for (mode, name) in [(AttachMode::Generic, "generic"), (AttachMode::Native, "native")] {
        if modes.is_empty() || modes.split(',').any(|m| m == name) {
            mode_trials(&mut s, HaSpec { xdp_mode: mode, ..spec.clone() })?;
        }
    }
    Ok(s)
}

/// The trials with the agents attaching in `spec.xdp_mode`: a table and the heal
/// paragraph. Generic keeps the figures' names of earlier runs; native ones end in `_native`.
fn mode_trials(s: &mut Section, spec: HaSpec) -> Result<()> {
    let (mode, suffix) = match spec.xdp_mode {
        AttachMode::Native => ("native", "_native"),
        _ => ("generic", ""),
    };
    let mut lab = HaLab::start(spec.clone(), Naming::Unique, &std::env::current_exe()?)?;
    let HaSpec { heartbeat_ms, .. } = spec;
    s.para(line!("XDP attached in **{mode}** mode by the agents (`run --mode {mode}`):"));
    let mut t = Table::new(
        "| fault on the VIP's owner | VIP | fault → first new connection: median / p95 / max | new connections failed (all trials) | fault → new owner's gratuitous ARP (IPv6: unsolicited Neighbor Advertisement) at the client: median / p95 / max | established connections broken (owner not their backend) |",
        "|---|---|---|---:|---|---:|",
    );
    let faults = std::env::var("VIP_BENCH_FAULTS").unwrap_or_default();
    for fault in [Fault::AgentKill, Fault::AgentStop, Fault::LinkDown] {
        if !faults.is_empty() && !faults.split(',').any(|f| format!("{fault:?}").eq_ignore_ascii_case(f)) {
            continue;
        }
        let mut by_family = [Vec::new(), Vec::new()];
        for k in 0..TRIALS {
            for (ipv6, trials) in [false, true].into_iter().zip(by_family.iter_mut()) {
                trials.push(failover_trial(&mut lab, fault, k, ipv6).with_context(|| format!("{fault:?} trial {k} ({mode}, IPv6 {ipv6})"))?);
            }
        }
        for (trials, (family, tag)) in by_family.iter().zip([("IPv4", ""), ("IPv6", "_ipv6")]) {
            let first: Vec<f64> = trials.iter().map(|t| t.first_ok_ms).collect();
            let take: Vec<f64> = trials.iter().filter_map(|t| t.takeover_ms).collect();
            let failed: usize = trials.iter().map(|t| t.failed_attempts).sum();
            let (conns, broken): (usize, usize) = (trials.iter().map(|t| t.conns).sum(), trials.iter().map(|t| t.broken).sum());
            let name = match fault {
                Fault::AgentKill => "agent SIGKILL",
                Fault::AgentStop => "agent SIGSTOP (hung)",
                Fault::LinkDown => "link down (bridge port)",
            };
            let (first_d, take_d, seen) = (dist_text(&first), dist_text(&take), take.len());
            let a = at(format!("failover_{fault:?}{tag}{suffix}"));
            t.row(
                line!(
                    "| {name} | {family} | {first_d} | {} | {take_d} ({seen} of {TRIALS} seen) | {} of {} |",
                    a.f("failed_attempts").show(failed),
                    a.f("broken").show(broken),
                    a.f("connections").show(conns)
                )
                .with(a.f("first_new_connection_ms").data(&first))
                .with(a.f("takeover_garp_ms").data(&take))
                .with(a.f("fault_command_ms").data(trials.iter().map(|t| t.fault_ms).collect::<Vec<_>>())),
            );
        }
    }
    s.table(t);
    if faults.is_empty() || faults.split(',').any(|f| f.eq_ignore_ascii_case("heal")) {
        // Stated bound: the cut-off node hears a peer within one heartbeat interval of
        // the heal (and resolves its neighbours at once), the peers hear it within one
        // more; 100 ms covers reconciles, the 100 ms conflict poll and delivery.
        let bound = Duration::from_millis(2 * heartbeat_ms + 100);
        let mut last = Vec::new();
        let mut late = 0;
        for k in 0..TRIALS {
            let (l, n) = heal_trial(&mut lab, k, bound).with_context(|| format!("heal trial {k} ({mode})"))?;
            last.push(l.unwrap_or(0.0));
            late += n;
        }
        let (median, max) = (percentile(&last, 0.5), percentile(&last, 1.0));
        let a = at(format!("heal{suffix}"));
        s.para(
            line!(
                "Partition heal ({mode}; {TRIALS} trials: the owner isolated with its link up until it held every VIP alone, then joined again; the client asks ARP for every VIP every 10 ms for 1 s): last answer or announcement from a MAC other than the final owner's, after the heal: median {median:.0} ms, max {max:.0} ms; after the stated bound ({} ms = 2 × heartbeat interval + 100 ms): {}.",
                a.f("bound_ms").show(bound.as_millis() as u64),
                a.f("wrong_after_bound").show(late)
            )
            .with(a.f("last_wrong_ms").data(&last)),
        );
    }
    Ok(())
}
