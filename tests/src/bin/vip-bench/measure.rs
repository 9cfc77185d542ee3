//! Statistics and /proc readings the sections share.
use std::time::Duration;

use crate::report::{At, Fig};

pub fn median(v: Vec<f64>) -> f64 {
    percentile(&v, 0.5)
}

/// The sample at rank `p` (0 to 1) of `v`, nearest rank.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Median, p95 and max of samples.
pub struct Dist {
    pub median: f64,
    pub p95: f64,
    pub max: f64,
}

impl Dist {
    pub fn of(v: &[f64]) -> Self {
        Self { median: percentile(v, 0.5), p95: percentile(v, 0.95), max: percentile(v, 1.0) }
    }

    /// The three as figures `median`, `p95` and `max` at `at`, shown in `1/scale`
    /// of their unit (1e3: µs shown as ms) with `decimals` decimals.
    pub fn figs(&self, at: &At, scale: f64, decimals: usize) -> [Fig; 3] {
        [("median", self.median), ("p95", self.p95), ("max", self.max)].map(|(k, v)| at.f(k).fig(v, format!("{:.decimals$}", v / scale)))
    }
}

/// The first number after `key` in /proc/PID/FILE (`VmRSS:` in `status`, in kB).
pub fn proc_field(pid: u32, file: &str, key: &str) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
    t.lines().find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

/// Resident memory of `pid` in MiB.
pub fn rss_mib(pid: u32) -> Option<f64> {
    Some(proc_field(pid, "status", "VmRSS:")? as f64 / 1024.0)
}

/// CPU time (user + system) of `pid` in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = t.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}
