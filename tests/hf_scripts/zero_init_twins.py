"""transformers 5 models built from their config with the same seed, on every rank: under `engine.zero.Init`
directly against the plain build, and through transformers' own ZeRO-3 path (`HfDeepSpeedConfig` alive, then
`from_config`: transformers builds under `deepspeed.zero.Init`, the compat distribution's) against that path's
unpartitioned twin (see hf_twin). Rank 0 writes, per model and way, the parameters whose gathered values differ
from the twin's (bitwise), those not finite, and whether every parameter was built partitioned.

    zrun --nproc_per_node 2 tests/hf_scripts/zero_init_twins.py --out twins.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared model shapes
from models import tiny_hf_config

STAGE3 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
MODELS = ("llama", "mixtral", "qwen2_moe", "raw")


def config(name: str) -> Any:
    return raw_model_class().config_class(hidden_size=4) if name == "raw" else tiny_hf_config(name)


def raw_model_class() -> Any:
    """A PreTrainedModel with a raw nn.Parameter (torch.empty) that nothing but its _init_weights fills."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers import initialization as init

    class RawConfig(PretrainedConfig):
        model_type = "raw_parameter_test"

        def __init__(self, hidden_size: int = 4, **kwargs: Any) -> None:
            self.hidden_size = hidden_size
            super().__init__(**kwargs)

    class RawModel(PreTrainedModel):
        config_class = RawConfig

        def __init__(self, config: RawConfig) -> None:
            super().__init__(config)
            self.scale = torch.nn.Parameter(torch.empty(8, config.hidden_size))
            self.proj = torch.nn.Linear(config.hidden_size, config.hidden_size)
            self.post_init()

        def _init_weights(self, module: torch.nn.Module) -> None:
            if module is self:
                init.normal_(self.scale, std=0.5)
            elif isinstance(module, torch.nn.Linear):
                init.normal_(module.weight, std=0.02)
                init.zeros_(module.bias)

    return RawModel


_RAW: list[Any] = []


def build(name: str, hf: bool = False) -> torch.nn.Module:
    """The model as its users build it from a config: from_config (the raw one: its class called, or its
    _from_config on transformers' ZeRO-3 path, `hf`)."""
    if name == "raw":
        if not _RAW:
            _RAW.append(raw_model_class())  # one class for every build
        return _RAW[0]._from_config(config(name)) if hf else _RAW[0](config(name))
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(name))


def hf_twin(name: str) -> dict[str, torch.Tensor]:
    """What transformers' ZeRO-3 path computes, without partitioning: it builds under its no_init_weights (the
    constructors draw no random numbers) and initialises afterwards (initialize_weights_zero3, then tie_weights);
    so its values come from another point of the random stream than the plain build's, by transformers'
    design, and its unpartitioned twin is the same two phases in one process."""
    from transformers import initialization as init

    torch.manual_seed(0)
    with init.no_init_weights():
        model = build(name, hf=True)
    model.init_weights()  # initialize_weights, then tie_weights
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with engine.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    return {
        "missing": sorted(set(want) ^ set(got)),
        "differ": [n for n in want if n in got and not torch.equal(got[n], want[n])],
        "not_finite": [n for n, t in got.items() if not torch.isfinite(t).all()],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    from transformers.integrations import HfDeepSpeedConfig

    report: dict[str, Any] = {}
    for name in MODELS:
        torch.manual_seed(0)
        plain = {n: p.detach().clone() for n, p in build(name).named_parameters()}
        torch.manual_seed(0)
        with engine.zero.Init(config_dict_or_path=STAGE3):
            direct = build(name)
        torch.manual_seed(0)
        keep = HfDeepSpeedConfig(STAGE3)  # transformers builds under deepspeed.zero.Init while it is alive
        through_hf = build(name, hf=True)
        del keep
        report[name] = {
            way: {**compare(whole(model), want), "partitioned": all(p.numel() == 0 for p in model.parameters())}
            for way, model, want in (("init", direct, plain), ("hf", through_hf, hf_twin(name)))
        }
    if int(os.environ.get("RANK", "0")) == 0:
        a.out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
