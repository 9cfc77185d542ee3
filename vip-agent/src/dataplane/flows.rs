//! The flow tables (`lb4_flows` for flows past their first packet, `lb4_first_packets`
//! for flows seen once): eviction, and filling them to scale in tests and benchmarks.
use anyhow::{Context as _, Result};
use aya::maps::IterableMap as _;
use vip_common::{first_packet_check, Lb4FirstPacket, Lb4Flow, Lb4FlowKey, FIRST_PACKET_SLOTS};

use super::{batch, Dataplane};

impl Dataplane {
    /// Removes entries matching `pred` from both flow tables (one batched walk of
    /// each, batched deletes; first-packet records are cleared); returns how many.
    pub fn evict_flows(&mut self, pred: impl Fn(&Lb4FlowKey, &Lb4Flow) -> bool) -> Result<usize> {
        let map = self.flows.map();
        let stale: Vec<Lb4FlowKey> = batch::lookup_all::<Lb4FlowKey, Lb4Flow>(map)?.into_iter().filter(|(k, f)| pred(k, f)).map(|(k, _)| k).collect();
        let mut n = if stale.is_empty() { 0 } else { batch::delete(map, &stale)? };
        let cleared: Vec<(u32, Lb4FirstPacket)> = self
            .first_packets()?
            .into_iter()
            .filter(|(_, r)| pred(&r.key, &Lb4Flow { backend: r.backend, _pad: 0 }))
            .map(|(slot, _)| (slot, Lb4FirstPacket::default()))
            .collect();
        if !cleared.is_empty() {
            batch::update(self.first_packets.map(), &cleared).context("clearing lb4_first_packets")?;
            n += cleared.len();
        }
        self.epoch.bump()?; // cached copies of the removed flows
        Ok(n)
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

    /// Writes established flows (`lb4_flows`) as the data path would on second
    /// packets: how tests and benchmarks fill the flow table to real scale without
    /// sending millions of packets.
    pub fn insert_flows(&mut self, flows: &[(Lb4FlowKey, Lb4Flow)]) -> Result<()> {
        batch::update(self.flows.map(), flows).context("writing lb4_flows")
    }

    /// The flow cache's epoch (`lb4_flow_cache_ctl`): bumped each time cached answers are invalidated.
    pub fn flow_cache_epoch(&self) -> Result<u64> {
        self.epoch.epoch()
    }

    /// Flows in `lb4_flows` (past their first packet).
    pub fn flow_count(&self) -> usize {
        batch::lookup_all::<Lb4FlowKey, Lb4Flow>(self.flows.map()).map_or(0, |v| v.len())
    }

    /// Flows recorded in `lb4_first_packets` (seen once).
    pub fn new_flow_count(&self) -> usize {
        self.first_packets().map_or(0, |v| v.len())
    }
}
