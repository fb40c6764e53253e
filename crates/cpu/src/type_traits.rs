//! The CPU's per-type traits (ggml's `get_type_traits_cpu`): how to convert f32 rows into a
//! type, and the dot product the matrix-vector kernels use for it with its partner type.
//!
//! Rows are byte slices so one signature serves every type, quantized ones included. A row of
//! `n` elements of type `t` takes `t.row_size(n)` bytes; the functions check the lengths.

use half::{bf16, f16};

use super::kernels::{block_dot, quant_dot};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Converts `n` f32 values into a row of the type (`out` holds `row_size(n)` bytes).
pub type FromFloat = fn(&[f32], &mut [u8]) -> Result<()>;

/// Dot product of `n` elements: a row of the type and a row of its `vec_dot_type`.
pub type VecDot = fn(usize, &[u8], &[u8]) -> Result<f32>;

/// What the CPU backend knows about one type.
#[derive(Debug, Clone, Copy)]
pub struct CpuTypeTraits {
    /// The type these traits describe.
    pub dtype: DType,
    /// f32 → this type, if the CPU can produce it.
    pub from_float: Option<FromFloat>,
    /// The dot product with [`CpuTypeTraits::vec_dot_type`] rows, if any.
    pub vec_dot: Option<VecDot>,
    /// The type the other operand of `vec_dot` must have (activations are converted to it).
    pub vec_dot_type: DType,
    /// Rows one `vec_dot` call handles.
    pub nrows: usize,
}

fn check(what: &str, dtype: DType, n: usize, bytes: usize) -> Result<()> {
    let need = dtype.row_size(n)?;
    if bytes != need {
        return Err(Error::shape(format!(
            "{what}: {n} {} elements take {need} bytes, got {bytes}",
            dtype.name()
        )));
    }
    Ok(())
}

fn from_f32(x: &[f32], out: &mut [u8]) -> Result<()> {
    check("from_float f32", DType::F32, x.len(), out.len())?;
    out.copy_from_slice(bytemuck::cast_slice(x));
    Ok(())
}

/// f32 → a 16-bit float type with `convert`, straight into `out` when it is 2-byte aligned,
/// else through a temporary row.
fn from_f32_to_16<T: bytemuck::Pod>(
    what: &str,
    dtype: DType,
    x: &[f32],
    out: &mut [u8],
    convert: fn(&[f32], &mut [T]) -> Result<()>,
) -> Result<()> {
    check(what, dtype, x.len(), out.len())?;
    match bytemuck::try_cast_slice_mut::<u8, T>(out) {
        Ok(direct) => convert(x, direct),
        Err(_) => {
            let mut tmp = vec![T::zeroed(); x.len()];
            convert(x, &mut tmp)?;
            out.copy_from_slice(bytemuck::cast_slice(&tmp));
            Ok(())
        }
    }
}

fn from_f16(x: &[f32], out: &mut [u8]) -> Result<()> {
    from_f32_to_16::<f16>(
        "from_float f16",
        DType::F16,
        x,
        out,
        crate::convert::fp32_to_fp16_row,
    )
}

fn from_bf16(x: &[f32], out: &mut [u8]) -> Result<()> {
    from_f32_to_16::<bf16>(
        "from_float bf16",
        DType::BF16,
        x,
        out,
        crate::convert::fp32_to_bf16_row,
    )
}

fn from_q8_0(x: &[f32], out: &mut [u8]) -> Result<()> {
    check("from_float q8_0", DType::Q8_0, x.len(), out.len())?;
    quant_dot::quantize_row_q8_0(x, out);
    Ok(())
}

fn from_q4_0(x: &[f32], out: &mut [u8]) -> Result<()> {
    check("from_float q4_0", DType::Q4_0, x.len(), out.len())?;
    quant_dot::quantize_row_q4_0(x, out);
    Ok(())
}

fn dot_f32(n: usize, x: &[u8], y: &[u8]) -> Result<f32> {
    check("vec_dot f32", DType::F32, n, x.len())?;
    check("vec_dot f32", DType::F32, n, y.len())?;
    let (a, b) = (widen(x, |v: f32| v), widen(y, |v: f32| v));
    Ok(quant_dot::dot_f32(&a, &b))
}

fn widen<T: Copy + bytemuck::Pod>(bytes: &[u8], f: fn(T) -> f32) -> Vec<f32> {
    bytes
        .chunks_exact(std::mem::size_of::<T>())
        .map(|c| f(bytemuck::pod_read_unaligned(c)))
        .collect()
}

fn dot_f16(n: usize, x: &[u8], y: &[u8]) -> Result<f32> {
    check("vec_dot f16", DType::F16, n, x.len())?;
    check("vec_dot f16", DType::F16, n, y.len())?;
    let (a, b) = (widen(x, f16::to_f32), widen(y, f16::to_f32));
    Ok(quant_dot::dot_f32(&a, &b))
}

fn dot_bf16(n: usize, x: &[u8], y: &[u8]) -> Result<f32> {
    check("vec_dot bf16", DType::BF16, n, x.len())?;
    check("vec_dot bf16", DType::BF16, n, y.len())?;
    let (a, b) = (widen(x, bf16::to_f32), widen(y, bf16::to_f32));
    Ok(quant_dot::dot_f32(&a, &b))
}

fn dot_q8_0(n: usize, x: &[u8], y: &[u8]) -> Result<f32> {
    check("vec_dot q8_0", DType::Q8_0, n, x.len())?;
    check("vec_dot q8_0", DType::Q8_0, n, y.len())?;
    Ok(quant_dot::dot_q8_0_q8_0(x, y))
}

fn dot_q4_0(n: usize, x: &[u8], y: &[u8]) -> Result<f32> {
    check("vec_dot q4_0", DType::Q4_0, n, x.len())?;
    check("vec_dot q4_0 (partner q8_0)", DType::Q8_0, n, y.len())?;
    Ok(quant_dot::dot_q4_0_q8_0(x, y))
}

/// f32 → a block type other than q8_0/q4_0 (ggml id `ID`), with the CPU's fastest codec for
/// it (`quant_dot::quantize_row`: vectorised q8_1, else the reference quantizer).
fn from_block<const ID: u32>(x: &[f32], out: &mut [u8]) -> Result<()> {
    let dtype = DType::from_ggml_type_id(ID)?;
    check("from_float", dtype, x.len(), out.len())?;
    quant_dot::quantize_row(dtype, x, out)
}

/// A block type (ggml id `ID`) · its partner type, with the fastest kernel of this CPU.
fn dot_block<const ID: u32>(n: usize, x: &[u8], y: &[u8]) -> Result<f32> {
    let dtype = DType::from_ggml_type_id(ID)?;
    let partner = block_dot::vec_dot_type(dtype)
        .ok_or_else(|| Error::unsupported(format!("vec_dot {}", dtype.name())))?;
    check("vec_dot", dtype, n, x.len())?;
    check("vec_dot (partner)", partner, n, y.len())?;
    let dot = block_dot::dot_fn(dtype)
        .ok_or_else(|| Error::unsupported(format!("vec_dot {}", dtype.name())))?;
    Ok(dot(x, y))
}

/// The traits of the block types other than q8_0/q4_0, by ggml id (`ID` must be `dtype`'s).
/// Types without a quantizer ([`DType::has_quantizer`]: the i-quants below 4 bits) have no
/// `from_float`, as in ggml.
fn block_traits<const ID: u32>(dtype: DType) -> (Option<FromFloat>, Option<VecDot>, DType) {
    let from_float = dtype
        .has_quantizer()
        .then_some(from_block::<ID> as FromFloat);
    match block_dot::vec_dot_type(dtype) {
        Some(partner) => (from_float, Some(dot_block::<ID>), partner),
        // Activation-only types (q8_1, q8_K): produced from f32, no product of their own.
        None => (from_float, None, dtype),
    }
}

/// The CPU traits of `dtype`.
pub fn type_traits(dtype: DType) -> CpuTypeTraits {
    let (from_float, vec_dot, vec_dot_type): (Option<FromFloat>, Option<VecDot>, DType) =
        match dtype {
            DType::F32 => (Some(from_f32), Some(dot_f32), DType::F32),
            DType::F16 => (Some(from_f16), Some(dot_f16), DType::F16),
            DType::BF16 => (Some(from_bf16), Some(dot_bf16), DType::BF16),
            DType::Q8_0 => (Some(from_q8_0), Some(dot_q8_0), DType::Q8_0),
            DType::Q4_0 => (Some(from_q4_0), Some(dot_q4_0), DType::Q8_0),
            DType::Q4_1 => block_traits::<3>(dtype),
            DType::Q5_0 => block_traits::<6>(dtype),
            DType::Q5_1 => block_traits::<7>(dtype),
            DType::Q8_1 => block_traits::<9>(dtype),
            DType::Q2_K => block_traits::<10>(dtype),
            DType::Q3_K => block_traits::<11>(dtype),
            DType::Q4_K => block_traits::<12>(dtype),
            DType::Q5_K => block_traits::<13>(dtype),
            DType::Q6_K => block_traits::<14>(dtype),
            DType::Q8_K => block_traits::<15>(dtype),
            DType::IQ4_NL => block_traits::<20>(dtype),
            DType::IQ4_XS => block_traits::<23>(dtype),
            DType::IQ2_XXS => block_traits::<16>(dtype),
            DType::IQ2_XS => block_traits::<17>(dtype),
            DType::IQ3_XXS => block_traits::<18>(dtype),
            DType::IQ1_S => block_traits::<19>(dtype),
            DType::IQ3_S => block_traits::<21>(dtype),
            DType::IQ2_S => block_traits::<22>(dtype),
            DType::IQ1_M => block_traits::<29>(dtype),
            DType::TQ1_0 => block_traits::<34>(dtype),
            DType::TQ2_0 => block_traits::<35>(dtype),
            DType::MXFP4 => block_traits::<39>(dtype),
            DType::NVFP4 => block_traits::<40>(dtype),
            DType::Q1_0 => block_traits::<41>(dtype),
            DType::Q2_0 => block_traits::<42>(dtype),
            other => (None, None, other),
        };
    CpuTypeTraits {
        dtype,
        from_float,
        vec_dot,
        vec_dot_type,
        nrows: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(dtype: DType, x: &[f32]) -> Vec<u8> {
        let traits = type_traits(dtype);
        let mut out = vec![0u8; dtype.row_size(x.len()).unwrap()];
        (traits.from_float.unwrap())(x, &mut out).unwrap();
        out
    }

    #[test]
    fn dot_products_match_f64_within_type_error() {
        let n = 64;
        let x: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.25).collect();
        let y: Vec<f32> = (0..n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.5).collect();
        let exact: f64 = x.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
        for (dtype, tol) in [
            (DType::F32, 1e-5),
            (DType::F16, 1e-3),
            (DType::BF16, 2e-2),
            (DType::Q8_0, 2e-2),
            (DType::Q4_0, 1.5e-1),
        ] {
            let traits = type_traits(dtype);
            let xs = row(dtype, &x);
            let ys = row(traits.vec_dot_type, &y);
            let got = (traits.vec_dot.unwrap())(n, &xs, &ys).unwrap();
            let rel = (got as f64 - exact).abs() / exact.abs().max(1.0);
            assert!(rel < tol, "{dtype:?}: {got} vs {exact}");
            assert_eq!(traits.nrows, 1);
        }
        assert_eq!(type_traits(DType::Q4_0).vec_dot_type, DType::Q8_0);
        assert!(type_traits(DType::I32).vec_dot.is_none());
    }

    /// from_float into an aligned and a misaligned byte slice gives the same bytes (the
    /// 16-bit types convert in place when they can, through a temporary row when not).
    #[test]
    fn half_from_float_any_alignment() {
        let x: Vec<f32> = (0..19).map(|i| i as f32 * 0.37 - 3.0).collect();
        for dtype in [DType::F16, DType::BF16] {
            let from = type_traits(dtype).from_float.unwrap();
            let mut aligned = vec![0u16; x.len()];
            from(&x, bytemuck::cast_slice_mut(&mut aligned)).unwrap();
            let mut buf = vec![0u8; 2 * x.len() + 1];
            from(&x, &mut buf[1..]).unwrap();
            assert_eq!(
                &buf[1..],
                bytemuck::cast_slice::<u16, u8>(&aligned),
                "{dtype:?}"
            );
            assert_ne!(aligned, vec![0u16; x.len()]);
        }
    }

    #[test]
    fn lengths_are_checked() {
        let traits = type_traits(DType::F16);
        let mut out = vec![0u8; 3];
        assert!((traits.from_float.unwrap())(&[1.0, 2.0], &mut out).is_err());
        assert!((traits.vec_dot.unwrap())(4, &[0; 8], &[0; 6]).is_err());
        let q = type_traits(DType::Q8_0);
        let mut out = vec![0u8; 34];
        assert!((q.from_float.unwrap())(&[0.0; 31], &mut out).is_err());
    }
}
