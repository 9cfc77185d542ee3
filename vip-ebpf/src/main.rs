//! vip XDP program: answers ARP and IPv6 neighbour solicitations for the VIPs
//! this node holds and spreads IPv4 and IPv6 VIP traffic over backend nodes with
//! Maglev rings (README, "The data path").
#![no_std]
#![no_main]

mod arp;
mod lb;
mod lb4;
mod lb6;
mod maps;
mod ndp;
mod parse;
mod proto;
mod stats;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use lb6::Lb6Route;
use maps::Scratch;
use network_types::arp::ArpHdr;
use parse::{Verdict, Vlan, L3};
use vip_common::Reason;

#[xdp]
pub fn vip_xdp(ctx: XdpContext) -> u32 {
    // What the paths need after a map lookup lives in this CPU's scratch, looked up
    // once here (see maps::Scratch); a frame's bytes to count go there too.
    let Some(s) = maps::scratch() else {
        return xdp_action::XDP_PASS;
    };
    let (action, reason) = match try_vip_xdp(&ctx, s) {
        Ok(v) => v,
        // Malformed frames are rare: their length from a helper.
        Err(()) => {
            unsafe { (*s).bytes = parse::frame_len(&ctx) as u32 };
            (xdp_action::XDP_DROP, Reason::DropMalformed)
        }
    };
    stats::count_verdict(s, reason);
    action
}

/// Benchmark reference: the cheapest possible XDP program. `cargo xtask bench`
/// quotes every path as a ratio to it; the agent never attaches it.
#[xdp]
pub fn xdp_baseline_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Transmits the frame it is run on out of the interface the run names (XDP_TX).
/// The agent sends gratuitous ARP through it with BPF_PROG_RUN in live-frames
/// mode, so it needs no packet socket (no CAP_NET_RAW). Never attached. A
/// header-only frame is the agent's probe of the kernel: dropped, never sent.
#[xdp]
pub fn vip_xmit(ctx: XdpContext) -> u32 {
    // A comparison, not a length: without CAP_PERFMON the verifier refuses
    // arithmetic between packet pointers.
    if ctx.data() + vip_common::XMIT_PROBE_LEN >= ctx.data_end() {
        return xdp_action::XDP_DROP;
    }
    xdp_action::XDP_TX
}

/// The verdict. The bytes to count for it go to the scratch `s`: the layer-2
/// header and the layer-3 length the headers give (IPv4 total length, 28 for
/// Ethernet/IPv4 ARP), so no Ethernet padding; the whole frame for anything else
/// (see `parse::frame_len`).
#[inline(always)]
fn try_vip_xdp(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    let (l3, vlan, asked) = parse::l3(ctx)?;
    unsafe { core::ptr::write_volatile(&raw mut (*s).asked, asked as u32) };
    let passed = |reason| {
        unsafe { (*s).bytes = parse::frame_len(ctx) as u32 };
        Ok((xdp_action::XDP_PASS, reason))
    };
    match (l3, vlan) {
        (_, Vlan::Foreign) => passed(Reason::PassedVlanOther),
        (L3::Other, _) => passed(Reason::PassedOther),
        (l3, Vlan::Untagged) => try_l3::<{ parse::ETH_LEN }>(ctx, s, l3, ctx.ingress_ifindex() as u32),
        (l3, Vlan::Id(0)) => try_l3::<{ parse::VLAN_ETH_LEN }>(ctx, s, l3, ctx.ingress_ifindex() as u32),
        // A VIP lives on one network: a VLAN's frames count as received on its
        // sub-interface, whose held VIPs alone they may reach.
        (l3, Vlan::Id(vid)) => match maps::lb_vlan_ifindex(s, ctx.ingress_ifindex() as u32, vid) {
            Some(ifindex) => try_l3::<{ parse::VLAN_ETH_LEN }>(ctx, s, l3, ifindex),
            None => passed(Reason::PassedVlanOther),
        },
    }
}

/// ARP, IPv4 or IPv6 behind an `L2`-byte layer-2 header, received on the
/// network of `ifindex` (an interface, or a VLAN's sub-interface).
#[inline(always)]
fn try_l3<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, l3: L3, ifindex: u32) -> Result<Verdict, ()> {
    if let L3::Arp = l3 {
        unsafe { (*s).bytes = (L2 + ArpHdr::LEN) as u32 };
        return Ok(parse::verdict_unpack(arp::arp_call::<L2>(ctx.ctx, s, ifindex)));
    }
    if let L3::Ipv6 = l3 {
        // The network read back from the scratch (lb6_route wrote it): kept in a
        // register, it would be spilled across the filter's lookup.
        return Ok(match lb6::lb6_route::<L2>(ctx, s, ifindex)? {
            Lb6Route::NotVip => (xdp_action::XDP_PASS, Reason::PassedNotVip),
            Lb6Route::Nd => parse::verdict_unpack(ndp::ndp_call::<L2>(ctx.ctx, s, unsafe { core::ptr::read_volatile(&(*s).ifindex) })),
            Lb6Route::IcmpError => parse::verdict_unpack(lb6::lb6_icmp_call::<L2>(ctx.ctx, s)),
            Lb6Route::Flow => lb6::lb6_flow::<L2>(ctx, s)?,
        });
    }
    lb4::lb4_handle::<L2>(ctx, s, ifindex)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
