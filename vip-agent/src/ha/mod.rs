//! High-availability building blocks, each usable on its own:
//! `ownership` (which live node holds each VIP), `heartbeat` (which agents are
//! alive, over UDP, without the API server), `garp` (gratuitous ARP and
//! unsolicited neighbour advertisements on takeover), `groups` (the
//! solicited-node multicast groups of held IPv6 VIPs) and `loopback` (the VIPs of
//! `announce: lo` pools on the holder's `lo`); `arpcheck` (peers asking who
//! answers ARP for the VIPs others hold); `HeldVip` (a held VIP as its status
//! shows it).
pub mod arpcheck;
pub mod auth;
pub mod garp;
pub mod groups;
pub mod heartbeat;
mod held;
pub mod loopback;
pub mod ownership;

pub use held::HeldVip;
