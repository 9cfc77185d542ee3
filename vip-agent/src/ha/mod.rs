//! High-availability building blocks, each usable on its own:
//! `ownership` (which live node holds each VIP), `heartbeat` (which agents are
//! alive, over UDP, without the API server) and `garp` (gratuitous ARP on takeover).
pub mod garp;
pub mod heartbeat;
pub mod ownership;
