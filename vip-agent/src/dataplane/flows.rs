//! The flow tables (`lb4_flows` / `lb6_flows` for flows past their first packet,
//! `lb4_first_packets` / `lb6_first_packets` for flows seen once): eviction, and
//! filling them to scale in tests and benchmarks.
use anyhow::{Context as _, Result};
use aya::{
    maps::{Array, HashMap, IterableMap as _, MapData},
    Pod,
};
use vip_common::{first_packet_check, fold_words6, Lb4FirstPacket, Lb4Flow, Lb4FlowKey, Lb6FirstPacket, Lb6FlowKey, FIRST_PACKET_SLOTS};

use super::{batch, Dataplane};

/// A first-packet record of either family.
trait FirstPacket: Pod + Default {
    type Key;
    fn key(&self) -> &Self::Key;
    fn backend(&self) -> u32;
    /// Whether the record is whole (see `Lb4FirstPacket::check`).
    fn valid(&self) -> bool;
}

impl FirstPacket for Lb4FirstPacket {
    type Key = Lb4FlowKey;
    fn key(&self) -> &Lb4FlowKey {
        &self.key
    }
    fn backend(&self) -> u32 {
        self.backend
    }
    fn valid(&self) -> bool {
        let w = self.key.words();
        self.check == first_packet_check(w[0], w[1], self.backend)
    }
}

impl FirstPacket for Lb6FirstPacket {
    type Key = Lb6FlowKey;
    fn key(&self) -> &Lb6FlowKey {
        &self.key
    }
    fn backend(&self) -> u32 {
        self.backend
    }
    fn valid(&self) -> bool {
        let (h0, h1) = fold_words6(&self.key.words());
        self.check == first_packet_check(h0, h1, self.backend)
    }
}

/// The valid records of a first-packet table with their slots (flows seen once).
fn first_packets<R: FirstPacket>(map: &Array<MapData, R>, name: &str) -> Result<Vec<(u32, R)>> {
    let all = batch::array_range::<R>(map.map(), 0, FIRST_PACKET_SLOTS).with_context(|| format!("reading {name}"))?;
    Ok((0..).zip(all).filter(|(_, r)| r.valid()).collect())
}

/// Removes the entries of one family's tables matching `pred` (one batched walk of
/// each, batched deletes; first-packet records are cleared); returns how many.
fn evict<K: Pod, R: FirstPacket<Key = K>>(
    flows: &HashMap<MapData, K, Lb4Flow>,
    firsts: &Array<MapData, R>,
    name: &str,
    pred: impl Fn(&K, &Lb4Flow) -> bool,
) -> Result<usize> {
    let map = flows.map();
    let stale: Vec<K> = batch::lookup_all::<K, Lb4Flow>(map)?.into_iter().filter(|(k, f)| pred(k, f)).map(|(k, _)| k).collect();
    let mut n = if stale.is_empty() { 0 } else { batch::delete(map, &stale)? };
    let cleared: Vec<(u32, R)> = first_packets(firsts, name)?
        .into_iter()
        .filter(|(_, r)| pred(r.key(), &Lb4Flow { backend: r.backend(), _pad: 0 }))
        .map(|(slot, _)| (slot, R::default()))
        .collect();
    if !cleared.is_empty() {
        batch::update(firsts.map(), &cleared).with_context(|| format!("clearing {name}"))?;
        n += cleared.len();
    }
    Ok(n)
}

impl Dataplane {
    /// Removes IPv4 flows matching `pred` from both flow tables; returns how many.
    pub fn evict_flows(&mut self, pred: impl Fn(&Lb4FlowKey, &Lb4Flow) -> bool) -> Result<usize> {
        let n = evict(&self.flows, &self.first_packets, "lb4_first_packets", pred)?;
        self.epoch.bump()?; // cached copies of the removed flows
        Ok(n)
    }

    /// Removes IPv6 flows matching `pred` from both flow tables; returns how many.
    pub fn evict_flows6(&mut self, pred: impl Fn(&Lb6FlowKey, &Lb4Flow) -> bool) -> Result<usize> {
        let n = evict(&self.flows6, &self.first_packets6, "lb6_first_packets", pred)?;
        self.epoch.bump()?;
        Ok(n)
    }

    /// Writes established flows (`lb4_flows`) as the data path would on second
    /// packets: how tests and benchmarks fill the flow table to real scale without
    /// sending millions of packets.
    pub fn insert_flows(&mut self, flows: &[(Lb4FlowKey, Lb4Flow)]) -> Result<()> {
        batch::update(self.flows.map(), flows).context("writing lb4_flows")
    }

    /// As [`Self::insert_flows`], for `lb6_flows`.
    pub fn insert_flows6(&mut self, flows: &[(Lb6FlowKey, Lb4Flow)]) -> Result<()> {
        batch::update(self.flows6.map(), flows).context("writing lb6_flows")
    }

    /// The flow cache's epoch (`lb4_flow_cache_ctl`): bumped each time cached answers are invalidated.
    pub fn flow_cache_epoch(&self) -> Result<u64> {
        self.epoch.epoch()
    }

    /// Flows in `lb4_flows` and `lb6_flows` (past their first packet).
    pub fn flow_count(&self) -> usize {
        let v4 = batch::lookup_all::<Lb4FlowKey, Lb4Flow>(self.flows.map()).map_or(0, |v| v.len());
        v4 + self.flow_count6()
    }

    /// Flows in `lb6_flows`.
    pub fn flow_count6(&self) -> usize {
        batch::lookup_all::<Lb6FlowKey, Lb4Flow>(self.flows6.map()).map_or(0, |v| v.len())
    }

    /// Flows recorded in `lb4_first_packets` and `lb6_first_packets` (seen once).
    pub fn new_flow_count(&self) -> usize {
        first_packets(&self.first_packets, "lb4_first_packets").map_or(0, |v| v.len())
            + first_packets(&self.first_packets6, "lb6_first_packets").map_or(0, |v| v.len())
    }
}
