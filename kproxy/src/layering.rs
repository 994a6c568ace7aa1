//! The layering check: every `crate::…` (and `super::…` that leaves its module) path in
//! `kproxy/src` is an edge from the layer of the file to the layer it names, and every edge must
//! be allowed by the table in ARCHITECTURE.md (between `<!-- layering:begin -->` and
//! `<!-- layering:end -->`), so the document and the code cannot drift apart. A second check
//! finds cycles between layers in the edges that exist.
//!
//! Layers are the top modules (`model`, `source`, …) except `dataplane`, whose root (the trait
//! and its vocabulary) and each child (`dataplane::ebpf`, `dataplane::iptables`, …) are layers
//! of their own, so "observe imports `dataplane` but no datapath" can be said. Comments are not
//! code: doc links do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `layer → layers it may import`, as ARCHITECTURE.md states it.
type Allowed = BTreeMap<String, BTreeSet<String>>;

/// One forbidden edge, with the first place it occurs.
#[derive(Debug, PartialEq, Eq)]
struct Violation {
    from: String,
    to: String,
    at: String,
}

/// The layer a module path (segments after `crate`) belongs to.
fn layer_of(path: &[&str]) -> Option<String> {
    match path {
        [] => None,
        ["dataplane", child, ..] if !is_dataplane_root_file(child) => {
            Some(format!("dataplane::{child}"))
        }
        [top, ..] => Some((*top).to_string()),
    }
}

/// Modules directly under `dataplane` that belong to its root layer rather than being a
/// datapath of their own.
fn is_dataplane_root_file(name: &str) -> bool {
    name == "with_conntrack" || name.chars().next().is_some_and(|c| c.is_uppercase())
}

/// The module path of a file under `src/` (`dataplane/ebpf/mod.rs` → `[dataplane, ebpf]`).
fn module_of(rel: &Path) -> Vec<String> {
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

/// Code without comments (line comments and doc comments; block comments are not used here).
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().map(|(n, line)| {
        let code = match line.find("//") {
            // A `//` inside a string literal would cut too much; no path follows one here.
            Some(i) => &line[..i],
            None => line,
        };
        (n + 1, code)
    })
}

/// Every module path a file names: `crate::a::b` as is, `super::…` resolved against the
/// file's module (inline `mod name {` blocks, tracked by indentation, count as a level).
fn referenced_paths(file_module: &[String], text: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    let mut inline: Vec<(usize, String)> = Vec::new();
    for (line_no, code) in code_lines(text) {
        let indent = code.len() - code.trim_start().len();
        if let Some((open_indent, _)) = inline.last()
            && code.trim() == "}"
            && indent == *open_indent
        {
            inline.pop();
            continue;
        }
        let mut current: Vec<String> = file_module.to_vec();
        current.extend(inline.iter().map(|(_, n)| n.clone()));
        for (start, _) in code.match_indices("crate::") {
            if start > 0 && is_ident_char(code.as_bytes()[start - 1]) {
                continue;
            }
            out.push((line_no, path_segments(&code[start + "crate::".len()..])));
        }
        for (start, _) in code.match_indices("super::") {
            if start > 0
                && (is_ident_char(code.as_bytes()[start - 1]) || code[..start].ends_with("::"))
            {
                continue;
            }
            let mut rest = &code[start..];
            let mut up = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                up += 1;
                rest = r;
            }
            if up > current.len() {
                continue;
            }
            let mut path = current[..current.len() - up].to_vec();
            path.extend(path_segments(rest));
            out.push((line_no, path));
        }
        let t = code.trim_start();
        let t = t.strip_prefix("pub ").unwrap_or(t);
        if let Some(name) = t.strip_prefix("mod ").and_then(|r| r.strip_suffix(" {")) {
            inline.push((indent, name.trim().to_string()));
        }
    }
    out
}

fn is_ident_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// `a::b::{c, d}` → `[a, b]`: the leading identifiers of a path.
fn path_segments(s: &str) -> Vec<String> {
    let mut segs = Vec::new();
    for seg in s.split("::") {
        let ident: String = seg
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            break;
        }
        let whole = ident.len() == seg.len();
        segs.push(ident);
        if !whole {
            break;
        }
    }
    segs
}

/// The allowed table from ARCHITECTURE.md: rows `| `layer` | `a`, `b` |` (`—` for none).
fn parse_allowed(doc: &str) -> Allowed {
    let start = doc
        .find("<!-- layering:begin -->")
        .expect("layering:begin marker");
    let end = doc
        .find("<!-- layering:end -->")
        .expect("layering:end marker");
    let mut table = Allowed::new();
    for row in doc[start..end].lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let names = |cell: &str| -> BTreeSet<String> {
            cell.split(',')
                .filter_map(|c| {
                    let c = c.trim();
                    (c.starts_with('`') && c.ends_with('`') && c.len() > 2)
                        .then(|| c.trim_matches('`').to_string())
                })
                .collect()
        };
        for layer in names(cells[1]) {
            table.insert(layer, names(cells[2]));
        }
    }
    table
}

/// Whether `to` is allowed from `from`. A layer may always import itself; `dataplane::*` in the
/// table stands for every datapath layer.
fn allowed(table: &Allowed, from: &str, to: &str) -> bool {
    if from == to {
        return true;
    }
    let Some(row) = table.get(from).or_else(|| {
        from.starts_with("dataplane::")
            .then(|| table.get("dataplane::*"))
            .flatten()
    }) else {
        return false;
    };
    row.contains("*")
        || row.contains(to)
        || (to.starts_with("dataplane::") && row.contains("dataplane::*"))
}

/// Every layer edge in the given files (`(relative path, text)`), with one place each occurs.
fn edges(files: &[(PathBuf, String)]) -> BTreeMap<(String, String), String> {
    let mut out = BTreeMap::new();
    for (rel, text) in files {
        let module = module_of(rel);
        let refs: Vec<&str> = module.iter().map(String::as_str).collect();
        let Some(from) = layer_of(&refs) else {
            continue;
        };
        for (line, path) in referenced_paths(&module, text) {
            let p: Vec<&str> = path.iter().map(String::as_str).collect();
            if let Some(to) = layer_of(&p)
                && to != from
            {
                out.entry((from.clone(), to))
                    .or_insert_with(|| format!("{}:{line}", rel.display()));
            }
        }
    }
    out
}

fn violations(files: &[(PathBuf, String)], table: &Allowed) -> Vec<Violation> {
    edges(files)
        .into_iter()
        .filter(|((from, to), _)| !allowed(table, from, to))
        .map(|((from, to), at)| Violation { from, to, at })
        .collect()
}

/// A cycle among the layers (in the order found), if any.
fn cycle(edges: &BTreeSet<(String, String)>) -> Option<Vec<String>> {
    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges {
        graph.entry(a).or_default().push(b);
    }
    fn visit<'a>(
        n: &'a str,
        graph: &BTreeMap<&'a str, Vec<&'a str>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(i) = stack.iter().position(|s| *s == n) {
            return Some(stack[i..].iter().map(|s| s.to_string()).collect());
        }
        if !done.insert(n) {
            return None;
        }
        stack.push(n);
        for next in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, graph, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, &graph, &mut Vec::new(), &mut done))
}

fn read_tree(dir: &Path, base: &Path, out: &mut Vec<(PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).expect("read src dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            read_tree(&path, base, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(base).expect("under src").to_path_buf();
            out.push((rel, std::fs::read_to_string(&path).expect("read source")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crate_files() -> Vec<(PathBuf, String)> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        read_tree(&src, &src, &mut files);
        // The binary and this checker are not layers.
        files.retain(|(rel, _)| rel != Path::new("main.rs") && rel != Path::new("layering.rs"));
        files
    }

    fn architecture_table() -> Allowed {
        let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ARCHITECTURE.md");
        parse_allowed(&std::fs::read_to_string(doc).expect("ARCHITECTURE.md"))
    }

    #[test]
    fn every_import_follows_the_architecture_table() {
        let table = architecture_table();
        assert!(table.len() >= 9, "layer table too small: {table:?}");
        let files = crate_files();
        assert!(files.len() > 90, "read only {} files", files.len());
        let bad = violations(&files, &table);
        assert!(
            bad.is_empty(),
            "imports ARCHITECTURE.md does not allow:\n{}",
            bad.iter()
                .map(|v| format!("  {} -> {} (first at {})", v.from, v.to, v.at))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    #[test]
    fn no_cycle_between_layers() {
        let found: BTreeSet<(String, String)> = edges(&crate_files()).into_keys().collect();
        assert!(found.len() > 10, "suspiciously few edges: {found:?}");
        assert_eq!(cycle(&found), None);
    }

    #[test]
    fn every_layer_of_the_crate_is_in_the_table() {
        let table = architecture_table();
        let layers: BTreeSet<String> = crate_files()
            .iter()
            .filter_map(|(rel, _)| {
                let m = module_of(rel);
                layer_of(&m.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .collect();
        for l in layers {
            assert!(
                table.contains_key(&l)
                    || (l.starts_with("dataplane::") && table.contains_key("dataplane::*")),
                "layer {l} has no row in ARCHITECTURE.md"
            );
        }
    }

    /// The checker itself catches a forbidden edge, a relative one and a cycle.
    #[test]
    fn the_checker_finds_forbidden_edges_and_cycles() {
        let table = parse_allowed(
            "<!-- layering:begin -->\n| layer | may import |\n|---|---|\n| `model` | — |\n\
             | `source` | `model` |\n| `dataplane` | `model` |\n| `dataplane::*` | `model`, `dataplane` |\n\
             | `observe` | `model`, `dataplane` |\n<!-- layering:end -->",
        );
        let files = vec![
            (
                PathBuf::from("model/tracker.rs"),
                "use crate::source::Event;\n".to_string(),
            ),
            (
                PathBuf::from("source/kube.rs"),
                "use crate::model::Snapshot;\n".to_string(),
            ),
            (
                PathBuf::from("dataplane/ebpf/mod.rs"),
                "// use crate::observe::Metrics; (a comment)\nuse super::super::observe::X;\n"
                    .to_string(),
            ),
            (
                PathBuf::from("observe/metrics.rs"),
                "use crate::dataplane::ProxyMode;\nfn f() { crate::dataplane::iptables::x(); }\n"
                    .to_string(),
            ),
        ];
        let bad: Vec<(String, String)> = violations(&files, &table)
            .into_iter()
            .map(|v| (v.from, v.to))
            .collect();
        assert_eq!(
            bad,
            vec![
                ("dataplane::ebpf".to_string(), "observe".to_string()),
                ("model".to_string(), "source".to_string()),
                ("observe".to_string(), "dataplane::iptables".to_string()),
            ]
        );
        let found: BTreeSet<(String, String)> = edges(&files).into_keys().collect();
        assert_eq!(
            cycle(&found),
            Some(vec!["model".to_string(), "source".to_string()])
        );
    }
}
