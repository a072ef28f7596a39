#!/usr/bin/env bash
# The GPU checks in one run, for a lent CUDA machine: build both extensions (timed), the CUDA op tests
# beside examples/train_gpt.py at stages 0-3 in bf16 on the GPU, then the step-time benchmark (engine
# stage 3 beside FSDP2, alone on the GPU). Logs go to $OUT (or ./gpu_out), five files. Each part has its
# own time limit inside one deadline (BUDGET seconds from the start), so one hang costs only its own.
# The CPU fp32 reference of train_gpt is run elsewhere: the same command with DS_ACCELERATOR=cpu.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
START=$(date +%s); DEADLINE=$((START + ${BUDGET:-450}))
stamp() { echo "[$(($(date +%s) - START)) s] $*"; }
limit() { local left=$((DEADLINE - $(date +%s) - 5)); ((left < $1)) && echo $((left > 1 ? left : 1)) || echo "$1"; }
if ls .whl/*.whl >/dev/null 2>&1; then  # jsonschema and its needs, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 MAX_JOBS=16 TQDM_DISABLE=1
STEPS=${STEPS:-40}
{ nvidia-smi -L; nvcc --version | tail -2; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"; } 2>&1 | tee "$OUT/device.txt"

stamp "build"
timeout "$(limit 240)" python3 - <<'PY' 2>&1 | tail -40 | tee "$OUT/build.log"
import time
from engine.ops import builder, cuda_builder
for name, module in (("cpu", builder), ("cuda", cuda_builder)):
    started = time.time()
    ext = module.load()
    print(f"{name} extension: {'built/loaded' if ext is not None else 'NONE'} in {time.time() - started:.1f} s;", module.status())
PY

python3 - <<'PY'
import json
from engine.config.source import read_source
for stage in range(4):
    raw, _ = read_source(f"configs/zero{stage}.json")
    raw.pop("fp16", None); raw["bf16"] = {"enabled": True}
    json.dump(raw, open(f"/tmp/gpu_zero{stage}_bf16.json", "w"))
PY

stamp "tests and training"
# The argument checks run last and alone: on the lent H200s any C++ exception thrown from an extension has
# killed the process (a torch load_inline module with one TORCH_CHECK too: benchmarks/results/gpu_h200.md)
(timeout "$(limit 150)" python3 -m pytest tests/gpu -q -p no:cacheprovider -k "not checks_its_arguments" >"$OUT/gpu_tests.log" 2>&1
 echo "rc=$?" >>"$OUT/gpu_tests.log") &
for stage in ${STAGES:-0 1 2 3}; do
  { echo "=== stage $stage bf16 cuda"
    timeout "$(limit 60)" python3 examples/train_gpt.py --steps "$STEPS" --eval_windows 32 --config /tmp/gpu_zero${stage}_bf16.json 2>&1
    echo "rc=$?"; } >>"$OUT/train.log"
  stamp "stage $stage"; grep -A3 "=== stage $stage" "$OUT/train.log" | head -2; grep -E "^(done|final)|rc=|Error" "$OUT/train.log" | tail -3
done
wait
stamp "gpu tests"; tail -25 "$OUT/gpu_tests.log"

stamp "bench"
IFS='|' read -r -a SYSTEMS <<<"${SYSTEMS:-fsdp2|engine --stage 3 --profile|engine --stage 2|engine --stage 0}"
for system in "${SYSTEMS[@]}"; do
  timeout "$(limit 90)" python3 benchmarks/bench_gpu_step.py --system $system --steps 8 --warmup 3 ${BENCH_ARGS:-} >>"$OUT/bench.log" 2>&1
  echo "rc=$? ($system)" >>"$OUT/bench.log"; grep -E '^\{|rc=' "$OUT/bench.log" | tail -2
done

stamp "argument checks"
timeout "$(limit 40)" python3 -m pytest tests/gpu -q -p no:cacheprovider -k "checks_its_arguments" 2>&1 | head -30 | tee -a "$OUT/gpu_tests.log"
stamp "end"
