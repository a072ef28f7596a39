"""The engine's own cost per micro-step: a tiny MLP (where the framework's Python, not the arithmetic,
is the step), one process, stages 0-3 in fp32 with AdamW, clipping and 2 micro-steps per step.

    .venv/bin/python benchmarks/bench_step_overhead.py      # prints {stage: microseconds per micro-step}

The figure is CPU time (time.process_time), the fastest of 7 blocks of 300 micro-steps: on a shared
2-core VM whose speed drifts by 2x between runs, the fastest block is the figure that repeats. To compare
two commits, run it from each tree in turn (PYTHONPATH=<tree>), alternating, several times.
"""

import json
import time

import torch

import engine


def block(eng: engine.Engine, x: torch.Tensor, n: int) -> float:
    """CPU microseconds per micro-step over n micro-steps."""
    t = time.process_time()
    for _ in range(n):
        eng.backward(eng(x).square().mean())
        eng.step()
    return (time.process_time() - t) / n * 1e6


torch.manual_seed(0)
torch.set_num_threads(1)
out = {}
for stage in (0, 1, 2, 3):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }
    eng, *_ = engine.initialize(model=model, config=cfg)
    x = torch.randn(2, 16)
    block(eng, x, 100)  # warm-up
    out[stage] = round(min(block(eng, x, 300) for _ in range(7)), 1)
    eng.destroy()
print(json.dumps(out))
