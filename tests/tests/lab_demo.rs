//! The README's first command, `cargo xtask lab demo`, as it runs it (`vip-lab
//! demo`): it succeeds, connections spread over the three nodes, the failover
//! keeps every established connection, and the closing status table shows each
//! agent up (restored after the failover) holding what the owners say.
use std::path::Path;

use vip_tests::netns::privileged;

#[test]
fn the_demo_spreads_fails_over_and_shows_every_agent_up() {
    if !privileged() {
        return;
    }
    vip_tests::agent::agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let out = std::process::Command::new(Path::new(env!("CARGO_BIN_EXE_vip-lab"))).arg("demo").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "vip-lab demo failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let status = text.split("== lab status").nth(1).unwrap_or_else(|| panic!("no status table:\n{text}"));
    let rows: Vec<Vec<&str>> = status.lines().filter(|l| l.starts_with("node-")).map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows.len(), 3, "a row per node:\n{status}");
    for r in &rows {
        assert_eq!(r[1], "up", "every agent runs at the end of the demo:\n{status}");
    }
    // Each VIP held by exactly one node's row, as the owners section says.
    let held: Vec<&str> = rows.iter().flat_map(|r| r[2..].iter().copied().filter(|c| c.starts_with("198.18.1."))).collect();
    let mut sorted = held.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!((held.len(), sorted), (3, vec!["198.18.1.10", "198.18.1.11", "198.18.1.12"]), "{status}");
    assert!(text.contains("established connections (owner was not their backend):"), "{text}");
    assert!(!Path::new("/run/netns/vlab-br").exists(), "the demo removes its lab");
}
