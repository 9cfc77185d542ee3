//! `cargo xtask lab demo`: a local stand-in for a cluster in network namespaces
//! (198.18.0.0/15 only). One L2 segment, three nodes and a client; node-1 holds
//! the VIP and its XDP program answers ARP and spreads connections over all three
//! nodes with L2 direct server return. Everything is removed at the end.
use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{atomic::AtomicBool, Arc},
};

use anyhow::{bail, Context as _, Result};
use vip_agent::{
    dataplane::{monotonic_ns, BackendSpec, ServiceAddr},
    inspect,
};
use vip_common::PROTO_TCP;
use vip_tests::{
    lab::{accept_vip, attach_node, fetch, name_server, Segment},
    netns::PinDir,
};

const NODES: u8 = 3;
const CONNECTIONS: u16 = 60;
const VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);

fn demo() -> Result<()> {
    println!("== building the lab: one L2 segment (bridge), {NODES} nodes, one client, VIP {VIP}:80");
    let seg = Segment::new()?;
    let client = seg.host("vlabcl", &format!("{CLIENT}/24"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut nodes = Vec::new();
    let mut servers = Vec::new();
    for i in 1..=NODES {
        let addr = Ipv4Addr::new(198, 18, 0, 10 + i);
        let ns = seg.host(&format!("vlabn{i}"), &format!("{addr}/24"))?;
        accept_vip(&ns, VIP)?;
        servers.push(name_server(&ns, 80, format!("node-{i}"), stop.clone())?);
        let mac = ns.mac("eth0")?;
        println!("   node-{i}: {addr}  mac {}", inspect::mac_str(&mac));
        nodes.push((ns, addr, mac));
    }
    let pins = PinDir::new()?;
    let (mut dp, ifindex) = attach_node(&nodes[0].0, &pins.path)?;
    dp.hold_vip(ifindex, VIP, monotonic_ns() + 300_000_000_000)?;
    let backends: Vec<BackendSpec> = nodes
        .iter()
        .enumerate()
        .map(|(i, (_, addr, mac))| BackendSpec { name: format!("node-{}", i + 1), addr: *addr, mac: *mac, weight: 1, local: i == 0 })
        .collect();
    let update = dp.set_service(ServiceAddr { vip: VIP, port: 80, proto: PROTO_TCP }, &backends, 16381, 0)?;
    println!("== node-1 holds {VIP}; Maglev ring of {} slots written in {:?}", update.table_size, update.elapsed);

    println!("== {CONNECTIONS} TCP connections from the client to {VIP}:80");
    let mut spread = BTreeMap::<String, u32>::new();
    for sport in 42000..42000 + CONNECTIONS {
        let answer = client.run(move || fetch(CLIENT, sport, SocketAddr::from((VIP, 80))))?;
        let name = answer.with_context(|| format!("connection from port {sport} failed"))?;
        *spread.entry(name).or_default() += 1;
    }
    for (node, n) in &spread {
        println!("   {node}: {n:>3} connections {}", "#".repeat(*n as usize));
    }
    let neigh = client.ip(&["neigh", "show", &VIP.to_string()])?;
    println!("== client's ARP entry for the VIP (answered by node-1's XDP program):\n   {}", String::from_utf8_lossy(&neigh.stdout).trim());
    println!("== node-1's maps (vip-agent inspect):");
    print!("{}", inspect::render(&inspect::report(&dp, None)?));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in servers {
        let _ = s.join();
    }
    if spread.len() != usize::from(NODES) {
        bail!("connections reached only {} of {NODES} nodes", spread.len());
    }
    println!("== done: traffic spread over all {NODES} nodes; removing the lab");
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        // The lab's per-node server (run inside a node namespace): answers its name, echoes lines.
        Some("serve") => {
            let (name, port) = (args.get(2).context("serve NAME PORT")?, args.get(3).context("serve NAME PORT")?.parse()?);
            vip_tests::halab::serve_name(port, name)
        }
        Some("demo") | None => demo(),
        Some(other) => bail!("unknown lab command {other:?}: only `demo` exists so far (it builds, runs and removes the lab)"),
    }
}
