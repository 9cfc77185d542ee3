//! High-availability building blocks, each usable on its own:
//! `ownership` (which live node holds each VIP), `heartbeat` (which agents are
//! alive, over UDP, without the API server), `garp` (gratuitous ARP and
//! unsolicited neighbour advertisements on takeover), `groups` (the
//! solicited-node multicast groups of held IPv6 VIPs) and `loopback` (the VIPs of
//! `announce: lo` pools on the holder's `lo`); `arpcheck` (peers asking who
//! answers ARP for the VIPs others hold).
pub mod arpcheck;
pub mod auth;
pub mod garp;
pub mod groups;
pub mod heartbeat;
pub mod loopback;
#[cfg(test)]
mod model_check;
pub mod ownership;
