"""The CUDA C++ source of a handoff inside one launch: the blocks that start first do one kernel's work, the others
wait for them and do the next one's, so a pair of kernels costs one launch (the fused layer's attention and mlp).
fusedlayer_cuda.py places this text in its header's namespace ref_layer, for those two kernels.

A block may wait only for blocks that are sure to run. The blocks take tickets in the order they start, so the
first tickets, the producers, are running before any block holds a waiter's ticket: no deadlock, whatever order
the GPU starts blocks in and however few fit at once. The counters live in an int32[3] the layer keeps zeroed
between launches (the last block out zeroes them); two launches queued at once need counters of their own.

References: the CUDA programming guide's memory fence functions (a block's writes made visible to the grid
before a counter says so); cooperative groups' grid.sync, which makes a grid-wide barrier safe by launching no
more blocks than fit, where tickets make it safe for any grid.
See chapter: dispatch-kernel
"""

from __future__ import annotations

HANDOFF = r"""
// One launch whose blocks hand work on (attention: attend's splits to the output projection; mlp: the hidden row
// to the down projection), by three counters the layer keeps zeroed between launches. sync[0] hands out tickets
// in the order blocks start, so the first tickets, the producers, all run before any block waits: no deadlock,
// whatever order the GPU starts blocks in and however few fit at once. sync[1] counts producers done, sync[2]
// blocks done; the last block out zeroes all three.
__device__ __forceinline__ int ticket(int* sync) {
  __shared__ int t;
  if (threadIdx.x == 0) t = atomicAdd(sync, 1);
  __syncthreads();
  return t;
}

// A producer's writes, made visible to the whole GPU, then counted
__device__ __forceinline__ void arrive(int* sync) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(sync + 1, 1);
  }
}

// Waits for `count` producers: 0, or NaN after 2^20 polls without them (0.3 s on an H100, in
// results/h100-20261206-140000-test_kernels.log), so a broken handoff shows in the layer's output instead of
// hanging the GPU
__device__ __forceinline__ float wait_for(int* sync, int count) {
  __shared__ float bad;
  if (threadIdx.x == 0) {
    int seen = 0, spins = 0;
    for (; spins < (1 << 20); ++spins) {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(sync + 1) : "memory");
      if (seen >= count) break;
      __nanosleep(32);
    }
    bad = seen >= count ? 0.0f : __int_as_float(0x7fc00000);
    __threadfence();
  }
  __syncthreads();
  return bad;
}

__device__ __forceinline__ void depart(int* sync) {
  if (threadIdx.x == 0 && atomicAdd(sync + 2, 1) == (int)gridDim.x - 1) {
    sync[0] = 0;
    sync[1] = 0;
    sync[2] = 0;
  }
}

"""
