"""Trainer uses the engine refuses, tried in turn in one process (one start-up for all of them): for each
case a tiny GPT-2 and a fresh `Trainer(args=TrainingArguments(deepspeed=CONFIG, **OPTIONS))`, then
`trainer.train()` (after `trainer.evaluate()` with "evaluate_first": transformers 5.24 trains at stage 3 with
the evaluation-only engine its own train() just destroyed). What each raised, as `TypeName: message`, goes
to --out (rank 0).

    zrun --nproc_per_node 2 tests/hf_scripts/trainer_refusals.py CASES.json --out refused.json

CASES.json: {"name": {"deepspeed": "ds.json", "options": {"tp_size": 2}, "evaluate_first": false}, ...}
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch


class Windows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def attempt(out: Path, deepspeed: str, options: dict[str, Any], evaluate_first: bool) -> dict[str, Any]:
    """What `trainer.train()` raised (None: nothing), and whether `trainer.evaluate()` ran first."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        deepspeed=deepspeed,
        **options,
    )
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=Windows(), eval_dataset=Windows())
    evaluated = False
    if evaluate_first:
        trainer.evaluate()
        evaluated = True
    try:
        trainer.train()
    except Exception as e:  # what the user sees: the exception's type and message
        return {"evaluated": evaluated, "raised": f"{type(e).__name__}: {e}"}
    return {"evaluated": evaluated, "raised": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    cases = json.loads(a.cases.read_text())
    raised = {
        name: attempt(a.out.parent / name, c["deepspeed"], c.get("options", {}), c.get("evaluate_first", False))
        for name, c in cases.items()
    }
    if int(os.environ.get("RANK", "0")) == 0:
        a.out.write_text(json.dumps(raised))


if __name__ == "__main__":
    main()
