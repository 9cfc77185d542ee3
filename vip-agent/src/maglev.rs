//! Maglev consistent hashing (Eisenbud et al., NSDI 2016, section 3.4).
//!
//! Every node builds the same ring from the same backend set: backends are sorted
//! by their stable identity before the build and each backend's permutation comes
//! from two seeded hashes of that identity, so neither input order nor the node
//! that computes it changes the result. That is what lets a VIP move to another
//! node without moving its flows.
use std::hash::Hasher;

use siphasher::sip::SipHasher13;

/// Default ring size: a prime, about 100 slots per backend for up to 160 backends.
pub const DEFAULT_TABLE_SIZE: u32 = 16381;
pub const MIN_TABLE_SIZE: u32 = 251;
pub const MAX_TABLE_SIZE: u32 = 131071;

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum MaglevError {
    #[error("table size {0} is not a prime between {MIN_TABLE_SIZE} and {MAX_TABLE_SIZE}")]
    BadTableSize(u32),
    #[error("backend {0:?} has weight 0; leave it out instead")]
    ZeroWeight(String),
    #[error("backend {0:?} is listed twice")]
    Duplicate(String),
}

/// Checks that `m` is an accepted Maglev table size.
pub fn check_table_size(m: u32) -> Result<(), MaglevError> {
    if (MIN_TABLE_SIZE..=MAX_TABLE_SIZE).contains(&m) && is_prime(m) {
        Ok(())
    } else {
        Err(MaglevError::BadTableSize(m))
    }
}

fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// One backend as Maglev sees it: a stable identity (the node name) and a weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    pub weight: u32,
}

impl Member {
    pub fn new(id: impl Into<String>) -> Self {
        Self { id: id.into(), weight: 1 }
    }
}

/// A built ring: `slots[i]` is an index into `members` (sorted by identity).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ring {
    pub members: Vec<Member>,
    pub slots: Vec<u32>,
}

impl Ring {
    /// The identity of the member in slot `i`.
    pub fn member_at(&self, i: usize) -> &str {
        &self.members[self.slots[i] as usize].id
    }

    /// Slots owned by each member, in `members` order.
    pub fn shares(&self) -> Vec<u32> {
        let mut counts = vec![0u32; self.members.len()];
        for &s in &self.slots {
            counts[s as usize] += 1;
        }
        counts
    }
}

fn hash(seed: u64, salt: u64, id: &str) -> u64 {
    let mut h = SipHasher13::new_with_keys(seed, salt);
    h.write(id.as_bytes());
    h.finish()
}

/// Builds the Maglev ring of size `m` for `members` (any order). An empty member
/// list gives an empty ring. Weights are honoured by giving a member `weight`
/// turns per round of the population loop.
pub fn build(members: &[Member], m: u32, seed: u64) -> Result<Ring, MaglevError> {
    check_table_size(m)?;
    let mut members = members.to_vec();
    members.sort_by(|a, b| a.id.cmp(&b.id));
    for w in members.windows(2) {
        if w[0].id == w[1].id {
            return Err(MaglevError::Duplicate(w[0].id.clone()));
        }
    }
    if let Some(z) = members.iter().find(|b| b.weight == 0) {
        return Err(MaglevError::ZeroWeight(z.id.clone()));
    }
    if members.is_empty() {
        return Ok(Ring { members, slots: Vec::new() });
    }
    // u32 arithmetic throughout: M < 2^17, so position + skip never overflows.
    let m64 = u64::from(m);
    // Per member: next position of its permutation and its skip.
    let mut pos: Vec<u32> = Vec::with_capacity(members.len());
    let mut skip: Vec<u32> = Vec::with_capacity(members.len());
    for b in &members {
        pos.push((hash(seed, 0x6f66_6673_6574, &b.id) % m64) as u32);
        skip.push((hash(seed, 0x736b_6970, &b.id) % (m64 - 1) + 1) as u32);
    }
    const EMPTY: u32 = u32::MAX;
    let mut slots = vec![EMPTY; m as usize];
    let mut filled = 0u32;
    'fill: loop {
        for (i, b) in members.iter().enumerate() {
            let step = skip[i];
            let mut c = pos[i];
            for _ in 0..b.weight {
                // Walk this member's permutation to its next free slot.
                while slots[c as usize] != EMPTY {
                    c += step;
                    if c >= m {
                        c -= m;
                    }
                }
                slots[c as usize] = i as u32;
                filled += 1;
                if filled == m {
                    break 'fill;
                }
            }
            pos[i] = c;
        }
    }
    Ok(Ring { members, slots })
}

/// The ring of `members` for a service whose other candidates, `absent` (dead or
/// unhealthy nodes), are out: every slot keeps the member the ring of all
/// candidates gives it, and only the absent members' slots go where the ring of
/// `members` alone puts them. So a member that leaves moves only its own slots (a
/// flow on a survivor keeps its backend even where no flow table remembers it,
/// e.g. on a new VIP owner), and it gets them back when it returns; every node
/// computes the same ring from the same two lists.
pub fn build_without(members: &[Member], absent: &[Member], m: u32, seed: u64) -> Result<Ring, MaglevError> {
    let live = build(members, m, seed)?;
    if absent.is_empty() || live.members.is_empty() {
        return Ok(live);
    }
    let all: Vec<Member> = members.iter().chain(absent).cloned().collect();
    let full = build(&all, m, seed)?;
    let index: std::collections::HashMap<&str, u32> = live.members.iter().enumerate().map(|(i, b)| (b.id.as_str(), i as u32)).collect();
    let slots = full.slots.iter().zip(&live.slots).map(|(&f, &l)| index.get(full.members[f as usize].id.as_str()).copied().unwrap_or(l)).collect();
    Ok(Ring { members: live.members, slots })
}

/// Slots whose value differs between two rings of equal size, with the new value.
/// A ring of different size (or an empty one) differs everywhere.
pub fn changed_slots(old: &[u32], new: &[u32]) -> Vec<(u32, u32)> {
    if old.len() != new.len() {
        return new.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
    }
    old.iter().zip(new).enumerate().filter(|(_, (a, b))| a != b).map(|(i, (_, &b))| (i as u32, b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members(n: usize) -> Vec<Member> {
        (0..n).map(|i| Member::new(format!("node-{i:04}"))).collect()
    }

    /// A member leaving moves only its own slots; back, the ring is whole again.
    #[test]
    fn build_without_moves_only_the_absent_members_slots() {
        let all = members(5);
        let full = build(&all, 16381, 7).unwrap();
        for gone in 0..5 {
            let live: Vec<Member> = all.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, b)| b.clone()).collect();
            let kept = build_without(&live, &all[gone..=gone], 16381, 7).unwrap();
            let id = |r: &Ring, i: usize| r.member_at(i).to_owned();
            let mut moved_to = std::collections::BTreeMap::<String, usize>::new();
            for i in 0..16381 {
                if id(&full, i) == all[gone].id {
                    *moved_to.entry(id(&kept, i)).or_default() += 1;
                } else {
                    assert_eq!(id(&full, i), id(&kept, i), "slot {i} of a survivor moved when {} left", all[gone].id);
                }
            }
            // Its slots are spread over the survivors, none of them gets them all.
            assert_eq!(moved_to.len(), 4, "{moved_to:?}");
            assert!(!moved_to.contains_key(&all[gone].id));
            // Plain Maglev without the member moves some survivors' slots too.
            let plain = build(&live, 16381, 7).unwrap();
            assert!((0..16381).any(|i| id(&full, i) != all[gone].id && id(&full, i) != id(&plain, i)));
        }
        assert_eq!(build_without(&all, &[], 16381, 7).unwrap().slots, full.slots);
    }

    #[test]
    fn table_sizes() {
        assert!(check_table_size(251).is_ok());
        assert!(check_table_size(16381).is_ok());
        assert!(check_table_size(131071).is_ok());
        assert_eq!(check_table_size(250), Err(MaglevError::BadTableSize(250)));
        assert_eq!(check_table_size(16383), Err(MaglevError::BadTableSize(16383)));
        assert_eq!(check_table_size(241), Err(MaglevError::BadTableSize(241)));
        assert_eq!(check_table_size(131101), Err(MaglevError::BadTableSize(131101)));
        assert!(build(&members(3), 1000, 0).is_err());
    }

    #[test]
    fn same_ring_in_any_order() {
        let a = members(10);
        let mut b = a.clone();
        b.reverse();
        b.swap(2, 7);
        assert_eq!(build(&a, 16381, 7).unwrap(), build(&b, 16381, 7).unwrap());
        assert_ne!(build(&a, 16381, 7).unwrap().slots, build(&a, 16381, 8).unwrap().slots);
    }

    #[test]
    fn balanced_when_m_is_100_n() {
        let r = build(&members(100), 65537, 0).unwrap();
        let s = r.shares();
        let (max, min) = (*s.iter().max().unwrap(), *s.iter().min().unwrap());
        assert!(f64::from(max) / f64::from(min) <= 1.01, "max {max} min {min}");
        assert_eq!(s.iter().sum::<u32>(), 65537);
    }

    #[test]
    fn removing_one_backend_moves_few_slots() {
        let all = members(100);
        let before = build(&all, 65537, 0).unwrap();
        let mut fewer = all.clone();
        fewer.remove(42);
        let after = build(&fewer, 65537, 0).unwrap();
        let moved = (0..65537).filter(|&i| before.member_at(i) != after.member_at(i)).count();
        // The removed member's ~1% must move; Maglev's extra shift stays small.
        let removed = before.shares()[42] as usize;
        assert!(moved >= removed);
        assert!(moved as f64 / 65537.0 <= 0.02, "moved {moved}");
        // And every slot that did not belong to the removed member mostly stays.
        let kept = (0..65537).filter(|&i| before.member_at(i) != "node-0042").filter(|&i| before.member_at(i) == after.member_at(i)).count();
        assert!(kept as f64 / (65537 - removed) as f64 > 0.99);
    }

    #[test]
    fn weights_are_proportional() {
        let mut m = members(3);
        m[0].weight = 2;
        let r = build(&m, 16381, 0).unwrap();
        let s = r.shares();
        let ratio = f64::from(s[0]) / f64::from(s[1]);
        assert!((ratio - 2.0).abs() < 0.05, "shares {s:?}");
    }

    #[test]
    fn rejects_bad_members() {
        let mut m = members(2);
        m[1].id = m[0].id.clone();
        assert!(matches!(build(&m, 251, 0), Err(MaglevError::Duplicate(_))));
        let mut m = members(2);
        m[1].weight = 0;
        assert!(matches!(build(&m, 251, 0), Err(MaglevError::ZeroWeight(_))));
        assert!(build(&[], 251, 0).unwrap().slots.is_empty());
    }

    #[test]
    fn diff_lists_only_changes() {
        assert_eq!(changed_slots(&[1, 2, 3], &[1, 5, 3]), vec![(1, 5)]);
        assert_eq!(changed_slots(&[], &[4, 4]), vec![(0, 4), (1, 4)]);
        assert!(changed_slots(&[1, 2], &[1, 2]).is_empty());
    }

    /// FNV-1a of a ring's slots: one number for a whole table.
    fn digest(r: &Ring) -> u64 {
        r.slots.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &s| (h ^ u64::from(s)).wrapping_mul(0x100_0000_01b3))
    }

    /// The rings every agent builds, held to fixed outputs. Agents of two
    /// releases build rings side by side during an upgrade, and a flow that
    /// moves between them (the VIP moves, a router rehashes) keeps its backend
    /// only if both build the same ring: a change to the permutation, the hash
    /// (SipHash-1-3 of the node name) or the fill order fails this on purpose. It
    /// may change only with a changelog entry saying that established flows move
    /// while versions are mixed.
    #[test]
    fn rings_are_fixed_outputs_of_their_members() {
        let three = members(3);
        let plain = build(&three, 251, 0).unwrap();
        let weighted = build(&[Member { id: "node-a".into(), weight: 3 }, Member::new("node-b")], 257, 0).unwrap();
        let without = build_without(&three[..2], &three[2..], 251, 0).unwrap();
        let seeded = build(&members(10), 16381, 7).unwrap();
        let fixed: [(&Ring, [u32; 16], &[u32], u64); 4] = [
            (&plain, [2, 1, 1, 2, 1, 1, 1, 1, 0, 2, 2, 2, 1, 0, 1, 1], &[84, 84, 83], 0x53a0_9129_529c_8ba5),
            (&weighted, [0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0, 0], &[193, 64], 0x6dbd_4b76_7b66_464f),
            (&without, [1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1], &[123, 128], 0xacb1_c648_5847_e883),
            (&seeded, [8, 7, 3, 0, 3, 3, 3, 9, 7, 0, 8, 6, 0, 5, 4, 9], &[1639, 1638, 1638, 1638, 1638, 1638, 1638, 1638, 1638, 1638], 0x45d7_d29a_b13c_a9fb),
        ];
        for (i, (ring, first, shares, whole)) in fixed.into_iter().enumerate() {
            assert_eq!(ring.slots[..16], first, "ring {i}: its first slots");
            assert_eq!(ring.shares(), shares, "ring {i}: each member's slots");
            assert_eq!(digest(ring), whole, "ring {i}: the whole table");
        }
    }
}
