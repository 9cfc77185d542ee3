//! `vip-agent inspect`: the pinned maps decoded for a human, or as JSON, with
//! the names the agent's status file knows (Services, nodes) in place of the data
//! path's internal ids.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Result;
use serde::Serialize;

use crate::{
    addrs::host_port,
    clock::monotonic_ns,
    dataplane::{Dataplane, HeldMode},
    spec::Mac,
    status::{Status, REFRESH_INTERVAL},
};

#[derive(Serialize)]
pub struct Report {
    pub held: Vec<HeldRow>,
    pub services: Vec<ServiceRow>,
    pub backends: Vec<BackendRow>,
    pub reasons: Vec<CounterRow>,
    pub flows: usize,
    /// The agent's status file: where, whether it was read, how old it is.
    pub status: StatusInfo,
    /// From the agent's status file, when there is one.
    pub agent: Option<AgentSection>,
}

/// The status file as `inspect` found it.
#[derive(Serialize)]
pub struct StatusInfo {
    pub path: PathBuf,
    /// `ok`, `missing` or `unreadable`.
    pub state: &'static str,
    /// Why it could not be read or parsed.
    pub error: Option<String>,
    /// When the agent wrote it (ms since the Unix epoch; absent from old agents).
    pub updated_unix_ms: Option<u64>,
    /// How old it was when read, in ms.
    pub age_ms: Option<u64>,
}

impl StatusInfo {
    /// Whether the agent has not rewritten it for longer than it would while running.
    pub fn stale(&self) -> bool {
        self.age_ms.is_some_and(|a| a > 3 * REFRESH_INTERVAL.as_millis() as u64)
    }
}

/// Reads the agent's status file; a missing, unreadable or unparsable file is
/// reported, not ignored.
pub fn read_status(path: &Path, now_unix_ms: u64) -> (StatusInfo, Option<Status>) {
    let mut info = StatusInfo { path: path.to_owned(), state: "ok", error: None, updated_unix_ms: None, age_ms: None };
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            info.state = "missing";
            return (info, None);
        }
        Err(e) => {
            info.state = "unreadable";
            info.error = Some(e.to_string());
            return (info, None);
        }
    };
    match serde_json::from_str::<Status>(&text) {
        Ok(st) => {
            if st.updated_unix_ms != 0 {
                info.updated_unix_ms = Some(st.updated_unix_ms);
                info.age_ms = Some(now_unix_ms.saturating_sub(st.updated_unix_ms));
            }
            (info, Some(st))
        }
        Err(e) => {
            info.state = "unreadable";
            info.error = Some(format!("not a status: {e}"));
            (info, None)
        }
    }
}

/// What only the agent knows: owners, backend health, config state.
#[derive(Serialize)]
pub struct AgentSection {
    pub node: String,
    pub config_generation: u64,
    pub config_error: Option<String>,
    pub owners: BTreeMap<std::net::IpAddr, String>,
    pub backends: Vec<HealthRow>,
    /// Service-ports the agent could not program, with why.
    pub unprogrammed: Vec<crate::status::UnprogrammedStatus>,
    /// What this host lacks for the VIP traffic it backs (see `vip-agent check`).
    pub host_problems: Vec<String>,
    /// Peers whose cluster-wide settings differ from this node's.
    pub settings_mismatch: Vec<String>,
    pub usage: crate::dataplane::Usage,
    /// This node's BGP sessions (`announce: bgp`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bgp: Option<crate::status::BgpStatus>,
}

#[derive(Serialize)]
pub struct HealthRow {
    pub service: String,
    pub node: String,
    pub addr: IpAddr,
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
    pub vip: std::net::IpAddr,
    /// Milliseconds until the deadline; negative once stale (not answered).
    pub expires_in_ms: i64,
    /// `arp` or `ndp` (answered by the data path: ARP, IPv6 neighbour
    /// solicitations) or `lo` (announced by a routing daemon).
    pub announce: &'static str,
    /// The node it was taken from (its name as the status knows its MAC, else
    /// the MAC), asked about the flows this node never saw (`arp_handoff`).
    pub taken_from: Option<String>,
}

#[derive(Serialize)]
pub struct ServiceRow {
    /// The Service's name as the agent's model has it (`namespace/name` from
    /// Kubernetes, the file's `name`); None without a status.
    pub name: Option<String>,
    pub vip: std::net::IpAddr,
    pub port: u16,
    pub proto: &'static str,
    /// The data path's id of the service (its counters' key).
    pub id: u32,
    pub table_size: u32,
    pub packets: u64,
    pub bytes: u64,
    /// The backends in its ring with their slots; empty: no backend (new flows are dropped).
    pub ring: Vec<RingMember>,
}

#[derive(Serialize)]
pub struct RingMember {
    pub backend_id: u32,
    /// The backend's node, where the status knows it.
    pub node: Option<String>,
    pub addr: Option<IpAddr>,
    pub slots: u32,
    pub share_pct: f64,
}

impl ServiceRow {
    /// The port-0 entry all fragments of the VIP's datagrams use (an alias of
    /// the service with the lowest port).
    pub fn fragment_alias(&self) -> bool {
        self.port == 0
    }
}

#[derive(Serialize)]
pub struct BackendRow {
    pub id: u32,
    /// Its node, where the status knows it.
    pub node: Option<String>,
    /// The node's address; where the status does not know it, what the map
    /// records (an IPv6 node's is a key in 0.0.0.0/8, `dataplane::backend_key`).
    pub addr: IpAddr,
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

pub fn report(dp: &Dataplane, status_info: StatusInfo, status: Option<Status>) -> Result<Report> {
    let now = monotonic_ns() as i64;
    let counters = dp.counters()?;
    let handoffs = dp.held_ref().handoffs()?;
    let nodes: Vec<_> = status.iter().flat_map(|s| s.nodes.iter()).collect();
    let taken_from = |ifindex: u32, vip| {
        let mac = Mac(*handoffs.get(&(ifindex, vip))?).to_string();
        Some(nodes.iter().find(|n| n.mac.as_deref() == Some(mac.as_str())).map_or(mac.clone(), |n| n.node.clone()))
    };
    let held = dp
        .held_ref()
        .entries()?
        .into_iter()
        .map(|e| {
            let announce = match (e.announce, e.vip) {
                (HeldMode::Lo, _) => "lo",
                (HeldMode::Arp, std::net::IpAddr::V4(_)) => "arp",
                (HeldMode::Arp, std::net::IpAddr::V6(_)) => "ndp",
            };
            HeldRow {
                ifindex: e.ifindex,
                network: crate::links::network_name(e.ifindex),
                vip: e.vip,
                expires_in_ms: (e.deadline_ns as i64 - now) / 1_000_000,
                announce,
                taken_from: taken_from(e.ifindex, e.vip),
            }
        })
        .collect();
    // A backend's node: the one with its key, and its MAC where two IPv6 nodes share a key.
    let node_of = |b: &vip_common::LbBackend| {
        let keyed = || nodes.iter().filter(|n| crate::dataplane::backend_key(n.addr).octets() == b.addr);
        let mac = Mac(b.mac).to_string();
        keyed().find(|n| n.mac.as_deref() == Some(mac.as_str())).or_else(|| keyed().next()).map(|n| (n.node.as_str(), n.addr))
    };
    let backends: Vec<BackendRow> = dp
        .backends()?
        .into_iter()
        .map(|(id, b)| {
            let (packets, bytes) = counters.backends.get(&id).copied().unwrap_or_default();
            let node = node_of(&b);
            BackendRow {
                id,
                node: node.map(|(n, _)| n.to_string()),
                addr: node.map_or(Ipv4Addr::from(b.addr).into(), |(_, a)| a),
                mac: Mac(b.mac).to_string(),
                local: b.flags & vip_common::BACKEND_LOCAL != 0,
                packets,
                bytes,
            }
        })
        .collect();
    let mut services = Vec::new();
    for (a, s, ring) in dp.services()? {
        let mut slots = BTreeMap::<u32, u32>::new();
        for id in ring.into_iter().filter(|&id| id != vip_common::NO_BACKEND) {
            *slots.entry(id).or_default() += 1;
        }
        let ring = slots
            .into_iter()
            .map(|(id, n)| {
                let b = backends.iter().find(|b| b.id == id);
                RingMember {
                    backend_id: id,
                    node: b.and_then(|b| b.node.clone()),
                    addr: b.map(|b| b.addr),
                    slots: n,
                    share_pct: 100.0 * f64::from(n) / f64::from(s.ring_size.max(1)),
                }
            })
            .collect();
        let name = status.iter().flat_map(|st| st.services.iter()).find(|v| v.vip == a.vip && v.port == a.port && v.protocol == a.protocol.name());
        let (packets, bytes) = counters.services.get(&s.id).copied().unwrap_or_default();
        services.push(ServiceRow {
            name: name.map(|v| v.name.clone()),
            vip: a.vip,
            port: a.port,
            proto: a.protocol.name(),
            id: s.id,
            table_size: s.ring_size,
            packets,
            bytes,
            ring,
        });
    }
    let reasons = counters.reasons.iter().map(|(&reason, &(packets, bytes))| CounterRow { reason, packets, bytes }).collect();
    let mut r = Report { held, services, backends, reasons, flows: dp.flow_count(), status: status_info, agent: None };
    r.agent = status.map(|st| agent_section(&r, st));
    Ok(r)
}

/// Rows per service (first port of each) and backend: the nodes in its ring with
/// their share (from the maps), and the nodes its health check has down.
fn agent_section(r: &Report, st: Status) -> AgentSection {
    let addr_of: BTreeMap<&str, IpAddr> = st.nodes.iter().map(|n| (n.node.as_str(), n.addr)).collect();
    let mut backends = Vec::new();
    let mut seen = BTreeSet::new();
    for s in st.services.iter().filter(|s| seen.insert(s.name.clone())) {
        let row = r.services.iter().find(|v| v.vip == s.vip && v.port == s.port && v.proto == s.protocol);
        let share = |addr: IpAddr| -> f64 { row.and_then(|v| v.ring.iter().find(|m| m.addr == Some(addr))).map_or(0.0, |m| m.share_pct) };
        let health = |node: &str| st.health.iter().find(|h| Some(&h.check) == s.check.as_ref() && h.node == node);
        for node in &s.backends {
            let Some(&addr) = addr_of.get(node.as_str()) else { continue };
            let mut detail = health(node).map_or_else(|| "not checked".to_owned(), |h| h.detail.clone());
            if s.failing_open {
                detail = format!("failing open (every backend down): {detail}");
            }
            backends.push(HealthRow { service: s.name.clone(), node: node.clone(), addr, healthy: !s.failing_open, ring_share_pct: share(addr), detail });
        }
        for h in st.health.iter().filter(|h| Some(&h.check) == s.check.as_ref() && !h.healthy && !(s.failing_open && s.backends.contains(&h.node))) {
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
        settings_mismatch: st.settings_mismatch,
        usage: st.usage,
        bgp: st.bgp,
    }
}

/// A duration as people read it: `3 s`, `5 min 2 s`, `2 h 10 min`.
fn age(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        _ => format!("{} h {} min", s / 3600, s % 3600 / 60),
    }
}

/// The line that says whose status this is and how old, or why there is none.
fn status_line(r: &Report) -> String {
    let st = &r.status;
    let path = st.path.display();
    match (st.state, &r.agent) {
        ("missing", _) => format!(
            "AGENT: no status file at {path}: Service names, owners and health are not shown \
             (the agent is not running on this node, or writes its status elsewhere: run --status-file / VIP_STATUS_FILE)"
        ),
        ("unreadable", _) => format!("AGENT: the status file {path} could not be read: {}", st.error.as_deref().unwrap_or("?")),
        (_, Some(a)) => {
            let cfg = match &a.config_error {
                None => format!("config generation {}", a.config_generation),
                Some(e) => format!("config generation {}; LAST CONFIG REJECTED: {e}", a.config_generation),
            };
            let when = match (st.updated_unix_ms, st.age_ms) {
                (Some(t), Some(ms)) => {
                    let at = humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(t));
                    let stale = if st.stale() {
                        format!(
                            "; STALE: not rewritten for {} (a running agent rewrites it every {} s): the agent is probably not running, this is its last state",
                            age(ms),
                            REFRESH_INTERVAL.as_secs()
                        )
                    } else {
                        String::new()
                    };
                    format!("status written {} ago ({at}){stale}", age(ms))
                }
                _ => "status age unknown (written by an agent without timestamps)".to_owned(),
            };
            format!("AGENT {} ({cfg}): {when}", a.node)
        }
        _ => String::new(),
    }
}

/// What a service's ring holds, for the table: `n1 50.0%, n2 50.0%`.
fn ring_text(v: &ServiceRow, verbose: bool) -> String {
    if v.ring.is_empty() {
        return "none: new connections are dropped (drop_no_backend)".to_owned();
    }
    let members: Vec<String> = v
        .ring
        .iter()
        .map(|m| {
            let who = match (&m.node, m.addr) {
                (Some(n), _) => n.clone(),
                (None, Some(a)) => a.to_string(),
                (None, None) => format!("backend {}", m.backend_id),
            };
            if verbose {
                format!("{who} (id {}) {}/{}", m.backend_id, m.slots, v.table_size)
            } else {
                format!("{who} {:.1}%", m.share_pct)
            }
        })
        .collect();
    members.join(", ")
}

/// A column of a [`Table`]: its header, the width it takes at least, whether its
/// cells are right-aligned, and what separates it from the column before.
struct Col {
    head: &'static str,
    min: usize,
    right: bool,
    sep: &'static str,
}

impl Col {
    fn left(head: &'static str, min: usize) -> Self {
        Self { head, min, right: false, sep: " " }
    }

    fn right(head: &'static str, min: usize) -> Self {
        Self { head, min, right: true, sep: " " }
    }
}

/// A table of `inspect`'s text output, indented two spaces: every column as wide as
/// its header and widest cell (and at least its `min`), so that an IPv6 address
/// (up to 39 characters) keeps the columns after it in line.
struct Table {
    cols: Vec<Col>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn new(cols: Vec<Col>) -> Self {
        Self { cols, rows: Vec::new() }
    }

    fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.cols.len());
        self.rows.push(cells);
    }

    /// Writes the header line (unless every header is empty) and the rows; lines
    /// carry no trailing spaces.
    fn write(&self, s: &mut String) {
        let widths: Vec<usize> = self
            .cols
            .iter()
            .enumerate()
            .map(|(i, c)| self.rows.iter().map(|r| r[i].chars().count()).chain([c.min, c.head.chars().count()]).max().unwrap_or(0))
            .collect();
        if self.cols.iter().any(|c| !c.head.is_empty()) {
            self.line(s, &widths, self.cols.iter().map(|c| c.head));
        }
        for r in &self.rows {
            self.line(s, &widths, r.iter().map(String::as_str));
        }
    }

    fn line<'a>(&self, s: &mut String, widths: &[usize], cells: impl Iterator<Item = &'a str>) {
        let start = s.len();
        s.push_str("  ");
        for (i, ((c, &w), cell)) in self.cols.iter().zip(widths).zip(cells).enumerate() {
            if i > 0 {
                s.push_str(c.sep);
            }
            let _ = if c.right { write!(s, "{cell:>w$}") } else { write!(s, "{cell:<w$}") };
        }
        let end = start + s[start..].trim_end().len();
        s.truncate(end);
        s.push('\n');
    }
}

pub fn render(r: &Report, verbose: bool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}\n", status_line(r));
    // The data path's ids, in verbose output only: a first column.
    let with_id = |cols: Vec<Col>| -> Vec<Col> {
        if verbose {
            [Col::left("ID", 5)].into_iter().chain(cols).collect()
        } else {
            cols
        }
    };
    let id_cell = |id: u32, cells: Vec<String>| -> Vec<String> {
        if verbose {
            [id.to_string()].into_iter().chain(cells).collect()
        } else {
            cells
        }
    };

    let _ = writeln!(s, "HELD VIPS");
    let mut t =
        Table::new(vec![Col::left("NETWORK", 16), Col::left("VIP", 16), Col::left("ANNOUNCE", 9), Col::left("EXPIRES", 20), Col::left("TAKEN FROM", 0)]);
    for h in &r.held {
        let state = if h.expires_in_ms >= 0 { format!("in {} ms", h.expires_in_ms) } else { "STALE (not answered)".into() };
        t.row(vec![h.network.clone(), h.vip.to_string(), h.announce.to_owned(), state, h.taken_from.clone().unwrap_or_else(|| "-".into())]);
    }
    t.write(&mut s);

    let _ = writeln!(s, "\nSERVICES");
    let mut t = Table::new(with_id(vec![
        Col::left("SERVICE", 24),
        Col::left("VIP:PORT/PROTO", 26),
        Col::left("PACKETS", 10),
        Col::left("BYTES", 12),
        Col::left("BACKENDS (share of the ring)", 0),
    ]));
    for v in r.services.iter().filter(|v| verbose || !v.fragment_alias()) {
        let port = if v.fragment_alias() { "*fragments".to_owned() } else { v.port.to_string() };
        t.row(id_cell(
            v.id,
            vec![
                v.name.as_deref().unwrap_or("?").to_owned(),
                format!("{}/{}", host_port(v.vip, port), v.proto),
                v.packets.to_string(),
                v.bytes.to_string(),
                ring_text(v, verbose),
            ],
        ));
    }
    t.write(&mut s);

    let _ = writeln!(s, "\nBACKENDS");
    let mut t = Table::new(with_id(vec![
        Col::left("NODE", 16),
        Col::left("ADDRESS", 16),
        Col::left("MAC", 18),
        Col::left("LOCAL", 6),
        Col::left("PACKETS", 10),
        Col::left("BYTES", 0),
    ]));
    for b in &r.backends {
        t.row(id_cell(
            b.id,
            vec![
                b.node.as_deref().unwrap_or("?").to_owned(),
                b.addr.to_string(),
                b.mac.clone(),
                b.local.to_string(),
                b.packets.to_string(),
                b.bytes.to_string(),
            ],
        ));
    }
    t.write(&mut s);

    if let Some(a) = &r.agent {
        let _ = writeln!(s, "\nOWNERS (as node {} sees them)", a.node);
        let mut t = Table::new(vec![Col::left("VIP", 16), Col::left("OWNER", 0)]);
        for (vip, owner) in &a.owners {
            t.row(vec![vip.to_string(), owner.clone()]);
        }
        t.write(&mut s);

        let _ = writeln!(s, "\nHEALTH");
        let mut t = Table::new(vec![
            Col::left("SERVICE", 24),
            Col::left("BACKEND", 14),
            Col::left("ADDRESS", 16),
            Col::left("HEALTH", 8),
            Col::right("RING", 7),
            Col { sep: "  ", ..Col::left("DETAIL", 0) },
        ]);
        for b in &a.backends {
            let h = if b.healthy { "up" } else { "DOWN" };
            t.row(vec![b.service.clone(), b.node.clone(), b.addr.to_string(), h.to_owned(), format!("{:.2}%", b.ring_share_pct), b.detail.clone()]);
        }
        t.write(&mut s);

        let u = &a.usage;
        let _ = writeln!(
            s,
            "\nTABLES: services {}/{}, rings {} using {}/{} slots, backends {}/{}",
            u.services, u.services_max, u.rings, u.ring_slots, u.ring_capacity, u.backends, u.backends_max
        );
        if !a.unprogrammed.is_empty() {
            let _ = writeln!(s, "\nNOT PROGRAMMED (retried)");
            let mut t = Table::new(vec![Col::left("SERVICE", 24), Col::left("VIP:PORT/PROTO", 26), Col::left("ERROR", 0)]);
            for u in &a.unprogrammed {
                t.row(vec![u.name.clone(), format!("{}/{}", host_port(u.vip, u.port), u.protocol), u.error.clone()]);
            }
            t.write(&mut s);
        }
        if let Some(b) = &a.bgp {
            let _ = writeln!(s, "\nBGP ({} routes in FRR's configuration)", b.routes);
            if let Some(e) = &b.reload_error {
                let _ = writeln!(s, "  FRR refused the last configuration (retried every 5 s): {e}");
            }
            let mut t =
                Table::new(vec![Col::left("PEER", 26), Col::left("STATE", 12), Col::right("SENT", 6), Col::right("RECEIVED", 9), Col::left("  LAST RESET", 0)]);
            for p in &b.sessions {
                t.row(vec![
                    p.peer.to_string(),
                    p.state.clone(),
                    p.prefixes_sent.to_string(),
                    p.prefixes_received.to_string(),
                    format!("  {}", p.last_reset.as_deref().unwrap_or("-")),
                ]);
            }
            t.write(&mut s);
        }
        for (title, lines) in [("HOST NOT READY", &a.host_problems), ("CLUSTER SETTINGS DIFFER (every agent must be set alike)", &a.settings_mismatch)] {
            if !lines.is_empty() {
                let _ = writeln!(s, "\n{title}");
                for l in lines {
                    let _ = writeln!(s, "  {l}");
                }
            }
        }
    }
    let _ = writeln!(s, "\nCOUNTERS (flows in table: {})", r.flows);
    // No header: `reason  N pkts  M bytes`, the numbers right-aligned.
    let mut t = Table::new(vec![Col::left("", 28), Col::right("", 15), Col::right("", 18)]);
    for c in r.reasons.iter().filter(|c| verbose || c.packets > 0) {
        t.row(vec![c.reason.to_owned(), format!("{} pkts", c.packets), format!("{} bytes", c.bytes)]);
    }
    t.write(&mut s);
    s
}

#[cfg(test)]
mod tests;
