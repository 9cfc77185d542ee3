//! What IPv4 (lb4.rs) and IPv6 (lb6.rs) balancing share: the flow cache's
//! lookup and answer, the service and held-VIP lookups, everything past them
//! (first packet, second packet, flow table, ring, backend, home, counters, the
//! rewrite), and where an ICMP error about a flow goes. The families differ only
//! in their keys and tables ([`Flows`]).
use core::ptr::{read_unaligned, read_volatile, write_unaligned, write_volatile};

use aya_ebpf::{
    bindings::{xdp_action, xdp_md},
    helpers::{bpf_ktime_get_coarse_ns, bpf_redirect, bpf_xdp_adjust_head, bpf_xdp_load_bytes},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};
use network_types::eth::EthHdr;
use vip_common::*;

use crate::{
    maps::{
        lb4_backend_stats, lb4_backends, lb4_flow_cache_ctl, lb4_ring, lb4_service_stats, lb4_vip_filter, lb_flows, lb_flows_ctl, lb_held_filter, lb_home,
        lb_key0, lb_nodes, lookup_at, Scratch,
    },
    parse::{ptr_at, verdict_call, verdict_pack, verdict_pack_or_malformed, verdict_unpack, Verdict, ETH_LEN, VLAN_ETH_LEN},
    proto::{TCP_ACK, TCP_FLAGS, TCP_SYN},
    stats,
};

/// A family's keys and tables, keyed by the flow in the scratch: what the
/// generic paths below look up for it. Each is inlined where it is used, so the
/// verifier sees the same code as from a family's own function.
pub trait Flows {
    /// Its per-CPU flow-cache entry (`Lb4FlowCacheEntry`, `Lb6FlowCacheEntry`):
    /// the key's [`Flows::WORDS`] words, then the answer.
    type CacheEntry;
    /// Its first-packet record (`Lb4FirstPacket`, `Lb6FirstPacket`).
    type FirstPacket;
    /// The flow key's words in the scratch (`words`, `words6`).
    const WORDS: usize;
    /// The scratch's key words.
    fn key(s: *const Scratch) -> *const u64;
    /// The key folded to the two words its flow-cache and first-packet slots
    /// are hashed from (and checked by, `first_packet_check`).
    fn folded(s: *const Scratch) -> (u64, u64);
    /// The flow's hash on its service's ring.
    fn ring_hash(s: *const Scratch) -> u32;
    /// Writes the flow's key words to its first-packet record `p` ([`lb_record_first`]).
    fn record_key(p: *mut u64, s: *const Scratch);
    /// A first-packet record's backend and check words.
    fn first_fields(p: *mut Self::FirstPacket) -> (*mut u32, *mut u32);
    /// The flow's keyed hash in `lb_flows` ([`lb_flow_hash`] of its family and words).
    fn flow_hash(seed: &[u64; 2], s: *const Scratch) -> u64;
    /// The `vip_filter_bit` of the flow's VIP.
    fn filter_bit(s: *const Scratch) -> u32;
    /// The flow-cache entry at the scratch's `key`.
    fn cache_at(s: *mut Scratch) -> Option<*mut Self::CacheEntry>;
    /// The answer of a flow-cache entry.
    fn cache_answer(e: *mut Self::CacheEntry) -> *mut FlowAnswer;
    /// The first-packet record at the scratch's `key`.
    fn first_at(s: *mut Scratch) -> Option<*mut Self::FirstPacket>;
    /// The flow's service: its service key (VIP, dport, proto) built in the
    /// scratch and looked up ([`lb_service`] with the family's cache).
    fn service(s: *mut Scratch) -> Option<*mut LbService>;
    /// Writes the held-VIP key of the flow's VIP on its network to the scratch
    /// (`held`, `held6`).
    fn held_key(s: *mut Scratch);
    /// The key's copy in its held slot (maps::held4_slot, maps::held6_slot).
    fn held_slot(s: *mut Scratch) -> Option<*const HeldVip>;
    /// The key's entry in the family's held table (`arp_held`, `ndp_held`).
    fn held_table(s: *mut Scratch) -> Option<*mut HeldVip>;
    /// The held key's previous holder (`arp_handoff`, `ndp_handoff`), a node_mac_key.
    fn handoff(s: *mut Scratch) -> Option<*const u64>;
    /// The EtherType the family's asks go under (`ETH_P_ASK4`, `ETH_P_ASK6`).
    const ASK: u16;
    /// The flow's IP protocol.
    fn proto(s: *const Scratch) -> u8;
}

/// The [`Flows`] items that only name a family's key and tables, written once
/// for both: `key` the scratch field of its key words (`words: N` of them,
/// `flow` the key type they are, `ring` its ring hash and `family` its
/// `lb_flows` family), `cache` and `first` its flow-cache and first-packet maps
/// with their value types, `held` its held table and scratch key field after
/// the slot `slot` gives, `handoff` its previous-holder map (same key) and
/// `ask` the EtherType of its asks.
macro_rules! lb_tables {
    (
        key: $key:ident, words: $words:literal, flow: $flow:ty, ring: $ring:path, family: $family:expr,
        cache: $cache:ident<$entry:ty>, first: $first:ident<$record:ty>, held: $held:ident at $hkey:ident, slot: $slot:path,
        handoff: $handoff:ident, ask: $ask:expr $(,)?
    ) => {
        type CacheEntry = $entry;
        type FirstPacket = $record;
        const WORDS: usize = $words;
        const ASK: u16 = $ask;

        #[inline(always)]
        fn proto(s: *const $crate::maps::Scratch) -> u8 {
            let k: $flow = unsafe { core::mem::transmute((*s).$key) };
            k.proto
        }

        #[inline(always)]
        fn handoff(s: *mut $crate::maps::Scratch) -> Option<*const u64> {
            $crate::maps::lookup_at::<_, u64>(&$handoff, unsafe { &raw const (*s).$hkey }.cast()).map(|p| p as *const u64)
        }

        #[inline(always)]
        fn key(s: *const $crate::maps::Scratch) -> *const u64 {
            unsafe { (&raw const (*s).$key).cast() }
        }

        #[inline(always)]
        fn ring_hash(s: *const $crate::maps::Scratch) -> u32 {
            let k: $flow = unsafe { core::mem::transmute((*s).$key) };
            $ring(k.src, k.dst, k.sport, k.dport, k.proto)
        }

        #[inline(always)]
        fn flow_hash(seed: &[u64; 2], s: *const $crate::maps::Scratch) -> u64 {
            vip_common::lb_flow_hash(seed, $family, unsafe { &(*s).$key })
        }

        #[inline(always)]
        fn cache_at(s: *mut $crate::maps::Scratch) -> Option<*mut $entry> {
            $crate::maps::lookup_at::<_, $entry>(&$cache, s.cast())
        }

        #[inline(always)]
        fn cache_answer(e: *mut $entry) -> *mut vip_common::FlowAnswer {
            unsafe { &raw mut (*e).answer }
        }

        #[inline(always)]
        fn first_at(s: *mut $crate::maps::Scratch) -> Option<*mut $record> {
            $crate::maps::lookup_at::<_, $record>(&$first, s.cast())
        }

        #[inline(always)]
        fn first_fields(p: *mut $record) -> (*mut u32, *mut u32) {
            unsafe { (&raw mut (*p).backend, &raw mut (*p).check) }
        }

        #[inline(always)]
        fn held_slot(s: *mut $crate::maps::Scratch) -> Option<*const vip_common::HeldVip> {
            $slot(s)
        }

        #[inline(always)]
        fn held_table(s: *mut $crate::maps::Scratch) -> Option<*mut vip_common::HeldVip> {
            $crate::maps::lookup_at::<_, vip_common::HeldVip>(&$held, unsafe { &raw const (*s).$hkey }.cast())
        }
    };
}
pub(crate) use lb_tables;

/// Whether the `F::WORDS` words at `p` are the flow's key in `s`.
#[inline(always)]
fn lb_key_is<F: Flows>(p: *const u64, s: *const Scratch) -> bool {
    let k = F::key(s);
    for i in 0..F::WORDS {
        if unsafe { *p.add(i) != *k.add(i) } {
            return false;
        }
    }
    true
}

/// Whether the TCP or UDP header at `off` (a constant: a packet pointer takes no
/// variable offset without CAP_PERFMON) is a TCP SYN without ACK: a new connection.
#[inline(always)]
pub fn lb_syn_at(ctx: &XdpContext, off: usize, proto: u8) -> bool {
    proto == PROTO_TCP && matches!(ptr_at::<u8>(ctx, off + TCP_FLAGS), Ok(f) if unsafe { *f } & (TCP_SYN | TCP_ACK) == TCP_SYN)
}

/// The ports word of the TCP or UDP header at `off`, a variable offset (past IP
/// options or IPv6 extension headers, rare), and whether it is a TCP SYN without
/// ACK: copied by a helper, which takes the variable offset the verifier refuses
/// on a packet pointer.
#[inline(always)]
pub fn lb_ports_at(ctx: &XdpContext, off: usize, proto: u8) -> Result<(u32, bool), ()> {
    let mut ports = 0u32;
    if unsafe { bpf_xdp_load_bytes(ctx.ctx, off as u32, (&mut ports as *mut u32).cast(), 4) } != 0 {
        return Err(());
    }
    let mut flags = 0u8;
    let syn = proto == PROTO_TCP
        && unsafe { bpf_xdp_load_bytes(ctx.ctx, (off + TCP_FLAGS) as u32, (&mut flags as *mut u8).cast(), 1) } == 0
        && flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    Ok((ports, syn))
}

/// The flow cache first (the flow's key and SYN flag in the scratch `s`): a hit
/// is the whole answer, with no map helper call (array lookups are inlined by
/// the verifier). On a miss (None) the flow-table line starts coming before the
/// family's call into its slow path ([`lb_touch_early`]), which [`lb_miss`] is.
#[inline(always)]
pub fn lb_cache<F: Flows>(ctx: &XdpContext, s: *mut Scratch) -> Result<Option<Verdict>, ()> {
    if let Some(e) = lb_cache_lookup::<F>(s) {
        // A SYN skips it: its flow may be a reused 5-tuple whose cached answer is
        // stale (the flag read back from the scratch, not kept in a register). So
        // does a frame to a group MAC, which only the VIP's fresh holder may handle.
        // A frame not to our MAC the answer was computed for skips it too: a group
        // frame, or one a switch flooded to us for another host (lb_other_host).
        if unsafe { read_volatile(&(*s).syn) } == 0
            && lb_dst_is(ctx, F::cache_answer(e))?
            && lb_key_is::<F>(e.cast(), s)
            && lb_answer_hit(F::cache_answer(e), s)
        {
            return lb_cached(ctx, F::cache_answer(e), s).map(Some);
        }
    }
    lb_touch_early::<F>(s);
    Ok(None)
}

/// This CPU's flow-cache slot for the flow in `s` (its slot and the current
/// epoch recorded in `s`).
#[inline(always)]
fn lb_cache_lookup<F: Flows>(s: *mut Scratch) -> Option<*mut F::CacheEntry> {
    let ctl = lookup_at::<_, FlowCacheCtl>(&lb4_flow_cache_ctl, lb_key0()).map(|c| unsafe { *c }).unwrap_or_default();
    unsafe {
        (*s).epoch = ctl.epoch;
        let (h0, h1) = F::folded(s);
        (*s).key = flow_cache_slot(h0, h1) & ctl.slot_mask;
        (*s).cache_slot = (*s).key;
    }
    F::cache_at(s)
}

/// This CPU's flow-cache slot for the flow in `s`, found again past the hit path
/// (an inlined array lookup) rather than kept in a register.
#[inline(always)]
fn lb_cache_slot<F: Flows>(s: *mut Scratch) -> Option<*mut F::CacheEntry> {
    unsafe { (*s).key = (*s).cache_slot };
    F::cache_at(s)
}

/// Drops this CPU's cached answer for the flow in `s`, if any.
#[inline(always)]
fn lb_cache_forget<F: Flows>(s: *mut Scratch) {
    let Some(e) = lb_cache_slot::<F>(s) else { return };
    let w = e as *mut u64;
    if lb_key_is::<F>(w, s) {
        for i in 0..F::WORDS {
            lb_zero(unsafe { w.add(i) });
        }
    }
}

/// The flow's cache slot with its key written (as words, see [`lb_copy_words`]),
/// for [`lb_answer_store`].
#[inline(always)]
fn lb_cache_claim<F: Flows>(s: *mut Scratch) -> Option<*mut FlowAnswer> {
    let e = lb_cache_slot::<F>(s)?;
    let (w, k) = (e as *mut u64, F::key(s));
    for i in 0..F::WORDS {
        unsafe { write_volatile(w.add(i), read_volatile(k.add(i))) };
    }
    Some(F::cache_answer(e))
}

/// The first-packet slot of the flow in `s` (the key in `s`).
#[inline(always)]
fn lb_first_slot<F: Flows>(s: *mut Scratch) -> Option<*mut F::FirstPacket> {
    let (h0, h1) = F::folded(s);
    unsafe { (*s).key = first_packet_slot(h0, h1) };
    F::first_at(s)
}

/// Records the flow's first packet, whose backend [`lb_ring_backend`] put in
/// the scratch, in its first-packet slot: its key, the backend, and the check
/// of both (see `Lb4FirstPacket`).
#[inline(always)]
fn lb_record_first<F: Flows>(s: *mut Scratch) {
    let Some(p) = lb_first_slot::<F>(s) else { return };
    // Folded before the key is written: the record's stores may alias the scratch.
    let (h0, h1) = F::folded(s);
    F::record_key(p.cast(), s);
    let (backend, check) = F::first_fields(p);
    unsafe {
        *backend = (*s).backend_id;
        *check = first_packet_check(h0, h1, (*s).backend_id);
    }
}

/// Whether the flow's first packet was recorded (the record checked whole) and
/// its backend still exists (then in the scratch); the record is cleared.
#[inline(always)]
fn lb_second_packet<F: Flows>(s: *mut Scratch) -> bool {
    let Some(p) = lb_first_slot::<F>(s) else { return false };
    let (backend, check) = F::first_fields(p);
    unsafe {
        let (h0, h1) = F::folded(s);
        if !lb_key_is::<F>(p.cast(), s) || *check != first_packet_check(h0, h1, *backend) {
            return false;
        }
        let w = p as *mut u64;
        for i in 0..F::WORDS {
            lb_zero(w.add(i));
        }
        lb_present_backend(s, *backend)
    }
}

/// Clears a word of a record. Volatile: two plain zero stores become a memset,
/// whose pointer arithmetic the verifier refuses without CAP_PERFMON.
#[inline(always)]
fn lb_zero(w: *mut u64) {
    unsafe { write_volatile(w, 0) };
}

/// Whether the frame goes to a broadcast or multicast MAC: it reaches every node,
/// so only the VIP's fresh holder may handle it, or every node's stack would
/// answer it too.
#[inline(always)]
fn lb_group(ctx: &XdpContext) -> Result<bool, ()> {
    let eth: *const EthHdr = ptr_at(ctx, 0)?;
    Ok(unsafe { (*eth).dst_addr[0] } & 1 != 0)
}

/// Whether the frame is addressed to the MAC of the cached answer `a` (ours on
/// the interface it was computed for, written after the backend's): never a
/// group frame.
#[inline(always)]
fn lb_dst_is(ctx: &XdpContext, a: *const FlowAnswer) -> Result<bool, ()> {
    let dst = ptr_at::<[u8; 6]>(ctx, 0)? as *const u8;
    let ours = unsafe { (*a).eth.as_ptr().add(6) };
    Ok(unsafe {
        read_unaligned(dst as *const u32) == read_unaligned(ours as *const u32)
            && read_unaligned(dst.add(4) as *const u16) == read_unaligned(ours.add(4) as *const u16)
    })
}

/// Whether the frame, for a VIP held here (our MAC on its network in the
/// scratch), is unicast to another MAC: a switch floods a frame to a MAC it has
/// not learnt or whose port went down, so every node on the segment may see a
/// frame its holder also sees. That host's to balance (and its stack's, if it
/// has one): balanced here too, it would reach a backend twice.
#[inline(always)]
fn lb_other_host(ctx: &XdpContext, s: *const Scratch) -> Result<bool, ()> {
    let dst = ptr_at::<[u8; 6]>(ctx, 0)? as *const u8;
    let ours = unsafe { (&raw const (*s).mac) as *const u8 };
    Ok(unsafe {
        *dst & 1 == 0
            && (read_unaligned(dst as *const u32) != read_unaligned(ours as *const u32)
                || read_unaligned(dst.add(4) as *const u16) != read_unaligned(ours.add(4) as *const u16))
    })
}

/// The service whose key words (`W`) are at byte `OFF` of the scratch, through
/// this CPU's service cache `cache`; on a miss `lookup` (the family's hash lookup,
/// given the key) finds it and it is cached. The epoch is read before the lookup:
/// a service the agent changes afterwards is cached under the epoch its bump
/// replaces, never under the new one. Only `s` lives across the lookups (see
/// maps::Scratch): the key is read at its offset from `s` each time, the slot and
/// the epoch wait in the scratch, and the entry gets its key before the hash
/// lookup, with an epoch no ctl reaches (`u64::MAX`), and its epoch last.
#[inline(always)]
pub fn lb_service<const W: usize, const OFF: usize>(
    s: *mut Scratch,
    cache: &PerCpuArray<ServiceCacheEntry<W>>,
    lookup: impl FnOnce(*const u8) -> Option<*mut LbService>,
) -> Option<*mut LbService> {
    let key = |s: *mut Scratch, i: usize| unsafe { *(s as *const u8).add(OFF).cast::<u64>().add(i) };
    let Some(ctl) = lookup_at::<_, FlowCacheCtl>(&lb4_flow_cache_ctl, lb_key0()) else {
        return lookup(unsafe { (s as *const u8).add(OFF) });
    };
    unsafe {
        write_volatile(&raw mut (*s).svc_epoch, (*ctl).epoch);
        let mut words = [0u64; W];
        for (i, w) in words.iter_mut().enumerate() {
            *w = key(s, i);
        }
        let slot = service_cache_slot(&words);
        (*s).key = slot;
        (*s).key2 = slot;
        if let Some(e) = lookup_at::<_, ServiceCacheEntry<W>>(cache, s.cast()) {
            if (*e).epoch == read_volatile(&(*s).svc_epoch) && lb_service_cached(e, |i| key(s, i)) {
                return Some(&raw mut (*e).service);
            }
            for i in 0..W {
                write_volatile(&raw mut (*e).key[i], service_cache_word::<W>(i, key(s, i)));
            }
            write_volatile(&raw mut (*e).epoch, u64::MAX);
        }
    }
    let p = lookup(unsafe { (s as *const u8).add(OFF) })?;
    unsafe {
        (*s).key = read_volatile(&(*s).key2);
        if let Some(e) = lookup_at::<_, ServiceCacheEntry<W>>(cache, s.cast()) {
            lb_copy_words::<2>((&raw mut (*e).service).cast(), p.cast());
            write_volatile(&raw mut (*e).epoch, read_volatile(&(*s).svc_epoch));
        }
    }
    Some(p)
}

/// Whether the service-cache entry `e` holds the key whose words `key` gives, a
/// word at a time.
#[inline(always)]
fn lb_service_cached<const W: usize>(e: *const ServiceCacheEntry<W>, key: impl Fn(usize) -> u64) -> bool {
    for i in 0..W {
        if unsafe { (*e).key[i] } != service_cache_word::<W>(i, key(i)) {
            return false;
        }
    }
    true
}

/// Whether `bit` of `lb4_vip_filter` (`vip_filter_bit` of a destination, either
/// family) is clear: no service uses that address. The filter is looked up here,
/// so that only the caller's `ctx`, scratch and `bit` live across the lookup.
#[inline(always)]
pub fn lb_not_vip(bit: u32) -> Result<bool, ()> {
    lb_bit_clear(&lb4_vip_filter, bit)
}

/// Whether `bit` of a one-slot bitmap map (`lb4_vip_filter`, `lb_held_filter`) is clear.
#[inline(always)]
fn lb_bit_clear(map: &Array<[u32; VIP_FILTER_WORDS as usize]>, bit: u32) -> Result<bool, ()> {
    let words = lookup_at::<_, [u32; VIP_FILTER_WORDS as usize]>(map, lb_key0()).ok_or(())?;
    Ok(unsafe { (*words)[(bit / 32) as usize & (VIP_FILTER_WORDS as usize - 1)] } & (1 << (bit % 32)) == 0)
}

/// The family's path past the flow cache (its slow path, a function of its own:
/// lb4::lb4_slow, lb6::lb6_slow): the held-VIP and service lookups, then
/// [`lb_balance`]. Only `ctx` and `s` live across its map lookups: what a later
/// step needs goes to the scratch (the service, the held entry's MAC and
/// freshness, the backend), and every key is built there. A value kept in a
/// register across a lookup is spilled to the stack once more than four are live,
/// each spill a speculation barrier without CAP_PERFMON (see maps::LB_KEY0).
#[inline(always)]
pub fn lb_miss<F: Flows, const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    let held = lb_held::<F>(s);
    lb_touch_if::<F>(s, held);
    match F::service(s) {
        Some(p) => lb_copy_words::<2>(unsafe { &raw mut (*s).service }.cast(), p.cast()),
        None if unsafe { (*s).fragment } != 0 => return Ok((xdp_action::XDP_PASS, Reason::PassedFragmentNoService)),
        None => return Ok((xdp_action::XDP_PASS, Reason::PassedNotVip)),
    }
    lb_balance::<F, L2>(ctx, s, held)
}

/// Whether this node has a held entry (`arp_held`, `ndp_held`) for the flow's
/// VIP on its network (its MAC and freshness then in the scratch): its held slot
/// first, then the table. An entry whose deadline has passed means the agent
/// stopped vouching for it (fencing, or released after the VIP moved): not
/// balanced for new flows. The coarse clock costs a few ns where
/// `bpf_ktime_get_ns` costs ~25; it lags by up to a tick, which the agent covers
/// by storing deadlines two ticks early. It is read first, so that the entry's
/// pointer does not live across the call.
#[inline(always)]
fn lb_held<F: Flows>(s: *mut Scratch) -> bool {
    unsafe { write_volatile(&raw mut (*s).now, bpf_ktime_get_coarse_ns()) };
    F::held_key(s);
    if let Some(h) = F::held_slot(s) {
        lb_held_entry(s, h);
        return true;
    }
    let Some(h) = F::held_table(s) else {
        return false;
    };
    lb_held_entry(s, h);
    true
}

/// The flow in `s`, of a service found (in the scratch) and of a VIP this node
/// holds on its network (`held`; its MAC and freshness in the scratch): the
/// flow-table and ring decisions, then the counters and the rewrite. Only `ctx`
/// and `s` live across its map lookups (see maps::Scratch).
#[inline(always)]
fn lb_balance<F: Flows, const L2: usize>(ctx: &XdpContext, s: *mut Scratch, held: bool) -> Result<Verdict, ()> {
    // Asks come untagged alone (parse::l3): a VLAN's copy of this path has none.
    if L2 == ETH_LEN && unsafe { read_volatile(&(*s).asked) } != 0 {
        return Ok(verdict_unpack(lb_answer_call::<F, L2>(ctx.ctx, s)));
    }
    if !held {
        return lb_not_held(ctx);
    }
    if lb_other_host(ctx, s)? {
        return Ok((xdp_action::XDP_PASS, Reason::PassedOtherHost));
    }
    if let Some(v) = lb_stale(ctx, s)? {
        return Ok(v);
    }
    // Whether the flow is in the flow table now (only those are memoised in the cache).
    let established = if unsafe { (*s).syn } != 0 {
        // A new connection, also on a reused 5-tuple whose pin is stale: the ring
        // decides, and its next packet pins that choice over any old one.
        lb_cache_forget::<F>(s);
        if !lb_first_packet::<F>(s) {
            return Ok((xdp_action::XDP_DROP, Reason::DropNoBackend));
        }
        false
    } else if lb_second_packet::<F>(s) {
        // Its second packet: the flow is pinned to where its first went.
        lb_flow_insert(s);
        true
    } else if lb_flow_backend(s, true) {
        true
    } else if let Some(v) = lb_asked::<F, L2>(ctx, s) {
        return Ok(v);
    } else if lb_first_packet::<F>(s) {
        // A flow seen for the first time without a SYN (UDP, or TCP picked up
        // mid-connection after a failover): recorded like a SYN.
        false
    } else {
        return Ok((xdp_action::XDP_DROP, Reason::DropNoBackend));
    };
    lb_deliver::<F, L2>(ctx, s, established)
}

/// A TCP segment past its first (no SYN) to a VIP held here fresh, of a flow
/// neither pinned nor recorded here: it began before this node took the VIP,
/// and its pin, if any, is at the node that held it before (`handoff`), whose
/// ring may have been another (a backend joined, left or was drained since).
/// Hashed on ours, it would go to another backend whenever the two rings differ
/// at its slot, which resets the connection. So it is sent to the previous
/// holder under the family's ask EtherType, which that node's data path answers
/// from its pins (`lb_answer_ask`); nothing is recorded here. Only while the
/// previous holder is a backend here (in `lb_nodes`: its data path is taken to
/// run), untagged on the frame's own network, for a client's frame: a frame from
/// the previous holder is its answer, passed here (its pin or ring chose this
/// node), and one from another node is balanced as before, so no frame is asked
/// about twice. None: the ring decides, as without a previous holder.
#[inline(always)]
fn lb_ask<F: Flows, const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Option<Verdict>, ()> {
    if unsafe { read_volatile(&(*s).fresh) } == 0 || unsafe { read_volatile(&(*s).fragment) } != 0 {
        return Ok(None);
    }
    let Some(prev) = F::handoff(s) else { return Ok(None) };
    unsafe { write_volatile(&raw mut (*s).prev, *prev) };
    lb_src_node(ctx, s)?;
    if unsafe { read_volatile(&(*s).node) == read_volatile(&(*s).prev) } {
        return Ok(Some((xdp_action::XDP_PASS, Reason::PassedFromPrevious)));
    }
    if lookup_at::<_, u32>(&lb_nodes, unsafe { &raw const (*s).node }.cast()).is_some() {
        return Ok(None);
    }
    unsafe { write_volatile(&raw mut (*s).node, read_volatile(&(*s).prev)) };
    if lookup_at::<_, u32>(&lb_nodes, unsafe { &raw const (*s).node }.cast()).is_none() {
        return Ok(None);
    }
    let p = ptr_at::<[u8; ETH_LEN]>(ctx, 0)? as *mut u8;
    unsafe {
        let prev = read_volatile(&(*s).prev);
        write_unaligned(p as *mut u32, prev as u32);
        write_unaligned(p.add(4) as *mut u16, (prev >> 32) as u16);
        lb_copy_mac(p.add(6) as *mut [u8; 6], &raw const (*s).mac);
        write_unaligned(p.add(12) as *mut u16, F::ASK.to_be());
    }
    Ok(Some((xdp_action::XDP_TX, Reason::AskedPrevious)))
}

/// What [`lb_ask_call`] returns when the ring is to decide.
const NOT_ASKED: u64 = u64::MAX;

/// [`lb_ask`] for a TCP segment (the protocol checked inline: a new UDP flow's
/// first packet makes no call), in a function of its own (BPF to BPF): inlined,
/// its lookups and rewrite made the slow path spill registers on the new-flow
/// paths (stack accesses: speculation barriers without CAP_PERFMON).
#[inline(always)]
fn lb_asked<F: Flows, const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Option<Verdict> {
    if L2 != ETH_LEN || F::proto(s) != PROTO_TCP {
        return None;
    }
    let v = lb_ask_call::<F, L2>(ctx.ctx, s);
    (v != NOT_ASKED).then(|| verdict_unpack(v))
}

#[inline(never)]
fn lb_ask_call<F: Flows, const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    let ctx = XdpContext::new(ctx);
    match lb_ask::<F, L2>(&ctx, s) {
        Ok(None) => NOT_ASKED,
        Ok(Some(v)) => verdict_pack(v),
        Err(()) => verdict_pack_or_malformed(&ctx, s, Err(())),
    }
}

/// [`lb_answer_ask`], a function of its own as [`lb_ask_call`]: a second copy of
/// delivery inlined in the slow path spilled its registers.
#[inline(never)]
fn lb_answer_call<F: Flows, const L2: usize>(ctx: *mut xdp_md, s: *mut Scratch) -> u64 {
    verdict_call!(ctx, s, lb_answer_ask::<F, L2>)
}

/// A frame another node asked about ([`lb_ask`] there; its EtherType restored,
/// parse::l3), held here or not: to the backend of its pin here, else the
/// ring's, as a packet of the flow is, from our MAC the asker addressed. Nothing
/// is recorded or pinned (the pin found is refreshed); never asked on.
#[inline(always)]
fn lb_answer_ask<F: Flows, const L2: usize>(ctx: &XdpContext, s: *mut Scratch) -> Result<Verdict, ()> {
    lb_copy_mac(unsafe { &raw mut (*s).mac }, ptr_at::<[u8; 6]>(ctx, 0)?);
    lb_flow_touch::<F>(s);
    let pinned = lb_flow_backend(s, true);
    unsafe { write_volatile(&raw mut (*s).key2, pinned as u32) };
    if !pinned && !lb_ring_backend(s, F::ring_hash(s)) {
        return Ok((xdp_action::XDP_DROP, Reason::DropNoBackend));
    }
    let (action, _) = lb_deliver::<F, L2>(ctx, s, false)?;
    Ok((action, if unsafe { read_volatile(&(*s).key2) } != 0 { Reason::AskAnsweredPinned } else { Reason::AskAnsweredRing }))
}

/// Writes the frame's source MAC to the scratch as its `lb_nodes` key (`node`).
#[inline(always)]
fn lb_src_node(ctx: &XdpContext, s: *mut Scratch) -> Result<(), ()> {
    unsafe {
        let src = (ptr_at::<[u8; 12]>(ctx, 0)? as *const u8).add(6);
        (*s).node = u64::from(read_unaligned(src as *const u32)) | u64::from(read_unaligned(src.add(4) as *const u16)) << 32;
    }
    Ok(())
}

/// What a stale entry (fenced, or released when the VIP moved) does with a
/// frame that is not its to balance: a group frame is dropped (only a fresh
/// holder may handle one, or every node's stack would answer it too), a frame
/// from another node passed to the stack. None: the frame is balanced (fresh
/// entries always).
///
/// A client's frame is balanced as by a fresh holder (its pin, else the ring's
/// backend with its first packet recorded): a client keeps sending to our MAC
/// until the new owner's announcement reaches it, and the new owner's ring sends
/// a flow it never saw to the same backend, so a connection opened meanwhile
/// survives the move (given to our stack, it would break as soon as the client
/// follows the new owner). A frame from another node's MAC was forwarded here by
/// a holder whose ring or pin chose this node: forwarded again, two stale
/// holders with different rings or pins could pass it to each other for ever
/// (layer 2 has no hop limit). Nodes are told by their MACs in `lb_nodes`: only
/// `ctx` and `s` live across its lookup; fresh entries never look.
#[inline(always)]
fn lb_stale(ctx: &XdpContext, s: *mut Scratch) -> Result<Option<Verdict>, ()> {
    if unsafe { read_volatile(&(*s).fresh) } != 0 {
        return Ok(None);
    }
    if lb_group(ctx)? {
        return Ok(Some((xdp_action::XDP_DROP, Reason::DropGroupNotOwner)));
    }
    lb_src_node(ctx, s)?;
    let from_node = lookup_at::<_, u32>(&lb_nodes, unsafe { &raw const (*s).node }.cast()).is_some();
    Ok(from_node.then_some((xdp_action::XDP_PASS, Reason::PassedNotOwner)))
}

/// A held entry found (`arp_held`, `ndp_held` or a copy in a held slot): whether
/// it is fresh, against the clock read before, and its MAC, to the scratch.
#[inline(always)]
fn lb_held_entry(s: *mut Scratch, h: *const HeldVip) {
    unsafe {
        (*s).fresh = ((*s).now <= (*h).deadline_ns) as u32;
        lb_copy_mac(&raw mut (*s).mac, &raw const (*h).mac);
    }
}

/// A frame for a VIP service this node does not hold (another node owns it): sent
/// to this node as a backend, or stray; the stack decides.
#[inline(always)]
fn lb_not_held(ctx: &XdpContext) -> Result<Verdict, ()> {
    Ok(if lb_group(ctx)? { (xdp_action::XDP_DROP, Reason::DropGroupNotOwner) } else { (xdp_action::XDP_PASS, Reason::PassedNotOwner) })
}

/// An ICMP error about the flow in `s` (its key as the flow's own packets give
/// it), of a service, to a VIP held here or not: to the backend that serves the
/// flow, which answers the client directly and so must hear of the path's MTU.
/// The flow's pin in `lb_flows`, else the ring's choice; nothing is recorded,
/// pinned, memoised or refreshed (the error is no packet of the flow, and may be
/// forged). `pass` is the family's reason for ICMP it leaves to the stack, given
/// when the flow has no service or the ring no backend.
#[inline(always)]
pub fn lb_icmp_error<F: Flows, const L2: usize>(ctx: &XdpContext, s: *mut Scratch, pass: Reason) -> Result<Verdict, ()> {
    let Some(svc) = F::service(s) else { return Ok((xdp_action::XDP_PASS, pass)) };
    lb_copy_words::<2>(unsafe { &raw mut (*s).service }.cast(), svc.cast());
    if !lb_held::<F>(s) {
        return lb_not_held(ctx);
    }
    lb_flow_touch::<F>(s);
    // As for the flow's packets.
    if lb_other_host(ctx, s)? {
        return Ok((xdp_action::XDP_PASS, Reason::PassedOtherHost));
    }
    if let Some(v) = lb_stale(ctx, s)? {
        return Ok(v);
    }
    if !lb_flow_backend(s, false) && !lb_ring_backend(s, F::ring_hash(s)) {
        return Ok((xdp_action::XDP_PASS, pass));
    }
    Ok(match lb_deliver::<F, L2>(ctx, s, false)? {
        (action, Reason::Forwarded | Reason::ForwardedHome) => (action, Reason::ForwardedIcmpError),
        v => v,
    })
}

/// The frame of a flow of a VIP held here, to the backend in the scratch: passed
/// when it is this node, else its MAC written in and sent back out (or out of
/// home); counted per service and backend. The answer is memoised in the flow
/// cache when the flow is `established` (pinned).
#[inline(always)]
fn lb_deliver<F: Flows, const L2: usize>(ctx: &XdpContext, s: *mut Scratch, established: bool) -> Result<Verdict, ()> {
    // A VIP of another network than home: its frames reach the backend out of home.
    let home = lookup_at::<_, LbHome>(&lb_home, lb_key0()).is_some_and(|h| unsafe {
        let via = (*h).ifindex != 0 && (*h).ifindex != (*s).ifindex;
        if via {
            (*s).home.ifindex = (*h).ifindex;
            lb_copy_mac(&raw mut (*s).home.mac, &raw const (*h).mac);
        }
        via
    });
    // The flow is pinned: memoise the answer for its next packets (forwards on
    // the frame's own network and local deliveries only). Not for a stale entry,
    // whose every frame must meet lb_stale (the cache answers before it).
    if established && !home && unsafe { read_volatile(&(*s).fresh) } != 0 {
        if let Some(a) = lb_cache_claim::<F>(s) {
            lb_answer_store(a, s);
        }
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
            lb_pop_tag(ctx)?;
        }
        return Ok((xdp_action::XDP_PASS, Reason::PassedLocalBackend));
    }
    if home {
        return lb_forward_home::<L2>(ctx, &b.mac, unsafe { &(*s).home });
    }
    lb_copy_macs(ptr_at::<[u8; 12]>(ctx, 0)? as *mut u8, &b.mac, unsafe { &(*s).mac });
    Ok((xdp_action::XDP_TX, Reason::Forwarded))
}

/// Whether this established flow is in `lb_flows` with a backend that still
/// exists (then in the scratch), its stamp refreshed if the clock moved on and
/// `refresh` asks. A flow whose backend was removed (unhealthy, drained) is
/// re-hashed on the current ring. The four ways of its set are one line: one cold
/// access at most.
#[inline(always)]
pub fn lb_flow_backend(s: *mut Scratch, refresh: bool) -> bool {
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
            if refresh && (w1 >> 32) as u32 != stamp {
                write_volatile((w.add(2 * i + 1) as *mut u32).add(1), stamp);
            }
            return lb_present_backend(s, u32::from(backend));
        }
    }
    false
}

/// A packet past its first (no SYN) to a VIP held here will look its flow up in
/// lb_flows, most likely a line not in the caches, after its first-packet slot:
/// both are loaded at the flow cache's miss, before the call into the slow path,
/// so that the two misses overlap each other and the held-VIP and service
/// lookups that follow. Frames for VIPs held elsewhere
/// (what backends receive) and SYNs never read the table: `lb_held_filter`'s
/// bit, an inlined array lookup, tells the first without the held-VIP hash
/// lookup (a bit set for another VIP only costs a line loaded for nothing).
/// Whether it loaded them goes to the scratch for [`lb_touch_if`].
#[inline(always)]
fn lb_touch_early<F: Flows>(s: *mut Scratch) {
    let hinted = unsafe { read_volatile(&(*s).syn) } == 0 && matches!(lb_bit_clear(&lb_held_filter, F::filter_bit(s)), Ok(false));
    unsafe { write_volatile(&raw mut (*s).touched, hinted as u32) };
    if hinted {
        lb_touch::<F>(s);
    }
}

/// Past the held-VIP lookup (`held`): what [`lb_touch_early`] did not do for a
/// packet past its first, as the filter is only a hint (a VIP held under pins
/// an older agent wrote has no bit). The flow's hash is needed past here.
#[inline(always)]
fn lb_touch_if<F: Flows>(s: *mut Scratch, held: bool) {
    if held && unsafe { read_volatile(&(*s).syn) } == 0 && unsafe { read_volatile(&(*s).touched) } == 0 {
        lb_touch::<F>(s);
    }
}

/// Loads the flow's `lb_flows` line (its hash to the scratch) and first-packet slot.
#[inline(always)]
fn lb_touch<F: Flows>(s: *mut Scratch) {
    lb_flow_touch::<F>(s);
    if let Some(p) = lb_first_slot::<F>(s) {
        // Volatile: kept though its value is not used.
        let _ = unsafe { read_volatile(p as *const u64) };
    }
}

/// Computes the flow's keyed hash (to the scratch; the key from `lb_flows_ctl`,
/// an inlined lookup of a line that stays cached; the family's words) and loads
/// its set's line.
#[inline(always)]
fn lb_flow_touch<F: Flows>(s: *mut Scratch) {
    let Some(ctl) = lookup_at::<_, LbFlowsCtl>(&lb_flows_ctl, lb_key0()) else { return };
    unsafe {
        let h = F::flow_hash(&(*ctl).seed, s);
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
pub fn lb_flow_insert(s: *mut Scratch) {
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
/// first-packet slot (over whatever flow was there) for its second packet to
/// pin. No hash table is touched: a flood of first packets costs array writes and
/// evicts nothing.
#[inline(always)]
fn lb_first_packet<F: Flows>(s: *mut Scratch) -> bool {
    if !lb_ring_backend(s, F::ring_hash(s)) {
        return false;
    }
    lb_record_first::<F>(s);
    true
}

/// Copies a MAC as a word and a half-word (see [`lb_copy_words`]).
#[inline(always)]
pub fn lb_copy_mac(dst: *mut [u8; 6], src: *const [u8; 6]) {
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
pub fn lb_copy_words<const N: usize>(dst: *mut u64, src: *const u64) {
    for i in 0..N {
        unsafe { write_volatile(dst.add(i), read_volatile(src.add(i))) };
    }
}

/// Writes the answer for the flow in `s` to its flow-cache slot's answer `a`
/// (its key written by the family). Field by field, the MACs as words: a
/// whole-struct write compiles to memmove (see [`lb_copy_words`]).
#[inline(always)]
fn lb_answer_store(a: *mut FlowAnswer, s: *const Scratch) {
    unsafe {
        (*a).epoch = (*s).epoch;
        (*a).ifindex = (*s).ifindex;
        (*a).backend = (*s).backend_id;
        lb_copy_macs((*a).eth.as_mut_ptr(), &(*s).backend.mac, &(*s).mac);
        (*a).service = (*s).service.id;
        (*a).flags = if (*s).backend.flags & BACKEND_LOCAL != 0 { FLOW_CACHE_LOCAL } else { 0 };
        (*a).hits = 0;
    }
}

/// Whether the cached answer `a` (its key matched) is current for the frame's
/// interface and not due for its periodic recheck (which counts this hit).
#[inline(always)]
fn lb_answer_hit(a: *mut FlowAnswer, s: *const Scratch) -> bool {
    unsafe {
        if (*a).epoch != (*s).epoch || (*a).ifindex != (*s).ifindex {
            return false;
        }
        let hits = (*a).hits.wrapping_add(1);
        if hits % FLOW_CACHE_RECHECK_HITS == 0 {
            return false;
        }
        (*a).hits = hits;
    }
    true
}

/// A flow-cache hit: the rewrite and the counters the slow path would have done.
/// The counters' keys are copied to the scratch first, so that only the scratch
/// and the verdict live across their lookups (not the entry, a fifth register).
#[inline(always)]
fn lb_cached(ctx: &XdpContext, a: *const FlowAnswer, s: *mut Scratch) -> Result<Verdict, ()> {
    let a = unsafe { &*a };
    unsafe {
        (*s).key = a.service;
        (*s).key2 = a.backend;
    }
    let verdict = if a.flags & FLOW_CACHE_LOCAL != 0 {
        (xdp_action::XDP_PASS, Reason::PassedLocalBackend)
    } else {
        let dst: *mut u8 = ptr_at::<[u8; 12]>(ctx, 0)? as *mut u8;
        let src = a.eth.as_ptr();
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

/// Removes the frame's 802.1Q tag: its MACs move 4 bytes on, over the tag, and
/// the head moves past them.
#[inline(always)]
fn lb_pop_tag(ctx: &XdpContext) -> Result<(), ()> {
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
fn lb_forward_home<const L2: usize>(ctx: &XdpContext, to: &[u8; 6], h: &LbHome) -> Result<Verdict, ()> {
    const TAG: usize = VLAN_ETH_LEN - ETH_LEN;
    if L2 == VLAN_ETH_LEN {
        lb_copy_macs(ptr_at::<[u8; 12]>(ctx, TAG)? as *mut u8, to, &h.mac);
        if unsafe { bpf_xdp_adjust_head(ctx.ctx, TAG as i32) } != 0 {
            return Err(());
        }
    } else {
        lb_copy_macs(ptr_at::<[u8; 12]>(ctx, 0)? as *mut u8, to, &h.mac);
    }
    if h.ifindex == ctx.ingress_ifindex() as u32 {
        return Ok((xdp_action::XDP_TX, Reason::ForwardedHome));
    }
    Ok((unsafe { bpf_redirect(h.ifindex, 0) } as u32, Reason::ForwardedHome))
}

/// Writes `to` then `ours` at `dst` (12 bytes) as words (no memmove, see above).
#[inline(always)]
fn lb_copy_macs(dst: *mut u8, to: &[u8; 6], ours: &[u8; 6]) {
    // `ours` as a half-word then a word: `dst` is 8-aligned in a flow-cache entry.
    unsafe {
        write_unaligned(dst as *mut u32, read_unaligned(to.as_ptr() as *const u32));
        write_unaligned(dst.add(4) as *mut u16, read_unaligned(to.as_ptr().add(4) as *const u16));
        write_unaligned(dst.add(6) as *mut u16, read_unaligned(ours.as_ptr() as *const u16));
        write_unaligned(dst.add(8) as *mut u32, read_unaligned(ours.as_ptr().add(2) as *const u32));
    }
}

/// Whether backend `id` exists (then it and its id in the scratch); counts a
/// re-hash when it does not.
#[inline(always)]
fn lb_present_backend(s: *mut Scratch, id: u32) -> bool {
    if lb_backend(s, id) {
        return true;
    }
    stats::count_reason(s, Reason::FlowRehashed, 0);
    false
}

/// Whether backend `id` exists: copied with its id to the scratch.
#[inline(always)]
fn lb_backend(s: *mut Scratch, id: u32) -> bool {
    unsafe {
        (*s).backend_id = id;
        (*s).key = id;
        match lookup_at::<_, LbBackend>(&lb4_backends, s.cast()) {
            Some(b) if (*b).flags & BACKEND_PRESENT != 0 => {
                lb_copy_words::<2>((&raw mut (*s).backend).cast(), b.cast());
                true
            }
            _ => false,
        }
    }
}

/// Maglev lookup: the backend of the slot `hash` picks in the service's ring
/// (in the scratch), to the scratch.
#[inline(always)]
fn lb_ring_backend(s: *mut Scratch, hash: u32) -> bool {
    unsafe {
        let svc = (*s).service;
        if svc.ring_size == 0 {
            return false;
        }
        (*s).key = svc.ring_offset.wrapping_add(hash % svc.ring_size);
        let id = match lookup_at::<_, u32>(&lb4_ring, s.cast()) {
            Some(id) => *id,
            None => return false,
        };
        id != NO_BACKEND && lb_backend(s, id)
    }
}
