//! IPv6 load balancing, the twin of lb4.rs: per-CPU flow cache, else flow table,
//! else Maglev ring, then L2 direct server return (lb.rs). The extension headers
//! a flow may carry (hop-by-hop, routing, destination options, fragment) are
//! walked to find its ports.
use core::{
    ffi::c_void,
    mem::offset_of,
    ptr::{read_unaligned, write_unaligned, write_volatile},
};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::bpf_xdp_load_bytes,
    programs::XdpContext,
};
use network_types::ip::Ipv6Hdr;
use vip_common::*;

use crate::{
    lb::{lb_cache, lb_copy_words, lb_icmp_error, lb_miss, lb_not_vip, lb_ports_at, lb_service, lb_syn_at, lb_tables, Flows},
    maps::{held6_slot, lb6_first_packets, lb6_flow_cache, lb6_service_cache, lb6_services, lookup_at, ndp_handoff, ndp_held, Scratch},
    parse::{ptr_at, verdict_call, verdict_unpack, Verdict},
    proto::{ICMP6_DST_UNREACH, ICMP6_HDR_LEN, ICMP6_PACKET_TOO_BIG, IP6, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT, IPPROTO_HOPOPTS, IPPROTO_ICMPV6, IPPROTO_ROUTING},
};

/// Extension headers walked at most before the upper layer; more pass, counted.
const MAX_EXT_HEADERS: usize = 6;

/// Where the entry sends an IPv6 packet ([`lb6_route`]).
pub enum Lb6Route {
    /// For no service's address, and no ICMPv6 right behind its header: most
    /// of a node's IPv6 traffic, passed without a call.
    NotVip,
    /// ICMPv6 right behind the header, not an error about a flow: neighbour
    /// discovery (or a ping), for ndp::ndp_call, as ARP goes to arp_call.
    Nd,
    /// An ICMPv6 destination unreachable or packet too big: [`lb6_icmp_call`].
    IcmpError,
    /// For a service's address, as the VIP filter says: [`lb6_flow`].
    Flow,
}

/// Where the IPv6 packet behind an `L2`-byte layer-2 header goes, read once
/// from its header. The network's `ifindex` and, for all but ICMPv6, the bytes
/// to count go to the scratch `s`: only `ctx` and `s` live across the filter's
/// lookup.
#[inline(always)]
pub fn lb6_route<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, ifindex: u32) -> Result<Lb6Route, ()> {
    unsafe { write_volatile(&raw mut (*s).ifindex, ifindex) };
    let ip: *const Ipv6Hdr = ptr_at(ctx, L2)?;
    let (vcf0, next) = unsafe { ((*ip).vcf[0], (*ip).next_hdr) };
    if vcf0 >> 4 != 6 {
        return Err(());
    }
    if next == IPPROTO_ICMPV6 {
        return Ok(match ptr_at::<u8>(ctx, L2 + IP6) {
            Ok(t) if matches!(unsafe { *t }, ICMP6_DST_UNREACH | ICMP6_PACKET_TOO_BIG) => Lb6Route::IcmpError,
            _ => Lb6Route::Nd,
        });
    }
    lb6_count::<L2>(ip, s);
    let dst = unsafe { (ip as *const u8).add(24) as *const u64 };
    Ok(if lb_not_vip(unsafe { vip_filter_bit_word(fold6_words(read_unaligned(dst), read_unaligned(dst.add(1)))) })? {
        Lb6Route::NotVip
    } else {
        Lb6Route::Flow
    })
}

/// An ICMPv6 error ([`lb6_icmp`]), a function of its own as [`lb6_slow`].
#[inline(never)]
pub fn lb6_icmp_call<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    verdict_call!(ctx, s, lb6_icmp::<L2>)
}

/// An ICMPv6 destination unreachable or packet too big (its type checked; the
/// network in the scratch, [`lb6_route`]): about a flow of a service, it goes where the flow's
/// packets go (lb::lb_icmp_error), as lb4::lb4_icmp; else it is passed as other
/// ICMPv6 is (`passed_other`). Read at fixed offsets only: an inner packet with
/// extension headers (a fragment among them) passes.
#[inline(always)]
fn lb6_icmp<const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    const PASS: Verdict = (xdp_action::XDP_PASS, Reason::PassedOther);
    const INNER: usize = IP6 + ICMP6_HDR_LEN;
    lb6_count::<L2>(ptr_at(ctx, L2)?, s);
    let Ok(p) = ptr_at::<[u8; INNER + IP6 + 4]>(ctx, L2) else { return Ok(PASS) };
    let p = p as *const u8;
    unsafe {
        let inner = p.add(INNER);
        let proto = *inner.add(6);
        let (src, vip) = (inner.add(8), p.add(24));
        if *inner >> 4 != 6
            || (proto != PROTO_TCP && proto != PROTO_UDP)
            || read_unaligned(src as *const u64) != read_unaligned(vip as *const u64)
            || read_unaligned(src.add(8) as *const u64) != read_unaligned(vip.add(8) as *const u64)
        {
            return Ok(PASS);
        }
        // (VIP, client) and (VIP port, client port) swapped: as the client sent them.
        for (i, from) in [24, 32, 8, 16].into_iter().enumerate() {
            write_volatile(&raw mut (*s).words6[i], read_unaligned(inner.add(from) as *const u64));
        }
        let ports = read_unaligned(inner.add(IP6) as *const u32);
        write_volatile(&raw mut (*s).words6[4], u64::from(ports.rotate_left(16)) | u64::from(proto) << 32);
    }
    lb_icmp_error::<V6, L2>(ctx, s, PASS.1)
}

/// Where a flow's upper-layer header is, past the extension headers.
enum Upper {
    /// TCP or UDP at this offset from the IPv6 header; a fragment when `fragment`.
    Ports { proto: u8, off: usize, fragment: bool },
    /// ICMPv6 (errors and pings belong to the holder's stack).
    Icmp,
    /// Another protocol: not a service's.
    Other,
    /// A header not walked, or a chain too long.
    Unwalked,
}

/// IPv6 other than ICMPv6 right behind its header, for a service's address as
/// the VIP filter says ([`lb6_route`]). As lb4::lb4_handle, inlined into the
/// program: the flow cache, then [`lb6_slow`]. A call of its own here cost the
/// hit path a return, which the kernel's return thunk (a mitigation of
/// return-stack attacks on AMD CPUs) makes dear. A packet with extension
/// headers goes to a function of its own ([`lb6_ext_call`]): walking them takes
/// helper calls, across which the common path's values would be spilled.
#[inline(always)]
pub fn lb6_flow<const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    // The bytes to count and the network are in the scratch already, the
    // version checked (lb6_route).
    let ip: *const Ipv6Hdr = ptr_at(ctx, L2)?;
    let proto = unsafe { (*ip).next_hdr };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok(verdict_unpack(lb6_ext_call::<L2>(ctx.ctx, s)));
    }
    lb6_key_words(ip, s, false);
    let p: *const u32 = ptr_at(ctx, L2 + IP6)?;
    let syn = lb_syn_at(ctx, L2 + IP6, proto);
    lb6_lookup::<L2>(ctx, s, unsafe { read_unaligned(p) }, proto, syn)
}

/// The Lb6FlowKey's address words to the scratch `s`: source and destination
/// as they follow each other in the header at `ip`; and whether it is a fragment.
#[inline(always)]
fn lb6_key_words(ip: *const Ipv6Hdr, s: *mut Scratch, fragment: bool) {
    let a = unsafe { (ip as *const u8).add(8) };
    unsafe {
        for i in 0..4 {
            write_volatile(&raw mut (*s).words6[i], read_unaligned(a.add(8 * i) as *const u64));
        }
        write_volatile(&raw mut (*s).fragment, fragment as u32);
    }
}

/// The flow's last key word, (sport, dport, proto) as in IPv4's second word, to
/// the scratch `s` with whether it is a SYN; then the flow cache, else
/// [`lb6_slow`].
#[inline(always)]
fn lb6_lookup<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, ports: u32, proto: u8, syn: bool) -> Result<Verdict, ()> {
    unsafe {
        write_volatile(&raw mut (*s).words6[4], u64::from(ports) | u64::from(proto) << 32);
        write_volatile(&raw mut (*s).syn, syn as u32);
    }
    match lb_cache::<V6>(ctx, s)? {
        Some(v) => Ok(v),
        None => Ok(verdict_unpack(lb6_slow::<L2>(ctx.ctx, s))),
    }
}

/// A packet to a VIP whose IPv6 header is followed by an extension header, or by
/// an upper layer other than TCP and UDP ([`lb6_ext`]), as a function of its own.
#[inline(never)]
fn lb6_ext_call<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    verdict_call!(ctx, s, lb6_ext::<L2>)
}

/// [`lb6_ext_call`]'s path: the extension headers walked to the flow's ports.
/// Fragments hash without ports and use the VIP's port-0 service, as in IPv4.
#[inline(always)]
fn lb6_ext<const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    let next = unsafe { (*ptr_at::<Ipv6Hdr>(ctx, L2)?).next_hdr };
    let (proto, off, fragment) = match lb6_walk::<L2>(ctx, next)? {
        Upper::Ports { proto, off, fragment } => (proto, off, fragment),
        Upper::Icmp => return Ok((xdp_action::XDP_PASS, Reason::PassedIcmp)),
        Upper::Other => return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip)),
        Upper::Unwalked => return Ok((xdp_action::XDP_PASS, Reason::PassedIpv6Ext)),
    };
    lb6_key_words(ptr_at(ctx, L2)?, s, fragment);
    let (ports, syn) = if fragment { (0, false) } else { lb_ports_at(ctx, L2 + off, proto)? };
    lb6_lookup::<L2>(ctx, s, ports, proto, syn)
}

/// The bytes to count for the IPv6 packet at `ip` (behind an `L2`-byte layer-2
/// header), to the scratch: its headers and payload length. A jumbogram says 0
/// (its length is in a hop-by-hop option) and is counted by its headers alone:
/// asking a helper for the frame's length would keep values across a call on
/// every IPv6 packet's path (see maps::Scratch).
#[inline(always)]
fn lb6_count<const L2: usize>(ip: *const Ipv6Hdr, s: *mut Scratch) {
    unsafe { write_volatile(&raw mut (*s).bytes, (L2 + IP6 + usize::from(u16::from_be_bytes((*ip).payload_len))) as u32) };
}

/// Walks the extension headers from the IPv6 header's next header `next`, read
/// with a helper (their offsets vary; see parse::ETH_LEN). Any fragment header
/// makes the packet a fragment. Each header is at least 8 bytes: a frame that
/// ends within those is malformed.
#[inline(always)]
fn lb6_walk<const L2: usize>(ctx: &XdpContext, mut next: u8) -> Result<Upper, ()> {
    let mut off = IP6;
    let mut fragment = false;
    let mut h = [0u8; 8];
    for _ in 0..MAX_EXT_HEADERS {
        match next {
            PROTO_TCP | PROTO_UDP => return Ok(Upper::Ports { proto: next, off, fragment }),
            IPPROTO_ICMPV6 => return Ok(Upper::Icmp),
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT => {}
            // No next header (59), and every other upper layer or header.
            _ => return Ok(if lb6_known_upper(next) { Upper::Other } else { Upper::Unwalked }),
        }
        if unsafe { bpf_xdp_load_bytes(ctx.ctx, (L2 + off) as u32, h.as_mut_ptr() as *mut c_void, 8) } != 0 {
            return Err(());
        }
        if next == IPPROTO_FRAGMENT {
            fragment = true;
            off += 8;
        } else {
            off += (usize::from(h[1]) + 1) * 8;
        }
        next = h[0];
    }
    Ok(Upper::Unwalked)
}

/// Upper-layer protocols that are no extension header to walk: not a service's
/// (neither TCP nor UDP), passed as any other non-service packet.
#[inline(always)]
fn lb6_known_upper(next: u8) -> bool {
    // No next header, IPv4/IPv6 in IPv6, GRE, SCTP, ICMP.
    matches!(next, 59 | 4 | 41 | 47 | 132 | 1)
}

/// Everything past the flow cache, as lb4::lb4_slow.
#[inline(never)]
fn lb6_slow<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    verdict_call!(ctx, s, lb_miss::<V6, L2>)
}

/// IPv6's keys and tables, as IPv4's: the flow as five words (`words6`),
/// `lb6_first_packets`, `lb6_flow_cache`, `lb6_services` through
/// `lb6_service_cache`, `ndp_held` after `lb6_held_slots`; its flows in
/// `lb_flows` too.
struct V6;

impl Flows for V6 {
    /// The five words folded ([`fold_words6`]).
    #[inline(always)]
    fn folded(s: *const Scratch) -> (u64, u64) {
        fold_words6(unsafe { &(*s).words6 })
    }

    /// As words (see [`lb_copy_words`]).
    #[inline(always)]
    fn record_key(p: *mut u64, s: *const Scratch) {
        lb_copy_words::<5>(p, unsafe { &raw const (*s).words6 }.cast());
    }

    #[inline(always)]
    fn filter_bit(s: *const Scratch) -> u32 {
        unsafe { vip_filter_bit_word(fold6_words((*s).words6[2], (*s).words6[3])) }
    }

    /// Its Lb6ServiceKey (VIP, dport, proto) in three words.
    #[inline(always)]
    fn service(s: *mut Scratch) -> Option<*mut LbService> {
        unsafe {
            let w = (*s).words6;
            write_volatile(&raw mut (*s).svc6[0], w[2]);
            write_volatile(&raw mut (*s).svc6[1], w[3]);
            write_volatile(&raw mut (*s).svc6[2], (w[4] >> 16 & 0xffff) | (w[4] >> 32 & 0xff) << 16);
        }
        lb_service::<3, { offset_of!(Scratch, svc6) }>(s, &lb6_service_cache, |key| lookup_at::<_, LbService>(&lb6_services, key.cast()))
    }

    #[inline(always)]
    fn held_key(s: *mut Scratch) {
        unsafe {
            (*s).held6.ifindex = (*s).ifindex;
            let k = (&raw mut (*s).held6.vip) as *mut u8;
            write_unaligned(k as *mut u64, (*s).words6[2]);
            write_unaligned(k.add(8) as *mut u64, (*s).words6[3]);
        }
    }

    lb_tables! {
        key: words6, words: 5, flow: Lb6FlowKey, ring: flow_hash6, family: FLOW_FAMILY_V6,
        cache: lb6_flow_cache<Lb6FlowCacheEntry>, first: lb6_first_packets<Lb6FirstPacket>, held: ndp_held at held6, slot: held6_slot,
        handoff: ndp_handoff, ask: ETH_P_ASK6,
    }
}
