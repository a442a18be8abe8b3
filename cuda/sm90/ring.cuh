// A ring of N shared-memory slots between the TMA producer of a warp-specialized kernel and
// its consumers, each slot with a "full" mbarrier (completed by the producer's copies
// landing) and an "empty" one (completed by the consumers' releases). Nothing but the count
// of fills passes between the roles: each derives a fill's slot and its barriers' phase
// parity from how many fills it has gone through, so all of them agree without sharing an
// index. The producer waits on the empty barrier with the opposite parity (tma::wait).
#pragma once

template <int N> struct Ring {
    int st, phase;
    // Fill number `it` (from 0).
    __device__ __forceinline__ explicit Ring(int it) : st(it % N), phase((it / N) & 1) {}
};
