//! The rules of ARCHITECTURE.md that a program can check, checked by reading the source tree
//! (rust-analyzer's `tidy.rs`): the layer tables of its `## Layers` section against the
//! `use crate::` paths, no import circle among the server's files, SQL only in the store and
//! only through the compile-checked macros, services free of HTTP types, job statuses only
//! through `JobStatus`, no `#[ignore]` or `#[should_panic]`, streams and events created only by
//! the schedule and the backend, and a module doc atop every Rust file.
//!
//! It lives with the server's tests only because `cargo test` runs the default member; it reads
//! the whole workspace, with the standard library alone.
//!
//! Test code: the rules about dependencies, SQL, statuses and streams are about the shipped
//! program, so they skip test code: items under `#[cfg(test)]` (a `mod tests { .. }` block, a
//! test-only `use` or `fn`), every file a `#[cfg(test)] mod name;` brings in (and the files
//! below it), and the integration tests (`tests/` beside a crate's `src/`). The rules about
//! `#[ignore]` and module docs hold everywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Where SQL may be written: `sqlx::query*` appears only in files under this folder.
const SQL_HOME: &str = "server/src/store/";

/// sqlx's unchecked query functions: the store uses their macro forms (`sqlx::query!`), which
/// check each statement against the schema at compile time (through `server/.sqlx` offline).
const UNCHECKED_QUERIES: &[&str] =
    &["sqlx::query(", "sqlx::query_as(", "sqlx::query_scalar(", "sqlx::query_as_with("];

/// Where streams and events may be created: the schedule, and the backends that define them.
const STREAM_HOMES: &[&str] = &["engine/src/schedule/", "engine/src/backend/"];

/// Every job status, as `JobStatus::as_str` spells it and `migrations/0001_initial.sql`'s CHECK
/// lists it.
const JOB_STATUSES: &[&str] =
    &["queued", "running", "completed", "failed", "cancelled", "interrupted"];

/// The crates whose `src/` the layer tables describe: (the `###` heading, the folder).
const CRATES: &[(&str, &str)] = &[("Engine", "engine"), ("Server", "server")];

#[test]
fn layers() {
    let tree = Tree::read();
    let mut problems = Vec::new();
    for (heading, dir) in CRATES {
        check_layers(&tree, heading, dir, &mut problems);
    }
    report("layers", &problems);
}

#[test]
fn no_import_cycle_in_server() {
    let tree = Tree::read();
    let mut problems = Vec::new();
    check_cycles(&tree, "server", &mut problems);
    report("no import cycle", &problems);
}

#[test]
fn sql_only_in_store() {
    let tree = Tree::read();
    let mut problems = Vec::new();
    for file in tree.files.iter().filter(|f| !f.rel.starts_with(SQL_HOME)) {
        for (line, code) in file.shipped_lines(&file.code) {
            let queries = code.contains("sqlx::query")
                || (code.contains("use sqlx::") && code.contains("query"));
            if queries {
                problems.push(format!(
                    "{}:{line}: sqlx::query* outside the store: SQL is written only in files under {SQL_HOME}",
                    file.rel
                ));
            }
        }
    }
    for file in tree.files.iter().filter(|f| f.rel.starts_with(SQL_HOME)) {
        for (line, code) in file.shipped_lines(&file.code) {
            if let Some(unchecked) = UNCHECKED_QUERIES.iter().find(|q| code.contains(**q)) {
                problems.push(format!(
                    "{}:{line}: {unchecked}..) is not checked at compile time: use the macro form ({}..)",
                    file.rel,
                    unchecked.replace('(', "!(")
                ));
            }
        }
    }
    report("SQL only in the store, compile-checked", &problems);
}

/// What only the HTTP layer may speak of: the API's error type and HTTP statuses and replies.
const HTTP_WORDS: &[&str] =
    &["ApiError", "ApiResult", "StatusCode", "IntoResponse", "axum::response", "axum::extract"];

#[test]
fn services_know_no_http() {
    let tree = Tree::read();
    let doc =
        fs::read_to_string(tree.root.join("ARCHITECTURE.md")).expect("reading ARCHITECTURE.md");
    let layers = Layers::parse(&doc, "Server").unwrap_or_else(|e| panic!("tidy: {e}"));
    let services: BTreeSet<&String> = layers
        .rows
        .iter()
        .filter(|(layer, _)| layer == "services")
        .flat_map(|(_, names)| names)
        .collect();
    assert!(!services.is_empty(), "tidy: the server's layer table has no `services` row");
    let mut problems = Vec::new();
    for file in Crate::new(&tree, "server").files(&tree) {
        let top = file.module_path("server").map(|p| p.first().cloned().unwrap_or_default());
        if !top.is_some_and(|t| services.contains(&t)) {
            continue;
        }
        for (line, code) in file.shipped_lines(&file.code) {
            if let Some(word) = HTTP_WORDS.iter().find(|w| code.contains(**w)) {
                problems.push(format!(
                    "{}:{line}: `{word}` in a service: services return their own error types, mapped to HTTP in api/errors.rs",
                    file.rel
                ));
            }
        }
    }
    report("services know no HTTP", &problems);
}

#[test]
fn job_status_only_through_enum() {
    let tree = Tree::read();
    let home: Vec<&File> =
        tree.files.iter().filter(|f| f.code.contains("enum JobStatus")).collect();
    assert_eq!(home.len(), 1, "tidy: exactly one file defines `enum JobStatus`");
    let home = home[0];
    for status in JOB_STATUSES {
        assert!(
            home.text.contains(&format!("\"{status}\"")),
            "tidy: {} does not spell the status \"{status}\"; update JOB_STATUSES in tidy.rs",
            home.rel
        );
    }
    let mut problems = Vec::new();
    for file in tree.files.iter().filter(|f| f.rel != home.rel) {
        for (line, code) in file.shipped_lines(&file.no_comments) {
            for status in JOB_STATUSES {
                if code.contains(&format!("'{status}'")) {
                    problems.push(format!(
                        "{}:{line}: the job status '{status}' spelled as an SQL literal: bind a JobStatus (defined in {})",
                        file.rel, home.rel
                    ));
                }
            }
        }
    }
    report("job statuses only through JobStatus", &problems);
}

#[test]
fn no_ignored_or_panicking_tests() {
    let tree = Tree::read();
    let mut problems = Vec::new();
    for file in &tree.files {
        for (i, code) in file.code.lines().enumerate() {
            for attribute in ["#[ignore", "#[should_panic"] {
                if code.contains(attribute) {
                    problems.push(format!(
                        "{}:{}: {attribute}]: every test runs everywhere, and a test of an error asserts on the Err",
                        file.rel,
                        i + 1
                    ));
                }
            }
        }
    }
    report("no #[ignore], no #[should_panic]", &problems);
}

#[test]
fn streams_and_events_only_in_schedule() {
    let tree = Tree::read();
    let mut problems = Vec::new();
    for file in
        tree.files.iter().filter(|f| !STREAM_HOMES.iter().any(|home| f.rel.starts_with(home)))
    {
        for (line, code) in file.shipped_lines(&file.code) {
            for call in ["new_stream(", "new_event("] {
                if code.contains(call) {
                    problems.push(format!(
                        "{}:{line}: `{call}` called outside {}: only the schedule creates streams and events (the backends define them)",
                        file.rel,
                        STREAM_HOMES.join(" and ")
                    ));
                }
            }
        }
    }
    report("streams and events only in the schedule", &problems);
}

#[test]
fn module_docs() {
    let tree = Tree::read();
    let problems: Vec<String> = tree
        .files
        .iter()
        .filter(|f| !f.text.starts_with("//!"))
        .map(|f| {
            format!(
                "{}:1: no module doc: a Rust file starts with `//!` saying what it holds",
                f.rel
            )
        })
        .collect();
    report("module docs", &problems);
}

fn report(rule: &str, problems: &[String]) {
    assert!(
        problems.is_empty(),
        "tidy rule \"{rule}\", {} violation(s):\n{}\n",
        problems.len(),
        problems.join("\n")
    );
}

// --- the layer tables ------------------------------------------------------------------------

/// A crate's layers as ARCHITECTURE.md lists them: rows top to bottom, each row's modules.
struct Layers {
    rows: Vec<(String, Vec<String>)>,
    /// The table's first line, for messages.
    line: usize,
}

impl Layers {
    /// Reads `### <heading>`'s table under `## Layers`.
    fn parse(doc: &str, heading: &str) -> Result<Layers, String> {
        let lines: Vec<&str> = doc.lines().collect();
        let section = lines
            .iter()
            .position(|l| l.trim_end() == "## Layers")
            .ok_or("ARCHITECTURE.md: no `## Layers` section")?;
        let sub = (section + 1..lines.len())
            .take_while(|&i| !lines[i].starts_with("## "))
            .find(|&i| lines[i].trim_end() == format!("### {heading}"))
            .ok_or(format!("ARCHITECTURE.md: no `### {heading}` under `## Layers`"))?;
        let start = (sub + 1..lines.len())
            .take_while(|&i| !lines[i].starts_with("#"))
            .find(|&i| lines[i].starts_with('|'))
            .ok_or(format!("ARCHITECTURE.md: no table under `### {heading}`"))?;
        let at = |i: usize| format!("ARCHITECTURE.md:{}", i + 1);
        if cells(lines[start]) != ["layer", "modules"] {
            return Err(format!("{}: the table's header must be `| layer | modules |`", at(start)));
        }
        if lines.get(start + 1).map(|l| cells(l))
            != Some(vec!["---".to_string(), "---".to_string()])
        {
            return Err(format!("{}: the header's rule must be `| --- | --- |`", at(start + 1)));
        }
        let mut rows = Vec::new();
        for (i, line) in
            lines.iter().enumerate().skip(start + 2).take_while(|(_, l)| l.starts_with('|'))
        {
            let [layer, modules] = <[String; 2]>::try_from(cells(line))
                .map_err(|_| format!("{}: a row has two cells", at(i)))?;
            let mut names = Vec::new();
            for name in modules.split(',').map(str::trim) {
                let bare = name.strip_prefix('`').and_then(|n| n.strip_suffix('`'));
                match bare {
                    Some(n)
                        if !n.is_empty()
                            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') =>
                    {
                        names.push(n.to_string())
                    }
                    _ => {
                        return Err(format!(
                            "{}: `{name}` is not a module name in backticks",
                            at(i)
                        ));
                    }
                }
            }
            rows.push((layer, names));
        }
        Ok(Layers { rows, line: start + 1 })
    }

    fn row_of(&self, module: &str) -> Option<usize> {
        self.rows.iter().position(|(_, names)| names.iter().any(|n| n == module))
    }
}

fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

fn check_layers(tree: &Tree, heading: &str, dir: &str, problems: &mut Vec<String>) {
    let doc =
        fs::read_to_string(tree.root.join("ARCHITECTURE.md")).expect("reading ARCHITECTURE.md");
    let layers = match Layers::parse(&doc, heading) {
        Ok(layers) => layers,
        Err(e) => return problems.push(e),
    };
    let krate = Crate::new(tree, dir);
    let table = format!("ARCHITECTURE.md:{} (### {heading})", layers.line);
    let mut listed = BTreeMap::new();
    for (layer, names) in &layers.rows {
        for name in names {
            if let Some(other) = listed.insert(name.clone(), layer.clone()) {
                problems.push(format!("{table}: `{name}` is in two rows, `{other}` and `{layer}`"));
            }
            if !krate.modules.contains(name) {
                problems.push(format!("{table}: `{name}` is not a module of {dir}/src (no {dir}/src/{name}.rs or {dir}/src/{name}/)"));
            }
        }
    }
    for module in &krate.modules {
        if !listed.contains_key(module) {
            problems.push(format!("{table}: {dir}/src's module `{module}` is in no row"));
        }
    }
    for file in krate.files(tree) {
        let Some(from) =
            file.module_path(dir).map(|p| p.first().cloned().unwrap_or_else(|| file.root_name()))
        else {
            continue;
        };
        for reference in krate.references(file) {
            let to = krate.top_module(&reference.path);
            if to == from {
                continue;
            }
            let (Some(a), Some(b)) = (layers.row_of(&from), layers.row_of(&to)) else {
                continue;
            };
            if b < a {
                problems.push(format!(
                    "{}:{}: `{from}` (layer `{}`) uses `{to}` (layer `{}`, above it); {table} lets a module use only its own row and the rows below",
                    file.rel, reference.line, layers.rows[a].0, layers.rows[b].0
                ));
            }
        }
    }
}

// --- import cycles -----------------------------------------------------------------------------

fn check_cycles(tree: &Tree, dir: &str, problems: &mut Vec<String>) {
    let krate = Crate::new(tree, dir);
    // file -> (file it uses -> first line that does)
    let mut graph: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for file in krate.files(tree) {
        let edges = graph.entry(file.rel.clone()).or_default();
        for reference in krate.references(file) {
            if let Some(to) = krate.file_of(&reference.path)
                && to != file.rel
            {
                edges.entry(to).or_insert(reference.line);
            }
        }
    }
    for component in strongly_connected(&graph) {
        if component.len() < 2 {
            continue;
        }
        let cycle = cycle_within(&graph, &component);
        let mut path = String::new();
        for pair in cycle.windows(2) {
            path.push_str(&format!("{}:{} -> ", pair[0], graph[&pair[0]][&pair[1]]));
        }
        path.push_str(&cycle[0]);
        problems.push(format!(
            "{}: import cycle: {path} (the circle joins {} files: {})",
            cycle[0],
            component.len(),
            component.join(", ")
        ));
    }
}

/// Tarjan's strongly connected components.
fn strongly_connected(graph: &BTreeMap<String, BTreeMap<String, usize>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<String, BTreeMap<String, usize>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flat_map(|e| e.keys()) {
            if !s.index.contains_key(w.as_str()) {
                visit(s, w);
                let low = s.low[v].min(s.low[w.as_str()]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w.as_str()) {
                let low = s.low[v].min(s.index[w.as_str()]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            component.sort();
            s.components.push(component);
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.components.sort();
    s.components
}

/// A shortest cycle through the component's first file: the files in the order their uses run,
/// the first repeated at the end.
fn cycle_within(
    graph: &BTreeMap<String, BTreeMap<String, usize>>,
    component: &[String],
) -> Vec<String> {
    let start = &component[0];
    let inside: BTreeSet<&String> = component.iter().collect();
    let mut came_from: BTreeMap<&String, &String> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in graph[v].keys().filter(|w| inside.contains(w)) {
            if w == start {
                let mut path = vec![v.clone()];
                let mut at = v;
                while at != start {
                    at = came_from[at];
                    path.push(at.clone());
                }
                path.reverse();
                path.push(start.clone());
                return path;
            }
            if !came_from.contains_key(w) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    vec![start.clone(), start.clone()]
}

// --- the source tree -------------------------------------------------------------------------

/// Every Rust file of the workspace.
struct Tree {
    root: PathBuf,
    files: Vec<File>,
}

struct File {
    /// The path from the workspace root, with `/`.
    rel: String,
    text: String,
    /// The text with comments blanked (newlines kept).
    no_comments: String,
    /// The text with comments and string and character literals blanked.
    code: String,
    /// Per line (0-based), whether it is test code.
    test: Vec<bool>,
}

impl File {
    /// The lines (1-based numbers) of `view` that are not test code.
    fn shipped_lines<'a>(&'a self, view: &'a str) -> impl Iterator<Item = (usize, &'a str)> {
        view.lines()
            .enumerate()
            .filter(|(i, _)| !self.test.get(*i).copied().unwrap_or(true))
            .map(|(i, l)| (i + 1, l))
    }

    /// `lib` or `main` for a crate root.
    fn root_name(&self) -> String {
        self.rel.rsplit('/').next().unwrap_or_default().trim_end_matches(".rs").to_string()
    }

    /// The module path of a file under `<dir>/src/`: `src/a/b.rs` and `src/a/b/mod.rs` are
    /// `[a, b]`, `src/lib.rs` and `src/main.rs` are `[]`.
    fn module_path(&self, dir: &str) -> Option<Vec<String>> {
        let inside = self.rel.strip_prefix(&format!("{dir}/src/"))?.strip_suffix(".rs")?;
        if inside == "lib" || inside == "main" {
            return Some(Vec::new());
        }
        let mut path: Vec<String> = inside.split('/').map(str::to_string).collect();
        if path.last().is_some_and(|l| l == "mod") {
            path.pop();
        }
        Some(path)
    }
}

impl Tree {
    fn read() -> Tree {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root")
            .to_path_buf();
        let mut paths = Vec::new();
        walk(&root, &mut paths);
        paths.sort();
        let mut files: Vec<File> = paths
            .into_iter()
            .map(|path| {
                let text = fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                let rel = path
                    .strip_prefix(&root)
                    .expect("under the root")
                    .to_string_lossy()
                    .replace('\\', "/");
                let (no_comments, code) = blank(&text);
                let test = test_lines(&code);
                File { rel, text, no_comments, code, test }
            })
            .collect();
        mark_test_files(&mut files);
        Tree { root, files }
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with('.') || name == "target" || name == "node_modules" {
            continue;
        }
        if path.is_dir() {
            walk(&path, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// Integration tests (`<crate>/tests/`) are test code, and so is every file a test module
/// brings in: a file whose `mod` declaration in its parent is test code, or whose parent is.
fn mark_test_files(files: &mut [File]) {
    // Parents come before their children in path order once `mod.rs` and `name.rs` are ordered
    // by depth, so walk by depth.
    let mut order: Vec<usize> = (0..files.len()).collect();
    order.sort_by_key(|&i| files[i].rel.matches('/').count());
    for i in order {
        let rel = files[i].rel.clone();
        let Some((dir, _)) = rel.split_once("/src/") else {
            if rel.contains("/tests/") || rel.starts_with("tests/") {
                files[i].test.iter_mut().for_each(|t| *t = true);
            }
            continue;
        };
        let Some(path) = files[i].module_path(dir) else { continue };
        let Some((name, parent)) = path.split_last() else { continue };
        let parent_rel = if parent.is_empty() {
            [format!("{dir}/src/lib.rs"), format!("{dir}/src/main.rs")].to_vec()
        } else {
            let p = parent.join("/");
            [format!("{dir}/src/{p}.rs"), format!("{dir}/src/{p}/mod.rs")].to_vec()
        };
        let declared_in_test = files.iter().filter(|f| parent_rel.contains(&f.rel)).any(|f| {
            let whole_file = f.test.iter().all(|&t| t) && !f.test.is_empty();
            whole_file || f.code.lines().enumerate().any(|(n, l)| f.test[n] && declares(l, name))
        });
        if declared_in_test {
            files[i].test.iter_mut().for_each(|t| *t = true);
        }
    }
}

/// Whether a line declares the file module `name` (`mod name;`, maybe `pub`).
fn declares(line: &str, name: &str) -> bool {
    let want = format!("mod {name};");
    line.split_whitespace().collect::<Vec<_>>().join(" ").contains(&want)
}

/// The text with comments blanked, and with comments and literals blanked (newlines kept, so
/// line numbers hold).
fn blank(text: &str) -> (String, String) {
    let chars: Vec<char> = text.chars().collect();
    let mut no_comments = String::with_capacity(text.len());
    let mut code = String::with_capacity(text.len());
    let blank_char = |c: char| if c == '\n' { '\n' } else { ' ' };
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let (end, keep_in_no_comments) = if c == '/' && next == Some('/') {
            (chars[i..].iter().position(|&c| c == '\n').map_or(chars.len(), |p| i + p), false)
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            let mut j = i;
            while j < chars.len() {
                if chars[j] == '/' && chars.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if chars[j] == '*' && chars.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            (j, false)
        } else if c == '"' {
            let mut j = i + 1;
            while j < chars.len() && chars[j] != '"' {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            ((j + 1).min(chars.len()), true)
        } else if (c == 'r' || (c == 'b' && next == Some('r')))
            && (i == 0 || !ident(chars[i - 1]))
            && {
                let k = if c == 'b' { i + 2 } else { i + 1 };
                let hashes = chars[k..].iter().take_while(|&&c| c == '#').count();
                chars.get(k + hashes) == Some(&'"')
            }
        {
            let k = if c == 'b' { i + 2 } else { i + 1 };
            let hashes = chars[k..].iter().take_while(|&&c| c == '#').count();
            let close: Vec<char> =
                std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            let mut j = k + hashes + 1;
            while j < chars.len() && !chars[j..].starts_with(&close) {
                j += 1;
            }
            ((j + close.len()).min(chars.len()), true)
        } else if c == '\'' && next == Some('\\') {
            let close =
                chars[i + 2..].iter().position(|&c| c == '\'').map_or(chars.len(), |p| i + 3 + p);
            (close, true)
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            (i + 3, true)
        } else {
            no_comments.push(c);
            code.push(c);
            i += 1;
            continue;
        };
        for &c in &chars[i..end] {
            no_comments.push(if keep_in_no_comments { c } else { blank_char(c) });
            code.push(blank_char(c));
        }
        i = end.max(i + 1);
    }
    (no_comments, code)
}

/// Per line, whether it belongs to an item under `#[cfg(test)]`: from the attribute to the
/// item's `;` or the `}` closing its body.
fn test_lines(code: &str) -> Vec<bool> {
    let line_count = code.lines().count();
    let mut test = vec![false; line_count];
    let line_of = |at: usize| code[..at].matches('\n').count();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(found) = code[from..].find("#[cfg(test)]") {
        let start = from + found;
        let mut j = start + "#[cfg(test)]".len();
        let mut depth = 0i32;
        let end = loop {
            match bytes.get(j) {
                None => break code.len(),
                Some(b'(' | b'[') => depth += 1,
                Some(b')' | b']') => depth -= 1,
                Some(b';') if depth == 0 => break j,
                Some(b'{') if depth == 0 => {
                    let mut braces = 0i32;
                    let mut k = j;
                    while k < bytes.len() {
                        match bytes[k] {
                            b'{' => braces += 1,
                            b'}' => {
                                braces -= 1;
                                if braces == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                        k += 1;
                    }
                    break k.min(code.len());
                }
                _ => {}
            }
            j += 1;
        };
        for t in test.iter_mut().take((line_of(end) + 1).min(line_count)).skip(line_of(start)) {
            *t = true;
        }
        from = end.max(start + 1);
    }
    test
}

// --- one crate's modules and references --------------------------------------------------------

struct Crate {
    dir: String,
    /// The top-level modules: `src/NAME.rs` or `src/NAME/`, and `lib` and `main`.
    modules: BTreeSet<String>,
    /// Names the crate root re-exports, and the module each comes from (`AppState` -> `state`).
    reexports: BTreeMap<String, String>,
    /// Every file's module path, for resolving a path to the file that defines it.
    file_paths: BTreeMap<Vec<String>, String>,
}

struct Reference {
    line: usize,
    /// The absolute module path named, from the crate root (`crate::a::b::C` is `[a, b, C]`).
    path: Vec<String>,
}

impl Crate {
    fn new(tree: &Tree, dir: &str) -> Crate {
        let src = tree.root.join(dir).join("src");
        let mut modules = BTreeSet::new();
        for entry in fs::read_dir(&src).unwrap_or_else(|e| panic!("listing {}: {e}", src.display()))
        {
            let path = entry.expect("a directory entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            if path.is_dir() {
                modules.insert(name);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                modules.insert(stem.to_string());
            }
        }
        let mut reexports = BTreeMap::new();
        if let Some(lib) = tree.files.iter().find(|f| f.rel == format!("{dir}/src/lib.rs")) {
            for statement in lib.code.split(';') {
                let Some(used) = statement.trim().strip_prefix("pub use ") else { continue };
                let Some((module, rest)) = used.split_once("::") else { continue };
                for item in rest
                    .trim_matches(|c: char| c == '{' || c == '}' || c.is_whitespace())
                    .split(',')
                {
                    let leaf = item
                        .rsplit(" as ")
                        .next()
                        .unwrap_or(item)
                        .rsplit("::")
                        .next()
                        .unwrap_or(item)
                        .trim();
                    if !leaf.is_empty() {
                        reexports.insert(leaf.to_string(), module.trim().to_string());
                    }
                }
            }
        }
        let mut file_paths = BTreeMap::new();
        for file in &tree.files {
            if let Some(path) = file.module_path(dir)
                && !path.is_empty()
            {
                file_paths.insert(path, file.rel.clone());
            }
        }
        file_paths.insert(Vec::new(), format!("{dir}/src/lib.rs"));
        Crate { dir: dir.to_string(), modules, reexports, file_paths }
    }

    fn files<'a>(&'a self, tree: &'a Tree) -> impl Iterator<Item = &'a File> {
        let prefix = format!("{}/src/", self.dir);
        tree.files.iter().filter(move |f| f.rel.starts_with(&prefix))
    }

    /// The top-level module a path lands in; a name the root defines itself is `lib`.
    fn top_module(&self, path: &[String]) -> String {
        match path.first() {
            Some(first) if self.modules.contains(first) && first != "lib" && first != "main" => {
                first.clone()
            }
            Some(first) => self.reexports.get(first).cloned().unwrap_or_else(|| "lib".to_string()),
            None => "lib".to_string(),
        }
    }

    /// The file that defines what a path names: its longest prefix that is a file module.
    fn file_of(&self, path: &[String]) -> Option<String> {
        let mut path = path.to_vec();
        if let Some(module) = path.first().and_then(|f| self.reexports.get(f)) {
            path = vec![module.clone()];
        }
        (0..=path.len()).rev().find_map(|n| self.file_paths.get(&path[..n]).cloned())
    }

    /// Every `crate::` and `super::` path in a file's shipped code, made absolute.
    fn references(&self, file: &File) -> Vec<Reference> {
        let Some(here) = file.module_path(&self.dir) else { return Vec::new() };
        let mut out = Vec::new();
        for (line, code) in file.shipped_lines(&file.code) {
            let mut rest = code;
            while let Some((at, base, after)) = next_anchor(rest, &here) {
                for tail in path_tails(after) {
                    let mut path = base.clone();
                    path.extend(tail);
                    out.push(Reference { line, path });
                }
                rest = &rest[at..];
            }
        }
        out
    }
}

/// The next `crate::` or `super::` in `text`: where to go on from, the module it starts at, and
/// the text after it.
fn next_anchor<'a>(text: &'a str, here: &[String]) -> Option<(usize, Vec<String>, &'a str)> {
    let mut from = 0;
    loop {
        let crate_at = text[from..].find("crate::").map(|p| p + from);
        let super_at = text[from..].find("super::").map(|p| p + from);
        let at = match (crate_at, super_at) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        let boundary =
            at == 0 || !text[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$');
        if !boundary {
            from = at + 1;
            continue;
        }
        if text[at..].starts_with("crate::") {
            let after = &text[at + "crate::".len()..];
            return Some((at + "crate::".len(), Vec::new(), after));
        }
        // `super` of `a/b.rs` (module `a::b`) is `a`; of `a/mod.rs` (module `a`) it is the root.
        // (An inline module's `super` would be its file; shipped code has none that reach out.)
        let mut base = here.to_vec();
        let mut after = &text[at..];
        while let Some(next) = after.strip_prefix("super::") {
            base.pop();
            after = next;
        }
        let consumed = text.len() - after.len();
        return Some((consumed, base, after));
    }
}

/// The paths that follow an anchor: `a::b::C` is one, `{a, b::c, d::{e, f}}` is several (their
/// leading segments are enough for files and layers).
fn path_tails(text: &str) -> Vec<Vec<String>> {
    let text = text.trim_start();
    if let Some(group) = text.strip_prefix('{') {
        let mut depth = 0;
        let mut items = Vec::new();
        let mut current = String::new();
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(std::mem::take(&mut current));
                    continue;
                }
                _ => {}
            }
            current.push(c);
        }
        items.push(current);
        return items
            .iter()
            .map(|item| segments(item))
            .filter(|s| !s.is_empty() && s[0] != "self")
            .collect();
    }
    vec![segments(text)]
}

fn segments(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    loop {
        let len = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if len == 0 {
            break;
        }
        out.push(rest[..len].to_string());
        match rest[len..].strip_prefix("::") {
            Some(next) => rest = next,
            None => break,
        }
    }
    out
}
