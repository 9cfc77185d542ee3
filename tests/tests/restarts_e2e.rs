//! Restarts as a cluster does them, under load: three nodes run `vip-agent run
//! --kubernetes` against the stand-in API server (a VipPool, three LoadBalancer
//! Services, one VIP each), with the DaemonSet's arguments and HTTP port, and a
//! stand-in kubelet (`vip_tests::kubelet`) restarts them: crashes in
//! CrashLoopBackOff, rolling updates in the DaemonSet's order and
//! `maxUnavailable`, each new pod waited for until its readiness probe passes.
//! Meanwhile the client opens a connection every 20 ms through the VIPs in turn
//! and keeps long-lived ones to every node busy; nothing may fail or break.
//!
//! Each test prints its counts (`restarts: …`), the figures BENCHMARKS.md quotes.
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

use serde_json::json;
use vip_agent::k8s::source::KUBE_PROXY_HEALTHZ_PORT;
use vip_tests::{
    agent::{agent_bin, previous_release_bin},
    halab::{arp_probe, vip, HaLab, HaSpec, LongConn},
    kubelab::KubeLab,
    kubelet::Kubelet,
    load::{Load, LoadReport},
    netns::privileged,
};

/// One lab at a time (each loads the machine's two cores).
static SERIAL: Mutex<()> = Mutex::new(());

const VIPS: usize = 3;
/// A new connection every this long, to the VIPs in turn.
const EVERY: Duration = Duration::from_millis(20);
/// A new connection that has not named its backend by then failed (one lost SYN
/// costs 1 s: it is counted slow, not failed).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

fn lab_exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_vip-lab"))
}

fn all(lab: &HaLab) -> Vec<usize> {
    (0..lab.nodes.len()).collect()
}

type Setup = (std::sync::MutexGuard<'static, ()>, KubeLab, Kubelet);

/// The lab with its pool and Services, every VIP held and every ring whole; its
/// agents run the binary `image` (None: this build's). The pool's HTTP check asks
/// each node's name server.
fn setup(image: Option<PathBuf>) -> Option<Setup> {
    let check = json!({ "type": "http", "path": "/healthz", "interval": "200ms", "timeout": "100ms" });
    setup_with(HaSpec { agent_bin: image, ..HaSpec::default() }, check)
}

/// [`setup`] from `spec` (its VIPs and HTTP port set here) with the pool's
/// `healthCheck` `check`.
fn setup_with(spec: HaSpec, check: serde_json::Value) -> Option<Setup> {
    if !privileged() {
        return None;
    }
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let kl = KubeLab::start(HaSpec { vips: VIPS, metrics_on_segment: true, ..spec }, lab_exe()).unwrap();
    let (lab, api) = (&kl.lab, &kl.api);
    api.insert(
        "vippools.vip.dev",
        json!({
            "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "lab" },
            "spec": { "addresses": [format!("{}-{}", vip(0), vip(VIPS - 1))], "nodeSelector": { "lab": "yes" }, "tableSize": 251,
                      "healthCheck": check }
        }),
    )
    .unwrap();
    for k in 0..VIPS {
        api.insert("services", service(k)).unwrap();
    }
    lab.wait_converged_on(&all(lab), VIPS, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    lab.wait_rings_full(&all(lab), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let kubelet = Kubelet::new(lab).unwrap();
    Some((g, kl, kubelet))
}

/// Service `web{k}`: a LoadBalancer Service of externalTrafficPolicy Cluster.
fn service(k: usize) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Service", "metadata": { "name": format!("web{k}"), "namespace": "shop" },
        "spec": { "type": "LoadBalancer", "externalTrafficPolicy": "Cluster", "ports": [{ "port": 80, "protocol": "TCP" }] }
    })
}

/// `per_vip` long-lived connections through every VIP, from source ports below
/// the client's ephemeral range (from 20000).
fn long_conns(lab: &HaLab, per_vip: u16) -> Vec<LongConn> {
    (0..VIPS as u16)
        .flat_map(|k| (0..per_vip).map(move |p| (k, 20000 + k * 100 + p)))
        .map(|(k, sport)| LongConn::open(&lab.client, vip(k as usize), sport, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs())))
        .collect()
}

fn vips() -> Vec<IpAddr> {
    (0..VIPS).map(|k| vip(k).into()).collect()
}

/// Node `i`'s services whose ring has `node` in it, as its status says.
fn rings_with(lab: &HaLab, i: usize, node: &str) -> Option<usize> {
    Some(lab.status(i)?.services.iter().filter(|x| x.backends.iter().any(|n| n == node)).count())
}

fn assert_clean(report: &LoadReport, lab: &HaLab) {
    assert!(report.attempted > 0 && report.long > 0, "{report}");
    assert_eq!((report.failed, report.broken.len()), (0, 0), "{report}\n{}", lab.agent_logs());
}

/// An agent that crashes again every time it is up (a crash loop: the OOM killer,
/// a panic at start) is restarted after 0.7 s, then 10 s, then 20 s: all that time
/// its node's data path and pods serve on, so it stays a backend in every ring
/// (its health target answers) while its VIPs move; no connection it serves
/// breaks and no new connection fails.
#[test]
fn a_crash_looping_agent_breaks_nothing_its_node_serves() {
    let Some((_g, mut kl, mut kubelet)) = setup(None) else { return };
    let lab = &mut kl.lab;
    let d = 2;
    let name = lab.nodes[d].name.clone();
    let conns = long_conns(lab, 8);
    let served = conns.iter().filter(|c| c.backend == name).count();
    assert!(served >= 3, "too few long-lived connections on {name}: {served}");
    let rest = [0, 1];
    let full: Vec<Option<usize>> = rest.iter().map(|&i| rings_with(lab, i, &name)).collect();
    assert!(full.iter().all(|n| *n == Some(VIPS)), "{full:?}");

    let load = Load::start(&lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
    let t0 = Instant::now();
    let mut waits = Vec::new();
    for _ in 0..3 {
        let due = kubelet.crash(lab, d);
        // While it is down: its VIPs move to the others, it stays in their rings.
        let mut samples = 0;
        while Instant::now() + Duration::from_millis(300) < due || samples == 0 {
            std::thread::sleep(Duration::from_millis(100));
            let during: Vec<Option<usize>> = rest.iter().map(|&i| rings_with(lab, i, &name)).collect();
            assert_eq!(during, full, "{name} left rings while its agent was down\n{}", lab.agent_logs());
            samples += 1;
        }
        let r = kubelet.restart_at(lab, d, due).unwrap();
        waits.push(r.delay);
        lab.wait_converged_on(&all(lab), VIPS, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    }
    let (report, _) = load.finish().unwrap();
    let shown: Vec<String> = waits.iter().map(|w| format!("{:.1} s", w.as_secs_f64())).collect();
    eprintln!(
        "restarts: crash loop of {name}'s agent ({} restarts after {}; {:.0} s): {report}; {served} of the long-lived connections on {name}",
        kubelet.restarts(d),
        shown.join(", "),
        t0.elapsed().as_secs_f64()
    );
    assert!(waits[1] >= Duration::from_secs(10) && waits[2] >= Duration::from_secs(20), "the kubelet's back-off: {waits:?}");
    assert_clean(&report, lab);
}

/// Ten rolling updates in a row (the DaemonSet's `maxUnavailable`, each new pod
/// Ready before the next node's is deleted), with fault trials after the fifth: the
/// owner of a VIP SIGKILLed (the kubelet restarts it) and another SIGSTOPped for
/// longer than `deadAfter`. Nothing fails or breaks, and every VIP is held by one
/// node after each rollout.
#[test]
fn ten_rollouts_with_fault_trials_between_break_nothing() {
    let Some((_g, mut kl, mut kubelet)) = setup(None) else { return };
    let lab = &mut kl.lab;
    let conns = long_conns(lab, 6);
    let mut load = Load::start(&lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
    let t0 = Instant::now();
    let mut reports = Vec::new();
    let mut slowest_ready = Duration::ZERO;
    for r in 1..=10 {
        for (stop, ready) in kubelet.rollout(lab).unwrap_or_else(|e| panic!("rollout {r}: {e:#}")) {
            assert!(stop < kubelet.pod.grace, "rollout {r}: an agent needed SIGKILL after {stop:?}");
            slowest_ready = slowest_ready.max(ready);
        }
        let owners = lab.wait_converged_on(&all(lab), VIPS, Duration::from_secs(10)).unwrap_or_else(|e| panic!("rollout {r}: {e:#}\n{}", lab.agent_logs()));
        if r == 5 {
            // Fault trials: the rollouts after them start from what faults leave.
            let (report, conns) = load.finish().unwrap();
            reports.push(("rollouts 1-5", report));
            let fault_load = Load::start(&lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
            let killed = lab.index_of(&owners[&vip(0)]);
            let due = kubelet.crash(lab, killed);
            kubelet.restart_at(lab, killed, due).unwrap();
            let owners =
                lab.wait_converged_on(&all(lab), VIPS, Duration::from_secs(10)).unwrap_or_else(|e| panic!("after SIGKILL: {e:#}\n{}", lab.agent_logs()));
            let stopped = lab.index_of(&owners[&vip(1)]);
            lab.signal_agent(stopped, libc::SIGSTOP);
            std::thread::sleep(Duration::from_secs(1));
            lab.signal_agent(stopped, libc::SIGCONT);
            lab.wait_converged_on(&all(lab), VIPS, Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("after SIGSTOP and SIGCONT of {}: {e:#}\n{}", lab.nodes[stopped].name, lab.agent_logs()));
            let (report, conns) = fault_load.finish().unwrap();
            reports.push(("fault trials", report));
            load = Load::start(&lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
        }
    }
    let (report, _) = load.finish().unwrap();
    reports.push(("rollouts 6-10", report));
    for (what, report) in &reports {
        eprintln!("restarts: {what}: {report}");
    }
    eprintln!(
        "restarts: 10 rollouts of 3 agents (maxUnavailable {}) in {:.0} s; slowest new pod Ready {:.1} s after its start",
        kubelet.pod.max_unavailable,
        t0.elapsed().as_secs_f64(),
        slowest_ready.as_secs_f64()
    );
    for (_, report) in &reports {
        assert_clean(report, lab);
    }
}

/// The release node `i`'s agent says it is (`vip_build_info{version}`).
fn build_version(lab: &HaLab, i: usize) -> Option<String> {
    let m = lab.metrics(i);
    let line = m.lines().find(|l| l.starts_with("vip_build_info{"))?;
    Some(line.split("version=\"").nth(1)?.split('"').next()?.to_owned())
}

/// While the releases are mixed (after each node's new pod is Ready): every node
/// runs the release it was given, every VIP has one holder, which alone answers
/// ARP for it, and each agent of this release shows which release each node
/// runs (the previous one says none in its heartbeats).
fn check_mixed(lab: &HaLab, previous: &str) -> anyhow::Result<()> {
    let current = vip_agent::model::VERSION;
    let runs_current: Vec<bool> = lab.nodes.iter().map(|n| n.agent_bin.is_none()).collect();
    for (i, new) in runs_current.iter().enumerate() {
        let v = build_version(lab, i);
        anyhow::ensure!(v.as_deref() == Some(if *new { current } else { previous }), "{} runs {v:?}", lab.nodes[i].name);
    }
    let owners = lab.wait_converged_on(&all(lab), VIPS, Duration::from_secs(10))?;
    let vips: Vec<_> = (0..VIPS).map(vip).collect();
    for (v, claims) in arp_probe(&lab.client, &vips, 3, Duration::from_millis(100))? {
        let holder = lab.nodes[lab.index_of(&owners[&v])].mac;
        anyhow::ensure!(claims.answered == [holder].into(), "{v}: answered by {:?}, held by {}", claims.answered, owners[&v]);
    }
    let shown = |i: usize| -> Option<Vec<Option<String>>> {
        let s = lab.status(i)?;
        lab.nodes.iter().map(|n| Some(s.nodes.iter().find(|x| x.node == n.name)?.version.clone())).collect()
    };
    let expected: Vec<Option<String>> = runs_current.iter().map(|new| new.then(|| current.to_owned())).collect();
    for i in (0..lab.nodes.len()).filter(|&i| runs_current[i]) {
        // Versions ride one heartbeat in 20.
        let seen = vip_tests::halab::time_until(Duration::from_secs(5), || shown(i) == Some(expected.clone()));
        anyhow::ensure!(seen.is_some(), "{} shows versions {:?}, not {expected:?}", lab.nodes[i].name, shown(i));
    }
    Ok(())
}

/// An upgrade from the previous release and the rollback, as a DaemonSet's image
/// change does them: the lab starts on the previous release's agent (built from
/// the commit releases.toml names), rolls out this build's node by node under
/// load, then rolls back to the previous release. VIPs move between agents of
/// both releases on the way (each stopping agent hands its VIPs over); after
/// every node's step the mixed cluster is checked ([`check_mixed`]). No new
/// connection fails and no long-lived one breaks: each flow keeps its backend
/// whichever release balances it.
#[test]
fn an_upgrade_from_the_previous_release_and_its_rollback_break_nothing() {
    let (previous, version) = previous_release_bin().unwrap_or_else(|e| panic!("{e:#}"));
    assert_ne!(version, vip_agent::model::VERSION, "the previous release has this build's version");
    let Some((_g, mut kl, mut kubelet)) = setup(Some(previous.clone())) else { return };
    let lab = &mut kl.lab;
    check_mixed(lab, &version).unwrap_or_else(|e| panic!("on the previous release: {e:#}\n{}", lab.agent_logs()));
    let mut conns = long_conns(lab, 6);
    let mut reports = Vec::new();
    for (what, bin) in [(format!("upgrade {version} → {}", vip_agent::model::VERSION), None), (format!("rollback to {version}"), Some(previous.as_path()))] {
        let load = Load::start(&lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
        let t = Instant::now();
        kubelet
            .rollout_to(lab, bin, |lab, batch| check_mixed(lab, &version).map_err(|e| e.context(format!("after {what} of node {batch:?}"))))
            .unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
        let (report, alive) = load.finish().unwrap();
        eprintln!("restarts: {what}, node by node ({:.0} s): {report}", t.elapsed().as_secs_f64());
        reports.push(report);
        conns = alive;
    }
    for report in &reports {
        assert_clean(report, lab);
    }
}

/// The holder of `v` its VipStatus names.
fn status_holder(kl: &KubeLab, v: std::net::Ipv4Addr) -> Option<String> {
    let s = kl.api.list("vipstatuses.vip.dev", None).into_iter().find(|o| o["spec"]["address"] == v.to_string())?;
    s["status"]["holder"].as_str().map(str::to_owned)
}

/// The API server gone for 60 s under load (its listener closed, every watch
/// ended, its store kept: a control-plane restart, or the nodes cut off from it),
/// and in it the holder of a VIP crashes, which the kubelet starts again at once
/// with no API to read its model from. Heartbeats, failover and the data path
/// need no API: the VIP moves, the crashed agent's node stays in every ring (its
/// pods serve on), no new connection fails and no long-lived one breaks. Once the
/// API is back, the restarted agent turns Ready, the VIPs settle and every
/// VipStatus names its VIP's holder.
#[test]
fn an_api_server_outage_of_60_s_with_a_crash_in_it_breaks_nothing() {
    const OUTAGE: Duration = Duration::from_secs(60);
    let Some((_g, mut kl, mut kubelet)) = setup(None) else { return };
    let owners = kl.lab.wait_converged_on(&all(&kl.lab), VIPS, Duration::from_secs(10)).unwrap();
    for k in 0..VIPS {
        let v = vip(k);
        let named = vip_tests::halab::time_until(Duration::from_secs(20), || status_holder(&kl, v).as_ref() == Some(&owners[&v]));
        assert!(named.is_some(), "VipStatus of {v}: holder {:?}, not {}", status_holder(&kl, v), owners[&v]);
    }
    let conns = long_conns(&kl.lab, 6);
    let load = Load::start(&kl.lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
    let t0 = Instant::now();
    kl.stop_api();
    std::thread::sleep(Duration::from_secs(5));
    let k = kl.lab.index_of(&owners[&vip(0)]);
    let name = kl.lab.nodes[k].name.clone();
    let due = kubelet.crash(&mut kl.lab, k);
    let started = kubelet.start_at(&mut kl.lab, k, due).unwrap();
    let rest: Vec<usize> = all(&kl.lab).into_iter().filter(|&i| i != k).collect();
    let moved = kl.lab.wait_converged_on(&rest, VIPS, Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e:#}\n{}", kl.lab.agent_logs()));
    assert_ne!(moved[&vip(0)], name, "{name}'s VIP did not move during the outage");
    while t0.elapsed() < OUTAGE {
        let rings: Vec<Option<usize>> = rest.iter().map(|&i| rings_with(&kl.lab, i, &name)).collect();
        assert!(rings.iter().all(|n| *n == Some(VIPS)), "{name} left rings during the outage: {rings:?}\n{}", kl.lab.agent_logs());
        std::thread::sleep(Duration::from_secs(1));
    }
    kl.start_api().unwrap();
    let back = Instant::now();
    let ready = kubelet.wait_ready(&kl.lab, k, started, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e:#}"));
    let ready_after = back.elapsed();
    let owners = kl.lab.wait_converged_on(&all(&kl.lab), VIPS, Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e:#}\n{}", kl.lab.agent_logs()));
    let caught_up = vip_tests::halab::time_until(Duration::from_secs(30), || (0..VIPS).all(|j| status_holder(&kl, vip(j)).as_ref() == Some(&owners[&vip(j)])));
    let shown: Vec<_> = (0..VIPS).map(|j| (vip(j), status_holder(&kl, vip(j)))).collect();
    caught_up.unwrap_or_else(|| panic!("VipStatus holders {shown:?} 30 s after the API came back; the agents say {owners:?}"));
    let status_after = back.elapsed();
    let (report, _) = load.finish().unwrap();
    eprintln!(
        "restarts: API server down {} s, {name}'s agent crashed 5 s in and restarted without it: {report}; it turned Ready {:.1} s after the API came back ({:.1} s after its start), every VipStatus named its holder {:.1} s after it came back",
        OUTAGE.as_secs(),
        ready_after.as_secs_f64(),
        ready.as_secs_f64(),
        status_after.as_secs_f64()
    );
    assert_clean(&report, &kl.lab);
}

/// The converged lab before a fault on node-3 (`d`): every node, the VIPs'
/// holders, 8 long-lived connections through each VIP and how many of them
/// node-3's pods serve.
struct Loaded {
    every: Vec<usize>,
    owners: std::collections::BTreeMap<std::net::Ipv4Addr, String>,
    d: usize,
    name: String,
    conns: Vec<LongConn>,
    served: usize,
}

fn loaded(lab: &HaLab) -> Loaded {
    let every = all(lab);
    let owners = lab.wait_converged_on(&every, VIPS, Duration::from_secs(10)).unwrap();
    let d = 2;
    let name = lab.nodes[d].name.clone();
    let conns = long_conns(lab, 8);
    let served = conns.iter().filter(|c| c.backend == name).count();
    Loaded { every, owners, d, name, conns, served }
}

/// kube-proxy restarted on a node: its health server (`:10256/healthz`, what a
/// pool's bare HTTP check asks for Cluster-policy Services) gone for 3 s while its
/// rules serve on, as they do across a kube-proxy restart. The node leaves every
/// ring for new flows, the connections it serves drain on, it is back once
/// kube-proxy answers, and no VIP moves: no new connection fails, none breaks.
#[test]
fn a_kube_proxy_restart_breaks_nothing_its_node_serves() {
    const DOWN: Duration = Duration::from_secs(3);
    let spec = HaSpec { health_port: Some(KUBE_PROXY_HEALTHZ_PORT), ..HaSpec::default() };
    let Some((_g, mut kl, _kubelet)) = setup_with(spec, json!({ "type": "http", "interval": "200ms", "timeout": "100ms" })) else { return };
    let lab = &mut kl.lab;
    let Loaded { every, owners, d, name, conns, served } = loaded(lab);
    assert!(served >= 3, "too few long-lived connections on {name}: {served}");
    let in_rings = |lab: &HaLab, n: usize| every.iter().all(|&i| rings_with(lab, i, &name) == Some(n));
    assert!(in_rings(lab, VIPS));

    let load = Load::start(&lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
    let t = Instant::now();
    lab.stop_health(d);
    let out = vip_tests::halab::time_until(DOWN, || in_rings(lab, 0));
    let out = out.unwrap_or_else(|| panic!("{name} still in a ring {DOWN:?} after kube-proxy's health server stopped\n{}", lab.agent_logs()));
    std::thread::sleep(DOWN.saturating_sub(t.elapsed()));
    lab.start_health(d).unwrap();
    let back = vip_tests::halab::time_until(Duration::from_secs(5), || in_rings(lab, VIPS));
    let back = back.unwrap_or_else(|| panic!("{name} not back in every ring 5 s after kube-proxy answered\n{}", lab.agent_logs()));
    let (report, _) = load.finish().unwrap();
    eprintln!(
        "restarts: kube-proxy's health server on {name} down {} s: {report}; {name} out of every ring {} ms after it stopped, back {} ms after it answered; {served} of the long-lived connections on {name}",
        DOWN.as_secs(),
        out.as_millis(),
        back.as_millis()
    );
    assert_eq!(lab.wait_converged_on(&every, VIPS, Duration::from_secs(5)).unwrap(), owners, "VIPs moved");
    assert_clean(&report, lab);
}

/// A node rebooted under load: its link down, then its agent, its pods (the name
/// server) and its data path gone (bpffs emptied), back 2 s later, when the
/// kubelet starts the DaemonSet's pod on an empty pin directory. Its VIPs move
/// and come back; what breaks is only what must: the connections its own pods
/// carried, and of those it balanced to other nodes through its VIPs, the ones
/// whose pins went with it (counted). No new connection fails and no connection
/// through the other VIPs to other nodes breaks.
#[test]
fn a_rebooted_node_breaks_only_what_went_with_it() {
    let Some((_g, mut kl, kubelet)) = setup(None) else { return };
    let lab = &mut kl.lab;
    let Loaded { every, owners, d, name, conns, served } = loaded(lab);
    // The VIP of each connection, from its source port (long_conns' numbering).
    let vip_of = |sport: u16| vip(usize::from((sport - 20000) / 100));
    let through: Vec<u16> = conns.iter().filter(|c| c.backend != name && owners[&vip_of(c.sport)] == name).map(|c| c.sport).collect();
    assert!(served > 0 && !through.is_empty(), "{served} on {name}, {} through its VIPs", through.len());
    let others = conns.len() - served - through.len();

    let load = Load::start(&lab.client, vips(), EVERY, CONNECT_TIMEOUT, conns).unwrap();
    lab.power_off(d).unwrap();
    let rest: Vec<usize> = every.iter().copied().filter(|&i| i != d).collect();
    let moved = lab.wait_converged_on(&rest, VIPS, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert!(moved.values().all(|o| *o != name), "{moved:?}");
    std::thread::sleep(Duration::from_secs(2));
    let booted = Instant::now();
    lab.power_on(d).unwrap();
    let ready = kubelet.wait_ready(lab, d, booted, Duration::from_secs(30)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let back = lab.wait_converged_on(&every, VIPS, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    assert_eq!(back, owners, "the VIPs did not return to their owners");
    lab.wait_rings_full(&every, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let (report, _) = load.finish().unwrap();
    let on = |b: &String| b.split_once(':').map(|(node, sport)| (node.to_owned(), sport.parse::<u16>().unwrap()));
    let broken: Vec<(String, u16)> = report.broken.iter().filter_map(on).collect();
    let ended = broken.iter().filter(|(n, _)| *n == name).count();
    let lost = broken.iter().filter(|(n, s)| *n != name && through.contains(s)).count();
    let wrong: Vec<_> = broken.iter().filter(|(n, s)| *n != name && !through.contains(s)).collect();
    eprintln!(
        "restarts: {name} rebooted (off 2 s, its new pod Ready {:.1} s after its start): {} of {} new connections failed (slowest {} ms); long-lived: {ended} of {served} its pods carried ended, {} of {} through its VIPs to other nodes kept, {} of {others} others kept",
        ready.as_secs_f64(),
        report.failed,
        report.attempted,
        report.slowest.as_millis(),
        through.len() - lost,
        through.len(),
        others - wrong.len()
    );
    assert!(wrong.is_empty(), "connections through the other VIPs to other nodes broke: {wrong:?}\n{}", lab.agent_logs());
    assert_eq!(report.failed, 0, "{report}\n{}", lab.agent_logs());
}
