//! TEMP shim
use crate::error::Result;
use half::f16;
pub const QK8_0: usize = 32;
pub const QK4_0: usize = 32;
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}
pub fn blocks_q8_0(_b: &[u8]) -> Result<&[BlockQ8_0]> {
    todo!()
}
pub fn blocks_q4_0(_b: &[u8]) -> Result<&[BlockQ4_0]> {
    todo!()
}
pub fn blocks_q8_0_mut(_b: &mut [u8]) -> Result<&mut [BlockQ8_0]> {
    todo!()
}
pub fn blocks_q4_0_mut(_b: &mut [u8]) -> Result<&mut [BlockQ4_0]> {
    todo!()
}
pub fn dequantize_row_q8_0(_x: &[BlockQ8_0], _y: &mut [f32]) -> Result<()> {
    todo!()
}
pub fn dequantize_row_q4_0(_x: &[BlockQ4_0], _y: &mut [f32]) -> Result<()> {
    todo!()
}
pub fn quantize_row_q8_0_ref(_x: &[f32], _y: &mut [BlockQ8_0]) -> Result<()> {
    todo!()
}
pub fn quantize_row_q4_0_ref(_x: &[f32], _y: &mut [BlockQ4_0]) -> Result<()> {
    todo!()
}
