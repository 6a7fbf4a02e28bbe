//! The user's documents hold together: every link in the README and `docs/` reaches a file of
//! the repository (and, for `#anchor`, a heading in it), the README stays short enough to
//! finish, and nothing tracked points at a document outside the repository.
//!
//! Pure file reads: no services.

use pulldown_cmark::{Event, Parser, Tag, TagEnd};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the repository")
        .to_path_buf()
}

/// The Markdown files users read: the README and every page in `docs/`, relative to the repo.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![PathBuf::from("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| {
            p.strip_prefix(repo())
                .expect("under the repo")
                .to_path_buf()
        })
        .collect();
    pages.sort();
    docs.extend(pages);
    docs
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens, and
/// `-1`, `-2`… for repeats.
fn anchor(text: &str, seen: &mut BTreeMap<String, usize>) -> String {
    let slug: String = text
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect();
    let n = seen.entry(slug.clone()).or_insert(0);
    let out = if *n == 0 { slug } else { format!("{slug}-{n}") };
    *n += 1;
    out
}

/// One document's headings (as anchors) and link targets.
struct Parsed {
    anchors: BTreeSet<String>,
    links: Vec<String>,
}

fn parse(text: &str) -> Parsed {
    let mut anchors = BTreeSet::new();
    let mut links = Vec::new();
    let mut seen = BTreeMap::new();
    let mut heading: Option<String> = None;
    for event in Parser::new(text) {
        match event {
            Event::Start(Tag::Heading { .. }) => heading = Some(String::new()),
            Event::End(TagEnd::Heading(_)) => {
                if let Some(h) = heading.take() {
                    anchors.insert(anchor(&h, &mut seen));
                }
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                links.push(dest_url.to_string())
            }
            _ => {}
        }
    }
    Parsed { anchors, links }
}

/// `docs/../README.md` → `README.md`, without touching the file system.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn every_link_in_the_readme_and_docs_resolves() {
    let docs = documents();
    let parsed: BTreeMap<PathBuf, Parsed> = docs
        .iter()
        .map(|d| {
            let text = std::fs::read_to_string(repo().join(d)).expect("a document");
            (d.clone(), parse(&text))
        })
        .collect();
    let mut broken = Vec::new();
    let mut checked = 0;
    for (doc, p) in &parsed {
        for link in &p.links {
            if link.starts_with("http://") || link.starts_with("https://") {
                continue;
            }
            checked += 1;
            let (path, fragment) = link.split_once('#').unwrap_or((link, ""));
            let target = if path.is_empty() {
                doc.clone()
            } else {
                normalise(&doc.parent().unwrap_or(Path::new("")).join(path))
            };
            if !repo().join(&target).exists() {
                broken.push(format!(
                    "{}: {link}: no file {}",
                    doc.display(),
                    target.display()
                ));
                continue;
            }
            if fragment.is_empty() {
                continue;
            }
            let anchors = match parsed.get(&target) {
                Some(t) => t.anchors.clone(),
                None => {
                    let text = std::fs::read_to_string(repo().join(&target)).expect("a file");
                    parse(&text).anchors
                }
            };
            if !anchors.contains(fragment) {
                broken.push(format!(
                    "{}: {link}: no heading #{fragment} in {}",
                    doc.display(),
                    target.display()
                ));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    // The documents do link to each other: a parser that found nothing would pass above.
    assert!(checked > 30, "only {checked} local links found in {docs:?}");
}

#[test]
fn the_readme_is_short_enough_to_finish() {
    let text = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let words = text.split_whitespace().count();
    assert!(
        words <= 3_000,
        "README.md has {words} words, more than 3,000"
    );
    for part in ["## The two commands", "## Your own config", "## Guarantees"] {
        assert!(text.contains(part), "README.md lacks {part:?}");
    }
}

/// docs/design.md is the design in our own words, short enough to hold in one's head: at most
/// 5,000 words.
#[test]
fn the_design_stays_within_five_thousand_words() {
    let text = std::fs::read_to_string(repo().join("docs/design.md")).expect("docs/design.md");
    let words = text.split_whitespace().count();
    assert!(
        words <= 5_000,
        "docs/design.md has {words} words, more than 5,000"
    );
}

/// Every file git would track, outside `target/` and `.git/`.
fn tracked(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a directory") {
        let path = entry.expect("an entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if !matches!(name, "target" | ".git") {
                tracked(&path, out);
            }
        } else {
            out.push(path);
        }
    }
}

#[test]
fn nothing_points_at_a_document_outside_the_repository() {
    // Spelled in two halves so this file does not match itself.
    let outside = [
        ["DESIGN", " §"].concat(),
        ["../", "shared/"].concat(),
        ["shared/", "DESIGN.md"].concat(),
    ];
    let mut files = Vec::new();
    tracked(&repo(), &mut files);
    let mut hits = Vec::new();
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue; // not text
        };
        for (n, line) in text.lines().enumerate() {
            if outside.iter().any(|o| line.contains(o.as_str())) {
                hits.push(format!(
                    "{}:{}: {}",
                    file.strip_prefix(repo()).unwrap_or(file).display(),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(files.len() > 100, "only {} files walked", files.len());
    assert!(
        hits.is_empty(),
        "references to documents outside the repository (cite docs/design.md):\n{}",
        hits.join("\n")
    );
}

/// Every `docs/PAGE.md#anchor` cited outside docs/ — in deploy/, scripts/, examples/ and the
/// crates' source — names a heading that exists (a unit file's comment once pointed at
/// `operations.md#systemd`, which no heading made).
#[test]
fn every_docs_anchor_cited_from_code_and_deploy_files_resolves() {
    let mut files = Vec::new();
    for dir in [
        "deploy",
        "scripts",
        "examples",
        "core",
        "store",
        "broker",
        "client",
        "shared",
        "beat",
        "worker",
        "cli",
        "tests/src",
    ] {
        tracked(&repo().join(dir), &mut files);
    }
    let mut anchors: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let (mut broken, mut checked) = (Vec::new(), 0);
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for (at, _) in text.match_indices("docs/") {
            let cited = &text[at + 5..];
            let end = cited
                .find(|c: char| !(c.is_ascii_alphanumeric() || "-_.#".contains(c)))
                .unwrap_or(cited.len());
            let Some((page, anchor)) = cited[..end].trim_end_matches('.').split_once(".md#") else {
                continue;
            };
            let heads = anchors.entry(page.to_owned()).or_insert_with(|| {
                let text = std::fs::read_to_string(repo().join(format!("docs/{page}.md")))
                    .unwrap_or_default();
                parse(&text).anchors
            });
            checked += 1;
            if !heads.contains(anchor) {
                broken.push(format!("{}: docs/{page}.md#{anchor}", file.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "anchors that no heading makes:\n{}",
        broken.join("\n")
    );
    assert!(checked > 30, "only {checked} cited anchors found");
}

/// A table row right after a paragraph line is not part of any table: Markdown shows it as
/// text (operations.md once had a metric row stranded under the paragraph after its table).
#[test]
fn no_table_row_follows_a_paragraph() {
    let mut stranded = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(repo().join(&doc)).expect("a document");
        let (mut fenced, mut before) = (false, "");
        for (n, line) in text.lines().enumerate() {
            fenced ^= line.starts_with("```");
            let paragraph = !before.trim().is_empty() && !before.starts_with('|');
            if !fenced && line.starts_with('|') && paragraph {
                stranded.push(format!("{}:{}: {line}", doc.display(), n + 1));
            }
            before = line;
        }
    }
    assert!(
        stranded.is_empty(),
        "table rows after a paragraph:\n{}",
        stranded.join("\n")
    );
}
