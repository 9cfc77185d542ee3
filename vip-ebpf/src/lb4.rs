//! IPv4 load balancing: per-CPU flow cache, else flow table, else Maglev ring,
//! then L2 direct server return.
use core::{
    mem::offset_of,
    ptr::{read_unaligned, write_volatile},
};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    programs::XdpContext,
};
use network_types::ip::Ipv4Hdr;
use vip_common::*;

use crate::{
    lb::{lb_cache, lb_icmp_error, lb_miss, lb_not_vip, lb_ports_at, lb_service, lb_syn_at, lb_tables, Flows},
    maps::{arp_handoff, arp_held, held4_slot, lb4_first_packets, lb4_flow_cache, lb4_service_cache, lb4_services, lookup_at, Scratch},
    parse::{ptr_at, verdict_call, verdict_unpack, Verdict},
    proto::{ICMP_DEST_UNREACH, ICMP_HDR_LEN, IPPROTO_ICMP, IP_MF_OFFSET, IP_OFFSET},
};

// Keys are assembled from packet words in little-endian order (bpfel).
const _: () = assert!(cfg!(target_endian = "little"));

/// IPv4 behind an `L2`-byte layer-2 header, received on the network of `ifindex`.
/// The paths most packets take (not a VIP's, a flow-cache hit) are here; the rest
/// is [`lb4_slow`]. What the path needs after its map lookups goes to the scratch
/// `s` as it is read, not to registers the compiler would spill (see maps::Scratch).
#[inline(always)]
pub fn lb4_handle<const L2: usize>(ctx: &XdpContext, s: *mut Scratch, ifindex: u32) -> Result<Verdict, ()> {
    unsafe { write_volatile(&raw mut (*s).ifindex, ifindex) };
    let ip = unsafe { &*ptr_at::<Ipv4Hdr>(ctx, L2)? };
    if ip.vihl >> 4 != 4 || ((ip.vihl & 0x0f) as usize) * 4 < Ipv4Hdr::LEN {
        return Err(());
    }
    // The bytes to count, for every verdict below.
    unsafe { write_volatile(&raw mut (*s).bytes, (L2 + usize::from(u16::from_be_bytes(ip.tot_len))) as u32) };
    // Not a service's address (most of a node's traffic): out before anything
    // else, with ctx, s and the bit alone live across the lookup (values kept
    // across a lookup beyond the four callee-saved registers are spilled to the
    // stack, each spill a speculation barrier without CAP_PERFMON).
    if lb_not_vip(vip_filter_bit(ip.dst_addr))? {
        return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip));
    }
    // The header again, rather than its pointer and length kept across the lookup.
    let iph: *const Ipv4Hdr = ptr_at(ctx, L2)?;
    let ip = unsafe { &*iph };
    let ihl = ((ip.vihl & 0x0f) as usize) * 4;
    let proto = ip.proto;
    if proto == IPPROTO_ICMP {
        return Ok(verdict_unpack(lb4_icmp_call::<L2>(ctx.ctx, s)));
    }
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip));
    }
    let fragment = u16::from_be_bytes(ip.frags) & IP_MF_OFFSET != 0;
    // The Lb4FlowKey as the two words lookups compare: (src, dst) and (sport, dport,
    // proto). Unaligned packet loads: allowed by the verifier on x86-64 and arm64,
    // and single loads with the linker's allows-misaligned-mem-access. Volatile
    // stores, each as soon as its value is read, so that none is held in a register.
    unsafe {
        write_volatile(&raw mut (*s).words[0], read_unaligned((iph as *const u8).add(12) as *const u64));
        write_volatile(&raw mut (*s).fragment, fragment as u32);
    }
    // Fragments carry no ports past the first: all fragments of a datagram hash on
    // (src, dst, proto) and use the VIP's port-0 service entry. A TCP segment's
    // flags tell a new connection (SYN) from the rest.
    let (ports, syn) = if fragment {
        (0, false)
    } else if ihl == Ipv4Hdr::LEN {
        let p: *const u32 = ptr_at(ctx, L2 + Ipv4Hdr::LEN)?;
        let syn = lb_syn_at(ctx, L2 + Ipv4Hdr::LEN, proto);
        (unsafe { read_unaligned(p) }, syn)
    } else {
        // IP options (rare): a variable offset.
        lb_ports_at(ctx, L2 + ihl, proto)?
    };
    unsafe {
        write_volatile(&raw mut (*s).words[1], lb4_ports_proto(ports, proto));
        write_volatile(&raw mut (*s).syn, syn as u32);
    }

    // The flow cache first (lb::lb_cache), else the call.
    if let Some(v) = lb_cache::<V4>(ctx, s)? {
        return Ok(v);
    }
    Ok(verdict_unpack(lb4_slow::<L2>(ctx.ctx, s)))
}

/// Everything past the flow cache (lb::lb_miss): new flows, the flow table, the
/// held-VIP and service lookups, forwards out of home. A function of its own,
/// called (BPF to BPF) rather than inlined: inlined, its many live values made
/// the compiler spill registers on the hot paths too. The verdict packed in one
/// register (parse::verdict_pack).
#[inline(never)]
fn lb4_slow<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    verdict_call!(ctx, s, lb_miss::<V4, L2>)
}

/// ICMP to a VIP ([`lb4_icmp`]), a function of its own (BPF to BPF) as
/// [`lb4_slow`]: the hot paths are allocated without it.
#[inline(never)]
fn lb4_icmp_call<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    verdict_call!(ctx, s, lb4_icmp::<L2>)
}

/// ICMP to a VIP: a destination unreachable (fragmentation needed among them)
/// about a flow of a service goes where the flow's packets go (lb::lb_icmp_error);
/// pings and the rest belong to the node's own stack. The error quotes the packet
/// the backend sent (VIP to client): its addresses and ports swapped are the
/// flow's key. Read only at fixed offsets (no outer or inner IP options: see
/// parse::ETH_LEN), from the VIP, TCP or UDP with its ports; else passed.
#[inline(always)]
fn lb4_icmp<const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    const PASS: Verdict = (xdp_action::XDP_PASS, Reason::PassedIcmp);
    const INNER: usize = Ipv4Hdr::LEN + ICMP_HDR_LEN;
    let Ok(p) = ptr_at::<[u8; INNER + Ipv4Hdr::LEN + 4]>(ctx, L2) else { return Ok(PASS) };
    let p = p as *const u8;
    unsafe {
        let inner = p.add(INNER);
        let proto = *inner.add(9);
        if *p != 0x45
            || u16::from_be_bytes([*p.add(6), *p.add(7)]) & IP_MF_OFFSET != 0
            || *p.add(Ipv4Hdr::LEN) != ICMP_DEST_UNREACH
            || *inner != 0x45
            || u16::from_be_bytes([*inner.add(6), *inner.add(7)]) & IP_OFFSET != 0
            || (proto != PROTO_TCP && proto != PROTO_UDP)
            || read_unaligned(inner.add(12) as *const u32) != read_unaligned(p.add(16) as *const u32)
        {
            return Ok(PASS);
        }
        // (VIP, client) and (VIP port, client port) swapped: as the client sent them.
        let addrs = read_unaligned(inner.add(12) as *const u64);
        let ports = read_unaligned(inner.add(Ipv4Hdr::LEN) as *const u32);
        write_volatile(&raw mut (*s).words[0], addrs.rotate_left(32));
        write_volatile(&raw mut (*s).words[1], lb4_ports_proto(ports.rotate_left(16), proto));
    }
    lb_icmp_error::<V4, L2>(ctx, s, PASS.1)
}

/// The Lb4FlowKey's second word as loaded: the ports word (sport, dport) and the
/// protocol above it.
#[inline(always)]
fn lb4_ports_proto(ports: u32, proto: u8) -> u64 {
    u64::from(ports) | u64::from(proto) << 32
}

/// IPv4's keys and tables: the flow as two words (`words`), `lb4_first_packets`,
/// `lb4_flow_cache`, `lb4_services` through `lb4_service_cache`, `arp_held`
/// after `lb4_held_slots`; its flows in `lb_flows`.
struct V4;

impl Flows for V4 {
    /// The two words themselves.
    #[inline(always)]
    fn folded(s: *const Scratch) -> (u64, u64) {
        unsafe { ((*s).words[0], (*s).words[1]) }
    }

    /// As two plain stores (no memset: not zeros).
    #[inline(always)]
    fn record_key(p: *mut u64, s: *const Scratch) {
        unsafe {
            *p = (*s).words[0];
            *p.add(1) = (*s).words[1];
        }
    }

    #[inline(always)]
    fn filter_bit(s: *const Scratch) -> u32 {
        unsafe { vip_filter_bit_word(((*s).words[0] >> 32) as u32) }
    }

    /// Its Lb4ServiceKey (VIP, dport, proto) as one word.
    #[inline(always)]
    fn service(s: *mut Scratch) -> Option<*mut LbService> {
        unsafe {
            let (w0, w1) = ((*s).words[0], (*s).words[1]);
            write_volatile(&raw mut (*s).svc, (w0 >> 32) | (w1 >> 16 & 0xffff) << 32 | (w1 >> 32 & 0xff) << 48);
        }
        lb_service::<1, { offset_of!(Scratch, svc) }>(s, &lb4_service_cache, |key| lookup_at::<_, LbService>(&lb4_services, key.cast()))
    }

    #[inline(always)]
    fn held_key(s: *mut Scratch) {
        unsafe { (*s).held = ArpHeldKey { ifindex: (*s).ifindex, vip: (((*s).words[0] >> 32) as u32).to_ne_bytes() } };
    }

    lb_tables! {
        key: words, words: 2, flow: Lb4FlowKey, ring: flow_hash, family: FLOW_FAMILY_V4,
        cache: lb4_flow_cache<Lb4FlowCacheEntry>, first: lb4_first_packets<Lb4FirstPacket>, held: arp_held at held, slot: held4_slot,
        handoff: arp_handoff, ask: ETH_P_ASK4,
    }
}
