//! The dropout mask as a tensor: a testing aid, like FlashAttention's option of returning the
//! attention probabilities with the dropped entries marked.

use candle::{Device, Result, Tensor};

use crate::params::{self, Dropout};
use crate::philox;

/// **Testing aid**: the keep mask that [`crate::FlashAttn::forward`] uses for dropout
/// probability `p`, `seed` and RNG `offset` (see [`crate::FlashAttn::seed`] and
/// [`crate::FlashAttn::rng_offset`]; pass an explicit offset to the op to know it).
///
/// Returns a U8 tensor `(batch, num_heads, seqlen_q, seqlen_k)` on the CPU: 1 where the
/// probability of (query `i`, key `j`) of batch `b`, query head `h` is kept (and scaled by
/// `1 / (1 - p)`), 0 where it is dropped. Entries the causal mask hides are listed too; their
/// value does not matter. Give it to [`crate::attention_slow_dropout`] to compute the same
/// function in plain Candle ops. The CPU and CUDA paths drop exactly these entries.
///
/// Variable-length batches: sequence `b` of a [`crate::VarLen`] uses the top-left
/// `(len_q(b), len_k(b))` corner of row `b` of
/// `dropout_mask(p, seed, offset, num_seqs, num_heads, max_seqlen_q, max_seqlen_k)`: the mask
/// of an entry depends on its sequence, head and position within the sequence only.
///
/// It materialises `batch · num_heads · seqlen_q · seqlen_k` bytes: meant for tests.
///
/// Errors: `p` outside `[0, 1)`, a mask that cannot fit in memory.
pub fn dropout_mask(
    p: f32,
    seed: u64,
    offset: u64,
    batch: usize,
    num_heads: usize,
    seqlen_q: usize,
    seqlen_k: usize,
) -> Result<Tensor> {
    params::check_dropout(p)?;
    let elems = params::alloc_elems(&[batch, num_heads, seqlen_q, seqlen_k], 1, "dropout_mask")?;
    let dropout = Dropout { p, seed, offset };
    let mut mask = Vec::with_capacity(elems);
    for b in 0..batch {
        for h in 0..num_heads {
            for i in 0..seqlen_q {
                let mut row = philox::RowKeep::new(&dropout, num_heads, b, h, i);
                mask.extend((0..seqlen_k).map(|j| u8::from(row.kept(j))));
            }
        }
    }
    Tensor::from_vec(mask, (batch, num_heads, seqlen_q, seqlen_k), &Device::Cpu)
}
