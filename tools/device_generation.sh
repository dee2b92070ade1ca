#!/usr/bin/env bash
# The generation measurements (issues 30 and 32) on a lent GPU, one stage per device call, each
# well inside a call's 10 minutes. Results (JSON, logs) go to $OUT (or ./device_out).
#
#   tools/device_generation.sh kernels      # mma.sp check + decode GEMMs (every config on
#                                           # the 8B shapes, the default one on 70B) + the
#                                           # kernels' GPU tests
#   tools/device_generation.sh gen_bf16     # generate(): bf16 and int4 2:4 (bf16 alone on an
#                                           # 80 GB card) at batch 1 and 16
#                                           # against every dense way (HF compiled in both
#                                           # modes, HF eager, sparsekit's dense generate)
#   tools/device_generation.sh gen_fp8      # generate(): fp8 2:4 W8A8 and W8A16 (each layer
#                                           # on the kernel its plan timed faster) at batch 1
#                                           # and 16 against HF reduce-overhead and
#                                           # sparsekit's dense way
#   tools/device_generation.sh gen_b1       # generate(): bf16, int4, fp8 2:4 at batch 1 against
#                                           # every dense way, in one process
#   tools/device_generation.sh gen_core     # generate(): bf16 and fp8w 2:4 at batch 16, then 1,
#                                           # against HF reduce-overhead and sparsekit's dense
#                                           # way (the most a single call can hold)
#   tools/device_generation.sh gen_int4     # generate(): int4 2:4 and int4 dense (issue 32's
#                                           # own-kernel comparison) at batch 16, then 1,
#                                           # against HF reduce-overhead and sparsekit's dense
#   tools/device_generation.sh gen_way      # generate(): the ways PRECISIONS names (one fits a
#                                           # call; fp8w and int4 together did not, 520 s at
#                                           # batch 1 with PROFILE on an H100) at batch 16, then
#                                           # 1, against the dense ways DENSE names
#   tools/device_generation.sh widen        # the prefill's weight widening ops (fp8w, int4 2:4)
#                                           # against the fused elementwise ops, 8B shapes
#   tools/device_generation.sh lean         # the mma.sp kernel's GPU tests (every
#                                           # configuration against the reference), then the 8B
#                                           # sweep at M = 1 and 16 (the lean configurations
#                                           # beside the others), in one call
#   tools/device_generation.sh ncu          # Nsight Compute counters of the mma.sp kernel's
#                                           # decode GEMMs (8B shapes, M = 1 and 16, bf16/fp8h/
#                                           # int4, the sweep's best and two lean
#                                           # configurations): DRAM throughput, occupancy,
#                                           # stall reasons (SWEEP: a bench_sk24_mma.py JSON)
#   tools/device_generation.sh sparsegpt    # joint SparseGPT 2:4 + GPTQ int4 on 8 blocks of
#                                           # the 8B shapes, 128 x 2048 calibration tokens
#                                           # (issue 32's 15-minute target, scaled to 32)
#   tools/device_generation.sh gpu_tests    # the whole `pytest -m gpu` suite
#
# Expects the packages the GPU image lacks on PYTHONPATH (tools/../shared/tools/device-wheels.sh)
# and builds the mma.sp library into the checkout first (python -m sparsekit.accel.build: nvcc
# runs only where the sources changed since the last build); BATCHES (default
# 1,16) the generate stages' batch sizes; gen_b1 takes PRECISIONS, DENSE and LIMIT (seconds);
# sparsegpt takes LAYERS (default 8); gen_core, gen_int4 and gen_way take BATCHES (default
# 16,1), DENSE (default hf,sk: HF static cache + reduce-overhead, sparsekit's dense generate),
# PDL (set: inductor's kernels launched as programmatic dependents in every way), COMBO (set:
# inductor's independent kernels combined into one launch in every way) and PROFILE
# (set: one more call per way under torch.profiler, kernel time by kind); gen_way takes
# PRECISIONS (default fp8w).
set -uo pipefail
stages="kernels gen_bf16 gen_fp8 gen_b1 gen_core gen_int4 gen_way widen lean ncu sparsegpt gpu_tests"
for stage in "$@"; do
  case " $stages " in *" $stage "*) ;; *)
    echo "device_generation.sh: unknown stage '$stage' (${stages// /, })" >&2; exit 2 ;;
  esac
done
out=${OUT:-device_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.inductor}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
python -m sparsekit.accel.build 2>&1 | tail -n 1 | tee "$out/build.txt"
# STAGE PRECISIONS: those ways at batch 16, then 1, against the DENSE ways
pair_16_1() {
  timeout "${LIMIT:-560}" python tools/bench_generate.py --sections generate \
    --batches "${BATCHES:-16,1}" --precisions "$2" --dense "${DENSE:-hf,sk}" --per-step "" \
    --no-peers --rounds 3 ${PDL:+--inductor-pdl} ${COMBO:+--inductor-combo} ${PROFILE:+--profile} \
    --out "$out/$1.json" 2>&1 | tee "$out/$1.log" | tail -n 40
}
for stage in "$@"; do
  case $stage in
    kernels)
      # every configuration (the prefetching ones too) on the 8B shapes; the default one on 70B
      timeout 270 python tools/bench_sk24_mma.py --shapes 8b_qkv,8b_o,8b_gate_up,8b_down \
        --ms 1,4,16,32 --out "$out/mma_8b.json" 2>&1 | tee "$out/mma_8b.log" \
        | grep -v '^{"shape"' | tail -n 20
      timeout 100 python tools/bench_sk24_mma.py --sections time --configs default \
        --shapes 70b_qkv,70b_o,70b_gate_up,70b_down --ms 1,4,16,32 --out "$out/mma_70b.json" \
        2>&1 | tee "$out/mma_70b.log" | grep -v '^{"shape"' | tail -n 20
      timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/accel/test_sk24_mma_gpu.py \
        tests/accel/test_int4_kernels_gpu.py tests/accel/test_attention_gpu.py \
        tests/accel/test_decode_gpu.py 2>&1 | tee "$out/pytest_kernels.log" | tail -n 25 ;;
    gen_bf16)
      # an 80 GB card holds three dense copies and one compressed model, not two
      big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
      precisions=bf16,int4; [ "${big:-0}" -lt 100000 ] && precisions=bf16
      timeout 575 python tools/bench_generate.py --sections generate --batches "${BATCHES:-1,16}" \
        --precisions $precisions --no-peers --rounds 3 --out "$out/gen_bf16_int4.json" \
        2>&1 | tee "$out/gen_bf16_int4.log" | tail -n 40 ;;
    gen_fp8)
      timeout 575 python tools/bench_generate.py --sections generate --batches "${BATCHES:-1,16}" \
        --precisions fp8,fp8w --dense hf,sk --per-step dense_sk,sk_fp8_2:4 --no-peers --rounds 3 --out "$out/gen_fp8.json" \
        2>&1 | tee "$out/gen_fp8.log" | tail -n 40 ;;
    gen_b1)
      # every precision at batch 1 in one process; an 80 GB card: no int4, no default-mode copy
      big=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
      precisions=bf16,int4,fp8 dense=hf,hf_default,hf_eager,sk
      [ "${big:-0}" -lt 100000 ] && precisions=bf16,fp8 dense=hf,hf_eager,sk
      precisions=${PRECISIONS:-$precisions} dense=${DENSE:-$dense}
      timeout "${LIMIT:-580}" python tools/bench_generate.py --sections generate --batches 1 \
        --precisions $precisions --dense $dense --per-step dense_sk,sk_bf16_2:4,sk_fp8_2:4 \
        --no-peers --rounds 3 --out "$out/gen_b1.json" 2>&1 | tee "$out/gen_b1.log" | tail -n 40 ;;
    gen_core) pair_16_1 gen_core bf16,fp8w ;;
    gen_int4) pair_16_1 gen_int4 int4,int4dense ;;
    gen_way) p=${PRECISIONS:-fp8w}; pair_16_1 "gen_${p//,/_}" "$p" ;;
    widen)
      timeout 240 python tools/bench_sk24_mma.py --sections widen \
        --shapes 8b_qkv,8b_o,8b_gate_up,8b_down --out "$out/widen_8b.json" 2>&1 \
        | tee "$out/widen_8b.log" | tail -n 8 ;;
    lean)
      timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/accel/test_sk24_mma_gpu.py \
        2>&1 | tee "$out/pytest_sk24_mma.log" | tail -n 15
      timeout 300 python tools/bench_sk24_mma.py --sections time \
        --shapes 8b_qkv,8b_o,8b_gate_up,8b_down --ms 1,16 --out "$out/mma_8b_m1_16.json" 2>&1 \
        | tee "$out/mma_8b_m1_16.log" | grep -v '^{"shape"' | tail -n 5 ;;
    ncu)
      timeout 400 python tools/ncu_sk24_mma.py --configs best,8x4x1x19,8x4x2x19 \
        --sweep "${SWEEP:-docs/bench/bench_sk24_mma_2026-12-07d_m1_16_h100.json}" \
        --out "$out/ncu_sk24_mma.json" 2>&1 | tee "$out/ncu_sk24_mma.log" | tail -n 30 ;;
    sparsegpt)
      timeout 570 python tools/bench_sparsegpt_gptq.py --layers "${LAYERS:-8}" \
        --out "$out/sparsegpt_gptq.json" 2>&1 | tee "$out/sparsegpt_gptq.log" | tail -n 20 ;;
    gpu_tests)
      timeout 575 python -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
        | tee "$out/pytest_gpu.log" | tail -n 30 ;;
  esac
done
