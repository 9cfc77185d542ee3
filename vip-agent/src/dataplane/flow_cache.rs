//! The data path's per-CPU flow cache (`lb4_flow_cache`) memoises answers for
//! flows pinned in `lb4_flows`; the epoch in `lb4_flow_cache_ctl` says which
//! answers are current. Every facade call that could make a cached answer wrong
//! bumps the epoch after its last map write: a service or its fragment alias
//! removed or changed, a backend written, zeroed or its id reused, flows evicted,
//! a VIP released or forgotten, an interface's MAC changed. Answers computed before
//! the bump are not used again; answers computed after it read the maps as the
//! call left them.
use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData};
use vip_common::{flow_cache_slots_for, FlowCacheCtl};

pub(super) struct Ctl(pub(super) Array<MapData, FlowCacheCtl>);

impl Ctl {
    fn get(&self) -> Result<FlowCacheCtl> {
        self.0.get(&0, 0).context("reading lb4_flow_cache_ctl")
    }

    fn set(&mut self, ctl: FlowCacheCtl) -> Result<()> {
        self.0.set(0, ctl, 0).context("writing lb4_flow_cache_ctl")
    }

    /// Invalidates every cached answer on every CPU.
    pub(super) fn bump(&mut self) -> Result<()> {
        let c = self.get()?;
        self.set(FlowCacheCtl { epoch: c.epoch.wrapping_add(1), ..c })
    }

    /// Sizes the cache for this machine's CPUs (see [`flow_cache_slots_for`]).
    pub(super) fn configure(&mut self) -> Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)? as u32;
        let mask = flow_cache_slots_for(cpus) - 1;
        let c = self.get()?;
        if c.slot_mask != mask {
            self.set(FlowCacheCtl { epoch: c.epoch.wrapping_add(1), slot_mask: mask, _pad: 0 })?;
        }
        Ok(())
    }

    pub(super) fn epoch(&self) -> Result<u64> {
        Ok(self.get()?.epoch)
    }
}
