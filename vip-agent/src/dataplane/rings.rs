//! The rings in `lb4_ring`, shared: services whose Maglev rings come out equal
//! (same backends, weights, table size and seed, the common case: with
//! `externalTrafficPolicy: Cluster` every Service has every ready node) point
//! at one region. A ring is identified by its content, so the agent never needs
//! the inputs back: a re-opened agent finds the same sharing in the maps.
//!
//! Capacity then grows with the number of *distinct* backend sets, not with the
//! number of services: 5,000 service-ports over one node set take one ring.
use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::{ring_alloc::RingAlloc, DataplaneError, ServiceAddr};

/// One region of `lb4_ring`.
#[derive(Debug)]
pub struct RingRegion {
    /// Backend id of each slot (`NO_BACKEND` for an empty service).
    pub slots: Vec<u32>,
    /// The distinct backend ids in `slots`.
    pub members: BTreeSet<u32>,
    /// Services pointing at it.
    pub users: BTreeSet<ServiceAddr>,
}

impl RingRegion {
    pub fn size(&self) -> u32 {
        self.slots.len() as u32
    }
}

/// The rings in use, by offset and by content.
pub struct Rings {
    alloc: RingAlloc,
    by_offset: BTreeMap<u32, RingRegion>,
    by_content: HashMap<Vec<u32>, u32>,
}

impl Rings {
    pub fn new(capacity: u32) -> Self {
        Self { alloc: RingAlloc::new(capacity), by_offset: BTreeMap::new(), by_content: HashMap::new() }
    }

    pub fn capacity(&self) -> u32 {
        self.alloc.capacity()
    }

    /// Slots in use (the sum of the distinct rings' sizes).
    pub fn used_slots(&self) -> u64 {
        self.by_offset.values().map(|r| r.slots.len() as u64).sum()
    }

    pub fn len(&self) -> usize {
        self.by_offset.len()
    }

    pub fn get(&self, offset: u32) -> Option<&RingRegion> {
        self.by_offset.get(&offset)
    }

    pub fn find(&self, slots: &[u32]) -> Option<u32> {
        self.by_content.get(slots).copied()
    }

    /// Records a ring found in the maps (re-open) or just written.
    pub fn insert(&mut self, offset: u32, slots: Vec<u32>, reserve: bool) -> Result<(), DataplaneError> {
        if reserve {
            self.alloc.reserve(offset, slots.len() as u32)?;
        }
        let members = slots.iter().copied().filter(|&b| b != vip_common::NO_BACKEND).collect();
        self.by_content.insert(slots.clone(), offset);
        self.by_offset.insert(offset, RingRegion { slots, members, users: BTreeSet::new() });
        Ok(())
    }

    /// A free region of `len` slots.
    pub fn alloc(&mut self, len: u32) -> Result<u32, DataplaneError> {
        self.alloc.alloc(len)
    }

    /// Replaces the content of the ring at `offset` (rewritten in place).
    pub fn recontent(&mut self, offset: u32, slots: Vec<u32>) {
        let r = self.by_offset.get_mut(&offset).expect("ring to recontent");
        if self.by_content.get(&r.slots) == Some(&offset) {
            self.by_content.remove(&r.slots);
        }
        r.members = slots.iter().copied().filter(|&b| b != vip_common::NO_BACKEND).collect();
        self.by_content.insert(slots.clone(), offset);
        r.slots = slots;
    }

    pub fn add_user(&mut self, offset: u32, svc: ServiceAddr) {
        if let Some(r) = self.by_offset.get_mut(&offset) {
            r.users.insert(svc);
        }
    }

    /// Removes `svc` from the ring's users; frees the ring when it was the last.
    pub fn drop_user(&mut self, offset: u32, svc: ServiceAddr) {
        let Some(r) = self.by_offset.get_mut(&offset) else { return };
        r.users.remove(&svc);
        self.free_if_unused(offset);
    }

    /// Returns a region that was allocated but never recorded as a ring.
    pub fn unalloc(&mut self, offset: u32) {
        self.alloc.free(offset);
    }

    /// Frees the ring at `offset` when no service uses it.
    pub fn free_if_unused(&mut self, offset: u32) {
        if self.by_offset.get(&offset).is_some_and(|r| r.users.is_empty()) {
            let r = self.by_offset.remove(&offset).expect("present");
            if self.by_content.get(&r.slots) == Some(&offset) {
                self.by_content.remove(&r.slots);
            }
            self.alloc.free(offset);
        }
    }

    /// Backend ids some ring references.
    pub fn used_backends(&self) -> BTreeSet<u32> {
        self.by_offset.values().flat_map(|r| r.members.iter().copied()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(port: u16) -> ServiceAddr {
        ServiceAddr { vip: "198.18.1.1".parse().unwrap(), port, protocol: crate::model::Protocol::Tcp }
    }

    #[test]
    fn shared_by_content_and_freed_with_the_last_user() {
        let mut r = Rings::new(1000);
        let a = vec![1, 2, 1, 2, 1];
        let off = r.alloc(5).unwrap();
        r.insert(off, a.clone(), false).unwrap();
        r.add_user(off, svc(80));
        r.add_user(off, svc(443));
        assert_eq!(r.find(&a), Some(off));
        assert_eq!(r.get(off).unwrap().members, BTreeSet::from([1, 2]));
        r.drop_user(off, svc(80));
        assert_eq!(r.find(&a), Some(off), "one user left");
        r.drop_user(off, svc(443));
        assert_eq!(r.find(&a), None);
        assert_eq!(r.len(), 0);
        assert_eq!(r.alloc(1000).unwrap(), 0, "the region was freed");
    }

    #[test]
    fn recontent_rekeys() {
        let mut r = Rings::new(100);
        r.insert(0, vec![1, 1, 1], true).unwrap();
        r.add_user(0, svc(80));
        r.recontent(0, vec![1, 2, 1]);
        assert_eq!(r.find(&[1, 1, 1]), None);
        assert_eq!(r.find(&[1, 2, 1]), Some(0));
        assert_eq!(r.used_backends(), BTreeSet::from([1, 2]));
    }
}
