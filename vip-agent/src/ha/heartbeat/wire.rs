//! The datagram: the heartbeat's wire format, and what a receiver takes (from
//! whom, signed with which key, carrying which name).
use std::{
    collections::HashMap,
    net::SocketAddr,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

use crate::ha::{arpcheck, auth};

/// Wire format, version 1. `sent_ms` (sender's wall clock, Unix ms) is informational
/// (logs, skew/latency metrics): clocks are not assumed to agree, so liveness uses
/// only the receiver's monotonic clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub v: u8,
    pub node: String,
    pub incarnation: u64,
    pub seq: u64,
    pub sent_ms: u64,
    /// Sent by an agent that is stopping (SIGTERM: a rolling update, a restart):
    /// take my VIPs now, but keep this node in the rings for this long, since its
    /// data path and kube-proxy keep serving the connections they carry while its
    /// next agent starts. Health checks still take it out if the node itself goes.
    /// Absent (0) in every other heartbeat; agents of before ignore it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub leaving_ms: u64,
    /// ARP self-check findings for VIPs the receiver holds (`ha::arpcheck`),
    /// in the heartbeat to that peer only; absent when there are none. Agents of
    /// before ignore the field (unknown fields are skipped when decoding).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub arp: Vec<arpcheck::Finding>,
    /// The sender's cluster-wide settings (`model::cluster_settings`), in every
    /// [`SETTINGS_EVERY`]th heartbeat (the first among them), absent in the
    /// others; agents of before ignore it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub settings: String,
}

/// One heartbeat in this many carries the sender's settings: a second's worth at
/// the default interval, so that they cost little beside the heartbeats.
pub const SETTINGS_EVERY: u64 = 20;

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Heartbeat {
    pub const VERSION: u8 = 1;

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a struct of strings and integers serializes")
    }

    /// `None` for anything that is not a version-1 heartbeat.
    pub fn decode(b: &[u8]) -> Option<Self> {
        serde_json::from_slice::<Self>(b).ok().filter(|h| h.v == Self::VERSION)
    }
}

/// This agent start's incarnation: the wall clock in nanoseconds, so that a
/// restarted agent's incarnation is above its last one and a replayed datagram of
/// an earlier run is recognised as old. (A node whose clock went back across a
/// restart is taken for a replay by its peers until its clock passes its last
/// start; its log and `vip_heartbeats_rejected_total{reason="stale"}` on the
/// peers say so.)
pub fn new_incarnation() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
}

pub(super) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Why a received datagram changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rejected {
    /// From an address that is no configured peer's.
    UnknownSender,
    /// Not a heartbeat (or unsigned where keys are set).
    Malformed,
    /// Signed with a key we do not have.
    UnknownKey,
    /// A bad tag: forged or altered.
    BadTag,
    /// A name that is not the one the model gives the sender's address.
    WrongName,
    /// An older incarnation or a sequence number already seen: a replay.
    Stale,
}

impl Rejected {
    pub fn name(self) -> &'static str {
        match self {
            Rejected::UnknownSender => "unknown_sender",
            Rejected::Malformed => "malformed",
            Rejected::UnknownKey => "unknown_key",
            Rejected::BadTag => "bad_tag",
            Rejected::WrongName => "wrong_name",
            Rejected::Stale => "stale",
        }
    }
}

/// The heartbeat in a datagram from `from`, if it is one we take: from a known
/// peer's address, signed with one of our keys (when we have keys), carrying
/// the name the model gives that address.
pub(super) fn accept(datagram: &[u8], from: SocketAddr, known: &HashMap<SocketAddr, String>, keys: Option<&auth::Keys>) -> Result<Heartbeat, Rejected> {
    let name = known.get(&plain(from)).ok_or(Rejected::UnknownSender)?;
    let payload = match keys {
        Some(k) => k.open(datagram).map_err(|r| match r {
            auth::Reject::Malformed => Rejected::Malformed,
            auth::Reject::UnknownKey => Rejected::UnknownKey,
            auth::Reject::BadTag => Rejected::BadTag,
        })?,
        None => datagram,
    };
    let hb = Heartbeat::decode(payload).ok_or(Rejected::Malformed)?;
    if hb.node != *name {
        return Err(Rejected::WrongName);
    }
    Ok(hb)
}

/// An address and port alone: an IPv6 sender's flow label and scope id (set by the
/// kernel or not) do not make it another peer.
pub(super) fn plain(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip(), a.port())
}
