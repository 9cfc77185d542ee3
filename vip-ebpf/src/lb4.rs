//! IPv4 load balancing: per-CPU flow cache, else flow table, else Maglev ring,
//! then L2 direct server return.
use core::ptr::{read_unaligned, read_volatile, write_unaligned, write_volatile};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::{bpf_ktime_get_coarse_ns, bpf_redirect, bpf_xdp_adjust_head, bpf_xdp_load_bytes},
    programs::XdpContext,
};
use network_types::{eth::EthHdr, ip::Ipv4Hdr};
use vip_common::*;

use crate::{
    maps::{
        arp_held, lb4_backend_stats, lb4_backends, lb4_first_packets, lb4_flow_cache, lb4_flow_cache_ctl, lb4_ring, lb4_service_stats, lb4_services,
        lb4_vip_filter, lb_flows, lb_flows_ctl, lb_home, lb_key0, lookup_at, Scratch,
    },
    parse::{frame_len, ptr_at, verdict_pack, verdict_unpack, Verdict, ETH_LEN, VLAN_ETH_LEN},
    stats,
};

const IPPROTO_ICMP: u8 = 1;
/// The flags byte's offset in the TCP header, and the flags that tell a SYN.
const TCP_FLAGS: usize = 13;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
/// More-fragments flag and fragment offset, in the host-order `frags` word.
const IP_MF_OFFSET: u16 = 0x3fff;

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
    let bit = vip_filter_bit(ip.dst_addr);
    let words = lookup_at::<_, [u32; VIP_FILTER_WORDS as usize]>(&lb4_vip_filter, lb_key0()).ok_or(())?;
    if unsafe { (*words)[(bit / 32) as usize & (VIP_FILTER_WORDS as usize - 1)] } & (1 << (bit % 32)) == 0 {
        return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip));
    }
    // The header again, rather than its pointer and length kept across the lookup.
    let iph: *const Ipv4Hdr = ptr_at(ctx, L2)?;
    let ip = unsafe { &*iph };
    let ihl = ((ip.vihl & 0x0f) as usize) * 4;
    let proto = ip.proto;
    if proto == IPPROTO_ICMP {
        // Pings and ICMP errors for a VIP belong to the node's own stack.
        return Ok((xdp_action::XDP_PASS, Reason::PassedIcmp));
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
        if unsafe { read_volatile(&(*s).syn) } == 0 && !lb4_group(ctx)? && lb4_cache_hit(p, s) {
            return lb4_cached(ctx, p, s);
        }
    }
    Ok(verdict_unpack(lb4_slow::<L2>(ctx.ctx, s)))
}

/// Whether the frame goes to a broadcast or multicast MAC: it reaches every node,
/// so only the VIP's fresh holder may handle it, or every node's stack would
/// answer it too.
#[inline(always)]
fn lb4_group(ctx: &XdpContext) -> Result<bool, ()> {
    let eth: *const EthHdr = ptr_at(ctx, 0)?;
    Ok(unsafe { (*eth).dst_addr[0] } & 1 != 0)
}

/// Everything past the flow cache: new flows, the flow table, the held-VIP and
/// service lookups, forwards out of home. A function of its own, called (BPF to
/// BPF) rather than inlined: inlined, its many live values made the compiler spill
/// registers on the hot paths too. The verdict packed in one register
/// ([`verdict_pack`]).
#[inline(never)]
fn lb4_slow<const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    let ctx = XdpContext::new(ctx);
    verdict_pack(match lb4_miss::<L2>(&ctx, s) {
        Ok(v) => v,
        Err(()) => {
            unsafe { (*s).bytes = frame_len(&ctx) as u32 };
            (xdp_action::XDP_DROP, Reason::DropMalformed)
        }
    })
}

/// [`lb4_slow`]'s path. Only `ctx` and `s` live across its map lookups: what a
/// later step needs goes to the scratch (the service, the held entry's MAC and
/// freshness, the backend), and every key is built there. A value kept in a
/// register across a lookup is spilled to the stack once more than four are live,
/// each spill a speculation barrier without CAP_PERFMON (see maps::LB_KEY0).
#[inline(always)]
fn lb4_miss<const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    // The Lb4ServiceKey (VIP, dport, proto) as one word.
    unsafe {
        let (w0, w1) = ((*s).words[0], (*s).words[1]);
        write_volatile(&raw mut (*s).svc, (w0 >> 32) | (w1 >> 16 & 0xffff) << 32 | (w1 >> 32 & 0xff) << 48);
    }
    match lookup_at::<_, Lb4Service>(&lb4_services, unsafe { &raw const (*s).svc }.cast()) {
        Some(p) => lb4_copy_words::<2>(unsafe { &raw mut (*s).service }.cast(), p.cast()),
        None if unsafe { (*s).fragment } != 0 => return Ok((xdp_action::XDP_PASS, Reason::PassedFragmentNoService)),
        None => return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip)),
    }
    if !lb4_held(s) {
        // Not ours to balance (another node owns it): the frame was sent to this
        // node as a backend, or is stray; the stack decides.
        return Ok(if lb4_group(ctx)? { (xdp_action::XDP_DROP, Reason::DropGroupNotOwner) } else { (xdp_action::XDP_PASS, Reason::PassedNotOwner) });
    }
    // A packet past its first (no SYN) to a VIP held here will look its flow up
    // in lb_flows, most likely a line not in the caches: it is loaded now, so that
    // the steps before that lookup run while it comes. (Not earlier: frames for
    // VIPs held elsewhere, which backends receive, and SYNs never read the table.)
    if unsafe { (*s).syn } == 0 {
        lb_flow_touch(s);
    }
    let fresh = || unsafe { read_volatile(&(*s).fresh) } != 0;
    if !fresh() && lb4_group(ctx)? {
        return Ok((xdp_action::XDP_DROP, Reason::DropGroupNotOwner));
    }
    // Whether the flow is in lb_flows now (only those are memoised in the cache).
    let established = if unsafe { (*s).syn } != 0 {
        // A new connection, also on a reused 5-tuple whose pin is stale: the ring
        // decides, and its next packet pins that choice over any old one.
        if !fresh() {
            return Ok((xdp_action::XDP_PASS, Reason::PassedNotOwner));
        }
        lb4_cache_forget(s);
        if !lb4_first_packet(s) {
            return Ok((xdp_action::XDP_DROP, Reason::DropNoBackend));
        }
        false
    } else if lb4_second_packet(s) {
        // Its second packet: the flow is pinned to where its first went.
        lb_flow_insert(s);
        true
    } else if lb4_flow_backend(s) {
        true
    } else if !fresh() {
        // A stale entry (fenced, or released when the VIP moved) takes no new
        // flow, but keeps the flows it already pinned: a client still sending to
        // our MAC until the new owner's gratuitous ARP reaches it keeps its
        // connection instead of getting a RST from our stack.
        return Ok((xdp_action::XDP_PASS, Reason::PassedNotOwner));
    } else if lb4_first_packet(s) {
        // A flow seen for the first time without a SYN (UDP, or TCP picked up
        // mid-connection after a failover): recorded like a SYN.
        false
    } else {
        return Ok((xdp_action::XDP_DROP, Reason::DropNoBackend));
    };
    // A VIP of another network than home: its frames reach the backend out of home.
    let home = lookup_at::<_, LbHome>(&lb_home, lb_key0()).is_some_and(|h| unsafe {
        let via = (*h).ifindex != 0 && (*h).ifindex != (*s).ifindex;
        if via {
            (*s).home.ifindex = (*h).ifindex;
            lb4_copy_mac(&raw mut (*s).home.mac, &raw const (*h).mac);
        }
        via
    });
    // The flow is pinned in lb_flows: memoise the answer for its next packets
    // (forwards on the frame's own network and local deliveries only).
    if established && !home {
        lb4_cache_store(s);
    }
    unsafe { (*s).key = (*s).service.id };
    stats::count_at(&lb4_service_stats, s.cast(), unsafe { &(*s).bytes });
    unsafe { (*s).key = (*s).backend_id };
    stats::count_at(&lb4_backend_stats, s.cast(), unsafe { &(*s).bytes });
    let b = unsafe { &(*s).backend };
    if b.flags & BACKEND_LOCAL != 0 {
        // A VLAN's frame reaches this node's stack untagged too, as it would from
        // another node: the node need not have that VLAN.
        if home && L2 == VLAN_ETH_LEN {
            lb4_pop_tag(ctx)?;
        }
        return Ok((xdp_action::XDP_PASS, Reason::PassedLocalBackend));
    }
    if home {
        return lb4_forward_home::<L2>(ctx, &b.mac, unsafe { &(*s).home });
    }
    lb4_rewrite_eth(ctx, &b.mac, unsafe { &(*s).mac })
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
        let Some(h) = lookup_at::<_, ArpHeldVip>(&arp_held, (&raw const (*s).held).cast()) else {
            return false;
        };
        (*s).fresh = ((*s).now <= (*h).deadline_ns) as u32;
        lb4_copy_mac(&raw mut (*s).mac, &raw const (*h).mac);
    }
    true
}

/// Copies a MAC as a word and a half-word (see [`lb4_copy_words`]).
#[inline(always)]
fn lb4_copy_mac(dst: *mut [u8; 6], src: *const [u8; 6]) {
    let (d, m) = (dst.cast::<u8>(), src.cast::<u8>());
    unsafe {
        write_unaligned(d as *mut u32, read_unaligned(m as *const u32));
        write_unaligned(d.add(4) as *mut u16, read_unaligned(m.add(4) as *const u16));
    }
}

/// Copies `N` words from `src` to `dst` (8-byte aligned map values): a struct
/// assignment compiles to memmove, whose pointer comparison the verifier refuses
/// without CAP_PERFMON.
#[inline(always)]
fn lb4_copy_words<const N: usize>(dst: *mut u64, src: *const u64) {
    for i in 0..N {
        unsafe { write_volatile(dst.add(i), read_volatile(src.add(i))) };
    }
}

/// Writes the answer for the flow in `s` to its flow-cache slot. Field by field,
/// the key and MACs as words: a whole-struct write compiles to memmove, whose
/// pointer comparison the verifier refuses without CAP_PERFMON.
#[inline(always)]
fn lb4_cache_store(s: *mut Scratch) {
    let Some(e) = lb4_cache_slot(s) else { return };
    unsafe {
        let w = e as *mut u64;
        *w = (*s).words[0];
        *w.add(1) = (*s).words[1];
        (*e).epoch = (*s).epoch;
        (*e).ifindex = (*s).ifindex;
        (*e).backend = (*s).backend_id;
        lb4_copy_macs((*e).eth.as_mut_ptr(), &(*s).backend.mac, &(*s).mac);
        (*e).service = (*s).service.id;
        (*e).flags = if (*s).backend.flags & BACKEND_LOCAL != 0 { FLOW_CACHE_LOCAL } else { 0 };
        (*e).hits = 0;
    }
}

/// Removes the frame's 802.1Q tag: its MACs move 4 bytes on, over the tag, and
/// the head moves past them.
#[inline(always)]
fn lb4_pop_tag(ctx: &XdpContext) -> Result<(), ()> {
    let p = ptr_at::<[u8; 16]>(ctx, 0)? as *mut u8;
    unsafe {
        let (a, b, c) = (read_unaligned(p as *const u32), read_unaligned(p.add(4) as *const u32), read_unaligned(p.add(8) as *const u32));
        write_unaligned(p.add(4) as *mut u32, a);
        write_unaligned(p.add(8) as *mut u32, b);
        write_unaligned(p.add(12) as *mut u32, c);
        if bpf_xdp_adjust_head(ctx.ctx, (VLAN_ETH_LEN - ETH_LEN) as i32) != 0 {
            return Err(());
        }
    }
    Ok(())
}

/// Forwards the frame to the backend MAC `to` out of the home interface `h`,
/// untagged: the backends' MACs are those of the network their nodes are
/// reached on, which need not have the VIP's VLAN or segment. The tag, if any,
/// goes (the MACs are written 4 bytes on, over it, and the head moves past them).
#[inline(always)]
fn lb4_forward_home<const L2: usize>(ctx: &XdpContext, to: &[u8; 6], h: &LbHome) -> Result<Verdict, ()> {
    const TAG: usize = VLAN_ETH_LEN - ETH_LEN;
    if L2 == VLAN_ETH_LEN {
        lb4_copy_macs(ptr_at::<[u8; 12]>(ctx, TAG)? as *mut u8, to, &h.mac);
        if unsafe { bpf_xdp_adjust_head(ctx.ctx, TAG as i32) } != 0 {
            return Err(());
        }
    } else {
        lb4_copy_macs(ptr_at::<[u8; 12]>(ctx, 0)? as *mut u8, to, &h.mac);
    }
    if h.ifindex == ctx.ingress_ifindex() as u32 {
        return Ok((xdp_action::XDP_TX, Reason::ForwardedHome));
    }
    Ok((unsafe { bpf_redirect(h.ifindex, 0) } as u32, Reason::ForwardedHome))
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
/// its periodic recheck (which counts this hit).
#[inline(always)]
fn lb4_cache_hit(p: *mut Lb4FlowCacheEntry, s: *const Scratch) -> bool {
    let w = p as *const u64;
    unsafe {
        if *w != (*s).words[0] || *w.add(1) != (*s).words[1] || (*p).epoch != (*s).epoch || (*p).ifindex != (*s).ifindex {
            return false;
        }
        let hits = (*p).hits.wrapping_add(1);
        if hits % FLOW_CACHE_RECHECK_HITS == 0 {
            return false;
        }
        (*p).hits = hits;
    }
    true
}

/// A flow-cache hit: the rewrite and the counters the slow path would have done.
/// The counters' keys are copied to the scratch first, so that only the scratch
/// and the verdict live across their lookups (not the entry, a fifth register).
#[inline(always)]
fn lb4_cached(ctx: &XdpContext, e: *const Lb4FlowCacheEntry, s: *mut Scratch) -> Result<Verdict, ()> {
    let e = unsafe { &*e };
    unsafe {
        (*s).key = e.service;
        (*s).key2 = e.backend;
    }
    let verdict = if e.flags & FLOW_CACHE_LOCAL != 0 {
        (xdp_action::XDP_PASS, Reason::PassedLocalBackend)
    } else {
        let dst: *mut u8 = ptr_at::<[u8; 12]>(ctx, 0)? as *mut u8;
        let src = e.eth.as_ptr();
        unsafe {
            write_unaligned(dst as *mut u64, read_unaligned(src as *const u64));
            write_unaligned(dst.add(8) as *mut u32, read_unaligned(src.add(8) as *const u32));
        }
        (xdp_action::XDP_TX, Reason::Forwarded)
    };
    stats::count_at(&lb4_service_stats, s.cast(), unsafe { &(*s).bytes });
    unsafe { (*s).key = read_volatile(&(*s).key2) };
    stats::count_at(&lb4_backend_stats, s.cast(), unsafe { &(*s).bytes });
    Ok(verdict)
}

/// Destination MAC to the backend's, source to ours.
#[inline(always)]
fn lb4_rewrite_eth(ctx: &XdpContext, to: &[u8; 6], ours: &[u8; 6]) -> Result<Verdict, ()> {
    lb4_copy_macs(ptr_at::<[u8; 12]>(ctx, 0)? as *mut u8, to, ours);
    Ok((xdp_action::XDP_TX, Reason::Forwarded))
}

/// Writes `to` then `ours` at `dst` (12 bytes) as words (no memmove, see above).
#[inline(always)]
fn lb4_copy_macs(dst: *mut u8, to: &[u8; 6], ours: &[u8; 6]) {
    unsafe {
        write_unaligned(dst as *mut u32, read_unaligned(to.as_ptr() as *const u32));
        write_unaligned(dst.add(4) as *mut u16, read_unaligned(to.as_ptr().add(4) as *const u16));
        write_unaligned(dst.add(6) as *mut u16, read_unaligned(ours.as_ptr() as *const u16));
        write_unaligned(dst.add(8) as *mut u32, read_unaligned(ours.as_ptr().add(2) as *const u32));
    }
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

/// Whether this established flow is in `lb_flows` with a backend that still
/// exists (then in the scratch), its stamp refreshed if the clock moved on. A
/// flow whose backend was removed (unhealthy, drained) is re-hashed on the
/// current ring. The four ways of its set are one line: one cold access at most.
#[inline(always)]
fn lb4_flow_backend(s: *mut Scratch) -> bool {
    let Some(set) = lb_flow_set_of(s) else { return false };
    let w = set as *mut u64;
    unsafe {
        let tag = (*s).ftag;
        for i in 0..FLOW_WAYS as usize {
            if *w.add(2 * i) != tag {
                continue;
            }
            let w1 = *w.add(2 * i + 1);
            let backend = w1 as u16;
            if (w1 >> 16) as u16 != lb_flow_check(tag, backend) {
                return false; // torn by two writers: matches nothing
            }
            // Written only when it changed (once a second at most): a lookup
            // does not dirty the line.
            let stamp = ((*s).now >> FLOW_STAMP_SHIFT) as u32;
            if (w1 >> 32) as u32 != stamp {
                write_volatile((w.add(2 * i + 1) as *mut u32).add(1), stamp);
            }
            return lb4_present_backend(s, u32::from(backend));
        }
    }
    false
}

/// Computes the flow's keyed hash (to the scratch; the key from `lb_flows_ctl`,
/// an inlined lookup of a line that stays cached) and loads its set's line.
#[inline(always)]
fn lb_flow_touch(s: *mut Scratch) {
    let Some(ctl) = lookup_at::<_, LbFlowsCtl>(&lb_flows_ctl, lb_key0()) else { return };
    unsafe {
        let h = lb_flow_hash(&(*ctl).seed, FLOW_FAMILY_V4, &(*s).words);
        (*s).fhash = h;
        (*s).key = lb_flow_set(h);
        if let Some(set) = lookup_at::<_, u64>(&lb_flows, s.cast()) {
            // Volatile: kept though its value is not used.
            let _ = read_volatile(set);
        }
    }
}

/// The flow in `s`'s set in `lb_flows` (its hash from [`lb_flow_touch`]); its tag
/// goes to the scratch.
#[inline(always)]
fn lb_flow_set_of(s: *mut Scratch) -> Option<*mut LbFlowSet> {
    unsafe {
        let h = (*s).fhash;
        (*s).ftag = lb_flow_tag(h, (*s).service.id);
        (*s).key = lb_flow_set(h);
        lookup_at::<_, LbFlowSet>(&lb_flows, s.cast())
    }
}

/// Pins the flow in `s` to the backend in the scratch (its second packet): in the
/// way of its set that holds it already, else the first empty one, else the one
/// looked up least recently (counted `FlowEvicted` when that was within
/// FLOW_LIVE_STAMPS). Each way gets a score and the highest wins, so that one
/// register carries the choice (more would be spilled to the stack: speculation
/// barriers without CAP_PERFMON): 2 for the flow's own way, 1 for an empty one,
/// else how old its stamp is, above the way's rank. The second word is written
/// first: a reader between the two stores sees the old tag with the new check,
/// which matches nothing.
#[inline(always)]
fn lb_flow_insert(s: *mut Scratch) {
    let Some(set) = lb_flow_set_of(s) else { return };
    let w = set as *mut u64;
    let live = unsafe {
        let tag = (*s).ftag;
        let mut best = 0u64;
        for i in 0..FLOW_WAYS as u64 {
            let t = *w.add(2 * i as usize);
            let score = if t == tag {
                2 << 34
            } else if t == 0 {
                1 << 34
            } else {
                u64::from(!((*w.add(2 * i as usize + 1) >> 32) as u32))
            };
            best = best.max(score << 2 | (3 - i));
        }
        // Through the scratch: the verifier then sees one unknown offset on every
        // path (a variable offset that differs between paths is refused without
        // CAP_PERFMON).
        write_volatile(&raw mut (*s).key2, (3 - (best & 3)) as u32);
        let e = w.add(2 * (read_volatile(&(*s).key2) & (FLOW_WAYS - 1)) as usize);
        let stamp = ((*s).now >> FLOW_STAMP_SHIFT) as u32;
        write_volatile(e.add(1), lb_flow_word1(tag, (*s).backend_id as u16, stamp));
        write_volatile(e, tag);
        best >> 2 < 1 << 34 && stamp.wrapping_sub(!((best >> 2) as u32)) <= FLOW_LIVE_STAMPS
    };
    // Counted last: nothing else is live across the counter's lookup.
    if live {
        stats::count_reason(s, Reason::FlowEvicted, 0);
    }
}

/// A flow's first packet: the ring's backend (to the scratch), recorded in its
/// `lb4_first_packets` slot (over whatever flow was there) for its second packet to
/// pin. No flow table is touched: a flood of first packets costs array writes and
/// evicts nothing.
#[inline(always)]
fn lb4_first_packet(s: *mut Scratch) -> bool {
    if !lb4_ring_backend(s) {
        return false;
    }
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
    true
}

/// Whether the flow in `s` had its first packet recorded in its slot (whole: see
/// [`Lb4FirstPacket`]) and that backend still exists (then in the scratch); the
/// slot is cleared, as the flow is about to be pinned.
#[inline(always)]
fn lb4_second_packet(s: *mut Scratch) -> bool {
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
        lb4_present_backend(s, (*p).backend)
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

/// Drops this CPU's cached answer for the flow in `s`, if the cache holds one.
#[inline(always)]
fn lb4_cache_forget(s: *mut Scratch) {
    let Some(e) = lb4_cache_slot(s) else { return };
    let w = e as *mut u64;
    unsafe {
        if *w == (*s).words[0] && *w.add(1) == (*s).words[1] {
            write_volatile(w, 0); // volatile: see lb4_second_packet
            write_volatile(w.add(1), 0);
        }
    }
}

/// Whether backend `id` exists (then it and its id in the scratch); counts a
/// re-hash when it does not.
#[inline(always)]
fn lb4_present_backend(s: *mut Scratch, id: u32) -> bool {
    if lb4_backend(s, id) {
        return true;
    }
    stats::count_reason(s, Reason::FlowRehashed, 0);
    false
}

/// Whether backend `id` exists: copied with its id to the scratch.
#[inline(always)]
fn lb4_backend(s: *mut Scratch, id: u32) -> bool {
    unsafe {
        (*s).backend_id = id;
        (*s).key = id;
        match lookup_at::<_, Lb4Backend>(&lb4_backends, s.cast()) {
            Some(b) if (*b).flags & BACKEND_PRESENT != 0 => {
                lb4_copy_words::<2>((&raw mut (*s).backend).cast(), b.cast());
                true
            }
            _ => false,
        }
    }
}

/// Maglev lookup: the backend of the slot the flow hash picks in the service's
/// ring, to the scratch.
#[inline(always)]
fn lb4_ring_backend(s: *mut Scratch) -> bool {
    unsafe {
        let svc = (*s).service;
        if svc.ring_size == 0 {
            return false;
        }
        let fkey: Lb4FlowKey = core::mem::transmute((*s).words);
        let hash = flow_hash(fkey.src, fkey.dst, fkey.sport, fkey.dport, fkey.proto);
        (*s).key = svc.ring_offset.wrapping_add(hash % svc.ring_size);
        let id = match lookup_at::<_, u32>(&lb4_ring, s.cast()) {
            Some(id) => *id,
            None => return false,
        };
        id != NO_BACKEND && lb4_backend(s, id)
    }
}
