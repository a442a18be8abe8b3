//! The FP8 (e4m3) forward's launcher: the warp-specialized Hopper kernel with e4m3 q, k and v
//! (`flash_fwd_ws_<out dtype>_d<D>[_packed]_fp8`, cuda/sm90/fwd_ws.cu with FP8 traits), its
//! descale factors, and the errors where it cannot run.

use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result};
use float8::F8E4M3;
use half::{bf16, f16};

use super::abi::AttnParams;
use super::buffers::{lock_tensor, locked_ptr, seq_offsets, set_seq_offsets};
use super::catalogue::{Family, Kernel, Variant};
use super::overrides::overrides;
use super::runtime::{device_facts, poison};
use super::tma;
use crate::fp8_fwd::Fp8Descales;
use crate::params::Problem;
use crate::quant::FP8_BLOCK_ROWS;

/// FP8 forward: q, k, v F8E4M3 storages; returns `(out, lse)`, out `(b, sq, h, d)` (packed:
/// `(total_q, h, d)`) contiguous in `out_dtype` (F16 or BF16), lse as [`super::fwd`]'s.
pub(crate) fn fwd_fp8(
    problem: &Problem,
    descales: &Fp8Descales,
    out_dtype: DType,
    v_transposed: bool,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    match out_dtype {
        DType::F16 => fwd_fp8_typed::<f16>(problem, descales, out_dtype, v_transposed, q, k, v),
        DType::BF16 => fwd_fp8_typed::<bf16>(problem, descales, out_dtype, v_transposed, q, k, v),
        dt => {
            bail!("out_dtype: {dt:?} is not supported for FP8 inputs on CUDA, expected F16 or BF16")
        }
    }
}

/// Up to this many keys the narrowest key tile is taken: a 192-key tile pads 512 keys to
/// 576, and the 128 x 192 kernel ran 3% (non-causal) and 9% (causal) slower than 128 x 128
/// there, while from 1k keys it was 4-14% faster (H200; docs/archive/PERF.md, "the
/// constant-offset FP8 transposer"). d = 256 takes the same rule between its 64- and
/// 96-key tiles: the 96-key kernel ran 1.06-1.21x the 64-key one non-causal from 1k keys,
/// causal 0.99x at 1k and 1.09-1.20x from 2k, level at 512 (H200, two alternated rounds;
/// docs/archive/PERF.md, "the FP8 forward's wider key tiles measured"). With V given
/// transposed, d = 256's widest tile is 128 keys: 1.02-1.06x the 96-key `_vt` kernel from 2k
/// keys, causal or not, 0.97x at 1k non-causal and level causal (H100, two alternated rounds;
/// docs/archive/PERF.md, "d 256 with V transposed on 128-key tiles").
const FP8_NARROW_MAX_KEYS: usize = 512;

/// The FP8 kernel for head dim `d` (packed batches or not) over `sk` keys (the longest
/// sequence's), or the error that names what is compiled. The widest key tile that fits the
/// call: tiles of more than 128 keys straddle the 128-key blocks of per-block k and v
/// descales (`kv_blocks`), which take 128-key tiles, and short sequences take the narrowest
/// (`FP8_NARROW_MAX_KEYS`). `CANDLE_FLASH_WS_SHAPE=base` keeps the narrowest, `n<keys>` takes
/// that many keys instead of the widest where it fits (A/B runs). `vt`: V stored key-major
/// (the `_vt` kernels, which copy V^T as it is instead of transposing V).
fn kernel(d: usize, sk: usize, packed: bool, kv_blocks: bool, vt: bool) -> Result<Kernel> {
    if packed && vt {
        // FlashAttn::forward refuses the option on packed batches before any launch.
        bail!("v: a transposed V takes fixed-length batches only (no FP8 kernel reads it packed)")
    }
    let forced = overrides().ws_shape.as_str();
    let narrowest = forced == "base" || sk <= FP8_NARROW_MAX_KEYS;
    let forced_bn: Option<u16> = forced.strip_prefix('n').and_then(|n| n.parse().ok());
    let fits = |v: &Variant| {
        v.family == Family::FwdWs
            && usize::from(v.d) == d
            && v.fp8
            && v.packed == packed
            && v.vt == vt
            && (!kv_blocks || FP8_BLOCK_ROWS.is_multiple_of(usize::from(v.bn)))
    };
    let fitting = Kernel::ALL.iter().copied().filter(|k| fits(k.variant()));
    let bn = |k: &Kernel| k.variant().bn;
    let chosen = if narrowest {
        fitting.min_by_key(bn)
    } else {
        let forced = forced_bn.and_then(|n| fitting.clone().find(|k| bn(k) == n));
        forced.or_else(|| fitting.max_by_key(bn))
    };
    if let Some(k) = chosen {
        return Ok(k);
    }
    let mut dims: Vec<u16> = Kernel::ALL
        .iter()
        .map(|k| k.variant())
        .filter(|v| v.family == Family::FwdWs && v.fp8)
        .map(|v| v.d)
        .collect();
    dims.sort_unstable();
    dims.dedup();
    bail!("q: head_dim {d} has no FP8 kernel on CUDA, expected one of {dims:?}")
}

fn fwd_fp8_typed<T: CudaDType + DeviceRepr>(
    problem: &Problem,
    descales: &Fp8Descales,
    out_dtype: DType,
    v_transposed: bool,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    let s = problem.shape;
    let dev = q.device.clone();
    let facts = device_facts(&dev)?;
    if !facts.hopper() {
        bail!(
            "q: F8E4M3 attention needs a Hopper GPU (compute capability 9.x, e4m3 wgmma); \
             this one is {}.x: dequantize (candle_flash::quant::dequantize_fp8) and run the \
             f16/bf16 forward",
            facts.major
        )
    }
    let packed = problem.varlen.is_some();
    let kv_blocks = [&descales.k, &descales.v]
        .iter()
        .any(|t| Fp8Descales::strides(t)[2] != 0);
    let kernel = kernel(s.d, s.sk, packed, kv_blocks, v_transposed)?;
    let stream = dev.cuda_stream();
    let q_view = q.as_cuda_slice::<F8E4M3>()?.slice(ql.start_offset()..);
    let k_view = k.as_cuda_slice::<F8E4M3>()?.slice(kl.start_offset()..);
    let v_view = v.as_cuda_slice::<F8E4M3>()?.slice(vl.start_offset()..);
    // SAFETY: every element of out and lse is written by the kernel (rows < sq, cols < d).
    let mut out = unsafe { dev.alloc::<T>(s.q_elems())? };
    let mut lse = unsafe { dev.alloc::<f32>(s.h * s.total_q)? };
    poison(&stream, &mut out)?;
    poison(&stream, &mut lse)?;

    {
        // A transposed V's strides are not those of a (batch, keys, heads, d) layout: its
        // tensor map is built from them below, the parameter block takes k's.
        let mut params = AttnParams::new(problem, ql, kl, if v_transposed { kl } else { vl })?;
        let offsets = seq_offsets(problem, &dev)?;
        let _offset_syncs = set_seq_offsets(&mut params, &offsets, &stream);
        let (q_ptr, _q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, _k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, _v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(&stream);
        let (lse_ptr, _lse_sync) = lse.device_ptr_mut(&stream);
        (params.q, params.k, params.v, params.o, params.lse) =
            (q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr);

        let packed_rows = problem.varlen.as_ref().map(|_| (s.total_q, s.total_k));
        // (batch, heads_k, d, keys rounded up to 16), contiguous (fp8_fwd checked it).
        let v_transposed = v_transposed.then(|| {
            let st = vl.stride();
            tma::TransposedV {
                keys: vl.dims()[3],
                strides: [st[2] as i64, st[1] as i64, st[0] as i64],
            }
        });
        let Some(mut ws) = tma::fwd_params(
            &params,
            DType::F8E4M3,
            out_dtype,
            kernel,
            packed_rows,
            v_transposed,
        ) else {
            bail!(
                "q: the FP8 kernel copies with TMA, which needs q, k and v with 16-byte aligned \
                 starts and row, head and batch strides (a multiple of 16 elements, none \
                 broadcast)"
            )
        };
        let locks = [&descales.q, &descales.k, &descales.v].map(|t| lock_tensor(Some(t)));
        let (q_descale, _qd_sync) = locked_ptr::<f32, _>(&locks[0], &stream, "fp8_descales")?;
        let (k_descale, _kd_sync) = locked_ptr::<f32, _>(&locks[1], &stream, "fp8_descales")?;
        let (v_descale, _vd_sync) = locked_ptr::<f32, _>(&locks[2], &stream, "fp8_descales")?;
        (ws.q_descale, ws.k_descale, ws.v_descale) = (q_descale, k_descale, v_descale);
        let strides = |t: &candle::Tensor| -> Result<[i32; 3]> {
            let s = Fp8Descales::strides(t);
            if t.elem_count() > i32::MAX as usize {
                bail!(
                    "fp8_descales: {} factors exceed the kernel's 32-bit index",
                    t.elem_count()
                )
            }
            Ok(s.map(|x| x as i32))
        };
        ws.q_descale_strides = strides(&descales.q)?;
        ws.k_descale_strides = strides(&descales.k)?;
        ws.v_descale_strides = strides(&descales.v)?;

        super::fwd::launch_ws(
            kernel,
            out_dtype,
            ws,
            problem,
            problem.causal || packed,
            &dev,
            facts.sms,
        )?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bn(d: usize, packed: bool, kv_blocks: bool) -> u16 {
        kernel(d, 4096, packed, kv_blocks, false)
            .unwrap()
            .variant()
            .bn
    }

    #[test]
    fn the_widest_key_tile_that_fits_the_descales() {
        // Without CANDLE_FLASH_WS_SHAPE (the environment of `cargo test`).
        if !overrides().ws_shape.is_empty() {
            return;
        }
        // (head dim, packed, per-block k/v descales) -> key tile past 512 keys: per-block
        // descales take tiles inside one 128-row block (96 keys would straddle them).
        for (d, packed, kv_blocks, want) in [
            (128, false, false, 192),
            (128, false, true, 128),
            (128, true, false, 192),
            (128, true, true, 128),
            (256, false, false, 96),
            (256, false, true, 64),
            (256, true, false, 96),
        ] {
            assert_eq!(
                bn(d, packed, kv_blocks),
                want,
                "d {d}, packed {packed}, per-block {kv_blocks}"
            );
        }
        assert_eq!(
            kernel(256, 512, false, false, false).unwrap().variant().bn,
            64
        );
        assert_eq!(
            kernel(128, 512, false, false, false).unwrap().variant().bn,
            128
        );
        assert_eq!(
            kernel(128, 513, true, false, false).unwrap().variant().bn,
            192
        );
        assert!(kernel(64, 4096, false, false, false).is_err());
        // Key-major V: the same tiles at d = 128, 128 keys at d = 256 past 512 (with per-block
        // descales too); fixed-length batches only.
        for (d, sk, kv_blocks, want) in [
            (128, 4096, false, 192),
            (128, 4096, true, 128),
            (128, 512, false, 128),
            (256, 512, false, 64),
            (256, 4096, false, 128),
            (256, 4096, true, 128),
        ] {
            let v = kernel(d, sk, false, kv_blocks, true).unwrap().variant();
            assert!(v.vt && !v.packed, "d {d}: {v:?}");
            assert_eq!(v.bn, want, "d {d}, {sk} keys, per-block {kv_blocks}");
        }
        assert!(kernel(128, 4096, true, false, true).is_err());
    }

    /// Every FP8 problem at a head dim with FP8 kernels has one, for every key count, packed
    /// or not, with or without per-block k/v descales, that fits a Hopper block's shared
    /// memory (227 KB) and whose key tiles stay inside the descales' 128-row blocks; every
    /// other head dim the CUDA path takes is an error that names the compiled ones.
    #[test]
    fn every_fp8_problem_has_a_kernel_that_fits() {
        if !overrides().ws_shape.is_empty() {
            return;
        }
        let compiled = |d: usize| {
            Kernel::ALL.iter().any(|k| {
                let v = k.variant();
                v.family == Family::FwdWs && v.fp8 && usize::from(v.d) == d
            })
        };
        for d in (8..=256).step_by(8) {
            for sk in [1, 512, 513, 1023, 16384] {
                for (packed, kv_blocks, vt) in (0..8).map(|i| (i & 1 == 1, i & 2 == 2, i & 4 == 4))
                {
                    let what = format!(
                        "d {d}, {sk} keys, packed {packed}, per-block {kv_blocks}, vt {vt}"
                    );
                    match kernel(d, sk, packed, kv_blocks, vt) {
                        Err(e) if packed && vt => {
                            assert!(e.to_string().contains("fixed-length"), "{what}: {e}")
                        }
                        Ok(k) => {
                            let (v, g) = (k.variant(), k.geometry());
                            assert!(
                                v.fp8 && usize::from(v.d) == d && v.packed == packed && v.vt == vt,
                                "{what}: {v:?}"
                            );
                            assert!(g.smem as usize <= 227 * 1024, "{what}: {} B", g.smem);
                            let bn = usize::from(v.bn);
                            assert!(
                                !kv_blocks || FP8_BLOCK_ROWS.is_multiple_of(bn),
                                "{what}: {bn} keys"
                            );
                            let panel = g.vt_panel_keys as usize;
                            assert_eq!(panel != 0, vt, "{what}: panel {panel}");
                            assert!(panel == 0 || bn.is_multiple_of(panel), "{what}: {panel}");
                        }
                        Err(e) => {
                            assert!(!compiled(d), "{what}: {e}");
                            assert!(e.to_string().contains("head_dim"), "{what}: {e}");
                        }
                    }
                }
            }
        }
        assert!(compiled(128) && compiled(256));
    }
}
