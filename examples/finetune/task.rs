//! The built-in tasks, generated from a seed, each with a measurable accuracy: copying
//! ([`CopyTask`], the default: an induction head over the whole context) and associative
//! recall ([`Recall`]). Recall: a sequence scatters `pairs`
//! key-value token pairs among filler tokens, then asks for `queries` of the keys again; the
//! model must predict each value from a pair that may sit thousands of tokens earlier, so a
//! model only learns it through attention over the whole context. Generated from a seed, with
//! a measurable accuracy: the share of queried values predicted exactly.

use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};

use super::data::{Batch, Example};

/// Token-id ranges of the task inside a vocabulary of at least [`Recall::MIN_VOCAB`] ids.
#[derive(Clone, Debug)]
pub struct Recall {
    pub context: usize,
    pub pairs: usize,
    pub queries: usize,
    /// Beginning of sequence.
    bos: u32,
    keys: (u32, u32),
    values: (u32, u32),
    filler: (u32, u32),
}

impl Recall {
    /// Ids 0..4 are left to the tokenizer's special tokens; 128 keys, 128 values, filler above.
    pub const MIN_VOCAB: usize = 4 + 128 + 128 + 64;

    /// The task at `context` tokens with `pairs` bindings and `queries` questions.
    pub fn new(
        context: usize,
        pairs: usize,
        queries: usize,
        vocab: usize,
        bos: u32,
    ) -> anyhow::Result<Self> {
        if vocab < Self::MIN_VOCAB {
            anyhow::bail!(
                "--task recall: needs a vocabulary of at least {} ids, the model has {vocab}",
                Self::MIN_VOCAB
            )
        }
        let n = 128u32;
        let (keys, values) = ((4, 4 + n), (4 + n, 4 + 2 * n));
        let filler = (4 + 2 * n, vocab as u32);
        if pairs == 0 || queries == 0 || pairs > n as usize {
            anyhow::bail!("--pairs: must be in 1..={n} (distinct keys), and --queries > 0")
        }
        if 1 + 2 * pairs + 2 * queries > context {
            anyhow::bail!(
                "--context {context}: too short for {pairs} pairs and {queries} queries (needs {})",
                1 + 2 * pairs + 2 * queries
            )
        }
        Ok(Self {
            context,
            pairs,
            queries,
            bos,
            keys,
            values,
            filler,
        })
    }

    /// One sequence: BOS, the pairs scattered among filler, then the queries (key, value).
    /// The loss and the accuracy are on each queried value, predicted at its key.
    pub fn example(&self, rng: &mut StdRng) -> Example {
        let mut keys: Vec<u32> = (self.keys.0..self.keys.1).collect();
        keys.shuffle(rng);
        keys.truncate(self.pairs);
        let values: Vec<u32> = (0..self.pairs)
            .map(|_| rng.random_range(self.values.0..self.values.1))
            .collect();
        // Positions of the pairs inside the body, in order, each taking two slots.
        let body = self.context - 1 - 2 * self.queries;
        let free = body - 2 * self.pairs;
        let mut gaps: Vec<usize> = (0..self.pairs)
            .map(|_| rng.random_range(0..=free))
            .collect();
        gaps.sort_unstable();
        let mut tokens = vec![self.bos];
        let mut last = 0;
        for (i, &g) in gaps.iter().enumerate() {
            for _ in last..g {
                tokens.push(rng.random_range(self.filler.0..self.filler.1));
            }
            last = g;
            tokens.push(keys[i]);
            tokens.push(values[i]);
        }
        for _ in last..free {
            tokens.push(rng.random_range(self.filler.0..self.filler.1));
        }
        let mut targets = vec![];
        for _ in 0..self.queries {
            let i = rng.random_range(0..self.pairs);
            tokens.push(keys[i]);
            // Predict the value from the key's position.
            targets.push((tokens.len() - 1, values[i]));
            tokens.push(values[i]);
        }
        debug_assert_eq!(tokens.len(), self.context);
        Example { tokens, targets }
    }

    /// `n` sequences from `seed`, packed as one batch.
    pub fn batch(&self, n: usize, seed: u64) -> Batch {
        let mut rng = StdRng::seed_from_u64(seed);
        Batch::pack((0..n).map(|_| self.example(&mut rng)).collect())
    }
}

/// Copying: a block of random tokens, then the same block again. Every token of the second
/// copy (but its first) is a target, predicted from the token before it: the model must find
/// where that token stood in the first copy, `block` positions back, and read what followed.
/// An induction head over the whole context, with a target on half the tokens.
#[derive(Clone, Debug)]
pub struct CopyTask {
    pub context: usize,
    bos: u32,
    tokens: (u32, u32),
}

impl CopyTask {
    /// The task at `context` tokens (BOS, two copies of `(context - 1) / 2` tokens, padded
    /// with one filler token when `context` is even), tokens drawn above the special ids.
    pub fn new(context: usize, vocab: usize, bos: u32) -> anyhow::Result<Self> {
        if vocab < Recall::MIN_VOCAB {
            anyhow::bail!(
                "--task copy: needs a vocabulary of at least {} ids, the model has {vocab}",
                Recall::MIN_VOCAB
            )
        }
        if context < 7 {
            anyhow::bail!("--context {context}: --task copy needs at least 7 tokens")
        }
        Ok(Self {
            context,
            bos,
            tokens: (4, vocab as u32),
        })
    }

    pub fn example(&self, rng: &mut StdRng) -> Example {
        let block = (self.context - 1) / 2;
        let first: Vec<u32> = (0..block)
            .map(|_| rng.random_range(self.tokens.0..self.tokens.1))
            .collect();
        let mut tokens = vec![self.bos];
        tokens.extend(&first);
        tokens.extend(&first);
        if tokens.len() < self.context {
            tokens.push(rng.random_range(self.tokens.0..self.tokens.1));
        }
        // Position p (second copy, after its first token) predicts token p + 1.
        let targets = (block + 1..2 * block).map(|p| (p, tokens[p + 1])).collect();
        Example { tokens, targets }
    }

    pub fn batch(&self, n: usize, seed: u64) -> Batch {
        let mut rng = StdRng::seed_from_u64(seed);
        Batch::pack((0..n).map(|_| self.example(&mut rng)).collect())
    }
}

/// One of the built-in tasks.
#[derive(Clone, Debug)]
pub enum Task {
    Recall(Recall),
    Copy(CopyTask),
}

impl Task {
    pub fn batch(&self, n: usize, seed: u64) -> Batch {
        match self {
            Task::Recall(t) => t.batch(n, seed),
            Task::Copy(t) => t.batch(n, seed),
        }
    }
}
