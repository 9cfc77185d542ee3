//! Per-CPU counters: one per reason, per service and per backend.
use aya_ebpf::maps::PerCpuArray;
use vip_common::{Counter, Reason};

use crate::maps::{lb4_backend_stats, lb4_service_stats, lb_stats};

#[inline(always)]
fn bump(map: &PerCpuArray<Counter>, index: u32, bytes: usize) {
    if let Some(c) = map.get_ptr_mut(index) {
        // Per-CPU slot: no other CPU writes it, plain adds are enough.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += bytes as u64;
        }
    }
}

#[inline(always)]
pub fn count_reason(reason: Reason, bytes: usize) {
    bump(&lb_stats, reason as u32, bytes)
}

#[inline(always)]
pub fn count_service(id: u32, bytes: usize) {
    bump(&lb4_service_stats, id, bytes)
}

#[inline(always)]
pub fn count_backend(id: u32, bytes: usize) {
    bump(&lb4_backend_stats, id, bytes)
}
