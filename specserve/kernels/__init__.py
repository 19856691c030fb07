"""Fused GPU kernels (Triton) for the decode path, each with its PyTorch reference.

A decode step of an 8B model streams all its weights from memory; what else it does
must cost microseconds. In plain PyTorch an RMSNorm is ~7 kernels, rotary
embedding plus the KV-cache write ~16, SwiGLU's activation 3: ~1,400 tiny
kernels per step at 32 layers, each costing a launch slot even inside a CUDA
graph. The modules here do each of those in one, split by kind:

- ``norm``        residual add + RMSNorm, rotary embedding with the KV-cache write, SwiGLU's
                  silu(gate) * up;
- ``attention``   attention of 1-128 queries per KV head over the cache, reading each row only
                  as far as its last visible key (flash-decoding: chunks in parallel, then merged);
- ``argmax``      a row's argmax split into chunks side by side;
- ``tree``        one depth of greedy tree drafting;
- ``moe``         routed experts fused: pairs sorted by expert, two grouped GEMMs (CUDA-graph safe);
- ``moe_routing`` decode-size MoE routing (grouped sigmoid, softmax) and pair alignment, one
                  program each instead of ~30 small torch ops;
- ``gemv``        the skinny-matmul kernel and its GPU tuner;
- ``cpu_linear``  column-major CPU weights and the CPU tuner (MKL, oneDNN, the panel GEMV);
- ``cpu_native``  C++ AVX2 CPU kernels built on first use: the panel GEMV, norm, SwiGLU, rope +
                  KV write, attention over the cache (torch's ops where they cannot be built);
- ``linear``      the product every layer calls, following what the tuners chose (``LinearTuning``);
- ``common``      dispatch switches and the programmatic-dependent-launch helper.

The elementwise kernels reproduce the reference's bf16/fp16 roundings step by step (each
product and sum rounded where PyTorch rounds), so fused and reference agree to the last bit up
to the order of one float32 reduction. Triton runs on CUDA tensors; CPU tensors take the
reference, or in float32 inference the native kernels (within float32 rounding of it). ``SPECSERVE_FUSED_KERNELS=0`` forces the reference everywhere (for A/B
measurements). Without a GPU, tests run the ``*_triton`` launchers through Triton's interpreter
(TRITON_INTERPRET=1, set by conftest).
"""
