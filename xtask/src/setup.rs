//! `cargo xtask setup`: what building needs on a fresh machine of this kind, each
//! step skipped when already done; `--lab` and `--tests` add what the lab and the
//! test suite run. The build commands (`build-ebpf`, `image`) run the build part
//! themselves, `lab` the lab part and `test` and `bench` all of it.
//!
//! The toolchains are checked against the pins in `toolchains.toml`
//! ([`Pins`]): the pinned nightly is installed where rustup can fetch it, and
//! otherwise an installed nightly is used only if its LLVM major is the pinned one
//! (bpf-linker is built against the nightly's own LLVM), with a warning that says
//! what differs ([`nightly_verdict`]).
use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::run;

/// What a command needs installed.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Scope {
    /// The build: the toolchains, rust-src, bpf-linker and a C compiler
    /// (`setup`, `build-ebpf`, `image`).
    Build,
    /// The build and what the lab runs: the network-namespace tools and bpffs (`lab`).
    Lab,
    /// All of the above and what only the test suite uses (`test`, `bench`).
    Tests,
}

/// Debian packages of the build (binary checked, package installed): ring (the
/// Kubernetes client's TLS) and bpf-linker's LLVM bindings compile C.
const BUILD_PACKAGES: &[(&str, &str)] = &[("cc", "gcc")];

/// Debian packages the lab and the network-namespace tests use.
const LAB_PACKAGES: &[(&str, &str)] = &[
    ("bpftool", "bpftool"),
    ("ip", "iproute2"),
    ("arping", "iputils-arping"),
    ("ping", "iputils-ping"),
    ("tcpdump", "tcpdump"),
    // GRO on a veth peer: native XDP_TX (and the agent's XDP frame sender) on veth.
    ("ethtool", "ethtool"),
];

/// Debian packages only the test suite uses.
const TEST_PACKAGES: &[(&str, &str)] = &[
    // The multi-node cluster's nodes (tests/src/cluster.rs): container runtime, CNI
    // plugins, and kube-proxy's two modes (nft also for route_guard's tests). The
    // tests start a containerd of their own in each node's namespaces.
    ("containerd", "containerd"),
    ("runc", "runc"),
    ("/usr/lib/cni/bridge", "containernetworking-plugins"),
    ("nft", "nftables"),
    ("iptables", "iptables"),
    // tests/image.rs builds deploy/Containerfile and compares it with the archive.
    ("podman", "podman"),
    // promtool: the alert rules' unit tests (tests/tests/monitoring.rs). No Debian
    // package ships promtool without the Prometheus server, so the server comes too
    // and is kept from running ([`DAEMONS`]).
    ("promtool", "prometheus"),
    // Routed networks (tests/src/routed.rs): the upstream router (FRR's zebra and
    // bgpd), the nodes' own BGP speaker (BIRD, as Calico runs it) or the FRR
    // their agents drive.
    ("/usr/lib/frr/bgpd", "frr"),
    // announce: bgp: the agent applies FRR's configuration with frr-reload.py.
    ("/usr/lib/frr/frr-reload.py", "frr-pythontools"),
    ("bird", "bird2"),
];

/// Packages whose installation would start a daemon (Debian starts a package's
/// service when it is installed) that nothing here uses, and the service's name:
/// none is left running or enabled on the build host.
const DAEMONS: &[(&str, &str)] = &[("containerd", "containerd"), ("prometheus", "prometheus"), ("frr", "frr"), ("bird2", "bird")];

/// The pins of `toolchains.toml` at the workspace root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pins {
    /// The stable release the userspace build was verified with (`1.95.0`).
    pub stable: String,
    /// The dated nightly toolchain (`nightly-2026-05-20`).
    pub nightly: String,
    /// The start of its commit hash (`rustc -vV`'s commit-hash).
    pub nightly_commit: String,
    /// Its LLVM major, the one bpf-linker is built against.
    pub llvm_major: u32,
    /// The bpf-linker version.
    pub bpf_linker: String,
}

/// The `key = "value"` lines of a pin file (toolchains.toml, releases.toml), in
/// order; `#` starts a comment, a key may be quoted.
pub fn key_values(text: &str) -> Result<Vec<(String, String)>> {
    let mut values = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, rest) = line.split_once('=').with_context(|| format!("line {}: not `key = \"value\"`", n + 1))?;
        let rest = rest.trim().strip_prefix('"').with_context(|| format!("line {}: the value is not quoted", n + 1))?;
        let (value, after) = rest.split_once('"').with_context(|| format!("line {}: unterminated string", n + 1))?;
        let after = after.trim();
        if !(after.is_empty() || after.starts_with('#')) {
            bail!("line {}: unexpected {after:?} after the value", n + 1);
        }
        values.push((key.trim().trim_matches('"').to_owned(), value.to_owned()));
    }
    Ok(values)
}

const PIN_FILE: &str = include_str!("../../toolchains.toml");

impl Pins {
    pub fn load() -> Result<Self> {
        Self::parse(PIN_FILE).context("toolchains.toml")
    }

    fn parse(text: &str) -> Result<Self> {
        let mut values: std::collections::BTreeMap<String, String> = key_values(text)?.into_iter().collect();
        let mut take = |k: &str| values.remove(k).with_context(|| format!("no `{k}`"));
        let pins = Pins {
            stable: take("stable")?,
            nightly: take("nightly")?,
            nightly_commit: take("nightly-commit")?,
            llvm_major: take("llvm-major")?.parse().context("llvm-major")?,
            bpf_linker: take("bpf-linker")?,
        };
        if let Some(k) = values.keys().next() {
            bail!("unknown key `{k}`");
        }
        if !pins.nightly.starts_with("nightly-") {
            bail!("nightly = {:?}: not a dated nightly (nightly-YYYY-MM-DD)", pins.nightly);
        }
        Ok(pins)
    }
}

/// The outcome of comparing an installed toolchain with its pin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The pinned build: say so and go on.
    Ok(String),
    /// Another build that will do: say what differs and go on.
    Warn(String),
    /// Cannot build: stop with this.
    Error(String),
}

impl Verdict {
    fn rank(&self) -> u8 {
        match self {
            Verdict::Ok(_) => 0,
            Verdict::Warn(_) => 1,
            Verdict::Error(_) => 2,
        }
    }

    fn message(&self) -> &str {
        match self {
            Verdict::Ok(m) | Verdict::Warn(m) | Verdict::Error(m) => m,
        }
    }
}

/// The fields of `rustc -vV` that the checks read.
#[derive(Debug, Default)]
struct RustcVersion {
    release: String,
    commit_hash: String,
    commit_date: String,
    llvm: Option<String>,
}

impl RustcVersion {
    fn parse(text: &str) -> Self {
        let mut v = RustcVersion::default();
        for line in text.lines() {
            let Some((k, val)) = line.split_once(':') else { continue };
            let val = val.trim().to_owned();
            match k.trim() {
                "release" => v.release = val,
                "commit-hash" => v.commit_hash = val,
                "commit-date" => v.commit_date = val,
                "LLVM version" => v.llvm = Some(val),
                _ => {}
            }
        }
        v
    }

    fn llvm_major(&self) -> Option<u32> {
        self.llvm.as_deref()?.split('.').next()?.parse().ok()
    }

    /// `1.97.0-nightly (e50aa6fba 2026-05-19, LLVM 22.1.4)`.
    fn describe(&self) -> String {
        let hash: String = self.commit_hash.chars().take(9).collect();
        format!("{} ({hash} {}, LLVM {})", self.release, self.commit_date, self.llvm.as_deref().unwrap_or("unknown"))
    }
}

/// `1.95.0` (and `1.97.0-nightly`) as numbers, for ordering.
fn release_numbers(release: &str) -> Option<(u32, u32, u32)> {
    let mut it = release.split('-').next()?.split('.').map(|x| x.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
}

/// The command that installs the pinned nightly where rustup can fetch it.
fn install_nightly_command(pins: &Pins) -> String {
    format!("rustup toolchain install {} --profile minimal --component rust-src", pins.nightly)
}

/// Compares an installed nightly (`name`, its `rustc -vV` output `vv`) with the pinned
/// one. `note` says why another toolchain than the pinned one is looked at (empty
/// when `name` is the pinned toolchain itself), e.g. "not installed and cannot be
/// fetched". Same commit: ok; another build with the pinned LLVM major: warn; another
/// LLVM major, or not a nightly: error, since bpf-linker links that LLVM.
pub fn nightly_verdict(pins: &Pins, name: &str, vv: &str, note: &str) -> Verdict {
    let v = RustcVersion::parse(vv);
    let pinned = format!("pinned {} (LLVM {})", pins.nightly, pins.llvm_major);
    let prefix = if note.is_empty() { format!("{name}: {}", v.describe()) } else { format!("{pinned} {note}; installed {name}: {}", v.describe()) };
    if v.release.is_empty() {
        return Verdict::Error(format!("{pinned}: `rustc +{name} -vV` printed no release: {vv:?}"));
    }
    if !v.release.contains("nightly") {
        return Verdict::Error(format!("{prefix}: not a nightly (the XDP build needs build-std); install the pinned one: `{}`", install_nightly_command(pins)));
    }
    let Some(major) = v.llvm_major() else {
        return Verdict::Error(format!("{prefix}: no LLVM version in `rustc -vV`; install the pinned one: `{}`", install_nightly_command(pins)));
    };
    if major != pins.llvm_major {
        return Verdict::Error(format!(
            "{prefix}: LLVM {major}, not {}: bpf-linker {} is built against the nightly's own LLVM (feature llvm-{}), so this nightly cannot link the XDP program; install the pinned one: `{}`",
            pins.llvm_major,
            pins.bpf_linker,
            pins.llvm_major,
            install_nightly_command(pins)
        ));
    }
    if !pins.nightly_commit.is_empty() && v.commit_hash.starts_with(&pins.nightly_commit) {
        if note.is_empty() {
            return Verdict::Ok(format!("{prefix}, as pinned"));
        }
        return Verdict::Ok(format!("{prefix}: the pinned build under another name, continuing"));
    }
    Verdict::Warn(format!("{prefix}: not the pinned build (commit {}), same LLVM major, continuing", pins.nightly_commit))
}

/// Compares the default toolchain's `rustc -vV` (`vv`) with the pinned stable release:
/// the same: ok; newer, or not a stable release: warn; older: error.
pub fn stable_verdict(pins: &Pins, vv: &str) -> Verdict {
    let v = RustcVersion::parse(vv);
    let set_default = format!("`rustup toolchain install {0} && rustup default {0}`", pins.stable);
    let (Some(have), Some(want)) = (release_numbers(&v.release), release_numbers(&pins.stable)) else {
        return Verdict::Error(format!("pinned stable {}: cannot read the default toolchain's release from `rustc -vV`: {vv:?}", pins.stable));
    };
    if v.release.contains('-') {
        return Verdict::Warn(format!("pinned stable {}; the default toolchain is {}, not a stable release, continuing", pins.stable, v.describe()));
    }
    match have.cmp(&want) {
        std::cmp::Ordering::Equal => Verdict::Ok(format!("stable {}, as pinned", v.describe())),
        std::cmp::Ordering::Greater => Verdict::Warn(format!("pinned stable {}; the default toolchain is {}: newer, continuing", pins.stable, v.describe())),
        std::cmp::Ordering::Less => Verdict::Error(format!(
            "pinned stable {}; the default toolchain is {}: older than the build was verified with; {set_default}",
            pins.stable,
            v.describe()
        )),
    }
}

fn have(bin: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {bin} >/dev/null 2>&1")]).status().is_ok_and(|s| s.success())
        || Path::new("/usr/sbin").join(bin).exists()
}

fn output(cmd: &mut Command) -> Option<String> {
    let o = cmd.output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).into_owned())
}

fn is_root() -> bool {
    unsafe { libc_geteuid() == 0 }
}

/// Installs what `scope` needs (each step skipped when done) and returns the
/// nightly toolchain to build the XDP program with. `fetch`: install the pinned
/// nightly when it is missing even though an installed one would do (`setup`,
/// `test`, `bench`; the build commands fetch only when no installed nightly will do).
pub fn setup(scope: Scope, fetch: bool) -> Result<String> {
    let pins = Pins::load()?;
    apt_packages("build", BUILD_PACKAGES, "cargo xtask setup")?;
    stable(&pins)?;
    let nightly = nightly(&pins, fetch)?;
    rust_src(&nightly)?;
    bpf_linker(&pins, &nightly)?;
    if scope >= Scope::Lab {
        apt_packages("lab", LAB_PACKAGES, "cargo xtask setup --lab")?;
        bpffs()?;
    }
    if scope >= Scope::Tests {
        apt_packages("test", TEST_PACKAGES, "cargo xtask setup --tests")?;
        lint_tools()?;
    }
    eprintln!(
        "xtask: setup complete ({})",
        match scope {
            Scope::Build => "build",
            Scope::Lab => "build and lab",
            Scope::Tests => "build, lab and tests",
        }
    );
    Ok(nightly)
}

/// `rustc -vV` as the builds run it ([`crate::rust_tool`]: `toolchain`, else the default).
fn rustc_vv(toolchain: Option<&str>) -> Option<String> {
    output(crate::rust_tool("rustc", toolchain).arg("-vV"))
}

fn report(v: &Verdict) -> Result<()> {
    match v {
        Verdict::Ok(m) => eprintln!("xtask: {m}"),
        Verdict::Warn(m) => eprintln!("xtask: warning: {m}"),
        Verdict::Error(m) => bail!("{m}"),
    }
    Ok(())
}

fn stable(pins: &Pins) -> Result<()> {
    let vv = rustc_vv(None).context("`rustc -vV` did not run: the build needs rustup's stable toolchain as the default")?;
    report(&stable_verdict(pins, &vv))
}

/// The installed toolchains' names (`rustup toolchain list`, without its notes).
fn toolchains() -> Vec<String> {
    output(Command::new("rustup").args(["toolchain", "list"]))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// `name` is toolchain `channel` (`nightly-2026-05-20` names
/// `nightly-2026-05-20-x86_64-unknown-linux-gnu`).
fn is_channel(name: &str, channel: &str) -> bool {
    name == channel || name.strip_prefix(channel).is_some_and(|rest| rest.starts_with('-') && !rest[1..].starts_with(|c: char| c.is_ascii_digit()))
}

/// Runs `cmd`, killing it after `limit` (a download that hangs must not hang the
/// build); the error says only how it ended.
fn run_bounded(cmd: &mut Command, what: &str, limit: Duration) -> Result<()> {
    eprintln!("xtask: {what}");
    let mut child = cmd.spawn().with_context(|| format!("could not start {:?}", cmd.get_program()))?;
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            if !st.success() {
                bail!("{st}");
            }
            return Ok(());
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("no answer within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The nightly to build the XDP program with: the pinned one if installed (or, where
/// `fetch` or nothing else will do, fetched), else the best installed nightly that
/// [`nightly_verdict`] accepts.
fn nightly(pins: &Pins, fetch: bool) -> Result<String> {
    let check = |name: &str, note: &str| match rustc_vv(Some(name)) {
        Some(vv) => nightly_verdict(pins, name, &vv, note),
        None => Verdict::Error(format!("`rustc +{name} -vV` did not run")),
    };
    let installed = toolchains();
    if let Some(t) = installed.iter().find(|t| is_channel(t, &pins.nightly)) {
        let v = check(t, "");
        report(&v)?;
        return Ok(t.clone());
    }
    let others: Vec<&String> = installed.iter().filter(|t| t.starts_with("nightly")).collect();
    let usable = others.iter().any(|t| check(t, "").rank() < 2);
    let note = if fetch || !usable {
        let mut c = Command::new("rustup");
        // Its error, without a backtrace of rustup's own.
        c.args(["toolchain", "install", &pins.nightly, "--profile", "minimal", "--component", "rust-src"])
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE");
        match run_bounded(
            &mut c,
            &format!("installing the pinned {} with rust-src ({})", pins.nightly, install_nightly_command(pins)),
            Duration::from_secs(600),
        ) {
            Ok(()) => {
                if let Some(t) = toolchains().into_iter().find(|t| is_channel(t, &pins.nightly)) {
                    report(&check(&t, ""))?;
                    return Ok(t);
                }
                "not listed by rustup after its installation".to_owned()
            }
            Err(e) => format!("not installed and cannot be fetched (rustup: {e:#})"),
        }
    } else {
        "not installed (this command does not fetch it while another nightly will do; `cargo xtask setup` does, where rustup can)".to_owned()
    };
    // The plain `nightly` channel first, then dated ones.
    let mut verdicts: Vec<(&String, Verdict)> = others.iter().map(|t| (*t, check(t, &note))).collect();
    verdicts.sort_by_key(|(t, v)| (v.rank(), !is_channel(t, "nightly")));
    match verdicts.first() {
        Some((t, v)) if v.rank() < 2 => {
            report(v)?;
            Ok((*t).clone())
        }
        Some(_) => bail!("{}", verdicts.iter().map(|(_, v)| v.message()).collect::<Vec<_>>().join("\n")),
        None => bail!(
            "pinned {} (LLVM {}) {note}, and no other nightly toolchain is installed: the XDP build needs one (`{}`)",
            pins.nightly,
            pins.llvm_major,
            install_nightly_command(pins)
        ),
    }
}

fn apt_packages(group: &str, packages: &[(&str, &str)], setup_command: &str) -> Result<()> {
    let missing: Vec<&str> = packages.iter().filter(|(bin, _)| !have(bin)).map(|(_, pkg)| *pkg).collect();
    if missing.is_empty() {
        eprintln!("xtask: {group} Debian packages present ({})", packages.iter().map(|p| p.1).collect::<Vec<_>>().join(", "));
        return Ok(());
    }
    if !is_root() {
        bail!("missing {group} Debian packages {missing:?}: run `{setup_command}` as root or `apt-get install {}`", missing.join(" "));
    }
    run(Command::new("apt-get").args(["update", "-qq"]), "apt-get update")?;
    let daemons: Vec<&str> = DAEMONS.iter().filter(|(pkg, _)| missing.contains(pkg)).map(|(_, unit)| *unit).collect();
    // While installing, no package's service starts: invoke-rc.d and
    // deb-systemd-invoke ask /usr/sbin/policy-rc.d, and 101 is "not allowed".
    let policy = NoServiceStarts::new()?;
    let installed = run(
        Command::new("apt-get").args(["install", "-y", "-qq", "--no-install-recommends"]).args(&missing).env("DEBIAN_FRONTEND", "noninteractive"),
        &format!("installing {group} Debian packages {} (no service started)", missing.join(" ")),
    );
    drop(policy);
    installed?;
    // Under systemd the packages also enabled their services (for the next boot).
    if Path::new("/run/systemd/system").is_dir() {
        for unit in daemons {
            match Command::new("systemctl").args(["disable", "--now", &format!("{unit}.service")]).status() {
                Ok(st) if st.success() => eprintln!("xtask: {unit}.service disabled and stopped (the tests do not use it)"),
                other => eprintln!("xtask: warning: `systemctl disable --now {unit}.service`: {other:?}"),
            }
        }
    }
    Ok(())
}

const POLICY_RC_D: &str = "/usr/sbin/policy-rc.d";

/// A `/usr/sbin/policy-rc.d` that denies every service start, for as long as this
/// lives; an existing policy is left as it is (this machine's own).
struct NoServiceStarts {
    created: bool,
}

impl NoServiceStarts {
    fn new() -> Result<Self> {
        use std::os::unix::fs::PermissionsExt as _;
        if Path::new(POLICY_RC_D).exists() {
            return Ok(Self { created: false });
        }
        std::fs::write(POLICY_RC_D, "#!/bin/sh\n# Written by `cargo xtask setup` while it installs packages: no service starts.\nexit 101\n")
            .with_context(|| format!("writing {POLICY_RC_D}"))?;
        std::fs::set_permissions(POLICY_RC_D, std::fs::Permissions::from_mode(0o755))?;
        Ok(Self { created: true })
    }
}

impl Drop for NoServiceStarts {
    fn drop(&mut self) {
        if self.created {
            if let Err(e) = std::fs::remove_file(POLICY_RC_D) {
                eprintln!("xtask: warning: removing {POLICY_RC_D}: {e}");
            }
        }
    }
}

fn rust_src(nightly: &str) -> Result<()> {
    let installed = output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", nightly])).unwrap_or_default();
    if installed.lines().any(|l| l.starts_with("rust-src")) {
        eprintln!("xtask: rust-src present for {nightly}");
        return Ok(());
    }
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", nightly]), &format!("adding rust-src to {nightly}"))
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

/// bpf-linker, loading `nightly`'s libLLVM as the XDP build runs it (rustup puts
/// the toolchain's lib/ on the library path); built against it when missing or
/// when it cannot load that library.
fn bpf_linker(pins: &Pins, nightly: &str) -> Result<()> {
    let present = have("bpf-linker");
    if present {
        if let Some(v) = output(Command::new("rustup").args(["run", nightly, "bpf-linker", "--version"])) {
            let v = v.trim();
            if v.split_whitespace().nth(1) == Some(pins.bpf_linker.as_str()) {
                eprintln!("xtask: {v} present (loads {nightly}'s LLVM)");
            } else {
                eprintln!("xtask: warning: {v} present (loads {nightly}'s LLVM); pinned bpf-linker {}, continuing", pins.bpf_linker);
            }
            return Ok(());
        }
        eprintln!("xtask: bpf-linker is installed but does not run with {nightly}'s LLVM: building it again");
    }
    let major = pins.llvm_major;
    let sysroot =
        output(Command::new("rustc").arg(format!("+{nightly}")).args(["--print", "sysroot"])).with_context(|| format!("rustc +{nightly} --print sysroot"))?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let llvm = std::fs::read_dir(&lib)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("libLLVM.so.{major}"))))
        .with_context(|| format!("no libLLVM.so.{major}* in {}: bpf-linker must be built against the nightly's own LLVM {major}", lib.display()))?;
    let prefix = std::env::temp_dir().join("vip-llvm-prefix");
    std::fs::create_dir_all(prefix.join("lib"))?;
    let link = prefix.join("lib/libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&llvm, &link)?;
    let mut c = crate::cargo(Some(nightly));
    c.args(["install", "bpf-linker", "--locked", "--version", &pins.bpf_linker, "--no-default-features", "--features", &format!("llvm-{major}")]);
    if present {
        c.arg("--force");
    }
    run(c.env("LLVM_PREFIX", &prefix), &format!("building bpf-linker {} against {nightly}'s LLVM {major} (a few minutes)", pins.bpf_linker))
}

fn bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    if mounts.lines().any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf") && l.split_whitespace().nth(2) == Some("bpf")) {
        eprintln!("xtask: bpffs mounted at /sys/fs/bpf");
        return Ok(());
    }
    if !is_root() {
        eprintln!("xtask: bpffs not mounted and not root: the BPF tests need `mount -t bpf bpf /sys/fs/bpf`");
        return Ok(());
    }
    run(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]), "mounting bpffs at /sys/fs/bpf")
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pins() -> Pins {
        Pins { stable: "1.95.0".into(), nightly: "nightly-2026-05-20".into(), nightly_commit: "e50aa6fba".into(), llvm_major: 22, bpf_linker: "0.13.0".into() }
    }

    fn vv(release: &str, hash: &str, date: &str, llvm: Option<&str>) -> String {
        let mut s = format!(
            "rustc {release} ({} {date})\nbinary: rustc\ncommit-hash: {hash}\ncommit-date: {date}\nhost: x86_64-unknown-linux-gnu\nrelease: {release}\n",
            &hash[..9]
        );
        if let Some(l) = llvm {
            s += &format!("LLVM version: {l}\n");
        }
        s
    }

    const PINNED_HASH: &str = "e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a";
    const OTHER_HASH: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn the_pin_file_parses() {
        let p = Pins::load().unwrap();
        assert!(p.nightly.starts_with("nightly-20"), "{p:?}");
        assert!(release_numbers(&p.stable).is_some(), "{p:?}");
        assert!(p.nightly_commit.len() >= 7, "{p:?}");
        assert!(p.bpf_linker.split('.').count() == 3, "{p:?}");
        assert_eq!(Pins::parse("stable = \"1\"\n").unwrap_err().to_string(), "no `nightly`");
        assert!(Pins::parse("stable = 1.95\n").is_err());
        let extra = format!("{PIN_FILE}\nchannel = \"x\"\n");
        assert_eq!(Pins::parse(&extra).unwrap_err().to_string(), "unknown key `channel`");
    }

    #[test]
    fn the_pinned_nightly_is_ok() {
        let v = nightly_verdict(&pins(), "nightly-2026-05-20-x86_64-unknown-linux-gnu", &vv("1.97.0-nightly", PINNED_HASH, "2026-05-19", Some("22.1.4")), "");
        assert_eq!(v, Verdict::Ok("nightly-2026-05-20-x86_64-unknown-linux-gnu: 1.97.0-nightly (e50aa6fba 2026-05-19, LLVM 22.1.4), as pinned".into()));
        // The same build installed as the plain `nightly` channel.
        let v = nightly_verdict(&pins(), "nightly", &vv("1.97.0-nightly", PINNED_HASH, "2026-05-19", Some("22.1.4")), "not installed and cannot be fetched");
        assert_eq!(
            v,
            Verdict::Ok(
                "pinned nightly-2026-05-20 (LLVM 22) not installed and cannot be fetched; installed nightly: 1.97.0-nightly (e50aa6fba 2026-05-19, LLVM 22.1.4): the pinned build under another name, continuing"
                    .into()
            )
        );
    }

    #[test]
    fn another_nightly_with_the_same_llvm_major_warns() {
        let v = nightly_verdict(&pins(), "nightly", &vv("1.98.0-nightly", OTHER_HASH, "2026-06-02", Some("22.1.6")), "not installed and cannot be fetched");
        assert_eq!(
            v,
            Verdict::Warn(
                "pinned nightly-2026-05-20 (LLVM 22) not installed and cannot be fetched; installed nightly: 1.98.0-nightly (012345678 2026-06-02, LLVM 22.1.6): not the pinned build (commit e50aa6fba), same LLVM major, continuing"
                    .into()
            )
        );
    }

    #[test]
    fn another_llvm_major_or_no_nightly_is_an_error() {
        let Verdict::Error(m) = nightly_verdict(&pins(), "nightly", &vv("1.99.0-nightly", OTHER_HASH, "2026-08-01", Some("23.0.0")), "not installed") else {
            panic!("LLVM 23 accepted")
        };
        assert!(
            m.starts_with(
                "pinned nightly-2026-05-20 (LLVM 22) not installed; installed nightly: 1.99.0-nightly (012345678 2026-08-01, LLVM 23.0.0): LLVM 23, not 22:"
            ),
            "{m}"
        );
        assert!(m.ends_with("`rustup toolchain install nightly-2026-05-20 --profile minimal --component rust-src`"), "{m}");
        assert!(
            matches!(nightly_verdict(&pins(), "nightly", &vv("1.97.0-nightly", PINNED_HASH, "2026-05-19", None), "x"), Verdict::Error(m) if m.contains("no LLVM version"))
        );
        assert!(
            matches!(nightly_verdict(&pins(), "stable", &vv("1.95.0", OTHER_HASH, "2026-04-14", Some("22.1.2")), "x"), Verdict::Error(m) if m.contains("not a nightly"))
        );
        assert!(matches!(nightly_verdict(&pins(), "nightly", "error: toolchain not installed", "x"), Verdict::Error(_)));
    }

    #[test]
    fn stable_releases_compare() {
        let p = pins();
        assert_eq!(
            stable_verdict(&p, &vv("1.95.0", OTHER_HASH, "2026-04-14", Some("22.1.2"))),
            Verdict::Ok("stable 1.95.0 (012345678 2026-04-14, LLVM 22.1.2), as pinned".into())
        );
        assert_eq!(
            stable_verdict(&p, &vv("1.96.1", OTHER_HASH, "2026-06-01", Some("22.1.5"))),
            Verdict::Warn("pinned stable 1.95.0; the default toolchain is 1.96.1 (012345678 2026-06-01, LLVM 22.1.5): newer, continuing".into())
        );
        assert!(
            matches!(stable_verdict(&p, &vv("1.97.0-nightly", OTHER_HASH, "2026-05-19", Some("22.1.4"))), Verdict::Warn(m) if m.contains("not a stable release"))
        );
        let Verdict::Error(m) = stable_verdict(&p, &vv("1.94.1", OTHER_HASH, "2026-03-01", Some("21.1.0"))) else { panic!("older stable accepted") };
        assert!(m.ends_with("`rustup toolchain install 1.95.0 && rustup default 1.95.0`"), "{m}");
        assert!(matches!(stable_verdict(&p, ""), Verdict::Error(_)));
    }

    #[test]
    fn channels_are_told_apart() {
        assert!(is_channel("nightly-2026-05-20-x86_64-unknown-linux-gnu", "nightly-2026-05-20"));
        assert!(is_channel("nightly-2026-05-20", "nightly-2026-05-20"));
        assert!(is_channel("nightly-x86_64-unknown-linux-gnu", "nightly"));
        assert!(!is_channel("nightly-2026-05-20-x86_64-unknown-linux-gnu", "nightly"));
        assert!(!is_channel("nightly-2026-05-21-x86_64-unknown-linux-gnu", "nightly-2026-05-20"));
    }
}
