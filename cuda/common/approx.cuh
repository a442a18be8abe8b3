// The special-function unit's approximations that CUDA has no intrinsic for.
#pragma once

// tanh.approx.f32 (sm_75+, one MUFU.TANH, ~2^-11 relative error).
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
