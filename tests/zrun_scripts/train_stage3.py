"""Fixture: a short ZeRO stage-3 training run under zrun; must exit 0 with nothing printed at exit."""

import torch

import engine


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2)))
    net = torch.nn.ModuleDict({"inp": model[0], "blocks": model[1]})

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inner["inp"](x)
            for block in self.inner["blocks"]:
                h = torch.tanh(block(h))
            return h

    eng, *_ = engine.initialize(
        model=Net(),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3},
        },
    )
    for _ in range(3):
        eng.backward(eng(torch.randn(4, 8)).square().mean())
        eng.step()
    print(f"rank {eng.global_rank} trained {eng.global_steps} steps", flush=True)
    eng.destroy()


if __name__ == "__main__":
    main()
