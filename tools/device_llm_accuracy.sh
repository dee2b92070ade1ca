#!/usr/bin/env bash
# The real-LLM accuracy runs of tools/eval_llm_real.py on a lent GPU, in steps that fit one
# device call each (a call carries 64 MiB at most, so the 98 MB GGUF goes in two halves).
# Here, once:  split -n 2 -d MODEL.gguf gguf.part  ->  .m1/gguf.part00, .m2/gguf.part01;
#              python tools/eval_llm_real.py --prepare-text .evaltext --domains man,info \
#                  --chars man=600000,info=600000;   .whl/ as ../shared/tools/device-wheels.sh
# On the device (each a separate call on the same warm machine):
#   bash tools/device_llm_accuracy.sh part1        # carry .whl .m1: stash the first half
#   bash tools/device_llm_accuracy.sh oneshot      # carry .m2 .evaltext: assemble, one shot
#   STAGES=... MINUTES=8 bash tools/device_llm_accuracy.sh stages   # more stages, same state
# (EXTRA="--teacher-n 2048" passes more options; LIMIT=560 bounds the call's seconds)
# Results: $OUT/llm_real.json (merged across calls through /tmp/llm/llm_real.json).
set -euo pipefail
step=${1:?part1 | oneshot | stages | probe}
W=/tmp/llm
mkdir -p "$W" "${OUT:-/tmp/out}"
install() {
  if [ ! -d /tmp/site ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
}
run_stages() {  # results go straight to $OUT (a call stopped at its limit keeps them)
  if [ -f "$W/llm_real.json" ]; then cp "$W/llm_real.json" "$OUT/llm_real.json"; fi
  timeout "${LIMIT:-560}" python3 tools/eval_llm_real.py --model "$W/smollm2.gguf" \
    --text "$W/text" --train code --eval man,info --state-dir "$W/state" \
    --out "$OUT/llm_real.json" --distill-minutes "${MINUTES:-8}" \
    --distill-steps "${STEPS:-4000}" ${EXTRA:-} --stages "$1" 2>&1 | tee -a "$OUT/llm_real.log" || true
  cp "$OUT/llm_real.json" "$W/llm_real.json"
}
case $step in
  part1)
    cp .m1/gguf.part00 "$W/"
    install
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, transformers, accelerate, gguf; print(torch.__version__, transformers.__version__)"
    ;;
  probe)  # distillation and teacher-sampling throughput on a random model of SmolLM2's shape
    install
    python3 - <<'EOF' 2>&1 | tee "$OUT/probe.log"
import time, torch, transformers, sparsekit as sk
from sparsekit.prune.distill import distill_
from sparsekit.data.teacher import teacher_samples
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
teacher = transformers.LlamaForCausalLM(cfg).cuda().eval().requires_grad_(False)
student = transformers.LlamaForCausalLM(cfg).cuda()
student.load_state_dict(teacher.state_dict())
pruner = sk.Pruner(student, pattern="2:4", exclude=["re:lm_head"]); pruner.step(0)
data = [torch.randint(0, 49152, (16, 512)) for _ in range(4)]
run = distill_(student, teacher, data, steps=60, task="causal_lm", pruner=pruner,
               precision="bf16", feature_weight=1.0, temperature=1.0)
print("distill", run.summary())
t = time.perf_counter()
s = teacher_samples(teacher, 512, 512, batch_size=512)
torch.cuda.synchronize(); print("teacher 512x512", time.perf_counter() - t, "s")
EOF
    ;;
  oneshot)
    cat "$W/gguf.part00" .m2/gguf.part01 > "$W/smollm2.gguf"
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $W/smollm2.gguf" \
      | sha256sum -c
    install
    mkdir -p "$W/text" && cp .evaltext/man.txt .evaltext/info.txt "$W/text/"
    python3 tools/eval_llm_real.py --prepare-text "$W/text" --domains code --chars code=40000000
    run_stages "${STAGES:-dense,alps@code,alps+recon@code,alps+recon@mix,sparsegpt@code,gptq4@code,alps+recon@teacher,sparsegpt+recon@code}"
    ;;
  stages)
    install
    run_stages "${STAGES:?STAGES=...}"
    ;;
esac
