"""The DeepSpeed configs popular projects ship, trained as their users run them (issue 30).

tests/data/deepspeed_configs/ holds byte-identical copies of the ZeRO configs of axolotl, LLaMA-Factory,
transformers' tests, FastChat, open-instruct, DeepSpeedExamples and Megatron-DeepSpeed (SOURCES.md says
where each comes from). Each is given to `initialize` the way its users' code gives it:

- a config with "auto" values is meant for the HF Trainer/Accelerate, which fill them before DeepSpeed
  sees the config (`_hf_fill`, after transformers' `trainer_config_process`/`trainer_config_finalize`
  and Accelerate's `set_mixed_precision`/`_prepare_deepspeed`), and which pass the Trainer's own AdamW
  when the config has no "optimizer" section (swapped for DeepSpeedCPUAdam under optimizer offload);
- Megatron-DeepSpeed's training.py passes its own optimizer to initialize whatever the config says
  (DeepSpeed: a client optimizer "overrides any optimizer definition in the DeepSpeed json config");
- any other config is used with the plain DeepSpeed API: the config's optimizer, or the script's own
  AdamW when it has none.

Then 3 optimizer steps of a small MLP (two LLaMA-style blocks) at 2 ranks over gloo, every config in one
run_distributed call (about 10 s): the weights must move and every loss be finite, or initialize must
refuse with an error naming a feature that is genuinely not implemented. EXPECTED is the whole table; a
config missing from it fails the test.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from distributed import run_distributed

import engine
from engine.optim.deepspeed_classes import DeepSpeedCPUAdam

CORPUS = Path(__file__).resolve().parent / "data" / "deepspeed_configs"
STEPS = 3
WIDTH = 16  # the MLP's hidden size: what HF reads from model.config.hidden_size for the bucket "auto"s

# The TrainingArguments the simulated HF user runs with (a bf16 run, as these projects' scripts do,
# fp16 where the config itself enables fp16; lr large enough that 3 fp16 steps visibly move weights).
HF_MICRO, HF_GAS, HF_LR, HF_BETAS, HF_EPS, HF_WEIGHT_DECAY, HF_MAX_GRAD_NORM = 2, 1, 1e-3, [0.9, 0.999], 1e-8, 0.0, 1.0


class _Block(torch.nn.Module):
    """An HF-style MLP block: AutoTP knows up_proj (column) and down_proj (row) by name, as in LLaMA."""

    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down_proj = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.tanh(self.up_proj(x)))


def _make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(), _Block())


@dataclass(frozen=True)
class Refused:
    feature: str
    """A regex the error message must match: the feature initialize names as not implemented."""
    reason: str
    """Why refusing this is honest (one line)."""


TRAINS = "trains"

# Comments name what an entry exercises. "REFUSED when written" marks a config the engine refused
# when this table was written although DeepSpeed runs it (issue 30): its outcome is the one it should have.
EXPECTED: dict[str, str | Refused] = {
    # axolotl
    "axolotl/deepspeed_configs/zero1.json": TRAINS,
    "axolotl/deepspeed_configs/zero1_torch_compile.json": TRAINS,
    "axolotl/deepspeed_configs/zero2.json": TRAINS,
    "axolotl/deepspeed_configs/zero2_torch_compile.json": TRAINS,
    "axolotl/deepspeed_configs/zero3.json": TRAINS,
    "axolotl/deepspeed_configs/zero3_bf16.json": TRAINS,
    "axolotl/deepspeed_configs/zero3_bf16_cpuoffload_all.json": TRAINS,  # offload_param cpu, torch AdamW
    "axolotl/deepspeed_configs/zero3_bf16_cpuoffload_params.json": TRAINS,  # offload_param cpu
    # LLaMA-Factory
    "LLaMA-Factory/examples/deepspeed/ds_z0_config.json": TRAINS,
    # "_comment"; AutoTP 2 (tp_model_init first, as transformers does) with train_batch_size = micro x gas x
    # processes as the Trainer fills it, which DeepSpeed's config accepts (issue 30 item 5).
    "LLaMA-Factory/examples/deepspeed/ds_z2_autotp_config.json": TRAINS,
    "LLaMA-Factory/examples/deepspeed/ds_z2_config.json": TRAINS,
    "LLaMA-Factory/examples/deepspeed/ds_z2_offload_config.json": TRAINS,
    "LLaMA-Factory/examples/deepspeed/ds_z3_config.json": TRAINS,
    "LLaMA-Factory/examples/deepspeed/ds_z3_fp8_config.json": TRAINS,  # comms_config, monitor_config, CPU Adam
    "LLaMA-Factory/examples/deepspeed/ds_z3_offload_config.json": TRAINS,  # offload_param cpu
    # transformers
    "transformers/tests/deepspeed/ds_config_zero2.json": TRAINS,
    "transformers/tests/deepspeed/ds_config_zero3.json": TRAINS,  # offload_param, deprecated gather_fp16 key
    # FastChat
    "FastChat/playground/deepspeed_config_s2.json": TRAINS,  # no bf16 section (Accelerate adds it), CPU Adam
    "FastChat/playground/deepspeed_config_s3.json": TRAINS,  # offload_param cpu, sub_group_size 1e12
    # open-instruct
    "open-instruct/configs/ds_configs/stage2_no_offloading_accelerate.conf": TRAINS,
    "open-instruct/configs/ds_configs/stage3_no_offloading.conf": TRAINS,
    "open-instruct/configs/ds_configs/stage3_no_offloading_accelerate.conf": TRAINS,
    "open-instruct/configs/ds_configs/stage3_offloading.conf": TRAINS,  # offload_param cpu, WarmupDecayLR
    "open-instruct/configs/ds_configs/stage3_offloading_accelerate.conf": TRAINS,  # offload_param cpu
    # DeepSpeedExamples
    "DeepSpeedExamples/training/BingBertSquad/deepspeed_bsz24_config.json": TRAINS,
    "DeepSpeedExamples/training/BingBertSquad/1-bit_adam/nccl/deepspeed_onebitadam_bsz96_config.json": Refused(
        "OnebitAdam", "1-bit Adam's compressed communication is not implemented"
    ),
    "DeepSpeedExamples/training/bing_bert/deepspeed_bsz64k_lamb_config_seq128.json": Refused(
        "sparse_attention", "DeepSpeed's sparse attention kernels are not implemented"
    ),
    "DeepSpeedExamples/training/bing_bert/deepspeed_bsz4k_progressive_layer_drop_config_seq128.json": Refused(
        "progressive_layer_drop", "progressive layer drop is not implemented"
    ),
    "DeepSpeedExamples/training/bing_bert/01_adam/nccl/deepspeed_bsz4k_01adam_config_seq128_nccl.json": Refused(
        "ZeroOneAdam", "0/1 Adam's compressed communication is not implemented"
    ),
    "DeepSpeedExamples/training/gan/gan_deepspeed_config.json": TRAINS,
    "DeepSpeedExamples/training/imagenet/config/ds_config.json": TRAINS,  # unknown key cuda_visible_devices
    # fp16.auto_cast: refused before issue 30 item 6, now the engine casts the fp32 inputs.
    "DeepSpeedExamples/training/imagenet/config/ds_fp16_z1_config.json": TRAINS,
    "DeepSpeedExamples/training/pipeline_parallelism/ds_config.json": TRAINS,
    "DeepSpeedExamples/training/tensor_parallel/hf_integration/configs/ds_config.json": Refused(
        r"size 4 .*does not divide the world size 2", "autotp_size 4 needs 4 ranks (DeepSpeed fails too)"
    ),
    "DeepSpeedExamples/training/autotuning/hf/dsconfigs/ds_config_fp16_z3.json": TRAINS,
    "DeepSpeedExamples/training/bf16_master_weight/configs/bf16_full.json": Refused(
        "bf16_master_weights_and_grads|bf16_optimizer_states|torch_autocast",
        "bf16 master weights/optimizer states and torch_autocast are not implemented",
    ),
    "DeepSpeedExamples/training/DeepSpeed-ZenFlow/finetuning/zf_config.json": Refused(
        "zenflow", "ZenFlow's selective CPU-offloaded updates are not implemented"
    ),
    "DeepSpeedExamples/training/MoQ/test.json": Refused(
        "quantize_training", "MoQ quantization-aware training is not implemented"
    ),
    "DeepSpeedExamples/training/data_efficiency/gpt_finetuning/config/ds_config_gpt_base_random_ltd.json": Refused(
        "data_efficiency", "data efficiency (random-LTD) is not implemented"
    ),
    # ZeRO-Inference (parameters on NVMe, no optimizer); its train_batch_size 1 is one process's.
    "DeepSpeedExamples/inference/sglang/ds_offload_nvme_aio.json": Refused(
        r"train_batch_size|offload_param.device \"nvme\"",
        "written for one inference process (train_batch_size 1); parameters on NVMe need the optimizer there too",
    ),
    # ZeRO-Infinity as the Megatron ZeRO-3 example ran it (optimizer and parameters on NVMe, fp16). Its key
    # stage3_param_persitance_threshold is misspelt: DeepSpeed 0.19.8 refuses it (extra_forbidden) and so does
    # the engine, with the right spelling; corrected, it trains (tests/test_nvme_optimizer.py).
    "DeepSpeedExamples/Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_infinity_config.json": Refused(
        r"stage3_param_persitance_threshold: unknown key; did you mean stage3_param_persistence_threshold",
        "a misspelt key, refused by DeepSpeed 0.19.8 too",
    ),
    "DeepSpeedExamples/compression/cifar/config/ds_config.json": Refused(
        r"train_batch_size.*32", "train_batch_size 32 = micro 32 x 1 GPU: no 2-rank split (DeepSpeed fails too)"
    ),
    # Megatron-DeepSpeed
    # Megatron passes its own optimizer, which overrides the config's "optimizer" section as in DeepSpeed (its
    # max_grad_norm is then never read; refused before, with "remove one of them").
    "Megatron-DeepSpeed/examples_deepspeed/curriculum_learning/ds_zero_stage_1_config_baseline.json": TRAINS,
    "Megatron-DeepSpeed/examples_deepspeed/finetune_hf_llama/ds_config.json": TRAINS,
    "Megatron-DeepSpeed/examples_deepspeed/finetune_hf_llama/ds_config_empty.json": TRAINS,
    "Megatron-DeepSpeed/examples_deepspeed/universal_checkpointing/ds_config.json": Refused(
        r"train_batch_size.*16", "train_batch_size 16 = micro 16 x 1 GPU: no 2-rank split (DeepSpeed fails too)"
    ),
    "Megatron-DeepSpeed/examples_deepspeed/data_efficiency/gpt/eval/ds_config_eval_dummy.json": TRAINS,
}


def _corpus_files() -> list[str]:
    return sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.suffix in (".json", ".conf"))


def _has_auto(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_has_auto(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_auto(v) for v in node)
    return node == "auto"


def _fill(config: dict[str, Any], dotted_key: str, value: Any) -> None:
    """transformers' fill_match/fill_only: replace an "auto" where the key's section exists."""
    *sections, key = dotted_key.split(".")
    node: Any = config
    for section in sections:
        node = node.get(section)
        if not isinstance(node, dict):
            return
    if node.get(key) == "auto":
        node[key] = value


def _hf_precision(config: dict[str, Any]) -> str:
    """The Trainer flag a user pairs with this config: --fp16 where the config enables fp16, else --bf16."""
    return "fp16" if config.get("fp16", {}).get("enabled") is True else "bf16"


def _hf_fill(config: dict[str, Any]) -> dict[str, Any]:
    """The config as the HF Trainer + Accelerate hand it to deepspeed.initialize (transformers 5.x)."""
    config = copy.deepcopy(config)
    precision = _hf_precision(config)
    # Accelerate's DeepSpeedPlugin.set_mixed_precision: a missing section for the run's dtype is added.
    config.setdefault(precision, {"enabled": True, **({"auto_cast": True} if precision == "fp16" else {})})
    for dotted_key, value in [
        ("train_micro_batch_size_per_gpu", HF_MICRO),
        ("gradient_accumulation_steps", HF_GAS),
        ("train_batch_size", HF_MICRO * HF_GAS * 2),  # args.world_size: every process
        ("gradient_clipping", HF_MAX_GRAD_NORM),
        ("optimizer.params.lr", HF_LR),
        ("optimizer.params.betas", HF_BETAS),
        ("optimizer.params.eps", HF_EPS),
        ("optimizer.params.weight_decay", HF_WEIGHT_DECAY),
        ("scheduler.params.warmup_min_lr", 0),
        ("scheduler.params.warmup_max_lr", HF_LR),
        ("fp16.enabled", precision == "fp16"),
        ("bf16.enabled", precision == "bf16"),
        ("zero_optimization.reduce_bucket_size", WIDTH * WIDTH),
        ("scheduler.params.total_num_steps", STEPS),
        ("scheduler.params.warmup_num_steps", 1),  # max(1, warmup steps 0)
    ]:
        _fill(config, dotted_key, value)
    if config.get("zero_optimization", {}).get("stage") == 3:
        _fill(config, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * WIDTH * WIDTH))
        _fill(config, "zero_optimization.stage3_param_persistence_threshold", 10 * WIDTH)
    return config


def _client(name: str, config: dict[str, Any], model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config, initialize keywords) as the project's users' code calls initialize."""
    if name.startswith("Megatron-DeepSpeed/"):  # megatron/training.py: initialize(optimizer=its own, ...)
        return config, {"optimizer": torch.optim.AdamW(model.parameters(), lr=HF_LR)}
    if not _has_auto(config):  # the plain DeepSpeed API
        if "optimizer" in config:
            return config, {"model_parameters": model.parameters()}
        return config, {"optimizer": torch.optim.AdamW(model.parameters(), lr=HF_LR)}
    config = _hf_fill(config)
    tp_size = config.get("tensor_parallel", {}).get("autotp_size", 1)
    if tp_size > 1:  # transformers' deepspeed_init shards the model before it builds the optimizer
        dtype = (
            torch.bfloat16
            if config.get("bf16", {}).get("enabled")
            else torch.float16
            if config.get("fp16", {}).get("enabled")
            else torch.float32
        )
        engine.tp_model_init(model, tp_size, dtype=dtype, config=config)
    if "optimizer" in config:  # Accelerate's DummyOptim: DeepSpeed builds the config's optimizer
        return config, {"model_parameters": model.parameters()}
    # The Trainer's own AdamW; Accelerate allows it at any stage, and under optimizer offload swaps
    # in DeepSpeedCPUAdam (map_pytorch_optim_to_deepspeed) unless zero_force_ds_cpu_optimizer is false.
    config["zero_allow_untested_optimizer"] = True
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    if offload != "none" and config.get("zero_force_ds_cpu_optimizer", True):
        return config, {
            "optimizer": DeepSpeedCPUAdam(model.parameters(), lr=HF_LR, weight_decay=HF_WEIGHT_DECAY, adamw_mode=True)
        }
    return config, {
        "optimizer": torch.optim.AdamW(
            model.parameters(), lr=HF_LR, betas=(HF_BETAS[0], HF_BETAS[1]), eps=HF_EPS, weight_decay=HF_WEIGHT_DECAY
        )
    }


def _local_nvme(node: Any, folder: str) -> None:
    """Every nvme_path pointed at `folder` (the user's own disk; the configs name their authors')."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "nvme_path":
                node[key] = folder
            else:
                _local_nvme(value, folder)


def _train(name: str) -> str:
    raw = json.loads((CORPUS / name).read_text())
    nvme = tempfile.mkdtemp(prefix="corpus_nvme_")
    _local_nvme(raw, nvme)
    model = _make_model()
    config, kwargs = _client(name, raw, model)
    eng, *_ = engine.initialize(model=model, config=config, **kwargs)
    try:
        # fp16 without auto_cast: the user feeds the model's dtype (auto_cast casts fp32 inputs itself).
        auto_cast = eng.fp16_enabled() and config.get("fp16", {}).get("auto_cast", False)
        dtype = (
            torch.float16
            if eng.fp16_enabled() and not auto_cast
            else torch.bfloat16
            if eng.bfloat16_enabled()
            else torch.float32
        )
        before = eng.consolidated_state_dict()
        # Every rank feeds the same batches: tensor-parallel ranks must see the same input.
        g = torch.Generator().manual_seed(7)
        micro = eng.train_micro_batch_size_per_gpu()
        for _ in range(STEPS * eng.gradient_accumulation_steps()):
            x, y = torch.randn(micro, WIDTH, generator=g), torch.randn(micro, WIDTH, generator=g)
            loss = torch.nn.functional.mse_loss(eng(x.to(dtype)).float(), y)
            if not torch.isfinite(loss):
                return f"loss {loss.item()} at micro-step {eng.micro_steps}"
            eng.backward(loss)
            eng.step()
        after = eng.consolidated_state_dict()  # rank 0's; {} on the others
        moved = max((float((after[k].float() - v.float()).abs().max()) for k, v in before.items()), default=None)
        if moved == 0.0:
            return f"weights did not move in {STEPS} steps (skipped steps: {eng.skipped_steps})"
        return TRAINS
    finally:
        eng.destroy()
        shutil.rmtree(nvme, ignore_errors=True)


def _run_corpus(names: list[str]) -> dict[str, str]:
    outcomes = {}
    for name in names:
        try:
            outcomes[name] = _train(name)
        except Exception as err:  # noqa: BLE001 - a refusal is an outcome the parent checks by name
            outcomes[name] = f"refused: {type(err).__name__}: {err}"
        finally:
            engine.parallel.destroy_model_parallel()  # tp_model_init's groups, for the next config
    return outcomes


def _mismatch(name: str, expected: str | Refused | None, outcome: str) -> str | None:
    if expected is None:
        return f"{name}: not in EXPECTED (outcome: {outcome})"
    if expected == TRAINS:
        return None if outcome == TRAINS else f"{name}: expected to train, got: {outcome}"
    assert isinstance(expected, Refused)
    if outcome.startswith("refused: ") and re.search(expected.feature, outcome):
        return None
    return f"{name}: expected a refusal naming /{expected.feature}/ ({expected.reason}), got: {outcome}"


def test_every_corpus_config_is_in_the_table_and_listed_in_sources() -> None:
    files = _corpus_files()
    assert len(files) >= 40, f"the corpus under {CORPUS} has only {len(files)} configs"
    assert sorted(EXPECTED) == files, (
        f"not in EXPECTED: {sorted(set(files) - set(EXPECTED))}; "
        f"in EXPECTED but not on disk: {sorted(set(EXPECTED) - set(files))}"
    )
    sources = (CORPUS / "SOURCES.md").read_text()
    unlisted = [f for f in files if f"`{f}`" not in sources]
    assert not unlisted, f"SOURCES.md does not list: {unlisted}"


def test_shipped_configs_train_or_are_refused_by_name_at_2_ranks() -> None:
    files = _corpus_files()
    per_rank = run_distributed(_run_corpus, world_size=2, args=(files,), timeout=300)
    mismatches = []
    for name in files:
        # A rank's failure outranks the other's success (only rank 0 sees the consolidated weights).
        outcome = next((r[name] for r in per_rank if r[name] != TRAINS), TRAINS)
        if (problem := _mismatch(name, EXPECTED.get(name), outcome)) is not None:
            mismatches.append(problem)
    assert not mismatches, f"{len(mismatches)} of {len(files)} configs:\n" + "\n".join(mismatches)
