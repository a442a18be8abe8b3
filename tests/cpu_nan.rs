//! NaN in, NaN out on the CPU: output, LSE and gradients of the rows that meet a NaN, and
//! only those (tests/common/nan.rs; the GPU suite runs the same checks).

mod common;

use candle::{Device, Result};

#[test]
fn nan_query_row() -> Result<()> {
    common::nan::nan_query(&Device::Cpu)
}

#[test]
fn nan_key_causal_apart_from_rows_without_keys() -> Result<()> {
    common::nan::nan_key_causal(&Device::Cpu)
}

#[test]
fn nan_key_in_a_decode_cache() -> Result<()> {
    common::nan::nan_in_cache(&Device::Cpu)
}
