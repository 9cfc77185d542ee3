//! The flow tables (`lb_flows` for flows past their first packet, both families;
//! `lb4_first_packets` and `lb6_first_packets` for flows seen once): eviction, counts, and filling them to scale in tests and
//! benchmarks.
//!
//! `lb_flows` is an array of sets (four 16-byte entries, one cache line each; see
//! `vip_common::LbFlowEntry`), created `BPF_F_MMAPABLE`: the agent maps it and
//! reads and clears entries in place, an entry at a time, with the same hash,
//! set and tag functions (vip-common) as the data path. An eviction clears a tag
//! only if it is still the one read (compare-and-swap), so a flow the data path
//! pins meanwhile in that way is never lost.
use std::{
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::{AsFd as _, AsRawFd as _},
    sync::atomic::{AtomicU64, Ordering},
};

use anyhow::{bail, Context as _, Result};
use aya::maps::{Array, IterableMap as _, MapData};
use vip_common::{
    first_packet_check, fold_words6, lb_flow_check, lb_flow_hash, lb_flow_set, lb_flow_tag, lb_flow_word1, Lb4FirstPacket, Lb4FlowKey, Lb6FirstPacket,
    Lb6FlowKey, LbFlowEntry, LbFlowSet, LbFlowsCtl, FIRST_PACKET_SLOTS, FLOW_FAMILY_V4, FLOW_FAMILY_V6, FLOW_SETS, FLOW_STAMP_SHIFT, FLOW_WAYS,
};

use super::{batch, Dataplane};
use crate::model::{Protocol, ServiceAddr};

/// The flow table, mapped into this process.
pub(super) struct FlowTable {
    /// Keeps the map's fd (the mapping would outlive it anyway).
    _map: Array<MapData, LbFlowSet>,
    words: *const AtomicU64,
    len: usize,
    seed: [u64; 2],
}

// SAFETY: the mapping is shared memory accessed only through atomics; it lives
// until drop.
unsafe impl Send for FlowTable {}
unsafe impl Sync for FlowTable {}

impl Drop for FlowTable {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of `len` bytes, not used past here.
        unsafe { libc::munmap(self.words as *mut libc::c_void, self.len) };
    }
}

/// Words of the table: two per entry.
const WORDS: usize = (FLOW_SETS * FLOW_WAYS * 2) as usize;

impl FlowTable {
    /// Maps `map`; its hash key from `ctl`, written first if `create` and the
    /// table has none yet (a table just created: zero is never a random key in
    /// practice).
    pub(super) fn new(map: Array<MapData, LbFlowSet>, ctl: &mut Array<MapData, LbFlowsCtl>, create: bool) -> Result<Self> {
        let mut c = ctl.get(&0, 0).context("reading lb_flows_ctl")?;
        if create && c.seed == [0, 0] {
            c.seed = random_seed()?;
            ctl.set(0, c, 0).context("writing lb_flows_ctl")?;
        }
        if map.len() != FLOW_SETS {
            bail!("the pinned lb_flows has {} sets, this version {FLOW_SETS}: remove the pins (see Restarts and upgrades)", map.len());
        }
        let len = WORDS * 8;
        let fd = map.map().fd().as_fd().as_raw_fd();
        // SAFETY: a shared mapping of the whole map (created BPF_F_MMAPABLE, and
        // exactly `len` bytes: 64-byte values, a multiple of the page size in all).
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mapping lb_flows (an older lb_flows not created mmapable?)");
        }
        Ok(Self { _map: map, words: p as *const AtomicU64, len, seed: c.seed })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < WORDS);
        // SAFETY: within the mapping; AtomicU64 has u64's layout, and the kernel's
        // values start on a page, so every word is aligned.
        unsafe { &*self.words.add(i) }
    }

    /// The entry at `i` (set · FLOW_WAYS + way).
    fn entry(&self, i: usize) -> LbFlowEntry {
        let (tag, w1) = (self.word(2 * i).load(Ordering::Acquire), self.word(2 * i + 1).load(Ordering::Relaxed));
        LbFlowEntry { tag, backend: w1 as u16, check: (w1 >> 16) as u16, stamp: (w1 >> 32) as u32 }
    }

    /// (set, tag) of an IPv4 flow of service `service`, as the data path computes them.
    fn place(&self, key: &Lb4FlowKey, service: u32) -> (usize, u64) {
        let h = lb_flow_hash(&self.seed, FLOW_FAMILY_V4, &key.words());
        (lb_flow_set(h) as usize, lb_flow_tag(h, service))
    }

    /// (set, tag) of an IPv6 flow of service `service`, as the data path computes them.
    fn place6(&self, key: &Lb6FlowKey, service: u32) -> (usize, u64) {
        let h = lb_flow_hash(&self.seed, FLOW_FAMILY_V6, &key.words());
        (lb_flow_set(h) as usize, lb_flow_tag(h, service))
    }

    /// The index of the entry holding `tag` in `set`.
    fn find(&self, set: usize, tag: u64) -> Option<usize> {
        (set * FLOW_WAYS as usize..(set + 1) * FLOW_WAYS as usize).find(|&i| self.word(2 * i).load(Ordering::Acquire) == tag)
    }

    /// Empties the entry at `i` if it still holds `tag`.
    fn clear(&self, i: usize, tag: u64) -> bool {
        self.word(2 * i).compare_exchange(tag, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// Pins a flow as the data path's second packet does: the way that holds it,
    /// else an empty one, else the one with the oldest stamp.
    fn insert(&self, set: usize, tag: u64, backend: u16, stamp: u32) {
        let ways = set * FLOW_WAYS as usize..(set + 1) * FLOW_WAYS as usize;
        let i = self
            .find(set, tag)
            .or_else(|| ways.clone().find(|&i| self.entry(i).tag == 0))
            .unwrap_or_else(|| ways.min_by_key(|&i| self.entry(i).stamp).expect("four ways"));
        self.word(2 * i + 1).store(lb_flow_word1(tag, backend, stamp), Ordering::Release);
        self.word(2 * i).store(tag, Ordering::Release);
    }

    /// Every entry that is not empty nor torn, with its index.
    fn valid(&self) -> impl Iterator<Item = (usize, LbFlowEntry)> + '_ {
        (0..(FLOW_SETS * FLOW_WAYS) as usize).map(|i| (i, self.entry(i))).filter(|(_, e)| e.tag != 0 && e.check == lb_flow_check(e.tag, e.backend))
    }
}

/// A random hash key for a new table (getrandom(2)).
fn random_seed() -> Result<[u64; 2]> {
    let mut b = [0u8; 16];
    // SAFETY: a buffer of 16 writable bytes.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        return Err(std::io::Error::last_os_error()).context("getrandom for the flow table's hash key");
    }
    Ok([u64::from_ne_bytes(b[..8].try_into().expect("8")), u64::from_ne_bytes(b[8..].try_into().expect("8"))])
}

/// The coarse clock in stamp units, as the data path reads it (`bpf_ktime_get_coarse_ns`).
fn stamp_now() -> u32 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC_COARSE exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ((ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64) >> FLOW_STAMP_SHIFT) as u32
}

/// Service id given to flows whose service is not programmed (for eviction
/// predicates): no service has it.
pub const NO_SERVICE: u32 = u32::MAX;

impl Dataplane {
    /// Removes the flows for which `pred(service id, backend id)` holds from both
    /// flow tables (the first-packet records by the service their key names now,
    /// [`NO_SERVICE`] if none); returns how many. One pass over each table.
    pub fn evict_flows(&mut self, pred: impl Fn(u32, u32) -> bool) -> Result<usize> {
        let t = &self.flows;
        let stale: Vec<(usize, u64)> = t.valid().filter(|(_, e)| pred((e.tag >> 48) as u32, u32::from(e.backend))).map(|(i, e)| (i, e.tag)).collect();
        let mut n = stale.into_iter().filter(|&(i, tag)| t.clear(i, tag)).count();
        let cleared: Vec<(u32, Lb4FirstPacket)> = self
            .first_packets()?
            .into_iter()
            .filter(|(_, r)| pred(self.flow_service(&r.key).unwrap_or(NO_SERVICE), r.backend))
            .map(|(slot, _)| (slot, Lb4FirstPacket::default()))
            .collect();
        if !cleared.is_empty() {
            batch::update(self.first_packets.map(), &cleared).context("clearing lb4_first_packets")?;
            n += cleared.len();
        }
        let cleared6: Vec<(u32, Lb6FirstPacket)> = self
            .first_packets6()?
            .into_iter()
            .filter(|(_, r)| pred(self.flow_service6(&r.key).unwrap_or(NO_SERVICE), r.backend))
            .map(|(slot, _)| (slot, Lb6FirstPacket::default()))
            .collect();
        if !cleared6.is_empty() {
            batch::update(self.first_packets6.map(), &cleared6).context("clearing lb6_first_packets")?;
            n += cleared6.len();
        }
        self.epoch.bump()?; // cached copies of the removed flows
        Ok(n)
    }

    /// Removes one flow from `lb_flows` (and its first-packet record); whether
    /// there was one.
    pub fn evict_flow(&mut self, key: &Lb4FlowKey) -> Result<bool> {
        let mut found = false;
        if let Some(service) = self.flow_service(key) {
            let (set, tag) = self.flows.place(key, service);
            found = self.flows.find(set, tag).is_some_and(|i| self.flows.clear(i, tag));
        }
        let records: Vec<(u32, Lb4FirstPacket)> =
            self.first_packets()?.into_iter().filter(|(_, r)| r.key == *key).map(|(slot, _)| (slot, Lb4FirstPacket::default())).collect();
        if !records.is_empty() {
            batch::update(self.first_packets.map(), &records).context("clearing lb4_first_packets")?;
            found = true;
        }
        self.epoch.bump()?;
        Ok(found)
    }

    /// The id of the service an IPv4 flow reaches now: its (VIP, port, protocol),
    /// or for a fragment (port 0) the service its VIP's fragment entry names.
    pub(super) fn flow_service(&self, key: &Lb4FlowKey) -> Option<u32> {
        let protocol = Protocol::from_number(key.proto)?;
        self.service_of(Ipv4Addr::from(key.dst).into(), u16::from_be_bytes(key.dport), protocol)
    }

    /// The id of the service an IPv6 flow reaches now, as [`Self::flow_service`].
    pub(super) fn flow_service6(&self, key: &Lb6FlowKey) -> Option<u32> {
        let protocol = Protocol::from_number(key.proto)?;
        self.service_of(Ipv6Addr::from(key.dst).into(), u16::from_be_bytes(key.dport), protocol)
    }

    /// The id of the service of (`vip`, `port`, `protocol`); port 0: the service
    /// the VIP's fragment entry names.
    fn service_of(&self, vip: std::net::IpAddr, port: u16, protocol: Protocol) -> Option<u32> {
        if port == 0 {
            return self.fragment_target(vip, protocol).map(|p| p.id);
        }
        self.programmed.get(&ServiceAddr { vip, port, protocol }).map(|p| p.id)
    }

    /// The valid records of `lb4_first_packets` with their slots (flows seen once).
    fn first_packets(&self) -> Result<Vec<(u32, Lb4FirstPacket)>> {
        let all = batch::array_range::<Lb4FirstPacket>(self.first_packets.map(), 0, FIRST_PACKET_SLOTS).context("reading lb4_first_packets")?;
        Ok((0..)
            .zip(all)
            .filter(|(_, r)| {
                let w = r.key.words();
                r.check == first_packet_check(w[0], w[1], r.backend)
            })
            .collect())
    }

    /// The valid records of `lb6_first_packets` with their slots.
    fn first_packets6(&self) -> Result<Vec<(u32, Lb6FirstPacket)>> {
        let all = batch::array_range::<Lb6FirstPacket>(self.first_packets6.map(), 0, FIRST_PACKET_SLOTS).context("reading lb6_first_packets")?;
        Ok((0..)
            .zip(all)
            .filter(|(_, r)| {
                let (h0, h1) = fold_words6(&r.key.words());
                r.check == first_packet_check(h0, h1, r.backend)
            })
            .collect())
    }

    /// Pins established flows (key, backend id) in `lb_flows` as the data path
    /// would on their second packets: how tests and benchmarks fill the flow table
    /// to real scale without sending millions of packets. Each key's service must
    /// be programmed.
    pub fn insert_flows(&mut self, flows: &[(Lb4FlowKey, u32)]) -> Result<()> {
        let stamp = stamp_now();
        for (key, backend) in flows {
            let service = self.flow_service(key).with_context(|| format!("no service for the flow {key:?}"))?;
            let (set, tag) = self.flows.place(key, service);
            self.flows.insert(set, tag, *backend as u16, stamp);
        }
        Ok(())
    }

    /// [`Self::insert_flows`] for IPv6 flows (the same table, hashed as the data
    /// path hashes an IPv6 5-tuple).
    pub fn insert_flows6(&mut self, flows: &[(Lb6FlowKey, u32)]) -> Result<()> {
        let stamp = stamp_now();
        for (key, backend) in flows {
            let service = self.flow_service6(key).with_context(|| format!("no service for the flow {key:?}"))?;
            let (set, tag) = self.flows.place6(key, service);
            self.flows.insert(set, tag, *backend as u16, stamp);
        }
        Ok(())
    }

    /// The entry pinning an IPv6 flow, if any.
    pub fn flow6(&self, key: &Lb6FlowKey) -> Option<LbFlowEntry> {
        let (set, tag) = self.flows.place6(key, self.flow_service6(key)?);
        self.flows.find(set, tag).map(|i| self.flows.entry(i))
    }

    /// The entry pinning an IPv4 flow, if any.
    pub fn flow(&self, key: &Lb4FlowKey) -> Option<LbFlowEntry> {
        let (set, tag) = self.flows.place(key, self.flow_service(key)?);
        self.flows.find(set, tag).map(|i| self.flows.entry(i))
    }

    /// The set of `lb_flows` an IPv4 flow goes to (None: no service for it).
    pub fn flow_set(&self, key: &Lb4FlowKey) -> Option<usize> {
        Some(self.flows.place(key, self.flow_service(key)?).0)
    }

    /// Sets the stamp of a pinned flow (tests: a flow made to look idle); whether
    /// it was pinned.
    #[doc(hidden)]
    pub fn set_flow_stamp(&mut self, key: &Lb4FlowKey, stamp: u32) -> bool {
        let Some(service) = self.flow_service(key) else { return false };
        let (set, tag) = self.flows.place(key, service);
        let Some(i) = self.flows.find(set, tag) else { return false };
        let e = self.flows.entry(i);
        self.flows.word(2 * i + 1).store(lb_flow_word1(tag, e.backend, stamp), Ordering::Release);
        true
    }

    /// The flow cache's epoch (`lb4_flow_cache_ctl`): bumped each time cached answers are invalidated.
    pub fn flow_cache_epoch(&self) -> Result<u64> {
        self.epoch.epoch()
    }

    /// Flows in `lb_flows` (past their first packet), of both families.
    pub fn flow_count(&self) -> usize {
        self.flows.valid().count()
    }

    /// Flows recorded in `lb4_first_packets` and `lb6_first_packets` (seen once).
    pub fn new_flow_count(&self) -> usize {
        self.first_packets().map_or(0, |v| v.len()) + self.first_packets6().map_or(0, |v| v.len())
    }
}
