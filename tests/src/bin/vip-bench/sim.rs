//! The scale simulation: the agent's own planning code run in-process for
//! clusters far larger than the machine can run agents for. It builds the model
//! one agent would hold for N nodes and S service-ports. Then it runs what that
//! agent runs on it: the health planner (`desired::health_targets`), VIP ownership
//! (`desired::ownership`), the service maps it wants (`desired::desired`), and the
//! Maglev rings (`ServiceSpec::ring`, one build per distinct spec, as
//! `Dataplane::apply` groups them). Heartbeats are encoded and signed as the agent
//! sends them. No maps are written, and no probe or datagram is sent. The figures
//! are one node's, at the defaults a user gets: a VipPool check of `{type: http}`
//! probed every 1 s, heartbeats every 50 ms, tableSize 16381.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use anyhow::Result;
use vip_agent::{
    agent::desired::{self, Observed},
    dataplane::{group_by_spec, ServiceSpec},
    ha::{auth::Keys, heartbeat::Heartbeat},
    health::Target,
    maglev::DEFAULT_TABLE_SIZE,
    model::{self, AnnounceMode, HealthCheck, NoHealthyBackend, Node, Pool, Probe, Protocol, Service, ServiceAddr, World},
};

use crate::{
    measure::median,
    report::{at, line, Section, Table},
};

/// Each Service has two ports; every other Service is `externalTrafficPolicy:
/// Local`, with ready endpoints on this many nodes (three replicas).
const LOCAL_REPLICAS: usize = 3;
/// Runs of each timed step; the median is quoted.
const RUNS: usize = 3;
/// kube-proxy's health server, which `{type: http}` probes for Cluster Services.
const KUBE_PROXY_HEALTHZ: u16 = 10256;
/// The first `healthCheckNodePort`: one per Local Service, as Kubernetes allocates
/// them (from a NodePort range widened to hold them all in the largest shapes).
const FIRST_HEALTH_PORT: u16 = 20000;

#[derive(Clone, Copy)]
struct Shape {
    nodes: usize,
    /// Service-ports per family.
    ports: usize,
    dual: bool,
}

fn check(port: u16) -> HealthCheck {
    HealthCheck {
        probe: Probe::Http { port, path: "/healthz".into() },
        interval: Duration::from_secs(1),
        timeout: Duration::from_millis(500),
        rise: 2,
        fall: 3,
    }
}

fn node_name(i: usize) -> String {
    format!("node-{i:04}")
}

/// The nodes a Local Service's endpoints run on: [`LOCAL_REPLICAS`] distinct
/// nodes, scattered as a scheduler spreads replicas (a fixed hash of the Service,
/// so every run plans the same cluster).
fn endpoint_nodes(k: usize, nodes: usize) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut h = (k as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    while out.len() < LOCAL_REPLICAS.min(nodes) {
        h ^= h >> 29;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        out.insert(node_name((h % nodes as u64) as usize));
    }
    out
}

/// Heap and inline bytes the desired service maps hold: every service-port's
/// entry with the backends, drained backends and absent names of its spec,
/// counted once per distinct allocation (specs an `Arc` shares count once).
fn desired_bytes(d: &desired::Desired) -> usize {
    use std::mem::size_of;
    let mut seen = BTreeSet::new();
    let mut total = 0;
    for (_, s) in d.services.iter() {
        total += size_of::<ServiceAddr>() + size_of::<desired::DesiredService>() + s.name.len();
        let spec: &ServiceSpec = &s.spec;
        if !seen.insert(spec as *const ServiceSpec as usize) {
            continue;
        }
        let b = |v: &[vip_agent::dataplane::BackendSpec]| v.iter().map(|b| size_of::<vip_agent::dataplane::BackendSpec>() + b.name.len()).sum::<usize>();
        total += size_of::<ServiceSpec>() + b(&spec.backends) + b(&spec.draining) + spec.absent.iter().map(|n| size_of::<String>() + n.len()).sum::<usize>();
    }
    total
}

/// The model one agent holds for `shape`: every node eligible (the DaemonSet's
/// default pool), one VIP per Service (two per dual-stack Service).
fn world(shape: Shape) -> World {
    let nodes = (0..shape.nodes)
        .map(|i| Node {
            name: node_name(i),
            addr: IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 1)) + i as u32)),
            mac: Some([0x02, 0, 0, (i >> 16) as u8, (i >> 8) as u8, i as u8]),
            labels: BTreeMap::new(),
            taints: Vec::new(),
        })
        .collect();
    let mut services = Vec::new();
    for k in 0..shape.ports / 2 {
        let local = k % 2 == 1;
        let backend_nodes = local.then(|| endpoint_nodes(k, shape.nodes));
        let health = Some(check(if local { FIRST_HEALTH_PORT + (k / 2) as u16 } else { KUBE_PROXY_HEALTHZ }));
        let v4 = IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + k as u32));
        let v6 = IpAddr::V6(Ipv6Addr::from(u128::from(Ipv6Addr::new(0x2001, 2, 1, 0, 0, 0, 0, 0)) + k as u128));
        let vips = if shape.dual { vec![v4, v6] } else { vec![v4] };
        for vip in vips {
            services.push(Service {
                name: format!("ns/svc-{k}{}", if vip.is_ipv6() { "/ipv6" } else { "" }),
                vip,
                ports: vec![80, 443],
                protocol: Protocol::Tcp,
                table_size: DEFAULT_TABLE_SIZE,
                backend_selector: BTreeMap::new(),
                backend_nodes: backend_nodes.clone(),
                health: health.clone(),
                no_healthy_backend: NoHealthyBackend::default(),
            });
        }
    }
    let pool = Pool {
        name: "default".into(),
        addresses: services.iter().map(|s| s.vip).collect::<BTreeSet<_>>().into_iter().collect(),
        node_selector: BTreeMap::new(),
        tolerations: Vec::new(),
        announce: AnnounceMode::default(),
        distribution: Default::default(),
        garp: None,
        interfaces: Vec::new(),
        vlan: None,
        bgp: Default::default(),
    };
    World { nodes, pools: vec![pool], services, ..Default::default() }
}

/// Median wall time of `f` over [`RUNS`] runs, in ms, and its last result.
fn timed<T>(mut f: impl FnMut() -> T) -> (f64, T) {
    let mut times = Vec::new();
    let mut out = None;
    for _ in 0..RUNS {
        let t = Instant::now();
        out = Some(f());
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    (median(times), out.expect("RUNS > 0"))
}

/// One Maglev build per group of `Dataplane::apply`'s batch (equal specs share a
/// ring); returns how many were built.
fn build_rings<'a>(ports: impl Iterator<Item = (ServiceAddr, &'a ServiceSpec)>) -> Result<usize> {
    let groups = group_by_spec(ports);
    for (spec, _) in &groups {
        spec.ring(0)?;
    }
    Ok(groups.len())
}

struct Point {
    targets: usize,
    probes_per_s: f64,
    hb_sent_per_s: f64,
    hb_bytes_per_s: f64,
    start_ms: f64,
    start_rings: usize,
    desired_mib: f64,
    loss_ms: f64,
    loss_ports: usize,
    loss_rings: usize,
}

fn measure(shape: Shape) -> Result<Point> {
    let w = world(shape);
    let all: BTreeSet<String> = w.nodes.iter().map(|n| n.name.clone()).collect();
    let me = node_name(0);
    let empty = BTreeSet::new();
    let (health, joining, macs) = (BTreeMap::<Target, bool>::new(), BTreeSet::new(), BTreeMap::new());
    let all_live = Observed { me: &me, tracked: &all, live: &all, leaving: &empty, serving: &empty, health: &health, joining: &joining, macs: &macs };

    let targets = desired::health_targets(&w);
    let probes_per_s = targets.iter().map(|t| 1.0 / t.check.interval.as_secs_f64()).sum();

    // Heartbeats: one datagram to each peer per interval, as signed on the wire
    // (IPv4 and UDP headers added); one in SETTINGS_EVERY carries the settings.
    let keys = Keys::new(&[vec![7u8; 32]])?;
    let hb = |settings: String| Heartbeat {
        v: Heartbeat::VERSION,
        node: me.clone(),
        incarnation: u64::MAX / 3,
        seq: 123_456_789,
        sent_ms: 1_796_000_000_000,
        leaving_ms: 0,
        arp: Vec::new(),
        settings,
    };
    let every = vip_agent::ha::heartbeat::SETTINGS_EVERY as f64;
    let plain = keys.seal(&hb(String::new()).encode()).len() as f64 + 28.0;
    let with_settings = keys.seal(&hb(model::announced_settings(&w)).encode()).len() as f64 + 28.0;
    let hb_sent_per_s = (shape.nodes - 1) as f64 / w.failover.heartbeat_interval.as_secs_f64();
    let hb_bytes_per_s = hb_sent_per_s * (plain * (every - 1.0) + with_settings) / every;

    // A start: every node live, everything planned and every ring built.
    let (start_ms, (start_rings, before)) = timed(|| {
        std::hint::black_box(desired::ownership(&w, &me, &all));
        let d = desired::desired(&w, &all_live);
        let rings = build_rings(d.services.iter().map(|(a, s)| (*a, &*s.spec)));
        (rings, d)
    });
    let start_rings = start_rings?;
    let desired_mib = desired_bytes(&before) as f64 / (1 << 20) as f64;

    // A node lost (one that backs Local Services too): the live set shrinks, and
    // the services whose spec changed get new rings.
    let lost = node_name(1);
    let live: BTreeSet<String> = all.iter().filter(|n| **n != lost).cloned().collect();
    let (loss_ms, (loss_ports, loss_rings)) = timed(|| {
        std::hint::black_box(desired::ownership(&w, &me, &live));
        let after = desired::desired(&w, &Observed { live: &live, ..all_live });
        let changed: Vec<(ServiceAddr, &ServiceSpec)> = desired::changed(&before.services, &after.services).into_iter().map(|(a, d)| (a, &*d.spec)).collect();
        (changed.len(), build_rings(changed.into_iter()))
    });
    Ok(Point {
        targets: targets.len(),
        probes_per_s,
        hb_sent_per_s,
        hb_bytes_per_s,
        start_ms,
        start_rings,
        desired_mib,
        loss_ms,
        loss_ports,
        loss_rings: loss_rings?,
    })
}

pub fn section() -> Result<Section> {
    let mut s = Section::new(line!("Scale simulation: one node's planning cost against cluster size (the agent's own code, in-process)"));
    s.para(line!(
        "Each Service has two ports; every other one is `externalTrafficPolicy: Local` with endpoints on {LOCAL_REPLICAS} nodes, each with its own healthCheckNodePort. Every node is eligible. The defaults are a `{{type: http}}` check every 1 s, heartbeats every 50 ms and tableSize {DEFAULT_TABLE_SIZE}. \"Start\" is one node's ownership, its desired service maps and every distinct ring built, with all nodes live; \"node lost\" is the same after one node's heartbeats stop, building only the rings that changed. Times are medians of {RUNS} runs. \"Desired maps\" is the bytes those maps hold, counted from the structures (entries and the backend lists of their specs; no allocator or tree overhead)."
    ));
    let mut t = Table::new(
        "| nodes | service-ports | families | health targets | probes/s | heartbeats sent/s | heartbeat kB/s sent | start | distinct rings | ring slots (of 1,048,576) | desired maps | node lost | ports changed | rings rebuilt |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    );
    let mut shapes: Vec<Shape> = Vec::new();
    for nodes in [16, 64, 256, 1000] {
        for ports in [1000, 5000, 50_000] {
            shapes.push(Shape { nodes, ports, dual: false });
        }
    }
    shapes.push(Shape { nodes: 256, ports: 5000, dual: true });
    for shape in shapes {
        let p = measure(shape)?;
        let fam = if shape.dual { "IPv4 + IPv6" } else { "IPv4" };
        let a = at(format!("sim_n{}_s{}{}", shape.nodes, shape.ports, if shape.dual { "_dual" } else { "" }));
        let slots = p.start_rings as u64 * u64::from(DEFAULT_TABLE_SIZE);
        t.row(line!(
            "| {} | {} | {fam} | {} | {} | {} | {} | {} ms | {} | {} | {} MiB | {} ms | {} | {} |",
            a.f("nodes").show(shape.nodes as u64),
            a.f("service_ports").show(shape.ports as u64),
            a.f("health_targets").show(p.targets as u64),
            a.f("probes_per_s").num(p.probes_per_s, 0),
            a.f("heartbeats_sent_per_s").num(p.hb_sent_per_s, 0),
            a.f("heartbeat_kbytes_sent_per_s").num(p.hb_bytes_per_s / 1e3, 1),
            a.f("start_ms").num(p.start_ms, 1),
            a.f("distinct_rings").show(p.start_rings as u64),
            a.f("ring_slots").show(slots),
            a.f("desired_mib").num(p.desired_mib, 1),
            a.f("node_lost_ms").num(p.loss_ms, 1),
            a.f("node_lost_ports_changed").show(p.loss_ports as u64),
            a.f("node_lost_rings_rebuilt").show(p.loss_rings as u64),
        ));
    }
    s.table(t);
    s.para(line!(
        "Heartbeats are received at the same rate as they are sent. Ring slots above the map's 1,048,576 mean that, at this tableSize, the data path refuses the Services whose rings do not fit (`vip_services_unprogrammed`)."
    ));
    Ok(s)
}
