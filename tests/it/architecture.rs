//! The module rules of docs/ARCHITECTURE.md, checked on the source: no import cycle among
//! `src/` modules, plumbing imports no domain module, `config` (how a section is read) is a
//! leaf, no section and no plumbing imports the assembled file (`settings`), and only `main`
//! and `cli` import the wiring (`app`). A module's own submodules may use what it declares
//! (the `super::` and `crate::parent::` of a child are not a cycle); every other edge counts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Modules that are plumbing: they may import each other, nothing else.
const PLUMBING: &[&str] = &["body", "rt", "listen", "tls", "metrics", "config"];

/// How a section is read (errors, values): a leaf below every section.
const LEAF: &str = "config";

/// The assembler: it imports every subsystem's section, so nothing it imports may import
/// it back: no section reader (a subsystem's `config` module) and no plumbing.
const ASSEMBLER: &str = "settings";

/// The wiring, and who may import it.
const WIRING: &str = "app";
const WIRING_USERS: &[&str] = &["main", "cli"];

struct Modules {
    /// Module path ("" for the crate root) to its file.
    files: BTreeMap<String, PathBuf>,
}

impl Modules {
    fn read(src: &Path) -> Modules {
        let mut files = BTreeMap::new();
        let mut stack = vec![src.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).expect("read src") {
                let path = entry.expect("dir entry").path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                    continue;
                }
                let rel = path
                    .strip_prefix(src)
                    .expect("under src")
                    .with_extension("");
                let mut parts: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if parts.last().map(String::as_str) == Some("mod") {
                    parts.pop();
                }
                if parts == ["lib"] {
                    parts.clear();
                }
                files.insert(parts.join("::"), path);
            }
        }
        Modules { files }
    }

    /// The deepest module a path names (`a::b::Item` → `a::b` when that is a module).
    fn resolve(&self, path: &[&str]) -> Option<String> {
        (1..=path.len())
            .rev()
            .map(|n| path[..n].join("::"))
            .find(|m| self.files.contains_key(m))
    }

    /// Each module's imports of other modules, outside its tests.
    fn edges(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut edges = BTreeMap::new();
        for (module, file) in &self.files {
            let text = std::fs::read_to_string(file).expect("read module");
            let code = strip(&text);
            let own: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
            let dir_module = file.ends_with("mod.rs") || file.ends_with("lib.rs");
            // What `super` names: the parent of this module.
            let parent = &own[..own.len().saturating_sub(1)];
            let mut out = BTreeSet::new();
            for path in paths(&code, "crate::") {
                if let Some(m) = self.resolve(&path) {
                    out.insert(m);
                }
            }
            for path in paths(&code, "super::") {
                let mut full: Vec<&str> = parent.to_vec();
                full.extend(path);
                if let Some(m) = self.resolve(&full) {
                    out.insert(m);
                }
            }
            if dir_module {
                // A folder module's uses of its children (`mod conn; use conn::X`).
                for child in self.files.keys() {
                    let Some(rest) = child
                        .strip_prefix(module.as_str())
                        .map(|r| r.trim_start_matches("::"))
                    else {
                        continue;
                    };
                    if rest.is_empty() || rest.contains("::") || !module_child(module, child) {
                        continue;
                    }
                    if code.contains(&format!("{rest}::")) {
                        out.insert(child.clone());
                    }
                }
            }
            out.remove(module);
            // A child's use of an ancestor is structure, not an import cycle.
            out.retain(|m| !is_ancestor(m, module));
            edges.insert(module.clone(), out);
        }
        edges
    }
}

fn module_child(parent: &str, child: &str) -> bool {
    if parent.is_empty() {
        !child.is_empty()
    } else {
        child.starts_with(&format!("{parent}::"))
    }
}

fn is_ancestor(a: &str, of: &str) -> bool {
    a.is_empty() || of.starts_with(&format!("{a}::"))
}

/// Source without comments and without its `#[cfg(test)] mod tests`.
fn strip(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path after `prefix` (`crate::a::b`, and each item of `crate::{a, b::c}`).
fn paths<'a>(code: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                out.push(segments(item.trim()));
            }
        } else {
            out.push(segments(rest));
        }
    }
    out
}

fn segments(s: &str) -> Vec<&str> {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(s.len());
    s[..end].split("::").filter(|p| !p.is_empty()).collect()
}

fn modules() -> (Modules, BTreeMap<String, BTreeSet<String>>) {
    let modules = Modules::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let edges = modules.edges();
    (modules, edges)
}

/// The strongly connected components with more than one module (Tarjan).
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        let edges = s.edges;
        for w in edges.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.found
}

fn in_set(module: &str, set: &[&str]) -> bool {
    set.iter()
        .any(|p| module == *p || module.starts_with(&format!("{p}::")))
}

#[test]
fn no_import_cycle_among_src_modules() {
    let (modules, edges) = modules();
    assert!(modules.files.len() > 20, "found {:?}", modules.files.keys());
    let found = cycles(&edges);
    let shown: Vec<String> = found
        .iter()
        .map(|c| {
            let arrows: Vec<String> = c
                .iter()
                .map(|m| {
                    let to: Vec<&String> = edges[m].iter().filter(|t| c.contains(t)).collect();
                    format!("{m} -> {to:?}")
                })
                .collect();
            arrows.join("; ")
        })
        .collect();
    assert!(found.is_empty(), "import cycles: {shown:#?}");
}

#[test]
fn plumbing_imports_no_domain_module() {
    let (_, edges) = modules();
    let mut wrong = Vec::new();
    for (module, to) in &edges {
        if !in_set(module, PLUMBING) {
            continue;
        }
        for t in to {
            if !in_set(t, PLUMBING) {
                wrong.push(format!("{module} -> {t}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "plumbing importing domain modules: {wrong:?}"
    );
}

#[test]
fn config_imports_nothing_of_the_domain() {
    let (modules, edges) = modules();
    assert!(modules.files.contains_key("config::error"));
    let wrong: Vec<String> = edges
        .iter()
        .filter(|(m, _)| in_set(m, &[LEAF]))
        .flat_map(|(m, to)| {
            to.iter()
                .filter(|t| !in_set(t, &[LEAF]))
                .map(move |t| format!("{m} -> {t}"))
        })
        .collect();
    assert!(wrong.is_empty(), "`{LEAF}` importing the crate: {wrong:?}");
}

#[test]
fn no_section_and_no_plumbing_imports_the_assembler() {
    let (_, edges) = modules();
    assert!(edges["app"].contains(ASSEMBLER), "{:?}", edges["app"]);
    let section = |m: &str| m.ends_with("::config") || m == "access_log";
    let wrong: Vec<String> = edges
        .iter()
        .filter(|(m, to)| {
            (section(m) || in_set(m, PLUMBING)) && to.iter().any(|t| in_set(t, &[ASSEMBLER]))
        })
        .map(|(m, _)| m.clone())
        .collect();
    assert!(wrong.is_empty(), "importing `{ASSEMBLER}`: {wrong:?}");
}

#[test]
fn only_main_and_cli_import_the_wiring() {
    let (_, edges) = modules();
    let wrong: Vec<String> = edges
        .iter()
        .filter(|(m, to)| {
            to.iter().any(|t| in_set(t, &[WIRING]))
                && !in_set(m, WIRING_USERS)
                && !in_set(m, &[WIRING])
        })
        .map(|(m, _)| m.clone())
        .collect();
    assert!(wrong.is_empty(), "modules importing `{WIRING}`: {wrong:?}");
}

#[test]
fn the_checker_sees_a_cycle_and_a_plumbing_edge() {
    // The checks above would pass on a checker that sees no edge at all.
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    edges.insert("a".into(), ["b".to_string()].into());
    edges.insert("b".into(), ["a".to_string()].into());
    edges.insert("c".into(), BTreeSet::new());
    assert_eq!(cycles(&edges), vec![vec!["a".to_string(), "b".to_string()]]);
    let (_, real) = modules();
    assert!(real["app"].contains("listen"), "{:?}", real["app"]);
    assert!(real["listen::h1_scan"].contains("listen::conn"));
    assert_eq!(
        paths("use crate::{a::b, c};", "crate::"),
        vec![vec!["a", "b"], vec!["c"]]
    );
}
