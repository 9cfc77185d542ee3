//! The data path's per-CPU flow cache (`lb4_flow_cache`) memoises answers for
//! flows pinned in `lb_flows`; the epoch in `lb4_flow_cache_ctl` says which
//! answers are current. Every facade call that could make a cached answer wrong
//! bumps the epoch after its last map write: a service or its fragment alias
//! removed or changed, a backend written, zeroed or its id reused, flows evicted,
//! a VIP released or forgotten, an interface's MAC changed. Answers computed before
//! the bump are not used again; answers computed after it read the maps as the
//! call left them. The data path's per-CPU service caches (`lb4_service_cache`,
//! `lb6_service_cache`, not pinned) keep services by the same epoch, so a service
//! change must bump it too.
//!
//! The ring programmer and the liveness thread both bump it, through handles that
//! share one lock: a bump is a read and a write, and two unserialised bumps could
//! collapse into one.
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, Result};
use aya::maps::{Array, MapData};
use vip_common::{flow_cache_slots_for, FlowCacheCtl};

/// The flow-cache slots this machine uses ([`flow_cache_slots_for`] its possible CPUs).
pub(super) fn slots() -> Result<u32> {
    Ok(flow_cache_slots_for(aya::util::nr_cpus().map_err(|(_, e)| e)? as u32))
}

#[derive(Clone)]
pub(super) struct Ctl(Arc<Mutex<Array<MapData, FlowCacheCtl>>>);

impl Ctl {
    pub(super) fn new(map: Array<MapData, FlowCacheCtl>) -> Self {
        Self(Arc::new(Mutex::new(map)))
    }

    fn update(&self, f: impl FnOnce(FlowCacheCtl) -> Option<FlowCacheCtl>) -> Result<()> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let c = map.get(&0, 0).context("reading lb4_flow_cache_ctl")?;
        if let Some(n) = f(c) {
            map.set(0, n, 0).context("writing lb4_flow_cache_ctl")?;
        }
        Ok(())
    }

    /// Invalidates every cached answer on every CPU.
    pub(super) fn bump(&self) -> Result<()> {
        self.update(|c| Some(FlowCacheCtl { epoch: c.epoch.wrapping_add(1), ..c }))
    }

    /// Sizes the cache for this machine's CPUs (see [`flow_cache_slots_for`]).
    pub(super) fn configure(&self) -> Result<()> {
        let mask = slots()? - 1;
        self.update(|c| (c.slot_mask != mask).then_some(FlowCacheCtl { epoch: c.epoch.wrapping_add(1), slot_mask: mask, _pad: 0 }))
    }

    pub(super) fn epoch(&self) -> Result<u64> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(map.get(&0, 0).context("reading lb4_flow_cache_ctl")?.epoch)
    }
}
