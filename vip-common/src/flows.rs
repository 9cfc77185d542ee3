//! Flow keys and the hashes both sides compute: the flow table (`lb_flows`) and
//! its first-packet record and per-CPU caches, the Maglev ring's flow hash
//! ([`flow_hash`], [`flow_hash6`]) and the address bitmaps' bits. The agent and
//! the tests predict the data path's choices with these very functions; their
//! outputs are fixed by tests, since agents of two releases must agree on them.

use crate::maps::{LbService, FIRST_PACKET_BITS, FLOW_CACHE_BITS, FLOW_CACHE_SLOTS, FLOW_SET_BITS, FLOW_WAYS, MAX_FLOWS};

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
    /// [`FlowCacheCtl::epoch`] when the answer was computed.
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
pub struct FlowCacheCtl {
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
    pub service: LbService,
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
