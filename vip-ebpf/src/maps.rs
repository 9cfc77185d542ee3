//! The program's maps. Every map is pinned by name under the agent's bpffs
#![allow(non_upper_case_globals)]
//! directory (default /sys/fs/bpf/vip) so it outlives agent restarts.
use core::ptr::read_unaligned;

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
};
use vip_common::*;

/// Array values from a page boundary on (and the agent may mmap the map): a
/// 64-byte value is then one cache line.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// ifindex of an interface we are attached to → its MAC (source of replies and forwards).
#[map]
pub static lb_ifaces: HashMap<u32, LbIface> = HashMap::pinned(MAX_IFACES, 0);

/// (interface, 802.1Q VLAN id) of a tagged frame → the ifindex of that VLAN's
/// sub-interface, under which its VIPs are held; a VLAN absent here is not ours.
#[map]
pub static lb_vlans: HashMap<LbVlanKey, u32> = HashMap::pinned(MAX_VLANS, 0);

/// 0 → the interface this node is reached on and our MAC there (see LbHome):
/// frames to VIPs of other networks are forwarded to backends out of it.
#[map]
pub static lb_home: Array<LbHome> = Array::pinned(1, 0);

/// (ifindex, VIP) → deadline until which this node answers ARP for and balances the VIP.
#[map]
pub static arp_held: HashMap<ArpHeldKey, HeldVip> = HashMap::pinned(MAX_HELD, 0);

/// (ifindex, VIP) → ARP replies or gratuitous ARP seen from another MAC claiming
/// a VIP we hold there (`arp_conflict`): the agent re-announces those VIPs alone.
#[map]
pub static arp_conflicts: LruHashMap<ArpHeldKey, u64> = LruHashMap::pinned(MAX_HELD, 0);

/// (ifindex, VIP of another node) → the ARP answers seen claiming it there, while
/// the agent checks who answers for it (its ARP self-check writes the entry, sends
/// a request, reads and removes the entry a second later).
#[map]
pub static arp_watch: HashMap<ArpHeldKey, ArpWatch> = HashMap::pinned(MAX_ARP_WATCH, 0);

/// (ifindex, IPv6 VIP) → as `arp_held`, for the IPv6 VIPs this node answers
/// Neighbor Solicitations for (a map of its own: the IPv4 key stays 8 bytes).
#[map]
pub static ndp_held: HashMap<NdpHeldKey, HeldVip> = HashMap::pinned(MAX_HELD, 0);

/// (ifindex, IPv6 VIP) → Neighbor Advertisements seen from another MAC claiming
/// a VIP we hold there (`ndp_conflict`), as `arp_conflicts`.
#[map]
pub static ndp_conflicts: LruHashMap<NdpHeldKey, u64> = LruHashMap::pinned(MAX_HELD, 0);

/// (VIP, port, protocol) → the service's id and its ring's place in `lb4_ring`.
#[map]
pub static lb4_services: HashMap<Lb4ServiceKey, LbService> = HashMap::pinned(MAX_SERVICES, 0);

/// node_mac_key(MAC) of every backend node → 1: a stale holder never forwards
/// a frame again that one of them sent (see lb::lb_stale).
#[map]
pub static lb_nodes: HashMap<u64, u32> = HashMap::pinned(MAX_NODES, 0);

/// (ifindex, VIP) of a VIP this node took from another → node_mac_key of the
/// node that held it before (its previous holder, which may have pinned flows
/// this node never saw), written by the agent before it holds the VIP. A TCP
/// segment of a flow this node knows nothing of is asked about there rather than
/// hashed on a ring that may have changed since the flow began (lb::lb_ask).
#[map]
pub static arp_handoff: HashMap<ArpHeldKey, u64> = HashMap::pinned(MAX_HELD, 0);

/// As `arp_handoff`, for IPv6 VIPs (`ndp_held`'s key).
#[map]
pub static ndp_handoff: HashMap<NdpHeldKey, u64> = HashMap::pinned(MAX_HELD, 0);

/// backend id → backend node MAC, address and flags (BACKEND_PRESENT: slot in use,
/// BACKEND_LOCAL: pass to the stack). An array: the verifier inlines its lookups.
#[map]
pub static lb4_backends: Array<LbBackend> = Array::pinned(MAX_BACKENDS, 0);

/// ring slot (service ring_offset + index) → backend id; all services' Maglev rings.
#[map]
pub static lb4_ring: Array<u32> = Array::pinned(DEFAULT_RING_CAPACITY, 0);

/// lb_flow_set(hash) → a set of four flows past their first packet, each a tag
/// (the flow's keyed hash and service id), its backend and a stamp: connection
/// stickiness, written at a flow's second packet (data-path.md, "The flow
/// table"). One 64-byte line per set, so a lookup or insert touches one line; an
/// array, so its lookups are inlined. For every address family (lb_flow_hash
/// covers it).
#[map]
pub static lb_flows: Array<LbFlowSet> = Array::pinned(FLOW_SETS, BPF_F_MMAPABLE);

/// 0 → the flow table's random hash key (the agent writes it when it creates the
/// table; pinned with it).
#[map]
pub static lb_flows_ctl: Array<LbFlowsCtl> = Array::pinned(1, 0);

/// first_packet_slot(5-tuple) → a flow seen once and the backend its first packet
/// went to, until its second packet pins it in `lb_flows`: one-packet flows (a
/// spoofed-SYN flood) overwrite these slots alone, like the unassured entries
/// Linux conntrack drops first. An array, small enough to stay in the caches: its
/// lookups are inlined and touch no cold hash bucket (data-path.md, "New flows").
#[map]
pub static lb4_first_packets: Array<Lb4FirstPacket> = Array::pinned(FIRST_PACKET_SLOTS, 0);

/// 0 → a bitmap of VIP_FILTER_WORDS words: bit vip_filter_bit(address) set for
/// every address a service uses (the agent keeps it). Frames to other addresses
/// leave the program after this one inlined array lookup (its key the .rodata
/// zero), before the flow cache and the service hash.
#[map]
pub static lb4_vip_filter: Array<[u32; VIP_FILTER_WORDS as usize]> = Array::pinned(1, 0);

/// 0 → a bitmap as `lb4_vip_filter`'s: bit vip_filter_bit(VIP) set for every VIP
/// with an `arp_held` or `ndp_held` entry (the agent keeps it, a superset). A
/// hint, read before the held-VIP lookup: a flow's packet loads its flow-table
/// line first, so that the line's miss overlaps the lookups, and a frame for a
/// VIP held elsewhere (what a backend receives) loads none. Nothing else trusts it.
#[map]
pub static lb_held_filter: Array<[u32; VIP_FILTER_WORDS as usize]> = Array::pinned(1, 0);

/// held_slot(vip_filter_bit(VIP)) → a copy of that VIP's `arp_held` entry with its
/// key and a check word (Lb4HeldSlot), kept by the agent beside the entry: the
/// held-VIP lookup of a VIP's flows is then an inlined array lookup, not a hash
/// lookup (a call, and a hash of the key). Empty, another VIP's, or torn: the
/// lookup goes on to `arp_held`, which stays the truth.
#[map]
pub static lb4_held_slots: Array<Lb4HeldSlot> = Array::pinned(HELD_SLOTS, 0);

/// held_slot(vip_filter_bit6(VIP)) → as `lb4_held_slots`, for `ndp_held`: its
/// 20-byte key costs the hash lookup most.
#[map]
pub static lb6_held_slots: Array<Lb6HeldSlot> = Array::pinned(HELD_SLOTS, 0);

/// (IPv6 VIP, port, protocol) → the service's id and its ring's place in
/// `lb4_ring`, which serves both families (as do `lb4_backends` and the counters).
#[map]
pub static lb6_services: HashMap<Lb6ServiceKey, LbService> = HashMap::pinned(MAX_SERVICES, 0);

/// IPv6 flows seen once, as `lb4_first_packets`.
#[map]
pub static lb6_first_packets: Array<Lb6FirstPacket> = Array::pinned(FIRST_PACKET_SLOTS, 0);

/// The per-CPU flow cache of IPv6 flows, as `lb4_flow_cache` (same epoch and slot mask).
#[map]
pub static lb6_flow_cache: PerCpuArray<Lb6FlowCacheEntry> = PerCpuArray::pinned(FLOW_CACHE_SLOTS, 0);

/// service_cache_slot(Lb4ServiceKey as a word) → a service found in
/// `lb4_services` and the flow-cache epoch it was found under, per CPU, **not
/// pinned**: the service lookup of a flow past the flow cache is then an inlined
/// array lookup, not a hash lookup (a call, and a hash of the key). An entry of
/// another epoch, another key's or empty, is looked up again (lb::lb_service).
#[map]
pub static lb4_service_cache: PerCpuArray<ServiceCacheEntry<1>> = PerCpuArray::with_max_entries(SERVICE_CACHE_SLOTS, 0);
/// As `lb4_service_cache`, for `lb6_services` (its 20-byte key costs the hash most).
#[map]
pub static lb6_service_cache: PerCpuArray<ServiceCacheEntry<3>> = PerCpuArray::with_max_entries(SERVICE_CACHE_SLOTS, 0);

/// Reason → packets and bytes, per CPU.
#[map]
pub static lb_stats: PerCpuArray<Counter> = PerCpuArray::pinned(Reason::COUNT, 0);

/// service id → packets and bytes balanced for it, per CPU.
#[map]
pub static lb4_service_stats: PerCpuArray<Counter> = PerCpuArray::pinned(MAX_SERVICES, 0);

/// backend id → packets and bytes sent to it (forwarded or passed locally), per CPU.
#[map]
pub static lb4_backend_stats: PerCpuArray<Counter> = PerCpuArray::pinned(MAX_BACKENDS, 0);

/// flow_cache_slot(5-tuple) → the last answer given for a flow in that slot, per CPU
/// (a direct-mapped exact-match cache in front of `lb_flows`; an array, so its
/// lookups are inlined: a hit costs no map helper call).
#[map]
pub static lb4_flow_cache: PerCpuArray<Lb4FlowCacheEntry> = PerCpuArray::pinned(FLOW_CACHE_SLOTS, 0);

/// 0 → the flow cache's epoch and slot mask. The agent bumps the epoch after any
/// change that could make a cached answer wrong, which invalidates them all.
#[map]
pub static lb4_flow_cache_ctl: Array<FlowCacheCtl> = Array::pinned(1, 0);

// Without CAP_PERFMON the verifier puts a speculation barrier (lfence, Spectre v4)
// after every stack store to a slot not fully written before and after every
// pointer spill; in practice after every 4-byte map key written on the stack and
// most register spills: ~7 ns apiece here, 13 of them on the flow-cache hit path
// before these. The IPv4 path takes its keys from map values instead (LB_KEY0,
// lb_scratch, or a field of the entry just looked up) and keeps its state in
// lb_scratch, so that its hit path has no stack store at all.

/// 0, read-only (.rodata, an array map): the key of one-slot maps.
#[unsafe(no_mangle)]
static LB_KEY0: u32 = 0;

#[inline(always)]
pub fn lb_key0() -> *const u32 {
    &raw const LB_KEY0
}

/// Per-CPU working memory of one packet, and the one place state passes between
/// the program's functions: what a step finds out and a later step needs is
/// written here rather than returned or kept in registers the compiler would
/// spill to the stack (see above), and computed map keys are built here. Per CPU
/// is enough: a run of the program is not interleaved with another on the same
/// CPU (XDP runs with preemption off, BPF_PROG_TEST_RUN too). The fields are
/// grouped by the step that writes them; each group says who reads it.
#[repr(C)]
pub struct Scratch {
    // Lookup keys: each written just before its map lookup by the function
    // that makes it, and read by the helper through its address (LB_KEY0).
    /// The key of the hot paths' lookups, first: its address is the scratch's own,
    /// not another pointer for the compiler to keep (and spill).
    pub key: u32,
    /// The next value of `key`, for a lookup after one at `key`.
    pub key2: u32,
    /// The `lb4_services` key (an Lb4ServiceKey as a word; lb4.rs).
    pub svc: u64,
    /// The `lb6_services` key (an Lb6ServiceKey in three words; lb6.rs).
    pub svc6: [u64; 3],
    /// The `arp_held` key (arp.rs, lb4.rs).
    pub held: ArpHeldKey,
    /// The `lb_vlans` key (maps::lb_vlan_ifindex).
    pub vlan: LbVlanKey,
    /// The `ndp_held` key (ndp.rs, lb6.rs).
    pub held6: NdpHeldKey,
    /// Whether the frame came as an ask (`ETH_P_ASK4`, `ETH_P_ASK6`; its
    /// EtherType restored by parse::l3): answered by lb::lb_answer_ask.
    pub asked: u32,
    /// The `lb_nodes` key: the frame's source MAC (lb.rs).
    pub node: u64,
    /// The VIP's previous holder from `arp_handoff` or `ndp_handoff`, as a
    /// node_mac_key (lb::lb_ask).
    pub prev: u64,

    // The frame, as parsed (main.rs, lb4.rs, lb6.rs, ndp.rs); read by every
    // later step and by the counters.
    /// The receiving network: the interface, or its VLAN sub-interface.
    pub ifindex: u32,
    /// The bytes a verdict counts: the layer-2 header, then the IP header's length.
    pub bytes: u32,
    pub fragment: u32,
    /// A TCP SYN without ACK: a new connection.
    pub syn: u32,
    /// The Lb4FlowKey as two words (see lb4_handle).
    pub words: [u64; 2],
    /// The Lb6FlowKey as five words (see lb6_handle).
    pub words6: [u64; 5],
    /// A neighbour discovery message's checksum sum while its options are
    /// walked (ndp.rs): kept here, not in a register across the walk.
    pub csum: u64,

    // The service and the flow's backend (lb.rs: the service lookup, the flow
    // cache, the flow table, the ring); read by delivery and the counters.
    /// The flow-cache epoch read before the service lookup (lb::lb_service).
    pub svc_epoch: u64,
    /// The flow cache's epoch at its lookup: an entry of another is not used, and
    /// an answer written is stamped with it.
    pub epoch: u64,
    /// This flow's flow-cache slot (found again past the hit path).
    pub cache_slot: u32,
    /// Whether lb::lb_touch_early computed `fhash` and loaded the flow's lines.
    pub touched: u32,
    /// The flow's `lb_flows` hash (lb_flow_hash) and tag (lb_flow_tag), for its
    /// lookup or insert.
    pub fhash: u64,
    pub ftag: u64,
    /// The flow's service and the backend chosen for it, with its id.
    pub service: LbService,
    pub backend: LbBackend,
    pub backend_id: u32,

    // The held VIP (arp.rs, ndp.rs, lb.rs: is it ours, fresh, here); read by
    // the answer and by delivery, which writes our MAC as the source.
    /// Whether the VIP's `arp_held` entry is fresh; its MAC (ours) in `mac`.
    pub fresh: u32,
    /// The coarse clock, read before the `arp_held` lookup.
    pub now: u64,
    /// Our MAC on the receiving network; for a Neighbor Advertisement, the MAC
    /// it claims.
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// The home interface, when the frame leaves by it (lb.rs, delivery).
    pub home: LbHome,

    // The verdict (stats.rs).
    /// The bytes a reason counter is bumped by (`stats::count_reason`; not
    /// `bytes`, which holds the packet's until its verdict).
    pub counted: u32,
}

/// 0 → this CPU's Scratch.
#[map]
pub static lb_scratch: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's scratch. Looked up once, first thing in the program, and handed down:
/// its pointer then lives in a callee-saved register (one slot per CPU: the lookup
/// does not fail).
#[inline(always)]
pub fn scratch() -> Option<*mut Scratch> {
    lookup_at::<_, Scratch>(&lb_scratch, lb_key0())
}

/// `map`'s value for the key at `key` (in a map value, see LB_KEY0).
#[inline(always)]
pub fn lookup_at<M, T>(map: &M, key: *const u32) -> Option<*mut T> {
    let p = unsafe { aya_ebpf::helpers::bpf_map_lookup_elem(map as *const M as *mut _, key.cast()) };
    if p.is_null() {
        None
    } else {
        Some(p as *mut T)
    }
}

/// The copy of the held entry whose `arp_held` key is in the scratch `s` (`held`)
/// in its `lb4_held_slots` slot, if the slot holds a valid one (Lb4HeldSlot);
/// else the caller asks `arp_held`. The slot index goes to the scratch as the
/// lookup's key, and the key is read back from the scratch after the lookup, so
/// that no value is kept in a register across it (see LB_KEY0).
#[inline(always)]
pub fn held4_slot(s: *mut Scratch) -> Option<*const HeldVip> {
    unsafe {
        (*s).key = held_slot(vip_filter_bit((*s).held.vip));
        let e = lookup_at::<_, Lb4HeldSlot>(&lb4_held_slots, s.cast())?;
        let w = e as *const u64;
        let k = read_unaligned((&raw const (*s).held) as *const u64);
        (*w == k && *w.add(3) == held_slot_check(k, *w.add(1), *w.add(2))).then_some(&raw const (*e).held)
    }
}

/// As [`held4_slot`], for the `ndp_held` key in the scratch (`held6`) and `lb6_held_slots`.
#[inline(always)]
pub fn held6_slot(s: *mut Scratch) -> Option<*const HeldVip> {
    unsafe {
        let v = (&raw const (*s).held6.vip) as *const u8;
        (*s).key = held_slot(vip_filter_bit_word(fold6_words(read_unaligned(v as *const u64), read_unaligned(v.add(8) as *const u64))));
        let e = lookup_at::<_, Lb6HeldSlot>(&lb6_held_slots, s.cast())?;
        let w = e as *const u64;
        let (k0, v0, v1) = (u64::from((*s).held6.ifindex), read_unaligned(v as *const u64), read_unaligned(v.add(8) as *const u64));
        let ok = *w == k0 && *w.add(1) == v0 && *w.add(2) == v1 && *w.add(5) == held_slot_check6(k0, v0, v1, *w.add(3), *w.add(4));
        ok.then_some(&raw const (*e).held)
    }
}

/// The ifindex of the sub-interface of VLAN `vid` on `ifindex`, if a pool lives
/// there (`lb_vlans`); the key built in this CPU's scratch `s` (see LB_KEY0).
#[inline(always)]
pub fn lb_vlan_ifindex(s: *mut Scratch, ifindex: u32, vid: u16) -> Option<u32> {
    unsafe {
        (*s).vlan = LbVlanKey { ifindex, vid: u32::from(vid) };
        lookup_at::<_, u32>(&lb_vlans, (&raw const (*s).vlan).cast()).map(|v| *v)
    }
}
