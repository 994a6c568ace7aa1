//! The layering check: every `crate::…` (and `super::…` that leaves its module) path in
//! `kproxy/src` is an edge from the layer of the file to the layer it names, and every edge must
//! be allowed by the table in ARCHITECTURE.md (between `<!-- layering:begin -->` and
//! `<!-- layering:end -->`), so the document and the code cannot drift apart. A second check
//! finds cycles between layers in the edges that exist.
//!
//! Layers are the top modules (`model`, `source`, …) except `dataplane`, whose root (the trait
//! and its vocabulary), the face trait (`dataplane::face`), each mode (`dataplane::ebpf`,
//! `dataplane::iptables`, …) and each mode's face (`dataplane::ebpf::face`, …) are layers of
//! their own, so "observe imports `dataplane` but no datapath" and "app knows a mode only
//! through its face" can be said. A face may import only its own mode (checked apart from the
//! table). Comments are not code: doc links do not count.
//!
//! A third check looks inside the ebpf mode: its sub-modules (`object`, `layout`, `loader`,
//! `service_maps`, `socket_lb`, `node_path`, …) must not import each other in a loop, so the
//! mode stays a stack (object/pins core, then service maps and socket LB, then the datapath).

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
        ["dataplane", child, "face", ..] if !is_dataplane_root_file(child) => {
            Some(format!("dataplane::{child}::face"))
        }
        ["dataplane", child, ..] if !is_dataplane_root_file(child) => {
            Some(format!("dataplane::{child}"))
        }
        [top, ..] => Some((*top).to_string()),
    }
}

/// Modules directly under `dataplane` that belong to its root layer rather than being a
/// datapath of their own (`face`, the face trait, is a layer of its own: it reads `config`).
fn is_dataplane_root_file(name: &str) -> bool {
    matches!(name, "inspect" | "per_family" | "settings")
        || name.chars().next().is_some_and(|c| c.is_uppercase())
}

/// The table row a layer falls under: its own, else `dataplane::*::face` for a mode's face,
/// `dataplane::*` for a mode.
fn row_key(layer: &str) -> String {
    match layer.split("::").collect::<Vec<_>>().as_slice() {
        ["dataplane", "face"] => layer.to_string(),
        ["dataplane", _, "face"] => "dataplane::*::face".into(),
        ["dataplane", _] => "dataplane::*".into(),
        _ => layer.to_string(),
    }
}

/// The mode a `dataplane::<mode>` or `dataplane::<mode>::face` layer belongs to.
fn mode_of(layer: &str) -> Option<&str> {
    match layer.split("::").collect::<Vec<_>>().as_slice() {
        ["dataplane", "face"] | ["dataplane", "netfilter", ..] => None,
        ["dataplane", m] | ["dataplane", m, "face"] => Some(m),
        _ => None,
    }
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
    for (line_no, code) in joined_uses(code_lines(text)) {
        let code = code.as_str();
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
            for path in expand_group(&code[start + "crate::".len()..]) {
                out.push((line_no, path));
            }
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
            for tail in expand_group(rest) {
                let mut path = current[..current.len() - up].to_vec();
                path.extend(tail);
                out.push((line_no, path));
            }
        }
        let t = code.trim_start();
        let t = t.strip_prefix("pub ").unwrap_or(t);
        if let Some(name) = t.strip_prefix("mod ").and_then(|r| r.strip_suffix(" {")) {
            inline.push((indent, name.trim().to_string()));
        }
    }
    out
}

/// The code lines with every `use …;` that spans lines joined into one (at its first line's
/// number), so a brace group's items are seen with their path.
fn joined_uses<'a>(lines: impl Iterator<Item = (usize, &'a str)>) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut open = false;
    for (n, code) in lines {
        if open {
            let last = out.last_mut().expect("an open use has a line");
            last.1.push(' ');
            last.1.push_str(code.trim());
            open = !code.contains(';');
            continue;
        }
        let t = code.trim_start();
        let t = t.strip_prefix("pub ").unwrap_or(t);
        open = t.starts_with("use ") && !code.contains(';');
        out.push((n, code.to_string()));
    }
    out
}

/// The paths a path text names: `a::b::X` → `[a, b, X]`; `a::{b, c::{d, e}}` → `[a, b]`,
/// `[a, c, d]`, `[a, c, e]` (`self` in a group is the group's own path).
fn expand_group(s: &str) -> Vec<Vec<String>> {
    let head = path_segments(s);
    let consumed: usize = head.iter().map(|h| h.len() + 2).sum();
    let rest = s.get(consumed..).unwrap_or("");
    let Some(inner) = rest.strip_prefix('{') else {
        return vec![head];
    };
    let mut depth = 0;
    let mut items = vec![];
    let mut item_start = 0;
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&inner[item_start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&inner[item_start..i]);
                item_start = i + 1;
            }
            _ => {}
        }
    }
    let mut out = vec![];
    for item in items.iter().map(|i| i.trim()).filter(|i| !i.is_empty()) {
        for tail in expand_group(item) {
            let mut p = head.clone();
            p.extend(tail.into_iter().filter(|seg| seg != "self"));
            out.push(p);
        }
    }
    if out.is_empty() { vec![head] } else { out }
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
/// table stands for every datapath layer, `dataplane::*::face` for every mode's face; a face
/// may import no mode but its own.
fn allowed(table: &Allowed, from: &str, to: &str) -> bool {
    if from == to {
        return true;
    }
    if from.ends_with("::face")
        && let (Some(a), Some(b)) = (mode_of(from), mode_of(to))
        && a != b
    {
        return false;
    }
    let Some(row) = table.get(from).or_else(|| table.get(&row_key(from))) else {
        return false;
    };
    row.contains("*") || row.contains(to) || row.contains(&row_key(to))
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

/// Edges between the ebpf mode's sub-modules (`loader` → `service_maps`, …).
fn ebpf_edges(files: &[(PathBuf, String)]) -> BTreeSet<(String, String)> {
    let child = |path: &[String]| -> Option<String> {
        match path {
            [d, e, c, ..] if d == "dataplane" && e == "ebpf" => Some(c.clone()),
            _ => None,
        }
    };
    let mut out = BTreeSet::new();
    for (rel, text) in files {
        let module = module_of(rel);
        let Some(from) = child(&module) else { continue };
        for (_, path) in referenced_paths(&module, text) {
            if let Some(to) = child(&path)
                && to != from
            {
                out.insert((from.clone(), to));
            }
        }
    }
    out
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

    /// `(from, to)` of every forbidden edge in `files`.
    fn bad_edges(files: &[(PathBuf, String)], table: &Allowed) -> Vec<(String, String)> {
        violations(files, table)
            .into_iter()
            .map(|v| (v.from, v.to))
            .collect()
    }

    /// The ebpf mode's sub-modules (`dataplane::ebpf::<child>`) import each other without a
    /// loop.
    #[test]
    fn no_cycle_inside_the_ebpf_mode() {
        let found = ebpf_edges(&crate_files());
        assert!(found.len() >= 5, "suspiciously few edges: {found:?}");
        assert_eq!(cycle(&found), None, "edges: {found:?}");
    }

    /// A face that reaches into another mode, and an `app` that reaches past a face into a
    /// mode, are caught; a face into its own mode and `app` into a face are not.
    #[test]
    fn faces_are_the_only_way_into_a_mode() {
        let table = parse_allowed(
            "<!-- layering:begin -->\n| layer | may import |\n|---|---|\n| `model` | — |\n\
             | `config` | `model` |\n| `dataplane` | `model` |\n\
             | `dataplane::*` | `model`, `dataplane` |\n\
             | `dataplane::*::face` | `model`, `dataplane`, `dataplane::*`, `config` |\n\
             | `app` | `model`, `config`, `dataplane`, `dataplane::*::face` |\n<!-- layering:end -->",
        );
        let files = vec![
            (
                PathBuf::from("dataplane/ipvs/face.rs"),
                "use crate::dataplane::ipvs::genl::X;\nuse crate::dataplane::iptables::exec::Y;\n\
                 use crate::config::ProxyConfig;\n"
                    .to_string(),
            ),
            (
                PathBuf::from("app/registry.rs"),
                "fn f() { crate::dataplane::ipvs::face::Face; }\n\
                 use crate::dataplane::ipvs::genl::Z;\n"
                    .to_string(),
            ),
        ];
        let bad = bad_edges(&files, &table);
        assert_eq!(
            bad,
            vec![
                ("app".to_string(), "dataplane::ipvs".to_string()),
                (
                    "dataplane::ipvs::face".to_string(),
                    "dataplane::iptables".to_string()
                ),
            ]
        );
        let loops = vec![
            (
                PathBuf::from("dataplane/ebpf/loader.rs"),
                "use crate::dataplane::ebpf::service_maps::X;\n".to_string(),
            ),
            (
                PathBuf::from("dataplane/ebpf/service_maps/apply.rs"),
                "use super::super::loader::Y;\n".to_string(),
            ),
        ];
        assert_eq!(
            cycle(&ebpf_edges(&loops)),
            Some(vec!["loader".to_string(), "service_maps".to_string()])
        );
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
            (
                PathBuf::from("sync.rs"),
                "use crate::{\n    model::Snapshot,\n    dataplane::{Dataplane, ipvs::X},\n};\n"
                    .to_string(),
            ),
        ];
        let bad = bad_edges(&files, &table);
        assert_eq!(
            bad,
            vec![
                ("dataplane::ebpf".to_string(), "observe".to_string()),
                ("model".to_string(), "source".to_string()),
                ("observe".to_string(), "dataplane::iptables".to_string()),
                ("sync".to_string(), "dataplane".to_string()),
                ("sync".to_string(), "dataplane::ipvs".to_string()),
                ("sync".to_string(), "model".to_string()),
            ]
        );
        let found: BTreeSet<(String, String)> = edges(&files).into_keys().collect();
        assert_eq!(
            cycle(&found),
            Some(vec!["model".to_string(), "source".to_string()])
        );
    }
}
