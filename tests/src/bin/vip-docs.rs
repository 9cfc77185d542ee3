//! Writes the generated files (docs/reference/ from the code, the PrometheusRule
//! from the alert rule file): what `cargo xtask docs` runs. tests/tests/docs.rs
//! fails when they are out of date.
fn main() -> anyhow::Result<()> {
    let root = vip_tests::docs::repo_root();
    let written = vip_tests::docs::write_references(&root)?;
    for p in &written {
        println!("wrote {p}");
    }
    if written.is_empty() {
        println!("the generated files are up to date");
    }
    Ok(())
}
