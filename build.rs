//! Records the compiler version and target triple for the dynamic-backend ABI fingerprint.
//!
//! A backend library hands the loader a Rust trait object, whose layout is only stable for
//! one crate version built by one compiler for one target, so both sides embed these values
//! and the loader refuses a library whose values differ.

use std::env;
use std::process::Command;

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
    println!("cargo:rustc-env=FERROGRAPH_RUSTC_VERSION={version}");
    println!("cargo:rustc-env=FERROGRAPH_BUILD_TARGET={target}");
    println!("cargo:rerun-if-env-changed=RUSTC");
    println!("cargo:rerun-if-changed=build.rs");
}
