#!/usr/bin/env bash
# One GPU call for the int4 and MoE kernels: their GPU tests, then their timings, each step under its own time
# limit, a line printed as each ends, so a call cut short still shows what finished.
# Run from the repository root on the GPU machine, carrying [".whl"]:
#   bash benchmarks/gpu_checks.sh                     every step, about 10 minutes (tests ~290 s, mla ~30, experts ~120, int4 ~70,
#                                                     kimi ~90)
#   STEPS="tests int4" bash benchmarks/gpu_checks.sh  some of them
# Steps: tests (pytest -m gpu on the int4, MoE and speculation tests), mla (the latent-attention and MLA rope kernel
# tests, which run on the GPU when there is one), experts (benchmarks/int4_moe_cuda.py --sweep: the
# routed int4 experts at Kimi-K2.5 width, CUDA against Triton, 1-8 tokens, and the CUDA kernels' pipeline depths and
# warps), int4 (benchmarks/int4_linear_gpu.py on the
# shapes of BENCHMARKS.md 8 at 1, 16 and 64 rows), kimi (benchmarks/moe_layers_gpu.py: Kimi-K2.5 layers with int4
# experts, 4 MoE layers, the experts' launch-shape sweep included). Each step's output: $OUT/<step>.log; JSON
# files beside it.
set -u
. benchmarks/gpu_env.sh
STEPS=${STEPS:-tests mla experts int4 kimi}
step() {  # name, seconds, command...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s (limit $limit)"
  tail -n 12 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
for s in $STEPS; do
  case $s in
    tests) step tests 360 python -m pytest -q -p no:cacheprovider -m gpu tests/model/test_quant.py tests/kernels/test_moe_kernels.py \
             tests/model/test_quant_moe.py tests/model/test_moe.py tests/spec/test_speculative.py ;;
    mla) step mla 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_mla_kernel.py -m "not slow" ;;
    experts) step experts 240 python benchmarks/int4_moe_cuda.py --sweep --out "$OUT/int4_moe_cuda.json" ;;
    int4) step int4 100 python benchmarks/int4_linear_gpu.py --shapes kimi.kv_a kimi.q_a kimi.shared_gate_up kimi.o \
            llama8b.down llama8b.qkv --group 32 --rows 1 16 64 --out "$OUT/int4_linear.json" ;;
    kimi) step kimi 170 python benchmarks/moe_layers_gpu.py --shape kimi-k2.5 --experts int4 --moe-layers 4 ;;
    *) echo "unknown step $s (tests, mla, experts, int4, kimi)" ;;
  esac
done
