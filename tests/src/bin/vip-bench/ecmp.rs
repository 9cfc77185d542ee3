//! ECMP from every node (`announce: lo, distribution: all`, the nodes' own BGP
//! speakers: BIRD; and `announce: bgp`, the FRR each agent drives) through a real
//! router (FRR): long-lived connections
//! broken when a node leaves and rejoins the router's ECMP set, with vip's
//! shared rings and, in the same rounds, with plain ECMP to nodes that serve what
//! reaches them; and how soon the router drops a node whose agent stops.
use anyhow::Result;
use vip_tests::{
    halab::HaSpec,
    routed::{Churn, Death, RoutedLab, BFD_INTERVAL_MS, BFD_MULTIPLIER, HOLD_S, KEEPALIVE_S},
};

use crate::{
    measure::{median, ms},
    report::{at, line, Section, Table},
};

const ROUNDS: usize = 5;
/// Connections per step (before the node leaves; while it is out).
const CONNS: u16 = 48;

pub fn section() -> Result<Section> {
    let server = std::env::current_exe()?;
    let (mut plain, mut vip, mut bgp) = (Vec::new(), Vec::new(), Vec::new());
    let (mut hold, mut bfd): (Vec<Death>, Vec<Death>) = (Vec::new(), Vec::new());
    let (mut bgp_hold, mut bgp_bfd): (Vec<Death>, Vec<Death>) = (Vec::new(), Vec::new());
    let one = || HaSpec { vips: 1, ..Default::default() };
    for round in 0..ROUNDS {
        // A lab per round: fresh flows, a fresh router (its hash seed too).
        let mut r = RoutedLab::start(1, false, false, &server)?;
        let port = 20000 + 1000 * round as u16;
        plain.push(r.plain_churn(port, CONNS)?);
        vip.push(r.agent_churn(port + 500, CONNS)?);
        drop(r);
        let mut r = RoutedLab::start_bgp(one(), false, false, &server)?;
        bgp.push(r.agent_churn(port + 500, CONNS)?);
        drop(r);
        // A node's death, in a lab of its own each way: the session ends by the
        // hold timer, or by BFD; BIRD's session or the agent's FRR's.
        for (with_bgp, with_bfd, out) in [(false, false, &mut hold), (false, true, &mut bfd), (true, false, &mut bgp_hold), (true, true, &mut bgp_bfd)] {
            let mut r = if with_bgp { RoutedLab::start_bgp(one(), true, with_bfd, &server)? } else { RoutedLab::start(1, true, with_bfd, &server)? };
            out.push(r.node_death(port, CONNS)?);
        }
    }
    let a = at("ecmp");
    let mut s = Section::new(line!(
        "ECMP from every node: {} rounds, each a new three-node lab with an FRR router and, on the nodes, BIRD (`announce: lo`) or the FRR each agent drives (`announce: bgp`); {} long-lived connections opened before node-3 leaves the router's ECMP set and {} more while it is out",
        a.f("rounds").show(ROUNDS),
        a.f("conns").show(CONNS),
        a.f("conns_out").show(CONNS)
    ));
    let mut t = Table::new(
        "| data path | how node-3 leaves and rejoins | broken when it leaves (its own + others') | broken when it rejoins | router drops it (median) |",
        "|---|---|---:|---:|---:|",
    );
    let sum = |c: &[Churn], f: fn(&Churn) -> (usize, usize)| c.iter().map(f).fold((0, 0), |(x, y), (a, b)| (x + a, y + b));
    let total = ROUNDS * usize::from(CONNS);
    for (key, name, how, runs) in [
        ("plain", "plain ECMP, no rings", "VIP taken off its lo by hand, then put back", &plain),
        ("vip", "vip (`distribution: all`)", "agent SIGTERM (withdraws, stays a backend), then started", &vip),
        ("bgp", "vip (`announce: bgp`)", "agent SIGTERM (its FRR withdraws, the sessions stay up), then started", &bgp),
    ] {
        let k = a.f(key);
        let (l, j) = (sum(runs, |c| c.leave), sum(runs, |c| c.join));
        t.row(line!(
            "| {name} | {how} | {} + {} of {total} | {} of {total} | {} ms |",
            k.f("leave_own").show(l.0),
            k.f("leave_others").show(l.1),
            k.f("join").show(j.0 + j.1),
            k.f("withdrawn_ms").num(median(runs.iter().map(|c| ms(c.withdrawn)).collect()), 0)
        ));
    }
    s.table(t);
    let mut t = Table::new(
        "| node-3 dies (cable, agent, servers, speaker) | router drops it (median, max) | new connections failed (every 20 ms) | last failure after the death (max) | long-lived broken: its own + others' |",
        "|---|---:|---:|---:|---:|",
    );
    let longest = |d: &[Death]| d.iter().filter_map(|d| d.last_failed).max().map_or(0.0, ms);
    for (key, name, runs) in [
        ("hold", format!("BIRD: hold timer ({KEEPALIVE_S} s / {HOLD_S} s), no BFD"), &hold),
        ("bfd", format!("BIRD: BFD {BFD_INTERVAL_MS} ms × {BFD_MULTIPLIER}"), &bfd),
        ("bgp_hold", format!("`announce: bgp`: hold timer ({KEEPALIVE_S} s / {HOLD_S} s), no BFD"), &bgp_hold),
        ("bgp_bfd", format!("`announce: bgp`: BFD {BFD_INTERVAL_MS} ms × {BFD_MULTIPLIER}"), &bgp_bfd),
    ] {
        let k = a.f(key);
        let w: Vec<f64> = runs.iter().map(|d| ms(d.withdrawn)).collect();
        let max = w.iter().copied().fold(0.0, f64::max);
        t.row(line!(
            "| {name} | {} ms, {} ms | {} of {} | {} ms | {} + {} of {} |",
            k.f("withdrawn_ms").num(median(w), 0),
            k.f("withdrawn_max_ms").num(max, 0),
            k.f("failed").show(runs.iter().map(|d| d.failed).sum::<usize>()),
            k.f("attempts").show(runs.iter().map(|d| d.attempts).sum::<usize>()),
            k.f("last_failed_ms").num(longest(runs), 0),
            k.f("long_own").show(runs.iter().map(|d| d.long_broken.0).sum::<usize>()),
            k.f("long_others").show(runs.iter().map(|d| d.long_broken.1).sum::<usize>()),
            k.f("long").show(runs.iter().map(|d| d.long).sum::<usize>())
        ));
    }
    s.table(t);
    s.para(line!(
        "A node's flows reach the other nodes when the router drops it; the survivors' flows that the router's hash-threshold selection moves too break under plain ECMP and not under vip, whose nodes send each flow by the same ring. The time is from the end of the step (the address removed; the agent exited after SIGTERM) to the router's RIB and FIB both without the node, polled (one `vtysh` and one `ip route` call a poll, 5 ms apart). Generic XDP; BGP timers 1 s / 3 s, no BFD (not involved: the speakers withdraw)."
    ));
    s.para(line!(
        "A node's death: the time is from its cable pulled to the router's RIB and FIB without it. Until then the router sends the dead node's share to its MAC: those new connections fail until it drops the node (their SYNs retried after 1 s and 3 s meet the same hash), which is what the session's timers buy. With the node's bridge port down the bridge floods those frames to every port; the other nodes pass them (`passed_other_host`): balanced by each of them, a frame would reach its backend once per node. The dead node's own long-lived connections end with it; the others' flows through it go to surviving nodes, which send them by rings without the dead backend."
    ));
    Ok(s)
}
