//! The command line as its users meet it, with the real binary: `detach` refuses
//! without a target and says what `--all --purge` removed; `inspect` explains a
//! node without pins and a missing or broken status file; the Kubernetes start
//! names the watch that never lists (here: no VipPool CRD) instead of waiting
//! forever.
use std::{process::Output, time::Duration};

use vip_tests::{
    agent::{agent_bin, wait_for, TempDir},
    apiserver::{service_account_token, write_kubeconfig, ApiServer, ResourceSpec},
    netns::{privileged, NetNs, PinDir},
};

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn inspect_without_pins_says_the_agent_has_not_run_here() {
    let dir = TempDir::new("vip-cli-").unwrap();
    let o = std::process::Command::new(agent_bin().unwrap()).args(["--pin-dir"]).arg(dir.0.join("none")).arg("inspect").output().unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("no vip data path on this node") && text(&o).contains("The agent has not run here"), "{}", text(&o));
    assert!(!text(&o).contains("vip-agent attach"), "an agent user is not told to attach by hand: {}", text(&o));
}

#[test]
fn check_takes_the_file_as_config() {
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/file/vip.yaml");
    let o = std::process::Command::new(agent_bin().unwrap()).args(["check", "--config"]).arg(&example).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("valid: 3 nodes"), "{}", text(&o));
    let o = std::process::Command::new(agent_bin().unwrap()).arg("check").output().unwrap();
    assert_eq!(o.status.code(), Some(2), "clap's usage error: {}", text(&o));
    assert!(text(&o).contains("--config <CONFIG>"), "{}", text(&o));
}

/// Attached to two interfaces in a namespace of the test's own, then detached
/// from both and purged: each step says what it did.
#[test]
fn detach_needs_a_target_and_says_what_it_removed() {
    if !privileged() {
        return;
    }
    let ns = NetNs::new("vdet").unwrap();
    ns.ip(&["link", "add", "v0", "type", "veth", "peer", "name", "v1"]).unwrap();
    for i in ["v0", "v1"] {
        ns.ip(&["link", "set", i, "up"]).unwrap();
    }
    let pins = PinDir::new().unwrap();
    let agent = |args: &[&str]| ns.cmd(agent_bin().unwrap().to_str().unwrap()).args(["--pin-dir", pins.path.to_str().unwrap()]).args(args).output().unwrap();
    for i in ["v0", "v1"] {
        let o = agent(&["attach", "--iface", i, "--mode", "generic"]);
        assert!(o.status.success(), "{}", text(&o));
    }
    let xdp_on = |i: &str| String::from_utf8_lossy(&ns.cmd("ip").args(["-d", "link", "show", "dev", i]).output().unwrap().stdout).contains("xdpgeneric");
    assert!(xdp_on("v0") && xdp_on("v1"));

    // inspect on pins without an agent: the missing status is said, then a broken one.
    let tmp = TempDir::new("vip-cli-").unwrap();
    let status = tmp.0.join("status.json");
    let o = agent(&["inspect", "--status-file", status.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).starts_with(&format!("AGENT: no status file at {}", status.display())), "{}", text(&o));
    std::fs::write(&status, "{\"node\": ").unwrap();
    let o = agent(&["inspect", "--status-file", status.to_str().unwrap()]);
    assert!(text(&o).contains(&format!("the status file {} could not be read: not a status:", status.display())), "{}", text(&o));

    let o = agent(&["detach"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("detach needs a target: --iface IFACE"), "{}", text(&o));
    assert!(xdp_on("v0") && xdp_on("v1"), "a refused detach changes nothing");

    let o = agent(&["detach", "--all", "--purge"]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(out.contains("detached from v0\ndetached from v1\n"), "{out}");
    let removed = out.lines().find(|l| l.starts_with(&format!("removed {}: ", pins.path.display()))).unwrap_or_else(|| panic!("{out}"));
    assert!(removed.contains("vip_xdp") && removed.contains("lb4_services") && removed.contains("arp_held"), "{removed}");
    assert!(!pins.path.exists(), "the pin directory is gone");
    assert!(!xdp_on("v0") && !xdp_on("v1"), "the program is detached");

    let o = agent(&["detach", "--all", "--purge"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("no link pinned under") && text(&o).contains("nothing to purge"), "{}", text(&o));
}

/// An API server without the VipPool CRD: the start logs which lists it waits
/// for, then gives up with the missing watch and the likely cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubernetes_start_names_the_watch_that_never_lists() {
    let api = ApiServer::builder().resources(ResourceSpec::VIP.into_iter().filter(|r| r.plural != "vippools")).start().await.unwrap();
    let dir = TempDir::new("vip-cli-").unwrap();
    let kubeconfig = write_kubeconfig(&dir.0.join("kubeconfig"), &api.url(), Some(&service_account_token("vip-system", "vip-agent"))).unwrap();
    let mut child = std::process::Command::new(agent_bin().unwrap())
        .args(["--pin-dir"])
        .arg(dir.0.join("pins"))
        .args(["run", "--kubernetes", "--kubeconfig"])
        .arg(&kubeconfig)
        .args(["--node-name", "n1", "--trusted-segment", "--metrics-addr", "off", "--sync-timeout", "3s", "--status-file"])
        .arg(dir.0.join("status.json"))
        .env("RUST_LOG", "info")
        .env_remove("RUST_BACKTRACE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let exited = tokio::task::block_in_place(|| wait_for(Duration::from_secs(30), || child.try_wait().unwrap()));
    if exited.is_none() {
        let _ = child.kill();
    }
    let o = child.wait_with_output().unwrap();
    let log = text(&o);
    assert!(exited.is_some_and(|s| !s.success()), "the start should give up: {log}");
    assert!(log.contains("waiting for the first list of vippools from the Kubernetes API (done: "), "progress lines: {log}");
    assert!(log.contains("the Kubernetes start gave up after 3 s (--sync-timeout / VIP_SYNC_TIMEOUT): no first list of vippools (last error: "), "{log}");
    assert!(log.contains("the VipPool CRD may not be installed"), "{log}");
    assert!(!log.contains("no first list of nodes") && !log.contains("; services"), "only the missing watch is named: {log}");
}
