//! The flow tables (`lb4_flows` for flows past their first packet, `lb4_flows_new`
//! for flows seen once): eviction, and filling them to scale in tests and benchmarks.
use anyhow::{Context as _, Result};
use aya::maps::IterableMap as _;
use vip_common::{Lb4Flow, Lb4FlowKey};

use super::{batch, Dataplane};

impl Dataplane {
    /// Removes entries matching `pred` from both flow tables (one batched walk,
    /// batched deletes each); returns how many.
    pub fn evict_flows(&mut self, pred: impl Fn(&Lb4FlowKey, &Lb4Flow) -> bool) -> Result<usize> {
        let mut n = 0;
        for map in [self.flows.map(), self.flows_new.map()] {
            let stale: Vec<Lb4FlowKey> = batch::lookup_all::<Lb4FlowKey, Lb4Flow>(map)?.into_iter().filter(|(k, f)| pred(k, f)).map(|(k, _)| k).collect();
            n += if stale.is_empty() { 0 } else { batch::delete(map, &stale)? };
        }
        self.epoch.bump()?; // cached copies of the removed flows
        Ok(n)
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

    /// Flows in `lb4_flows_new` (seen once).
    pub fn new_flow_count(&self) -> usize {
        batch::lookup_all::<Lb4FlowKey, Lb4Flow>(self.flows_new.map()).map_or(0, |v| v.len())
    }
}
