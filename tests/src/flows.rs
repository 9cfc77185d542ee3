//! Filling a node's flow table (`lb4_flows`) to real scale without sending a
//! million packets: entries written from user space, as the data path would
//! write them on first packets.
use std::{net::Ipv4Addr, path::Path};

use anyhow::{Context as _, Result};
use vip_agent::dataplane::Dataplane;
use vip_common::{Lb4Flow, Lb4FlowKey, PROTO_TCP};

/// `n` distinct TCP flows from 198.19.0.0/16 to `vips` (round robin) on `dport`,
/// pinned to `backends` (round robin).
pub fn synthetic(n: usize, vips: &[Ipv4Addr], dport: u16, backends: &[u32]) -> Vec<(Lb4FlowKey, Lb4Flow)> {
    (0..n)
        .map(|i| {
            let key = Lb4FlowKey {
                src: Ipv4Addr::new(198, 19, (i >> 16) as u8, (i >> 8) as u8).octets(),
                dst: vips[i % vips.len()].octets(),
                sport: ((i & 0xff) as u16 + 1024).to_be_bytes(),
                dport: dport.to_be_bytes(),
                proto: PROTO_TCP,
                _pad: [0; 3],
            };
            (key, Lb4Flow { backend: backends[i % backends.len()], _pad: 0 })
        })
        .collect()
}

/// Writes `flows` into the flow table pinned under `pins`, spread over every CPU:
/// the table keeps a free list per CPU (`BPF_F_NO_COMMON_LRU`), so writes from
/// one CPU could fill only that CPU's share. Returns the entries in the table after.
pub fn fill(pins: &Path, flows: &[(Lb4FlowKey, Lb4Flow)]) -> Result<usize> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = flows.len().div_ceil(cpus);
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = flows
            .chunks(per.max(1))
            .enumerate()
            .map(|(cpu, part)| {
                s.spawn(move || -> Result<()> {
                    // SAFETY: a zeroed cpu_set_t with one bit set, for this thread.
                    unsafe {
                        let mut set: libc::cpu_set_t = std::mem::zeroed();
                        libc::CPU_SET(cpu, &mut set);
                        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                            anyhow::bail!("sched_setaffinity to CPU {cpu}: {}", std::io::Error::last_os_error());
                        }
                    }
                    let mut dp = Dataplane::open(pins)?;
                    dp.insert_flows(part)
                })
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("a fill thread panicked"))??;
        }
        Ok(())
    })
    .context("filling lb4_flows")?;
    Ok(Dataplane::open(pins)?.flow_count())
}
