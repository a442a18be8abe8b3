//! CPU variable-length (packed) attention and the padding helpers, against a loop of
//! `attention_slow` over the sequences: outputs, LSE and gradients.
//!
//! A sequence of length 0 is allowed (on either side): with no query it outputs no row, with
//! no key its query rows are zeros (LSE `-inf`), like a fixed-length call with that seqlen.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{attention_slow, FlashAttn, Padding, VarLen};
use common::varlen::{packed_qkv, per_sequence, sequence};
use common::{assert_close, assert_within_budget, grads, lse_slow, max_abs_diff, randn};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// f32 inputs: both sides do f32 math in a different order.
const F32_TOL: f32 = 1e-5;
const NAMES: [&str; 3] = ["dq", "dk", "dv"];

/// One packed problem: per-sequence lengths, heads, head_dim, mask.
#[derive(Clone, Debug)]
struct VarCase {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
}

impl VarCase {
    fn new(lens_q: &[usize], lens_k: &[usize], h: usize, hk: usize, d: usize) -> Self {
        Self {
            lens_q: lens_q.to_vec(),
            lens_k: lens_k.to_vec(),
            h,
            hk,
            d,
            causal: false,
        }
    }

    fn varlen(&self) -> Result<VarLen> {
        VarLen::from_seqlens(&self.lens_q, &self.lens_k)
    }

    fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    fn flash(&self) -> FlashAttn {
        FlashAttn::new().causal(self.causal)
    }

    /// The oracle: `attention_slow` on each sequence.
    fn reference(&self, varlen: &VarLen, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        per_sequence(varlen, q, k, v, |_, q, k, v| {
            attention_slow(q, k, v, self.scale(), self.causal)
        })
    }
}

/// Lengths 1, 17, 64, 113 (not multiples of the block sizes but 64), 0 on either side,
/// seq_q != seq_k within a sequence both ways, MHA, GQA and MQA, and one random batch.
fn cases() -> Vec<VarCase> {
    let mut rng = StdRng::seed_from_u64(17);
    let random: Vec<usize> = (0..6).map(|_| rng.random_range(1..130)).collect();
    let random_k: Vec<usize> = random.iter().map(|&l| rng.random_range(1..2 * l)).collect();
    let shapes = [
        VarCase::new(&[1, 17, 64, 113], &[1, 17, 64, 113], 4, 4, 32),
        VarCase::new(&[17, 113, 1, 64], &[113, 17, 64, 1], 8, 2, 40),
        VarCase::new(&[5, 0, 33, 7], &[5, 9, 0, 7], 4, 1, 16),
        VarCase::new(&[113], &[17], 2, 2, 128),
        VarCase::new(&random, &random_k, 4, 2, 64),
    ];
    shapes
        .iter()
        .flat_map(|c| {
            [false, true].map(|causal| VarCase {
                causal,
                ..c.clone()
            })
        })
        .collect()
}

#[test]
fn forward_matches_per_sequence_loop() -> Result<()> {
    for case in cases() {
        let varlen = case.varlen()?;
        let (q, k, v) = packed_qkv(&varlen, case.h, case.hk, case.d, DType::F32)?;
        let (ours, lse) = case.flash().forward_varlen_with_lse(&q, &k, &v, &varlen)?;
        assert_eq!(ours.dims(), &[varlen.total_q(), case.h, case.d]);
        assert_eq!(lse.dims(), &[case.h, varlen.total_q()]);
        assert_eq!(lse.dtype(), DType::F32);
        let expected = case.reference(&varlen, &q, &k, &v)?;
        assert_close(&format!("{case:?}"), &ours, &expected, F32_TOL)?;
        // LSE, packed (h, total_q): sequence b's rows are columns cu_q[b]..cu_q[b + 1].
        let cu = (varlen.cu_seqlens_q(), varlen.cu_seqlens_k());
        for b in 0..varlen.num_seqs() {
            let (q_b, k_b) = (sequence(&q, cu.0, b)?, sequence(&k, cu.1, b)?);
            let (len_q, len_k) = (q_b.dim(1)?, k_b.dim(1)?);
            if len_q == 0 {
                continue;
            }
            let ours = lse.narrow(1, cu.0[b] as usize, len_q)?;
            let expected = if len_k == 0 {
                Tensor::full(f32::NEG_INFINITY, (case.h, len_q), &Device::Cpu)?
            } else {
                lse_slow(&q_b, &k_b, case.scale(), case.causal)?.squeeze(0)?
            };
            let (e, o) = (expected.to_vec2::<f32>()?, ours.to_vec2::<f32>()?);
            for (e, o) in e.iter().flatten().zip(o.iter().flatten()) {
                let same = (e.is_infinite() && e == o) || (e - o).abs() <= 1e-5 * e.abs().max(1.0);
                assert!(same, "lse of sequence {b}: {o} vs {e} in {case:?}");
            }
        }
    }
    Ok(())
}

#[test]
fn grads_match_per_sequence_loop() -> Result<()> {
    for case in cases() {
        let varlen = case.varlen()?;
        let (q, k, v) = packed_qkv(&varlen, case.h, case.hk, case.d, DType::F32)?;
        let w = randn((varlen.total_q(), case.h, case.d), DType::F32)?;
        let flash =
            |q: &Tensor, k: &Tensor, v: &Tensor| case.flash().forward_varlen(q, k, v, &varlen);
        let reference = |q: &Tensor, k: &Tensor, v: &Tensor| case.reference(&varlen, q, k, v);
        let ours = grads(flash, &q, &k, &v, &w)?;
        let expected = grads(reference, &q, &k, &v, &w)?;
        for ((name, a), b) in NAMES.iter().zip(&ours).zip(&expected) {
            assert_eq!(a.dims(), b.dims(), "{name} {case:?}");
            assert_close(&format!("{name} {case:?}"), a, b, F32_TOL)?;
        }
    }
    Ok(())
}

/// bf16: the low-precision rule (2x for outputs, 3x for gradients) against the loop in bf16.
#[test]
fn bf16_within_budget_of_bf16_loop() -> Result<()> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    for case in cases().into_iter().skip(2).take(4) {
        let varlen = case.varlen()?;
        let (q, k, v) = packed_qkv(&varlen, case.h, case.hk, case.d, DType::BF16)?;
        let w = randn((varlen.total_q(), case.h, case.d), DType::BF16)?;
        let ours = case.flash().forward_varlen(&q, &k, &v, &varlen)?;
        let baseline = case.reference(&varlen, &q, &k, &v)?;
        let exact = case.reference(&varlen, &f32(&q)?, &f32(&k)?, &f32(&v)?)?;
        assert_within_budget(&format!("out {case:?}"), &ours, &baseline, &exact, 2.0)?;
        let flash =
            |q: &Tensor, k: &Tensor, v: &Tensor| case.flash().forward_varlen(q, k, v, &varlen);
        let reference = |q: &Tensor, k: &Tensor, v: &Tensor| case.reference(&varlen, q, k, v);
        let ours = grads(flash, &q, &k, &v, &w)?;
        let baseline = grads(reference, &q, &k, &v, &w)?;
        let exact = grads(reference, &f32(&q)?, &f32(&k)?, &f32(&v)?, &f32(&w)?)?;
        for i in 0..3 {
            let what = format!("{} {case:?}", NAMES[i]);
            assert_within_budget(&what, &ours[i], &baseline[i], &exact[i], 3.0)?;
        }
    }
    Ok(())
}

/// A fixed-length batch and the same batch packed run the same code: bitwise equal.
#[test]
fn fixed_length_batch_equals_packed_batch() -> Result<()> {
    let (b, sq, sk, h, hk, d) = (3, 17, 40, 4, 2, 32);
    let q = randn((b, sq, h, d), DType::F32)?;
    let k = randn((b, sk, hk, d), DType::F32)?;
    let v = randn((b, sk, hk, d), DType::F32)?;
    let varlen = VarLen::from_seqlens(&[sq; 3], &[sk; 3])?;
    let flash = FlashAttn::new().causal(true);
    let (fixed, fixed_lse) = flash.forward_with_lse(&q, &k, &v)?;
    let packed = |x: &Tensor| x.flatten_to(1);
    let (ours, lse) =
        flash.forward_varlen_with_lse(&packed(&q)?, &packed(&k)?, &packed(&v)?, &varlen)?;
    assert_eq!(max_abs_diff(&ours, &packed(&fixed)?)?, 0.0);
    // (b, h, sq) vs (h, b * sq).
    let fixed_lse = fixed_lse.transpose(0, 1)?.flatten_from(1)?;
    assert_eq!(max_abs_diff(&lse, &fixed_lse)?, 0.0);
    Ok(())
}

#[test]
fn offsets_from_tensors_lengths_and_cu_seqlens_agree() -> Result<()> {
    let a = VarLen::from_seqlens(&[3, 0, 5], &[2, 4, 4])?;
    let b = VarLen::from_cu_seqlens(&[0, 3, 3, 8], &[0, 2, 6, 10])?;
    let c = VarLen::from_tensors(
        &Tensor::new(&[0u32, 3, 3, 8], &Device::Cpu)?,
        &Tensor::new(&[0u32, 2, 6, 10], &Device::Cpu)?,
    )?;
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_eq!(
        (
            a.num_seqs(),
            a.max_seqlen_q(),
            a.max_seqlen_k(),
            a.total_q(),
            a.total_k()
        ),
        (3, 5, 4, 8, 10)
    );
    Ok(())
}

/// A random key-padding mask of `(batch, seqlen)` with at least `min_real` real tokens per
/// row, real tokens anywhere (not only on the left).
fn random_mask(rng: &mut StdRng, batch: usize, seqlen: usize, min_real: usize) -> Vec<Vec<u8>> {
    (0..batch)
        .map(|_| {
            let density = rng.random_range(0.2..1.0);
            let mut row: Vec<u8> = (0..seqlen)
                .map(|_| u8::from(rng.random_bool(density)))
                .collect();
            row[..min_real].fill(1);
            row
        })
        .collect()
}

/// Positions of the real tokens of each row.
fn positions(mask: &[Vec<u8>]) -> Vec<Vec<u32>> {
    mask.iter()
        .map(|row| {
            (0..row.len() as u32)
                .filter(|&s| row[s as usize] != 0)
                .collect()
        })
        .collect()
}

fn mask_tensor(mask: &[Vec<u8>]) -> Result<Tensor> {
    Tensor::new(mask.to_vec(), &Device::Cpu)
}

/// The oracle for a padded batch: per sequence, gather the real tokens, `attention_slow`,
/// scatter the rows back into zeros.
fn padded_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_pos: &[Vec<u32>],
    kv_pos: &[Vec<u32>],
    causal: bool,
) -> Result<Tensor> {
    let (_, sq, h, d) = q.dims4()?;
    let scale = 1.0 / (d as f32).sqrt();
    let mut outs = Vec::new();
    for (b, (qp, kp)) in q_pos.iter().zip(kv_pos).enumerate() {
        let (qp, kp) = (
            Tensor::new(qp.as_slice(), &Device::Cpu)?,
            Tensor::new(kp.as_slice(), &Device::Cpu)?,
        );
        let pick = |x: &Tensor, pos: &Tensor| x.i(b)?.index_select(pos, 0)?.unsqueeze(0);
        let out = attention_slow(
            &pick(q, &qp)?,
            &pick(k, &kp)?,
            &pick(v, &kp)?,
            scale,
            causal,
        )?;
        let zeros = Tensor::zeros((sq, h, d), q.dtype(), q.device())?;
        outs.push(zeros.index_add(&qp, &out.squeeze(0)?, 0)?);
    }
    Tensor::stack(&outs, 0)
}

#[test]
fn padded_batch_matches_per_sequence_loop() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(5);
    // (batch, seqlen_q, seqlen_k, h, hk, d); self-attention uses one mask for q and kv.
    for (b, sq, sk, h, hk, d) in [(3, 33, 33, 4, 2, 32), (2, 17, 70, 4, 1, 16)] {
        let q_mask = random_mask(&mut rng, b, sq, 1);
        let kv_mask = if sq == sk {
            q_mask.clone()
        } else {
            random_mask(&mut rng, b, sk, 1)
        };
        let (q_pad, kv_pad) = (
            Padding::from_mask(&mask_tensor(&q_mask)?)?,
            Padding::from_mask(&mask_tensor(&kv_mask)?)?,
        );
        let (q_pos, kv_pos) = (positions(&q_mask), positions(&kv_mask));
        let q = randn((b, sq, h, d), DType::F32)?;
        let k = randn((b, sk, hk, d), DType::F32)?;
        let v = randn((b, sk, hk, d), DType::F32)?;
        let w = randn((b, sq, h, d), DType::F32)?;
        for causal in [false, true] {
            let what = format!("b={b} sq={sq} sk={sk} causal={causal}");
            let flash = |q: &Tensor, k: &Tensor, v: &Tensor| {
                FlashAttn::new()
                    .causal(causal)
                    .forward_padded(q, k, v, &q_pad, &kv_pad)
            };
            let reference = |q: &Tensor, k: &Tensor, v: &Tensor| {
                padded_reference(q, k, v, &q_pos, &kv_pos, causal)
            };
            let ours = flash(&q, &k, &v)?;
            assert_eq!(ours.dims(), &[b, sq, h, d]);
            assert_close(&what, &ours, &reference(&q, &k, &v)?, F32_TOL)?;
            // Padded query rows are exactly zero.
            let rows = ours.abs()?.sum(3)?.sum(2)?.to_vec2::<f32>()?;
            for (row, m) in rows.iter().zip(&q_mask) {
                for (&x, &real) in row.iter().zip(m) {
                    assert!(real != 0 || x == 0.0, "{what}: a padded row is not zero");
                }
            }
            // Gradients through unpad / pad: padded positions get zero, real ones the loop's.
            let ours = grads(flash, &q, &k, &v, &w)?;
            let expected = grads(reference, &q, &k, &v, &w)?;
            for ((name, a), e) in NAMES.iter().zip(&ours).zip(&expected) {
                assert_close(&format!("{name} {what}"), a, e, F32_TOL)?;
            }
        }
    }
    Ok(())
}

#[test]
fn unpad_and_pad_round_trip() -> Result<()> {
    let mask = vec![
        vec![0u8, 1, 1, 0, 1],
        vec![1, 1, 0, 0, 0],
        vec![0, 0, 0, 0, 1],
    ];
    let pad = Padding::from_mask(&mask_tensor(&mask)?.to_dtype(DType::F32)?)?;
    assert_eq!(pad.cu_seqlens(), &[0, 3, 5, 6]);
    assert_eq!(
        (pad.total(), pad.max_seqlen(), pad.batch(), pad.seqlen()),
        (6, 3, 3, 5)
    );
    assert_eq!(pad.indices(), &[1, 2, 4, 5, 6, 14]);
    let x = randn((3, 5, 2, 4), DType::F32)?;
    let packed = pad.unpad(&x)?;
    assert_eq!(packed.dims(), &[6, 2, 4]);
    // Real tokens packed in order: sequence 0's positions 1, 2, 4 first.
    assert_eq!(max_abs_diff(&packed.i(2)?, &x.i((0, 4))?)?, 0.0);
    let masked = x.broadcast_mul(
        &mask_tensor(&mask)?
            .to_dtype(DType::F32)?
            .reshape((3, 5, 1, 1))?,
    )?;
    assert_eq!(max_abs_diff(&pad.pad(&packed)?, &masked)?, 0.0);
    // Right padding: from_lengths and from_mask agree.
    let right = vec![vec![1u8, 1, 1, 0], vec![1, 0, 0, 0]];
    assert_eq!(
        Padding::from_lengths(&[3, 1], 4)?,
        Padding::from_mask(&mask_tensor(&right)?)?
    );
    // A batch with no real token at all.
    let empty = Padding::from_lengths(&[0, 0], 3)?;
    let packed = empty.unpad(&randn((2, 3, 4), DType::F32)?)?;
    assert_eq!(packed.dims(), &[0, 4]);
    assert_eq!(
        max_abs_diff(
            &empty.pad(&packed)?,
            &Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu)?
        )?,
        0.0
    );
    Ok(())
}
