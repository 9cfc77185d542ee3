//! `cargo xtask setup`: everything a fresh machine of this kind needs, each step
//! skipped when already done.
use std::{path::Path, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::run;

/// Debian packages the tests and the lab use (binary checked, package installed).
const PACKAGES: &[(&str, &str)] = &[
    ("bpftool", "bpftool"),
    ("ip", "iproute2"),
    ("arping", "iputils-arping"),
    ("ping", "iputils-ping"),
    ("tcpdump", "tcpdump"),
    // GRO on a veth peer: native XDP_TX (and the agent's XDP frame sender) on veth.
    ("ethtool", "ethtool"),
    // The multi-node cluster's nodes (tests/src/cluster.rs): container runtime, CNI
    // plugins, and kube-proxy's two modes.
    ("containerd", "containerd"),
    ("runc", "runc"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    ("nft", "nftables"),
    ("iptables", "iptables"),
    // tests/image.rs builds deploy/Containerfile and compares it with the archive.
    ("podman", "podman"),
    // promtool: the alert rules' unit tests (tests/tests/monitoring.rs). The package
    // is Prometheus itself; where systemd runs, Debian starts its server (the tests
    // do not use it).
    ("promtool", "prometheus"),
];

fn have(bin: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {bin} >/dev/null 2>&1")]).status().is_ok_and(|s| s.success())
        || Path::new("/usr/sbin").join(bin).exists()
}

fn output(cmd: &mut Command) -> Option<String> {
    let o = cmd.output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

pub fn setup() -> Result<()> {
    apt_packages()?;
    nightly_rust_src()?;
    lint_tools()?;
    bpf_linker()?;
    bpffs()?;
    eprintln!("xtask: setup complete");
    Ok(())
}

fn apt_packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES.iter().filter(|(bin, _)| !have(bin)).map(|(_, pkg)| *pkg).collect();
    if missing.is_empty() {
        eprintln!("xtask: Debian packages present ({})", PACKAGES.iter().map(|p| p.1).collect::<Vec<_>>().join(", "));
        return Ok(());
    }
    if unsafe { libc_geteuid() } != 0 {
        bail!("missing Debian packages {missing:?}: run `cargo xtask setup` as root or `apt-get install {}`", missing.join(" "));
    }
    run(Command::new("apt-get").args(["update", "-qq"]), "apt-get update")?;
    run(
        Command::new("apt-get").args(["install", "-y", "-qq", "--no-install-recommends"]).args(&missing).env("DEBIAN_FRONTEND", "noninteractive"),
        &format!("installing Debian packages {}", missing.join(" ")),
    )
}

fn nightly_rust_src() -> Result<()> {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"])).unwrap_or_default();
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        bail!("no nightly toolchain: the BPF build needs the machine's nightly (docs/development/dependencies.md); `rustup toolchain install nightly` where it can be fetched");
    }
    let installed = output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", "nightly"])).unwrap_or_default();
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        eprintln!("xtask: rust-src present for nightly");
        return Ok(());
    }
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]), "adding rust-src to the nightly toolchain")
}

/// rustfmt and clippy for the stable toolchain (`cargo xtask test` checks both).
fn lint_tools() -> Result<()> {
    let installed = output(Command::new("rustup").args(["component", "list", "--installed"])).unwrap_or_default();
    let missing: Vec<&str> = ["rustfmt", "clippy"].into_iter().filter(|c| !installed.lines().any(|l| l.starts_with(c))).collect();
    if missing.is_empty() {
        eprintln!("xtask: rustfmt and clippy present");
        return Ok(());
    }
    run(Command::new("rustup").args(["component", "add"]).args(&missing), &format!("adding {} to the toolchain", missing.join(" ")))
}

fn bpf_linker() -> Result<()> {
    if let Some(v) = output(Command::new("bpf-linker").arg("--version")) {
        eprintln!("xtask: {} present", v.trim());
        return Ok(());
    }
    // bpf-linker links against LLVM 22; the nightly ships it as libLLVM.so.22.1-rust-*.
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"])).context("rustc +nightly --print sysroot")?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let llvm = std::fs::read_dir(&lib)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libLLVM.so.22")))
        .with_context(|| format!("no libLLVM.so.22* in {}: bpf-linker must be built against the nightly's own LLVM 22", lib.display()))?;
    let prefix = std::env::temp_dir().join("vip-llvm-prefix");
    std::fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&llvm, &link)?;
    run(
        crate::cargo(Some("nightly"))
            .args(["install", "bpf-linker", "--locked", "--version", "^0.13", "--no-default-features", "--features", "llvm-22"])
            .env("LLVM_PREFIX", &prefix),
        "building bpf-linker 0.13 against the nightly's LLVM 22 (a few minutes)",
    )
}

fn bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    if mounts.lines().any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf") && l.split_whitespace().nth(2) == Some("bpf")) {
        eprintln!("xtask: bpffs mounted at /sys/fs/bpf");
        return Ok(());
    }
    if unsafe { libc_geteuid() } != 0 {
        eprintln!("xtask: bpffs not mounted and not root: the BPF tests need `mount -t bpf bpf /sys/fs/bpf`");
        return Ok(());
    }
    run(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]), "mounting bpffs at /sys/fs/bpf")
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
