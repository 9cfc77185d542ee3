//! Key and value layouts of the BPF maps, shared by the XDP program (`vip-ebpf`)
//! and the agent (`vip-agent`). Everything is `#[repr(C)]` with explicit padding so
//! both sides agree byte for byte; addresses and ports are stored in network byte
//! order exactly as they appear in packets, so the data path never converts them.
#![no_std]

/// Map names; the agent pins each map under its bpffs directory with this name.
pub mod map_names {
    pub const IFACES: &str = "lb_ifaces";
    pub const HELD: &str = "arp_held";
    pub const CONFLICTS: &str = "arp_conflicts";
    pub const SERVICES: &str = "lb4_services";
    pub const BACKENDS: &str = "lb4_backends";
    pub const RING: &str = "lb4_ring";
    pub const FLOWS: &str = "lb_flows";
    pub const FLOWS_CTL: &str = "lb_flows_ctl";
    pub const FIRST_PACKETS: &str = "lb4_first_packets";
    pub const VIP_FILTER: &str = "lb4_vip_filter";
    pub const STATS: &str = "lb_stats";
    pub const SERVICE_STATS: &str = "lb4_service_stats";
    pub const BACKEND_STATS: &str = "lb4_backend_stats";
    pub const FLOW_CACHE: &str = "lb4_flow_cache";
    pub const FLOW_CACHE_CTL: &str = "lb4_flow_cache_ctl";
    pub const VLANS: &str = "lb_vlans";
    pub const HOME: &str = "lb_home";
    pub const HELD6: &str = "ndp_held";
    pub const CONFLICTS6: &str = "ndp_conflicts";
    pub const ARP_WATCH: &str = "arp_watch";
    pub const SERVICES6: &str = "lb6_services";
    pub const FIRST_PACKETS6: &str = "lb6_first_packets";
    pub const FLOW_CACHE6: &str = "lb6_flow_cache";
    pub const NODES: &str = "lb_nodes";
    pub const HELD_FILTER: &str = "lb_held_filter";
    pub const HELD_SLOTS: &str = "lb4_held_slots";
    pub const HELD_SLOTS6: &str = "lb6_held_slots";
    pub const ALL: [&str; 27] = [
        IFACES,
        HELD,
        CONFLICTS,
        SERVICES,
        BACKENDS,
        RING,
        FLOWS,
        FLOWS_CTL,
        FIRST_PACKETS,
        STATS,
        SERVICE_STATS,
        BACKEND_STATS,
        FLOW_CACHE,
        FLOW_CACHE_CTL,
        VLANS,
        HOME,
        VIP_FILTER,
        HELD6,
        CONFLICTS6,
        ARP_WATCH,
        SERVICES6,
        FIRST_PACKETS6,
        FLOW_CACHE6,
        NODES,
        HELD_FILTER,
        HELD_SLOTS,
        HELD_SLOTS6,
    ];
}

/// Name of the XDP program inside the object, and of its pin.
pub const PROGRAM_NAME: &str = "vip_xdp";
/// The program that transmits the frame it is run on (BPF_PROG_RUN, live frames):
/// how the agent sends gratuitous ARP without a packet socket. Pinned, never attached.
pub const XMIT_PROGRAM_NAME: &str = "vip_xmit";

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

/// The `lb4_vip_filter` bit of an address (network byte order, as in packets):
/// word `bit / 32`, bit `bit % 32`. A multiplicative hash's top 16 bits.
#[inline(always)]
pub fn vip_filter_bit(addr: [u8; 4]) -> u32 {
    vip_filter_bit_word(u32::from_ne_bytes(addr))
}

/// [`vip_filter_bit`] of an address loaded as a native-endian word.
#[inline(always)]
pub fn vip_filter_bit_word(addr: u32) -> u32 {
    addr.wrapping_mul(0x9e37_79b1) >> 16
}

/// The `lb4_vip_filter` bit of an IPv6 address (network byte order): its four
/// words folded into one, then as [`vip_filter_bit`]. IPv4 and IPv6 addresses
/// share the bitmap: a bit set by the other family only costs a service lookup.
#[inline(always)]
pub fn vip_filter_bit6(addr: [u8; 16]) -> u32 {
    vip_filter_bit(fold6(addr))
}

/// The bitmap bit of an address of either family ([`vip_filter_bit`],
/// [`vip_filter_bit6`]): `lb4_vip_filter`'s and `lb_held_filter`'s.
pub fn vip_filter_bit_of(addr: core::net::IpAddr) -> u32 {
    match addr {
        core::net::IpAddr::V4(v) => vip_filter_bit(v.octets()),
        core::net::IpAddr::V6(v) => vip_filter_bit6(v.octets()),
    }
}

/// An IPv6 address folded into four bytes: its two halves XORed (the second
/// rotated, so that equal halves do not cancel), then the result's two halves.
#[inline(always)]
pub fn fold6(a: [u8; 16]) -> [u8; 4] {
    let w = |i: usize| u64::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3], a[i + 4], a[i + 5], a[i + 6], a[i + 7]]);
    fold6_words(w(0), w(8)).to_ne_bytes()
}

/// [`fold6`] of an address loaded as two native-endian words.
#[inline(always)]
pub fn fold6_words(w0: u64, w1: u64) -> u32 {
    let x = w0 ^ w1.rotate_left(17);
    (x ^ (x >> 32)) as u32
}

/// Default number of ring slots in `lb4_ring`, shared by all services.
pub const DEFAULT_RING_CAPACITY: u32 = 1 << 20;

/// Ring slot value meaning "no backend" (a service whose backends are all gone).
pub const NO_BACKEND: u32 = u32::MAX;

/// EtherType of ARP (the data path parses it; the agent sends it).
pub const ETH_P_ARP: u16 = 0x0806;

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
/// value is an [`ArpHeldVip`] too). A map of its own, so that the IPv4 key and
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
pub struct ArpHeldVip {
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
    pub held: ArpHeldVip,
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
    pub held: ArpHeldVip,
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

impl ArpHeldVip {
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
    pub fn new(key: ArpHeldKey, held: ArpHeldVip) -> Self {
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
    pub fn new(key: NdpHeldKey, held: ArpHeldVip) -> Self {
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
pub struct Lb4Service {
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
pub struct Lb4Backend {
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
    /// Node address, network byte order (for humans and `inspect`).
    pub addr: [u8; 4],
    pub flags: u32,
}

/// An IPv4 flow's 5-tuple (ports 0 for fragments): what `lb_flows` fingerprints
/// ([`lb_flow_hash`] of [`Lb4FlowKey::words`]) and `lb4_first_packets` and the flow
/// cache hold whole.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Lb4FlowKey {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub _pad: [u8; 3],
}

impl Lb4FlowKey {
    /// The key as the two native-endian words the data path loads and compares.
    pub fn words(&self) -> [u64; 2] {
        let (s, d, sp, dp) = (self.src, self.dst, self.sport, self.dport);
        let p = self._pad;
        [u64::from_ne_bytes([s[0], s[1], s[2], s[3], d[0], d[1], d[2], d[3]]), u64::from_ne_bytes([sp[0], sp[1], dp[0], dp[1], self.proto, p[0], p[1], p[2]])]
    }
}

/// One entry of the flow table `lb_flows`: a flow past its first packet and the
/// backend it is pinned to (16 bytes; four make a [`LbFlowSet`], one cache line).
/// `tag` is 0 for an empty entry, else [`lb_flow_tag`]: 48 bits of the flow's
/// keyed hash ([`lb_flow_hash`]) with the service id above them, so a lookup
/// compares one word. `check` ([`lb_flow_check`]) ties the backend to the tag:
/// two CPUs writing one entry at once (two 8-byte stores each) can leave one's
/// tag with the other's backend, and such a torn entry matches no flow. `stamp`
/// is the coarse clock in units of 2^30 ns ([`FLOW_STAMP_SHIFT`]) when the flow was
/// last looked up in the table: the victim in a full set is the oldest.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LbFlowEntry {
    pub tag: u64,
    pub backend: u16,
    pub check: u16,
    pub stamp: u32,
}

/// `lb_flows` value: one set of [`FLOW_WAYS`] entries, a 64-byte line (the map is
/// `BPF_F_MMAPABLE`, so its values start on a page and every set is one line).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LbFlowSet {
    pub ways: [LbFlowEntry; FLOW_WAYS as usize],
}

/// `lb_flows_ctl` value (one entry): the flow table's hash key, random, written by
/// the agent that creates the table and pinned with it (so it survives restarts):
/// nobody who does not know it can aim flows at one set.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct LbFlowsCtl {
    pub seed: [u64; 2],
}

/// Address families in [`lb_flow_hash`]: an IPv4 and an IPv6 flow never share a tag.
pub const FLOW_FAMILY_V4: u64 = 4;
pub const FLOW_FAMILY_V6: u64 = 6;

/// A flow's keyed hash for `lb_flows`: its set is the top [`FLOW_SET_BITS`] bits,
/// its tag the low 48 ([`lb_flow_tag`]). `words` is the flow key as the data path
/// loads it (IPv4: [`Lb4FlowKey::words`]; an IPv6 key is five words), `family`
/// one of the `FLOW_FAMILY_*`. Each word is folded in with a multiply and a
/// xor-shift (the murmur3/splitmix finaliser), seeded with the table's random key:
/// like the kernel's own hash tables (jhash with a random seed), not a
/// cryptographic hash, but without the seed the sets of chosen 5-tuples cannot be
/// predicted.
#[inline(always)]
pub fn lb_flow_hash<const N: usize>(seed: &[u64; 2], family: u64, words: &[u64; N]) -> u64 {
    let mut h = seed[0] ^ family.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut i = 0;
    while i < N {
        h = (h ^ words[i]).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 31;
        i += 1;
    }
    h = (h ^ seed[1]).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 29)
}

/// The set of a flow whose [`lb_flow_hash`] is `h`.
#[inline(always)]
pub fn lb_flow_set(h: u64) -> u32 {
    (h >> (64 - FLOW_SET_BITS)) as u32
}

/// The tag of a flow whose [`lb_flow_hash`] is `h`, of service `service`: the
/// hash's low 48 bits, the lowest set (never 0, the empty entry), the service id
/// above them. A flow whose service is removed and recreated with another id is
/// no longer matched (it follows the ring again).
#[inline(always)]
pub fn lb_flow_tag(h: u64, service: u32) -> u64 {
    (h & 0x0000_ffff_ffff_ffff) | 1 | u64::from(service) << 48
}

/// [`LbFlowEntry::check`] for `tag` and `backend`: a multiplicative hash's top 16
/// bits, which depend on every bit of both.
#[inline(always)]
pub fn lb_flow_check(tag: u64, backend: u16) -> u16 {
    ((tag ^ u64::from(backend)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 48) as u16
}

/// An entry's second word as the data path loads and stores it: backend, check,
/// stamp.
#[inline(always)]
pub fn lb_flow_word1(tag: u64, backend: u16, stamp: u32) -> u64 {
    u64::from(backend) | u64::from(lb_flow_check(tag, backend)) << 16 | u64::from(stamp) << 32
}

/// A victim whose stamp is at most this many units (64 s) old counts as a live
/// flow evicted (`Reason::FlowEvicted`); older ones are taken silently.
pub const FLOW_LIVE_STAMPS: u32 = 60;

/// [`LbFlowEntry::stamp`] from a coarse-clock reading in ns: units of 2^30 ns
/// (1.07 s), which wrap after 146 years.
pub const FLOW_STAMP_SHIFT: u32 = 30;

/// `lb4_first_packets` value: a flow whose first packet went to `backend` by the
/// ring, until its next packet pins it in `lb_flows` (index: [`first_packet_slot`]).
/// One array for all CPUs: a flow's packets need not arrive on one CPU. Two CPUs
/// writing one slot at once can tear a record; `check` ([`first_packet_check`])
/// ties the backend to the key, so a torn record matches no flow.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Lb4FirstPacket {
    /// The flow (compared as two u64 words).
    pub key: Lb4FlowKey,
    pub backend: u32,
    pub check: u32,
}

/// Slot of a flow in `lb4_first_packets`: the flow cache's multiplicative hash,
/// its top [`FIRST_PACKET_BITS`] bits.
#[inline(always)]
pub fn first_packet_slot(w0: u64, w1: u64) -> u32 {
    ((w0 ^ w1.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - FIRST_PACKET_BITS)) as u32
}

/// [`Lb4FirstPacket::check`] for a flow (its key as two words) and backend. An
/// all-zero slot (never written, or cleared) fails it, and matches no TCP or UDP key.
#[inline(always)]
pub fn first_packet_check(w0: u64, w1: u64, backend: u32) -> u32 {
    let x = w0 ^ w1.rotate_left(17);
    ((x ^ (x >> 32)) as u32) ^ backend ^ 0x5bd1_e995
}

/// `lb4_flow_cache` flag: the cached backend is this node (pass to the stack).
pub const FLOW_CACHE_LOCAL: u16 = 1;

/// `lb4_flow_cache` value: one slot of the per-CPU direct-mapped cache in front of
/// `lb_flows` (index: [`flow_cache_slot`]). It memoises the data path's whole
/// answer for one flow pinned in `lb_flows` on one interface, valid while `epoch`
/// equals the epoch in `lb4_flow_cache_ctl` (the agent bumps that on every change
/// that could make an answer wrong).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Lb4FlowCacheEntry {
    /// The flow (compared as two u64 words).
    pub key: Lb4FlowKey,
    pub answer: FlowAnswer,
}

/// What a flow-cache slot memoises for its flow, in either family's cache.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FlowAnswer {
    /// [`Lb4FlowCacheCtl::epoch`] when the answer was computed.
    pub epoch: u64,
    /// Receiving interface (our MAC differs per interface).
    pub ifindex: u32,
    /// Backend id, for its counter.
    pub backend: u32,
    /// The Ethernet addresses to write: backend MAC, then our MAC (8-aligned).
    pub eth: [u8; 12],
    /// Service id, for its counter.
    pub service: u32,
    /// [`FLOW_CACHE_LOCAL`].
    pub flags: u16,
    /// Hits since the answer was read from the flow table (see [`FLOW_CACHE_RECHECK_HITS`]).
    pub hits: u16,
    pub _pad: [u8; 4],
}

/// Every this many hits a cached flow is looked up in `lb_flows` again (the
/// answer recomputed): the lookup refreshes its entry's stamp, which hits do not
/// touch (they would dirty a cold line), so that a busy flow is never the oldest
/// of its set when a new flow needs a way there.
pub const FLOW_CACHE_RECHECK_HITS: u16 = 64;

/// `lb4_flow_cache_ctl` value (one entry).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Lb4FlowCacheCtl {
    /// Cached answers with another epoch are not used; the agent bumps it.
    pub epoch: u64,
    /// Slots in use − 1 (a power of two − 1, at most `FLOW_CACHE_SLOTS − 1`).
    pub slot_mask: u32,
    pub _pad: u32,
}

/// The slots the flow cache uses on a machine with `cpus` possible CPUs: at most
/// 1/64 of one CPU's share of `lb_flows`. Cache hits do not refresh a flow's
/// stamp, but every new flow a CPU records also takes one random slot of that
/// CPU's cache: by the time new flows have gone through a good part of the table
/// (what it takes for a flow to become the oldest of its set), a cached flow has
/// been displaced from the cache, and looked up (its stamp refreshed), with
/// probability close to 1; a busy one is refreshed every
/// [`FLOW_CACHE_RECHECK_HITS`] hits anyway.
pub fn flow_cache_slots_for(cpus: u32) -> u32 {
    let share = MAX_FLOWS / cpus.max(1) / 64;
    let pow2 = if share == 0 { 1 } else { 1 << (31 - share.leading_zeros()) };
    pow2.clamp(16, FLOW_CACHE_SLOTS)
}

/// Slot of a flow in `lb4_flow_cache`: a multiplicative (Fibonacci) hash of the
/// Lb4FlowKey's two words as the data path loads them (native-endian u64s); the top
/// bits of the product depend on every input bit.
#[inline(always)]
pub fn flow_cache_slot(w0: u64, w1: u64) -> u32 {
    ((w0 ^ w1.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - FLOW_CACHE_BITS)) as u32
}

/// Slots of each per-CPU service cache (`lb4_service_cache`, `lb6_service_cache`).
pub const SERVICE_CACHE_SLOTS: u32 = 1 << SERVICE_CACHE_BITS;
pub const SERVICE_CACHE_BITS: u32 = 9;

/// Set in the last key word of a service-cache entry in use: no service key has
/// it (the words' top byte is zero), so a zeroed entry matches nothing.
pub const SERVICE_CACHE_VALID: u64 = 1 << 63;

/// Per-CPU service cache value: a service looked up in `lb4_services` (`W` = 1:
/// the Lb4ServiceKey as one word) or `lb6_services` (`W` = 3: the Lb6ServiceKey
/// in three words) while the flow-cache epoch was `epoch`. The agent bumps the
/// epoch after every service change, so an entry of another epoch is not used;
/// the data path alone writes these, each CPU its own.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceCacheEntry<const W: usize> {
    /// The key words, [`SERVICE_CACHE_VALID`] set in the last.
    pub key: [u64; W],
    pub epoch: u64,
    pub service: Lb4Service,
}

/// Word `i` of a `W`-word service key as a service-cache entry stores it:
/// [`SERVICE_CACHE_VALID`] set in the last.
#[inline(always)]
pub fn service_cache_word<const W: usize>(i: usize, word: u64) -> u64 {
    if i == W - 1 {
        word | SERVICE_CACHE_VALID
    } else {
        word
    }
}

/// Slot of a service in its service cache: a multiplicative hash of its key
/// words folded into one.
#[inline(always)]
pub fn service_cache_slot<const W: usize>(key: &[u64; W]) -> u32 {
    let mut h = 0u64;
    let mut i = 0;
    while i < W {
        h = (h ^ key[i]).rotate_left(29);
        i += 1;
    }
    (h.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - SERVICE_CACHE_BITS)) as u32
}

/// `lb6_services` key: (VIP, port, protocol), as [`Lb4ServiceKey`]. Its value is an
/// [`Lb4Service`]: service ids, `lb4_ring`, `lb4_backends` and the service and
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

/// An IPv6 flow's key (`lb6_first_packets`, `lb6_flow_cache`; hashed into `lb_flows`): the IPv6 5-tuple (ports 0 for fragments), 40 bytes: the
/// source and destination as they follow each other in the IPv6 header, then the
/// ports and protocol as in [`Lb4FlowKey`]'s second word.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Lb6FlowKey {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub _pad: [u8; 3],
}

impl Lb6FlowKey {
    /// The key as the five native-endian words the data path loads and compares.
    pub fn words(&self) -> [u64; 5] {
        let w = |a: &[u8; 16], i: usize| u64::from_ne_bytes([a[i], a[i + 1], a[i + 2], a[i + 3], a[i + 4], a[i + 5], a[i + 6], a[i + 7]]);
        let (sp, dp, p) = (self.sport, self.dport, self._pad);
        [w(&self.src, 0), w(&self.src, 8), w(&self.dst, 0), w(&self.dst, 8), u64::from_ne_bytes([sp[0], sp[1], dp[0], dp[1], self.proto, p[0], p[1], p[2]])]
    }
}

/// An IPv6 key's five words folded into two, for the IPv4 slot and check
/// functions ([`flow_cache_slot`], [`first_packet_slot`], [`first_packet_check`]).
#[inline(always)]
pub fn fold_words6(w: &[u64; 5]) -> (u64, u64) {
    (w[0] ^ w[2].rotate_left(21), w[1] ^ w[3].rotate_left(21) ^ w[4].rotate_left(42))
}

/// `lb6_first_packets` value, as [`Lb4FirstPacket`] (index: [`first_packet_slot`]
/// of [`fold_words6`]; `check`: [`first_packet_check`] of the same).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Lb6FirstPacket {
    pub key: Lb6FlowKey,
    pub backend: u32,
    pub check: u32,
}

/// `lb6_flow_cache` value, as [`Lb4FlowCacheEntry`] (index: [`flow_cache_slot`] of
/// [`fold_words6`]); it shares `lb4_flow_cache_ctl`'s epoch and slot mask.
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Lb6FlowCacheEntry {
    pub key: Lb6FlowKey,
    pub answer: FlowAnswer,
}

/// The flow hash of an IPv6 5-tuple: [`flow_hash`] of the addresses folded ([`fold6`]).
#[inline(always)]
pub fn flow_hash6(src: [u8; 16], dst: [u8; 16], sport: [u8; 2], dport: [u8; 2], proto: u8) -> u32 {
    flow_hash(fold6(src), fold6(dst), sport, dport, proto)
}

/// Packet and byte counter, one per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// Index into `lb_stats`: why the program returned what it returned.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    ArpAnswered = 0,
    ArpNotHeld = 1,
    ArpStale = 2,
    ArpOther = 3,
    Forwarded = 4,
    PassedLocalBackend = 5,
    PassedNotVip = 6,
    PassedNotOwner = 7,
    PassedIcmp = 8,
    PassedFragmentNoService = 9,
    DropMalformed = 10,
    DropNoBackend = 11,
    FlowRehashed = 12,
    PassedOther = 13,
    ArpConflict = 14,
    ArpNotAnnounced = 15,
    DropGroupNotOwner = 16,
    PassedVlanOther = 17,
    ForwardedHome = 18,
    NdpAnswered = 19,
    NdpNotHeld = 20,
    NdpStale = 21,
    NdpOther = 22,
    NdpInvalid = 23,
    NdpConflict = 24,
    NdpNotAnnounced = 25,
    ArpWatched = 26,
    PassedIpv6Ext = 27,
    FlowEvicted = 28,
    ForwardedIcmpError = 29,
}

impl Reason {
    pub const COUNT: u32 = 30;
    pub const ALL: [Reason; Self::COUNT as usize] = [
        Reason::ArpAnswered,
        Reason::ArpNotHeld,
        Reason::ArpStale,
        Reason::ArpOther,
        Reason::Forwarded,
        Reason::PassedLocalBackend,
        Reason::PassedNotVip,
        Reason::PassedNotOwner,
        Reason::PassedIcmp,
        Reason::PassedFragmentNoService,
        Reason::DropMalformed,
        Reason::DropNoBackend,
        Reason::FlowRehashed,
        Reason::PassedOther,
        Reason::ArpConflict,
        Reason::ArpNotAnnounced,
        Reason::DropGroupNotOwner,
        Reason::PassedVlanOther,
        Reason::ForwardedHome,
        Reason::NdpAnswered,
        Reason::NdpNotHeld,
        Reason::NdpStale,
        Reason::NdpOther,
        Reason::NdpInvalid,
        Reason::NdpConflict,
        Reason::NdpNotAnnounced,
        Reason::ArpWatched,
        Reason::PassedIpv6Ext,
        Reason::FlowEvicted,
        Reason::ForwardedIcmpError,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Reason::ArpAnswered => "arp_answered",
            Reason::ArpNotHeld => "arp_not_held",
            Reason::ArpStale => "arp_stale",
            Reason::ArpOther => "arp_other",
            Reason::Forwarded => "forwarded",
            Reason::PassedLocalBackend => "passed_local_backend",
            Reason::PassedNotVip => "passed_not_vip",
            Reason::PassedNotOwner => "passed_not_owner",
            Reason::PassedIcmp => "passed_icmp",
            Reason::PassedFragmentNoService => "passed_fragment_no_service",
            Reason::DropMalformed => "drop_malformed",
            Reason::DropNoBackend => "drop_no_backend",
            Reason::FlowRehashed => "flow_rehashed",
            Reason::PassedOther => "passed_other",
            Reason::ArpConflict => "arp_conflict",
            Reason::ArpNotAnnounced => "arp_not_announced",
            Reason::DropGroupNotOwner => "drop_group_not_owner",
            Reason::PassedVlanOther => "passed_vlan_other",
            Reason::ForwardedHome => "forwarded_home",
            Reason::NdpAnswered => "ndp_answered",
            Reason::NdpNotHeld => "ndp_not_held",
            Reason::NdpStale => "ndp_stale",
            Reason::NdpOther => "ndp_other",
            Reason::NdpInvalid => "ndp_invalid",
            Reason::NdpConflict => "ndp_conflict",
            Reason::NdpNotAnnounced => "ndp_not_announced",
            Reason::ArpWatched => "arp_watched",
            Reason::PassedIpv6Ext => "passed_ipv6_ext",
            Reason::FlowEvicted => "flow_evicted",
            Reason::ForwardedIcmpError => "forwarded_icmp_error",
        }
    }
}

impl Reason {
    /// What the program does with a frame counted under this reason.
    pub const fn verdict(self) -> &'static str {
        match self {
            Reason::ArpAnswered | Reason::Forwarded | Reason::NdpAnswered => "XDP_TX",
            Reason::ForwardedHome | Reason::ForwardedIcmpError => "XDP_TX or XDP_REDIRECT",
            Reason::DropMalformed | Reason::DropNoBackend | Reason::ArpNotAnnounced | Reason::DropGroupNotOwner => "XDP_DROP",
            Reason::FlowRehashed | Reason::FlowEvicted => "(an event, counted besides the verdict)",
            Reason::ArpNotHeld
            | Reason::ArpStale
            | Reason::ArpOther
            | Reason::PassedLocalBackend
            | Reason::PassedNotVip
            | Reason::PassedNotOwner
            | Reason::PassedIcmp
            | Reason::PassedFragmentNoService
            | Reason::PassedOther
            | Reason::ArpConflict
            | Reason::PassedVlanOther
            | Reason::NdpNotHeld
            | Reason::NdpStale
            | Reason::NdpOther
            | Reason::NdpInvalid
            | Reason::NdpConflict
            | Reason::NdpNotAnnounced
            | Reason::ArpWatched
            | Reason::PassedIpv6Ext => "XDP_PASS",
        }
    }

    /// Why a frame is counted under this reason, and what a rising count means
    /// (docs/reference/reasons.md is generated from these).
    pub const fn describe(self) -> &'static str {
        match self {
            Reason::ArpAnswered => {
                "An ARP request for a VIP this node holds, fresh, on the network it arrived on: answered by the data path (rewritten into the reply and sent back out)."
            }
            Reason::ArpNotHeld => {
                "An ARP request for an address this node does not hold on that network (another node's VIP, or no VIP at all): passed to the kernel, which answers for its own addresses."
            }
            Reason::ArpStale => {
                "An ARP request for a VIP this node holds past its deadline: not answered, passed. The holder's agent stopped refreshing it (hung or stopped), or the VIP was just released; rising on one node means its agent is not running its liveness loop."
            }
            Reason::ArpOther => {
                "ARP that is not a request for a held VIP: replies and gratuitous ARP that claim no VIP of ours, ARP for other hardware or protocol types. Passed untouched."
            }
            Reason::Forwarded => {
                "A packet to a VIP service this node holds, sent to a backend on another node of the same network (destination MAC rewritten, out of the interface it came in on)."
            }
            Reason::PassedLocalBackend => {
                "A packet to a VIP service whose chosen backend is this node: passed to the local stack (kube-proxy's rules, or the VIP on lo in file mode, take it)."
            }
            Reason::PassedNotVip => {
                "An IPv4 or IPv6 packet not addressed to a VIP service (another destination, port or IP protocol): ordinary traffic of the node, passed."
            }
            Reason::PassedNotOwner => {
                "A packet to a VIP service this node does not hold fresh: a frame another node forwarded here as a backend (normal on backends), also to a former holder of the VIP, which never forwards a node's frame again. Passed to the stack."
            }
            Reason::PassedIcmp => {
                "ICMP to a VIP other than an error about one of its balanced flows (pings, and errors the data path does not read: see `forwarded_icmp_error`), or ICMPv6 behind extension headers: passed to the stack, which answers pings to the VIPs it holds."
            }
            Reason::PassedFragmentNoService => {
                "An IPv4 or IPv6 fragment to an address and protocol without a VIP service: passed. (Fragments of VIP services go to one backend per datagram.)"
            }
            Reason::DropMalformed => "A frame whose Ethernet, VLAN, ARP, IPv4 or IPv6 header is truncated or invalid: dropped.",
            Reason::DropNoBackend => {
                "A new flow to a VIP service this node holds whose ring has no backend (no ready, healthy backend node with a known MAC): dropped. See the service's backends and their health with `vip-agent inspect`."
            }
            Reason::FlowRehashed => {
                "An event, not a verdict: a flow whose recorded backend has left (unhealthy, drained or removed) was placed on the service's ring again; its connection most likely breaks."
            }
            Reason::PassedOther => {
                "A frame that is neither ARP, IPv4 nor IPv6 (LLDP, ...), or ICMPv6 that is neither neighbour discovery nor an error about a balanced flow (pings, and errors the data path does not read: see `forwarded_icmp_error`): passed."
            }
            Reason::ArpConflict => {
                "An ARP reply or gratuitous ARP in which another MAC claims a VIP this node holds: two nodes answer for it (a second load balancer, a host with the VIP configured, a partitioned peer). Passed; the agent re-announces the VIP and counts vip_arp_conflicts_total."
            }
            Reason::ArpNotAnnounced => {
                "An ARP request for a VIP of an `announce: lo` pool that this node holds: dropped, so that the node's kernel does not answer for it over ARP (a routing daemon announces the VIP)."
            }
            Reason::DropGroupNotOwner => {
                "A broadcast or multicast frame to a VIP service that this node does not hold fresh: dropped, so that only the holder's stack answers it."
            }
            Reason::PassedVlanOther => {
                "A frame tagged for a VLAN no pool lives on here, or with an 802.1ad (S-tag) or two tags (QinQ): passed untouched."
            }
            Reason::ForwardedHome => {
                "A packet to a VIP of another network than the node's home (another interface, a VLAN), forwarded to its backend out of the home interface, untagged."
            }
            Reason::NdpAnswered => {
                "An IPv6 Neighbor Solicitation for a VIP this node holds, fresh, on the network it arrived on: answered by the data path with a Neighbor Advertisement (Solicited and Override set, our MAC as target link-layer address; to all-nodes for duplicate address detection)."
            }
            Reason::NdpNotHeld => {
                "A valid Neighbor Solicitation for an address this node does not hold on that network (another node's VIP, or no VIP at all): passed to the kernel, which answers for its own addresses."
            }
            Reason::NdpStale => {
                "A Neighbor Solicitation for a VIP this node holds past its deadline: not answered, passed (fenced, as `arp_stale`)."
            }
            Reason::NdpOther => {
                "A Neighbor Advertisement that claims no VIP of ours, or a neighbour discovery message the program leaves to the kernel: passed untouched."
            }
            Reason::NdpInvalid => {
                "A Neighbor Solicitation or Advertisement that fails RFC 4861's checks (hop limit not 255, code not 0, too short, multicast target, an option of length zero or past the end, a source link-layer option from the unspecified address, a destination that is neither the target nor its solicited-node group): not answered, passed (the kernel discards it too)."
            }
            Reason::NdpConflict => {
                "A Neighbor Advertisement in which another MAC claims a VIP this node holds: two nodes answer for it. Passed; the agent re-announces the VIP (as for `arp_conflict`) and counts vip_arp_conflicts_total."
            }
            Reason::FlowEvicted => {
                "An event, not a verdict: a flow's second packet pinned it in the flow table (`lb_flows`) over another flow looked up in the last minute or so (`FLOW_LIVE_STAMPS`), the oldest of the four in its set (a 64-byte line), because all four were taken. Flows idle for longer are replaced without a count (nothing else removes ended flows). A steady rise means more active flows than the table holds (1,048,576 a node), or a flood of flows that send two packets each: an evicted flow's next packet follows the ring again, which breaks it only if the ring changed since it began."
            }
            Reason::PassedIpv6Ext => {
                "An IPv6 packet to a VIP whose extension headers the program does not walk (other than hop-by-hop, routing, destination options and fragment, such as AH or ESP), or a chain of more than six: passed to the stack, not balanced."
            }
            Reason::NdpNotAnnounced => {
                "A Neighbor Solicitation for a VIP of an `announce: lo` pool that this node holds: not answered (a routing daemon announces the VIP), passed; Linux answers solicitations only for the receiving interface's own addresses, so a VIP on lo is not answered by the kernel either."
            }
            Reason::ForwardedIcmpError => {
                "An ICMP destination unreachable (fragmentation needed among them) or ICMPv6 destination unreachable or packet too big about a flow of a VIP service this node holds, sent to the backend that serves the flow (its pin in the flow table, else the ring's choice) as a packet of the flow is: the backend, which answers clients directly, learns the path MTU. Read only when the headers are at fixed places (no IPv4 options, no IPv6 extension headers, outer or inner) and the quoted packet is TCP or UDP from the VIP with its ports; creates no flow. A rise means a path to clients with a smaller MTU than the backends' (normal), or a flood of forged errors."
            }
            Reason::ArpWatched => {
                "An ARP reply or gratuitous ARP for a VIP another node holds that this node's agent is checking (its ARP self-check asked who answers for it): the sender MAC is recorded in `arp_watch` for the agent, the frame passed. A few per VIP checked, about every 45 s."
            }
        }
    }
}

/// The flow hash, shared so that userspace can predict the data path's choice
/// (tests, `inspect`). A Jenkins-style mix of the 5-tuple words; fragments pass
/// zero ports so every fragment of a datagram hashes alike.
#[inline(always)]
pub fn flow_hash(src: [u8; 4], dst: [u8; 4], sport: [u8; 2], dport: [u8; 2], proto: u8) -> u32 {
    let mut a = u32::from_ne_bytes(src);
    let mut b = u32::from_ne_bytes(dst);
    let mut c = (u32::from(u16::from_ne_bytes(sport)) << 16 | u32::from(u16::from_ne_bytes(dport))) ^ (u32::from(proto) << 8) ^ 0x9e37_79b9;
    // Bob Jenkins' final mix (lookup3 `final`).
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(14));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(11));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(25));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(16));
    a ^= c;
    a = a.wrapping_sub(c.rotate_left(4));
    b ^= a;
    b = b.wrapping_sub(a.rotate_left(14));
    c ^= b;
    c = c.wrapping_sub(b.rotate_left(24));
    c
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are repr(C), Copy, with explicit padding and no pointers.
    unsafe impl aya::Pod for LbIface {}
    unsafe impl aya::Pod for ArpHeldKey {}
    unsafe impl aya::Pod for NdpHeldKey {}
    unsafe impl aya::Pod for LbVlanKey {}
    unsafe impl aya::Pod for LbHome {}
    unsafe impl aya::Pod for ArpHeldVip {}
    unsafe impl aya::Pod for Lb4HeldSlot {}
    unsafe impl aya::Pod for Lb6HeldSlot {}
    unsafe impl aya::Pod for ArpWatch {}
    unsafe impl aya::Pod for Lb4ServiceKey {}
    unsafe impl aya::Pod for Lb4Service {}
    unsafe impl aya::Pod for Lb4Backend {}
    unsafe impl aya::Pod for Lb4FlowKey {}
    unsafe impl aya::Pod for LbFlowSet {}
    unsafe impl aya::Pod for LbFlowsCtl {}
    unsafe impl aya::Pod for Lb4FirstPacket {}
    unsafe impl aya::Pod for Counter {}
    unsafe impl aya::Pod for Lb4FlowCacheEntry {}
    unsafe impl aya::Pod for Lb4FlowCacheCtl {}
    unsafe impl aya::Pod for Lb6ServiceKey {}
    unsafe impl aya::Pod for Lb6FlowKey {}
    unsafe impl aya::Pod for Lb6FirstPacket {}
    unsafe impl aya::Pod for Lb6FlowCacheEntry {}
}
