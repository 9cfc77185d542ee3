//! Key and value layouts of the BPF maps, shared by the XDP program (`vip-ebpf`)
//! and the agent (`vip-agent`). Everything is `#[repr(C)]` with explicit padding so
//! both sides agree byte for byte; addresses and ports are stored in network byte
//! order exactly as they appear in packets, so the data path never converts them.
//!
//! By concern: `pins` (the pinned maps' names, the contract between releases),
//! `maps` (capacities, keys and values), `flows` (flow keys and the hashes both
//! sides compute), `reason` (why a frame got its verdict).
#![no_std]

mod flows;
mod maps;
mod pins;
#[cfg(feature = "user")]
mod pod;
mod reason;

pub use flows::*;
pub use maps::*;
pub use pins::*;
pub use reason::*;
