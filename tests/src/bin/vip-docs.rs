//! Writes the generated references (docs/reference/) from the code: what
//! `cargo xtask docs` runs. tests/tests/docs.rs fails when they are out of date.
fn main() -> anyhow::Result<()> {
    let root = vip_tests::docs::repo_root();
    let written = vip_tests::docs::write_references(&root)?;
    for p in &written {
        println!("wrote {p}");
    }
    if written.is_empty() {
        println!("docs/reference/ is up to date");
    }
    Ok(())
}
