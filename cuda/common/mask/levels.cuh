// What score and mask code a kernel is compiled with (its MODS): flags, each dropping its code
// entirely from the kernels compiled without it. The host sends a kernel only problems its
// flags cover; the wgmma kernels have a variant per combination, as each flag's code cost the
// plain kernels registers (spills).
#pragma once

// The softcap and ALiBi, each on or off at run time (entry points `_mods`).
constexpr int MODS_SCORES = 1;
// A block mask. Without MODS_BLOCKS_RUNTIME, one is always there.
constexpr int MODS_BLOCKS = 2;
// Whether a block mask applies is read at run time (p.block_mask null or not), so that one
// kernel serves problems with and without one.
constexpr int MODS_BLOCKS_RUNTIME = 4;
// A softcap without ALiBi, never with MODS_SCORES (the backward's `_cap` kernels), so that no
// bias code takes registers: their scores come prescaled (Mask::apply's PRESCALED), so the
// mask keeps no softcap_pre.
constexpr int MODS_CAP = 8;

// The combinations kernels are compiled with, besides MODS_SCORES and MODS_CAP alone.
constexpr int MODS_NONE = 0;
// `_sparse`: a block mask, which may come with a cap or slopes.
constexpr int MODS_SPARSE = MODS_SCORES | MODS_BLOCKS;
// Everything, the block mask tested at run time: the mma.sync kernels but the dK/dV ones
// (which take MODS_SCORES, or MODS_SPARSE for their `_sparse` kernels).
constexpr int MODS_ANY = MODS_SPARSE | MODS_BLOCKS_RUNTIME;
