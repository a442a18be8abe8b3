// Programmatic dependent launch (Hopper). A kernel launched with the
// PROGRAMMATIC_STREAM_SERIALIZATION attribute is launched as soon as the blocks of the kernel
// ahead of it in the stream have exited (or triggered it early), not after that kernel's
// completion has gone through the stream: its grid set-up and block dispatch, a few
// microseconds, overlap the end of the kernel before. It must not touch global memory
// before `pdl_wait`. Launched without the attribute, `pdl_wait` does nothing.
#pragma once

// Waits until the grids this one depends on have completed and their memory is visible.
// Before sm_90 there is no programmatic launch (the launchers never ask for it there), so
// stream order already guarantees it.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the kernels launched programmatically after this one be dispatched once every block of
// this grid has called it or exited: their blocks take the SMs this grid's finished blocks
// leave, and wait in `pdl_wait` for its completion. Only a hint; without it they are
// dispatched as this grid's last blocks exit.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
