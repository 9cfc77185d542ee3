//! Copies the XDP object built by `cargo xtask build-ebpf` into OUT_DIR so that
//! `dataplane::object` can embed it with `include_bytes_aligned!`, and names the
//! git revision the agent is built from (`vip_build_info`).
use std::{env, fs, path::PathBuf, process::Command};

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("..");
    let object = root.join("vip-ebpf/target/bpfel-unknown-none/release/vip");
    println!("cargo:rerun-if-changed={}", object.display());
    if !object.exists() {
        anyhow::bail!(
            "the XDP object {} is missing: build it first with `cargo xtask build-ebpf` \
             (which installs what the build needs on a fresh machine)",
            object.display()
        );
    }
    fs::copy(&object, PathBuf::from(env::var("OUT_DIR")?).join("vip.bpf.o"))?;
    revision(&root);
    Ok(())
}

/// `VIP_GIT_REVISION` when the build is given one (an image built without the
/// repository), else git's HEAD if this is a checkout; rebuilt when HEAD moves.
fn revision(root: &std::path::Path) {
    println!("cargo:rerun-if-env-changed=VIP_GIT_REVISION");
    if env::var_os("VIP_GIT_REVISION").is_some() {
        return;
    }
    let git = |args: &[&str]| -> Option<String> {
        let o = Command::new("git").arg("-C").arg(root).args(args).output().ok()?;
        o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let Some(rev) = git(&["rev-parse", "--short=12", "HEAD"]) else { return };
    // HEAD, and the branch it points to (loose or packed), say when it moves.
    for path in ["HEAD", "packed-refs"].into_iter().map(str::to_owned).chain(git(&["symbolic-ref", "-q", "HEAD"])) {
        // Only files that exist: a missing one would rerun this script on every build.
        if let Some(p) = git(&["rev-parse", "--path-format=absolute", "--git-path", &path]).filter(|p| std::path::Path::new(p).exists()) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    println!("cargo:rustc-env=VIP_GIT_REVISION={rev}");
}
