//! Filling a node's flow table (`lb_flows`) to real scale without sending a
//! million packets: entries written from user space, as the data path would
//! write them on second packets.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::Path,
};

use anyhow::{Context as _, Result};
use vip_agent::dataplane::Dataplane;
use vip_common::{Lb4FlowKey, Lb6FlowKey, PROTO_TCP};

/// `n` distinct TCP flows from 198.19.0.0/16 to `vips` (round robin) on `dport`,
/// each with its backend id from `backends` (round robin).
pub fn synthetic(n: usize, vips: &[Ipv4Addr], dport: u16, backends: &[u32]) -> Vec<(Lb4FlowKey, u32)> {
    (0..n)
        .map(|i| {
            let key = Lb4FlowKey {
                src: Ipv4Addr::new(198, 19, (i >> 16) as u8, (i >> 8) as u8).octets(),
                dst: vips[i % vips.len()].octets(),
                sport: ((i & 0xff) as u16 + 1024).to_be_bytes(),
                dport: dport.to_be_bytes(),
                proto: PROTO_TCP,
                _pad: [0; 3],
            };
            (key, backends[i % backends.len()])
        })
        .collect()
}

/// [`synthetic`] for IPv6: `n` distinct TCP flows from 2001:2:ffff::/64 to `vips`.
pub fn synthetic6(n: usize, vips: &[Ipv6Addr], dport: u16, backends: &[u32]) -> Vec<(Lb6FlowKey, u32)> {
    (0..n)
        .map(|i| {
            let key = Lb6FlowKey {
                src: Ipv6Addr::new(0x2001, 2, 0xffff, 0, 0, 0, (i >> 16) as u16, (i >> 8) as u16).octets(),
                dst: vips[i % vips.len()].octets(),
                sport: ((i & 0xff) as u16 + 1024).to_be_bytes(),
                dport: dport.to_be_bytes(),
                proto: PROTO_TCP,
                _pad: [0; 3],
            };
            (key, backends[i % backends.len()])
        })
        .collect()
}

/// Pins `flows` in the flow table pinned under `pins` (their services must be
/// programmed there). Returns the flows in the table after: a set-associative
/// table keeps about 80% of as many random flows as it has entries (a set
/// receives four on average, and keeps at most four).
pub fn fill(pins: &Path, flows: &[(Lb4FlowKey, u32)]) -> Result<usize> {
    let mut dp = Dataplane::open(pins)?;
    dp.insert_flows(flows).context("filling lb_flows")?;
    Ok(dp.flow_count())
}

/// [`fill`] with IPv4 and IPv6 flows (one table for both families).
pub fn fill_both(pins: &Path, flows: &[(Lb4FlowKey, u32)], flows6: &[(Lb6FlowKey, u32)]) -> Result<usize> {
    let mut dp = Dataplane::open(pins)?;
    dp.insert_flows(flows).context("filling lb_flows")?;
    dp.insert_flows6(flows6).context("filling lb_flows with IPv6 flows")?;
    Ok(dp.flow_count())
}
