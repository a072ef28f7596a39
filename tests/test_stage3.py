"""ZeRO stage 3 against a single-process reference, on real processes over gloo.

The model has repeated blocks (one gather unit each), a tied input/output weight (in the root unit),
a frozen layer inside a block, two param groups, and optionally runs a block twice per forward.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_distributed

import engine

STEPS = 12
MICRO = 4
WIDTH = 16
LR = 1e-2
DECAY = 0.05
ATOL = 1e-5  # fp32: only summation order differs (see test_stage0.py)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.lin(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.blocks[1].norm.requires_grad_(False)  # frozen parameters inside a unit
        self.out = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.out.weight = self.inp.weight  # tied across the model: lives in the root unit

    def forward(self, x: torch.Tensor, twice: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        if twice:
            h = self.blocks[0](h)  # a unit called twice in one forward
        return self.out(h)


def make_net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in trainable if not any(p is q for q in decay)]
    return [{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]


def batches(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(global_batch, WIDTH, generator=g), torch.randn(global_batch, WIDTH, generator=g))
            for _ in range(steps)]


def reference(gas: int, ws: int, clip: float, twice: bool) -> dict[str, torch.Tensor]:
    model = make_net(7)
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    for x, y in batches(STEPS, MICRO * gas * ws):
        loss = torch.nn.functional.mse_loss(model(x, twice), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(gas: int, clip: float, twice: bool, top: dict[str, Any]) -> dict[str, Any]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_net(7 + rank)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "gradient_clipping": clip,
              "zero_optimization": {"stage": 3}, **top}
    eng, _, _, _ = engine.initialize(model=model, model_parameters=param_groups(model), config=config)
    dtype = next(iter(eng._stage.units[0].groups)).shard.dtype
    empty_between_steps = []
    for batch in batches(STEPS, MICRO * gas * ws):
        for k in range(gas):
            start = (k * ws + rank) * MICRO
            x, y = batch[0][start:start + MICRO], batch[1][start:start + MICRO]
            eng.backward(torch.nn.functional.mse_loss(eng(x.to(dtype), twice).float(), y))
            eng.step()
        empty_between_steps.append(all(p.numel() == 0 for p in eng.module.parameters()))
    report = eng.memory_report()
    units = [(u.name, sum(g.layout.numel for g in u.groups)) for u in eng._stage.units]
    eng.destroy()  # gives the module back whole
    return {"state": {k: v.detach().float().clone() for k, v in eng.module.state_dict().items()},
            "empty": empty_between_steps, "memory": report, "units": units}


@pytest.mark.parametrize("world_size,gas", [(2, 1), (2, 4), (4, 1)])
@pytest.mark.parametrize("twice", [False, True])
def test_stage3_matches_single_process(world_size: int, gas: int, twice: bool) -> None:
    clip = 0.05
    results = run_distributed(_train, world_size, args=(gas, clip, twice, {}))
    expected = reference(gas, world_size, clip, twice)
    for rank, result in enumerate(results):
        assert all(result["empty"]), "outside forward/backward every parameter is released"
        assert [name for name, _ in result["units"]] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
        assert result["memory"]["gathered"] == 0
        for name, want in expected.items():
            torch.testing.assert_close(result["state"][name], want, atol=ATOL, rtol=0, msg=f"rank {rank} {name}")
