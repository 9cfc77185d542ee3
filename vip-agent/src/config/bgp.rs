//! The config file's `bgp` section (the sessions of `announce: bgp` pools) and a
//! pool's `bgp` (what its routes carry).
use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use serde::Deserialize;

use crate::{
    bgp::{self, Attributes, Bfd, Peer, Session, Settings},
    model::Selector,
    spec::{invalid, FieldError},
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct FileBgp {
    /// This cluster's AS: every node speaks with it (FRR's one instance per node).
    #[serde(rename = "myASN")]
    my_asn: u32,
    /// Off by default, as in MetalLB: a router that helps graceful restart
    /// keeps a node's routes for minutes once its session times out, so a dead
    /// node without BFD would stay a next hop. The agent restarts without it
    /// (FRR outlives the agent); it spares only an FRR restart.
    #[serde(default)]
    graceful_restart: bool,
    #[serde(default)]
    bfd_profiles: Vec<FileBfd>,
    peers: Vec<FilePeer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FileBfd {
    name: String,
    #[serde(default = "default_bfd_interval", with = "humantime_serde")]
    receive_interval: Duration,
    #[serde(default = "default_bfd_interval", with = "humantime_serde")]
    transmit_interval: Duration,
    #[serde(default = "default_bfd_multiplier")]
    detect_multiplier: u8,
}

/// FRR's defaults.
fn default_bfd_interval() -> Duration {
    Duration::from_millis(300)
}
fn default_bfd_multiplier() -> u8 {
    3
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct FilePeer {
    address: IpAddr,
    asn: u32,
    #[serde(default)]
    port: Option<u16>,
    #[serde(default)]
    source_address: Option<IpAddr>,
    #[serde(default, with = "humantime_serde")]
    hold_time: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    keepalive_time: Option<Duration>,
    #[serde(default)]
    ebgp_multihop: bool,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    bfd_profile: Option<String>,
    #[serde(default)]
    node_selector: Selector,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct FilePoolBgp {
    #[serde(default)]
    communities: Vec<String>,
    #[serde(default)]
    large_communities: Vec<String>,
    #[serde(default)]
    local_pref: Option<u32>,
}

/// A pool's `bgp` (`p` its path).
pub(super) fn pool(p: &str, b: FilePoolBgp) -> Result<Attributes, FieldError> {
    let a = Attributes { communities: b.communities, large_communities: b.large_communities, local_pref: b.local_pref };
    bgp::check_attributes(&a).map_err(|(field, value, what)| FieldError::new(format!("{p}.{field}"), format!("{value:?} is not a {what}")))?;
    Ok(a)
}

/// The `bgp` section: checked as FRR would check one node that opens every
/// session (one AS, no peer twice, the timers, passwords and BFD profiles).
pub(super) fn settings(b: FileBgp) -> Result<Settings, FieldError> {
    let mut profiles: BTreeMap<String, Bfd> = BTreeMap::new();
    for (i, f) in b.bfd_profiles.into_iter().enumerate() {
        let bfd = Bfd { name: f.name, receive_interval: f.receive_interval, transmit_interval: f.transmit_interval, detect_multiplier: f.detect_multiplier };
        if profiles.insert(bfd.name.clone(), bfd.clone()).is_some() {
            return invalid(format!("bgp.bfdProfiles[{i}].name"), format!("profile {:?} is defined twice", bfd.name));
        }
    }
    if b.peers.is_empty() {
        return invalid("bgp.peers", "at least one peer is needed");
    }
    let mut sessions = Vec::new();
    for (i, f) in b.peers.into_iter().enumerate() {
        let bfd = match f.bfd_profile {
            Some(name) => Some(profiles.get(&name).cloned().ok_or_else(|| {
                let known: Vec<&str> = profiles.keys().map(String::as_str).collect();
                FieldError::new(format!("bgp.peers[{i}].bfdProfile"), format!("no profile {name:?} in bgp.bfdProfiles (there are: {known:?})"))
            })?),
            None => None,
        };
        let peer = Peer {
            port: f.port,
            source: f.source_address,
            hold_time: f.hold_time,
            keepalive_time: f.keepalive_time,
            ebgp_multihop: f.ebgp_multihop,
            password: f.password,
            bfd,
            ..Peer::new(f.address, f.asn, b.my_asn)
        };
        sessions.push(Session { peer, node_selector: f.node_selector });
    }
    let all = bgp::Speaker {
        router_id: std::net::Ipv4Addr::new(0, 0, 0, 1),
        peers: sessions.iter().map(|s| s.peer.clone()).collect(),
        retiring: Vec::new(),
        advertisements: Vec::new(),
        graceful_restart: b.graceful_restart,
    };
    bgp::validate(&all).map_err(|e| {
        // The speaker's field names, for the file: sourceAddress, bfdProfile.
        let m = e.to_string().replace(".bfd:", ".bfdProfile:").replace(".source:", ".sourceAddress:");
        match m.split_once(": ") {
            Some((path, why)) => FieldError::new(format!("bgp.{path}"), why.to_owned()),
            None => FieldError::new("bgp.peers", m),
        }
    })?;
    Ok(Settings { sessions, graceful_restart: b.graceful_restart })
}
