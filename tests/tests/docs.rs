//! The documentation: the generated references in docs/reference/ are what the
//! code makes now (else: run `cargo xtask docs`), and every relative link and
//! `#anchor` in README.md, BENCHMARKS.md and docs/**/*.md resolves.
use vip_tests::docs::{broken_links, markdown_files, repo_root, stale_references};

#[test]
fn generated_references_are_up_to_date() {
    let stale = stale_references(&repo_root());
    assert!(stale.is_empty(), "generated references out of date; run `cargo xtask docs` and commit the result:\n{}", stale.join("\n"));
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = repo_root();
    let files = markdown_files(&root).unwrap();
    assert!(files.iter().any(|f| f.ends_with("README.md")) && files.iter().any(|f| f.ends_with("docs/reference/cli.md")), "{files:?}");
    let mut broken = Vec::new();
    for f in &files {
        for b in broken_links(f).unwrap() {
            broken.push(format!("{}: {b}", f.strip_prefix(&root).unwrap_or(f).display()));
        }
    }
    assert!(broken.is_empty(), "{} broken link(s):\n{}", broken.len(), broken.join("\n"));
}

/// The maps table of docs/concepts/data-path.md has a row for every map the agent pins.
#[test]
fn the_maps_table_lists_every_pinned_map() {
    let text = std::fs::read_to_string(repo_root().join("docs/concepts/data-path.md")).unwrap();
    let missing: Vec<&str> = vip_common::map_names::ALL.iter().copied().filter(|m| !text.contains(&format!("\n| `{m}` |"))).collect();
    assert!(missing.is_empty(), "docs/concepts/data-path.md's maps table has no row for {missing:?}");
}
