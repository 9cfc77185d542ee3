//! The scale section: the HA lab (three real agents, default timers) with
//! thousands of service-ports at the default table size.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use vip_agent::dataplane::Dataplane;
use vip_tests::{
    agent::wait_for,
    halab::{self, HaLab, HaSpec, Naming},
};

use crate::{
    measure::{cpu_ticks, ms, rss_mib, Dist},
    report::{at, line, At, Entry, Fig, Line, Section, Table},
};

const TRIALS: usize = 10;

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

/// Starts the lab with `vips` VIPs × 2 ports (each with an IPv6 twin if
/// `ipv6`), measures the start, and returns the lab with the table row
/// (`label`, recorded at `scale_start.KEY`).
fn scale_start(vips: usize, ipv6: bool, label: &str, key: &str) -> Result<(HaLab, Line)> {
    let spec = HaSpec { vips, ipv6, ports: vec![80, 8080], table_size: None, default_timers: true, check_interval_ms: 200, ..Default::default() };
    let t = Instant::now();
    let lab = HaLab::start(spec, Naming::Unique, &std::env::current_exe()?)?;
    let all = [0, 1, 2];
    lab.wait_converged(&all, Duration::from_secs(120))?;
    lab.wait_rings_full(&all, Duration::from_secs(120))?;
    let converged_ms = ms(t.elapsed());
    let pids: Vec<u32> = lab.nodes.iter().map(|n| n.agent.as_ref().map(|a| a.child.id())).collect::<Option<_>>().context("agents")?;
    let rss = pids.iter().filter_map(|p| rss_mib(*p)).fold(0.0, f64::max);
    let bpf = bpf_map_bytes(&lab.nodes[0].pins.path)? as f64 / (1024.0 * 1024.0);
    let hz = 100.0; // USER_HZ
    let before: Vec<u64> = pids.iter().filter_map(|p| cpu_ticks(*p)).collect();
    let idle = Duration::from_secs(10);
    std::thread::sleep(idle);
    let after: Vec<u64> = pids.iter().filter_map(|p| cpu_ticks(*p)).collect();
    let busiest = before.iter().zip(&after).map(|(b, a)| (a - b) as f64 / hz).fold(0.0, f64::max);
    let a = at("scale_start").f(key);
    let row = line!(
        "| {label} | {} ms | {} MiB | {} MiB | {} % |",
        a.f("converged_ms").num(converged_ms, 0),
        a.f("rss_mib").num(rss, 1),
        a.f("bpf_mib").num(bpf, 1),
        a.f("idle_cpu_pct").num(100.0 * busiest / idle.as_secs_f64(), 1)
    );
    Ok((lab, row))
}

/// What one run of [`scale_health`] saw, summed over the agents.
struct ScaleHealth {
    health_to_maps_us: Vec<f64>,
    heartbeat_gap_max_ms: f64,
    liveness_stalls: f64,
    false_liveness_changes: usize,
    owner_changes: f64,
    flows_evicted: f64,
    sweep_mean_ms: f64,
    scrapes: Vec<u32>,
}

/// TRIALS health changes (node-3's server stopped, then started) with every
/// flow table refilled to 1M entries before each (half of them IPv6 flows in a
/// dual-stack lab); `scrape`: /metrics on every agent every second throughout.
fn scale_health(lab: &mut HaLab, scrape_every_s: bool) -> Result<ScaleHealth> {
    let all = [0, 1, 2];
    let vips: Vec<Ipv4Addr> = (0..lab.spec.vips).map(halab::vip).collect();
    let vips6: Vec<Ipv6Addr> = (0..lab.spec.vips).map(halab::vip6).collect();
    let families = if lab.spec.ipv6 { 2 } else { 1 };
    let services = families * lab.spec.vips * lab.spec.ports.len();
    let before: Vec<String> = (0..lab.nodes.len()).map(|i| lab.metrics(i)).collect();
    let logs = |lab: &HaLab| -> Vec<usize> {
        lab.nodes.iter().map(|n| std::fs::read_to_string(&n.log).unwrap_or_default().matches("peer liveness changed").count()).collect()
    };
    let liveness_before = logs(lab);
    let samples_before: Vec<usize> = all.iter().map(|&i| lab.status(i).map_or(0, |s| s.health_to_maps_us.len())).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scrapers = if scrape_every_s { halab::scrape_every(lab, Duration::from_secs(1), &stop) } else { Vec::new() };
    for trial in 0..TRIALS {
        for n in &lab.nodes {
            let ids: Vec<u32> = Dataplane::open(&n.pins.path)?.backends()?.into_keys().collect();
            let n_flows = vip_common::MAX_FLOWS as usize / families;
            let flows = vip_tests::flows::synthetic(n_flows, &vips, 80, &ids);
            if lab.spec.ipv6 {
                vip_tests::flows::fill_both(&n.pins.path, &flows, &vip_tests::flows::synthetic6(n_flows, &vips6, 80, &ids))?;
            } else {
                vip_tests::flows::fill(&n.pins.path, &flows)?;
            }
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
                .all(|&i| lab.status(i).is_some_and(|s| s.services.len() == services && s.services.iter().all(|x| x.backends.len() == want)))
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
        us.extend(s.health_to_maps_us.iter().skip(samples_before[i]).map(|&v| v as f64));
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
    Ok(ScaleHealth {
        health_to_maps_us: us,
        heartbeat_gap_max_ms: gap * 1e3,
        liveness_stalls: stalls,
        false_liveness_changes: liveness,
        owner_changes: moved,
        flows_evicted: evicted,
        sweep_mean_ms: if sweeps > 0.0 { 1e3 * sweep_s / sweeps } else { 0.0 },
        scrapes,
    })
}

/// The figures of one run (a column of the table) at `at`, by row.
struct Column {
    health: [Fig; 3],
    sweep: Fig,
    evicted: Fig,
    gap: Fig,
    stalls: Fig,
    liveness: Fig,
    moved: Fig,
    data: Vec<Entry>,
}

impl ScaleHealth {
    fn column(&self, a: &At) -> Column {
        let h = a.f("health_to_maps_us");
        Column {
            // Recorded in µs, shown in ms.
            health: Dist::of(&self.health_to_maps_us).figs(&h, 1e3, 1),
            sweep: a.f("sweep_mean_ms").num(self.sweep_mean_ms, 0),
            evicted: a.f("flows_evicted").num(self.flows_evicted, 0),
            gap: a.f("heartbeat_gap_max_ms").num(self.heartbeat_gap_max_ms, 0),
            stalls: a.f("liveness_stalls").num(self.liveness_stalls, 0),
            liveness: a.f("false_liveness_changes").show(self.false_liveness_changes),
            moved: a.f("owner_changes").num(self.owner_changes, 0),
            data: vec![h.f("samples").data(self.health_to_maps_us.len()), a.f("scrapes").data(&self.scrapes)],
        }
    }
}

pub fn section() -> Result<Section> {
    let mut s = Section::new(line!("Scale (HA lab, three real agents, default timers and table size 16381, every service health-checked)"));
    let mut t = Table::new(
        "| service-ports | start → converged (owners agreed, every ring full) | agent RSS (largest) | BPF map memory per node | idle CPU (busiest agent) |",
        "|---:|---:|---:|---:|---:|",
    );
    // 5,000 service-ports first, then the 2,000 the health figures use.
    let (lab, row) = scale_start(2500, false, "5,000 (2,500 VIPs × 2)", "5000")?;
    drop(lab);
    t.row(row);
    // Dual-stack: 1,000 IPv4 VIPs and their 1,000 IPv6 twins, 2 ports each.
    let (mut lab, row) = scale_start(1000, true, "4,000, dual-stack (1,000 VIPs and their IPv6 twins × 2)", "4000_dual")?;
    t.row(row);
    let dual = scale_health(&mut lab, false)?;
    drop(lab);
    let (mut lab, row) = scale_start(1000, false, "2,000 (1,000 VIPs × 2)", "2000")?;
    t.row(row);
    s.table(t);
    let quiet = scale_health(&mut lab, false)?;
    let scraped = scale_health(&mut lab, true)?;
    s.para(line!("{TRIALS} health changes on 1,000 VIPs × 2 ports (node-3's server stopped / started: every ring changes on every agent), each with every flow table refilled to 1M entries; samples from all three agents. The dual-stack lab adds each VIP's IPv6 twin (4,000 service-ports) and fills the flow tables half with IPv6 flows:"));
    let a = at("scale_health");
    let (q, c, d) = (quiet.column(&a.f("no_scrapes")), scraped.column(&a.f("scraped")), dual.column(&a.f("dual_stack")));
    let mut t = Table::new("| figure | no scrapes | /metrics scraped every second on every agent | dual-stack, no scrapes |", "|---|---:|---:|---:|");
    let [qm, qp, qx] = q.health;
    let [cm, cp, cx] = c.health;
    let [dm, dp, dx] = d.health;
    let mut health = line!(
        "| health change decided → every affected ring written, median / p95 / max (target: median ≤ 100 ms) | {} / {} / {} ms | {} / {} / {} ms | {} / {} / {} ms |",
        qm,
        qp,
        qx,
        cm,
        cp,
        cx,
        dm,
        dp,
        dx
    );
    for e in q.data.into_iter().chain(c.data).chain(d.data) {
        health = health.with(e);
    }
    t.row(health);
    t.row(line!("| flow-table sweep after the rings (mean; off the liveness path) | {} ms | {} ms | {} ms |", q.sweep, c.sweep, d.sweep));
    t.row(line!("| flows evicted (pinned to the backend that left), all agents | {} | {} | {} |", q.evicted, c.evicted, d.evicted));
    t.row(line!("| largest heartbeat gap any peer saw (target: below deadAfter = 300 ms) | {} ms | {} ms | {} ms |", q.gap, c.gap, d.gap));
    t.row(line!("| liveness stalls (heartbeats held back) | {} | {} | {} |", q.stalls, c.stalls, d.stalls));
    t.row(line!(
        "| false liveness changes / owner moves (target: 0) | {} / {} | {} / {} | {} / {} |",
        q.liveness,
        q.moved,
        c.liveness,
        c.moved,
        d.liveness,
        d.moved
    ));
    s.table(t);
    Ok(s)
}
