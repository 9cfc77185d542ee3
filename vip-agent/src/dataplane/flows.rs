//! The flow table (`lb4_flows`): eviction, and filling it to scale in tests and
//! benchmarks.
use anyhow::{Context as _, Result};
use aya::maps::IterableMap as _;
use vip_common::{Lb4Flow, Lb4FlowKey};

use super::{batch, Dataplane};

impl Dataplane {
    /// Removes flow-table entries matching `pred` (one batched walk, batched
    /// deletes); returns how many.
    pub fn evict_flows(&mut self, pred: impl Fn(&Lb4FlowKey, &Lb4Flow) -> bool) -> Result<usize> {
        let stale: Vec<Lb4FlowKey> =
            batch::lookup_all::<Lb4FlowKey, Lb4Flow>(self.flows.map())?.into_iter().filter(|(k, f)| pred(k, f)).map(|(k, _)| k).collect();
        let n = if stale.is_empty() { 0 } else { batch::delete(self.flows.map(), &stale)? };
        self.epoch.bump()?; // cached copies of the removed flows
        Ok(n)
    }

    /// Writes flow-table entries as the data path would on first packets: how
    /// tests and benchmarks fill `lb4_flows` to real scale without sending a
    /// million packets.
    pub fn insert_flows(&mut self, flows: &[(Lb4FlowKey, Lb4Flow)]) -> Result<()> {
        batch::update(self.flows.map(), flows).context("writing lb4_flows")
    }

    /// The flow cache's epoch (`lb4_flow_cache_ctl`): bumped each time cached answers are invalidated.
    pub fn flow_cache_epoch(&self) -> Result<u64> {
        self.epoch.epoch()
    }

    pub fn flow_count(&self) -> usize {
        batch::lookup_all::<Lb4FlowKey, Lb4Flow>(self.flows.map()).map_or(0, |v| v.len())
    }
}
