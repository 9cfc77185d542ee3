//! `cargo xtask bench`: one module per section, each measuring into one
//! [`report::Report`] that is written as OUT_DIR/bench.md and OUT_DIR/bench.json.
//! `VIP_BENCH_ONLY=xdp,live,cps,maglev,health,failover,ecmp,k8s,cluster,auth,scale,sim` runs a subset;
//! `soak` (an hour of churn, `VIP_SOAK_MINUTES`) runs only when named
//! (for quick iteration; BENCHMARKS.md quotes full runs). The sections that send
//! real frames through an attached program (live, failover) measure generic and
//! native XDP in the same run.
mod auth;
mod cluster;
mod ecmp;
mod failover;
mod health;
mod k8s;
mod live;
mod maglev;
mod measure;
mod report;
mod scale;
mod sim;
mod soak;
mod xdp;

use std::path::PathBuf;

use anyhow::Result;
use vip_tests::halab;

/// A section's measurements.
type Bench = fn() -> Result<report::Section>;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        // The HA lab runs this binary as each node's name server.
        return halab::serve_name(args[3].parse()?, &args[2]);
    }
    if let Ok(path) = std::env::var("VIP_BENCH_XDP_ROWS") {
        // The xdp section's reduced-capabilities run (see xdp::section).
        return xdp::write_rows(&path);
    }
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "bench-results".into()));
    std::fs::create_dir_all(&dir)?;
    let only = std::env::var("VIP_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == name));
    let mut report = report::Report::default();
    if wanted("xdp") {
        // Live-frames XDP_TX really transmits: inside a namespace of our own, on its lo
        // (see xdp::section, which also runs us again with reduced capabilities).
        report.push(xdp::section()?);
    }
    let sections: [(&str, Bench); 11] = [
        ("live", live::section),
        ("cps", live::cps_section),
        ("maglev", maglev::section),
        ("health", health::section),
        ("failover", failover::section),
        ("ecmp", ecmp::section),
        ("k8s", k8s::section),
        ("cluster", cluster::section),
        ("auth", auth::section),
        ("scale", scale::section),
        ("sim", sim::section),
    ];
    for (name, section) in sections {
        if wanted(name) {
            report.push(section()?);
        }
    }
    // The soak runs an hour: only when asked for by name.
    if only.as_deref().is_some_and(|o| o.split(',').any(|x| x == "soak")) {
        report.push(soak::section()?);
    }
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let md = format!("Run on {} cores, kernel {}\n\n{}", std::thread::available_parallelism()?.get(), kernel.trim(), report.markdown());
    std::fs::write(dir.join("bench.md"), &md)?;
    std::fs::write(dir.join("bench.json"), serde_json::to_string_pretty(&report.json()?)?)?;
    println!("{md}\nwritten to {}", dir.join("bench.md").display());
    Ok(())
}
