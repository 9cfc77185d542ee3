//! Services and their rings: the batch that programs them (`apply`), the flows a
//! batch leaves pinned to lost backends (`sweep`), and what is programmed.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap as StdHashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use aya::maps::IterableMap as _;
use vip_common::*;

use super::{batch, filter_bits, ignore_missing, reset_counter, Dataplane, DataplaneError, Programmed};
use crate::{
    maglev::{self, Member},
    model::{Protocol, ServiceAddr},
};

/// A backend node as the data path needs it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BackendSpec {
    /// Stable identity (node name): the Maglev permutation is derived from it.
    pub name: String,
    pub addr: IpAddr,
    pub mac: [u8; 6],
    pub weight: u32,
    /// This node itself: matching packets are passed to the local stack.
    pub local: bool,
}

/// Service-ports grouped by equal spec, each group to get one ring. Maglev builds
/// are the CPU cost of a batch: services with equal specs (thousands, under one
/// node set) build one. Specs shared by reference (the planner shares them) are
/// grouped by address first, so a large spec is hashed once, not once per port.
pub fn group_by_spec<'a>(set: impl Iterator<Item = (ServiceAddr, &'a ServiceSpec)>) -> Vec<(&'a ServiceSpec, Vec<ServiceAddr>)> {
    let mut by_ref: StdHashMap<*const ServiceSpec, (&ServiceSpec, Vec<ServiceAddr>)> = StdHashMap::new();
    for (addr, spec) in set {
        by_ref.entry(spec as *const ServiceSpec).or_insert_with(|| (spec, Vec::new())).1.push(addr);
    }
    let mut by_spec: StdHashMap<&ServiceSpec, Vec<ServiceAddr>> = StdHashMap::new();
    for (spec, addrs) in by_ref.into_values() {
        by_spec.entry(spec).or_default().extend(addrs);
    }
    // Each group's ports in order, as the batch gave them (which port is told
    // about the slots written, the order ids are taken in).
    let mut groups: Vec<(&ServiceSpec, Vec<ServiceAddr>)> = by_spec.into_iter().collect();
    for (_, addrs) in &mut groups {
        addrs.sort();
    }
    groups
}

impl ServiceSpec {
    /// The Maglev ring this spec builds, with its backends in slot-index order
    /// (sorted by name, as `maglev::build` sorts its members); `None` without
    /// backends. The CPU cost of programming a service (the scale bench times it).
    pub fn ring(&self, seed: u64) -> Result<Option<(Vec<&BackendSpec>, maglev::Ring)>, DataplaneError> {
        maglev::check_table_size(self.table_size)?;
        if self.backends.is_empty() {
            return Ok(None);
        }
        let mut specs: Vec<&BackendSpec> = self.backends.iter().collect();
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        let members: Vec<Member> = specs.iter().map(|b| Member { id: b.name.clone(), weight: b.weight.max(1) }).collect();
        let absent: Vec<Member> = self.absent.iter().map(|n| Member { id: n.clone(), weight: 1 }).collect();
        Ok(Some((specs, maglev::build_without(&members, &absent, self.table_size, seed)?)))
    }
}

/// What `lb4_backends` records of a node's address (four bytes, for the backend's
/// identity across restarts and for people): an IPv4 address itself; for an IPv6
/// one a hash of it in 0.0.0.0/8, which no IPv4 node has, so that a dual-stack
/// cluster's keys do not meet. Two IPv6 nodes may share a key: their backends are
/// told apart by their MACs as well ([`Dataplane::backend_id`]).
pub fn backend_key(addr: IpAddr) -> Ipv4Addr {
    use std::hash::Hasher as _;
    match addr {
        IpAddr::V4(v) => v,
        IpAddr::V6(v) => {
            let mut h = siphasher::sip::SipHasher13::new();
            h.write(&v.octets());
            Ipv4Addr::from(h.finish() as u32 & 0x00ff_ffff)
        }
    }
}

/// The service-port of an `lb4_services` key (None: a protocol we never write).
pub(super) fn service_addr(k: &Lb4ServiceKey) -> Option<ServiceAddr> {
    Some(ServiceAddr { vip: Ipv4Addr::from(k.vip).into(), port: u16::from_be_bytes(k.port), protocol: Protocol::from_number(k.proto)? })
}

/// The service-port of an `lb6_services` key.
pub(super) fn service_addr6(k: &Lb6ServiceKey) -> Option<ServiceAddr> {
    Some(ServiceAddr { vip: Ipv6Addr::from(k.vip).into(), port: u16::from_be_bytes(k.port), protocol: Protocol::from_number(k.proto)? })
}

/// What a service should be: its backends and ring size.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceSpec {
    pub backends: Vec<BackendSpec>,
    pub table_size: u32,
    /// Candidate backends that are out now (dead, unhealthy, MAC unknown): the
    /// ring keeps every other slot where it would be with them
    /// ([`maglev::build_without`]), so their leaving moves only their slots.
    pub absent: Vec<String>,
    /// Backends out of the ring (they are in `absent` too) whose established
    /// flows keep going to them: their health check failed while their node
    /// still runs, so new flows avoid them but connections they serve live on.
    /// A backend that leaves this list without coming back to the ring has its
    /// flows evicted then.
    pub draining: Vec<BackendSpec>,
}

/// What one `set_service` call wrote.
#[derive(Clone, Debug, Default)]
pub struct RingUpdate {
    pub slots_written: usize,
    pub table_size: u32,
    pub elapsed: Duration,
}

/// The outcome of [`Dataplane::apply`]: each service either programmed or not,
/// on its own (a service that does not fit never stops the others).
#[derive(Debug, Default)]
pub struct Applied {
    /// Services now pointing at their new ring, with the slots written for them
    /// (0 when they joined a ring another service already had).
    pub written: BTreeMap<ServiceAddr, usize>,
    pub removed: Vec<ServiceAddr>,
    /// Services left as they were (or absent), with why.
    pub failed: BTreeMap<ServiceAddr, DataplaneError>,
    /// Time spent writing rings, services and backends.
    pub write_time: Duration,
    /// The flows to evict next ([`Dataplane::sweep`]).
    pub sweep: Sweep,
}

/// Flows a batch left pinned where they should no longer go.
#[derive(Debug, Default)]
pub struct Sweep {
    /// Services that lost backends → the backends they kept.
    lost: StdHashMap<ServiceAddr, BTreeSet<u32>>,
    /// Backends no service has any more.
    gone: BTreeSet<u32>,
}

impl Sweep {
    pub fn is_empty(&self) -> bool {
        self.lost.is_empty() && self.gone.is_empty()
    }
}

/// How full the data path's tables are.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub services: usize,
    pub services_max: u32,
    pub rings: usize,
    pub ring_slots: u64,
    pub ring_capacity: u32,
    pub backends: usize,
    pub backends_max: u32,
}

impl Dataplane {
    /// Services as (address, entry, ring) for inspection, from the mirrors.
    pub fn services(&self) -> Result<Vec<(ServiceAddr, LbService, Vec<u32>)>> {
        Ok(self
            .programmed
            .iter()
            .map(|(a, p)| {
                let ring = self.rings.get(p.ring).map(|r| r.slots.clone()).unwrap_or_default();
                (*a, LbService { id: p.id, ring_offset: p.ring, ring_size: ring.len() as u32, _pad: 0 }, ring)
            })
            .collect())
    }

    /// The services programmed now.
    pub fn service_addrs(&self) -> BTreeSet<ServiceAddr> {
        self.programmed.keys().copied().collect()
    }

    /// Backends in use (slots of `lb4_backends` with `BACKEND_PRESENT`), by id.
    pub fn backends(&self) -> Result<BTreeMap<u32, LbBackend>> {
        Ok(self.backend_slots.clone())
    }

    /// How full the tables are.
    pub fn usage(&self) -> Usage {
        Usage {
            services: self.programmed.len(),
            services_max: MAX_SERVICES,
            rings: self.rings.len(),
            ring_slots: self.rings.used_slots(),
            ring_capacity: self.rings.capacity(),
            backends: self.backend_slots.len(),
            backends_max: MAX_BACKENDS,
        }
    }

    /// Sets the backends of one service (see [`Self::apply`]); its error if it failed.
    pub fn set_service(&mut self, addr: ServiceAddr, backends: &[BackendSpec], table_size: u32, seed: u64) -> Result<RingUpdate> {
        let start = Instant::now();
        let spec = ServiceSpec { backends: backends.to_vec(), table_size, ..Default::default() };
        let mut a = self.apply(&BTreeMap::from([(addr, &spec)]), &[], seed)?;
        if let Some(e) = a.failed.remove(&addr) {
            bail!("{e}");
        }
        self.sweep(&a.sweep)?;
        let slots_written = a.written.get(&addr).copied().unwrap_or(0);
        Ok(RingUpdate { slots_written, table_size, elapsed: start.elapsed() })
    }

    /// Removes a service, its ring when no other service shares it, and any
    /// backend only it used (with their flows).
    pub fn remove_service(&mut self, addr: ServiceAddr) -> Result<()> {
        let a = self.apply(&BTreeMap::new(), &[addr], 0)?;
        self.sweep(&a.sweep).map(|_| ())
    }

    /// Programs a batch of changes: `set` services get the rings their specs
    /// build, `remove` ones go; the flows to evict are returned, for
    /// [`Self::sweep`]. Each service succeeds or fails on its own (a full
    /// ring map or service table is reported in [`Applied::failed`] and leaves that
    /// service as it was); an `Err` is a map operation the kernel refused.
    ///
    /// Order, so that packets never see a half-written ring: backend entries
    /// first; a ring shared with services that do not move is never written (a
    /// new region is filled, then services are pointed at it); a ring whose every
    /// user moves to the same new content is rewritten in place, changed slots
    /// only (Maglev keeps those few), each slot pointing at a written backend.
    /// Then service entries, fragment aliases, freed rings and backends, and one
    /// flow-cache epoch bump.
    pub fn apply(&mut self, set: &BTreeMap<ServiceAddr, &ServiceSpec>, remove: &[ServiceAddr], seed: u64) -> Result<Applied> {
        let start = Instant::now();
        let mut out = Applied::default();
        // The new services' addresses pass the data path's filter before they exist.
        self.sync_vip_filter(set.keys().map(|a| a.vip))?;
        // New content → the services that want it.
        let mut groups: BTreeMap<Vec<u32>, Vec<ServiceAddr>> = BTreeMap::new();
        let by_spec = group_by_spec(set.iter().map(|(a, s)| (*a, *s)));
        // The backends each service drains (their slots written, as the ring's).
        let mut draining: StdHashMap<ServiceAddr, BTreeSet<u32>> = StdHashMap::new();
        for (spec, addrs) in by_spec {
            let ring = self.ring_for(spec, seed).and_then(|slots| {
                let ids = spec.draining.iter().map(|b| self.backend_id(b)).collect::<Result<BTreeSet<u32>, _>>()?;
                Ok((slots, ids))
            });
            match ring {
                Ok((slots, ids)) => {
                    for a in &addrs {
                        draining.insert(*a, ids.clone());
                    }
                    groups.entry(slots).or_default().extend(addrs)
                }
                Err(e) => {
                    for addr in addrs {
                        out.failed.insert(addr, e.clone());
                    }
                }
            }
        }
        // Backends each changed service keeps (for the sweep), and whether it lost some.
        let mut lost: StdHashMap<ServiceAddr, BTreeSet<u32>> = StdHashMap::new();
        let mut touched: BTreeSet<ServiceAddr> = BTreeSet::new();
        for (slots, users) in groups {
            let (offset, written, was) = match self.place_ring(&slots, &users) {
                Ok(t) => t,
                Err(e) => {
                    for a in users {
                        out.failed.insert(a, e.clone());
                    }
                    continue;
                }
            };
            let members: BTreeSet<u32> = self.rings.get(offset).map(|r| r.members.clone()).unwrap_or_default();
            let mut first = true;
            for addr in users {
                let cur = self.programmed.get(&addr).copied();
                let before = match cur {
                    Some(p) if p.ring == offset => was.clone(), // rewritten in place (or unchanged)
                    Some(p) => self.rings.get(p.ring).map(|r| r.members.clone()),
                    None => None,
                };
                // Flows may stay on the ring's members and on the backends drained.
                let drained = draining.remove(&addr).unwrap_or_default();
                let kept: BTreeSet<u32> = members.union(&drained).copied().collect();
                let was_drained = if drained.is_empty() { self.draining.remove(&addr) } else { self.draining.insert(addr, drained) };
                let before = before.map(|b| b.union(&was_drained.unwrap_or_default()).copied().collect::<BTreeSet<u32>>());
                if before.is_some_and(|b| !b.is_subset(&kept)) {
                    lost.insert(addr, kept);
                }
                if cur.is_some_and(|p| p.ring == offset) {
                    if written > 0 && first {
                        out.written.insert(addr, written);
                        first = false;
                    }
                    continue;
                }
                let id = match cur {
                    Some(p) => p.id,
                    None => match self.free_service_id() {
                        Some(id) => id,
                        None => {
                            out.failed.insert(addr, DataplaneError::ServiceIdsExhausted(MAX_SERVICES));
                            continue;
                        }
                    },
                };
                let entry = LbService { id, ring_offset: offset, ring_size: slots.len() as u32, _pad: 0 };
                if let Err((map, e)) = self.write_service(&addr, entry) {
                    out.failed.insert(addr, DataplaneError::kernel(map, e));
                    continue;
                }
                self.ids.insert(id);
                self.rings.add_user(offset, addr);
                if let Some(p) = cur {
                    self.rings.drop_user(p.ring, addr);
                }
                self.programmed.insert(addr, Programmed { id, ring: offset });
                out.written.insert(addr, if first { written } else { 0 });
                touched.insert(addr);
                first = false;
            }
            // A new region nobody took (every user failed) goes back.
            self.rings.free_if_unused(offset);
        }
        for &addr in remove {
            self.draining.remove(&addr);
            let Some(p) = self.programmed.remove(&addr) else { continue };
            self.remove_service_entry(&addr)?;
            self.rings.drop_user(p.ring, addr);
            self.ids.remove(&p.id);
            reset_counter(&mut self.service_stats, p.id)?;
            touched.insert(addr);
            out.removed.push(addr);
        }
        let aliases: BTreeSet<(IpAddr, Protocol)> = touched.iter().map(|a| (a.vip, a.protocol)).collect();
        for (vip, protocol) in aliases {
            self.update_fragment_alias(vip, protocol)?;
        }
        self.sync_vip_filter(std::iter::empty())?;
        let gone = self.collect_backends()?;
        self.sync_nodes()?;
        self.epoch.bump()?;
        out.write_time = start.elapsed();
        out.sweep = Sweep { lost, gone };
        Ok(out)
    }

    /// Writes `lb4_vip_filter` when it differs from the bits of the programmed
    /// services' addresses and of `extra` (one write of the whole bitmap: each word
    /// a reader sees is the old or the new one, and a sync only sets or only
    /// clears the bits that change).
    pub(super) fn sync_vip_filter(&mut self, extra: impl Iterator<Item = IpAddr>) -> Result<()> {
        let want = filter_bits(self.programmed.keys().map(|a| a.vip).chain(extra));
        if want != self.vip_filter_words {
            self.vip_filter.set(0, want, 0).context("writing lb4_vip_filter")?;
            self.vip_filter_words = want;
        }
        Ok(())
    }

    /// Evicts the flows a batch left pinned to a backend their service lost (or
    /// that no service has any more), in one pass over the flow table: they
    /// re-hash on their next packet. Separate from [`Self::apply`] so that callers
    /// can tell "rings written" from "flows swept". Flows carry their service's
    /// id; a VIP's fragments (port 0) carry the id of the service its fragment
    /// entry names, so they follow that service's kept set.
    pub fn sweep(&mut self, sweep: &Sweep) -> Result<usize> {
        if sweep.is_empty() {
            return Ok(0);
        }
        let Sweep { lost, gone } = sweep;
        let by_id: StdHashMap<u32, &BTreeSet<u32>> = lost.iter().filter_map(|(a, kept)| Some((self.programmed.get(a)?.id, kept))).collect();
        self.evict_flows(|service, backend| gone.contains(&backend) || by_id.get(&service).is_some_and(|kept| !kept.contains(&backend)))
    }

    /// The ring `spec` builds, as backend ids per slot (writing backend entries).
    fn ring_for(&mut self, spec: &ServiceSpec, seed: u64) -> Result<Vec<u32>, DataplaneError> {
        let Some((specs, built)) = spec.ring(seed)? else {
            return Ok(vec![NO_BACKEND; spec.table_size as usize]);
        };
        let mut ids = Vec::with_capacity(specs.len());
        for b in specs {
            ids.push(self.backend_id(b)?);
        }
        Ok(built.slots.iter().map(|&i| ids[i as usize]).collect())
    }

    /// Where `slots` goes for `users`: (offset, slots written, the members the
    /// ring had when it was rewritten in place). An equal ring is shared; a ring
    /// all of whose users move here is rewritten in place; else a new region is
    /// filled.
    fn place_ring(&mut self, slots: &[u32], users: &[ServiceAddr]) -> Result<(u32, usize, Option<BTreeSet<u32>>), DataplaneError> {
        if let Some(off) = self.rings.find(slots) {
            let members = self.rings.get(off).map(|r| r.members.clone());
            return Ok((off, 0, members));
        }
        let moving: BTreeSet<&ServiceAddr> = users.iter().collect();
        let in_place = users
            .iter()
            .filter_map(|a| self.programmed.get(a))
            .map(|p| p.ring)
            .find(|&off| self.rings.get(off).is_some_and(|r| r.slots.len() == slots.len() && r.users.iter().all(|u| moving.contains(u))));
        if let Some(off) = in_place {
            let old = self.rings.get(off).expect("found");
            let members = old.members.clone();
            let changes: Vec<(u32, u32)> = maglev::changed_slots(&old.slots, slots).into_iter().map(|(i, b)| (off + i, b)).collect();
            batch::update(self.ring.map(), &changes).map_err(|e| DataplaneError::kernel("lb4_ring", e))?;
            self.rings.recontent(off, slots.to_vec());
            return Ok((off, changes.len(), Some(members)));
        }
        let off = self.rings.alloc(slots.len() as u32)?;
        let entries: Vec<(u32, u32)> = slots.iter().enumerate().map(|(i, &b)| (off + i as u32, b)).collect();
        if let Err(e) = batch::update(self.ring.map(), &entries) {
            self.rings.unalloc(off);
            return Err(DataplaneError::kernel("lb4_ring", e));
        }
        self.rings.insert(off, slots.to_vec(), false)?;
        Ok((off, slots.len(), None))
    }

    /// Backend id for `spec`, re-using the id of a backend with the same address
    /// (for an IPv6 node: the same [`backend_key`] and MAC), else the lowest free
    /// slot of `lb4_backends`.
    pub(super) fn backend_id(&mut self, spec: &BackendSpec) -> Result<u32, DataplaneError> {
        let flags = BACKEND_PRESENT | if spec.local { BACKEND_LOCAL } else { 0 };
        let want = LbBackend { mac: spec.mac, _pad: [0; 2], addr: backend_key(spec.addr).octets(), flags };
        let existing = &self.backend_slots;
        let id = match existing.iter().find(|(_, b)| b.addr == want.addr && (spec.addr.is_ipv4() || b.mac == want.mac)) {
            Some((&id, _)) => id,
            None => (0..MAX_BACKENDS).find(|id| !existing.contains_key(id)).ok_or(DataplaneError::BackendIdsExhausted(MAX_BACKENDS))?,
        };
        if existing.get(&id) != Some(&want) {
            self.backends.set(id, want, 0).map_err(|e| DataplaneError::kernel("lb4_backends", e))?;
            self.backend_slots.insert(id, want);
        }
        Ok(id)
    }

    fn free_service_id(&self) -> Option<u32> {
        (0..MAX_SERVICES).find(|i| !self.ids.contains(i))
    }

    /// Points (vip, port 0, proto), the entry fragments use, at the service with the
    /// lowest port of that VIP and protocol (or removes it when there is none).
    fn update_fragment_alias(&mut self, vip: IpAddr, protocol: Protocol) -> Result<()> {
        let alias = ServiceAddr { vip, port: 0, protocol };
        let first = self.fragment_target(vip, protocol);
        match first {
            Some(p) => {
                let size = self.rings.get(p.ring).map_or(0, |r| r.size());
                self.write_service(&alias, LbService { id: p.id, ring_offset: p.ring, ring_size: size, _pad: 0 }).map_err(|(_, e)| e)?;
            }
            None => self.remove_service_entry(&alias)?,
        }
        Ok(())
    }

    /// The service whose ring `vip`'s fragments of `protocol` use: its lowest port.
    pub(super) fn fragment_target(&self, vip: IpAddr, protocol: Protocol) -> Option<Programmed> {
        let alias = ServiceAddr { vip, port: 0, protocol };
        self.programmed
            .range(alias..=ServiceAddr { vip, port: u16::MAX, protocol: Protocol::Udp })
            .find(|(a, _)| a.protocol == protocol && a.port != 0)
            .map(|(_, p)| *p)
    }

    /// Writes a service's entry to its family's map (the map's name with the error).
    fn write_service(&mut self, a: &ServiceAddr, entry: LbService) -> Result<(), (&'static str, aya::maps::MapError)> {
        let (port, proto) = (a.port.to_be_bytes(), a.protocol.number());
        match a.vip {
            IpAddr::V4(v) => self.services.insert(Lb4ServiceKey { vip: v.octets(), port, proto, _pad: 0 }, entry, 0).map_err(|e| ("lb4_services", e)),
            IpAddr::V6(v) => self.services6.insert(Lb6ServiceKey { vip: v.octets(), port, proto, _pad: 0 }, entry, 0).map_err(|e| ("lb6_services", e)),
        }
    }

    /// Removes a service's entry, if any, from its family's map.
    fn remove_service_entry(&mut self, a: &ServiceAddr) -> Result<()> {
        let (port, proto) = (a.port.to_be_bytes(), a.protocol.number());
        ignore_missing(match a.vip {
            IpAddr::V4(v) => self.services.remove(&Lb4ServiceKey { vip: v.octets(), port, proto, _pad: 0 }),
            IpAddr::V6(v) => self.services6.remove(&Lb6ServiceKey { vip: v.octets(), port, proto, _pad: 0 }),
        })
    }

    /// Writes `lb_nodes` to hold the MACs of the backends in use (other nodes',
    /// which a stale holder never forwards frames from again): new ones first.
    pub(super) fn sync_nodes(&mut self) -> Result<()> {
        let want: BTreeSet<u64> =
            self.backend_slots.values().filter(|b| b.flags & BACKEND_LOCAL == 0 && b.mac != [0; 6]).map(|b| node_mac_key(b.mac)).collect();
        for k in want.difference(&self.node_keys) {
            self.nodes.insert(k, 1, 0).context("writing lb_nodes")?;
        }
        for k in self.node_keys.difference(&want) {
            ignore_missing(self.nodes.remove(k)).context("removing from lb_nodes")?;
        }
        self.node_keys = want;
        Ok(())
    }

    /// Deletes backends no ring references and no service drains, and returns their ids; the caller
    /// evicts their flows (in the same pass as any other eviction it needs).
    fn collect_backends(&mut self) -> Result<BTreeSet<u32>> {
        let mut used = self.rings.used_backends();
        used.extend(self.draining.values().flatten());
        let gone: BTreeSet<u32> = self.backend_slots.keys().copied().filter(|id| !used.contains(id)).collect();
        for id in &gone {
            // A zeroed slot (no BACKEND_PRESENT) is no backend: flows to it re-hash.
            self.backends.set(*id, LbBackend::default(), 0)?;
            self.backend_slots.remove(id);
            reset_counter(&mut self.backend_stats, *id)?;
        }
        Ok(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// IPv4 addresses as they are; IPv6 ones hashed into 0.0.0.0/8, the same on
    /// every run and agent version (ids are recovered from pinned maps by them).
    #[test]
    fn backend_keys() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(backend_key(ip("198.18.0.11")), Ipv4Addr::new(198, 18, 0, 11));
        let (a, b) = (backend_key(ip("2001:2::11")), backend_key(ip("2001:2::12")));
        assert!(a.octets()[0] == 0 && b.octets()[0] == 0 && a != b, "{a} {b}");
        assert_eq!(a, backend_key(ip("2001:2:0:0::11")));
        assert_eq!(a, Ipv4Addr::from(0x00dd_e328), "stable: {:#010x}", u32::from(a));
    }

    /// Equal specs form one group whether they share an allocation or not.
    #[test]
    fn ports_are_grouped_by_equal_spec() {
        let b = |name: &str| BackendSpec { name: name.into(), addr: "198.18.0.1".parse().unwrap(), mac: [2, 0, 0, 0, 0, 1], weight: 1, local: false };
        let spec = |names: &[&str]| ServiceSpec { backends: names.iter().map(|n| b(n)).collect(), table_size: 251, ..Default::default() };
        let (shared, copy, other) = (spec(&["a", "b"]), spec(&["a", "b"]), spec(&["a"]));
        let port = |p: u16| ServiceAddr { vip: "198.18.1.1".parse().unwrap(), port: p, protocol: crate::model::Protocol::Tcp };
        let mut groups = group_by_spec([(port(1), &shared), (port(2), &shared), (port(3), &copy), (port(4), &other)].into_iter());
        groups.sort_by_key(|g| g.1[0].port);
        let got: Vec<(usize, Vec<u16>)> = groups.iter().map(|(s, a)| (s.backends.len(), a.iter().map(|a| a.port).collect())).collect();
        assert_eq!(got, [(2, vec![1, 2, 3]), (1, vec![4])]);
    }
}
