//! The documentation's checks: the generated references (docs/reference/, from
//! `vip_agent::reference`) are what the code makes now, and every relative link
//! and `#anchor` of the Markdown files resolves.
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use pulldown_cmark::{Event, Parser, Tag, TagEnd};

/// The repository's root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_owned()
}

/// Every generated file, from the repository's root: the references (from the
/// code) and the PrometheusRule (from the alert rule file, [`crate::monitoring`]).
pub fn generated_files(root: &Path) -> Result<Vec<(&'static str, String)>> {
    use crate::monitoring::{prometheus_rule, PROMETHEUS_RULE, RULES};
    let mut files = vip_agent::reference::files();
    let rules = std::fs::read_to_string(root.join(RULES)).with_context(|| format!("reading {RULES}"))?;
    files.push((PROMETHEUS_RULE, prometheus_rule(&rules)?));
    Ok(files)
}

/// Writes every generated file under `root` that differs; returns the paths written.
pub fn write_references(root: &Path) -> Result<Vec<&'static str>> {
    let mut written = Vec::new();
    for (path, text) in generated_files(root)? {
        let full = root.join(path);
        if std::fs::read_to_string(&full).ok().as_deref() == Some(text.as_str()) {
            continue;
        }
        std::fs::create_dir_all(full.parent().expect("a file in a directory"))?;
        std::fs::write(&full, text).with_context(|| format!("writing {}", full.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// The generated files under `root` that differ from what the code (and the
/// rule file) make now, each with its first differing line.
pub fn stale_references(root: &Path) -> Vec<String> {
    let mut stale = Vec::new();
    let files = match generated_files(root) {
        Ok(f) => f,
        Err(e) => return vec![format!("{e:#}")],
    };
    for (path, want) in files {
        match std::fs::read_to_string(root.join(path)) {
            Err(e) => stale.push(format!("{path}: {e}")),
            Ok(have) if have != want => {
                let (n, (h, w)) = have
                    .lines()
                    .chain(std::iter::repeat(""))
                    .zip(want.lines().chain(std::iter::repeat("")))
                    .enumerate()
                    .find(|(_, (h, w))| h != w)
                    .expect("texts differ");
                stale.push(format!("{path}, line {}: committed {h:?}, generated {w:?}", n + 1));
            }
            Ok(_) => {}
        }
    }
    stale
}

/// The Markdown files whose links are checked: README.md, BENCHMARKS.md and docs/**/*.md.
pub fn markdown_files(root: &Path) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let p = e?.path();
            if p.is_dir() {
                walk(&p, out)?;
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
        Ok(())
    }
    let mut files: Vec<PathBuf> = ["README.md", "BENCHMARKS.md"].iter().map(|f| root.join(f)).filter(|p| p.exists()).collect();
    if root.join("docs").is_dir() {
        walk(&root.join("docs"), &mut files)?;
    }
    files.sort();
    Ok(files)
}

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped,
/// spaces made `-`.
pub fn slug(heading: &str) -> String {
    heading.trim().to_lowercase().chars().filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_')).map(|c| if c == ' ' { '-' } else { c }).collect()
}

/// The anchors of a Markdown text's headings, with GitHub's `-1`, `-2` for repeats.
pub fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut heading: Option<String> = None;
    for ev in Parser::new(text) {
        match ev {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                let base = slug(&heading.take().unwrap_or_default());
                let mut s = base.clone();
                let mut n = 0;
                while !out.insert(s.clone()) {
                    n += 1;
                    s = format!("{base}-{n}");
                }
            }
            _ => {}
        }
    }
    out
}

/// The link targets of a Markdown text (links and images), in order.
pub fn links(text: &str) -> Vec<String> {
    Parser::new(text)
        .filter_map(|ev| match ev {
            Event::Start(Tag::Link { dest_url, .. }) | Event::Start(Tag::Image { dest_url, .. }) => Some(dest_url.to_string()),
            _ => None,
        })
        .collect()
}

/// Every relative link of `file` that does not resolve: a missing file or
/// directory, or an anchor no heading of the target makes. External links
/// (a scheme such as https: or mailto:) are not fetched.
pub fn broken_links(file: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let dir = file.parent().expect("a file in a directory");
    let mut broken = Vec::new();
    for link in links(&text) {
        if link.contains("://") || link.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match link.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (link.as_str(), None),
        };
        let target = if path.is_empty() { file.to_owned() } else { dir.join(path) };
        if !target.exists() {
            broken.push(format!("{link}: {} does not exist", target.display()));
            continue;
        }
        if let Some(a) = anchor {
            if target.extension().is_some_and(|x| x == "md") {
                let heads = anchors(&std::fs::read_to_string(&target)?);
                if !heads.contains(a) {
                    broken.push(format!("{link}: no heading of {} has the anchor #{a}", target.display()));
                }
            }
        }
    }
    Ok(broken)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anchors_are_githubs() {
        let a = anchors("# vip\n## Run it on your machines\n## `--iface`: one name\n### FAQ\n### FAQ\n## Interfaces and VLANs (802.1Q)\n");
        let want = ["vip", "run-it-on-your-machines", "--iface-one-name", "faq", "faq-1", "interfaces-and-vlans-8021q"];
        assert_eq!(a, want.iter().map(|s| s.to_string()).collect());
    }

    #[test]
    fn broken_links_are_found_and_external_ones_skipped() {
        let dir = std::env::temp_dir().join(format!("vip-docs-links-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("docs")).unwrap();
        std::fs::write(dir.join("docs/a.md"), "# A\n## Part two\n").unwrap();
        std::fs::write(
            dir.join("README.md"),
            "# Top\nSee [a](docs/a.md), [two](docs/a.md#part-two), [top](#top), [web](https://example.com/x#y),\n\
             [gone](docs/b.md), [bad](docs/a.md#part-three), [self](#nowhere), [dir](docs/).\n\n```\n[not a link](nope.md)\n```\n",
        )
        .unwrap();
        let broken = broken_links(&dir.join("README.md")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(broken.len(), 3, "{broken:?}");
        assert!(broken[0].starts_with("docs/b.md: ") && broken[0].ends_with("does not exist"), "{broken:?}");
        assert!(broken[1].starts_with("docs/a.md#part-three: no heading"), "{broken:?}");
        assert!(broken[2].starts_with("#nowhere: no heading"), "{broken:?}");
    }
}
