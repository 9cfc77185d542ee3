//! Copies the XDP object built by `cargo xtask build-ebpf` into OUT_DIR so that
//! `dataplane::object` can embed it with `include_bytes_aligned!`.
use std::{env, fs, path::PathBuf};

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("..");
    let object = root.join("vip-ebpf/target/bpfel-unknown-none/release/vip");
    println!("cargo:rerun-if-changed={}", object.display());
    if !object.exists() {
        anyhow::bail!(
            "the XDP object {} is missing: build it first with `cargo xtask build-ebpf` \
             (or `cargo xtask setup` on a fresh machine)",
            object.display()
        );
    }
    fs::copy(&object, PathBuf::from(env::var("OUT_DIR")?).join("vip.bpf.o"))?;
    Ok(())
}
