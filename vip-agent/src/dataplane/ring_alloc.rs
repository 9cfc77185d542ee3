//! Regions of `lb4_ring` handed to services' rings (first fit).
use std::collections::BTreeMap;

use super::DataplaneError;

pub struct RingAlloc {
    capacity: u32,
    /// offset → length of each region in use.
    used: BTreeMap<u32, u32>,
}

impl RingAlloc {
    pub fn new(capacity: u32) -> Self {
        Self { capacity, used: BTreeMap::new() }
    }

    /// Marks a region found in the maps as used.
    pub fn reserve(&mut self, offset: u32, len: u32) -> Result<(), DataplaneError> {
        if offset.checked_add(len).is_none_or(|end| end > self.capacity) {
            return Err(DataplaneError::RingOutside { offset, len, capacity: self.capacity });
        }
        self.used.insert(offset, len);
        Ok(())
    }

    pub fn alloc(&mut self, len: u32) -> Result<u32, DataplaneError> {
        let mut start = 0u32;
        for (&off, &l) in &self.used {
            if off - start >= len {
                break;
            }
            start = off + l;
        }
        if self.capacity - start < len {
            return Err(DataplaneError::RingFull { len, capacity: self.capacity });
        }
        self.used.insert(start, len);
        Ok(start)
    }

    pub fn free(&mut self, offset: u32) {
        self.used.remove(&offset);
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_reuses_holes() {
        let mut a = RingAlloc::new(1000);
        assert_eq!(a.alloc(251).unwrap(), 0);
        assert_eq!(a.alloc(251).unwrap(), 251);
        assert_eq!(a.alloc(251).unwrap(), 502);
        assert!(a.alloc(251).is_err());
        a.free(251);
        assert_eq!(a.alloc(200).unwrap(), 251);
        assert!(a.reserve(900, 200).is_err());
    }
}
