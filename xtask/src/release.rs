//! The previous release's agent, built from the commit releases.toml names, for
//! the upgrade and rollback test: `target/releases/previous/vip-agent`, with its
//! version in the `version` file beside it and its commit in `commit`.
use std::{fs, path::PathBuf, process::Command};

use anyhow::{bail, Context as _, Result};

use crate::{build_ebpf_in, cargo, root, run, setup::key_values};

const RELEASES: &str = include_str!("../../releases.toml");

/// The last release releases.toml lists: (version, commit).
fn previous() -> Result<(String, String)> {
    key_values(RELEASES).context("releases.toml")?.pop().context("releases.toml lists no release")
}

fn git(args: &[&str]) -> Command {
    let mut c = Command::new("git");
    c.arg("-C").arg(root()).args(args);
    c
}

/// Makes `commit` available: a shallow clone is deepened first.
fn ensure_commit(version: &str, commit: &str) -> Result<()> {
    let have = || git(&["cat-file", "-e", &format!("{commit}^{{commit}}")]).status().is_ok_and(|s| s.success());
    if have() {
        return Ok(());
    }
    let shallow = git(&["rev-parse", "--is-shallow-repository"]).output().map(|o| o.stdout.starts_with(b"true")).unwrap_or(false);
    if shallow {
        run(&mut git(&["fetch", "--quiet", "--unshallow"]), &format!("fetching the history of this shallow clone (release {version} is commit {commit})"))?;
    }
    if !have() {
        bail!("release {version}'s commit {commit} (releases.toml) is not in this repository; a clone with its history has it");
    }
    Ok(())
}

/// Builds the previous release's agent (its XDP object with `nightly`) from its
/// commit, unless the one built last is of that commit; returns its path.
pub fn build_previous(nightly: &str) -> Result<PathBuf> {
    let (version, commit) = previous()?;
    let out = root().join("target/releases/previous");
    let bin = out.join("vip-agent");
    if bin.is_file() && fs::read_to_string(out.join("commit")).is_ok_and(|c| c.trim() == commit) {
        eprintln!("xtask: the previous release's agent ({version}, {commit}) is built: {}", bin.display());
        return Ok(bin);
    }
    ensure_commit(&version, &commit)?;
    // The release's tree, without a checkout: it builds in a target dir of its
    // own, so that nothing of it mixes with this build's artifacts.
    let src = out.join("src");
    if src.exists() {
        fs::remove_dir_all(&src).with_context(|| format!("removing {}", src.display()))?;
    }
    fs::create_dir_all(&src)?;
    let tar = out.join("src.tar");
    run(git(&["archive", "--format=tar", "-o"]).arg(&tar).arg(&commit), &format!("exporting release {version} ({commit})"))?;
    run(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(&src), "unpacking it")?;
    fs::remove_file(&tar)?;
    build_ebpf_in(&src, nightly)?;
    let mut c = cargo(None);
    c.current_dir(&src).args(["build", "--release", "-p", "vip-agent", "--bin", "vip-agent", "--target-dir"]).arg(out.join("target"));
    run(c.env("VIP_GIT_REVISION", &commit), &format!("building release {version}'s agent"))?;
    fs::copy(out.join("target/release/vip-agent"), &bin)?;
    fs::write(out.join("version"), format!("{version}\n"))?;
    fs::write(out.join("commit"), format!("{commit}\n"))?;
    fs::remove_dir_all(&src)?;
    eprintln!("xtask: the previous release's agent ({version}, {commit}): {}", bin.display());
    Ok(bin)
}
