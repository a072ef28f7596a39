"""TRL's SFTTrainer, DPOTrainer, GRPOTrainer, RLOOTrainer and OnlineDPOTrainer on the engine, driven as TRL's users drive DeepSpeed: a
config file given as `SFTConfig(deepspeed=...)` (DPOConfig, GRPOConfig), the model named by its folder (TRL
loads it, and DPO its reference model from the same folder: under ZeRO-3 both through deepspeed.zero.Init),
the engine found through the `deepspeed` distribution built from compat/deepspeed. Without --deepspeed the
same trainers run as plain DDP. Run by tests/test_trl.py under zrun at 2 ranks; `--save_init DIR` writes the
tiny model and tokenizer every run starts from (alone, or first in a launch that then trains from it).

    zrun --nproc_per_node 2 tests/trl_scripts/trl_train.py --model DIR --out OUT --deepspeed ds.json \
        --trainers sft,dpo,grpo,rloo,online_dpo,grpo_nogather

`--deepspeed` and `--trainers` may be given several times, paired in order: each config trains its trainers
in turn in the same launch (a launch costs each rank seconds of imports), into OUT/<the config file's stem>.

Rank 0 writes OUT/report.json (OUT/<stem>/report.json for each of several configs): for each trainer its log history, how its model and reference model were
wrapped (engine class, ZeRO stage, elements held on rank 0) and the ds_status values TRL read. GRPO, RLOO
and online DPO generate with TRL's defaults (ds3_gather_for_generation=True); grpo_nogather without it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

from engine.unsupported import UnsupportedFeatureError

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
SEED = 5
SAMPLES = 32
"""Examples per data set: 4 steps of 8 (4 per rank at 2 ranks)."""


def tokenizer() -> Any:
    """A character tokenizer built in code (a BPE with no merges): nothing downloaded."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def save_init(folder: Path) -> None:
    """A 2-layer Llama (tied embeddings, as small Llama/Qwen models ship) and its tokenizer, saved with
    save_pretrained. Dropout is 0 in Llama, so runs at any rank count compute the same numbers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(CHARS[:26]) for _ in range(rng.randint(2, 5))) for _ in range(n))


def sft_data() -> Any:
    from datasets import Dataset

    rng = random.Random(SEED)
    return Dataset.from_dict({"text": [words(rng, rng.randint(3, 6)) for _ in range(SAMPLES)]})


def dpo_data() -> Any:
    from datasets import Dataset

    rng = random.Random(SEED + 1)
    rows = [(words(rng, 2), words(rng, rng.randint(1, 3)), words(rng, rng.randint(1, 3))) for _ in range(SAMPLES)]
    return Dataset.from_dict(
        {"prompt": [r[0] for r in rows], "chosen": [r[1] for r in rows], "rejected": [r[2] for r in rows]}
    )


def on_disk(data: Any, folder: Path) -> Any:
    """The data set saved by rank 0 and loaded by every rank: one cache folder shared by the ranks (an in-memory
    data set caches in a temporary folder of each process)."""
    from accelerate import PartialState
    from datasets import load_from_disk

    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            data.save_to_disk(str(folder))
    return load_from_disk(str(folder))


def common_args(out: Path, deepspeed: str | None) -> dict[str, Any]:
    """What every trainer shares: 4 steps of 4 examples per rank, logged every step, fp32 (TRL's default is
    bf16), seed fixed."""
    return {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": 4,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": SEED,
        "data_seed": SEED,
        "deepspeed": deepspeed,
        "dataloader_num_workers": 0,
        "bf16": False,
        # On a CPU machine Accelerate counts one process unless told use_cpu (then gloo, DDP without DeepSpeed),
        # and with DeepSpeed its batch arithmetic would disagree with the engine's world size (as for
        # examples/hf_trainer.py).
        "use_cpu": True,
    }


def wrapping(model: Any) -> dict[str, Any]:
    """How a trainer's model is wrapped: the engine class and stage, the model's elements and how many of
    them this rank stores (DeepSpeed's partition_numel() where the parameter is partitioned)."""
    inner = getattr(model, "module", model)
    params = list(inner.parameters())
    stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    local = sum(p.partition_numel() if hasattr(p, "partition_numel") else p.numel() for p in params)
    return {"class": type(model).__name__, "stage": stage, "numel": numel, "local_numel": local}


LM_HEAD_STATUSES: list[str] = []
"""ds_status of the LM head's weight each time TRL's fused head asked for it at ZeRO-3 (forward and backward)."""


def record_lm_head_gathers() -> None:
    """Wrap trl.trainer.utils.maybe_gather_lm_head_ctx (which TRL's fused LM head and its backward look up there)
    to record the status TRL reads: the test checks that ZeRO-3's ds_status path really ran."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from trl.trainer import utils

    original = utils.maybe_gather_lm_head_ctx

    def recording(*params: Any) -> Any:
        if is_deepspeed_zero3_enabled():
            LM_HEAD_STATUSES.append(str(params[0].ds_status.name))
        return original(*params)

    utils.maybe_gather_lm_head_ctx = recording


def run_sft(model: str, out: Path, deepspeed: str | None) -> dict[str, Any]:
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**common_args(out, deepspeed), max_length=48)
    trainer = SFTTrainer(model=model, args=args, train_dataset=sft_data())
    trainer.train()
    return {
        "log_history": trainer.state.log_history,
        "model": wrapping(trainer.model_wrapped),
        "lm_head_statuses": sorted(set(LM_HEAD_STATUSES)),
    }


def run_dpo(model: str, out: Path, deepspeed: str | None, precompute: bool = False) -> dict[str, Any]:
    from trl import DPOConfig, DPOTrainer

    # sync_ref_model: every 2 steps TRL mixes the policy into the reference model (at ZeRO-3 inside
    # GatheredParameters of both engines, modifier_rank=0), so steps 3-4 also check that write.
    # precompute_ref_log_probs: no reference model; TRL wraps the policy itself in an inference engine
    # (prepare_deepspeed) for a pass over the data before training wraps it again.
    options = (
        {"precompute_ref_log_probs": True}
        if precompute
        else {"sync_ref_model": True, "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5}
    )
    args = DPOConfig(**common_args(out, deepspeed), max_length=48, beta=0.5, **options)
    data = dpo_data()
    if precompute:  # TRL writes the precomputed log-probs into the data set's cache folder on rank 0 for all ranks
        data = on_disk(data, out / "data")
    trainer = DPOTrainer(model=model, args=args, train_dataset=data)
    ref = wrapping(trainer.ref_model or trainer.model)  # prepare_deepspeed wrapped it when the trainer was built
    try:
        trainer.train()
    except UnsupportedFeatureError as e:  # precompute at ZeRO-3: the policy held by the log-prob pass's engine
        return {"refused": str(e)}
    return {
        "log_history": trainer.state.log_history,
        "model": wrapping(trainer.model_wrapped),
        "ref_model": ref,
        "lm_head_statuses": sorted(set(LM_HEAD_STATUSES)),
    }


def reward_length(completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def run_online(kind: str, model: str, out: Path, deepspeed: str | None, gather: bool) -> dict[str, Any]:
    """GRPO, RLOO or online DPO: 2 steps of generation (completions of 8 tokens, rewarded by their length)
    and training. `gather`: TRL's default ds3_gather_for_generation=True (at ZeRO-3 every parameter gathered
    once for the whole generation, the engine's stage-3 hooks removed and re-added through
    optimizer.parameter_offload); without it each layer is gathered as the generation's forwards run."""
    from datasets import Dataset

    rng = random.Random(SEED + 2)
    data = Dataset.from_dict({"prompt": [words(rng, 2) for _ in range(SAMPLES)]})
    common = {**common_args(out, deepspeed), "max_steps": 2, "ds3_gather_for_generation": gather}
    if kind == "online_dpo":
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        # TRL's experimental trainer loads a model named by its folder with device_map="auto", which transformers
        # refuses under ZeRO-3 (real DeepSpeed too): its users give device_map=None, as here at every stage.
        args = OnlineDPOConfig(**common, max_new_tokens=8, model_init_kwargs={"device_map": None})
        tok = AutoTokenizer.from_pretrained(model)  # online DPO does not load it by itself
        # Nor, at ZeRO-3, its reference model (TRL refuses to copy a partitioned one): loaded as its users load
        # it, after the config (under zero.Init at stage 3), at every stage.
        ref = AutoModelForCausalLM.from_pretrained(model)
        trainer = OnlineDPOTrainer(
            model=model, ref_model=ref, reward_funcs=reward_length, args=args, train_dataset=data, processing_class=tok
        )
    else:
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

        config, make = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
        args = config(**common, num_generations=4, max_completion_length=8)
        trainer = make(model=model, args=args, reward_funcs=reward_length, train_dataset=data)
    trainer.train()
    return {"log_history": trainer.state.log_history, "model": wrapping(trainer.model_wrapped)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save_init", type=Path)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--deepspeed", action="append", help="a DeepSpeed config file (absent: plain DDP)")
    parser.add_argument(
        "--trainers",
        action="append",
        help="of sft, dpo, dpo_precompute, grpo, rloo, online_dpo, and grpo_nogather (ds3_gather_for_generation off);"
        " sft,dpo if absent",
    )
    a = parser.parse_args()
    if a.save_init is not None and a.model is None:  # only write the model (one process)
        save_init(a.save_init)
        return
    if a.save_init is not None:  # the launch's first rank writes the model every trainer then loads
        from accelerate import PartialState

        state = PartialState(cpu=True)  # gloo over the launch's ranks, as TrainingArguments(use_cpu=True) makes it
        if state.is_main_process:
            save_init(a.save_init)
        state.wait_for_everyone()
    record_lm_head_gathers()
    configs, trainers = a.deepspeed or [None], a.trainers or ["sft,dpo"]
    if len(configs) != len(trainers):
        parser.error(f"--deepspeed given {len(configs)} times and --trainers {len(trainers)}: they go in pairs")
    for config, names in zip(configs, trainers, strict=True):
        out = a.out if len(configs) == 1 else a.out / Path(config).stem
        report = train(str(a.model), out, config, names.split(","))
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.json").write_text(json.dumps(report, default=repr))


def train(model: str, out: Path, deepspeed: str | None, names: list[str]) -> dict[str, Any]:
    """Each named trainer in turn with one config; what each did, by name."""
    report: dict[str, Any] = {}
    for name in names:
        if name in ("grpo", "rloo", "online_dpo", "grpo_nogather"):
            kind, gather = name.removesuffix("_nogather"), not name.endswith("_nogather")
            report[name] = run_online(kind, model, out / name, deepspeed, gather)
            continue
        LM_HEAD_STATUSES.clear()
        if name == "dpo_precompute":
            report[name] = run_dpo(model, out / name, deepspeed, precompute=True)
            continue
        run = {"sft": run_sft, "dpo": run_dpo}[name]
        report[name] = run(model, out / name, deepspeed)
    return report


if __name__ == "__main__":
    main()
