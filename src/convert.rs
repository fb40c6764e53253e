//! TEMP shim
use crate::error::Result;
use half::{bf16, f16};
pub fn fp16_to_fp32_row(s: &[f16], d: &mut [f32]) -> Result<()> {
    for (a, b) in d.iter_mut().zip(s) {
        *a = b.to_f32();
    }
    Ok(())
}
pub fn bf16_to_fp32_row(s: &[bf16], d: &mut [f32]) -> Result<()> {
    for (a, b) in d.iter_mut().zip(s) {
        *a = b.to_f32();
    }
    Ok(())
}
pub fn fp32_to_fp16_row(s: &[f32], d: &mut [f16]) -> Result<()> {
    for (a, b) in d.iter_mut().zip(s) {
        *a = f16::from_f32(*b);
    }
    Ok(())
}
pub fn fp32_to_bf16_row(s: &[f32], d: &mut [bf16]) -> Result<()> {
    for (a, b) in d.iter_mut().zip(s) {
        *a = bf16::from_f32(*b);
    }
    Ok(())
}
