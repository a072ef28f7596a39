"""Where an eager step of the GPT (benchmarks/gpt_workload.py) goes, one process, stage 0, one thread:
the share of matrix products (mm, addmm, bmm, attention) against the rest, from torch.profiler.

    python benchmarks/profile_step_share.py S|M
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")]
import torch
from gpt import GPT
from torch.profiler import ProfilerActivity, profile
from gpt_workload import MODELS, batches

import engine

torch.set_num_threads(1)
cfg = MODELS[sys.argv[1] if len(sys.argv) > 1 else "S"]
torch.manual_seed(0)
model = GPT(cfg)
eng, *_ = engine.initialize(
    model=model,
    config={
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 0},
    },
)
data = batches(cfg, 6)
for x, y in data[:3]:
    eng.backward(eng(x, y))
    eng.step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for x, y in data[3:]:
        eng.backward(eng(x, y))
        eng.step()
ev = prof.key_averages()
total = sum(e.self_cpu_time_total for e in ev)
gemm = sum(
    e.self_cpu_time_total
    for e in ev
    if any(k in e.key for k in ("mm", "matmul", "linear", "bmm", "addmm", "mkldnn", "_scaled_dot"))
)
print(f"self CPU total {total / 1e6:.3f} s over 3 steps; GEMM-like ops {gemm / total:.1%}")
for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]:
    print(f"  {e.key:45s} {e.self_cpu_time_total / total:6.1%}")
eng.destroy()
