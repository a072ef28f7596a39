"""The engine on the torch versions setup.cfg accepts (torch>=2.4), where this machine has only one.

torch 2.13 renamed the flat collectives (all_gather_into_tensor -> all_gather_single, reduce_scatter_tensor
-> reduce_scatter_single); a GPU machine with torch 2.11 failed at the first stage-1/2/3 collective with
"module 'torch.distributed' has no attribute 'reduce_scatter_single'". Here the new names are removed
before the engine is imported, as on torch <= 2.12, and stages 1-3 train one process (world size 1 runs
torch's own collectives, the path NCCL takes).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    for name in ("all_gather_single", "reduce_scatter_single"):  # as torch <= 2.12
        if hasattr(dist, name):
            delattr(dist, name)
    import engine
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        before = [p.detach().clone() for p in model.parameters()]
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": stage}}
        eng, *_ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
        for _ in range(2):
            loss = eng(torch.randn(4, 8)).pow(2).mean()
            eng.backward(loss)
            eng.step()
        with engine.zero.GatheredParameters(list(eng.module.parameters())):
            moved = max((p.detach() - b).abs().max().item() for p, b in zip(eng.module.parameters(), before))
        assert moved > 0, f"stage {stage}: the weights did not move"
        print(f"stage {stage} trained: max weight change {moved:.3g}")
        eng.destroy()
""")


def test_stages_train_without_torch_2_13_collective_names() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert [line.split(" trained")[0] for line in result.stdout.splitlines() if "trained" in line] == [
        "stage 1",
        "stage 2",
        "stage 3",
    ]
