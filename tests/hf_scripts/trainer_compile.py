"""The Trainer with `TrainingArguments(torch_compile=True)` and a DeepSpeed config, as its users turn it
on (Accelerate then calls `engine.compile(backend="inductor")`), beside the same run eager, for each
config in turn in one process: a tiny Llama from its config, 4 steps, fp32.

    zrun --nproc_per_node 2 tests/hf_scripts/trainer_compile.py ds0.json ds3.json:aot_eager [--regional ds3.json] --out r.json

A config may name the torch.compile backend after a colon (TrainingArguments.torch_compile_backend; default
inductor, the Trainer's).

Rank 0 writes, per config and per mode ("eager", "compiled", and "regional" for --regional's config): the losses and gradient norms of every step,
whether the engine was compiled, the graphs Dynamo compiled in the run by the end of its first step and by
its end (a run may reuse an earlier run's graphs: Dynamo's guards pass for a new model of the same shapes),
and the keys of the consolidated state dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared model shapes
from models import TINY_DECODER, tiny_hf_config

STEPS, MICRO, LENGTH = 4, 2, 16


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, TINY_DECODER["vocab_size"], (LENGTH,), generator=torch.Generator().manual_seed(50 + i))
        return {"input_ids": ids, "labels": ids.clone()}


def graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def train(out: Path, deepspeed: str, mode: str, backend: str) -> dict[str, Any]:
    """mode: "eager", "compiled" (engine.compile), or "regional" (Accelerate's regional compilation: each
    decoder layer's compile(), turned on as its users do, by ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION)."""
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    start = graphs()  # Dynamo's count is the process's: what this run added is counted from here
    seen: dict[str, int] = {}

    class AfterFirstStep(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.setdefault("graphs_after_step_1", graphs() - start)

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_hf_config(attn_implementation="sdpa"))
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=MICRO,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=7,
        deepspeed=deepspeed,
        torch_compile=mode != "eager",
        torch_compile_backend=backend if mode != "eager" else None,
    )
    os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "true" if mode == "regional" else "false"
    trainer = Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[AfterFirstStep()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    engine = trainer.model_wrapped
    layers = engine.module.model.layers
    keys = sorted(engine.consolidated_state_dict())  # every rank calls it; rank 0's holds the tensors
    return {
        "losses": [h["loss"] for h in logs],
        "norms": [h["grad_norm"] for h in logs],
        "is_compiled": bool(getattr(engine, "is_compiled", False)),
        "layers_compiled": sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers),
        "graphs_after_step_1": seen.get("graphs_after_step_1", 0),
        "graphs_at_end": graphs() - start,
        "keys": keys,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--regional", default=None, help="also train this config with regional compilation")
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    report: dict[str, dict[str, Any]] = {}
    runs = [(config, mode) for config in a.configs for mode in ("eager", "compiled")]
    runs += [(a.regional, "regional")] if a.regional else []
    for spec, mode in runs:
        config, _, backend = spec.partition(":")
        name = Path(config).stem
        report.setdefault(name, {})[mode] = train(a.out.parent / f"{name}-{mode}", config, mode, backend or "inductor")
    if int(os.environ.get("RANK", "0")) == 0:
        a.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
