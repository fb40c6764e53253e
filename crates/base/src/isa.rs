//! The instruction-set extensions of the running CPU, probed once per process.
//!
//! Every run-time feature check of the crate goes through [`get`]: the kernels ask the named
//! queries of [`Features`] (for example [`Features::avx2_fma_f16c`]) rather than calling
//! `is_x86_feature_detected!` themselves, and `cpu::features` reports ggml's `has_*` answers
//! from the same probe. This module sits below every other one (it uses `std` and `libc`
//! only), so both the format conversions and the CPU kernels can depend on it.
//!
//! How each flag is found:
//!
//! * x86 / x86-64: `is_x86_feature_detected!` (which also checks that the OS saves the
//!   register state) for everything the macro knows on the crate's minimum Rust version.
//!   AVX-VNNI, AVX-512 BF16 and the AMX bits are read from `cpuid` leaf 7 directly; the AVX
//!   family ones additionally require the OS support the macro found for AVX2 / AVX-512F.
//! * aarch64: `is_aarch64_feature_detected!`.
//!
//! `FERROGRAPH_NO_AMX` set in the environment (to anything) when the probe runs turns
//! [`Features::amx_bf16`] off; [`Features::amx_int8`] is reported as the hardware and OS
//! have it.
//!
//! `FERROGRAPH_MAX_ISA` caps what the probe reports, so that one machine can run the code a
//! lesser CPU would (every kernel choice follows these flags): `avx2` turns off AVX-512 and
//! AMX, `portable` every x86 / aarch64 extension; `avx512` caps nothing, and any other value
//! caps nothing with a warning in the log.

use std::sync::OnceLock;

/// The instruction-set extensions of the running CPU and OS. Every field is `false` on other
/// architectures. Obtain the cached instance with [`get`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Features {
    /// SSE3 (x86).
    pub sse3: bool,
    /// SSSE3 (x86).
    pub ssse3: bool,
    /// AVX with the OS saving the YMM state (x86).
    pub avx: bool,
    /// AVX2 (x86).
    pub avx2: bool,
    /// BMI2 (x86).
    pub bmi2: bool,
    /// F16C half-precision conversions (x86).
    pub f16c: bool,
    /// FMA3 fused multiply-add (x86).
    pub fma: bool,
    /// AVX-512 Foundation with the OS saving the ZMM state (x86).
    pub avx512f: bool,
    /// AVX-512 byte and word instructions (x86).
    pub avx512bw: bool,
    /// AVX-512 vector-length extensions: the AVX-512 instructions on 128/256-bit registers.
    pub avx512vl: bool,
    /// AVX-512 VBMI (x86).
    pub avx512vbmi: bool,
    /// AVX-512 VNNI, the int8 dot products (x86).
    pub avx512vnni: bool,
    /// AVX-512 BF16 (x86; `cpuid` leaf 7 sub-leaf 1, with AVX-512F).
    pub avx512bf16: bool,
    /// AVX-VNNI, the VEX-encoded int8 dot products (x86; `cpuid` leaf 7 sub-leaf 1, with
    /// AVX2).
    pub avx_vnni: bool,
    /// AMX-INT8 and AMX-TILE, with the OS enabling the tile state in XCR0 (x86).
    pub amx_int8: bool,
    /// AMX-BF16 and AMX-TILE usable by this process: present in `cpuid`, Linux granted the
    /// tile data permission (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, requested by the probe), and
    /// `FERROGRAPH_NO_AMX` unset (x86-64 Linux only).
    pub amx_bf16: bool,
    /// NEON / Advanced SIMD (aarch64).
    pub neon: bool,
    /// Half-precision vector arithmetic, FEAT_FP16 (aarch64).
    pub fp16: bool,
    /// Int8 dot products, FEAT_DotProd (aarch64).
    pub dotprod: bool,
    /// Int8 matrix multiply, FEAT_I8MM (aarch64).
    pub i8mm: bool,
    /// Scalable Vector Extension (aarch64).
    pub sve: bool,
}

/// The features of this machine, probed on the first call and cached for the process.
#[inline]
pub fn get() -> &'static Features {
    static FEATURES: OnceLock<Features> = OnceLock::new();
    FEATURES.get_or_init(Features::probe)
}

impl Features {
    fn probe() -> Features {
        let mut f = Features::default();
        f.detect();
        match std::env::var("FERROGRAPH_MAX_ISA").as_deref() {
            Ok("portable") => f = Features::default(),
            Ok("avx2") => f.cap_to_avx2(),
            Ok("avx512") | Err(_) => {}
            Ok(other) => log::warn!(
                "FERROGRAPH_MAX_ISA={other:?} is not one of portable, avx2, avx512: not capped"
            ),
        }
        f
    }

    /// Turns off the AVX-512 and AMX extensions.
    fn cap_to_avx2(&mut self) {
        self.avx512f = false;
        self.avx512bw = false;
        self.avx512vl = false;
        self.avx512vbmi = false;
        self.avx512vnni = false;
        self.avx512bf16 = false;
        self.amx_int8 = false;
        self.amx_bf16 = false;
    }

    /// The running CPU's and OS's extensions, uncapped.
    fn detect(&mut self) {
        let f = self;
        #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
        x86::probe(f);
        #[cfg(target_arch = "aarch64")]
        {
            use std::arch::is_aarch64_feature_detected;
            f.neon = is_aarch64_feature_detected!("neon");
            f.fp16 = is_aarch64_feature_detected!("fp16");
            f.dotprod = is_aarch64_feature_detected!("dotprod");
            f.i8mm = is_aarch64_feature_detected!("i8mm");
            f.sve = is_aarch64_feature_detected!("sve");
        }
    }

    /// AVX2 and FMA: the 8-lane f32 kernels (and the AVX2 builds of auto-vectorised loops).
    #[inline]
    pub fn avx2_fma(&self) -> bool {
        self.avx2 && self.fma
    }

    /// AVX2, FMA and F16C: the 8-lane kernels that also read f16 data.
    #[inline]
    pub fn avx2_fma_f16c(&self) -> bool {
        self.avx2_fma() && self.f16c
    }

    /// AVX-512F alone: the 16-lane f32 kernels that use no AVX2 code of their own.
    #[inline]
    pub fn avx512f(&self) -> bool {
        self.avx512f
    }

    /// AVX-512F together with AVX2 and FMA: 16-lane kernels whose fallbacks or helpers are
    /// the AVX2 ones.
    #[inline]
    pub fn avx512f_avx2_fma(&self) -> bool {
        self.avx512f && self.avx2_fma()
    }

    /// AVX-512F and AVX-512BW: 512-bit byte/word arithmetic (the int8 quantizers).
    #[inline]
    pub fn avx512_bw(&self) -> bool {
        self.avx512f && self.avx512bw
    }

    /// AVX-512F, AVX-512BW and AVX-512 VNNI: `vpdpbusd` on 512-bit vectors.
    #[inline]
    pub fn avx512_bw_vnni(&self) -> bool {
        self.avx512_bw() && self.avx512vnni
    }

    /// [`Self::avx512_bw_vnni`] plus F16C: the 512-bit int8 kernels that read f16 scales.
    #[inline]
    pub fn avx512_bw_vnni_f16c(&self) -> bool {
        self.avx512_bw_vnni() && self.f16c
    }

    /// AVX-512 VNNI with AVX-512VL (`vpdpbusd` on 256-bit vectors) plus AVX2, FMA and F16C,
    /// which the rest of those kernels use.
    #[inline]
    pub fn avx512_vnni_vl_avx2_f16c(&self) -> bool {
        self.avx2_fma_f16c() && self.avx512vnni && self.avx512vl
    }
}

#[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
mod x86 {
    use super::Features;
    #[cfg(target_arch = "x86")]
    use std::arch::x86 as arch;
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64 as arch;

    pub(super) fn probe(f: &mut Features) {
        f.sse3 = is_x86_feature_detected!("sse3");
        f.ssse3 = is_x86_feature_detected!("ssse3");
        f.avx = is_x86_feature_detected!("avx");
        f.avx2 = is_x86_feature_detected!("avx2");
        f.bmi2 = is_x86_feature_detected!("bmi2");
        f.f16c = is_x86_feature_detected!("f16c");
        f.fma = is_x86_feature_detected!("fma");
        f.avx512f = is_x86_feature_detected!("avx512f");
        f.avx512bw = is_x86_feature_detected!("avx512bw");
        f.avx512vl = is_x86_feature_detected!("avx512vl");
        f.avx512vbmi = is_x86_feature_detected!("avx512vbmi");
        f.avx512vnni = is_x86_feature_detected!("avx512vnni");

        let leaf7 = Leaf7::read();
        // The VEX/EVEX-encoded extensions are only usable where the OS saves the register
        // state of their base, which the macro checked for AVX2 / AVX-512F.
        f.avx_vnni = f.avx2 && leaf7.avx_vnni;
        f.avx512bf16 = f.avx512f && leaf7.avx512_bf16;
        f.amx_int8 = leaf7.amx_tile && leaf7.amx_int8 && os_enables_amx();
        f.amx_bf16 = std::env::var_os("FERROGRAPH_NO_AMX").is_none()
            && leaf7.amx_tile
            && leaf7.amx_bf16
            && request_amx_permission();
    }

    // Newer Rust made `__cpuid_count` safe; the unsafe block is kept for older compilers.
    #[allow(unused_unsafe)]
    fn cpuid(leaf: u32, sub_leaf: u32) -> arch::CpuidResult {
        // SAFETY: every CPU that Rust's x86 and x86-64 targets run on implements `cpuid`; it
        // only fills four registers and touches no memory. Leaves above the maximum return
        // zeros or the highest leaf's data, and callers check the maximum first.
        unsafe { arch::__cpuid_count(leaf, sub_leaf) }
    }

    /// The leaf-7 feature bits that `is_x86_feature_detected!` is not used for.
    #[derive(Default)]
    struct Leaf7 {
        avx_vnni: bool,
        avx512_bf16: bool,
        amx_bf16: bool,
        amx_tile: bool,
        amx_int8: bool,
    }

    impl Leaf7 {
        fn read() -> Leaf7 {
            if cpuid(0, 0).eax < 7 {
                return Leaf7::default();
            }
            let sub0 = cpuid(7, 0);
            // Sub-leaf 0's EAX is the highest sub-leaf of leaf 7.
            let sub1_eax = if sub0.eax >= 1 { cpuid(7, 1).eax } else { 0 };
            let bit = |reg: u32, n: u32| reg & (1 << n) != 0;
            Leaf7 {
                amx_bf16: bit(sub0.edx, 22),
                amx_tile: bit(sub0.edx, 24),
                amx_int8: bit(sub0.edx, 25),
                avx_vnni: bit(sub1_eax, 4),
                avx512_bf16: bit(sub1_eax, 5),
            }
        }
    }

    /// Whether the OS enabled the AMX tile configuration and tile data states (XCR0 bits 17
    /// and 18).
    fn os_enables_amx() -> bool {
        // CPUID.1:ECX bit 27 (OSXSAVE): the OS turned on XSAVE, so XGETBV may be executed.
        let osxsave = cpuid(1, 0).ecx & (1 << 27) != 0;
        if !osxsave {
            return false;
        }
        // SAFETY: OSXSAVE is set, so the CPU supports XSAVE/XGETBV and the OS enabled it;
        // reading XCR0 has no side effects.
        let xcr0 = unsafe { read_xcr0() };
        xcr0 & (0b11 << 17) == (0b11 << 17)
    }

    /// Reads XCR0, the OS-enabled extended state mask.
    ///
    /// # Safety
    ///
    /// The CPU must support XSAVE and the OS must have enabled it (CPUID.1:ECX.OSXSAVE).
    #[target_feature(enable = "xsave")]
    #[allow(unused_unsafe)]
    unsafe fn read_xcr0() -> u64 {
        // SAFETY: the caller guarantees XGETBV is available; register 0 always exists.
        unsafe { arch::_xgetbv(0) }
    }

    /// Asks Linux for this process's permission to use the AMX tile data state; whether it
    /// was granted. Elsewhere AMX is not used (`false`).
    fn request_amx_permission() -> bool {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: the arch_prctl system call with these arguments only changes this
            // process's permission to use the AMX tile state; it reads no memory of ours.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                )
            };
            r == 0
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probed_once() {
        assert!(std::ptr::eq(get(), get()));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn queries_agree_with_std() {
        let f = get();
        assert_eq!(
            f.avx2_fma(),
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        );
        assert_eq!(
            f.avx2_fma_f16c(),
            f.avx2_fma() && is_x86_feature_detected!("f16c")
        );
        assert_eq!(f.avx512f(), is_x86_feature_detected!("avx512f"));
        assert_eq!(
            f.avx512_bw_vnni(),
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        );
        assert_eq!(
            f.avx512_vnni_vl_avx2_f16c(),
            f.avx2_fma_f16c()
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
        );
        // Each extension implies its base.
        assert!(!f.avx512bf16 || f.avx512f);
        assert!(!f.avx_vnni || f.avx2);
    }
}
