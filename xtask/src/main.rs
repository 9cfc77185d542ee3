//! Project tasks: `cargo xtask setup | build-ebpf | image | previous-release | test | bench | lab | docs`.
mod image;
mod release;
mod setup;

use std::{path::PathBuf, process::Command};

use anyhow::{bail, Context as _, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building needs (idempotent, each step skipped when done):
    /// the toolchains checked against toolchains.toml (the pinned nightly
    /// installed where rustup can fetch it), rust-src for the nightly, bpf-linker
    /// against the nightly's LLVM, and gcc. The build commands run this themselves.
    Setup {
        /// Also what the lab runs: bpftool, iproute2, iputils-arping, iputils-ping,
        /// tcpdump, ethtool, and a bpffs at /sys/fs/bpf.
        #[arg(long)]
        lab: bool,
        /// Also (with --lab's) what only the test suite uses: containerd, runc, the
        /// CNI plugins, nftables, iptables, podman, promtool (Debian's prometheus,
        /// no service left running), rustfmt and clippy. `cargo xtask test` runs this.
        #[arg(long)]
        tests: bool,
    },
    /// The build setup, then the XDP object (release, with BTF) with the nightly toolchain.
    BuildEbpf,
    /// The build setup, build-ebpf and the release binaries, then the OCI image
    /// archives `vip-agent.oci.tar` (localhost/vip-agent:VERSION) and
    /// `vip-testpod.oci.tar` (localhost/vip-testpod:1), for `ctr images import` or
    /// `podman load`, and the agent image's files as a directory,
    /// `vip-agent.rootfs`, from which `deploy/Containerfile` builds the same image
    /// (the command is printed).
    Image {
        /// Where the archives and the directory go [default: target/images in the workspace].
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// setup --tests + build-ebpf + previous-release + lint (rustfmt, clippy -D warnings) + the images
    /// (`image`) + the whole test suite with XDP in generic mode, then the lab
    /// tests again in native mode (BPF and netns tests need root).
    Test {
        /// Extra arguments for `cargo test` (after `--`).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// setup --tests + build-ebpf + benchmarks; results go to bench-results/ and are
    /// summarised for BENCHMARKS.md.
    Bench,
    /// setup --lab + build-ebpf + the lab in network namespaces (three nodes running the
    /// agent, a client): `up`, `status`, `down`, or `demo` (up, spread, an owner
    /// killed with the measured failover, down).
    Lab {
        #[arg(default_value = "demo")]
        action: String,
    },
    /// The build setup, then the previous release's agent (the last release in
    /// releases.toml) built from its commit, for the upgrade and rollback test:
    /// target/releases/previous/vip-agent. `cargo xtask test` runs this.
    PreviousRelease,
    /// Regenerate the references in docs/reference/ from the code: the command
    /// line (clap), the VipPool fields (CRD schema), the metrics (registry), the
    /// data path's reasons (vip-common); and deploy/monitoring/prometheusrule.yaml
    /// from the alert rule file. `cargo xtask test` fails when they differ.
    Docs,
}

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_owned()
}

/// Runs `cmd`, failing with its description when it does not succeed.
pub fn run(cmd: &mut Command, what: &str) -> Result<()> {
    eprintln!("xtask: {what}");
    let st = cmd.status().with_context(|| format!("{what}: could not start {:?}", cmd.get_program()))?;
    if !st.success() {
        bail!("{what} failed ({st})");
    }
    Ok(())
}

/// `cargo` for the stable userspace build (`toolchain` None: the default
/// toolchain), or with `+toolchain`; see [`rust_tool`].
pub fn cargo(toolchain: Option<&str>) -> Command {
    rust_tool("cargo", toolchain)
}

/// `bin` (cargo, rustc) of `toolchain` (else the default), in the workspace root,
/// without the variables `cargo run` gave this process (they would pin the wrong
/// toolchain or target dir).
pub fn rust_tool(bin: &str, toolchain: Option<&str>) -> Command {
    let mut c = Command::new(bin);
    if let Some(t) = toolchain {
        c.arg(format!("+{t}"));
    }
    for v in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
    ] {
        c.env_remove(v);
    }
    c.current_dir(root());
    c
}

/// The test binaries that attach XDP to lab interfaces (directly or through the
/// agent's `--mode`): after the whole suite, run in generic mode, they run again
/// with `VIP_XDP_MODE=native`, the mode real NICs get (tests/src/lab.rs), all but
/// their tests in [`NATIVE_SKIP`]. Left out entirely: `ha_membership` and
/// `k8s_shapes`, which check decisions (who holds a VIP through membership
/// changes; readiness and addresses per cluster shape) that are the same code in
/// both modes; ARP and NDP answers, forwarding and failover in native mode are
/// checked by the binaries here.
const NATIVE_PASS: [&str; 9] = ["netns_e2e", "agent_e2e", "announce_e2e", "networks_e2e", "ha_e2e", "scale_e2e", "k8s_e2e", "pmtu_e2e", "routed_e2e"];

/// Tests of the [`NATIVE_PASS`] binaries the native pass leaves out, with why:
/// what they check does not depend on how the program is attached.
const NATIVE_SKIP: [(&str, &str, &str); 8] = [
    ("ha_e2e", "a_killed_agents_node_stays_a_backend_while_it_serves_and_a_cut_one_leaves", "who stays in the rings when an agent is silent"),
    ("ha_e2e", "forged_and_replayed_heartbeats_change_nothing_and_keys_rotate_without_a_move", "heartbeat authentication: UDP through the stack"),
    ("ha_e2e", "a_lower_hold_time_applies_to_deadlines_and_their_refresh_at_once", "deadlines written to arp_held"),
    ("ha_e2e", "a_restarted_agent_sweeps_services_deleted_while_it_was_down", "the maps' sweep at start"),
    ("ha_e2e", "a_full_ring_map_is_reported_isolated_and_never_stops_failover", "ring-map capacity and its report"),
    ("ha_e2e", "agents_whose_cluster_settings_differ_are_reported_until_they_agree", "settings carried by heartbeats"),
    ("ha_e2e", "a_node_out_of_the_model_or_off_its_address_holds_nothing", "membership of the model"),
    ("ha_e2e", "scale_out_and_back_in_leave_one_answer_per_vip", "ownership through membership changes"),
];

/// What `cargo test` runs in one pass: the whole suite in generic mode, or the
/// [`NATIVE_PASS`] binaries in native mode; `args` go after `--`.
fn test_pass(native: bool, args: &[String]) -> Command {
    let mut c = cargo(None);
    // --workspace in both: the same feature set, so the native pass rebuilds nothing.
    c.args(["test", "--workspace", "--release", "--no-fail-fast"]);
    if native {
        for t in NATIVE_PASS {
            c.args(["--test", t]);
        }
    } else {
        c.args(["--lib", "--bins", "--tests"]);
    }
    c.env("VIP_XDP_MODE", if native { "native" } else { "generic" });
    let skips = NATIVE_SKIP.iter().filter(|_| native).flat_map(|(_, name, _)| ["--skip", name]);
    let after: Vec<&str> = skips.chain(args.iter().map(String::as_str)).collect();
    if !after.is_empty() {
        c.arg("--").args(after);
    }
    c
}

/// Passed, failed and ignored tests, and why each ignored one was not run.
#[derive(Default)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
    /// libtest's `ignore` reason (tests/build.rs) and how many tests gave it.
    not_run: std::collections::BTreeMap<String, u64>,
}

/// The reasons tests/build.rs gives the tests it leaves out for want of
/// Kubernetes binaries; a test ignored for any other reason fails the suite.
const NOT_RUN_FOR_BINARIES: &str = "needs KUBEBUILDER_ASSETS";

/// Runs one `cargo test`, echoing its output, and sums its "test result:" lines.
fn run_counting(c: &mut Command) -> Result<(Counts, std::process::ExitStatus)> {
    use std::io::{BufRead, BufReader};
    let mut child = c.stdout(std::process::Stdio::piped()).spawn().context("starting cargo test")?;
    let mut n = Counts::default();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        if let Some((_, why)) = line.strip_prefix("test ").and_then(|l| l.split_once(" ... ignored")) {
            *n.not_run.entry(why.trim_start_matches(',').trim().to_owned()).or_default() += 1;
        }
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split(['.', ';']) {
                let mut w = part.split_whitespace();
                if let (Some(k), Some(what)) = (w.next().and_then(|k| k.parse::<u64>().ok()), w.next()) {
                    match what {
                        "passed" => n.passed += k,
                        "failed" => n.failed += k,
                        "ignored" => n.ignored += k,
                        _ => {}
                    }
                }
            }
        }
    }
    Ok((n, child.wait()?))
}

/// Runs the test passes (the whole suite with XDP in generic mode, then the
/// lab tests again in native mode) and closes with one line summing both, so the
/// total is the last thing a reader (or CI) sees. A pass that ran no test fails
/// (with a filter in `args` only the whole-suite pass must run one).
fn test_with_summary(args: &[String]) -> Result<()> {
    let passes = [
        (false, "the whole suite, XDP attached in generic mode (VIP_XDP_MODE=generic)"),
        (true, "the lab tests again, XDP attached in native mode (VIP_XDP_MODE=native)"),
    ];
    let mut total = Counts::default();
    let mut problems = Vec::new();
    let mut lines = Vec::new();
    for (k, (native, what)) in passes.iter().enumerate() {
        eprintln!("xtask: test pass {} of {}: {what}", k + 1, passes.len());
        let start = std::time::Instant::now();
        let (n, st) = run_counting(&mut test_pass(*native, args))?;
        let mode = if *native { "native" } else { "generic" };
        lines.push(format!("xtask: {mode} pass: {} passed, {} failed, {} skipped in {:.0} s", n.passed, n.failed, n.ignored, start.elapsed().as_secs_f64()));
        if !st.success() || n.failed > 0 {
            problems.push(format!("the {mode} pass failed ({st})"));
        }
        if n.passed == 0 && (!*native || args.is_empty()) {
            problems.push(format!("the {mode} pass ran no test"));
        }
        total.passed += n.passed;
        total.failed += n.failed;
        total.ignored += n.ignored;
        for (why, k) in n.not_run {
            *total.not_run.entry(why).or_default() += k;
        }
    }
    for l in &lines {
        eprintln!("{l}");
    }
    for (why, k) in &total.not_run {
        eprintln!("xtask: not run: {k} test(s): {}", if why.is_empty() { "ignored without a reason" } else { why });
        if !why.starts_with(NOT_RUN_FOR_BINARIES) {
            problems.push(format!("{k} test(s) ignored for a reason other than missing Kubernetes binaries ({why:?})"));
        }
    }
    println!("tests: {} passed, {} failed, {} skipped", total.passed, total.failed, total.ignored);
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

/// Builds the XDP object with `nightly` (the toolchain [`setup::setup`] chose).
pub fn build_ebpf(nightly: &str) -> Result<()> {
    build_ebpf_in(&root(), nightly)
}

/// [`build_ebpf`] in the workspace at `workspace` (another release's tree).
pub fn build_ebpf_in(workspace: &std::path::Path, nightly: &str) -> Result<()> {
    let mut c = cargo(Some(nightly));
    c.current_dir(workspace.join("vip-ebpf")).args(["build", "--release"]);
    run(&mut c, &format!("building the XDP object (vip-ebpf, {nightly}, bpfel-unknown-none)"))?;
    let obj = workspace.join("vip-ebpf/target/bpfel-unknown-none/release/vip");
    eprintln!("xtask: XDP object at {}", obj.display());
    Ok(())
}

/// Names the real API server and node binaries the Kubernetes tests will run
/// against (`KUBEBUILDER_ASSETS`, `VIP_KUBE_NODE_ASSETS`), or says they are not run.
fn report_api_server() {
    for (var, bin, what) in
        [("KUBEBUILDER_ASSETS", "kube-apiserver", "the real-API-server and real-cluster tests"), ("VIP_KUBE_NODE_ASSETS", "kubelet", "the real-cluster tests")]
    {
        let Some(dir) = std::env::var_os(var) else {
            eprintln!("xtask: {var} is not set: {what} are not run (counted as skipped)");
            continue;
        };
        let bin = PathBuf::from(dir).join(bin);
        match Command::new(&bin).arg("--version").output() {
            Ok(o) => eprintln!("xtask: {what} run {} ({})", String::from_utf8_lossy(&o.stdout).trim(), bin.display()),
            Err(e) => eprintln!("xtask: {var} is set but {} does not run: {e}", bin.display()),
        }
    }
}

/// `cargo fmt --check` (the workspace and the XDP program, width in rustfmt.toml)
/// and clippy with warnings as errors on every target of the workspace.
fn lint() -> Result<()> {
    run(cargo(None).args(["fmt", "--all", "--", "--check"]), "rustfmt --check (run `cargo fmt --all` to fix)")?;
    run(cargo(None).args(["fmt", "--manifest-path", "vip-ebpf/Cargo.toml", "--", "--check"]), "rustfmt --check on vip-ebpf")?;
    run(cargo(None).args(["clippy", "--release", "--workspace", "--all-targets", "--", "-D", "warnings"]), "clippy -D warnings")
}

/// The `vip-agent` binary the end-to-end tests and the lab run as real
/// processes (`cargo test` builds only test harnesses of other packages' bins).
pub fn build_agent() -> Result<()> {
    run(cargo(None).args(["build", "--release", "-p", "vip-agent", "--bin", "vip-agent"]), "build the vip-agent binary")
}

fn main() -> Result<()> {
    use setup::Scope;
    match Cli::parse().cmd {
        Cmd::Setup { lab, tests } => {
            let scope = if tests {
                Scope::Tests
            } else if lab {
                Scope::Lab
            } else {
                Scope::Build
            };
            setup::setup(scope, true).map(drop)
        }
        Cmd::BuildEbpf => build_ebpf(&setup::setup(Scope::Build, false)?),
        Cmd::PreviousRelease => release::build_previous(&setup::setup(Scope::Build, false)?).map(drop),
        Cmd::Image { out } => {
            build_ebpf(&setup::setup(Scope::Build, false)?)?;
            image::image(&out.unwrap_or_else(image::default_dir))
        }
        Cmd::Test { args } => {
            let nightly = setup::setup(Scope::Tests, true)?;
            build_ebpf(&nightly)?;
            release::build_previous(&nightly)?;
            lint()?;
            report_api_server();
            // The images (which build the agent) before the tests: the cluster
            // tests import target/images/*.oci.tar.
            image::image(&image::default_dir())?;
            test_with_summary(&args)
        }
        Cmd::Bench => {
            build_ebpf(&setup::setup(Scope::Tests, true)?)?;
            let mut c = cargo(None);
            c.args(["run", "--release", "-p", "vip-tests", "--bin", "vip-bench", "--"]).arg(root().join("bench-results"));
            run(&mut c, "running the benchmarks")
        }
        Cmd::Docs => {
            let mut c = cargo(None);
            c.args(["run", "--quiet", "--release", "-p", "vip-tests", "--bin", "vip-docs"]);
            run(&mut c, "writing docs/reference/ and the PrometheusRule")
        }
        Cmd::Lab { action } => {
            build_ebpf(&setup::setup(Scope::Lab, false)?)?;
            build_agent()?;
            let mut c = cargo(None);
            c.args(["run", "--quiet", "--release", "-p", "vip-tests", "--bin", "vip-lab", "--"]).arg(action);
            run(&mut c, "running the lab")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every test the native pass skips exists in the binary named, and that
    /// binary is in the pass: a renamed test is not silently run twice or lost.
    #[test]
    fn native_skips_name_tests_of_the_native_pass() {
        for (bin, name, why) in NATIVE_SKIP {
            assert!(NATIVE_PASS.contains(&bin), "{bin} is not in the native pass");
            let src = std::fs::read_to_string(root().join("tests/tests").join(format!("{bin}.rs"))).unwrap();
            assert!(src.contains(&format!("fn {name}()")), "tests/tests/{bin}.rs has no test {name}");
            assert!(!why.is_empty());
        }
    }
}
