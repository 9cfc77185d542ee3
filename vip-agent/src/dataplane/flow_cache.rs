//! The data path's per-CPU flow cache (`lb4_flow_cache`) memoises answers for
//! flows pinned in `lb4_flows`; `lb4_epoch` says which answers are current.
//! Every facade call that could make a cached answer wrong bumps the epoch after
//! its last map write: a service or its fragment alias removed or changed, a
//! backend written, zeroed or its id reused, flows evicted, a VIP released or
//! forgotten, an interface's MAC changed. Answers computed before the bump are not
//! used again; answers computed after it read the maps as the call left them.
use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData};

pub(super) struct Epoch(pub(super) Array<MapData, u64>);

impl Epoch {
    /// Invalidates every cached answer on every CPU.
    pub(super) fn bump(&mut self) -> Result<()> {
        let e = self.0.get(&0, 0).context("reading lb4_epoch")?;
        self.0.set(0, e.wrapping_add(1), 0).context("writing lb4_epoch")
    }

    pub(super) fn get(&self) -> Result<u64> {
        Ok(self.0.get(&0, 0)?)
    }
}
