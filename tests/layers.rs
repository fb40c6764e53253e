//! The layering, checked: the workspace's crates depend only downward (base <- cpu <- backends
//! <- ferrograph <- python), and inside each library crate no module names a module of a higher
//! layer. The layer tables below are the map `docs/ARCHITECTURE.md` draws; a module missing from
//! its crate's table fails the test, so a new module has to be placed.
//!
//! References are read from the sources: every `crate::<module>` path and every `super::`
//! path of a top-level module, outside comments, outside the `#[cfg(test)]` module at the end
//! of a file and outside `tests.rs` files (tests may build whatever they need). Modules in one layer may refer to each
//! other: they are one concept split over files (a tensor names its buffer, a buffer type
//! sizes tensors).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// Each crate's modules, bottom layer first; modules on one line share a layer.
const LAYERS: &[(&str, &[&[&str]])] = &[
    (
        "crates/base",
        &[
            &["error", "util", "isa", "pool"],
            &["quant", "dtype", "convert"],
            &["host"],
            // The op IR and the objects name each other: a custom op computes on tensors.
            &[
                "op",
                "tensor",
                "context",
                "graph",
                "buffer",
                "device",
                "backend",
                "event",
                "registration",
            ],
            &["ops"],
            &["alloc"],
            &["sched", "graph_copy"],
            &["gguf"],
        ],
    ),
    (
        "crates/cpu",
        &[
            &["features", "sysinfo"],
            &["kernels"],
            &["type_traits"],
            // The backend: its node loop, the repacking buffer type (which the node loop reads
            // and the device offers), the device and backend themselves.
            &["compute", "repack", "backend"],
        ],
    ),
    (
        "crates/backends",
        &[
            &["registry"],
            &["blas", "row_split"],
            &["dynload"],
            &["remote"],
        ],
    ),
];

/// Which workspace crates each crate may depend on (its `[dependencies]`).
const CRATE_DEPS: &[(&str, &[&str])] = &[
    ("crates/base", &[]),
    ("crates/cpu", &["ferrograph-base"]),
    ("crates/backends", &["ferrograph-base", "ferrograph-cpu"]),
    (
        ".",
        &["ferrograph-base", "ferrograph-cpu", "ferrograph-backends"],
    ),
    ("crates/python", &["ferrograph", "ferrograph-base"]),
];

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source without line comments and without a trailing `#[cfg(test)] mod ... { }`.
fn code_of(text: &str) -> String {
    let cut = text
        .find("#[cfg(test)]\nmod ")
        .or_else(|| text.find("#[cfg(test)]\npub(crate) mod "))
        .unwrap_or(text.len());
    text[..cut]
        .lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifiers that follow `prefix` in `code` (`crate::tensor::X` gives `tensor`), and for
/// `use crate::{a::X, b}` groups each item's first segment. Macro names (followed by `!`) are
/// not modules and are skipped.
fn referenced(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.push(name);
                }
            }
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && !rest[name.len()..].starts_with('!') {
            out.push(name);
        }
    }
    out
}

#[test]
fn no_module_names_a_higher_layer() {
    let mut violations = Vec::new();
    for (krate, layers) in LAYERS {
        let src = workspace().join(krate).join("src");
        let layer_of: BTreeMap<&str, usize> = layers
            .iter()
            .enumerate()
            .flat_map(|(i, mods)| mods.iter().map(move |m| (*m, i)))
            .collect();
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in files {
            let rel = file.strip_prefix(&src).unwrap();
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            // The crate root only declares modules; a `tests.rs` file is a test module.
            if parts == ["lib.rs"] || parts.last().is_some_and(|p| p == "tests.rs") {
                continue;
            }
            let module = parts[0].trim_end_matches(".rs").to_owned();
            let Some(&own) = layer_of.get(module.as_str()) else {
                violations.push(format!("{krate}: module `{module}` is in no layer"));
                continue;
            };
            let code = code_of(&fs::read_to_string(&file).unwrap());
            let mut names = referenced(&code, "crate::");
            // In a top-level module's own file (`a.rs`, `a/mod.rs`), `super::` is the crate.
            let top_level = parts.len() == 1 || (parts.len() == 2 && parts[1] == "mod.rs");
            if top_level {
                names.extend(referenced(&code, "super::"));
            }
            for name in names {
                if name == module {
                    continue;
                }
                match layer_of.get(name.as_str()) {
                    Some(&target) if target > own => violations.push(format!(
                        "{krate}/src/{}: `{module}` (layer {own}) names `{name}` (layer {target})",
                        rel.display()
                    )),
                    _ => {}
                }
            }
        }
    }
    assert!(violations.is_empty(), "{}", violations.join("\n"));
}

#[test]
fn crates_depend_only_downward() {
    let workspace_crates = [
        "ferrograph-base",
        "ferrograph-cpu",
        "ferrograph-backends",
        "ferrograph",
        "ferrograph-python",
    ];
    for (krate, allowed) in CRATE_DEPS {
        let manifest = fs::read_to_string(workspace().join(krate).join("Cargo.toml")).unwrap();
        let deps = manifest
            .split("\n[dependencies]\n")
            .nth(1)
            .map(|rest| rest.split("\n[").next().unwrap_or(""))
            .unwrap_or("");
        for line in deps.lines() {
            let name = line.split('=').next().unwrap_or("").trim();
            if workspace_crates.contains(&name) {
                assert!(
                    allowed.contains(&name),
                    "{krate} depends on {name}, which is not below it"
                );
            }
        }
    }
}

#[test]
fn the_reference_reader_sees_paths_and_groups() {
    let code = "use crate::tensor::Tensor;\nuse crate::{dtype::DType, ops};\n\
                let x = crate::buffer::alloc(); $crate::shape_err!(); crate::shape_err!(x);";
    assert_eq!(
        referenced(code, "crate::"),
        ["tensor", "dtype", "ops", "buffer"]
    );
    assert_eq!(
        code_of("a // crate::x\n#[cfg(test)]\nmod t { crate::y }"),
        "a "
    );
}
