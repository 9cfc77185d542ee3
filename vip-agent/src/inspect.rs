//! `vip-agent inspect`: the pinned maps decoded for a human, or as JSON.
use std::{fmt::Write as _, net::Ipv4Addr};

use anyhow::Result;
use serde::Serialize;

use crate::{
    clock::monotonic_ns,
    dataplane::{Announce, Dataplane},
    spec::Mac,
    status::Status,
};

#[derive(Serialize)]
pub struct Report {
    pub held: Vec<HeldRow>,
    pub services: Vec<ServiceRow>,
    pub backends: Vec<BackendRow>,
    pub reasons: Vec<CounterRow>,
    pub flows: usize,
    /// From the agent's status file, when there is one.
    pub agent: Option<AgentSection>,
}

/// What only the agent knows: owners, backend health, config state.
#[derive(Serialize)]
pub struct AgentSection {
    pub node: String,
    pub config_generation: u64,
    pub config_error: Option<String>,
    pub owners: std::collections::BTreeMap<Ipv4Addr, String>,
    pub backends: Vec<HealthRow>,
    /// Service-ports the agent could not program, with why.
    pub unprogrammed: Vec<crate::status::UnprogrammedStatus>,
    /// What this host lacks for the VIP traffic it backs (see `vip-agent check`).
    pub host_problems: Vec<String>,
    pub usage: crate::dataplane::Usage,
}

#[derive(Serialize)]
pub struct HealthRow {
    pub service: String,
    pub node: String,
    pub addr: Ipv4Addr,
    pub healthy: bool,
    /// Share of the service's ring this backend holds in the maps now, percent.
    pub ring_share_pct: f64,
    pub detail: String,
}

#[derive(Serialize)]
pub struct HeldRow {
    pub ifindex: u32,
    /// The network it is held on: an interface, or a VLAN of one.
    pub network: String,
    pub vip: Ipv4Addr,
    /// Milliseconds until the deadline; negative once stale (not answered).
    pub expires_in_ms: i64,
    /// `arp` (answered by the data path) or `lo` (announced by a routing daemon).
    pub announce: &'static str,
}

#[derive(Serialize)]
pub struct ServiceRow {
    pub vip: Ipv4Addr,
    pub port: u16,
    pub proto: &'static str,
    pub id: u32,
    pub table_size: u32,
    pub packets: u64,
    pub bytes: u64,
    /// (backend id, slots) of this service's ring.
    pub ring_share: Vec<(u32, u32)>,
}

#[derive(Serialize)]
pub struct BackendRow {
    pub id: u32,
    pub addr: Ipv4Addr,
    pub mac: String,
    pub local: bool,
    pub packets: u64,
    pub bytes: u64,
}

#[derive(Serialize)]
pub struct CounterRow {
    pub reason: &'static str,
    pub packets: u64,
    pub bytes: u64,
}

pub fn report(dp: &Dataplane, status: Option<Status>) -> Result<Report> {
    let now = monotonic_ns() as i64;
    let counters = dp.counters()?;
    let held = dp
        .held_ref()
        .entries()?
        .into_iter()
        .map(|e| {
            let announce = if e.announce == Announce::Lo { "lo" } else { "arp" };
            HeldRow {
                ifindex: e.ifindex,
                network: crate::links::network_name(e.ifindex),
                vip: e.vip,
                expires_in_ms: (e.deadline_ns as i64 - now) / 1_000_000,
                announce,
            }
        })
        .collect();
    let mut services = Vec::new();
    for (a, s, ring) in dp.services()? {
        let mut share = std::collections::BTreeMap::<u32, u32>::new();
        for id in ring {
            *share.entry(id).or_default() += 1;
        }
        let (packets, bytes) = counters.services.get(&s.id).copied().unwrap_or_default();
        services.push(ServiceRow {
            vip: a.vip,
            port: a.port,
            proto: a.protocol.name(),
            id: s.id,
            table_size: s.ring_size,
            packets,
            bytes,
            ring_share: share.into_iter().collect(),
        });
    }
    let backends = dp
        .backends()?
        .into_iter()
        .map(|(id, b)| {
            let (packets, bytes) = counters.backends.get(&id).copied().unwrap_or_default();
            BackendRow { id, addr: Ipv4Addr::from(b.addr), mac: Mac(b.mac).to_string(), local: b.flags & vip_common::BACKEND_LOCAL != 0, packets, bytes }
        })
        .collect();
    let reasons = counters.reasons.iter().map(|(&reason, &(packets, bytes))| CounterRow { reason, packets, bytes }).collect();
    let mut r = Report { held, services, backends, reasons, flows: dp.flow_count(), agent: None };
    r.agent = status.map(|st| agent_section(&r, st));
    Ok(r)
}

/// Rows per service (first port of each) and backend: the nodes in its ring with
/// their share (from the maps), and the nodes its health check has down.
fn agent_section(r: &Report, st: Status) -> AgentSection {
    let addr_of: std::collections::BTreeMap<&str, Ipv4Addr> = st.nodes.iter().map(|n| (n.node.as_str(), n.addr)).collect();
    let mut backends = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for s in st.services.iter().filter(|s| seen.insert(s.name.clone())) {
        let row = r.services.iter().find(|v| v.vip == s.vip && v.port == s.port && v.proto == s.protocol);
        let share = |addr: Ipv4Addr| -> f64 {
            let Some(v) = row else { return 0.0 };
            let Some(id) = r.backends.iter().find(|b| b.addr == addr).map(|b| b.id) else { return 0.0 };
            100.0 * v.ring_share.iter().find(|(b, _)| *b == id).map_or(0, |(_, n)| *n) as f64 / v.table_size.max(1) as f64
        };
        let health = |node: &str| st.health.iter().find(|h| Some(&h.check) == s.check.as_ref() && h.node == node);
        for node in &s.backends {
            let Some(&addr) = addr_of.get(node.as_str()) else { continue };
            let detail = health(node).map_or_else(|| "not checked".to_owned(), |h| h.detail.clone());
            backends.push(HealthRow { service: s.name.clone(), node: node.clone(), addr, healthy: true, ring_share_pct: share(addr), detail });
        }
        for h in st.health.iter().filter(|h| Some(&h.check) == s.check.as_ref() && !h.healthy) {
            let Some(&addr) = addr_of.get(h.node.as_str()) else { continue };
            backends.push(HealthRow {
                service: s.name.clone(),
                node: h.node.clone(),
                addr,
                healthy: false,
                ring_share_pct: share(addr),
                detail: h.detail.clone(),
            });
        }
    }
    AgentSection {
        node: st.node,
        config_generation: st.config.generation,
        config_error: st.config.error,
        owners: st.owners,
        backends,
        unprogrammed: st.unprogrammed,
        host_problems: st.host_problems,
        usage: st.usage,
    }
}

pub fn render(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "HELD VIPS\n  {:<16} {:<16} {:<9} EXPIRES", "NETWORK", "VIP", "ANNOUNCE");
    for h in &r.held {
        let state = if h.expires_in_ms >= 0 { format!("in {} ms", h.expires_in_ms) } else { "STALE (not answered)".into() };
        let _ = writeln!(s, "  {:<16} {:<16} {:<9} {}", h.network, h.vip, h.announce, state);
    }
    let _ = writeln!(s, "\nSERVICES\n  {:<22} {:<4} {:<6} {:<10} {:<10} RING SHARE (backend:slots)", "VIP:PORT", "ID", "PROTO", "PACKETS", "BYTES");
    for v in &r.services {
        let share: Vec<String> = v.ring_share.iter().map(|(b, n)| format!("{b}:{n}")).collect();
        let port = if v.port == 0 { "*frag".to_string() } else { v.port.to_string() };
        let _ = writeln!(
            s,
            "  {:<22} {:<4} {:<6} {:<10} {:<10} {} / {}",
            format!("{}:{}", v.vip, port),
            v.id,
            v.proto,
            v.packets,
            v.bytes,
            share.join(" "),
            v.table_size
        );
    }
    let _ = writeln!(s, "\nBACKENDS\n  {:<4} {:<16} {:<18} {:<6} {:<10} BYTES", "ID", "ADDRESS", "MAC", "LOCAL", "PACKETS");
    for b in &r.backends {
        let _ = writeln!(s, "  {:<4} {:<16} {:<18} {:<6} {:<10} {}", b.id, b.addr, b.mac, b.local, b.packets, b.bytes);
    }
    if let Some(a) = &r.agent {
        let cfg = match &a.config_error {
            None => format!("config generation {}", a.config_generation),
            Some(e) => format!("config generation {}; LAST FILE REJECTED: {e}", a.config_generation),
        };
        let _ = writeln!(s, "\nAGENT {} ({cfg})\n  {:<16} OWNER", a.node, "VIP");
        for (vip, owner) in &a.owners {
            let _ = writeln!(s, "  {:<16} {}", vip, owner);
        }
        let _ = writeln!(s, "\n  {:<14} {:<14} {:<16} {:<8} {:>7}  DETAIL", "SERVICE", "BACKEND", "ADDRESS", "HEALTH", "RING");
        for b in &a.backends {
            let h = if b.healthy { "up" } else { "DOWN" };
            let _ = writeln!(s, "  {:<14} {:<14} {:<16} {:<8} {:>6.2}%  {}", b.service, b.node, b.addr, h, b.ring_share_pct, b.detail);
        }
        let u = &a.usage;
        let _ = writeln!(
            s,
            "\n  TABLES: services {}/{}, rings {} using {}/{} slots, backends {}/{}",
            u.services, u.services_max, u.rings, u.ring_slots, u.ring_capacity, u.backends, u.backends_max
        );
        if !a.unprogrammed.is_empty() {
            let _ = writeln!(s, "\n  NOT PROGRAMMED (retried)\n  {:<14} {:<22} {:<6} ERROR", "SERVICE", "VIP:PORT", "PROTO");
            for u in &a.unprogrammed {
                let _ = writeln!(s, "  {:<14} {:<22} {:<6} {}", u.name, format!("{}:{}", u.vip, u.port), u.protocol, u.error);
            }
        }
        if !a.host_problems.is_empty() {
            let _ = writeln!(s, "\n  HOST NOT READY");
            for p in &a.host_problems {
                let _ = writeln!(s, "  {p}");
            }
        }
    }
    let _ = writeln!(s, "\nCOUNTERS (flows in table: {})", r.flows);
    for c in r.reasons.iter().filter(|c| c.packets > 0) {
        let _ = writeln!(s, "  {:<28} {:>10} pkts {:>12} bytes", c.reason, c.packets, c.bytes);
    }
    s
}
