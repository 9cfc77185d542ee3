//! What both sources share, below them: the specs users write in the file and in a
//! VipPool (health check, gratuitous ARP, address entries, MACs), their checks into
//! the model, and the field error both report.
use std::{fmt, net::IpAddr, str::FromStr, time::Duration};

use ipnet::IpNet;
use schemars::JsonSchema;
use serde::{de, Deserialize, Deserializer, Serialize};

use crate::{
    addrs::{AddrSet, Family},
    model::{AnnounceMode, Distribution, Garp, HealthCheck, Probe},
};

/// Largest number of addresses all pools may hold together (the held-VIP map's size).
pub const MAX_POOL_ADDRESSES: usize = vip_common::MAX_HELD as usize;

// The bounds of the numbers users write, each defined once: the checks below use
// them, and so does the VipPool CRD's schema (its `minimum`/`maximum`), so that the
// API server refuses at apply time what the agent would refuse.

/// Frames a takeover's gratuitous ARP sends: fewest and most.
pub const GARP_COUNT_MIN: u32 = 1;
pub const GARP_COUNT_MAX: u32 = 100;
/// Fewest consecutive results a health check's `rise` and `fall` count.
pub const RISE_FALL_MIN: u32 = 1;
/// Lowest port a health check probes (port 0 cannot be connected to).
pub const PROBE_PORT_MIN: u16 = 1;
/// An 802.1Q VLAN id a pool may live on: 0 is "priority tagged" (the untagged
/// network), 4095 is reserved.
pub const VLAN_MIN: u16 = 1;
pub const VLAN_MAX: u16 = 4094;

/// A rejected value: its field path (`spec.addresses[2]`, `services[0].ports[1]`)
/// and why. The file source adds the line; a VipPool shows it in its `Ready`
/// condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl FieldError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { path: path.into(), message: message.into() }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl std::error::Error for FieldError {}

pub(crate) fn invalid<T>(path: impl Into<String>, message: impl Into<String>) -> Result<T, FieldError> {
    Err(FieldError::new(path, message))
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
    #[schemars(range(min = PROBE_PORT_MIN))]
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
    #[schemars(range(min = RISE_FALL_MIN))]
    pub rise: u32,
    /// Consecutive failures that take it out of every ring.
    #[serde(default = "default_fall")]
    #[schemars(range(min = RISE_FALL_MIN))]
    pub fall: u32,
}

/// A pool's gratuitous ARP as written by users: in the file and in a VipPool's spec.
#[derive(Deserialize, Serialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GratuitousArpSpec {
    /// Frames sent on takeover (1 to 100).
    #[serde(default = "default_garp_count")]
    #[schemars(range(min = GARP_COUNT_MIN, max = GARP_COUNT_MAX))]
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
pub fn gratuitous_arp(p: &str, names: [&str; 3], g: Garp) -> Result<Garp, FieldError> {
    if !(GARP_COUNT_MIN..=GARP_COUNT_MAX).contains(&g.count) {
        return invalid(
            format!("{p}.{}", names[0]),
            format!("must be from {GARP_COUNT_MIN} to {GARP_COUNT_MAX} (a takeover nobody hears about moves no traffic)"),
        );
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
    pub fn check(&self, p: &str) -> Result<Garp, FieldError> {
        gratuitous_arp(p, ["count", "interval", "refresh"], Garp { count: self.count, interval: self.interval, refresh: self.refresh })
    }
}

pub(crate) fn default_interval() -> Duration {
    Duration::from_secs(1)
}
pub(crate) fn default_timeout() -> Duration {
    Duration::from_millis(500)
}
pub(crate) fn default_rise() -> u32 {
    2
}
pub(crate) fn default_fall() -> u32 {
    3
}
pub(crate) fn default_garp_count() -> u32 {
    Garp::default().count
}
pub(crate) fn default_garp_interval() -> Duration {
    Garp::default().interval
}
pub(crate) fn default_garp_refresh() -> Duration {
    Garp::default().refresh
}

/// A MAC address as users write it and as vip prints it: `aa:bb:cc:dd:ee:ff`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = self.0;
        write!(f, "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", m[0], m[1], m[2], m[3], m[4], m[5])
    }
}

impl<'de> Deserialize<'de> for Mac {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let bytes: Vec<u8> = s.split(':').filter_map(|p| (p.len() == 2).then(|| u8::from_str_radix(p, 16).ok()).flatten()).collect();
        let mac: [u8; 6] =
            bytes.try_into().map_err(|_| de::Error::custom(format!("{s:?} is not a MAC address (expected six hex pairs, aa:bb:cc:dd:ee:ff)")))?;
        Ok(Mac(mac))
    }
}

/// One `addresses` entry: an address, a CIDR, or an inclusive `first-last` range,
/// IPv4 or IPv6.
#[derive(Clone, Copy, Debug)]
pub enum AddrEntry {
    One(IpAddr),
    Net(IpNet),
    Range(IpAddr, IpAddr),
}

impl AddrEntry {
    /// The first and the last address.
    pub fn bounds(self) -> (IpAddr, IpAddr) {
        match self {
            AddrEntry::One(a) => (a, a),
            AddrEntry::Net(n) => (n.network(), n.broadcast()),
            AddrEntry::Range(a, b) => (a, b),
        }
    }

    pub fn family(self) -> Family {
        Family::of(self.bounds().0)
    }
}

impl FromStr for AddrEntry {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("{s:?} is not an IPv4 or IPv6 address, CIDR (198.18.1.0/28, 2001:2::/64) or range (198.18.1.10-198.18.1.20, 2001:2::10-2001:2::20)");
        if let Some((a, b)) = s.split_once('-') {
            let (a, b): (IpAddr, IpAddr) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
            if a.is_ipv4() != b.is_ipv4() {
                return Err(format!("range {s:?} mixes an IPv4 and an IPv6 address"));
            }
            if a > b {
                return Err(format!("range {s:?} ends before it starts"));
            }
            return Ok(AddrEntry::Range(a, b));
        }
        if s.contains('/') {
            let net: IpNet = s.parse().map_err(|_| bad())?;
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

/// Validates a health check spec (`p` is its field path) into the model.
pub fn health_check(p: &str, h: HealthCheckSpec, first_port: u16) -> Result<HealthCheck, FieldError> {
    let port = h.port.unwrap_or(first_port);
    if port < PROBE_PORT_MIN {
        return invalid(format!("{p}.port"), format!("port {port} cannot be probed"));
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
    if h.rise < RISE_FALL_MIN {
        return invalid(format!("{p}.rise"), format!("must be at least {RISE_FALL_MIN}"));
    }
    if h.fall < RISE_FALL_MIN {
        return invalid(format!("{p}.fall"), format!("must be at least {RISE_FALL_MIN}"));
    }
    Ok(HealthCheck { probe, interval: h.interval, timeout: h.timeout, rise: h.rise, fall: h.fall })
}

/// A pool's addresses: every entry, the exclusions removed (each must be in the
/// pool), at most MAX_POOL_ADDRESSES of IPv4 (the data path holds IPv4 VIPs; IPv6
/// ranges are kept as ranges, whatever their size). Errors name `{p}.addresses[k]`
/// or `{p}.excludedIPs[k]`. Shared by the file source and the VipPool resource.
pub fn pool_addresses(p: &str, addresses: &[AddrEntry], excluded: &[AddrEntry]) -> Result<AddrSet, FieldError> {
    let mut set = AddrSet::default();
    for (k, e) in addresses.iter().enumerate() {
        let (lo, hi) = e.bounds();
        set.insert_range(lo, hi);
        if set.len_of(Family::V4) > MAX_POOL_ADDRESSES as u128 {
            return invalid(format!("{p}.addresses[{k}]"), format!("the pool would exceed {MAX_POOL_ADDRESSES} IPv4 addresses"));
        }
    }
    for (k, x) in excluded.iter().enumerate() {
        let (lo, hi) = x.bounds();
        if !set.remove_range(lo, hi) {
            let what = if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") };
            return invalid(format!("{p}.excludedIPs[{k}]"), format!("{what} is not in this pool's addresses"));
        }
    }
    // The first address of an IPv6 prefix is its subnet-router anycast address
    // (RFC 4291 2.6.1), which routers of the link answer: never a VIP, whatever
    // the other entries say. A /127 or /128 has none (RFC 6164).
    for e in addresses {
        if let AddrEntry::Net(IpNet::V6(n)) = e {
            if n.prefix_len() < 127 {
                set.remove(IpAddr::V6(n.network()));
            }
        }
    }
    if set.is_empty() {
        return invalid(format!("{p}.addresses"), "the pool has no address left after exclusions and subnet-router anycast (IPv6) addresses");
    }
    Ok(set)
}

/// Longest interface name Linux takes: IFNAMSIZ (16) less the terminating NUL.
pub const IFNAME_MAX: usize = 15;

/// A pool's `distribution` (`p` its field path) against its `announce`: every
/// node holding a VIP is for routers to spread over (ECMP); on one L2 segment
/// several nodes answering ARP for one address would fight over the clients'
/// neighbour entries.
pub fn distribution(p: &str, d: Distribution, announce: AnnounceMode) -> Result<(), FieldError> {
    match (d, announce) {
        (Distribution::All, AnnounceMode::Arp) => invalid(
            p.to_owned(),
            "`all` needs `announce: lo`: under `announce: arp` one node answers for each VIP (several would take turns in the clients' neighbour tables)",
        ),
        _ => Ok(()),
    }
}

/// A pool's `vlan`: an 802.1Q VLAN id a pool may live on ([`VLAN_MIN`] to [`VLAN_MAX`]).
pub fn vlan_id(p: &str, vlan: Option<u16>) -> Result<(), FieldError> {
    match vlan {
        Some(v) if !(VLAN_MIN..=VLAN_MAX).contains(&v) => invalid(p.to_owned(), format!("{v} is not a VLAN id: {VLAN_MIN} to {VLAN_MAX}")),
        _ => Ok(()),
    }
}

/// Why `a` cannot be a node's address (heartbeats are sent to and from it, health
/// checks and forwarding reach the node there), if it cannot: a link-local IPv6
/// address needs an interface to mean anything, and no socket reaches a node at an
/// unspecified, multicast or broadcast one.
pub fn node_address_problem(a: IpAddr) -> Option<&'static str> {
    match a {
        IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80 => {
            Some("is link-local (fe80::/10), which means nothing without an interface: give the node's global or unique local address")
        }
        IpAddr::V4(v) if v.is_broadcast() => Some("is not a node's address"),
        _ if a.is_unspecified() || a.is_multicast() => Some("is not a node's address"),
        _ => None,
    }
}

/// Checks a pool's interface names (`p` is the list's field path, errors name
/// `{p}[k]`) by the kernel's own rule for a device name (`dev_valid_name`): 1 to 15
/// bytes, no '/', ':' or whitespace, not "." or "..". A name twice is refused too.
/// ':' is refused because `eth0:1` is an address label, not an interface.
pub fn interface_names(p: &str, names: &[String]) -> Result<(), FieldError> {
    for (k, name) in names.iter().enumerate() {
        let at = || format!("{p}[{k}]");
        if name.is_empty() || name.len() > IFNAME_MAX {
            return invalid(at(), format!("{name:?} is not an interface name: 1 to {IFNAME_MAX} bytes"));
        }
        if name == "." || name == ".." {
            return invalid(at(), format!("{name:?} is not an interface name"));
        }
        if let Some(c) = name.chars().find(|&c| c == '/' || c == ':' || c.is_whitespace()) {
            return invalid(at(), format!("{name:?} is not an interface name: it contains {c:?}"));
        }
        if let Some(j) = names[..k].iter().position(|n| n == name) {
            return invalid(at(), format!("{name:?} is already listed at {p}[{j}]"));
        }
    }
    Ok(())
}

/// Parses a pool's address and exclusion strings (as a VipPool carries them) and
/// expands them; errors name `{p}.addresses[k]` / `{p}.excludedIPs[k]`.
pub fn pool_addresses_from_strings(p: &str, addresses: &[String], excluded: &[String]) -> Result<AddrSet, FieldError> {
    let parse = |field: &str, list: &[String]| {
        list.iter().enumerate().map(|(k, a)| a.parse::<AddrEntry>().map_err(|m| FieldError::new(format!("{p}.{field}[{k}]"), m))).collect::<Result<Vec<_>, _>>()
    };
    pool_addresses(p, &parse("addresses", addresses)?, &parse("excludedIPs", excluded)?)
}
