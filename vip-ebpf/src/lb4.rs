//! IPv4 load balancing: per-CPU flow cache, else flow table, else Maglev ring,
//! then L2 direct server return.
use core::{
    mem::offset_of,
    ptr::{read_unaligned, read_volatile, write_volatile},
};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::{bpf_ktime_get_coarse_ns, bpf_xdp_load_bytes},
    programs::XdpContext,
};
use network_types::ip::Ipv4Hdr;
use vip_common::*;

use crate::{
    lb::{
        lb_answer_hit, lb_balance, lb_cached, lb_copy_words, lb_group, lb_held_entry, lb_icmp_error, lb_not_vip, lb_present_backend, lb_service,
        lb_touch_early, lb_touch_if, Flows,
    },
    maps::{arp_held, held4_slot, lb4_first_packets, lb4_flow_cache, lb4_flow_cache_ctl, lb4_service_cache, lb4_services, lb_key0, lookup_at, Scratch},
    parse::{ptr_at, verdict_pack_or_malformed, verdict_unpack, Verdict},
};

const IPPROTO_ICMP: u8 = 1;
/// The flags byte's offset in the TCP header, and the flags that tell a SYN.
const TCP_FLAGS: usize = 13;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
/// More-fragments flag and fragment offset, in the host-order `frags` word.
const IP_MF_OFFSET: u16 = 0x3fff;
const IP_OFFSET: u16 = 0x1fff;
/// ICMP's destination unreachable (every code: fragmentation needed is 4), and
/// the header before the quoted packet.
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_HDR_LEN: usize = 8;

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
        let syn = proto == PROTO_TCP && matches!(ptr_at::<u8>(ctx, L2 + Ipv4Hdr::LEN + TCP_FLAGS), Ok(f) if unsafe { *f } & (TCP_SYN | TCP_ACK) == TCP_SYN);
        (unsafe { read_unaligned(p) }, syn)
    } else {
        lb4_ports_past_options(ctx, L2 + ihl, proto)?
    };
    unsafe {
        write_volatile(&raw mut (*s).words[1], lb4_ports_proto(ports, proto));
        write_volatile(&raw mut (*s).syn, syn as u32);
    }

    // The flow cache first: a hit is the whole answer, with no map helper call
    // (array lookups are inlined by the verifier).
    let cached = lb4_cache_lookup(s);
    if let Some(p) = cached {
        // A SYN skips it: its flow may be a reused 5-tuple whose cached answer is
        // stale (the flag read back from the scratch, not kept in a register). So
        // does a frame to a group MAC, which only the VIP's fresh holder may handle.
        if unsafe { read_volatile(&(*s).syn) } == 0 && !lb_group(ctx)? && lb4_cache_hit(p, s) {
            return lb_cached(ctx, unsafe { &raw const (*p).answer }, s);
        }
    }
    // Its flow-table line starts coming before the call (lb::lb_touch_early).
    lb_touch_early::<V4>(s);
    Ok(verdict_unpack(lb4_slow::<L2>(ctx.ctx, s)))
}

/// Everything past the flow cache: new flows, the flow table, the held-VIP and
/// service lookups, forwards out of home. A function of its own, called (BPF to
/// BPF) rather than inlined: inlined, its many live values made the compiler spill
/// registers on the hot paths too. The verdict packed in one register
/// (parse::verdict_pack).
#[inline(never)]
fn lb4_slow<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    let ctx = XdpContext::new(ctx);
    verdict_pack_or_malformed(&ctx, s, lb4_miss::<L2>(&ctx, s))
}

/// [`lb4_slow`]'s path. Only `ctx` and `s` live across its map lookups: what a
/// later step needs goes to the scratch (the service, the held entry's MAC and
/// freshness, the backend), and every key is built there. A value kept in a
/// register across a lookup is spilled to the stack once more than four are live,
/// each spill a speculation barrier without CAP_PERFMON (see maps::LB_KEY0).
#[inline(always)]
fn lb4_miss<const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    let held = lb4_held(s);
    lb_touch_if::<V4>(s, held);
    match lb4_service(s) {
        Some(p) => lb_copy_words::<2>(unsafe { &raw mut (*s).service }.cast(), p.cast()),
        None if unsafe { (*s).fragment } != 0 => return Ok((xdp_action::XDP_PASS, Reason::PassedFragmentNoService)),
        None => return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip)),
    }
    lb_balance::<V4, L2>(ctx, s, held)
}

/// The service of the flow in `s`: its Lb4ServiceKey (VIP, dport, proto) as one
/// word, looked up.
#[inline(always)]
fn lb4_service(s: *mut Scratch) -> Option<*mut Lb4Service> {
    unsafe {
        let (w0, w1) = ((*s).words[0], (*s).words[1]);
        write_volatile(&raw mut (*s).svc, (w0 >> 32) | (w1 >> 16 & 0xffff) << 32 | (w1 >> 32 & 0xff) << 48);
    }
    lb_service::<1, { offset_of!(Scratch, svc) }>(s, &lb4_service_cache, |key| lookup_at::<_, Lb4Service>(&lb4_services, key.cast()))
}

/// ICMP to a VIP ([`lb4_icmp`]), a function of its own (BPF to BPF) as
/// [`lb4_slow`]: the hot paths are allocated without it.
#[inline(never)]
fn lb4_icmp_call<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    let ctx = XdpContext::new(ctx);
    verdict_pack_or_malformed(&ctx, s, lb4_icmp::<L2>(&ctx, s))
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
    let Some(svc) = lb4_service(s) else { return Ok(PASS) };
    lb_copy_words::<2>(unsafe { &raw mut (*s).service }.cast(), svc.cast());
    lb_icmp_error::<V4, L2>(ctx, s, lb4_held(s), Reason::PassedIcmp)
}

/// Whether this node has an `arp_held` entry for the flow's VIP on its network
/// (its MAC and freshness then in the scratch). An entry whose deadline has
/// passed means the agent stopped vouching for it (fencing, or released after
/// the VIP moved): not balanced for new flows. The coarse clock costs a few ns
/// where `bpf_ktime_get_ns` costs ~25; it lags by up to a tick, which the agent
/// covers by storing deadlines two ticks early. It is read first, so that the
/// entry's pointer does not live across the call.
#[inline(always)]
fn lb4_held(s: *mut Scratch) -> bool {
    unsafe {
        write_volatile(&raw mut (*s).now, bpf_ktime_get_coarse_ns());
        (*s).held = ArpHeldKey { ifindex: (*s).ifindex, vip: (((*s).words[0] >> 32) as u32).to_ne_bytes() };
        // Its slot first (lb4_held_slots), then arp_held.
        if let Some(h) = held4_slot(s) {
            lb_held_entry(s, h);
            return true;
        }
        let Some(h) = lookup_at::<_, ArpHeldVip>(&arp_held, (&raw const (*s).held).cast()) else {
            return false;
        };
        lb_held_entry(s, h);
    }
    true
}

/// The Lb4FlowKey's second word as loaded: the ports word (sport, dport) and the
/// protocol above it.
#[inline(always)]
fn lb4_ports_proto(ports: u32, proto: u8) -> u64 {
    u64::from(ports) | u64::from(proto) << 32
}

/// This CPU's flow-cache slot for the flow in `s` (its key and the current epoch
/// recorded in `s`).
#[inline(always)]
fn lb4_cache_lookup(s: *mut Scratch) -> Option<*mut Lb4FlowCacheEntry> {
    let ctl = lookup_at::<_, Lb4FlowCacheCtl>(&lb4_flow_cache_ctl, lb_key0()).map(|c| unsafe { *c }).unwrap_or_default();
    unsafe {
        (*s).epoch = ctl.epoch;
        (*s).key = flow_cache_slot((*s).words[0], (*s).words[1]) & ctl.slot_mask;
        (*s).cache_slot = (*s).key;
        lookup_at::<_, Lb4FlowCacheEntry>(&lb4_flow_cache, s.cast())
    }
}

/// Whether the cached answer `p` is for the flow in `s`, current, and not due for
/// its periodic recheck.
#[inline(always)]
fn lb4_cache_hit(p: *mut Lb4FlowCacheEntry, s: *const Scratch) -> bool {
    let w = p as *const u64;
    unsafe { *w == (*s).words[0] && *w.add(1) == (*s).words[1] && lb_answer_hit(&raw mut (*p).answer, s) }
}

/// The ports word of a packet with IP options (rare), and whether it is a TCP SYN
/// without ACK: copied by a helper, which takes the variable offset the verifier
/// refuses on a packet pointer.
#[inline(always)]
fn lb4_ports_past_options(ctx: &XdpContext, off: usize, proto: u8) -> Result<(u32, bool), ()> {
    let mut ports = 0u32;
    let r = unsafe { bpf_xdp_load_bytes(ctx.ctx, off as u32, (&mut ports as *mut u32).cast(), 4) };
    if r != 0 {
        return Err(());
    }
    let mut flags = 0u8;
    let syn = proto == PROTO_TCP
        && unsafe { bpf_xdp_load_bytes(ctx.ctx, (off + TCP_FLAGS) as u32, (&mut flags as *mut u8).cast(), 1) } == 0
        && flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    Ok((ports, syn))
}

/// IPv4's tables: `lb4_first_packets`, `lb4_flow_cache`; its flows in `lb_flows`.
struct V4;

impl Flows for V4 {
    #[inline(always)]
    fn ring_hash(s: *const Scratch) -> u32 {
        let k: Lb4FlowKey = unsafe { core::mem::transmute((*s).words) };
        flow_hash(k.src, k.dst, k.sport, k.dport, k.proto)
    }

    #[inline(always)]
    fn record_first(s: *mut Scratch) {
        if let Some(p) = lb4_first_packet_slot(s) {
            unsafe {
                let (w0, w1) = ((*s).words[0], (*s).words[1]);
                let w = p as *mut u64;
                *w = w0;
                *w.add(1) = w1;
                (*p).backend = (*s).backend_id;
                (*p).check = first_packet_check(w0, w1, (*s).backend_id);
            }
        }
    }

    /// The record is checked whole (see [`Lb4FirstPacket`]).
    #[inline(always)]
    fn second_packet(s: *mut Scratch) -> bool {
        let Some(p) = lb4_first_packet_slot(s) else { return false };
        unsafe {
            let (w0, w1) = ((*s).words[0], (*s).words[1]);
            let w = p as *mut u64;
            if *w != w0 || *w.add(1) != w1 || (*p).check != first_packet_check(w0, w1, (*p).backend) {
                return false;
            }
            // Volatile: two plain zero stores become a memset, whose pointer
            // arithmetic the verifier refuses without CAP_PERFMON.
            write_volatile(w, 0);
            write_volatile(w.add(1), 0);
            lb_present_backend(s, (*p).backend)
        }
    }

    #[inline(always)]
    fn flow_hash(seed: &[u64; 2], s: *const Scratch) -> u64 {
        lb_flow_hash(seed, FLOW_FAMILY_V4, unsafe { &(*s).words })
    }

    #[inline(always)]
    fn filter_bit(s: *const Scratch) -> u32 {
        unsafe { vip_filter_bit_word(((*s).words[0] >> 32) as u32) }
    }

    #[inline(always)]
    fn first_touch(s: *mut Scratch) {
        if let Some(p) = lb4_first_packet_slot(s) {
            // Volatile: kept though its value is not used.
            let _ = unsafe { read_volatile(p as *const u64) };
        }
    }

    #[inline(always)]
    fn cache_forget(s: *mut Scratch) {
        let Some(e) = lb4_cache_slot(s) else { return };
        let w = e as *mut u64;
        unsafe {
            if *w == (*s).words[0] && *w.add(1) == (*s).words[1] {
                write_volatile(w, 0); // volatile: see second_packet
                write_volatile(w.add(1), 0);
            }
        }
    }

    /// The key as words (see [`lb_copy_words`]).
    #[inline(always)]
    fn cache_claim(s: *mut Scratch) -> Option<*mut FlowAnswer> {
        let e = lb4_cache_slot(s)?;
        lb_copy_words::<2>(e.cast(), unsafe { &raw const (*s).words }.cast());
        Some(unsafe { &raw mut (*e).answer })
    }
}

/// The `lb4_first_packets` slot of the flow in `s` (the key in `s`).
#[inline(always)]
fn lb4_first_packet_slot(s: *mut Scratch) -> Option<*mut Lb4FirstPacket> {
    unsafe {
        (*s).key = first_packet_slot((*s).words[0], (*s).words[1]);
        lookup_at::<_, Lb4FirstPacket>(&lb4_first_packets, s.cast())
    }
}

/// This CPU's flow-cache slot for the flow in `s`, found again past the hit path
/// (an inlined array lookup) rather than kept in a register.
#[inline(always)]
fn lb4_cache_slot(s: *mut Scratch) -> Option<*mut Lb4FlowCacheEntry> {
    unsafe {
        (*s).key = (*s).cache_slot;
        lookup_at::<_, Lb4FlowCacheEntry>(&lb4_flow_cache, s.cast())
    }
}
