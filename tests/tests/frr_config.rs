//! The FRR configuration the agent renders (`vip_agent::bgp::frr_config`) as
//! FRR itself reads it: `vtysh --dryrun` parses the integrated file with every
//! daemon's commands (bgpd's, bfdd's, the route maps) and fails on any line it
//! does not know. bgpd's own `--dryrun` is no check: it ignores other daemons'
//! sections and exits 0 whatever it refused.
use std::{net::IpAddr, process::Command, time::Duration};

use vip_agent::bgp::{frr_config, Advertisement, Attributes, Bfd, Peer, Speaker};

const VTYSH: &str = "vtysh";

/// Whether vtysh (Debian's frr package) runs; outside CI a missing one skips, in
/// CI it fails.
fn vtysh_installed() -> bool {
    if Command::new(VTYSH).arg("--help").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    let why = "vtysh is not installed (Debian's frr package; `cargo xtask setup --tests` installs it)";
    assert!(!std::env::var("CI").is_ok_and(|v| v == "true"), "CI=true but {why}");
    eprintln!("skipping: {why}");
    false
}

/// `vtysh --dryrun` of `config`: Ok, or FRR's complaint.
fn dry_run(config: &str) -> Result<(), String> {
    // Tests run in parallel: a directory per call.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("vip-frr-config-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("frr.conf");
    std::fs::write(&file, config).unwrap();
    let out = Command::new(VTYSH).arg("--dryrun").arg("-f").arg(&file).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    match out.status.success() {
        true => Ok(()),
        false => Err(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))),
    }
}

fn peer(address: &str) -> Peer {
    Peer::new(address.parse().unwrap(), 64512, 64513)
}

fn addrs(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|a| a.parse().unwrap()).collect()
}

/// Speakers using every setting: sessions of both families, with and without BFD
/// (two profiles), timers, password, port, source, multihop; advertisements with
/// and without communities, large communities and local preference; graceful
/// restart on and off; no session at all.
fn speakers() -> Vec<(&'static str, Speaker)> {
    let bfd = |name: &str, ms: u64, mult| Bfd {
        name: name.into(),
        receive_interval: Duration::from_millis(ms),
        transmit_interval: Duration::from_millis(ms),
        detect_multiplier: mult,
    };
    let every = Speaker {
        router_id: "198.18.0.11".parse().unwrap(),
        peers: vec![
            Peer {
                hold_time: Some(Duration::from_secs(3)),
                keepalive_time: Some(Duration::from_secs(1)),
                password: Some("s3cret".into()),
                bfd: Some(bfd("fast", 300, 3)),
                ..peer("198.18.0.1")
            },
            Peer { bfd: Some(bfd("slow", 1000, 5)), source: Some("198.18.0.11".parse().unwrap()), ..peer("198.18.0.2") },
            Peer { source: Some("2001:2::11".parse().unwrap()), port: Some(1179), ebgp_multihop: true, bfd: Some(bfd("fast", 300, 3)), ..peer("2001:2::1") },
        ],
        retiring: vec![],
        advertisements: vec![
            Advertisement {
                addresses: addrs(&["203.0.113.1", "203.0.113.2", "2001:db8::1"]),
                attributes: Attributes {
                    communities: vec!["64512:100".into(), "65535:65281".into()],
                    large_communities: vec!["64512:1:2".into()],
                    local_pref: Some(200),
                },
            },
            Advertisement { addresses: addrs(&["203.0.113.9", "2001:db8::9"]), ..Advertisement::default() },
        ],
        graceful_restart: true,
    };
    let plain = Speaker { peers: vec![peer("198.18.0.1")], advertisements: vec![Advertisement::default()], graceful_restart: false, ..every.clone() };
    let none = Speaker { peers: vec![], advertisements: vec![], ..every.clone() };
    let retiring = every.step_towards(Speaker { peers: every.peers[..1].to_vec(), ..every.clone() }, |_| false);
    let leaving = every.step_towards(Speaker::silent(), |_| false);
    assert_eq!((retiring.retiring.len(), leaving.retiring.len()), (2, 3));
    vec![
        ("every setting", every),
        ("one plain session, nothing advertised", plain),
        ("no session", none),
        ("two sessions retiring", retiring),
        ("every session retiring", leaving),
    ]
}

#[test]
fn frr_reads_every_configuration_the_agent_renders() {
    if !vtysh_installed() {
        return;
    }
    for (what, s) in speakers() {
        let config = frr_config(&s).unwrap_or_else(|e| panic!("{what}: {e}"));
        dry_run(&config).unwrap_or_else(|e| panic!("{what}: FRR refuses the configuration:\n{e}\n{config}"));
    }
}

/// The check above can fail: a line FRR does not know is refused.
#[test]
fn frr_refuses_a_line_it_does_not_know() {
    if !vtysh_installed() {
        return;
    }
    let config = frr_config(&speakers()[0].1).unwrap().replace(" timers 1 3", " timerz 1 3");
    let e = dry_run(&config).expect_err("vtysh took an unknown command");
    assert!(e.contains("timerz"), "{e}");
}
