//! BGP through FRR (`announce: bgp`): the sessions and advertisements one node
//! wants ([`speaker`], from the model's [`Settings`] and the VIPs the node
//! holds), and FRR's configuration for them ([`frr_config`]). The agent renders
//! the file and FRR's own `frr-reload.py` loads it, applying only the
//! difference, so that sessions that did not change are not reset
//! ([`frr`]); FRR's bgpd and bfdd, which outlive the agent, speak the
//! protocols. Why FRR: docs/development/dependencies.md.
use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use serde::Serialize;

use crate::model::{selects, AnnounceMode, Selector, World};

pub mod frr;

/// A BGP session of this node (MetalLB's BGPPeer, for one node).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Peer {
    pub address: IpAddr,
    pub asn: u32,
    /// This node's AS number: one for every session of a node (FRR's default
    /// instance has one AS).
    pub my_asn: u32,
    /// The peer's port, if not 179.
    pub port: Option<u16>,
    /// The address sessions come from (FRR's `update-source`).
    pub source: Option<IpAddr>,
    /// Hold time and keepalive (whole seconds: BGP's unit).
    pub hold_time: Option<Duration>,
    pub keepalive_time: Option<Duration>,
    pub ebgp_multihop: bool,
    /// The TCP MD5 password (never shown in status or `inspect`).
    #[serde(skip)]
    pub password: Option<String>,
    /// BFD on the session, with this profile.
    pub bfd: Option<Bfd>,
}

impl Peer {
    /// A session to `address` in AS `asn` from AS `my_asn`, every other setting
    /// at BGP's and FRR's defaults.
    pub fn new(address: IpAddr, asn: u32, my_asn: u32) -> Self {
        Self { address, asn, my_asn, port: None, source: None, hold_time: None, keepalive_time: None, ebgp_multihop: false, password: None, bfd: None }
    }
}

/// A BFD profile (MetalLB's BFDProfile): FRR's defaults are 300 ms and 3.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Bfd {
    pub name: String,
    pub receive_interval: Duration,
    pub transmit_interval: Duration,
    pub detect_multiplier: u8,
}

/// What a pool's routes carry (MetalLB's BGPAdvertisement).
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Attributes {
    /// Standard communities, `ASN:value`.
    pub communities: Vec<String>,
    /// Large communities, `ASN:value:value`.
    pub large_communities: Vec<String>,
    pub local_pref: Option<u32>,
}

/// Addresses this node announces (a pool's held VIPs) and what goes with them.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Advertisement {
    /// Host routes: /32 and /128.
    pub addresses: Vec<IpAddr>,
    pub attributes: Attributes,
}

/// A session and the nodes that open it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    pub peer: Peer,
    /// Nodes whose labels match (empty: every node).
    pub node_selector: Selector,
}

/// The cluster's BGP settings (the config file's `bgp`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    pub sessions: Vec<Session>,
    pub graceful_restart: bool,
}

/// The speaker of node `me`: its sessions, and one advertisement per
/// `announce: bgp` pool (in the model's order, so that the route maps keep their
/// names while VIPs come and go) with the pool's VIPs of `held`. None without
/// BGP settings or for a node not in the model.
pub fn speaker(world: &World, me: &str, held: &BTreeSet<IpAddr>) -> Option<Speaker> {
    let settings = world.bgp.as_ref()?;
    let node = world.nodes.iter().find(|n| n.name == me)?;
    let peers = settings.sessions.iter().filter(|s| selects(&s.node_selector, &node.labels)).map(|s| s.peer.clone()).collect();
    let advertisements = world
        .pools
        .iter()
        .filter(|p| p.announce == AnnounceMode::Bgp)
        .map(|p| Advertisement { addresses: p.addresses.iter().copied().filter(|a| held.contains(a)).collect(), attributes: p.bgp.clone() })
        .collect();
    Some(Speaker { router_id: router_id(node.addr, me), peers, retiring: Vec::new(), advertisements, graceful_restart: settings.graceful_restart })
}

/// A node's BGP identifier: its IPv4 address; an IPv6-only node's is drawn
/// from its name (FRR needs one, and it must differ between the nodes).
fn router_id(address: IpAddr, name: &str) -> Ipv4Addr {
    match address {
        IpAddr::V4(a) => a,
        IpAddr::V6(_) => {
            // FNV-1a: stable across releases (std's hasher is not).
            let h = name.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
            // Never 0.0.0.0, which BGP refuses.
            Ipv4Addr::from(h.max(1))
        }
    }
}

/// What one node's speaker is given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Speaker {
    /// The node's IPv4 address, its BGP identifier.
    pub router_id: std::net::Ipv4Addr,
    pub peers: Vec<Peer>,
    /// Sessions on their way out: kept, with nothing sent on them, so that
    /// their peers get the routes withdrawn before the session closes (a peer
    /// that helps graceful restart keeps the routes of a closed session as
    /// stale ones, for minutes).
    pub retiring: Vec<Peer>,
    pub advertisements: Vec<Advertisement>,
    /// Graceful restart on every session: the peers keep this node's routes while
    /// its speaker restarts.
    pub graceful_restart: bool,
}

impl Speaker {
    /// No sessions and nothing to announce: a node the model no longer gives
    /// BGP settings.
    pub fn silent() -> Self {
        Self { router_id: Ipv4Addr::UNSPECIFIED, peers: Vec::new(), retiring: Vec::new(), advertisements: Vec::new(), graceful_restart: false }
    }

    /// What FRR is given on the way from `self` (what it has) to `next`: `next`,
    /// with the sessions it drops that may still carry routes kept as
    /// [`Speaker::retiring`] (every session, if the AS changes: FRR's instance
    /// goes with it) until `done` says a session's wait is over. A session
    /// carries routes if `self` announced any, or if it is retiring already.
    pub fn step_towards(&self, next: Speaker, done: impl Fn(IpAddr) -> bool) -> Speaker {
        let announced = self.advertisements.iter().any(|a| !a.addresses.is_empty());
        let new_as = matches!((self.peers.first().or(self.retiring.first()), next.peers.first()), (Some(a), Some(b)) if a.my_asn != b.my_asn);
        let dropped = |p: &&Peer| new_as || !next.peers.iter().any(|q| q.address == p.address);
        let retiring: Vec<Peer> = self.peers.iter().filter(|_| announced).chain(&self.retiring).filter(dropped).filter(|p| !done(p.address)).cloned().collect();
        if retiring.is_empty() {
            next
        } else if new_as || next.peers.is_empty() {
            Speaker { peers: Vec::new(), retiring, ..self.clone() }
        } else {
            Speaker { retiring, ..next }
        }
    }
}

/// A [`Speaker`] FRR cannot be given, naming the field.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("peers[{index}].myASN: {got} differs from peers[0]'s {first}: a node speaks with one AS")]
    MixedAsn { index: usize, got: u32, first: u32 },
    #[error("peers[{index}].address: {address} is given twice")]
    DuplicatePeer { index: usize, address: IpAddr },
    #[error("peers[{index}].{field}: {message}")]
    Peer { index: usize, field: &'static str, message: String },
    #[error("advertisements[{index}].{field}: {value:?} is not a {what}")]
    Community { index: usize, field: &'static str, value: String, what: &'static str },
}

fn secs(d: Duration) -> u64 {
    d.as_secs()
}

/// Whether `s` is `a:b` (standard, each part 16 bits) or `a:b:c` (large, each
/// 32 bits).
fn community_ok(s: &str, parts: usize) -> bool {
    let p: Vec<&str> = s.split(':').collect();
    p.len() == parts && p.iter().all(|x| if parts == 2 { x.parse::<u16>().is_ok() } else { x.parse::<u32>().is_ok() })
}

/// Checks what FRR would refuse or misread, naming the field.
pub fn validate(s: &Speaker) -> Result<(), Error> {
    let all: Vec<&Peer> = s.peers.iter().chain(&s.retiring).collect();
    for (index, p) in all.iter().enumerate() {
        if p.my_asn != all[0].my_asn {
            return Err(Error::MixedAsn { index, got: p.my_asn, first: all[0].my_asn });
        }
        if all[..index].iter().any(|q| q.address == p.address) {
            return Err(Error::DuplicatePeer { index, address: p.address });
        }
        let bad = |field, message: &str| Err(Error::Peer { index, field, message: message.to_owned() });
        match (p.keepalive_time, p.hold_time) {
            (Some(_), None) | (None, Some(_)) => return bad("holdTime", "hold time and keepalive time go together"),
            (Some(k), Some(h)) if secs(h) != 0 && (secs(h) < 3 || secs(k) * 3 > secs(h)) => {
                return bad("holdTime", "must be 0 or at least 3 s and three keepalive times");
            }
            _ => {}
        }
        if p.password.as_deref().is_some_and(|w| w.is_empty() || w.len() > 80 || w.chars().any(|c| c.is_whitespace() || c.is_control())) {
            return bad("password", "1 to 80 characters, no white space");
        }
        if let Some(b) = &p.bfd {
            let ms = |d: Duration| d.as_millis();
            if !(10..=60_000).contains(&ms(b.receive_interval)) || !(10..=60_000).contains(&ms(b.transmit_interval)) {
                return bad("bfd", "intervals between 10 ms and 60 s");
            }
            if !(2..=255).contains(&b.detect_multiplier) {
                return bad("bfd", "detectMultiplier between 2 and 255");
            }
            if b.name.is_empty() || !b.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                return bad("bfd", "profile names are letters, digits, - and _");
            }
        }
    }
    for (index, a) in s.advertisements.iter().enumerate() {
        check_attributes(&a.attributes).map_err(|(field, value, what)| Error::Community { index, field, value, what })?;
    }
    Ok(())
}

/// A pool's communities that FRR would refuse: the field, the value and what it
/// should be.
pub fn check_attributes(a: &Attributes) -> Result<(), (&'static str, String, &'static str)> {
    if let Some(c) = a.communities.iter().find(|c| !community_ok(c, 2)) {
        return Err(("communities", c.clone(), "community (ASN:value, 16 bits each)"));
    }
    if let Some(c) = a.large_communities.iter().find(|c| !community_ok(c, 3)) {
        return Err(("largeCommunities", c.clone(), "large community (a:b:c, 32 bits each)"));
    }
    Ok(())
}

/// FRR's configuration (frr.conf) for `s`: bfdd's profiles, bgpd's sessions and
/// one `network` per advertised address, with its communities and local
/// preference through a route map of its own. Nothing is imported from the
/// peers; only the advertised host routes are sent. The same speaker always
/// renders the same text (peers and addresses in their given order), so that a
/// reload that finds no difference changes nothing.
pub fn frr_config(s: &Speaker) -> Result<String, Error> {
    validate(s)?;
    let mut c = String::from("frr defaults traditional\nhostname vip\nlog stdout informational\nservice integrated-vtysh-config\n!\n");
    let mut profiles: Vec<&Bfd> = Vec::new();
    let all: Vec<&Peer> = s.peers.iter().chain(&s.retiring).collect();
    for b in all.iter().filter_map(|p| p.bfd.as_ref()) {
        if !profiles.iter().any(|q| q.name == b.name) {
            profiles.push(b);
        }
    }
    if !profiles.is_empty() {
        c.push_str("bfd\n");
        for b in &profiles {
            let _ = write!(
                c,
                " profile {}\n  receive-interval {}\n  transmit-interval {}\n  detect-multiplier {}\n exit\n",
                b.name,
                b.receive_interval.as_millis(),
                b.transmit_interval.as_millis(),
                b.detect_multiplier
            );
        }
        c.push_str("exit\n!\n");
    }
    let Some(first) = all.first() else { return Ok(c) };
    let _ = write!(
        c,
        "router bgp {}\n bgp router-id {}\n no bgp ebgp-requires-policy\n no bgp default ipv4-unicast\n no bgp network import-check\n",
        first.my_asn, s.router_id
    );
    if s.graceful_restart {
        c.push_str(" bgp graceful-restart\n bgp graceful-restart preserve-fw-state\n");
    }
    for p in &all {
        let n = format!(" neighbor {}", p.address);
        let _ = writeln!(c, "{n} remote-as {}", p.asn);
        if let Some(port) = p.port {
            let _ = writeln!(c, "{n} port {port}");
        }
        if let Some(src) = p.source {
            let _ = writeln!(c, "{n} update-source {src}");
        }
        if let (Some(k), Some(h)) = (p.keepalive_time, p.hold_time) {
            let _ = writeln!(c, "{n} timers {} {}", secs(k), secs(h));
        }
        if p.ebgp_multihop {
            let _ = writeln!(c, "{n} ebgp-multihop");
        }
        if let Some(w) = &p.password {
            let _ = writeln!(c, "{n} password {w}");
        }
        if let Some(b) = &p.bfd {
            let _ = writeln!(c, "{n} bfd profile {}", b.name);
        }
    }
    for (family, v6) in [("ipv4", false), ("ipv6", true)] {
        let _ = writeln!(c, " !\n address-family {family} unicast");
        for (i, a) in s.advertisements.iter().enumerate() {
            for addr in a.addresses.iter().filter(|x| x.is_ipv6() == v6) {
                let _ = writeln!(c, "  network {addr}/{} route-map vip-adv-{i}", if v6 { 128 } else { 32 });
            }
        }
        // A session carries its own family (an IPv4 peer IPv4 routes), as MetalLB's FRR mode does.
        for p in all.iter().filter(|p| p.address.is_ipv6() == v6) {
            let _ = write!(c, "  neighbor {0} activate\n  neighbor {0} route-map vip-in in\n", p.address);
            if s.retiring.contains(*p) {
                let _ = writeln!(c, "  neighbor {} route-map vip-none out", p.address);
            }
        }
        c.push_str(" exit-address-family\n");
    }
    c.push_str("exit\n!\nroute-map vip-in deny 10\nexit\n!\n");
    if !s.retiring.is_empty() {
        c.push_str("route-map vip-none deny 10\nexit\n!\n");
    }
    for (i, a) in s.advertisements.iter().map(|a| &a.attributes).enumerate() {
        let _ = writeln!(c, "route-map vip-adv-{i} permit 10");
        if !a.communities.is_empty() {
            let _ = writeln!(c, " set community {}", a.communities.join(" "));
        }
        if !a.large_communities.is_empty() {
            let _ = writeln!(c, " set large-community {}", a.large_communities.join(" "));
        }
        if let Some(lp) = a.local_pref {
            let _ = writeln!(c, " set local-preference {lp}");
        }
        c.push_str("exit\n!\n");
    }
    Ok(c)
}

#[cfg(test)]
mod tests;
