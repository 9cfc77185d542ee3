//! The data path's counters, summed over CPUs.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use anyhow::Result;
use aya::maps::{IterableMap as _, MapData, PerCpuArray};
use vip_common::*;

use super::{batch, service_addr, service_addr6, Dataplane, ServiceAddr};

/// Summed counters.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Counters {
    pub reasons: BTreeMap<&'static str, (u64, u64)>,
    pub services: BTreeMap<u32, (u64, u64)>,
    pub backends: BTreeMap<u32, (u64, u64)>,
    /// The service-port of each service id (fragment aliases aside).
    #[serde(skip)]
    pub service_addrs: BTreeMap<u32, ServiceAddr>,
    /// The node address of each backend id ([`super::backend_key`] for IPv6 nodes).
    #[serde(skip)]
    pub backend_addrs: BTreeMap<u32, Ipv4Addr>,
}

impl Dataplane {
    /// Sums the per-CPU counters.
    pub fn counters(&self) -> Result<Counters> {
        let mut c = Counters::default();
        for r in Reason::ALL {
            c.reasons.insert(r.name(), sum(&self.stats, r as u32)?);
        }
        // From the maps, not the mirrors: a handle opened for reading (the metrics
        // endpoint, inspect) sees services another handle programmed since. Two
        // batched reads, then one read per id.
        let mut ids = BTreeSet::new();
        let v4 = batch::lookup_all::<Lb4ServiceKey, LbService>(self.services.map())?.into_iter().map(|(k, s)| (service_addr(&k), s));
        let v6 = batch::lookup_all::<Lb6ServiceKey, LbService>(self.services6.map())?.into_iter().map(|(k, s)| (service_addr6(&k), s));
        for (a, s) in v4.chain(v6) {
            ids.insert(s.id);
            if let Some(a) = a.filter(|a| a.port != 0) {
                c.service_addrs.insert(s.id, a);
            }
        }
        for id in ids {
            c.services.insert(id, sum(&self.service_stats, id)?);
        }
        for (id, b) in batch::lookup_all::<u32, LbBackend>(self.backends.map())? {
            if b.flags & BACKEND_PRESENT != 0 {
                c.backends.insert(id, sum(&self.backend_stats, id)?);
                c.backend_addrs.insert(id, Ipv4Addr::from(b.addr));
            }
        }
        Ok(c)
    }

    /// One reason's counter (packets, bytes) summed over CPUs: cheap enough to poll.
    pub fn reason_count(&self, r: Reason) -> Result<(u64, u64)> {
        sum(&self.stats, r as u32)
    }
}

pub(super) fn sum(map: &PerCpuArray<MapData, Counter>, i: u32) -> Result<(u64, u64)> {
    let v = map.get(&i, 0)?;
    Ok(v.iter().fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes)))
}
