//! `vip-agent check`: the example config a newcomer starts from is valid, a broken
//! file is refused with its path and line, and a host is checked for what direct
//! server return needs (the VIP on lo, strict ARP), in a namespace of the test's own.
use std::process::Output;

use vip_tests::{
    agent::agent_bin,
    netns::{privileged, NetNs},
};

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn example() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/file/vip.yaml")
}

#[test]
fn the_example_config_is_valid_and_a_broken_copy_is_refused_with_its_line() {
    let o = std::process::Command::new(agent_bin().unwrap()).args(["check", "--config"]).arg(example()).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("valid: 3 nodes, 1 pools (10 addresses), 2 services (3 service-ports)"), "{}", text(&o));

    let dir = vip_tests::agent::TempDir::new("vip-check-").unwrap();
    let good = std::fs::read_to_string(example()).unwrap();
    // The commented-out keys are valid when uncommented.
    let uncommented = dir.0.join("uncommented.yaml");
    assert!(good.contains("    # interfaces: [eth0, ens3]\n"), "the example shows a pool's interfaces");
    std::fs::write(&uncommented, good.replace("    # interfaces: ", "    interfaces: ")).unwrap();
    // The file as a positional argument: the form before --config, kept.
    let o = std::process::Command::new(agent_bin().unwrap()).arg("check").arg(&uncommented).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let world = vip_agent::config::parse(&std::fs::read_to_string(&uncommented).unwrap()).unwrap();
    assert_eq!(world.pools[0].interfaces, ["eth0", "ens3"]);

    let broken = dir.0.join("vip.yaml");
    std::fs::write(&broken, good.replace("    protocol: udp\n", "    protocol: udp\n    tableSise: 251\n")).unwrap();
    let o = std::process::Command::new(agent_bin().unwrap()).args(["check", "--config"]).arg(&broken).output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let line = good.lines().position(|l| l == "    protocol: udp").unwrap() + 2;
    assert!(text(&o).contains(&format!("line {line}: services[1].tableSise: unknown field `tableSise`")), "{}", text(&o));
}

/// The host check, in a namespace: first the VIPs are missing from lo, then they
/// are there but ARP is loose (two answerers), then the node is ready.
#[test]
fn check_names_what_a_backend_host_lacks_until_it_is_ready() {
    if !privileged() {
        return;
    }
    let dir = vip_tests::agent::TempDir::new("vip-check-").unwrap();
    let cfg = dir.0.join("vip.yaml");
    std::fs::write(
        &cfg,
        "nodes:\n  - {name: n1, address: 198.18.0.11}\n  - {name: n2, address: 198.18.0.12}\n\
         pools:\n  - {name: p, addresses: [198.18.1.0/30]}\n\
         services:\n  - {name: web, vip: 198.18.1.1, ports: [80]}\n  - {name: dns, vip: 198.18.1.2, ports: [53], protocol: udp}\n",
    )
    .unwrap();
    let host = NetNs::new("vchk").unwrap();
    host.ip(&["link", "set", "lo", "up"]).unwrap();
    let check = || {
        host.cmd(agent_bin().unwrap().to_str().unwrap()).args(["check", "--config"]).arg(&cfg).args(["--node-name", "n1", "--iface", "lo"]).output().unwrap()
    };

    let o = check();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("2 VIP(s) this node is a backend of are not addresses of this host (198.18.1.1, 198.18.1.2)"), "{}", text(&o));

    for vip in ["198.18.1.1/32", "198.18.1.2/32"] {
        host.ip(&["addr", "add", vip, "dev", "lo"]).unwrap();
    }
    host.sysctl("net.ipv4.conf.all.arp_ignore", "0").unwrap();
    host.sysctl("net.ipv4.conf.all.arp_announce", "0").unwrap();
    let o = check();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("arp_ignore is 0 and arp_announce 0") && text(&o).contains("two MACs"), "{}", text(&o));
    assert!(!text(&o).contains("not addresses of this host"), "{}", text(&o));

    host.sysctl("net.ipv4.conf.all.arp_ignore", "1").unwrap();
    host.sysctl("net.ipv4.conf.all.arp_announce", "2").unwrap();
    let o = check();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("host: ready as node \"n1\""), "{}", text(&o));
    assert!(text(&o).contains("host: pool \"p\" answered on lo"), "--iface names the pool's interface: {}", text(&o));

    // Without --iface: the pool lives by its addresses or the node's; this host has
    // neither network, then gets the node's address on an interface.
    let check = || host.cmd(agent_bin().unwrap().to_str().unwrap()).args(["check", "--config"]).arg(&cfg).args(["--node-name", "n1"]).output().unwrap();
    let o = check();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("pool \"p\": no interface of this node has a network containing 198.18.1.0"), "{}", text(&o));
    host.ip(&["link", "add", "v0", "type", "veth", "peer", "name", "v1"]).unwrap();
    host.ip(&["addr", "add", "198.18.0.11/24", "dev", "v0"]).unwrap();
    let o = check();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("host: pool \"p\" answered on v0"), "{}", text(&o));
}

/// `vip-agent cleanup` (what deploy/cleanup/ runs on every node) leaves no XDP
/// attachment, no pins, none of vip's addresses on lo, none of route_guard's rules
/// and routes and no status file, and keeps an address on lo, a rule and a route
/// that are not vip's.
#[test]
fn cleanup_removes_the_attachment_pins_loopback_vips_route_guard_and_status() {
    if !privileged() {
        return;
    }
    let host = NetNs::new("vclean").unwrap();
    let peer = NetNs::new("vcpeer").unwrap();
    vip_tests::netns::veth(&host, "eth0", &peer, "p0").unwrap();
    let pins = vip_tests::netns::PinDir::new().unwrap();
    let dir = pins.path.clone();
    host.run(move || vip_agent::dataplane::Dataplane::load(&dir, 1 << 12).unwrap().attach("eth0", vip_agent::dataplane::AttachMode::Generic).unwrap()).unwrap();
    host.ip(&["addr", "add", "198.18.7.1/32", "dev", "lo", "label", "lo:vip"]).unwrap();
    host.ip(&["addr", "add", "198.18.7.2/32", "dev", "lo"]).unwrap();
    // route_guard's (as the agent writes them: proto 118) and someone else's.
    for cmd in [
        "rule add iif eth0 lookup 7473 pref 7473 proto 118",
        "-6 rule add iif eth0 lookup 7473 pref 7473 proto 118",
        "route add blackhole 198.18.7.200/32 table 7473 proto 118",
        "rule add iif eth0 lookup 7474 pref 7474",
        "route add blackhole 198.18.7.201/32 table 7474",
    ] {
        host.ip(&cmd.split(' ').collect::<Vec<_>>()).unwrap();
    }
    let tmp = vip_tests::agent::TempDir::new("vip-cleanup-").unwrap();
    let status = tmp.0.join("status.json");
    std::fs::write(&status, "{}").unwrap();
    let xdp_on = || String::from_utf8_lossy(&host.ip(&["-d", "link", "show", "eth0"]).unwrap().stdout).contains("prog/xdp");
    assert!(xdp_on(), "attached before the clean-up");

    let o = host
        .cmd(agent_bin().unwrap().to_str().unwrap())
        .args(["--pin-dir", pins.path.to_str().unwrap(), "cleanup", "--status-file", status.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("detached from eth0") && out.contains("198.18.7.1") && !out.contains("198.18.7.2"), "{out}");
    assert!(!xdp_on(), "still attached after the clean-up");
    assert!(!pins.path.exists(), "pins left in {}", pins.path.display());
    assert!(!status.exists());
    let lo = String::from_utf8_lossy(&host.ip(&["addr", "show", "dev", "lo"]).unwrap().stdout).into_owned();
    assert!(!lo.contains("198.18.7.1/32") && lo.contains("198.18.7.2/32"), "{lo}");
    assert!(out.contains("removed 2 routing rule(s) to table 7473 and 1 blackhole route(s)"), "{out}");
    let show = |args: &[&str]| String::from_utf8_lossy(&host.ip(args).unwrap().stdout).into_owned();
    let left = show(&["rule", "show"]) + &show(&["-6", "rule", "show"]) + &show(&["route", "show", "table", "all"]);
    assert!(!left.contains("7473") && left.contains("lookup 7474") && left.contains("blackhole 198.18.7.201"), "{left}");

    // Twice is fine: nothing left to remove.
    let o = host
        .cmd(agent_bin().unwrap().to_str().unwrap())
        .args(["--pin-dir", pins.path.to_str().unwrap(), "cleanup", "--status-file", status.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success() && text(&o).contains("no XDP attachment"), "{}", text(&o));
}
