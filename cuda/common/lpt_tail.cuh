// The longest-first tail of a walk over work tiles grouped by (sequence, head) pair, each pair's
// tiles heaviest first (under a causal mask they differ in work: 1 to `per_pair` blocks).
// Walked pair by pair, the last tiles handed out include the last pairs' heavy ones, which
// finish late while the other SMs idle. So the last `tail_pairs` pairs go rank by rank
// across them (all their heaviest tiles, then all their second-heaviest, ...), the
// longest-processing-time order: the work left at the end is the lightest tiles. Only the tail:
// before it, a pair's tiles stay together so that their shared K/V (forward) or Q/dO
// (backward) stay in L2, and the whole walk in this order was 3-14% slower
// (docs/archive/PERF.md, "The dynamic walk's last tiles longest first"). The hosts size the
// tail to about two waves of tiles.
#pragma once

// Walk index t of `tiles` -> the index in pair-major order (pair * per_pair + rank).
// A bijection; tail_pairs 0 or 1: the identity.
__device__ __forceinline__ int longest_first_tail(int t, int tiles, int tail_pairs,
                                                  int per_pair) {
    const int start = tiles - tail_pairs * per_pair, u = t - start;
    return tail_pairs > 1 && u >= 0 ? start + u % tail_pairs * per_pair + u / tail_pairs : t;
}
