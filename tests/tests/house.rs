//! The house stays built (docs/design.md#the-house): in the product's `src/` (not the tests,
//! not the examples, not `#[cfg(test)]` modules) no function is over 60 lines, no two files of
//! a crate import each other round a circle, and no block of six or more lines is repeated.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use syn::visit::Visit;

/// The product's crates.
const CRATES: [&str; 9] = [
    "core", "store", "broker", "client", "shared", "beat", "ops", "worker", "cli",
];
/// The longest a function may be, from `fn` to its closing brace.
const LONGEST_FN: usize = 60;
/// The shortest block that counts as repeated.
const BLOCK: usize = 6;

/// One source file of a crate's library: its module path and syntax tree.
struct File {
    path: PathBuf,
    module: Vec<String>,
    text: String,
    ast: syn::File,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_owned()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("read a source folder") {
        let path = entry.expect("a folder entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/a/b.rs` and `src/a/b/mod.rs` are module `a::b`; `lib.rs` and `main.rs` the root.
fn module_of(src: &Path, path: &Path) -> Vec<String> {
    let rel = path.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// Every `.rs` file under the crate's `src/`, binaries (`main.rs`, `src/bin/`) included.
fn files(krate: &str) -> Vec<File> {
    let src = root().join(krate).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths);
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = fs::read_to_string(&path).expect("read a source file");
            let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let module = module_of(&src, &path);
            File {
                path,
                module,
                text,
                ast,
            }
        })
        .collect()
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

/// Functions over [`LONGEST_FN`] lines, and the line ranges of `#[cfg(test)]` modules.
#[derive(Default)]
struct Walk {
    long: Vec<(String, usize)>,
    tests: Vec<(usize, usize)>,
    paths: Vec<Vec<String>>,
}

impl Walk {
    fn function(&mut self, name: &syn::Ident, body: &syn::Block, start: usize) {
        use syn::spanned::Spanned;
        let lines = body.span().end().line + 1 - start;
        if lines > LONGEST_FN {
            self.long.push((name.to_string(), lines));
        }
    }
}

fn start_line(sig: &syn::Signature) -> usize {
    use syn::spanned::Spanned;
    sig.span().start().line
}

impl<'ast> Visit<'ast> for Walk {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        use syn::spanned::Spanned;
        if is_cfg_test(&m.attrs) {
            self.tests
                .push((m.span().start().line, m.span().end().line));
            return;
        }
        syn::visit::visit_item_mod(self, m);
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        self.function(&f.sig.ident, &f.block, start_line(&f.sig));
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        self.function(&f.sig.ident, &f.block, start_line(&f.sig));
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        if let Some(body) = &f.default {
            self.function(&f.sig.ident, body, start_line(&f.sig));
        }
        syn::visit::visit_trait_item_fn(self, f);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        let names = p.segments.iter().map(|s| s.ident.to_string()).collect();
        self.paths.push(names);
        syn::visit::visit_path(self, p);
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        use_paths(&u.tree, &mut Vec::new(), &mut self.paths);
    }
}

/// Every path a `use` tree names, its group members and renames resolved.
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => out.push([&prefix[..], &[n.ident.to_string()]].concat()),
        syn::UseTree::Rename(r) => out.push([&prefix[..], &[r.ident.to_string()]].concat()),
        syn::UseTree::Glob(_) => out.push(prefix.clone()),
        syn::UseTree::Group(g) => g.items.iter().for_each(|t| use_paths(t, prefix, out)),
    }
}

fn walk(file: &File) -> Walk {
    let mut w = Walk::default();
    w.visit_file(&file.ast);
    w
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn no_function_in_src_is_over_sixty_lines() {
    let root = root();
    let mut long = Vec::new();
    for krate in CRATES {
        for file in files(krate) {
            for (name, lines) in walk(&file).long {
                long.push(format!("{}: {name} {lines}", relative(&root, &file.path)));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {LONGEST_FN} lines:\n{}",
        long.join("\n")
    );
}

/// The module a path names, resolved from `module` (`crate::`, `super::`, `self::`, or a
/// child module's name), as far as files go: the longest prefix that is a file's module.
fn target(
    module: &[String],
    path: &[String],
    known: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let mut abs: Vec<String> = module.to_vec();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            abs.clear();
            rest = &path[1..];
        }
        Some("self") => rest = &path[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                abs.pop()?;
                rest = &rest[1..];
            }
        }
        Some(first) => {
            let child = [module, &[first.to_owned()]].concat();
            if !known.contains(&child) {
                return None;
            }
        }
        None => return None,
    }
    abs.extend(rest.iter().cloned());
    (0..=abs.len())
        .rev()
        .map(|n| abs[..n].to_vec())
        .find(|m| known.contains(m))
}

/// The circles of the file import graph of one crate's library, each as its files.
fn circles(krate: &str) -> Vec<Vec<String>> {
    let root = root();
    let lib: Vec<File> = files(krate)
        .into_iter()
        .filter(|f| !f.path.ends_with("main.rs") && !f.path.iter().any(|p| p == "bin"))
        .collect();
    let known: BTreeSet<Vec<String>> = lib.iter().map(|f| f.module.clone()).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for file in &lib {
        let to = edges.entry(file.module.clone()).or_default();
        for path in walk(file).paths {
            if let Some(t) = target(&file.module, &path, &known) {
                if t != file.module && !file.module.starts_with(&t) {
                    to.insert(t);
                }
            }
        }
    }
    let name = |m: &Vec<String>| {
        let file = lib.iter().find(|f| &f.module == m).expect("a file");
        relative(&root, &file.path)
    };
    strongly_connected(&edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| c.iter().map(name).collect())
        .collect()
}

/// Tarjan's strongly connected components.
fn strongly_connected<N: Ord + Clone>(edges: &BTreeMap<N, BTreeSet<N>>) -> Vec<Vec<N>> {
    struct State<N> {
        index: HashMap<usize, (usize, usize)>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<N>>,
    }
    fn visit<N: Ord + Clone>(v: usize, nodes: &[N], adj: &[Vec<usize>], s: &mut State<N>) {
        s.index.insert(v, (s.next, s.next));
        s.next += 1;
        s.stack.push(v);
        for &w in &adj[v] {
            if !s.index.contains_key(&w) {
                visit(w, nodes, adj, s);
                let low = s.index[&w].1.min(s.index[&v].1);
                s.index.get_mut(&v).expect("visited").1 = low;
            } else if s.stack.contains(&w) {
                let low = s.index[&w].0.min(s.index[&v].1);
                s.index.get_mut(&v).expect("visited").1 = low;
            }
        }
        if s.index[&v].0 == s.index[&v].1 {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                component.push(nodes[w].clone());
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let nodes: Vec<N> = edges.keys().cloned().collect();
    let at = |n: &N| nodes.iter().position(|m| m == n);
    let adj: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| edges[n].iter().filter_map(at).collect())
        .collect();
    let mut s = State {
        index: HashMap::new(),
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..nodes.len() {
        if !s.index.contains_key(&v) {
            visit(v, &nodes, &adj, &mut s);
        }
    }
    s.out
}

#[test]
fn no_two_files_of_a_crate_import_each_other_round_a_circle() {
    let found: Vec<String> = CRATES
        .iter()
        .flat_map(|k| circles(k))
        .map(|c| c.join(" -> "))
        .collect();
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The lines of `file` a repeated block may be made of: outside `#[cfg(test)]` modules, not
/// blank, not comments, trimmed; each with its line number.
fn code_lines(file: &File) -> Vec<(usize, String)> {
    let tests = walk(file).tests;
    file.text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(n, _)| !tests.iter().any(|(a, b)| a <= n && n <= b))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with("//"))
        .map(|(n, l)| (n, l.to_owned()))
        .collect()
}

/// A block of [`BLOCK`] lines counts when it says something: at least 120 characters that
/// are not punctuation or whitespace.
fn says_something(block: &[(usize, String)]) -> bool {
    let chars: usize = block
        .iter()
        .map(|(_, l)| l.chars().filter(|c| c.is_alphanumeric()).count())
        .sum();
    chars >= 120
}

#[test]
fn no_block_of_six_lines_is_repeated_in_src() {
    let root = root();
    let mut seen: HashMap<Vec<String>, String> = HashMap::new();
    let mut repeated = Vec::new();
    for krate in CRATES {
        for file in files(krate) {
            let lines = code_lines(&file);
            let mut last_hit: Option<usize> = None;
            for (i, block) in lines.windows(BLOCK).enumerate() {
                if !says_something(block) {
                    continue;
                }
                let text: Vec<String> = block.iter().map(|(_, l)| l.clone()).collect();
                let here = format!("{}:{}", relative(&root, &file.path), block[0].0);
                match seen.get(&text) {
                    // One report per run of overlapping windows.
                    Some(first) if last_hit.is_none_or(|h| h + BLOCK <= i) => {
                        repeated.push(format!("{here} repeats {first}"));
                        last_hit = Some(i);
                    }
                    Some(_) => {}
                    None => {
                        seen.insert(text, here);
                    }
                }
            }
        }
    }
    assert!(
        repeated.is_empty(),
        "blocks of {BLOCK} lines repeated:\n{}",
        repeated.join("\n")
    );
}

/// The names in the `[dependencies]` table of `krate`'s manifest.
fn dependencies(krate: &str) -> BTreeSet<String> {
    let manifest = fs::read_to_string(root().join(krate).join("Cargo.toml")).expect("a manifest");
    manifest
        .lines()
        .skip_while(|l| l.trim() != "[dependencies]")
        .skip(1)
        .take_while(|l| !l.starts_with('['))
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['.', ' ', '=']).next().map(str::to_owned))
        .collect()
}

/// Each crate reaches only its role's outside world: the core none (no async runtime either),
/// Redis only the store, RabbitMQ only the broker (docs/design.md#module-map).
#[test]
fn each_crate_depends_only_on_its_roles_outside_world() {
    let may = |krate: &str, dep: &str| match dep {
        "redis" => krate == "store",
        "lapin" => matches!(krate, "broker"),
        "tokio" | "async-rs" => krate != "core",
        _ => true,
    };
    let mut wrong = Vec::new();
    for krate in CRATES {
        for dep in dependencies(krate) {
            if !may(krate, &dep) {
                wrong.push(format!("{krate} depends on {dep}"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The producer client builds without the config parser, the time zones, an HTTP server,
/// Redis or the OpenTelemetry exporter (docs/design.md#module-map): what `cargo` resolves for
/// it alone.
#[test]
fn the_producer_client_pulls_in_no_config_parser_time_zones_server_or_redis() {
    let out = std::process::Command::new("cargo")
        .args(["tree", "--offline", "-p", "drumline-client", "-e", "normal"])
        .args(["--prefix", "none", "--format", "{p}"])
        .current_dir(root())
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let names: BTreeSet<&str> = tree.lines().filter_map(|l| l.split(' ').next()).collect();
    assert!(names.contains("drumline-core"), "{tree}");
    let unwanted = [
        "toml",
        "chrono-tz",
        "axum",
        "redis",
        "clap",
        "opentelemetry",
    ];
    for unwanted in unwanted {
        assert!(!names.contains(unwanted), "the client pulls in {unwanted}");
    }
}
