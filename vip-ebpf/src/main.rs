//! vip XDP program: answers ARP for the VIPs this node holds and spreads VIP
//! traffic over backend nodes with Maglev rings (see DESIGN.md, "Data path").
#![no_std]
#![no_main]

mod arp;
mod lb4;
mod maps;
mod parse;
mod stats;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use parse::{L3, Verdict};
use vip_common::Reason;

#[xdp]
pub fn vip_xdp(ctx: XdpContext) -> u32 {
    let (action, reason) = match try_vip_xdp(&ctx) {
        Ok(v) => v,
        Err(()) => (xdp_action::XDP_DROP, Reason::DropMalformed),
    };
    stats::count_reason(reason, ctx.data_end() - ctx.data());
    action
}

/// Benchmark reference: the cheapest possible XDP program. `cargo xtask bench`
/// quotes every path as a ratio to it; the agent never attaches it.
#[xdp]
pub fn xdp_baseline_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Benchmark reference for the miss path: the frame's 5-tuple looked up in the
/// flow table and, when absent, inserted; nothing else. Any design that records
/// each new flow in a table of this size pays at least this (BENCHMARKS.md).
/// The agent never attaches it.
#[xdp]
pub fn xdp_floor_flow_insert(ctx: XdpContext) -> u32 {
    lb4::lb4_floor_flow_insert(&ctx).unwrap_or(xdp_action::XDP_ABORTED)
}

/// Transmits the frame it is run on out of the interface the run names (XDP_TX).
/// The agent sends gratuitous ARP through it with BPF_PROG_RUN in live-frames
/// mode, so it needs no packet socket (no CAP_NET_RAW). Never attached.
#[xdp]
pub fn vip_xmit(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_TX
}

#[inline(always)]
fn try_vip_xdp(ctx: &XdpContext) -> Result<Verdict, ()> {
    let ifindex = ctx.ingress_ifindex() as u32;
    match parse::l3(ctx)? {
        L3::Arp(off) => arp::arp_handle(ctx, ifindex, off),
        L3::Ipv4(off) => lb4::lb4_handle(ctx, ifindex, off),
        L3::Other => Ok((xdp_action::XDP_PASS, Reason::PassedOther)),
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
