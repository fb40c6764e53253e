//! Records what a dynamically loaded backend must share with its host: the compiler version,
//! the target triple and a hash of the sources of the crates whose types cross the library
//! boundary (base, cpu and this one).
//!
//! A backend library hands the loader Rust trait objects and receives Rust structures, whose
//! layout is only the same for the same crate sources built by the same compiler for the
//! same target. Both sides embed these values (see `crates/backends/src/dynload.rs`), and the loader refuses
//! a library whose values differ, e.g. one built before the sources last changed.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// 64-bit FNV-1a, enough to tell source trees apart.
fn fnv1a(hash: &mut u64, bytes: &[u8]) {
    for &byte in bytes {
        *hash ^= u64::from(byte);
        *hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The crates (relative to the workspace root) whose sources make up the ABI.
const ABI_CRATES: [&str; 3] = ["crates/base", "crates/cpu", "crates/backends"];

fn source_hash(root: &Path) -> String {
    let mut files = Vec::new();
    for krate in ABI_CRATES {
        collect_files(&root.join(krate).join("src"), &mut files);
        files.push(root.join(krate).join("Cargo.toml"));
    }
    files.sort();
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for file in &files {
        let relative = file.strip_prefix(root).unwrap_or(file);
        fnv1a(&mut hash, relative.to_string_lossy().as_bytes());
        fnv1a(&mut hash, &[0]);
        if let Ok(bytes) = fs::read(file) {
            fnv1a(&mut hash, &bytes);
        }
        fnv1a(&mut hash, &[0]);
    }
    format!("{hash:016x}")
}

fn main() {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let version = Command::new(&rustc)
        .arg("-V")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|text| text.trim().to_owned())
        .filter(|text| !text.is_empty())
        .unwrap_or_else(|| "rustc (unknown version)".to_owned());
    let target = env::var("TARGET").unwrap_or_else(|_| "unknown-target".to_owned());
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".to_owned()));
    // This crate sits at `crates/backends` in the workspace.
    let root = manifest.join("../..");
    println!("cargo:rustc-env=FERROGRAPH_RUSTC_VERSION={version}");
    println!("cargo:rustc-env=FERROGRAPH_BUILD_TARGET={target}");
    println!(
        "cargo:rustc-env=FERROGRAPH_SOURCE_HASH={}",
        source_hash(&root)
    );
    println!("cargo:rerun-if-env-changed=RUSTC");
    println!("cargo:rerun-if-changed=build.rs");
    for krate in ABI_CRATES {
        println!(
            "cargo:rerun-if-changed={}",
            root.join(krate).join("src").display()
        );
        println!(
            "cargo:rerun-if-changed={}",
            root.join(krate).join("Cargo.toml").display()
        );
    }
}
