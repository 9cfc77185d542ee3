//! Per-CPU counters: one per reason, per service and per backend (these two
//! bumped with `count_at`).
use aya_ebpf::maps::PerCpuArray;
use vip_common::{Counter, Reason};

use crate::maps::{lb_stats, lookup_at, Scratch};

/// One packet of `bytes` in a per-CPU slot: no other CPU writes it, plain adds
/// are enough.
#[inline(always)]
fn add(c: *mut Counter, bytes: u64) {
    unsafe {
        (*c).packets += 1;
        (*c).bytes += bytes;
    }
}

/// Counts in the slot whose key is at `key`, `*bytes` bytes: both in map values,
/// `*bytes` read after the lookup (no stack store, see maps::LB_KEY0).
#[inline(always)]
pub fn count_at(map: &PerCpuArray<Counter>, key: *const u32, bytes: *const u32) {
    if let Some(c) = lookup_at::<_, Counter>(map, key) {
        add(c, u64::from(unsafe { *bytes }))
    }
}

/// Counts the verdict's reason, by the packet's bytes (`bytes` in the scratch `s`).
#[inline(always)]
pub fn count_verdict(s: *mut Scratch, reason: Reason) {
    unsafe { (*s).key = reason as u32 };
    count_at(&lb_stats, s.cast(), unsafe { &(*s).bytes })
}

/// Counts an event on the way to a verdict (`FlowRehashed`), by `bytes`.
#[inline(always)]
pub fn count_reason(s: *mut Scratch, reason: Reason, bytes: u32) {
    unsafe {
        (*s).key = reason as u32;
        (*s).counted = bytes;
    }
    count_at(&lb_stats, unsafe { &(*s).key }, unsafe { &(*s).counted })
}
