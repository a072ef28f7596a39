#!/usr/bin/env bash
# The GPU checks in one run, for a lent CUDA machine (issue 35): the CUDA op tests, examples/train_gpt.py
# at stages 0-3 in bf16 on the GPU beside the CPU fp32 run, and the stage-3 step-time benchmark beside
# FSDP2. Logs go to $OUT (or ./gpu_out). Each part has its own time limit, so one hang costs only its own.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # jsonschema and its needs, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16
STEPS=${STEPS:-40}
{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; } 2>&1 | tee "$OUT/device.txt"

python3 - <<'PY'
import json, os
from engine.config.source import read_source
for stage in range(4):
    raw, _ = read_source(f"configs/zero{stage}.json")
    raw.pop("fp16", None); raw["bf16"] = {"enabled": True}
    json.dump(raw, open(f"/tmp/gpu_zero{stage}_bf16.json", "w"))
PY

# The CPU fp32 reference runs beside the GPU tests (16 cores)
(DS_ACCELERATOR=cpu timeout 300 python3 examples/train_gpt.py --steps "$STEPS" --eval_windows 32 \
   --config configs/zero0.json >"$OUT/train_cpu_fp32.log" 2>&1; echo "rc=$?" >>"$OUT/train_cpu_fp32.log") &

# The argument checks last and alone: they once crashed the process (a c10::Error raised with the GIL released)
timeout 240 python3 -m pytest tests/gpu -q -p no:cacheprovider -k "not checks_its_arguments" 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"

for stage in 0 1 2 3; do
  timeout 90 python3 examples/train_gpt.py --steps "$STEPS" --eval_windows 32 --config /tmp/gpu_zero${stage}_bf16.json \
    >"$OUT/train_cuda_stage${stage}.log" 2>&1; echo "rc=$?" >>"$OUT/train_cuda_stage${stage}.log"
  grep -E "done|final|rc=|Error|error" "$OUT/train_cuda_stage${stage}.log" | tail -5
done
wait
grep -E "done|final|rc=" "$OUT/train_cpu_fp32.log"

for system in "engine --stage 3" "fsdp2" "engine --stage 2" "engine --stage 0"; do
  timeout 120 python3 benchmarks/bench_gpu_step.py --system $system ${BENCH_ARGS:-} 2>&1 | tail -15 | tee -a "$OUT/bench_gpu_step.log"
done

timeout 60 python3 -m pytest tests/gpu -q -p no:cacheprovider -k "checks_its_arguments" 2>&1 | tail -15 | tee -a "$OUT/gpu_tests.log"
