//! CPU feature detection at run time, a one-line system summary, and NUMA / core-count queries.
//!
//! There is one `has_*` function per ggml `ggml_cpu_has_*` query. Unlike ggml, which mostly
//! reports the instruction sets a binary was *compiled* for, these report what the *running*
//! CPU (and operating system) supports, so a kernel can pick its code path at run time.
//! Everything is probed once and cached: see [`CpuFeatures::detect`].
//!
//! How each flag is found:
//!
//! * x86 / x86-64 and aarch64: from the crate's one probe of the instruction-set extensions,
//!   [`crate::isa`], which the kernels choose their code paths by as well. SSE3 to AVX-512
//!   VBMI come from `is_x86_feature_detected!`; AVX-VNNI, AVX-512 BF16 and AMX-INT8 from
//!   `cpuid` leaf 7 (the AVX-family ones require the OS support that the macro found for
//!   AVX2 / AVX-512F, AMX-INT8 requires the OS to enable the AMX tile state in XCR0).
//!   AVX-512 VNNI is reported with AVX-512F only. On aarch64: NEON, FP16 vector arithmetic,
//!   dot product, int8 matrix multiply and SVE. FMA is part of AArch64's Advanced SIMD, so `arm_fma`
//!   equals `neon`. SME and the SVE vector length are not probed (`false` / `0`).
//! * 32-bit ARM, RISC-V, POWER, s390x and WebAssembly: whatever the build was compiled for
//!   (`cfg!(target_feature = ..)`); the RVV vector length is not probed (`0`).
//! * `llamafile` is always `false`: ferrograph has no llamafile sgemm kernels.

use std::sync::OnceLock;

/// The CPU features of the running machine, as ggml's `ggml_cpu_has_*` queries report them.
///
/// Obtain the cached instance with [`CpuFeatures::detect`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct CpuFeatures {
    /// SSE3 (x86).
    pub sse3: bool,
    /// SSSE3 (x86).
    pub ssse3: bool,
    /// AVX, with the OS saving the YMM state (x86).
    pub avx: bool,
    /// AVX-VNNI, the VEX-encoded int8 dot products (x86).
    pub avx_vnni: bool,
    /// AVX2 (x86).
    pub avx2: bool,
    /// BMI2 (x86).
    pub bmi2: bool,
    /// F16C half-precision conversions (x86).
    pub f16c: bool,
    /// FMA3 fused multiply-add (x86).
    pub fma: bool,
    /// AVX-512 Foundation, with the OS saving the ZMM state (x86).
    pub avx512: bool,
    /// AVX-512 VBMI (x86).
    pub avx512_vbmi: bool,
    /// AVX-512 VNNI (x86).
    pub avx512_vnni: bool,
    /// AVX-512 BF16 (x86).
    pub avx512_bf16: bool,
    /// AMX-INT8 tile instructions, with the OS enabling the tile state (x86).
    pub amx_int8: bool,
    /// NEON / Advanced SIMD (ARM).
    pub neon: bool,
    /// Vector fused multiply-add (ARM).
    pub arm_fma: bool,
    /// Half-precision vector arithmetic, FEAT_FP16 (ARM).
    pub fp16_va: bool,
    /// Int8 dot product instructions, FEAT_DotProd (ARM).
    pub dotprod: bool,
    /// Int8 matrix multiply, FEAT_I8MM (ARM).
    pub matmul_int8: bool,
    /// Scalable Vector Extension (ARM).
    pub sve: bool,
    /// SVE vector length in bytes; `0` when unknown (it is not probed yet) or without SVE.
    pub sve_cnt: usize,
    /// Scalable Matrix Extension (ARM); not probed yet, always `false`.
    pub sme: bool,
    /// RISC-V vector extension (compile-time).
    pub riscv_v: bool,
    /// RISC-V vector length in bytes; `0` when unknown (not probed yet) or without RVV.
    pub rvv_vlen: usize,
    /// POWER VSX (compile-time).
    pub vsx: bool,
    /// s390x vector enhancements facility 1 (compile-time).
    pub vxe: bool,
    /// WebAssembly 128-bit SIMD (compile-time).
    pub wasm_simd: bool,
    /// llamafile's sgemm kernels: always `false`, ferrograph does not ship them.
    pub llamafile: bool,
}

impl CpuFeatures {
    /// The features of this machine, probed on the first call and cached for the process.
    pub fn detect() -> &'static CpuFeatures {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        FEATURES.get_or_init(Self::probe)
    }

    fn probe() -> CpuFeatures {
        let mut f = CpuFeatures::default();
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        x86::probe(&mut f);
        #[cfg(target_arch = "aarch64")]
        aarch64::probe(&mut f);
        #[cfg(target_arch = "arm")]
        {
            f.neon = cfg!(target_feature = "neon");
            f.arm_fma = f.neon && cfg!(target_feature = "vfp4");
        }
        f.riscv_v = cfg!(all(
            any(target_arch = "riscv32", target_arch = "riscv64"),
            target_feature = "v"
        ));
        #[cfg(all(
            any(target_arch = "riscv32", target_arch = "riscv64"),
            target_feature = "v"
        ))]
        {
            let vlenb: usize;
            // SAFETY: the crate is compiled for the V extension (checked by the cfg), so the
            // read-only `vlenb` CSR (the vector register length in bytes) exists; reading it
            // has no side effects.
            unsafe { std::arch::asm!("csrr {0}, vlenb", out(reg) vlenb, options(nomem, nostack)) };
            f.rvv_vlen = vlenb;
        }
        f.vsx = cfg!(all(
            any(target_arch = "powerpc", target_arch = "powerpc64"),
            target_feature = "vsx"
        ));
        f.vxe = cfg!(all(
            target_arch = "s390x",
            target_feature = "vector-enhancements-1"
        ));
        f.wasm_simd = cfg!(all(
            any(target_arch = "wasm32", target_arch = "wasm64"),
            target_feature = "simd128"
        ));
        f.llamafile = false;
        f
    }

    /// Every boolean feature with its ggml-style lower-case name, in a fixed order (x86
    /// first, then ARM, RISC-V, POWER, s390x, WebAssembly, llamafile).
    ///
    /// The numeric entries (`sve_cnt`, `rvv_vlen`) are in [`CpuFeatures::as_counts`].
    pub fn as_pairs(&self) -> Vec<(&'static str, bool)> {
        vec![
            ("sse3", self.sse3),
            ("ssse3", self.ssse3),
            ("avx", self.avx),
            ("avx_vnni", self.avx_vnni),
            ("avx2", self.avx2),
            ("bmi2", self.bmi2),
            ("f16c", self.f16c),
            ("fma", self.fma),
            ("avx512", self.avx512),
            ("avx512_vbmi", self.avx512_vbmi),
            ("avx512_vnni", self.avx512_vnni),
            ("avx512_bf16", self.avx512_bf16),
            ("amx_int8", self.amx_int8),
            ("neon", self.neon),
            ("arm_fma", self.arm_fma),
            ("fp16_va", self.fp16_va),
            ("dotprod", self.dotprod),
            ("matmul_int8", self.matmul_int8),
            ("sve", self.sve),
            ("sme", self.sme),
            ("riscv_v", self.riscv_v),
            ("vsx", self.vsx),
            ("vxe", self.vxe),
            ("wasm_simd", self.wasm_simd),
            ("llamafile", self.llamafile),
        ]
    }

    /// The numeric entries, in a fixed order: `("sve_cnt", bytes)` and `("rvv_vlen", bytes)`.
    pub fn as_counts(&self) -> Vec<(&'static str, usize)> {
        vec![("sve_cnt", self.sve_cnt), ("rvv_vlen", self.rvv_vlen)]
    }
}

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
mod x86 {
    use super::CpuFeatures;

    /// Copies the answers of the crate's one probe ([`crate::isa`]).
    pub(super) fn probe(f: &mut CpuFeatures) {
        let isa = crate::isa::get();
        f.sse3 = isa.sse3;
        f.ssse3 = isa.ssse3;
        f.avx = isa.avx;
        f.avx2 = isa.avx2;
        f.bmi2 = isa.bmi2;
        f.f16c = isa.f16c;
        f.fma = isa.fma;
        f.avx512 = isa.avx512f;
        f.avx512_vbmi = isa.avx512vbmi;
        f.avx_vnni = isa.avx_vnni;
        f.avx512_vnni = isa.avx512f && isa.avx512vnni;
        f.avx512_bf16 = isa.avx512bf16;
        f.amx_int8 = isa.amx_int8;
    }
}

#[cfg(target_arch = "aarch64")]
mod aarch64 {
    use super::CpuFeatures;

    pub(super) fn probe(f: &mut CpuFeatures) {
        let isa = crate::isa::get();
        f.neon = isa.neon;
        // Fused multiply-add is part of AArch64's Advanced SIMD.
        f.arm_fma = f.neon;
        f.fp16_va = isa.fp16;
        f.dotprod = isa.dotprod;
        f.matmul_int8 = isa.i8mm;
        f.sve = isa.sve;
        f.sve_cnt = if f.sve { sve_vector_bytes() } else { 0 };
        // SME detection is not stable in std at the minimum Rust version: it stays unknown.
        f.sme = false;
    }

    /// The SVE vector length in bytes for this thread (ggml's `sve_cnt`), from
    /// `prctl(PR_SVE_GET_VL)`; 0 where the kernel does not say.
    #[cfg(target_os = "linux")]
    fn sve_vector_bytes() -> usize {
        // PR_SVE_GET_VL and the length mask of its result (linux/prctl.h).
        const PR_SVE_GET_VL: libc::c_int = 51;
        const PR_SVE_VL_LEN_MASK: libc::c_int = 0xffff;
        // SAFETY: PR_SVE_GET_VL takes no further arguments and only returns a value.
        let rc = unsafe { libc::prctl(PR_SVE_GET_VL, 0, 0, 0, 0) };
        if rc < 0 {
            0
        } else {
            (rc & PR_SVE_VL_LEN_MASK) as usize
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn sve_vector_bytes() -> usize {
        0
    }
}

macro_rules! feature_fns {
    ($($(#[$doc:meta])* $name:ident => $field:ident: $ty:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name() -> $ty {
                CpuFeatures::detect().$field
            }
        )*
    };
}

feature_fns! {
    /// Whether the CPU supports SSE3.
    has_sse3 => sse3: bool;
    /// Whether the CPU supports SSSE3.
    has_ssse3 => ssse3: bool;
    /// Whether the CPU and OS support AVX.
    has_avx => avx: bool;
    /// Whether the CPU supports AVX-VNNI.
    has_avx_vnni => avx_vnni: bool;
    /// Whether the CPU supports AVX2.
    has_avx2 => avx2: bool;
    /// Whether the CPU supports BMI2.
    has_bmi2 => bmi2: bool;
    /// Whether the CPU supports F16C.
    has_f16c => f16c: bool;
    /// Whether the CPU supports FMA3.
    has_fma => fma: bool;
    /// Whether the CPU and OS support AVX-512 Foundation.
    has_avx512 => avx512: bool;
    /// Whether the CPU supports AVX-512 VBMI.
    has_avx512_vbmi => avx512_vbmi: bool;
    /// Whether the CPU supports AVX-512 VNNI.
    has_avx512_vnni => avx512_vnni: bool;
    /// Whether the CPU supports AVX-512 BF16.
    has_avx512_bf16 => avx512_bf16: bool;
    /// Whether the CPU supports AMX-INT8 and the OS enabled the tile state.
    has_amx_int8 => amx_int8: bool;
    /// Whether the CPU supports NEON (Advanced SIMD).
    has_neon => neon: bool;
    /// Whether the CPU supports vector fused multiply-add on ARM.
    has_arm_fma => arm_fma: bool;
    /// Whether the CPU supports half-precision vector arithmetic on ARM.
    has_fp16_va => fp16_va: bool;
    /// Whether the CPU supports the ARM int8 dot product instructions.
    has_dotprod => dotprod: bool;
    /// Whether the CPU supports the ARM int8 matrix multiply instructions.
    has_matmul_int8 => matmul_int8: bool;
    /// Whether the CPU supports SVE.
    has_sve => sve: bool;
    /// The SVE vector length in bytes; `0` without SVE or when unknown (not probed yet).
    sve_cnt => sve_cnt: usize;
    /// Whether the CPU supports SME (not probed yet: always `false`).
    has_sme => sme: bool;
    /// Whether the build targets the RISC-V vector extension.
    has_riscv_v => riscv_v: bool;
    /// The RISC-V vector length in bytes; `0` without RVV or when unknown (not probed yet).
    rvv_vlen => rvv_vlen: usize;
    /// Whether the build targets POWER VSX.
    has_vsx => vsx: bool;
    /// Whether the build targets the s390x vector enhancements facility.
    has_vxe => vxe: bool;
    /// Whether the build targets WebAssembly SIMD128.
    has_wasm_simd => wasm_simd: bool;
    /// Always `false`: ferrograph has no llamafile sgemm kernels.
    has_llamafile => llamafile: bool;
}

/// Number of hardware threads the process may use (at least 1).
fn logical_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A one-line summary of the machine: the architecture, every feature that is present as
/// `NAME = 1`, non-zero vector lengths as `NAME = bytes`, and the usable thread count, e.g.
/// `"x86_64 | SSE3 = 1 | AVX2 = 1 | F16C = 1 | threads = 2"`.
pub fn system_info() -> String {
    let f = CpuFeatures::detect();
    let mut parts = vec![std::env::consts::ARCH.to_string()];
    for (name, on) in f.as_pairs() {
        if on {
            parts.push(format!("{} = 1", name.to_ascii_uppercase()));
        }
    }
    for (name, n) in f.as_counts() {
        if n > 0 {
            parts.push(format!("{} = {}", name.to_ascii_uppercase(), n));
        }
    }
    parts.push(format!("threads = {}", logical_threads()));
    parts.join(" | ")
}

/// How compute threads should be placed on a NUMA machine (ggml's `ggml_numa_strategy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum NumaStrategy {
    /// No NUMA-aware placement.
    #[default]
    Disabled,
    /// Spread threads evenly over the nodes.
    Distribute,
    /// Keep threads on the node the process started on.
    Isolate,
    /// Follow the CPU set that `numactl` gave the process.
    Numactl,
    /// Mirror data on every node.
    Mirror,
}

static NUMA_STRATEGY: OnceLock<NumaStrategy> = OnceLock::new();

/// Records the NUMA strategy for the process. Only the first call has an effect; later calls
/// (with any strategy) are ignored, so calling it again is harmless.
///
/// This only records the choice (see [`numa_strategy`]) and logs the node count; placing
/// threads according to it is up to the thread pool.
pub fn numa_init(strategy: NumaStrategy) {
    let mut first = false;
    let recorded = *NUMA_STRATEGY.get_or_init(|| {
        first = true;
        strategy
    });
    if first {
        log::info!(
            "numa: strategy {:?}, {} node(s){}",
            recorded,
            numa_node_count(),
            if is_numa() {
                ""
            } else {
                " (not a NUMA system)"
            }
        );
    } else if recorded != strategy {
        log::debug!("numa: already initialized with {recorded:?}; ignoring {strategy:?}");
    }
}

/// The strategy recorded by the first [`numa_init`] call, if any.
pub fn numa_strategy() -> Option<NumaStrategy> {
    NUMA_STRATEGY.get().copied()
}

/// Whether the machine has more than one NUMA node.
pub fn is_numa() -> bool {
    numa_node_count() > 1
}

/// Number of NUMA nodes: the `node<N>` entries of `/sys/devices/system/node` on Linux. Where
/// that is unavailable (other systems, kernels without NUMA support) the machine counts as one
/// node, so the result is at least 1. Read once and cached.
pub fn numa_node_count() -> usize {
    static NODES: OnceLock<usize> = OnceLock::new();
    *NODES.get_or_init(|| count_sysfs_nodes().unwrap_or(0).max(1))
}

fn count_sysfs_nodes() -> Option<usize> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let entries = std::fs::read_dir("/sys/devices/system/node").ok()?;
    let n = entries
        .filter_map(|e| e.ok())
        .filter(|e| is_numbered(&e.file_name().to_string_lossy(), "node"))
        .count();
    Some(n)
}

/// Whether `name` is `prefix` followed by one or more decimal digits.
fn is_numbered(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
}

/// Best-effort number of physical cores (hyper-threads of one core count once).
///
/// Counts distinct (package, core) pairs from `/proc/cpuinfo`, or else from
/// `/sys/devices/system/cpu/cpu*/topology`; where neither says anything, falls back to the
/// usable thread count. The result is at least 1 and at most the number of threads the
/// process may use (so a container restricted to a few CPUs does not report the host's
/// cores).
pub fn n_physical_cores() -> usize {
    let threads = logical_threads();
    let counted = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| cores_from_cpuinfo(&text))
        .or_else(cores_from_sysfs_topology);
    counted.unwrap_or(threads).clamp(1, threads)
}

/// Distinct `(physical id, core id)` pairs in `/proc/cpuinfo` text; `None` if it lists no
/// core ids (as on many ARM kernels).
fn cores_from_cpuinfo(text: &str) -> Option<usize> {
    let mut cores = std::collections::HashSet::new();
    let mut package = None;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            // A blank line ends one processor's section.
            package = None;
            continue;
        };
        match key.trim() {
            "physical id" => package = Some(value.trim().to_string()),
            "core id" => {
                cores.insert((package.clone(), value.trim().to_string()));
            }
            _ => {}
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Distinct `(physical_package_id, core_id)` pairs under `/sys/devices/system/cpu`.
fn cores_from_sysfs_topology() -> Option<usize> {
    let mut cores = std::collections::HashSet::new();
    for entry in std::fs::read_dir("/sys/devices/system/cpu").ok()?.flatten() {
        if !is_numbered(&entry.file_name().to_string_lossy(), "cpu") {
            continue;
        }
        let topo = entry.path().join("topology");
        let read = |f: &str| std::fs::read_to_string(topo.join(f)).ok();
        if let Some(core) = read("core_id") {
            let package = read("physical_package_id").unwrap_or_default();
            cores.insert((package.trim().to_string(), core.trim().to_string()));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn detect_is_cached() {
        assert!(std::ptr::eq(CpuFeatures::detect(), CpuFeatures::detect()));
    }

    #[test]
    fn free_functions_match_struct() {
        let f = CpuFeatures::detect();
        let fns: [(&str, bool); 25] = [
            ("sse3", has_sse3()),
            ("ssse3", has_ssse3()),
            ("avx", has_avx()),
            ("avx_vnni", has_avx_vnni()),
            ("avx2", has_avx2()),
            ("bmi2", has_bmi2()),
            ("f16c", has_f16c()),
            ("fma", has_fma()),
            ("avx512", has_avx512()),
            ("avx512_vbmi", has_avx512_vbmi()),
            ("avx512_vnni", has_avx512_vnni()),
            ("avx512_bf16", has_avx512_bf16()),
            ("amx_int8", has_amx_int8()),
            ("neon", has_neon()),
            ("arm_fma", has_arm_fma()),
            ("fp16_va", has_fp16_va()),
            ("dotprod", has_dotprod()),
            ("matmul_int8", has_matmul_int8()),
            ("sve", has_sve()),
            ("sme", has_sme()),
            ("riscv_v", has_riscv_v()),
            ("vsx", has_vsx()),
            ("vxe", has_vxe()),
            ("wasm_simd", has_wasm_simd()),
            ("llamafile", has_llamafile()),
        ];
        assert_eq!(f.as_pairs(), fns.to_vec());
        assert_eq!(
            f.as_counts(),
            vec![("sve_cnt", sve_cnt()), ("rvv_vlen", rvv_vlen())]
        );
        assert!(!has_llamafile());
        if !has_sve() {
            assert_eq!(sve_cnt(), 0);
        }
        if !has_riscv_v() {
            assert_eq!(rvv_vlen(), 0);
        }
    }

    #[test]
    fn names_are_unique_and_lower_case() {
        let f = CpuFeatures::detect();
        let mut names: Vec<&str> = f.as_pairs().iter().map(|p| p.0).collect();
        names.extend(f.as_counts().iter().map(|p| p.0));
        let unique: HashSet<&str> = names.iter().copied().collect();
        assert_eq!(unique.len(), names.len());
        for n in names {
            assert!(
                n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{n}"
            );
        }
    }

    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    #[test]
    fn x86_consistent_with_std() {
        let f = CpuFeatures::detect();
        // FERROGRAPH_MAX_ISA caps the probe (see `ferrograph_base::isa`).
        let cap = std::env::var("FERROGRAPH_MAX_ISA").ok();
        let any = cap.as_deref() != Some("portable");
        let wide = any && cap.as_deref() != Some("avx2");
        assert_eq!(f.sse3, any && is_x86_feature_detected!("sse3"));
        assert_eq!(f.ssse3, any && is_x86_feature_detected!("ssse3"));
        assert_eq!(f.avx, any && is_x86_feature_detected!("avx"));
        assert_eq!(f.avx2, any && is_x86_feature_detected!("avx2"));
        assert_eq!(f.bmi2, any && is_x86_feature_detected!("bmi2"));
        assert_eq!(f.f16c, any && is_x86_feature_detected!("f16c"));
        assert_eq!(f.fma, any && is_x86_feature_detected!("fma"));
        assert_eq!(f.avx512, wide && is_x86_feature_detected!("avx512f"));
        assert_eq!(
            f.avx512_vbmi,
            wide && is_x86_feature_detected!("avx512vbmi")
        );
        // Implications that hold on every real CPU.
        let implies = |a: bool, b: bool, what: &str| assert!(!a || b, "{what}");
        implies(f.ssse3, f.sse3, "ssse3 => sse3");
        implies(f.avx2, f.avx, "avx2 => avx");
        implies(f.fma, f.avx, "fma => avx");
        implies(f.f16c, f.avx, "f16c => avx");
        implies(f.avx512, f.avx2, "avx512 => avx2");
        implies(f.avx512_vbmi, f.avx512, "avx512_vbmi => avx512");
        implies(f.avx512_vnni, f.avx512, "avx512_vnni => avx512");
        implies(f.avx512_bf16, f.avx512, "avx512_bf16 => avx512");
        implies(f.avx_vnni, f.avx2, "avx_vnni => avx2");
        // Nothing from other architectures.
        assert!(!(f.neon || f.arm_fma || f.fp16_va || f.dotprod || f.matmul_int8));
        assert!(!(f.sve || f.sme || f.riscv_v || f.vsx || f.vxe || f.wasm_simd));
        assert_eq!((f.sve_cnt, f.rvv_vlen), (0, 0));
    }

    /// The Linux kernel lists the features it found (and enabled) in /proc/cpuinfo; our
    /// detection must agree with it, which also checks the raw-cpuid ones.
    #[cfg(all(target_os = "linux", any(target_arch = "x86", target_arch = "x86_64")))]
    #[test]
    fn x86_consistent_with_proc_cpuinfo() {
        let Ok(text) = std::fs::read_to_string("/proc/cpuinfo") else {
            return;
        };
        let Some(flags) = text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == "flags").then(|| v.split_whitespace().collect::<HashSet<&str>>())
        }) else {
            return;
        };
        let f = CpuFeatures::detect();
        for (ours, kernel) in [
            (f.sse3, "pni"),
            (f.ssse3, "ssse3"),
            (f.avx, "avx"),
            (f.avx2, "avx2"),
            (f.bmi2, "bmi2"),
            (f.f16c, "f16c"),
            (f.fma, "fma"),
            (f.avx512, "avx512f"),
            (f.avx512_vbmi, "avx512vbmi"),
            (f.avx512_vnni, "avx512_vnni"),
            (f.avx512_bf16, "avx512_bf16"),
            (f.avx_vnni, "avx_vnni"),
            (f.amx_int8, "amx_int8"),
        ] {
            // With FERROGRAPH_MAX_ISA capping the probe, a present feature may be off, never
            // the reverse.
            if std::env::var_os("FERROGRAPH_MAX_ISA").is_some() {
                assert!(!ours || flags.contains(kernel), "feature {kernel}");
            } else {
                assert_eq!(ours, flags.contains(kernel), "feature {kernel}");
            }
        }
    }

    #[cfg(target_arch = "aarch64")]
    #[test]
    fn aarch64_consistent_with_std() {
        let f = CpuFeatures::detect();
        assert_eq!(f.neon, std::arch::is_aarch64_feature_detected!("neon"));
        assert_eq!(f.arm_fma, f.neon);
        assert_eq!(
            f.dotprod,
            std::arch::is_aarch64_feature_detected!("dotprod")
        );
        assert!(!(f.sse3 || f.avx || f.avx2 || f.avx512 || f.amx_int8));
    }

    #[test]
    fn system_info_lists_present_features() {
        let info = system_info();
        let parts: Vec<&str> = info.split(" | ").collect();
        assert_eq!(parts[0], std::env::consts::ARCH);
        assert_eq!(
            *parts.last().unwrap(),
            format!("threads = {}", logical_threads())
        );
        let f = CpuFeatures::detect();
        for (name, on) in f.as_pairs() {
            let entry = format!("{} = 1", name.to_ascii_uppercase());
            assert_eq!(parts.contains(&entry.as_str()), on, "{entry} in {info}");
        }
        assert!(!info.contains('\n'));
    }

    #[test]
    fn numa_init_is_idempotent() {
        numa_init(NumaStrategy::Distribute);
        let first = numa_strategy().expect("recorded");
        numa_init(NumaStrategy::Isolate);
        numa_init(NumaStrategy::Mirror);
        assert_eq!(numa_strategy(), Some(first));
        assert_eq!(first, NumaStrategy::Distribute);
    }

    #[test]
    fn numa_nodes() {
        let n = numa_node_count();
        assert!(n >= 1);
        assert_eq!(is_numa(), n > 1);
        if let Some(sysfs) = count_sysfs_nodes() {
            assert_eq!(n, sysfs.max(1));
        }
        assert!(is_numbered("node12", "node"));
        assert!(!is_numbered("node", "node"));
        assert!(!is_numbered("nodex", "node"));
        assert!(!is_numbered("has_cpu", "node"));
    }

    #[test]
    fn physical_cores() {
        let n = n_physical_cores();
        assert!(n >= 1 && n <= logical_threads());
    }

    #[test]
    fn cpuinfo_parsing() {
        // Two packages, two cores each, two threads per core.
        let mut text = String::new();
        for (cpu, (pkg, core)) in [
            (0, 0),
            (0, 0),
            (0, 1),
            (0, 1),
            (1, 0),
            (1, 0),
            (1, 1),
            (1, 1),
        ]
        .iter()
        .enumerate()
        {
            text += &format!(
                "processor\t: {cpu}\nphysical id\t: {pkg}\ncore id\t\t: {core}\nflags\t: fpu\n\n"
            );
        }
        assert_eq!(cores_from_cpuinfo(&text), Some(4));
        assert_eq!(cores_from_cpuinfo("processor : 0\nBogoMIPS : 48\n\n"), None);
        // Core ids without package ids still count.
        assert_eq!(
            cores_from_cpuinfo("core id : 0\n\ncore id : 1\n\ncore id : 1\n"),
            Some(2)
        );
    }
}
