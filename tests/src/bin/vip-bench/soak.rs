//! The soak (`VIP_BENCH_ONLY=soak`, not part of a full run: it takes
//! `VIP_SOAK_MINUTES`, default 60). Three agents in Kubernetes mode against the
//! stand-in API server, at default timers and table size, restarted by the
//! stand-in kubelet, under load, through a round of churn every
//! [`STEP`] × 5: a Service created and the previous one deleted, a Local
//! Service's endpoints moved, node-3's agent SIGKILLed (the kubelet restarts it),
//! node-2's cable pulled for 2 s, node-3's pod deleted (a new one started).
//! node-1's agent is never restarted: its memory, file descriptors and map entries
//! over the hour are the leak check. After every step the cluster must settle
//! (one holder per allocated address, agreed by all) and ARP must be answered by
//! that holder alone and for no unallocated address of the pool: anything else is
//! a wrong answerer.
use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use serde_json::json;
use vip_tests::{
    halab::{arp_probe, vip, HaLab, HaSpec, LongConn},
    kubelab::{endpoint_slice, lb_service, KubeLab},
    kubelet::Kubelet,
    load::{Load, LoadReport},
};

use crate::{
    measure::{cpu_ticks, rss_mib},
    report::{at, line, Section, Table},
};

/// Addresses in the pool: the Services use 5 at a time, so freed ones are reused.
const POOL: usize = 8;
/// A churn step at least this long (the load runs through it).
const STEP: Duration = Duration::from_secs(12);
const EVERY: Duration = Duration::from_millis(20);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Long-lived connections kept open (topped up after each step).
const LONG: usize = 12;
const STABLE: [&str; 3] = ["web0", "web1", "web2"];
/// The Local Service's endpoints, step after step.
const ENDPOINTS: [&[&str]; 4] = [&["node-1"], &["node-1", "node-2"], &["node-1", "node-2", "node-3"], &["node-2", "node-3"]];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Service,
    Endpoints,
    Crash,
    Flap,
    PodDeleted,
}

impl Step {
    const ROUND: [Step; 5] = [Step::Service, Step::Endpoints, Step::Crash, Step::Flap, Step::PodDeleted];

    fn what(self) -> &'static str {
        match self {
            Step::Service => "a Service created, the previous one deleted",
            Step::Endpoints => "the Local Service's endpoints moved",
            Step::Crash => "node-3's agent SIGKILLed, restarted by the kubelet",
            Step::Flap => "node-2's cable pulled for 2 s",
            Step::PodDeleted => "node-3's pod deleted, a new one started",
        }
    }
}

/// One reading of every agent after a step.
#[derive(Clone, Debug, serde::Serialize)]
struct Sample {
    minute: f64,
    rss_mib: Vec<f64>,
    fds: Vec<usize>,
    /// Entries in the hash maps, per node (the flow tables are arrays of a fixed size).
    entries: Vec<u64>,
    cpu_ticks: Vec<u64>,
}

/// Entries in the hash-like map pinned at `path` (None: an array, whose entries
/// are its size), walked with BPF_MAP_GET_NEXT_KEY.
fn map_entries(path: &Path) -> Result<Option<u64>> {
    use aya::maps::MapType;
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let info = aya::maps::MapInfo::from_pin(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let hashed = matches!(
        info.map_type().map_err(|e| anyhow::anyhow!("{e}"))?,
        MapType::Hash | MapType::LruHash | MapType::PerCpuHash | MapType::LruPerCpuHash | MapType::LpmTrie
    );
    if !hashed {
        return Ok(None);
    }
    let fd = info.fd().map_err(|e| anyhow::anyhow!("{e}"))?;
    let size = info.key_size() as usize;
    let (mut key, mut next) = (vec![0u8; size], vec![0u8; size]);
    #[repr(C)]
    struct Attr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
    }
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    let mut n = 0u64;
    // Bounded: a map that changes while walked may restart the walk.
    while n <= 2 * u64::from(info.max_entries()) {
        let attr =
            Attr { map_fd: fd.as_fd().as_raw_fd() as u32, _pad: 0, key: if n == 0 { 0 } else { key.as_ptr() as u64 }, next_key: next.as_mut_ptr() as u64 };
        // SAFETY: BPF_MAP_GET_NEXT_KEY reads key_size bytes at `key` and writes as many at `next_key`.
        let r = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_GET_NEXT_KEY, &attr as *const Attr, std::mem::size_of::<Attr>()) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOENT) {
                break;
            }
            return Err(e).with_context(|| format!("walking {}", path.display()));
        }
        n += 1;
        std::mem::swap(&mut key, &mut next);
    }
    Ok(Some(n))
}

fn sample(lab: &HaLab, t0: Instant) -> Result<Sample> {
    let mut s = Sample { minute: t0.elapsed().as_secs_f64() / 60.0, rss_mib: Vec::new(), fds: Vec::new(), entries: Vec::new(), cpu_ticks: Vec::new() };
    for n in &lab.nodes {
        let pid = n.agent.as_ref().context("an agent")?.child.id();
        s.rss_mib.push(rss_mib(pid).unwrap_or(0.0));
        s.fds.push(std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0));
        s.cpu_ticks.push(cpu_ticks(pid).unwrap_or(0));
        let mut entries = 0;
        for name in vip_common::map_names::ALL {
            entries += map_entries(&n.pins.path.join(name))?.unwrap_or(0);
        }
        s.entries.push(entries);
    }
    Ok(s)
}

/// The address the stand-in allocated to Service `shop/name`.
fn address_of(kl: &KubeLab, name: &str) -> Option<Ipv4Addr> {
    kl.api.get("services", Some("shop"), name)?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str()?.parse().ok()
}

/// Waits for the cluster to settle on `count` allocated addresses, then asks ARP
/// for every address of the pool: the wrong answers seen.
fn check_answerers(lab: &HaLab, count: usize) -> Result<Vec<String>> {
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged_on(&all, count, Duration::from_secs(30))?;
    let pool: Vec<Ipv4Addr> = (0..POOL).map(vip).collect();
    let mut wrong = Vec::new();
    for (v, claims) in arp_probe(&lab.client, &pool, 3, Duration::from_millis(100))? {
        let want: std::collections::BTreeSet<[u8; 6]> = owners.get(&v).map(|o| lab.nodes[lab.index_of(o)].mac).into_iter().collect();
        if claims.answered != want || !claims.announced.is_subset(&want) {
            wrong.push(format!("{v}: answered by {:?}, announced by {:?}, held by {:?}", claims.answered, claims.announced, owners.get(&v)));
        }
    }
    Ok(wrong)
}

/// Opens long-lived connections through `vips` until there are [`LONG`].
fn top_up(lab: &HaLab, conns: &mut Vec<LongConn>, vips: &[IpAddr], next_port: &mut u16) {
    let mut tries = 0;
    while conns.len() < LONG && tries < 3 * LONG {
        tries += 1;
        // Source ports 20000-29999, below the client's ephemeral range.
        *next_port = 20000 + (*next_port - 20000 + 1) % 10000;
        let v = vips[usize::from(*next_port) % vips.len()];
        if let Ok(c) = LongConn::open(&lab.client, v, *next_port, Duration::from_secs(2)) {
            conns.push(c);
        }
    }
}

#[derive(Default)]
struct Tally {
    steps: usize,
    attempted: usize,
    failed: usize,
    slowest: Duration,
    long: usize,
    broken: usize,
    /// Long-lived connections served by node-2 when the step began (its cable pulls).
    on_node2: usize,
}

impl Tally {
    fn add(&mut self, r: &LoadReport) {
        self.steps += 1;
        self.attempted += r.attempted;
        self.failed += r.failed;
        self.slowest = self.slowest.max(r.slowest);
        self.long += r.long;
        self.broken += r.broken.len();
    }
}

pub fn section() -> Result<Section> {
    let minutes: f64 = std::env::var("VIP_SOAK_MINUTES").ok().map(|m| m.parse()).transpose().context("VIP_SOAK_MINUTES")?.unwrap_or(60.0);
    let exe = std::env::current_exe()?;
    let mut kl = KubeLab::start(HaSpec { vips: POOL, metrics_on_segment: true, ..HaSpec::default() }, &exe)?;
    kl.api.insert(
        "vippools.vip.dev",
        json!({
            "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "soak" },
            "spec": { "addresses": [format!("{}-{}", vip(0), vip(POOL - 1))], "nodeSelector": { "lab": "yes" },
                      "healthCheck": { "type": "http", "path": "/healthz", "interval": "200ms", "timeout": "100ms" } }
        }),
    )?;
    for name in STABLE {
        kl.api.insert("services", lb_service("shop", name, false))?;
    }
    kl.api.insert("services", lb_service("shop", "local", true))?;
    kl.api.insert("endpointslices.discovery.k8s.io", endpoint_slice("shop", "local", ENDPOINTS[0]))?;
    let mut count = STABLE.len() + 1;
    check_answerers(&kl.lab, count).with_context(|| kl.lab.agent_logs())?;
    let mut kubelet = Kubelet::new(&kl.lab)?;
    let vips: Vec<IpAddr> = STABLE.iter().map(|n| address_of(&kl, n).map(IpAddr::V4).context("a stable Service's address")).collect::<Result<_>>()?;
    let mut next_port = 20000;
    let mut conns = Vec::new();
    top_up(&kl.lab, &mut conns, &vips, &mut next_port);

    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(minutes * 60.0);
    let mut tallies: BTreeMap<Step, Tally> = BTreeMap::new();
    let mut samples = vec![sample(&kl.lab, t0)?];
    let mut wrong: Vec<String> = Vec::new();
    let mut made = 0usize;
    let mut step_no = 0usize;
    while Instant::now() < end {
        let step = Step::ROUND[step_no % Step::ROUND.len()];
        let started = Instant::now();
        let on_node2 = conns.iter().filter(|c| c.backend == kl.lab.nodes[1].name).count();
        let load = Load::start(&kl.lab.client, vips.clone(), EVERY, CONNECT_TIMEOUT, std::mem::take(&mut conns))?;
        let lab = &mut kl.lab;
        match step {
            Step::Service => {
                made += 1;
                kl.api.insert("services", lb_service("shop", &format!("churn{made}"), false))?;
                if made > 1 {
                    kl.api.delete("services", Some("shop"), &format!("churn{}", made - 1))?;
                }
                count = STABLE.len() + 2;
            }
            Step::Endpoints => {
                let nodes = ENDPOINTS[(step_no / Step::ROUND.len() + 1) % ENDPOINTS.len()];
                kl.api.insert("endpointslices.discovery.k8s.io", endpoint_slice("shop", "local", nodes))?;
            }
            Step::Crash => {
                let due = kubelet.crash(lab, 2);
                kubelet.restart_at(lab, 2, due)?;
            }
            Step::Flap => {
                lab.seg.cable(&lab.nodes[1].ns, false)?;
                std::thread::sleep(Duration::from_secs(2));
                lab.seg.cable(&lab.nodes[1].ns, true)?;
            }
            Step::PodDeleted => {
                kubelet.delete_pod(lab, 2)?;
            }
        }
        let lab = &kl.lab;
        // Not settling is counted as wrong too, and the soak goes on.
        let seen = check_answerers(lab, count).unwrap_or_else(|e| vec![format!("{e:#}")]);
        wrong.extend(seen.into_iter().map(|w| format!("step {step_no} ({}): {w}", step.what())));
        std::thread::sleep((started + STEP).saturating_duration_since(Instant::now()));
        let (report, alive) = load.finish()?;
        let tally = tallies.entry(step).or_default();
        tally.add(&report);
        tally.on_node2 += on_node2;
        conns = alive;
        top_up(lab, &mut conns, &vips, &mut next_port);
        samples.push(sample(lab, t0)?);
        eprintln!("soak: {:.1} min, step {step_no} ({}): {report}", t0.elapsed().as_secs_f64() / 60.0, step.what());
        step_no += 1;
    }
    // The kubelet's count is the pod's (a deleted pod's new one starts at 0).
    let restarts = [Step::Crash, Step::PodDeleted].iter().filter_map(|s| tallies.get(s)).map(|t| t.steps as u32).sum();
    Ok(report(minutes, step_no, &tallies, &samples, &wrong, restarts))
}

/// The sample nearest minute `m`.
fn at_minute(samples: &[Sample], m: f64) -> &Sample {
    samples.iter().min_by(|a, b| (a.minute - m).abs().total_cmp(&(b.minute - m).abs())).expect("samples")
}

fn report(minutes: f64, steps: usize, tallies: &BTreeMap<Step, Tally>, samples: &[Sample], wrong: &[String], restarts: u32) -> Section {
    let a = at("soak");
    let mut s = Section::new(line!(
        "Soak ({} minutes: three agents in Kubernetes mode, default timers and table size, {} churn steps)",
        a.f("minutes").num(minutes, 0),
        a.f("steps").show(steps as u64)
    ));
    s.para(line!(
        "A new connection every 20 ms through the three stable VIPs, {LONG} long-lived connections kept busy (topped up after each step). node-3's agent restarted {} times. Wrong answerers after a step (an address answered by other than its one holder, or an unallocated one answered): {}.",
        a.f("node3_restarts").show(restarts),
        a.f("wrong_answerers").show(wrong.len() as u64)
    ));
    let mut t = Table::new(
        "| step | times | new connections failed (slowest) | long-lived broken | long-lived on node-2 (the cut node) as it began |",
        "|---|---:|---:|---:|---:|",
    );
    for (step, x) in tallies {
        let b = a.f("steps_by_kind").f(format!("{step:?}").to_lowercase());
        t.row(line!(
            "| {} | {} | {} of {} ({} ms) | {} of {} | {} |",
            b.f("what").show(step.what()),
            b.f("times").show(x.steps as u64),
            b.f("failed").show(x.failed as u64),
            b.f("attempted").show(x.attempted as u64),
            b.f("slowest_ms").show(x.slowest.as_millis() as u64),
            b.f("broken").show(x.broken as u64),
            b.f("long").show(x.long as u64),
            b.f("on_node2").show(x.on_node2 as u64)
        ));
    }
    s.table(t);
    let mut t = Table::new(
        "| minute | RSS node-1 / node-2 / node-3 (MiB) | open fds | hash-map entries | CPU since the previous row, node-1 (% of a core) |",
        "|---:|---:|---:|---:|---:|",
    );
    let ticks = 100.0; // USER_HZ
    let mut marks: Vec<&Sample> = [1.0, 0.25 * minutes, 0.5 * minutes, 0.75 * minutes, minutes].iter().map(|m| at_minute(samples, *m)).collect();
    marks.sort_by(|a, b| a.minute.total_cmp(&b.minute));
    marks.dedup_by(|a, b| a.minute == b.minute);
    let mut prev = &samples[0];
    for (k, x) in marks.into_iter().enumerate() {
        let b = a.f("samples").f(k.to_string());
        let join = |v: Vec<String>| v.join(" / ");
        let cpu = if x.minute > prev.minute {
            (x.cpu_ticks[0].saturating_sub(prev.cpu_ticks[0])) as f64 / ticks / ((x.minute - prev.minute) * 60.0) * 100.0
        } else {
            0.0
        };
        t.row(line!(
            "| {} | {} | {} | {} | {} |",
            b.f("minute").num(x.minute, 1),
            b.f("rss_mib").fig(json!(x.rss_mib), join(x.rss_mib.iter().map(|r| format!("{r:.1}")).collect())),
            b.f("fds").fig(json!(x.fds), join(x.fds.iter().map(usize::to_string).collect())),
            b.f("entries").fig(json!(x.entries), join(x.entries.iter().map(u64::to_string).collect())),
            b.f("cpu_pct_node1").num(cpu, 1)
        ));
        prev = x;
    }
    s.table(t);
    let first = at_minute(samples, 1.0);
    let last = samples.last().expect("samples");
    s.para(
        line!(
            "node-1 (never restarted) from minute {} to the end: RSS {} → {} MiB, fds {} → {}, hash-map entries {} → {}; node-2 (its cable pulled {} times, never restarted): RSS {} → {} MiB.",
            a.f("flat").f("from_minute").num(first.minute, 1),
            a.f("flat").f("rss_first").num(first.rss_mib[0], 1),
            a.f("flat").f("rss_last").num(last.rss_mib[0], 1),
            a.f("flat").f("fds_first").show(first.fds[0] as u64),
            a.f("flat").f("fds_last").show(last.fds[0] as u64),
            a.f("flat").f("entries_first").show(first.entries[0]),
            a.f("flat").f("entries_last").show(last.entries[0]),
            a.f("flat").f("flaps").show(tallies.get(&Step::Flap).map_or(0, |t| t.steps) as u64),
            a.f("flat").f("rss2_first").num(first.rss_mib[1], 1),
            a.f("flat").f("rss2_last").num(last.rss_mib[1], 1)
        )
        .with(a.f("all_samples").data(samples))
        .with(a.f("wrong").data(wrong)),
    );
    s
}
