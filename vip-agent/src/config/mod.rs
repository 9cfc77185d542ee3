//! The YAML file source: parses and validates `vip-agent run --config FILE` into
//! the model. Unknown keys are errors; every error names the field path and line.
mod bgp;
mod locate;

use std::{collections::BTreeMap, fmt, net::IpAddr, time::Duration};

use serde::Deserialize;

pub use crate::spec::{FieldError, MAX_POOL_ADDRESSES};
use crate::{
    maglev,
    model::{Announce, AnnounceMode, Distribution, Failover, Garp, NoHealthyBackend, Node, Pool, Protocol, Selector, Service, World},
    spec::{self, gratuitous_arp, health_check, invalid, pool_addresses, AddrEntry, GratuitousArpSpec, HealthCheckSpec, Mac},
};

/// A rejected config: where (field path, line) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = self.line {
            write!(f, "line {l}: ")?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

// ---- the file's schema -------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct File {
    nodes: Vec<FileNode>,
    #[serde(default)]
    pools: Vec<FilePool>,
    #[serde(default)]
    services: Vec<FileService>,
    #[serde(default)]
    announce: FileAnnounce,
    #[serde(default)]
    failover: FileFailover,
    #[serde(default)]
    bgp: Option<bgp::FileBgp>,
    #[serde(default)]
    maglev_seed: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileFailover {
    #[serde(default = "default_heartbeat_port")]
    heartbeat_port: u16,
    #[serde(default = "default_heartbeat_interval", with = "humantime_serde")]
    heartbeat_interval: Duration,
    #[serde(default = "default_dead_after", with = "humantime_serde")]
    dead_after: Duration,
}

impl Default for FileFailover {
    fn default() -> Self {
        let f = Failover::default();
        Self { heartbeat_port: f.heartbeat_port, heartbeat_interval: f.heartbeat_interval, dead_after: f.dead_after }
    }
}

fn default_heartbeat_port() -> u16 {
    Failover::default().heartbeat_port
}
fn default_heartbeat_interval() -> Duration {
    Failover::default().heartbeat_interval
}
fn default_dead_after() -> Duration {
    Failover::default().dead_after
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileNode {
    name: String,
    address: IpAddr,
    #[serde(default)]
    mac: Option<Mac>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FilePool {
    name: String,
    addresses: Vec<AddrEntry>,
    #[serde(default, rename = "excludedIPs")]
    excluded_ips: Vec<AddrEntry>,
    #[serde(default)]
    node_selector: Selector,
    #[serde(default)]
    announce: AnnounceMode,
    #[serde(default)]
    distribution: Distribution,
    #[serde(default)]
    gratuitous_arp: Option<GratuitousArpSpec>,
    #[serde(default)]
    interfaces: Vec<String>,
    #[serde(default)]
    vlan: Option<u16>,
    #[serde(default)]
    bgp: Option<bgp::FilePoolBgp>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileService {
    name: String,
    vip: IpAddr,
    ports: Vec<u16>,
    #[serde(default = "default_protocol")]
    protocol: Protocol,
    #[serde(default = "default_table_size")]
    table_size: u32,
    #[serde(default)]
    backend_selector: Option<Selector>,
    #[serde(default)]
    health_check: Option<HealthCheckSpec>,
    #[serde(default)]
    no_healthy_backend: NoHealthyBackend,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileAnnounce {
    #[serde(default = "default_hold_time", with = "humantime_serde")]
    hold_time: Duration,
    #[serde(default = "spec::default_garp_count")]
    garp_count: u32,
    #[serde(default = "spec::default_garp_interval", with = "humantime_serde")]
    garp_interval: Duration,
    #[serde(default = "spec::default_garp_refresh", with = "humantime_serde")]
    garp_refresh: Duration,
}

impl Default for FileAnnounce {
    fn default() -> Self {
        let a = Announce::default();
        Self { hold_time: a.hold_time, garp_count: a.garp.count, garp_interval: a.garp.interval, garp_refresh: a.garp.refresh }
    }
}

fn default_protocol() -> Protocol {
    Protocol::Tcp
}
fn default_table_size() -> u32 {
    maglev::DEFAULT_TABLE_SIZE
}
fn default_hold_time() -> Duration {
    Announce::default().hold_time
} // ---- parsing and validation --------------------------------------------------

/// Parses and validates a config text.
pub fn parse(text: &str) -> Result<World, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(text);
    let file: File = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let path = if path == "." { String::new() } else { path };
        // The located field is exact; serde's own position can be the enclosing mapping.
        let line = (!path.is_empty()).then(|| locate::line_of(text, &path)).flatten().or(inner.location().map(|l| l.line()));
        let msg = strip_location(&inner.to_string());
        // serde_yaml_ng may start its message with (part of) the path; we print it once.
        let message = match msg.split_once(": ") {
            Some((head, rest)) if !head.is_empty() && path.starts_with(head) => rest.to_owned(),
            _ => msg,
        };
        ConfigError { path, line, message }
    })?;
    validate(file).map_err(|FieldError { path, message }| ConfigError { line: locate::line_of(text, &path), path, message })
}

/// serde_yaml puts " at line L column C" in its messages; we report the line ourselves.
fn strip_location(msg: &str) -> String {
    match msg.find(" at line ") {
        Some(i) => msg[..i].to_owned(),
        None => msg.to_owned(),
    }
}

fn validate(f: File) -> Result<World, FieldError> {
    let mut names = BTreeMap::new();
    let mut addrs = BTreeMap::new();
    let mut nodes = Vec::new();
    if f.nodes.is_empty() {
        return invalid("nodes", "at least one node is needed");
    }
    for (i, n) in f.nodes.into_iter().enumerate() {
        let p = format!("nodes[{i}]");
        if n.name.is_empty() {
            return invalid(format!("{p}.name"), "must not be empty");
        }
        if let Some(j) = names.insert(n.name.clone(), i) {
            return invalid(format!("{p}.name"), format!("node {:?} is already defined at nodes[{j}]", n.name));
        }
        if let Some(why) = spec::node_address_problem(n.address) {
            return invalid(format!("{p}.address"), format!("{} {why}", n.address));
        }
        if let Some(j) = addrs.insert(n.address, i) {
            return invalid(format!("{p}.address"), format!("{} is already the address of nodes[{j}]", n.address));
        }
        nodes.push(Node { name: n.name, addr: n.address, mac: n.mac.map(|m| m.0), labels: n.labels, taints: Vec::new() });
    }
    nodes.sort_by(|a, b| a.name.cmp(&b.name));

    let mut pools: Vec<Pool> = Vec::new();
    let mut owner_of: BTreeMap<IpAddr, usize> = BTreeMap::new();
    let mut pool_names = BTreeMap::new();
    for (i, fp) in f.pools.into_iter().enumerate() {
        let p = format!("pools[{i}]");
        if let Some(j) = pool_names.insert(fp.name.clone(), i) {
            return invalid(format!("{p}.name"), format!("pool {:?} is already defined at pools[{j}]", fp.name));
        }
        // Parsed as the VipPool's are. The file source holds every address of its
        // pools (IPv6 ones answered by neighbour discovery), so a pool is counted
        // before it is expanded: an IPv6 prefix can be huge.
        let set = pool_addresses(&p, &fp.addresses, &fp.excluded_ips)?;
        if owner_of.len() as u128 + set.len() > MAX_POOL_ADDRESSES as u128 {
            return invalid(format!("{p}.addresses"), format!("all pools together exceed {MAX_POOL_ADDRESSES} addresses"));
        }
        for a in set.iter() {
            if let Some(j) = owner_of.insert(a, i) {
                return invalid(format!("{p}.addresses"), format!("{a} is also in pools[{j}] ({:?}); pools must not overlap", pools[j].name));
            }
        }
        if owner_of.len() > MAX_POOL_ADDRESSES {
            return invalid(format!("{p}.addresses"), format!("all pools together exceed {MAX_POOL_ADDRESSES} addresses"));
        }
        let garp = fp.gratuitous_arp.map(|g| g.check(&format!("{p}.gratuitousArp"))).transpose()?;
        spec::interface_names(&format!("{p}.interfaces"), &fp.interfaces)?;
        spec::vlan_id(&format!("{p}.vlan"), fp.vlan)?;
        spec::distribution(&format!("{p}.distribution"), fp.distribution, fp.announce)?;
        if fp.announce == AnnounceMode::Bgp && f.bgp.is_none() {
            return invalid(format!("{p}.announce"), "`bgp` needs the sessions to announce it on: a top-level `bgp` section with `myASN` and `peers`");
        }
        let attributes = match fp.bgp {
            Some(_) if fp.announce != AnnounceMode::Bgp => return invalid(format!("{p}.bgp"), "only for `announce: bgp`"),
            Some(b) => bgp::pool(&format!("{p}.bgp"), b)?,
            None => Default::default(),
        };
        pools.push(Pool {
            name: fp.name,
            addresses: set.iter().collect(),
            node_selector: fp.node_selector,
            tolerations: Vec::new(),
            announce: fp.announce,
            distribution: fp.distribution,
            garp,
            interfaces: fp.interfaces,
            vlan: fp.vlan,
            bgp: attributes,
        });
    }

    let mut services = Vec::new();
    let mut taken: BTreeMap<(IpAddr, u16, Protocol), usize> = BTreeMap::new();
    let mut svc_names = BTreeMap::new();
    for (i, fs) in f.services.into_iter().enumerate() {
        let p = format!("services[{i}]");
        if let Some(j) = svc_names.insert(fs.name.clone(), i) {
            return invalid(format!("{p}.name"), format!("service {:?} is already defined at services[{j}]", fs.name));
        }
        let vip = fs.vip;
        let Some(&pool) = owner_of.get(&vip) else {
            return invalid(format!("{p}.vip"), format!("{} is in no pool; add it to a pool's addresses", vip));
        };
        if fs.ports.is_empty() {
            return invalid(format!("{p}.ports"), "at least one port is needed");
        }
        for (k, &port) in fs.ports.iter().enumerate() {
            if port == 0 {
                return invalid(format!("{p}.ports[{k}]"), "port 0 is not a service port");
            }
            if let Some(j) = taken.insert((vip, port, fs.protocol), i) {
                return invalid(
                    format!("{p}.ports[{k}]"),
                    format!("{}/{:?} is already served by services[{j}]", std::net::SocketAddr::new(vip, port), fs.protocol).to_lowercase(),
                );
            }
        }
        if let Err(e) = maglev::check_table_size(fs.table_size) {
            return invalid(format!("{p}.tableSize"), e.to_string());
        }
        let health = match fs.health_check {
            Some(h) => Some(health_check(&format!("{p}.healthCheck"), h, fs.ports[0])?),
            None => None,
        };
        let backend_selector = fs.backend_selector.unwrap_or_else(|| pools[pool].node_selector.clone());
        services.push(Service {
            name: fs.name,
            vip,
            ports: fs.ports,
            protocol: fs.protocol,
            table_size: fs.table_size,
            backend_selector,
            backend_nodes: None,
            health,
            no_healthy_backend: fs.no_healthy_backend,
        });
    }

    let a = f.announce;
    let garp = gratuitous_arp(
        "announce",
        ["garpCount", "garpInterval", "garpRefresh"],
        Garp { count: a.garp_count, interval: a.garp_interval, refresh: a.garp_refresh },
    )?;
    let announce = Announce { hold_time: a.hold_time, garp };
    let fo = f.failover;
    let failover = Failover { heartbeat_port: fo.heartbeat_port, heartbeat_interval: fo.heartbeat_interval, dead_after: fo.dead_after };
    check_timers(&announce, &failover, &FILE_TIMER_FIELDS)?;
    let bgp = f.bgp.map(bgp::settings).transpose()?;
    Ok(World { nodes, pools, services, announce, failover, bgp, maglev_seed: f.maglev_seed, left_out: BTreeMap::new() })
}

/// What a source calls the timers and the heartbeat port in its messages: the
/// file's field paths, or `run`'s flags in Kubernetes mode.
pub struct TimerFields {
    pub hold_time: &'static str,
    pub heartbeat_port: &'static str,
    pub heartbeat_interval: &'static str,
    pub dead_after: &'static str,
}

/// The config file's names of the timers.
pub const FILE_TIMER_FIELDS: TimerFields = TimerFields {
    hold_time: "announce.holdTime",
    heartbeat_port: "failover.heartbeatPort",
    heartbeat_interval: "failover.heartbeatInterval",
    dead_after: "failover.deadAfter",
};

/// The bounds the timers must keep, whatever sets them (the file, or `run`'s flags
/// in Kubernetes mode); errors name the field as `names` spell it.
pub fn check_timers(announce: &Announce, fo: &Failover, names: &TimerFields) -> Result<(), FieldError> {
    if announce.hold_time < Duration::from_millis(100) {
        return invalid(names.hold_time, "must be at least 100ms (the agent refreshes held VIPs three times per hold time)");
    }
    if fo.heartbeat_port == 0 {
        return invalid(names.heartbeat_port, "port 0 cannot be bound by every agent alike");
    }
    if fo.heartbeat_interval < Duration::from_millis(5) {
        return invalid(names.heartbeat_interval, "must be at least 5ms");
    }
    if fo.dead_after < fo.heartbeat_interval * 3 {
        return invalid(
            names.dead_after,
            format!("must be at least 3 heartbeat intervals ({:?}), or one lost datagram makes a node look dead", fo.heartbeat_interval * 3),
        );
    }
    let fence = announce.hold_time + announce.hold_time / 3;
    if fo.dead_after < fence {
        return invalid(
            names.dead_after,
            format!("must be at least {} × 4/3 ({fence:?}): a wedged owner must have stopped answering ARP before a peer takes its VIPs", names.hold_time),
        );
    }
    Ok(())
}

/// Pools whose selector matches no node: nobody will answer for their VIPs. Nodes
/// of both families: heartbeats go from each node's address to the others', so an
/// IPv4 node and an IPv6 one never hear each other. Not errors (labels may come
/// later; a cluster may be moving from one family to the other), but worth a warning.
pub fn warnings(world: &World) -> Vec<String> {
    let mut w: Vec<String> = world
        .pools
        .iter()
        .filter(|p| world.eligible(p).is_empty())
        .map(|p| format!("pool {:?}: nodeSelector matches no node; its VIPs are not answered", p.name))
        .collect();
    let v4 = world.nodes.iter().find(|n| n.addr.is_ipv4());
    if let (Some(a), Some(b)) = (v4, world.nodes.iter().find(|n| n.addr.is_ipv6())) {
        w.push(format!(
            "nodes: {:?} has an IPv4 address and {:?} an IPv6 one: heartbeats do not pass between families, so such nodes count each other dead",
            a.name, b.name
        ));
    }
    w
}

#[cfg(test)]
mod tests;
