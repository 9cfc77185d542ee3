//! What the program's maps cost in memory, from their definitions, for any CPU
//! count. Since Linux 5.11 a map's memory is charged to the memory cgroup of the
//! process that creates it: the agent pod's on a node's first start (later pods
//! re-use the pinned maps). Per-CPU maps grow with the number of *possible* CPUs,
//! so a limit that fits a small test node can be far too small on a large one.
//!
//! [`charge`] mirrors the kernel's `map_mem_usage` (kernel/bpf/arraymap.c,
//! hashtab.c), which the kernel also reports as `memlock` in a map's fdinfo:
//! [`pinned_maps`] reads both for the maps an agent pinned, so a test checks the
//! formula against the running kernel before extrapolating it.
use std::{collections::BTreeMap, path::Path};

use anyhow::{anyhow, Context as _, Result};

/// `BPF_MAP_TYPE_*` numbers (include/uapi/linux/bpf.h).
const HASH: u32 = 1;
const ARRAY: u32 = 2;
const PERCPU_ARRAY: u32 = 6;
const LRU_HASH: u32 = 9;
const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_F_NO_COMMON_LRU: u32 = 2;
/// `sizeof(struct htab_elem)` on 64-bit kernels: list node, free-list/LRU node, hash.
const HTAB_ELEM: u64 = 48;
/// `sizeof(struct bucket)`: list head and lock.
const BUCKET: u64 = 16;
/// `HASHTAB_MAP_LOCK_COUNT`: per-CPU recursion counters of each hash map.
const LOCK_COUNT: u64 = 8;
/// The fixed `struct bpf_htab` / `struct bpf_array` headers vary with the kernel's
/// configuration; this bounds them (the test checks it against the kernel).
pub const HEADER_SLACK: u64 = 4096;

/// One map's definition as the kernel reports it (fdinfo), and its `memlock`.
#[derive(Clone, Debug)]
pub struct MapDef {
    pub map_type: u32,
    pub key_size: u64,
    pub value_size: u64,
    pub max_entries: u64,
    pub flags: u32,
    /// What the kernel says the map uses now (fdinfo `memlock`).
    pub memlock: u64,
}

fn round8(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

/// The bytes `def` uses on a machine with `cpus` possible CPUs, without the fixed
/// header (see [`HEADER_SLACK`]); None for a map type not modelled.
pub fn charge(def: &MapDef, cpus: u64) -> Option<u64> {
    let value = round8(def.value_size);
    Some(match def.map_type {
        ARRAY => def.max_entries * value,
        PERCPU_ARRAY => def.max_entries * 8 + def.max_entries * value * cpus,
        HASH | LRU_HASH => {
            let lru = def.map_type == LRU_HASH;
            let mut entries = def.max_entries;
            if lru && def.flags & BPF_F_NO_COMMON_LRU != 0 {
                // Split evenly over CPUs: rounded up to a multiple of their number.
                entries = entries.div_ceil(cpus) * cpus;
            }
            let mut usage = entries.next_power_of_two() * BUCKET + 4 * cpus * LOCK_COUNT;
            if def.flags & BPF_F_NO_PREALLOC == 0 {
                let elem = HTAB_ELEM + round8(def.key_size) + value;
                // A plain hash map keeps one spare element per CPU for updates.
                let extra = if lru { 0 } else { cpus };
                usage += elem * (entries + extra);
                if !lru {
                    usage += 8 * cpus;
                }
            }
            usage
        }
        _ => return None,
    })
}

/// The program's pinned maps in `dir` (the agent's pin directory), by name.
pub fn pinned_maps(dir: &Path) -> Result<BTreeMap<String, MapDef>> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut out = BTreeMap::new();
    for name in vip_common::map_names::ALL {
        let path = dir.join(name);
        let info = aya::maps::MapInfo::from_pin(&path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let fd = info.fd().map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_fd().as_raw_fd()))?;
        let field = |k: &str| -> Result<u64> {
            let line = text.lines().find_map(|l| l.strip_prefix(k)?.strip_prefix(':')).ok_or_else(|| anyhow!("no {k} in fdinfo of {}", path.display()))?;
            let v = line.trim();
            match v.strip_prefix("0x") {
                Some(h) => Ok(u64::from_str_radix(h, 16)?),
                None => Ok(v.parse()?),
            }
        };
        let def = MapDef {
            map_type: field("map_type")? as u32,
            key_size: field("key_size")?,
            value_size: field("value_size")?,
            max_entries: field("max_entries")?,
            flags: field("map_flags")? as u32,
            memlock: field("memlock")?,
        };
        out.insert(name.to_owned(), def);
    }
    Ok(out)
}

/// The number of possible CPUs here (what per-CPU maps are sized by).
pub fn possible_cpus() -> Result<u64> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let mut n = 0;
    for part in text.trim().split(',') {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<u64>()? - a.parse::<u64>()? + 1,
            None => 1,
        };
    }
    Ok(n)
}

/// A Kubernetes memory quantity ("384Mi", "1Gi", "500M", "1048576") in bytes.
pub fn quantity_bytes(q: &str) -> Result<u64> {
    let units: [(&str, u64); 8] =
        [("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("Ti", 1 << 40), ("k", 1000), ("M", 1_000_000), ("G", 1_000_000_000), ("T", 1_000_000_000_000)];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return Ok(n.parse::<u64>().with_context(|| format!("memory quantity {q:?}"))? * mult);
        }
    }
    q.parse().with_context(|| format!("memory quantity {q:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(quantity_bytes("384Mi").unwrap(), 384 << 20);
        assert_eq!(quantity_bytes("1Gi").unwrap(), 1 << 30);
        assert_eq!(quantity_bytes("500M").unwrap(), 500_000_000);
        assert_eq!(quantity_bytes("4096").unwrap(), 4096);
        assert!(quantity_bytes("lots").is_err());
    }

    #[test]
    fn per_cpu_maps_grow_with_cpus_and_others_do_not() {
        let pcpu = MapDef { map_type: PERCPU_ARRAY, key_size: 4, value_size: 12, max_entries: 100, flags: 0, memlock: 0 };
        assert_eq!(charge(&pcpu, 4).unwrap() - charge(&pcpu, 2).unwrap(), 2 * 100 * 16);
        let arr = MapDef { map_type: ARRAY, ..pcpu.clone() };
        assert_eq!(charge(&arr, 2), charge(&arr, 256));
        let lru = MapDef { map_type: LRU_HASH, key_size: 13, value_size: 8, max_entries: 1000, flags: BPF_F_NO_COMMON_LRU, memlock: 0 };
        // 1000 entries over 3 CPUs: 1002 elements of 48 + 16 + 8 bytes.
        assert_eq!(charge(&lru, 3).unwrap(), 1024 * BUCKET + 4 * 3 * LOCK_COUNT + 1002 * 72);
    }
}
