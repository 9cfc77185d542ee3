//! The maps' capacities and the key and value layouts of every map but the
//! flow table and its caches (in `flows`): interfaces, VLANs, held VIPs, the ARP
//! watch, services, backends, counters. A map that serves both families has one
//! family-neutral value type (`LbService`, `LbBackend`, `HeldVip`) and a key per
//! family; its pinned name is the historical one (see `pins`).

/// Capacity of the maps (the ring's is set by the agent at load time).
pub const MAX_IFACES: u32 = 64;
/// VLAN sub-interfaces the program serves (entries of `lb_vlans`).
pub const MAX_VLANS: u32 = 256;
pub const MAX_HELD: u32 = 4096;
pub const MAX_SERVICES: u32 = 16384;
pub const MAX_BACKENDS: u32 = 4096;
/// Node MACs `lb_nodes` holds: one per backend at most.
pub const MAX_NODES: u32 = MAX_BACKENDS;
/// Entries of the flow table `lb_flows`: [`FLOW_SETS`] sets of [`FLOW_WAYS`].
pub const MAX_FLOWS: u32 = FLOW_SETS * FLOW_WAYS;
/// Sets of `lb_flows`, one 64-byte cache line each (a power of two).
pub const FLOW_SETS: u32 = 1 << FLOW_SET_BITS;
pub const FLOW_SET_BITS: u32 = 18;
/// Entries per set: four of 16 bytes fill a line.
pub const FLOW_WAYS: u32 = 4;
/// Slots of `lb4_first_packets`, the direct-mapped record of flows seen once until
/// their second packet pins them in `lb_flows`: a flood of one-packet flows
/// (spoofed SYNs) overwrites these slots alone and never evicts an established flow.
/// A record needs to live one round trip; 24 bytes each, 384 KiB in all: it stays
/// in the caches, where a hash table of flows would not.
pub const FIRST_PACKET_SLOTS: u32 = 1 << FIRST_PACKET_BITS;
pub const FIRST_PACKET_BITS: u32 = 14;
/// Slots of the per-CPU flow cache (`lb4_flow_cache`), a power of two; the agent
/// may use fewer (see [`flow_cache_slots_for`]).
pub const FLOW_CACHE_SLOTS: u32 = 1 << FLOW_CACHE_BITS;
pub const FLOW_CACHE_BITS: u32 = 12;
/// Words of `lb4_vip_filter`, a bitmap with one bit per [`vip_filter_bit`]: set
/// for every address some service uses (8 KiB, 65,536 bits).
pub const VIP_FILTER_WORDS: u32 = 2048;

/// The `lb_nodes` key of a MAC: its six bytes then two zero bytes, as a
/// little-endian word (the data path reads it as a word and a half-word).
#[inline(always)]
pub fn node_mac_key(mac: [u8; 6]) -> u64 {
    u64::from_le_bytes([mac[0], mac[1], mac[2], mac[3], mac[4], mac[5], 0, 0])
}

/// Default number of ring slots in `lb4_ring`, shared by all services.
pub const DEFAULT_RING_CAPACITY: u32 = 1 << 20;

/// Ring slot value meaning "no backend" (a service whose backends are all gone).
pub const NO_BACKEND: u32 = u32::MAX;

/// EtherType of ARP (the data path parses it; the agent sends it).
pub const ETH_P_ARP: u16 = 0x0806;

/// EtherTypes of a frame one node asks another about (IEEE 802's two local
/// experimental types): a VIP's new holder sends a TCP segment of a flow it
/// never saw to the VIP's previous holder under these, in place of IPv4's and
/// IPv6's, and the previous holder, whose pins the flow may be in, restores the
/// type and forwards it to the flow's backend (see `arp_handoff`). A switch
/// forwards any type; a stack drops these, so only a data path that answers
/// them is asked (the agent checks the peer's version).
pub const ETH_P_ASK4: u16 = 0x88B5;
pub const ETH_P_ASK6: u16 = 0x88B6;

/// IP protocol numbers used in [`Lb4ServiceKey::proto`].
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// `lb_ifaces`: ifindex of an interface the program is attached to → its MAC.
/// The agent's record (it survives agent restarts with the pins); the data path
/// reads the copy in each `arp_held` entry instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LbIface {
    pub mac: [u8; 6],
    /// `IFACE_NATIVE` when the program is attached in native (driver) mode.
    pub flags: u8,
    pub _pad: u8,
}

/// `lb_ifaces` flag: attached in native mode (the driver can transmit XDP frames).
pub const IFACE_NATIVE: u8 = 1;

/// `lb_vlans` key: an 802.1Q VLAN id seen on an interface the program runs on.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct LbVlanKey {
    /// The interface the tagged frame arrived on (the VLAN's parent).
    pub ifindex: u32,
    /// The VLAN id (1..=4094); a u32 so the key has no padding.
    pub vid: u32,
}

/// `lb_home` value: the interface this node is reached on (untagged), where the
/// backends' MACs are valid. A VIP living on another network (another interface,
/// a VLAN) has its frames forwarded out of here, untagged; ifindex 0: not set,
/// every frame is forwarded on the network it came from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LbHome {
    pub ifindex: u32,
    /// Our MAC there: the source of frames forwarded out of it.
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
}

/// `arp_held` key: a VIP held on one interface. For a VIP on an 802.1Q VLAN,
/// `ifindex` is the VLAN sub-interface's: `lb_vlans` maps (parent, VLAN id) of a
/// tagged frame to it, so a VIP is answered and balanced only on its own VLAN.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ArpHeldKey {
    pub ifindex: u32,
    /// IPv4 address, network byte order.
    pub vip: [u8; 4],
}

/// Entries of `arp_watch`: the VIPs whose ARP answers the agent waits for at once
/// (it probes a few per second, each for about a second).
pub const MAX_ARP_WATCH: u32 = 256;
/// Distinct sender MACs an [`ArpWatch`] keeps.
pub const ARP_WATCH_MACS: usize = 4;

/// `arp_watch` value (key: an [`ArpHeldKey`], the network the agent asked on and
/// the VIP): the ARP replies and gratuitous ARP seen claiming the VIP there since
/// the agent wrote the entry (zeroed) and sent its request. The agent of a peer
/// node asks who answers for a VIP another node holds (its ARP self-check).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ArpWatch {
    /// The distinct sender MACs seen, the first `seen` of them.
    pub macs: [[u8; 6]; ARP_WATCH_MACS],
    /// How many of `macs` are filled (at most ARP_WATCH_MACS; further MACs are
    /// counted in `replies` only).
    pub seen: u32,
    /// Every reply or gratuitous ARP counted.
    pub replies: u32,
    /// `bpf_ktime_get_coarse_ns` of the last one.
    pub last_ns: u64,
}

/// `ndp_held` key: an IPv6 VIP held on one interface (as [`ArpHeldKey`]; its
/// value is an [`HeldVip`] too). A map of its own, so that the IPv4 key and
/// the IPv4 path's lookups stay as they are.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct NdpHeldKey {
    pub ifindex: u32,
    /// IPv6 address, network byte order.
    pub vip: [u8; 16],
}

/// `arp_held` value: until when the agent vouches for holding the VIP, and the
/// MAC of the interface (copied from `lb_ifaces` by the agent), so that ARP replies
/// and forwards need this one lookup only.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct HeldVip {
    /// CLOCK_MONOTONIC nanoseconds, compared with `bpf_ktime_get_coarse_ns` (the
    /// agent stores it two coarse ticks early to cover that clock's lag). Past it
    /// the VIP is neither answered nor load-balanced: a wedged agent loses its VIPs
    /// by itself.
    pub deadline_ns: u64,
    /// Our MAC on this interface: source of ARP replies and forwards.
    pub mac: [u8; 6],
    /// `HELD_NO_ARP`: balanced but not answered (the pool announces on `lo`).
    pub flags: u8,
    pub _pad: u8,
}

/// Slots of `lb4_held_slots` and `lb6_held_slots` (a power of two): a held VIP's
/// slot is [`held_slot`] of its filter bit.
pub const HELD_SLOTS: u32 = 4096;

/// The held-slot index of a VIP whose [`vip_filter_bit`] (or [`vip_filter_bit6`])
/// is `bit`: two held VIPs of a family with the same index share one slot, which
/// the first keeps (the other is found in `arp_held` / `ndp_held`).
#[inline(always)]
pub fn held_slot(bit: u32) -> u32 {
    bit & (HELD_SLOTS - 1)
}

/// `lb4_held_slots` value: a copy of one `arp_held` entry, its key as one word
/// (an [`ArpHeldKey`]'s bytes, little-endian), found by the data path with an
/// inlined array lookup rather than a hash lookup. All zero: empty.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Lb4HeldSlot {
    pub key: u64,
    pub held: HeldVip,
    /// [`held_slot_check`] of the words above: a slot read while the agent
    /// rewrites it (an array value is copied without a lock) matches nothing,
    /// and the lookup falls back to `arp_held`.
    pub check: u64,
}

/// `lb6_held_slots` value: as [`Lb4HeldSlot`], for an `ndp_held` entry; its key
/// as three words (the ifindex in the first, the VIP's two halves).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Lb6HeldSlot {
    pub key: [u64; 3],
    pub held: HeldVip,
    pub check: u64,
}

/// The check word of a held slot: its key words folded (`k`), the held entry's
/// deadline and its MAC-and-flags word, mixed so that a slot whose words come
/// from two writes fails it; never 0, so an empty slot fails it too.
#[inline(always)]
pub fn held_slot_check(k: u64, deadline_ns: u64, mac_flags: u64) -> u64 {
    let x = (k ^ deadline_ns.rotate_left(23) ^ mac_flags.rotate_left(41)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x | 1
}

impl HeldVip {
    /// Its MAC and flags as the word after the deadline (little-endian).
    pub fn mac_flags_word(&self) -> u64 {
        let m = self.mac;
        u64::from_le_bytes([m[0], m[1], m[2], m[3], m[4], m[5], self.flags, self._pad])
    }
}

/// [`held_slot_check`] of an [`Lb6HeldSlot`], whose key is three words (`k0`,
/// `k1`, `k2`): the data path and the agent both compute it here.
#[inline(always)]
pub fn held_slot_check6(k0: u64, k1: u64, k2: u64, deadline_ns: u64, mac_flags: u64) -> u64 {
    held_slot_check(k0 ^ k1.rotate_left(13) ^ k2.rotate_left(29), deadline_ns, mac_flags)
}

impl Lb4HeldSlot {
    /// `key` as the slot stores it.
    pub fn key_of(key: ArpHeldKey) -> u64 {
        let v = key.vip;
        u64::from_le_bytes([0, 0, 0, 0, v[0], v[1], v[2], v[3]]) | u64::from(key.ifindex)
    }

    /// The slot holding `key`'s entry `held`.
    pub fn new(key: ArpHeldKey, held: HeldVip) -> Self {
        let k = Self::key_of(key);
        Self { key: k, held, check: held_slot_check(k, held.deadline_ns, held.mac_flags_word()) }
    }
}

impl Lb6HeldSlot {
    /// `key` as the slot stores it.
    pub fn key_of(key: NdpHeldKey) -> [u64; 3] {
        let v = key.vip;
        let w = |i: usize| u64::from_le_bytes([v[i], v[i + 1], v[i + 2], v[i + 3], v[i + 4], v[i + 5], v[i + 6], v[i + 7]]);
        [u64::from(key.ifindex), w(0), w(8)]
    }

    /// The slot holding `key`'s entry `held`.
    pub fn new(key: NdpHeldKey, held: HeldVip) -> Self {
        let k = Self::key_of(key);
        Self { key: k, held, check: held_slot_check6(k[0], k[1], k[2], held.deadline_ns, held.mac_flags_word()) }
    }
}

/// `arp_held` flag: the VIP is announced by a routing daemon from `lo`, so the data
/// path balances it but answers no ARP for it (counted `arp_not_announced`).
pub const HELD_NO_ARP: u8 = 1;

/// `lb4_services` key: (VIP, port, protocol). Fragments look up port 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Lb4ServiceKey {
    pub vip: [u8; 4],
    /// Network byte order; 0 is the entry fragments of this VIP/protocol use.
    pub port: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
}

/// `lb4_services` value: where the service's Maglev ring lives in `lb4_ring`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LbService {
    /// Index into `lb4_service_stats`.
    pub id: u32,
    /// First slot of the ring in `lb4_ring`.
    pub ring_offset: u32,
    /// Ring size (a prime); 0 means no ring yet (counted as no backend).
    pub ring_size: u32,
    pub _pad: u32,
}

/// `lb4_backends` value flag: the backend is this node, hand the packet to the stack.
pub const BACKEND_LOCAL: u32 = 1;
/// `lb4_backends` value flag: the slot is in use. `lb4_backends` is an array indexed
/// by backend id; a slot without this flag (all zero) is no backend.
pub const BACKEND_PRESENT: u32 = 2;

/// `lb4_backends`: backend id (stored in ring slots and flows; `< MAX_BACKENDS`)
/// → where to send. Array slot; see [`BACKEND_PRESENT`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LbBackend {
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// Node address, network byte order (for humans and `inspect`).
    pub addr: [u8; 4],
    pub flags: u32,
}

/// `lb6_services` key: (VIP, port, protocol), as [`Lb4ServiceKey`]. Its value is an
/// [`LbService`]: service ids, `lb4_ring`, `lb4_backends` and the service and
/// backend counters serve both families (a backend is a node, whatever the VIP's family).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Lb6ServiceKey {
    pub vip: [u8; 16],
    /// Network byte order; 0 is the entry fragments of this VIP/protocol use.
    pub port: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
}

/// Packet and byte counter, one per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}
