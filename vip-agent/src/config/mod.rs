//! The YAML file source: parses and validates `vip-agent run --config FILE` into
//! the model. Unknown keys are errors; every error names the field path and line.
mod locate;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::Ipv4Addr,
    path::Path,
    str::FromStr,
    time::Duration,
};

use ipnet::Ipv4Net;
use schemars::JsonSchema;
use serde::{de, Deserialize, Deserializer, Serialize};

use crate::{
    maglev,
    model::{Announce, AnnounceMode, Failover, Garp, HealthCheck, Node, Pool, Probe, Protocol, Selector, Service, World},
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

/// Largest number of addresses all pools may hold together (the held-VIP map's size).
pub const MAX_POOL_ADDRESSES: usize = vip_common::MAX_HELD as usize;

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
    address: Ipv4Addr,
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
    excluded_ips: Vec<Ipv4Addr>,
    #[serde(default)]
    node_selector: Selector,
    #[serde(default)]
    announce: AnnounceMode,
    #[serde(default)]
    gratuitous_arp: Option<GratuitousArpSpec>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileService {
    name: String,
    vip: Ipv4Addr,
    ports: Vec<u16>,
    #[serde(default = "default_protocol")]
    protocol: Protocol,
    #[serde(default = "default_table_size")]
    table_size: u32,
    #[serde(default)]
    backend_selector: Option<Selector>,
    #[serde(default)]
    health_check: Option<HealthCheckSpec>,
}

#[derive(Deserialize, Serialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    Tcp,
    Http,
}

/// A health check as written by users: in the file and in a VipPool's spec.
#[derive(Deserialize, Serialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HealthCheckSpec {
    /// tcp (connect) or http (GET, 2xx/3xx is healthy).
    #[serde(rename = "type")]
    pub kind: ProbeKind,
    /// Defaults to the service's first port. In a VipPool, a bare `{type: http}` (no port, no path) probes kube-proxy's health endpoint (`:10256/healthz`) for `externalTrafficPolicy: Cluster` Services and `healthCheckNodePort` (`/healthz`) for `Local` ones.
    #[serde(default)]
    pub port: Option<u16>,
    /// URL path for http (default /).
    #[serde(default)]
    pub path: Option<String>,
    /// Between probes, e.g. 1s or 500ms.
    #[serde(default = "default_interval", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub interval: Duration,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub timeout: Duration,
    /// Consecutive successes that bring a backend back.
    #[serde(default = "default_rise")]
    pub rise: u32,
    /// Consecutive failures that take it out of every ring.
    #[serde(default = "default_fall")]
    pub fall: u32,
}

/// A pool's gratuitous ARP as written by users: in the file and in a VipPool's spec.
#[derive(Deserialize, Serialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GratuitousArpSpec {
    /// Frames sent on takeover (1 to 100).
    #[serde(default = "default_garp_count")]
    pub count: u32,
    /// Between those frames, e.g. 100ms (at least 1ms).
    #[serde(default = "default_garp_interval", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub interval: Duration,
    /// One more frame this often while holding (switch entries age out), e.g. 30s
    /// (at least 1s).
    #[serde(default = "default_garp_refresh", with = "humantime_serde")]
    #[schemars(with = "String")]
    pub refresh: Duration,
}

/// Validates gratuitous ARP settings; `p` is the field path of the section and
/// `names` the keys of count, interval and refresh in it.
pub fn gratuitous_arp(p: &str, names: [&str; 3], g: Garp) -> Result<Garp, Invalid> {
    if !(1..=100).contains(&g.count) {
        return invalid(format!("{p}.{}", names[0]), "must be from 1 to 100 (a takeover nobody hears about moves no traffic)");
    }
    if g.interval < Duration::from_millis(1) || g.interval > Duration::from_secs(10) {
        return invalid(format!("{p}.{}", names[1]), "must be from 1ms to 10s");
    }
    if g.refresh < Duration::from_secs(1) {
        return invalid(format!("{p}.{}", names[2]), "must be at least 1s");
    }
    Ok(g)
}

impl GratuitousArpSpec {
    pub fn check(&self, p: &str) -> Result<Garp, Invalid> {
        gratuitous_arp(p, ["count", "interval", "refresh"], Garp { count: self.count, interval: self.interval, refresh: self.refresh })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileAnnounce {
    #[serde(default = "default_hold_time", with = "humantime_serde")]
    hold_time: Duration,
    #[serde(default = "default_garp_count")]
    garp_count: u32,
    #[serde(default = "default_garp_interval", with = "humantime_serde")]
    garp_interval: Duration,
    #[serde(default = "default_garp_refresh", with = "humantime_serde")]
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
fn default_interval() -> Duration {
    Duration::from_secs(1)
}
fn default_timeout() -> Duration {
    Duration::from_millis(500)
}
fn default_rise() -> u32 {
    2
}
fn default_fall() -> u32 {
    3
}
fn default_hold_time() -> Duration {
    Announce::default().hold_time
}
fn default_garp_count() -> u32 {
    Garp::default().count
}
fn default_garp_interval() -> Duration {
    Garp::default().interval
}
fn default_garp_refresh() -> Duration {
    Garp::default().refresh
}

/// `aa:bb:cc:dd:ee:ff`.
struct Mac([u8; 6]);

impl<'de> Deserialize<'de> for Mac {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let bytes: Vec<u8> = s.split(':').filter_map(|p| (p.len() == 2).then(|| u8::from_str_radix(p, 16).ok()).flatten()).collect();
        let mac: [u8; 6] =
            bytes.try_into().map_err(|_| de::Error::custom(format!("{s:?} is not a MAC address (expected six hex pairs, aa:bb:cc:dd:ee:ff)")))?;
        Ok(Mac(mac))
    }
}

/// One `addresses` entry: an address, a CIDR, or an inclusive `first-last` range.
#[derive(Clone, Copy, Debug)]
pub enum AddrEntry {
    One(Ipv4Addr),
    Net(Ipv4Net),
    Range(Ipv4Addr, Ipv4Addr),
}

impl AddrEntry {
    fn bounds(self) -> (u32, u32) {
        match self {
            AddrEntry::One(a) => (a.into(), a.into()),
            AddrEntry::Net(n) => (n.network().into(), n.broadcast().into()),
            AddrEntry::Range(a, b) => (a.into(), b.into()),
        }
    }
}

impl FromStr for AddrEntry {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not an IPv4 address, CIDR (198.18.1.0/28) or range (198.18.1.10-198.18.1.20)");
        if let Some((a, b)) = s.split_once('-') {
            let (a, b): (Ipv4Addr, Ipv4Addr) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
            if a > b {
                return Err(format!("range {s:?} ends before it starts"));
            }
            return Ok(AddrEntry::Range(a, b));
        }
        if s.contains('/') {
            let net: Ipv4Net = s.parse().map_err(|_| bad())?;
            if net.trunc() != net {
                return Err(format!("{s:?} has host bits set; did you mean {}?", net.trunc()));
            }
            return Ok(AddrEntry::Net(net));
        }
        s.parse().map(AddrEntry::One).map_err(|_| bad())
    }
}

impl<'de> Deserialize<'de> for AddrEntry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(de::Error::custom)
    }
}

// ---- parsing and validation --------------------------------------------------

/// Reads and validates `path`.
pub fn load(path: &Path) -> Result<World, ConfigError> {
    let text =
        std::fs::read_to_string(path).map_err(|e| ConfigError { path: String::new(), line: None, message: format!("cannot read {}: {e}", path.display()) })?;
    parse(&text)
}

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
    validate(file).map_err(|(path, message)| ConfigError { line: locate::line_of(text, &path), path, message })
}

/// serde_yaml puts " at line L column C" in its messages; we report the line ourselves.
fn strip_location(msg: &str) -> String {
    match msg.find(" at line ") {
        Some(i) => msg[..i].to_owned(),
        None => msg.to_owned(),
    }
}

/// (field path, message) of a rejected value.
pub type Invalid = (String, String);

fn invalid<T>(path: impl Into<String>, message: impl Into<String>) -> Result<T, Invalid> {
    Err((path.into(), message.into()))
}

fn validate(f: File) -> Result<World, Invalid> {
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
        if let Some(j) = addrs.insert(n.address, i) {
            return invalid(format!("{p}.address"), format!("{} is already the address of nodes[{j}]", n.address));
        }
        nodes.push(Node { name: n.name, addr: n.address, mac: n.mac.map(|m| m.0), labels: n.labels, taints: Vec::new() });
    }
    nodes.sort_by(|a, b| a.name.cmp(&b.name));

    let mut pools: Vec<Pool> = Vec::new();
    let mut owner_of: BTreeMap<Ipv4Addr, usize> = BTreeMap::new();
    let mut pool_names = BTreeMap::new();
    for (i, fp) in f.pools.into_iter().enumerate() {
        let p = format!("pools[{i}]");
        if let Some(j) = pool_names.insert(fp.name.clone(), i) {
            return invalid(format!("{p}.name"), format!("pool {:?} is already defined at pools[{j}]", fp.name));
        }
        let set = pool_addresses(&p, &fp.addresses, &fp.excluded_ips)?;
        for a in &set {
            if let Some(j) = owner_of.insert(*a, i) {
                return invalid(format!("{p}.addresses"), format!("{a} is also in pools[{j}] ({:?}); pools must not overlap", pools[j].name));
            }
        }
        if owner_of.len() > MAX_POOL_ADDRESSES {
            return invalid(format!("{p}.addresses"), format!("all pools together exceed {MAX_POOL_ADDRESSES} addresses"));
        }
        let garp = fp.gratuitous_arp.map(|g| g.check(&format!("{p}.gratuitousArp"))).transpose()?;
        pools.push(Pool {
            name: fp.name,
            addresses: set.into_iter().collect(),
            node_selector: fp.node_selector,
            tolerations: Vec::new(),
            announce: fp.announce,
            garp,
        });
    }

    let mut services = Vec::new();
    let mut taken: BTreeMap<(Ipv4Addr, u16, Protocol), usize> = BTreeMap::new();
    let mut svc_names = BTreeMap::new();
    for (i, fs) in f.services.into_iter().enumerate() {
        let p = format!("services[{i}]");
        if let Some(j) = svc_names.insert(fs.name.clone(), i) {
            return invalid(format!("{p}.name"), format!("service {:?} is already defined at services[{j}]", fs.name));
        }
        let Some(&pool) = owner_of.get(&fs.vip) else {
            return invalid(format!("{p}.vip"), format!("{} is in no pool; add it to a pool's addresses", fs.vip));
        };
        if fs.ports.is_empty() {
            return invalid(format!("{p}.ports"), "at least one port is needed");
        }
        for (k, &port) in fs.ports.iter().enumerate() {
            if port == 0 {
                return invalid(format!("{p}.ports[{k}]"), "port 0 is not a service port");
            }
            if let Some(j) = taken.insert((fs.vip, port, fs.protocol), i) {
                return invalid(format!("{p}.ports[{k}]"), format!("{}:{port}/{:?} is already served by services[{j}]", fs.vip, fs.protocol).to_lowercase());
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
            vip: fs.vip,
            ports: fs.ports,
            protocol: fs.protocol,
            table_size: fs.table_size,
            backend_selector,
            backend_nodes: None,
            health,
        });
    }

    let a = f.announce;
    if a.hold_time < Duration::from_millis(100) {
        return invalid("announce.holdTime", "must be at least 100ms (the agent refreshes held VIPs three times per hold time)");
    }
    let garp = gratuitous_arp(
        "announce",
        ["garpCount", "garpInterval", "garpRefresh"],
        Garp { count: a.garp_count, interval: a.garp_interval, refresh: a.garp_refresh },
    )?;
    let announce = Announce { hold_time: a.hold_time, garp };
    let fo = f.failover;
    if fo.heartbeat_port == 0 {
        return invalid("failover.heartbeatPort", "port 0 cannot be bound by every agent alike");
    }
    if fo.heartbeat_interval < Duration::from_millis(5) {
        return invalid("failover.heartbeatInterval", "must be at least 5ms");
    }
    if fo.dead_after < fo.heartbeat_interval * 3 {
        return invalid(
            "failover.deadAfter",
            format!("must be at least 3 heartbeat intervals ({:?}), or one lost datagram makes a node look dead", fo.heartbeat_interval * 3),
        );
    }
    let fence = a.hold_time + a.hold_time / 3;
    if fo.dead_after < fence {
        return invalid(
            "failover.deadAfter",
            format!("must be at least announce.holdTime × 4/3 ({fence:?}): a wedged owner must have stopped answering ARP before a peer takes its VIPs"),
        );
    }
    let failover = Failover { heartbeat_port: fo.heartbeat_port, heartbeat_interval: fo.heartbeat_interval, dead_after: fo.dead_after };
    Ok(World { nodes, pools, services, announce, failover, maglev_seed: f.maglev_seed })
}

/// Validates a health check spec (`p` is its field path) into the model.
pub fn health_check(p: &str, h: HealthCheckSpec, first_port: u16) -> Result<HealthCheck, Invalid> {
    let port = h.port.unwrap_or(first_port);
    if port == 0 {
        return invalid(format!("{p}.port"), "port 0 cannot be probed");
    }
    let probe = match (h.kind, h.path) {
        (ProbeKind::Tcp, Some(_)) => return invalid(format!("{p}.path"), "a path only applies to type: http"),
        (ProbeKind::Tcp, None) => Probe::Tcp { port },
        (ProbeKind::Http, path) => {
            let path = path.unwrap_or_else(|| "/".into());
            if !path.starts_with('/') || path.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return invalid(format!("{p}.path"), format!("{path:?} is not an absolute URL path"));
            }
            Probe::Http { port, path }
        }
    };
    if h.interval < Duration::from_millis(10) {
        return invalid(format!("{p}.interval"), "must be at least 10ms");
    }
    if h.timeout.is_zero() || h.timeout > h.interval {
        return invalid(format!("{p}.timeout"), format!("must be more than zero and at most the interval ({:?})", h.interval));
    }
    if h.rise == 0 {
        return invalid(format!("{p}.rise"), "must be at least 1");
    }
    if h.fall == 0 {
        return invalid(format!("{p}.fall"), "must be at least 1");
    }
    Ok(HealthCheck { probe, interval: h.interval, timeout: h.timeout, rise: h.rise, fall: h.fall })
}

/// A pool's addresses: every entry expanded, the exclusions removed (each must be
/// in the pool), at most MAX_POOL_ADDRESSES. Errors name `{p}.addresses[k]` or
/// `{p}.excludedIPs[k]`. Shared by the file source and the VipPool resource.
pub fn pool_addresses(p: &str, addresses: &[AddrEntry], excluded: &[Ipv4Addr]) -> Result<BTreeSet<Ipv4Addr>, Invalid> {
    let mut set = BTreeSet::new();
    for (k, e) in addresses.iter().enumerate() {
        let (lo, hi) = e.bounds();
        if (hi - lo) as usize + set.len() >= MAX_POOL_ADDRESSES {
            return invalid(format!("{p}.addresses[{k}]"), format!("the pool would exceed {MAX_POOL_ADDRESSES} addresses"));
        }
        set.extend((lo..=hi).map(Ipv4Addr::from));
    }
    for (k, x) in excluded.iter().enumerate() {
        if !set.remove(x) {
            return invalid(format!("{p}.excludedIPs[{k}]"), format!("{x} is not in this pool's addresses"));
        }
    }
    if set.is_empty() {
        return invalid(format!("{p}.addresses"), "the pool has no address left after exclusions");
    }
    Ok(set)
}

/// Parses a pool's address and exclusion strings (as a VipPool carries them) and
/// expands them; errors name `{p}.addresses[k]` / `{p}.excludedIPs[k]`.
pub fn pool_addresses_from_strings(p: &str, addresses: &[String], excluded: &[String]) -> Result<BTreeSet<Ipv4Addr>, Invalid> {
    let entries =
        addresses.iter().enumerate().map(|(k, a)| a.parse::<AddrEntry>().map_err(|m| (format!("{p}.addresses[{k}]"), m))).collect::<Result<Vec<_>, _>>()?;
    let excluded = excluded
        .iter()
        .enumerate()
        .map(|(k, a)| a.parse::<Ipv4Addr>().map_err(|_| (format!("{p}.excludedIPs[{k}]"), format!("{a:?} is not an IPv4 address"))))
        .collect::<Result<Vec<_>, _>>()?;
    pool_addresses(p, &entries, &excluded)
}

/// Pools whose selector matches no node: nobody will answer for their VIPs.
/// Not an error (labels may come later), but worth a warning.
pub fn warnings(w: &World) -> Vec<String> {
    w.pools.iter().filter(|p| w.eligible(p).is_empty()).map(|p| format!("pool {:?}: nodeSelector matches no node; its VIPs are not answered", p.name)).collect()
}

#[cfg(test)]
mod tests;
