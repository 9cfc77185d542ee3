//! CLOCK_MONOTONIC in nanoseconds: the clock held-VIP deadlines are given in (the
//! data path compares them with `bpf_ktime_get_coarse_ns`), also used for the
//! agent's own turn stamps.

/// CLOCK_MONOTONIC now, in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
