//! `cargo xtask lab up | demo | status | down`: a local stand-in for a cluster in
//! network namespaces (198.18.0.0/15 only): one L2 segment (a bridge), three
//! nodes each running the real `vip-agent` from one YAML file and an HTTP server
//! answering its node name, and a client. `demo` brings it up when it is not,
//! shows how connections to each VIP spread over the nodes, kills the owner of a
//! VIP (agent SIGKILL and cable pulled) while connections are open, prints the
//! measured failover, restores the node, and removes the lab if it brought it up.
use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use vip_agent::{dataplane::Dataplane, spec::Mac};
use vip_tests::{
    agent::agent_bin,
    halab::{self, ask, vip, FailoverWatch, HaLab, HaSpec, LongConn, Naming, FIXED_DIR, FIXED_PINS, FIXED_PREFIX},
};

const CONNECTIONS_PER_VIP: u16 = 30;

fn is_up() -> bool {
    Path::new("/run/netns").join(format!("{FIXED_PREFIX}br")).exists()
}

fn up() -> Result<HaLab> {
    if is_up() {
        bail!("the lab is already up (`cargo xtask lab status`, or `cargo xtask lab down` first)");
    }
    agent_bin()?;
    let spec = HaSpec::default();
    println!(
        "== lab up: bridge {FIXED_PREFIX}br, {} nodes, client {FIXED_PREFIX}cl; VIPs {}..{} (one service each, port 80); XDP in {:?} mode (VIP_XDP_MODE)",
        spec.nodes,
        vip(0),
        vip(spec.vips - 1),
        spec.xdp_mode
    );
    let lab = HaLab::start(spec, Naming::Fixed, &std::env::current_exe()?)?;
    for n in &lab.nodes {
        println!("   {}: {}  mac {}  (namespace {}, agent log {})", n.name, n.addr, Mac(n.mac), n.ns.name, n.log.display());
    }
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged(&all, Duration::from_secs(15)).with_context(|| lab.agent_logs())?;
    lab.wait_rings_full(&all, Duration::from_secs(15))?;
    println!("== agents agree on the owners (heartbeats, bounded-load rendezvous hashing):");
    for (v, o) in &owners {
        println!("   {v} -> {o}");
    }
    println!("   config {}; try: nsenter --net=/run/netns/{FIXED_PREFIX}cl curl -s http://{}/", lab.config.display(), vip(0));
    Ok(lab)
}

fn status() -> Result<()> {
    if !is_up() {
        println!("the lab is not up (`cargo xtask lab up`)");
        return Ok(());
    }
    println!("{:<8} {:<6} {:<32} {:>10} {:>10} {:>12}", "NODE", "AGENT", "HOLDS", "ARP ANSW.", "FORWARDED", "LOCAL PASS");
    let mut owners = BTreeMap::new();
    for i in 1.. {
        let name = format!("node-{i}");
        let status_file = Path::new(FIXED_DIR).join(format!("{name}.status.json"));
        if !status_file.exists() {
            break;
        }
        let s: vip_agent::status::Status = serde_json::from_str(&std::fs::read_to_string(&status_file)?)?;
        let held: Vec<String> = s.held.iter().map(|v| v.to_string()).collect();
        let c = Dataplane::open(&Path::new(FIXED_PINS).join(&name)).and_then(|dp| dp.counters());
        let get = |r: &str| c.as_ref().ok().and_then(|c| c.reasons.get(r)).map_or(0, |v| v.0);
        let pids = std::fs::read_to_string(Path::new(FIXED_DIR).join("pids")).unwrap_or_default();
        let pid = pids.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 3 && f[0] == name && f[1] == "agent").then(|| f[2].to_owned())
        });
        let alive = if pid.is_some_and(|p| Path::new("/proc").join(p).exists()) { "up" } else { "down" };
        println!("{:<8} {:<6} {:<32} {:>10} {:>10} {:>12}", name, alive, held.join(" "), get("arp_answered"), get("forwarded"), get("passed_local_backend"));
        for (v, n) in &s.owners {
            owners.entry(*v).or_insert_with(Vec::new).push(format!("{name} says {n}"));
        }
    }
    println!("\nOWNERS as each agent sees them:");
    for (v, views) in owners {
        println!("  {v:<14} {}", views.join(", "));
    }
    Ok(())
}

fn down() -> Result<()> {
    let n = halab::down_fixed()?;
    println!("== lab down: removed {n} namespaces, the agents and servers, {FIXED_PINS} and {FIXED_DIR}");
    Ok(())
}

fn bar(n: u32) -> String {
    "#".repeat(n as usize)
}

fn demo() -> Result<()> {
    let brought_up = !is_up();
    if !brought_up {
        bail!("the lab is already up from `lab up`; the demo needs its own: `cargo xtask lab down` first");
    }
    let mut lab = up()?;
    let result = demo_on(&mut lab);
    drop(lab);
    halab::down_fixed()?;
    println!("== lab removed");
    result
}

fn demo_on(lab: &mut HaLab) -> Result<()> {
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    println!("\n== traffic: {CONNECTIONS_PER_VIP} new TCP connections to each VIP; which node's server answered");
    let mut sport = 40000;
    for k in 0..lab.spec.vips {
        let mut seen = BTreeMap::<String, u32>::new();
        for _ in 0..CONNECTIONS_PER_VIP {
            sport += 1;
            *seen.entry(ask(&lab.client, vip(k), sport, Duration::from_secs(2))?).or_default() += 1;
        }
        println!("   {}:", vip(k));
        for (n, c) in &seen {
            println!("      {n}: {c:>3} {}", bar(*c));
        }
        if seen.len() != lab.nodes.len() {
            bail!("connections to {} reached only {} of {} nodes", vip(k), seen.len(), lab.nodes.len());
        }
    }

    let v = vip(0);
    let owners = lab.wait_converged(&all, Duration::from_secs(5))?;
    let a = lab.index_of(&owners[&v]);
    let victim = lab.nodes[a].name.clone();
    let mut conns = Vec::new();
    for _ in 0..12 {
        let c = LongConn::open(&lab.client, v, 0, Duration::from_secs(2))?;
        if c.backend != victim {
            conns.push(c);
        }
    }
    println!("\n== failover: {victim} owns {v}; {} long-lived connections through it to the other nodes are open", conns.len());
    println!("   killing {victim}: its agent gets SIGKILL and its cable is pulled, while the client tries a new connection every 10 ms");
    let watch = FailoverWatch::start(lab, v, lab.nodes[a].mac, conns, Duration::from_millis(2000))?;
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    lab.seg.cable(&lab.nodes[a].ns, false)?;
    lab.kill_agent(a);
    let done = Instant::now();
    let (o, mut conns, broken) = watch.finish(t0, done)?;
    let rest: Vec<usize> = all.iter().copied().filter(|&i| i != a).collect();
    let moved = lab.wait_converged(&rest, Duration::from_secs(5))?;
    let new_owner = moved[&v].clone();
    println!("   {new_owner} took {v} over; its gratuitous ARP reached the client after {}", fmt_ms(o.takeover));
    println!("   first new connection succeeded {} after the fault ({} attempts failed before)", fmt_ms(o.first_ok), o.failed);
    let (n_conns, survived) = (o.conns, o.conns - o.broken);
    println!("   established connections (owner was not their backend): {survived} of {n_conns} survived");
    println!("   client's ARP entry for {v}: {}", lab.client_neigh(v).map(|m| Mac(m).to_string()).unwrap_or_else(|| "none".into()));

    println!("\n== restoring {victim}: cable back in, agent restarted");
    lab.seg.cable(&lab.nodes[a].ns, true)?;
    lab.start_agent(a)?;
    let t = Instant::now();
    let back = lab.wait_converged(&all, Duration::from_secs(10))?;
    println!("   owners agreed again after {:?}; {v} -> {}", t.elapsed(), back[&v]);
    let mut kept = 0;
    for (c, b) in conns.iter_mut().zip(broken.iter()) {
        if !*b && c.ping().is_ok() {
            kept += 1;
        }
    }
    println!("   the {survived} surviving connections after the owner's return: {kept} still answer");
    println!("\n== lab status");
    status()?;
    if survived != n_conns || o.first_ok.is_none() {
        bail!("failover lost connections ({survived} of {n_conns} survived) or never recovered");
    }
    println!("\n== done; removing the lab");
    Ok(())
}

fn fmt_ms(d: Option<Duration>) -> String {
    d.map_or_else(|| "never (within 2 s)".into(), |d| format!("{:.0} ms", d.as_secs_f64() * 1e3))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        // The lab's per-node server (run inside a node namespace): answers its name.
        Some("serve") => {
            let (name, port) = (args.get(2).context("serve NAME PORT")?, args.get(3).context("serve NAME PORT")?.parse()?);
            halab::serve_name(port, name)
        }
        Some("up") => up().map(HaLab::persist),
        Some("status") => status(),
        Some("down") => down(),
        Some("demo") | None => demo(),
        Some(other) => bail!("unknown lab command {other:?}: up | demo | status | down"),
    }
}
