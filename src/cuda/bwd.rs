//! Backward launchers (`cuda/sm80/bwd.cu`): dsum, then either
//! - the dK/dV kernel and the dQ kernel (deterministic; any head dim), or
//! - for d <= 128 when the caller allows non-determinism (the default): one kernel for dK, dV
//!   and dQ, dQ summed with f32 atomics into a zeroed buffer, then a convert kernel.
//!
//! On Hopper at d 64 and 128, for batches whose tensors TMA can address, the fused kernel is
//! the warp-specialized one (`cuda/sm90/bwd_ws.cu`, launched by [`super::bwd_ws`]; packed
//! batches in its `_packed` kernels, dropout in its `_dropout` and `_packed_dropout` ones, a
//! softcap without ALiBi at d 64 and 128 in its `_cap` ones);
//! packed batches with a softcap, ALiBi or block mask there take the first wgmma kernel
//! (`cuda/sm90/bwd.cu`), dropout with one the mma.sync `_dropout` kernel.
//! At head dims 65-96 its d = 128 kernel and at 129-256 its d = 256 kernel also run (the
//! columns past the head dim zero), under the same conditions (65-96: without a block mask or
//! a `CANDLE_FLASH_BWD` override). It has a deterministic mode (the key blocks add dQ in
//! order; under a block mask in its `_sparse_det` kernels): `deterministic(true)` runs it
//! there, and the dK/dV and dQ kernels elsewhere.
//! Elsewhere the mma.sync fused kernel takes 128 keys per block over 8
//! warps where that variant is compiled (d 64 and 128, no dropout) and fits, with twice the
//! streamed query rows where 158 KB of shared memory is allowed (A100, Hopper: +3-5% at d 64,
//! even at d 128; docs/archive/PERF.md, "a taller 128-key backward"), else 64 keys over 4
//! warps: at hd 128, seqlen 8k the 128-key shape measured 207 against 192 TFLOP/s (H200;
//! docs/archive/PERF.md, "backward: dQ by atomics in the dK/dV kernel, double-buffered Q/dO").
//!
//! `CANDLE_FLASH_BWD` (read once) overrides the choice for A/B comparisons of speed and
//! accuracy: `separate` forces the deterministic kernels everywhere; `sm90` the first wgmma
//! kernel on Hopper; `bn64`, `bn128` and `bn128t` (128 keys, twice the query rows per tile)
//! force the mma.sync fused kernel of that shape.

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result, Tensor};
use half::{bf16, f16};

use super::bwd_ws::{self, BwdWsBuffers, BwdWsShape};
use super::{
    device_facts, dtype_name, launch, lock_slopes, lock_sparse, locked_ptr, poison, seq_offsets,
    set_seq_offsets, sparse_ptrs, tma, AttnParams, BwdParams, FwdTile,
};
use crate::params::Problem;

/// Backward tile shapes for one compiled head dim; mirror of `BwdConfig` and
/// `BwdFusedConfig` in `cuda/sm80/bwd_traits.cuh`.
#[derive(Clone, Copy, Debug)]
struct BwdTile {
    d: usize,
    /// dK/dV output columns per block.
    d_out: usize,
    kv_bn: usize,
    kv_bm: usize,
    q_bm: usize,
    q_bn: usize,
    /// Streamed query rows per tile of the fused dK/dV/dQ kernel.
    fused_bm: usize,
    /// d = 256's dK/dV kernel with 16-row tiles (`BwdKvSmall256`), for 99 KB devices.
    kv_small: bool,
}

/// The fused kernel double-buffers its Q/dO tiles (and their row statistics).
const FUSED_STAGES: usize = 2;

impl BwdTile {
    fn for_head_dim(d: usize) -> Self {
        let d = FwdTile::for_head_dim(d).d;
        Self {
            d,
            d_out: if d <= 128 { d } else { d / 2 },
            kv_bn: 64,
            kv_bm: if d <= 96 { 64 } else { 32 },
            q_bm: 64,
            q_bn: if d <= 128 { 64 } else { 32 },
            fused_bm: if d <= 96 { 64 } else { 32 },
            kv_small: false,
        }
    }

    /// This tile, or where its dK/dV kernel needs more than `smem` bytes of shared memory
    /// (d = 256 on a 99 KB device: 99.3 KB), the 16-row one (84 KB).
    fn fit(self, smem: usize) -> Self {
        if self.kv_smem_bytes() as usize <= smem || self.d != 256 {
            return self;
        }
        Self {
            kv_bm: 16,
            kv_small: true,
            ..self
        }
    }

    /// The dK/dV kernel's name suffix.
    fn kv_suffix(&self) -> &'static str {
        if self.kv_small {
            "_s16"
        } else {
            ""
        }
    }
    /// Whether the fused kernel exists: one block must own all of dK and dV's columns.
    fn has_fused(&self) -> bool {
        self.d <= 128
    }
    fn has_fused_wide(&self) -> bool {
        self.d == 64 || self.d == 128
    }
    const THREADS: u32 = 128;
    fn splits(&self) -> usize {
        self.d / self.d_out
    }
    fn kv_smem_bytes(&self) -> u32 {
        ((2 * self.kv_bn + 2 * self.kv_bm) * (self.d + 8) * 2 + 2 * self.kv_bm * 4) as u32
    }
    fn q_smem_bytes(&self) -> u32 {
        ((2 * self.q_bm + 2 * self.q_bn) * (self.d + 8) * 2) as u32
    }
    /// K, V (`bn` keys); per stage Q, dO (`bm` rows), LSE and dsum; the dS^T tile
    /// (`bn` x `bm` + 8).
    fn fused_smem_bytes(&self, bn: usize, bm: usize) -> u32 {
        ((2 * bn + 2 * FUSED_STAGES * bm) * (self.d + 8) * 2
            + bn * (bm + 8) * 2
            + 2 * FUSED_STAGES * bm * 4) as u32
    }
}

/// Keys per block of the wgmma backward kernel (`BwdSm90Traits` in `cuda/sm90/bwd.cu`).
const SM90_BN: usize = 128;

/// K, V (128 keys), two stages of Q, dO (64 rows) and their row statistics, the dS^T tile
/// (128 x 64), unpadded (swizzled) rows, plus 1 KB for the alignment.
fn sm90_smem_bytes(d: usize) -> u32 {
    (2 * SM90_BN * d * 2 + 4 * 64 * d * 2 + SM90_BN * 64 * 2 + 4 * 64 * 4 + 1024) as u32
}

/// Which backward kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BwdPath {
    /// dK/dV kernel + dQ kernel: deterministic, every head dim.
    Separate,
    /// dK/dV/dQ kernel with atomic dQ + convert kernel, of one block shape.
    Fused(FusedShape),
    /// The wgmma dK/dV/dQ kernel (`cuda/sm90/bwd.cu`) + convert kernel: d 64 and 128 on
    /// Hopper, no dropout.
    Sm90,
    /// The warp-specialized kernels (`cuda/sm90/bwd_ws.cu`): where `Sm90` runs, and at head
    /// dims 65-96 and 129-256 on Hopper, for batches whose tensors TMA can address
    /// (`bwd_ws::supported`), with dropout too, deterministic too (under a block mask its
    /// `_sparse_det` kernels).
    Ws(BwdWsShape),
}

/// Block shapes of the mma.sync fused kernel (`BwdFusedConfig` in `cuda/sm80/bwd_traits.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FusedShape {
    /// 64 keys over 4 warps; the only shape with a dropout variant.
    Bn64,
    /// 128 keys over 8 warps (FA2's d = 128 shape).
    Bn128,
    /// 128 keys over 8 warps and twice the streamed query rows.
    Bn128Tall,
}

/// One fused shape's launch geometry (for the head dim's tile, with or without dropout).
#[derive(Clone, Copy, Debug)]
struct FusedGeometry {
    /// Keys per block.
    bn: usize,
    warps: u32,
    /// Streamed query rows per tile: also the row tile of its dq_accum.
    bm: usize,
    /// The shape's name suffix; its dK/dV/dQ kernel adds `_dropout` with dropout, its
    /// convert kernel (one per warp layout) does not.
    suffix: &'static str,
}

impl FusedShape {
    fn geometry(self, tile: &BwdTile) -> FusedGeometry {
        let (bn, warps, bm, suffix) = match self {
            Self::Bn64 => (64, 4, tile.fused_bm, ""),
            Self::Bn128 => (128, 8, tile.fused_bm, "_bn128"),
            Self::Bn128Tall => (128, 8, 2 * tile.fused_bm, "_bn128t"),
        };
        FusedGeometry {
            bn,
            warps,
            bm,
            suffix,
        }
    }
}

/// The `CANDLE_FLASH_BWD` override (overrides.rs): `separate`, `bn64`, `bn128`, `bn128t` or
/// unset.
fn bwd_override() -> Option<&'static str> {
    super::overrides::overrides().bwd.as_deref()
}

/// What the backward's kernel choice depends on.
#[derive(Clone, Copy)]
struct BwdProblem<'a> {
    tile: &'a BwdTile,
    deterministic: bool,
    dropout: bool,
    /// A block mask.
    sparse: bool,
    /// Hopper, whatever CANDLE_FLASH_FWD says: that switch is the forward's.
    hopper: bool,
    /// The bytes of shared memory a block may use on the device.
    smem: usize,
}

impl BwdPath {
    /// The warp-specialized kernel where one runs the head dim (`tma::ws_head_dim`: 65-96 on
    /// d = 128, 129-224 on d = 256), else `without_ws`.
    fn choose(c: &BwdProblem) -> Self {
        Self::ws(c).map_or_else(|| Self::without_ws(c), Self::Ws)
    }

    /// The warp-specialized kernel of the head dim's class, on Hopper, deterministic or not
    /// (`bwd_ws::supported` then says whether a kernel of the problem's variant runs it).
    /// `CANDLE_FLASH_BWD` (A/B runs) keeps it off: `separate` everywhere; `sm90`, `bn64`, `bn128`, `bn128t` where those kernels exist (64-128), but `bn*` under a
    /// block mask at 64/128 still runs it (the fused mma.sync kernels have no `_sparse`
    /// variant). Head dims 65-96 under a block mask keep the mma.sync kernels (measured only
    /// without one).
    fn ws(c: &BwdProblem) -> Option<BwdWsShape> {
        let env = bwd_override();
        let d = tma::ws_head_dim(c.tile.d)?;
        let allowed = match env {
            None => !(c.sparse && c.tile.d == 96),
            Some("separate") => false,
            Some("sm90") => c.tile.d > 192,
            Some(_) => c.tile.d > 192 || (c.sparse && c.tile.has_fused_wide()),
        };
        if !c.hopper || !allowed {
            return None;
        }
        BwdWsShape::for_head_dim(d)
    }

    /// The kernels before the warp-specialized one; also where it was chosen but cannot run
    /// (packed batches, tensors TMA cannot address). The first wgmma kernel at 64/128, else
    /// the mma.sync fused kernels up to 128, else the dK/dV and dQ kernels. The 128-key fused
    /// shapes (115 and 158 KB at d = 128) run only where they fit in `smem`, the tall one
    /// first. Under a block mask the mma.sync kernels run the separate path, whose dK/dV
    /// kernel has the `_sparse` variant (the fused ones have none: the walk cost them
    /// registers).
    fn without_ws(c: &BwdProblem) -> Self {
        let BwdProblem {
            tile,
            deterministic,
            dropout,
            sparse,
            hopper,
            smem,
            ..
        } = *c;
        let env = bwd_override();
        let wgmma = hopper && tile.has_fused_wide() && !dropout;
        if deterministic || !tile.has_fused() || env == Some("separate") || (sparse && !wgmma) {
            Self::Separate
        } else if wgmma && (env.is_none() || env == Some("sm90") || sparse) {
            Self::Sm90
        } else {
            let fits = |shape: FusedShape| {
                let g = shape.geometry(tile);
                tile.has_fused_wide()
                    && !dropout
                    && tile.fused_smem_bytes(g.bn, g.bm) as usize <= smem
            };
            // The first that fits of the allowed 128-key shapes; 64 keys otherwise.
            let wide: &[FusedShape] = match env {
                Some("bn64") => &[],
                Some("bn128") => &[FusedShape::Bn128],
                _ => &[FusedShape::Bn128Tall, FusedShape::Bn128],
            };
            Self::Fused(
                wide.iter()
                    .copied()
                    .find(|&s| fits(s))
                    .unwrap_or(FusedShape::Bn64),
            )
        }
    }
}

fn cuda_storage<'a>(storage: &'a candle::Storage, name: &str) -> Result<&'a CudaStorage> {
    match storage {
        candle::Storage::Cuda(s) => Ok(s),
        _ => bail!("flash-attn backward: {name} is not on the CUDA device like q"),
    }
}

/// Backward pass: returns one buffer `[dq | dk | dv]` in q's dtype, dq `(b, sq, h, d)` and
/// dk, dv `(b, sk, hk, d)`, all contiguous. `out`, `grad_out` and `lse` are contiguous.
/// With `deterministic`, no floating-point atomics (dQ has a pass of its own); otherwise dQ's
/// summation order over key blocks varies from run to run where the fused kernel exists.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bwd(
    problem: &Problem,
    deterministic: bool,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<CudaStorage> {
    match q.0.dtype() {
        DType::F16 => bwd_typed::<f16>(problem, deterministic, q, k, v, out, grad_out, lse),
        DType::BF16 => bwd_typed::<bf16>(problem, deterministic, q, k, v, out, grad_out, lse),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

#[allow(clippy::too_many_arguments)]
fn bwd_typed<T: CudaDType + DeviceRepr>(
    problem: &Problem,
    deterministic: bool,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<CudaStorage> {
    let s = problem.shape;
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let facts = device_facts(&dev)?;
    let tile = BwdTile::for_head_dim(s.d).fit(facts.smem);
    let dtype = dtype_name(q.dtype())?;

    let (o_storage, o_layout) = out.storage_and_layout();
    let (do_storage, do_layout) = grad_out.storage_and_layout();
    let (lse_storage, lse_layout) = lse.storage_and_layout();
    let o = cuda_storage(&o_storage, "out")?.as_cuda_slice::<T>()?;
    let d_o = cuda_storage(&do_storage, "grad_out")?.as_cuda_slice::<T>()?;
    let lse_in = cuda_storage(&lse_storage, "lse")?.as_cuda_slice::<f32>()?;
    let o_view = o.slice(o_layout.start_offset()..);
    let do_view = d_o.slice(do_layout.start_offset()..);
    let lse_view = lse_in.slice(lse_layout.start_offset()..);
    let q_view = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
    let k_view = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
    let v_view = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);

    let (nq, nkv) = (s.q_elems(), s.kv_elems());
    // SAFETY: the kernels write every element of dq, dk, dv (rows < seqlen, cols < d).
    let mut grads = unsafe { dev.alloc::<T>(nq + 2 * nkv)? };
    poison(&stream, &mut grads)?;

    let packed = problem.varlen.is_some();
    let totals = packed.then_some((s.total_q, s.total_k));
    let mut params = BwdParams {
        a: AttnParams::new(problem, ql, kl, vl)?,
        dk_batch_stride: if packed {
            0
        } else {
            (s.sk * s.hk * s.d) as i64
        },
        dk_row_stride: (s.hk * s.d) as i64,
        dk_head_stride: s.d as i64,
        dq_accum_len: nq as i64,
        ..BwdParams::default()
    };
    let dropout = params.a.drop_threshold != 0;
    let choice = BwdProblem {
        tile: &tile,
        deterministic,
        dropout,
        sparse: problem.mods.sparse.is_some(),
        hopper: facts.hopper(),
        smem: facts.smem,
    };
    let path = BwdPath::choose(&choice);
    let offsets = seq_offsets(problem, &dev)?;
    {
        let _offset_syncs = set_seq_offsets(&mut params.a, &offsets, &stream);
        let (q_ptr, _q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, _k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, _v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, _o_sync) = o_view.device_ptr(&stream);
        let (do_ptr, _do_sync) = do_view.device_ptr(&stream);
        let (lse_ptr, _lse_sync) = lse_view.device_ptr(&stream);
        let (grads_ptr, _grads_sync) = grads.device_ptr_mut(&stream);
        let elem = std::mem::size_of::<T>() as u64;
        (params.a.q, params.a.k, params.a.v, params.a.o, params.a.lse) =
            (q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr);
        params.dout = do_ptr;
        params.dq = grads_ptr;
        params.dk = grads_ptr + nq as u64 * elem;
        params.dv = grads_ptr + (nq + nkv) as u64 * elem;
        let slopes = lock_slopes(&problem.mods);
        let (alibi, _slopes_sync) = locked_ptr::<f32, _>(&slopes, &stream, "alibi_slopes")?;
        params.a.alibi_slopes = alibi;
        let sparse = lock_sparse(&problem.mods);
        let (_sparse_syncs, next_col) = sparse_ptrs(&mut params.a, &sparse, &stream)?;
        match path {
            BwdPath::Ws(shape) if bwd_ws::supported(&params, &shape, q.dtype(), totals) => {
                let mut buffers = BwdWsBuffers::new(&dev, &shape, s.b, s.h, s.sq)?;
                bwd_ws::run(
                    &dev,
                    facts.sms,
                    &shape,
                    q.dtype(),
                    dtype,
                    &params,
                    totals,
                    deterministic,
                    next_col,
                    &mut buffers,
                )?;
            }
            // Packed batches or dropout with a softcap, ALiBi or block mask, an A/B switch
            // (`tma::ws_variant`), or tensors TMA cannot address: what runs there without the
            // warp-specialized kernels.
            BwdPath::Ws(_) => {
                let path = BwdPath::without_ws(&choice);
                run_path(&dev, path, &tile, problem, dtype, &mut params)?
            }
            path => run_path(&dev, path, &tile, problem, dtype, &mut params)?,
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(grads, dev))
}

/// dsum, then the kernels of `path` (not `Ws`) on `params` (every pointer but dsum and
/// dq_accum set).
fn run_path(
    dev: &candle::CudaDevice,
    path: BwdPath,
    tile: &BwdTile,
    problem: &Problem,
    dtype: &str,
    params: &mut BwdParams,
) -> Result<()> {
    let s = problem.shape;
    let stream = dev.cuda_stream();
    let nq = s.q_elems();
    // SAFETY: the dsum kernel writes every row before the others read it.
    let mut dsum = unsafe { dev.alloc::<f32>(s.h * s.total_q)? };
    // The fused kernels add into it; rows that no key reaches keep their zeros. The mma.sync
    // ones tile it (`dq_tile_offset` in cuda/common/bwd_dq_accum.cuh): per query head, total_q rows
    // plus one tile of rows per sequence, of the kernel's head dim.
    let mut dq_accum = match path {
        BwdPath::Fused(shape) => {
            let rows = s.total_q + shape.geometry(tile).bm * s.b;
            params.dq_tile_rows = rows as i64;
            Some(dev.alloc_zeros::<f32>(s.h * rows * tile.d)?)
        }
        BwdPath::Sm90 => Some(dev.alloc_zeros::<f32>(nq)?),
        BwdPath::Separate => None,
        BwdPath::Ws(_) => bail!("flash-attn backward: the warp-specialized path is run by bwd_ws"),
    };
    let (dsum_ptr, _dsum_sync) = dsum.device_ptr_mut(&stream);
    let dq_accum_ptr = dq_accum.as_mut().map(|b| b.device_ptr_mut(&stream));
    params.dsum = dsum_ptr;
    params.dq_accum = dq_accum_ptr.as_ref().map_or(0, |(ptr, _)| *ptr);
    let params = &*params;
    let dropout = params.a.drop_threshold != 0;
    let rows_per_block = 8; // one warp per row, 256 threads
    launch(
        dev,
        &format!("flash_bwd_dsum_{dtype}"),
        (s.sq.div_ceil(rows_per_block), s.h, s.b),
        32 * rows_per_block as u32,
        0,
        params,
    )?;
    match path {
        BwdPath::Separate => {
            launch(
                dev,
                &format!(
                    "flash_bwd_dkdv_{dtype}_d{}{}{}",
                    tile.d,
                    tile.kv_suffix(),
                    if params.a.block_q != 0 { "_sparse" } else { "" }
                ),
                (s.sk.div_ceil(tile.kv_bn), s.hk * tile.splits(), s.b),
                BwdTile::THREADS,
                tile.kv_smem_bytes(),
                params,
            )?;
            launch(
                dev,
                &format!("flash_bwd_dq_{dtype}_d{}", tile.d),
                (s.sq.div_ceil(tile.q_bm), s.h, s.b),
                BwdTile::THREADS,
                tile.q_smem_bytes(),
                params,
            )?;
        }
        BwdPath::Sm90 => {
            launch(
                dev,
                &format!(
                    "flash_bwd_sm90_{dtype}_d{}{}",
                    tile.d,
                    params.a.mods_suffix()
                ),
                (s.sk.div_ceil(SM90_BN), s.hk, s.b),
                256,
                sm90_smem_bytes(tile.d),
                params,
            )?;
            let (threads, per_thread) = (256, 8);
            launch(
                dev,
                &format!("flash_bwd_dq_convert_{dtype}"),
                (nq.div_ceil(threads * per_thread), 1, 1),
                threads as u32,
                0,
                params,
            )?;
        }
        BwdPath::Fused(shape) => {
            // Dropout has a kernel of its own (its Philox code costs registers);
            // `choose` picks the 128-key shapes only without dropout.
            let g = shape.geometry(tile);
            let dropout_suffix = if dropout { "_dropout" } else { "" };
            launch(
                dev,
                &format!(
                    "flash_bwd_dkdvq_{dtype}_d{}{}{dropout_suffix}",
                    tile.d, g.suffix
                ),
                (s.sk.div_ceil(g.bn), s.hk, s.b),
                32 * g.warps,
                tile.fused_smem_bytes(g.bn, g.bm),
                params,
            )?;
            launch(
                dev,
                &format!("flash_bwd_dq_convert_{dtype}_d{}{}", tile.d, g.suffix),
                (s.sq.div_ceil(g.bm), s.h, s.b),
                32 * g.warps,
                0,
                params,
            )?;
        }
        BwdPath::Ws(_) => {} // refused above
    }
    Ok(())
}
