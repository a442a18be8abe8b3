// The last of several blocks to finish combines their results (the decode's key splits, the
// argmax's row slices): each block stores its share, then counts itself in; the block that
// brings the count to the end reads every other block's share. The count is one atomic by one
// thread with release and acquire semantics at GPU scope. The block barrier before it orders
// the block's own stores ahead of the count, and the barrier after it orders the last block's
// loads behind it, so no thread needs a fence of its own (a sequentially consistent fence in
// every thread, MEMBAR.SC.GPU, waits on each thread's stores in turn).
#pragma once

// Increments *counter, wrapping to 0 after `last` (atomicInc's rule, so that the last arrival
// leaves the counter clean for the next launch), as a release of the calling block's stores
// and an acquire of every earlier arrival's. Returns the count before.
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned* counter, unsigned last) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;\n"
                 : "=r"(old)
                 : "l"(counter), "r"(last)
                 : "memory");
    return old;
}
