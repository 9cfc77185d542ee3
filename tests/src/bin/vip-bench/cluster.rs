//! Kubernetes on a real cluster (`vip_tests::cluster`: kube-apiserver, controller
//! manager, scheduler, two kubelet nodes with containerd and kube-proxy on a veth
//! bridge), vip installed with `kubectl apply -k deploy/` as its users install it:
//! the agent pod's memory at default settings, failover on real nodes (the
//! holder's link cut, the holder's agent SIGKILLed) and rolling upgrades, each
//! under the client load of `vipcluster::Load`. The steps are the cluster test's
//! (tests/tests/cluster_vip.rs), from `vip_tests::vipcluster`.
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::json;
use vip_tests::{
    cluster::{self, Cluster, ClusterSpec},
    vipcluster::{self as vc, FaultReport, LoadReport, PodMemory, Upgrade},
};

use crate::{
    measure::{ms, percentile},
    report::{at, line, Section, Table},
};

/// Trials of each fault (`VIP_BENCH_CLUSTER_TRIALS` overrides).
const TRIALS: usize = 5;
/// Repetitions of each upgrade (`VIP_BENCH_CLUSTER_UPGRADES` overrides).
const UPGRADES: usize = 2;

fn count(var: &str, default: usize) -> Result<usize> {
    match std::env::var(var) {
        Ok(v) => v.parse().with_context(|| format!("{var}={v}: not a count")),
        Err(_) => Ok(default),
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / 1048576.0
}

pub fn section() -> Result<Section> {
    let spec = ClusterSpec::default();
    let nodes = spec.nodes;
    let mut s = Section::new(line!("Kubernetes: a real cluster ({nodes} nodes, vip installed with `kubectl apply -k deploy/`)"));
    if !cluster::available(&spec) {
        let why = "needs root, KUBEBUILDER_ASSETS (kube-apiserver, etcd), VIP_KUBE_NODE_ASSETS (kubelet, kube-proxy, kube-controller-manager, kube-scheduler) and the images of `cargo xtask image`";
        eprintln!("vip-bench cluster: not run: {why}");
        s.para(line!("**Not run**: the section {why}.").with(at("cluster").data(json!({ "run": false, "reason": why }))));
        return Ok(s);
    }
    let (trials, upgrades) = (count("VIP_BENCH_CLUSTER_TRIALS", TRIALS)?, count("VIP_BENCH_CLUSTER_UPGRADES", UPGRADES)?);
    let t0 = Instant::now();
    let c = Cluster::start(spec).context("the cluster")?;
    let up = c.bring_up().total;
    let installed = vc::install(&c)?;
    let link = String::from_utf8_lossy(&c.node(0).exec(&["ip", "-d", "link", "show", "eth0"])?.stdout).into_owned();
    let xdp = if link.contains("xdpgeneric") { "generic" } else { "native" };
    let (limit, first) = vc::agent_memory(&c)?;
    eprintln!("vip-bench cluster: up in {up:?}, vip installed in {installed:?} (XDP {xdp})");

    // The failover and upgrade Service: as in the cluster test's failover step,
    // externalTrafficPolicy Local, a pod on each node; vip's ring then follows each
    // node's own pod, and the measurement is vip's, not kube-proxy's endpoint updates.
    vc::apply_pool(&c)?;
    vc::apply_web(&c, "web", nodes, "Local", None)?;
    let vip = vc::wait_vip(&c, "web", Duration::from_secs(30))?;
    vc::poll("both pods answering through the VIP", Duration::from_secs(20), || Ok(vc::spread(&c, vip, 10).ok().filter(|s| s.len() == nodes)))?;

    let mut cuts = Vec::new();
    let mut rejoins = Vec::new();
    let mut kills = Vec::new();
    for k in 0..trials {
        let r = vc::cut_link_trial(&c, "web", vip).with_context(|| format!("link cut, trial {k}"))?;
        eprintln!("vip-bench cluster: link cut {k}: {r:?}");
        rejoins.push(vc::restore_link(&c, &r.victim, vip).with_context(|| format!("rejoin after link cut {k}"))?);
        cuts.push(r);
        let r = vc::kill_agent_trial(&c, "web", vip).with_context(|| format!("agent SIGKILL, trial {k}"))?;
        eprintln!("vip-bench cluster: agent SIGKILL {k}: {r:?}");
        kills.push(r);
    }

    let mut ups: Vec<(&str, LoadReport)> = Vec::new();
    let mut restarted = None;
    for k in 0..upgrades {
        let image = if k == 0 { Upgrade::next_image() } else { Upgrade::Image(format!("{}-{}", cluster::AGENT_IMAGE, k + 1)) };
        for (what, u) in [("rollout restart", Upgrade::RolloutRestart), ("image change", image)] {
            let r = vc::upgrade_under_load(&c, vip, &u).with_context(|| format!("{what} {k}"))?;
            eprintln!("vip-bench cluster: {what} {k}: {r:?}");
            if restarted.is_none() {
                // The pods a rollout restart made: the node's maps were pinned already.
                restarted = Some(vc::agent_memory(&c)?.1);
            }
            ups.push((what, r));
        }
    }
    let took = t0.elapsed();

    s.para(line!(
        "One cluster ({nodes} nodes, kube-proxy in nftables mode; up in {} s, every agent Ready {} s after `kubectl apply -k deploy/`); the agents attach XDP in **{xdp}** mode (`--mode auto` on the nodes' veth links; no native XDP there). One LoadBalancer Service, externalTrafficPolicy Local, a pod on each node; the client load (`vipcluster::Load`): a new connection every 20 ms (2 s timeout) and 12 long-lived connections each echoing a line every 100 ms. The section took {} s.",
        at("cluster").f("up_s").num(up.as_secs_f64(), 1),
        at("cluster").f("install_s").num(installed.as_secs_f64(), 1),
        at("cluster").f("section_s").num(took.as_secs_f64(), 0)
    ));
    memory_table(&mut s, limit, &first, restarted.as_deref().unwrap_or_default());
    failover_table(&mut s, &cuts, &kills);
    let ready: Vec<f64> = rejoins.iter().map(|r| ms(r.ready)).collect();
    let ring: Vec<f64> = rejoins.iter().map(|r| ms(r.in_ring)).collect();
    if !rejoins.is_empty() {
        let a = at("cluster_rejoin");
        s.para(
            line!(
                "After each link cut (restored about 4 s after the cut, before the node went NotReady): link restored → every agent's ring for the Service whole again (both nodes back): median {} ms, max {} ms ({} trials).",
                a.f("in_ring_ms_median").num(percentile(&ring, 0.5), 0),
                a.f("in_ring_ms_max").num(percentile(&ring, 1.0), 0),
                a.f("n").show(rejoins.len())
            )
            .with(a.f("in_ring_ms").data(&ring))
            .with(a.f("ready_ms").data(&ready)),
        );
    }
    upgrade_table(&mut s, &ups);
    Ok(s)
}

fn memory_table(s: &mut Section, limit: u64, first: &[PodMemory], restarted: &[PodMemory]) {
    let mut t = Table::new(
        "| node | first start (the pod creates the maps): now / peak | after `kubectl rollout restart` (pins reused): now / peak | limit |",
        "|---|---:|---:|---:|",
    );
    for p in first {
        let a = at(format!("cluster_memory {}", p.node));
        // No rollout restart ran (VIP_BENCH_CLUSTER_UPGRADES=0): null, shown as a dash.
        let b = |v: Option<u64>| v.map_or(serde_json::Value::Null, |v| v.into());
        let shown = |v: Option<u64>| v.map_or("—".to_owned(), |v| format!("{:.1}", mib(v)));
        let after = restarted.iter().find(|r| r.node == p.node);
        let (now2, peak2) = (after.map(|r| r.now), after.map(|r| r.peak));
        t.row(line!(
            "| {} | {} / {} MiB | {} / {} MiB | {} MiB |",
            a.f("node").show(p.node.as_str()),
            a.f("first_now_bytes").fig(p.now, shown(Some(p.now))),
            a.f("first_peak_bytes").fig(p.peak, shown(Some(p.peak))),
            a.f("restarted_now_bytes").fig(b(now2), shown(now2)),
            a.f("restarted_peak_bytes").fig(b(peak2), shown(peak2)),
            a.f("limit_bytes").fig(limit, format!("{:.0}", mib(limit)))
        ));
    }
    s.para(line!(
        "The agent pod's memory cgroup (v1: `memory.usage_in_bytes` and `memory.max_usage_in_bytes` of the pod), default settings (deploy/ as it is):"
    ));
    s.table(t);
}

/// "median / max" of samples.
fn med_max(v: &[f64], decimals: usize) -> String {
    if v.is_empty() {
        return "—".to_owned();
    }
    format!("{:.decimals$} / {:.decimals$}", percentile(v, 0.5), percentile(v, 1.0))
}

fn failover_table(s: &mut Section, cuts: &[FaultReport], kills: &[FaultReport]) {
    s.para(line!(
        "Failover on real nodes: each trial on the node that holds the VIP, under the load; a link cut is the node's bridge port disabled (the link stays up: a partition), restored after each trial once the VIP had moved and the load had run 3 s more; an agent SIGKILL is `ctr tasks kill -s SIGKILL` of its container, the kubelet restarts it, and the load runs until the DaemonSet is whole again and 2 s more. \"Longest gap\" is the longest time between two successful new connections (how long new connections stopped); long-lived connections are counted by the node whose pod serves them."
    ));
    let mut t = Table::new(
        "| fault on the VIP's holder | longest gap without a new connection: median / max | new connections failed per trial: median / max (all trials) | long-lived broken, served by the other node | long-lived broken, served by the faulted node | trials |",
        "|---|---|---|---:|---:|---:|",
    );
    for (name, key, rs) in [("link cut", "cluster_failover_link_cut", cuts), ("agent SIGKILL", "cluster_failover_agent_kill", kills)] {
        if rs.is_empty() {
            continue;
        }
        let a = at(key);
        let gaps: Vec<f64> = rs.iter().map(|r| ms(r.load.longest_gap)).collect();
        let failed: Vec<f64> = rs.iter().map(|r| r.load.failed as f64).collect();
        let (attempts, failed_all): (u32, u32) = (rs.iter().map(|r| r.load.attempts).sum(), rs.iter().map(|r| r.load.failed).sum());
        let (other, victim) = rs.iter().fold(((0, 0), (0, 0)), |(o, v), r| {
            let (ro, rv) = (r.long_lived_on(false), r.long_lived_on(true));
            ((o.0 + ro.0, o.1 + ro.1), (v.0 + rv.0, v.1 + rv.1))
        });
        let (gap_d, failed_d) = (med_max(&gaps, 0), med_max(&failed, 0));
        t.row(
            line!(
                "| {name} | {gap_d} ms | {failed_d} ({} of {}) | {} of {} | {} of {} | {} |",
                a.f("failed").show(failed_all),
                a.f("attempts").show(attempts),
                a.f("broken_other").show(other.1),
                a.f("long_lived_other").show(other.0),
                a.f("broken_faulted").show(victim.1),
                a.f("long_lived_faulted").show(victim.0),
                a.f("trials").show(rs.len())
            )
            .with(a.f("longest_gap_ms").data(&gaps))
            .with(a.f("failed_per_trial").data(&failed))
            .with(a.f("fault_at_ms").data(rs.iter().map(|r| ms(r.fault_at)).collect::<Vec<_>>()))
            // Where the longest gap ended, on the load's clock (as fault_at_ms): at the
            // fault, or later (a killed agent's return takes the VIP back).
            .with(a.f("gap_end_ms").data(rs.iter().map(|r| ms(r.load.gap_end)).collect::<Vec<_>>()))
            .with(a.f("attempts_per_trial").data(rs.iter().map(|r| r.load.attempts).collect::<Vec<_>>()))
            .with(a.f("victims").data(rs.iter().map(|r| r.victim.clone()).collect::<Vec<_>>())),
        );
    }
    s.table(t);
}

fn upgrade_table(s: &mut Section, ups: &[(&str, LoadReport)]) {
    s.para(line!(
        "Upgrades under the load: the DaemonSet (maxUnavailable 1) rolled with `kubectl rollout restart`, or to a new image name (`kubectl set image`; the same image tagged anew on each node); the load runs until the rollout is complete and 3 s more. In turn, each repeated:"
    ));
    let mut t = Table::new("| upgrade | new connections failed | long-lived broken | longest gap without a new connection |", "|---|---:|---:|---:|");
    let mut seen: std::collections::BTreeMap<&str, usize> = Default::default();
    for (what, r) in ups {
        let k = seen.entry(what).or_insert(0);
        *k += 1;
        let a = at(format!("cluster_upgrade {what} {k}"));
        t.row(line!(
            "| {what} ({k}) | {} of {} | {} of {} | {} ms |",
            a.f("failed").show(r.failed),
            a.f("attempts").show(r.attempts),
            a.f("broken").show(r.broken_total()),
            a.f("long_lived").show(r.long_lived.values().sum::<u32>()),
            a.f("longest_gap_ms").num(ms(r.longest_gap), 0)
        ));
    }
    s.table(t);
}
