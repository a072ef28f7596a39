"""What the configs and scripts popular projects ship ask of the config layer (issue 30): DeepSpeed's own
optimizer classes at stages 1-3, offload_param, unknown top-level keys, and AutoTP batch arithmetic as
Accelerate writes it. Each is compared with what DeepSpeed 0.19 does with the same input."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from distributed import run_distributed
from models import global_batches, make_model, rank_micro_batch

import engine
from engine.optim.deepspeed_classes import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam

STEPS, MICRO, LR = 4, 2, 1e-2

# DeepSpeed's classes as DeepSpeed-API scripts build them (FastChat, axolotl's zero2 configs with the
# DeepSpeed API; Accelerate swaps in the CPU classes for offload). deepspeed.ops.adam re-exports these.
DEEPSPEED_CLASSES: dict[str, Any] = {
    "DeepSpeedCPUAdam": lambda params: DeepSpeedCPUAdam(params, lr=LR, weight_decay=0.1),
    "FusedAdam": lambda params: FusedAdam(params, lr=LR, weight_decay=0.1),
    "DeepSpeedCPUAdagrad": lambda params: DeepSpeedCPUAdagrad(params, lr=LR),
    "DeepSpeedCPULion": lambda params: DeepSpeedCPULion(params, lr=LR * 0.1),
}
# The update each one computes, as torch (or the engine's Lion) computes it.
REFERENCES: dict[str, Any] = {
    "DeepSpeedCPUAdam": lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1),
    "FusedAdam": lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1),
    "DeepSpeedCPUAdagrad": lambda params: torch.optim.Adagrad(params, lr=LR),
    "DeepSpeedCPULion": lambda params: engine.optim.Lion(params, lr=LR * 0.1, betas=(0.9, 0.999)),
}


def _train_stage2_with_client_optimizers(names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Each optimizer object passed to initialize at stage 2, STEPS steps on this rank's half of the batch."""
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for name in names:
        model = make_model(5)
        eng, *_ = engine.initialize(
            model=model,
            optimizer=DEEPSPEED_CLASSES[name](model.parameters()),
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "gradient_clipping": 0.0,
                "zero_optimization": {"stage": 2},
            },
        )
        for batch in global_batches(STEPS, MICRO * ws):
            x, y = rank_micro_batch(batch, rank, ws, MICRO, 0)
            eng.backward(torch.nn.functional.mse_loss(eng(x), y))
            eng.step()
        out[name] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        eng.destroy()
    return out


def _reference(name: str) -> dict[str, torch.Tensor]:
    model = make_model(5)
    opt = REFERENCES[name](model.parameters())
    for x, y in global_batches(STEPS, MICRO * 2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_deepspeed_optimizer_classes_train_at_stage_2() -> None:
    """DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS (runtime/zero/utils.py) has DeepSpeedCPUAdam, FusedAdam,
    DeepSpeedCPUAdagrad and DeepSpeedCPULion: they train at stages 1-3 without zero_allow_untested_optimizer,
    and on 2 ranks give what the same update gives in one process on the whole batch."""
    names = list(DEEPSPEED_CLASSES)
    ranks = run_distributed(_train_stage2_with_client_optimizers, 2, args=(names,))
    start = make_model(5).state_dict()
    for name in names:
        got, want = ranks[0][name], _reference(name)
        assert any(not torch.equal(got[k], start[k]) for k in start), f"{name}: the weights did not move"
        for key in want:
            # Same update, fp32: only the order of the gradient sums differs (two halves, then the mean).
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-5, msg=f"{name} {key}")
        for key in got:
            torch.testing.assert_close(ranks[1][name][key], got[key], atol=0, rtol=0)


def test_every_optimizer_class_the_engine_ships_is_accepted_on_shards_and_lamb_is_not() -> None:
    """By the names initialize checks (type(optimizer).__name__): every DeepSpeed class the engine provides
    and its own fused CPUAdam; per-tensor LAMB (the engine's Lamb, DeepSpeed's FusedLamb) stays refused."""
    import inspect

    from engine.config import load_config, run_checks
    from engine.optim import deepspeed_classes

    cfg = load_config(
        {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}, world_size=1, world_size_source="test"
    )
    shipped = [
        c.__name__
        for _, c in inspect.getmembers(deepspeed_classes, inspect.isclass)
        if issubclass(c, torch.optim.Optimizer) and c.__module__ == deepspeed_classes.__name__
    ]
    assert sorted(shipped) == sorted(DEEPSPEED_CLASSES)  # the distributed test above trains each of them
    for name in [*shipped, engine.ops.adam.CPUAdam.__name__]:
        run_checks.check_optimizer_for_stage(cfg, name)
    for name in ("Lamb", "FusedLamb"):
        with pytest.raises(
            engine.ConfigError,
            match=rf"^optimizer {name} at zero_optimization.stage 2: .* {name} is "
            r"not one of them.*zero_allow_untested_optimizer",
        ):
            run_checks.check_optimizer_for_stage(cfg, name)


# ------------------------------------------------------------------ offload_param
# axolotl's, LLaMA-Factory's, transformers', FastChat's and open-instruct's "zero3 offload" configs.
OFFLOAD_PARAM = {"device": "cpu", "pin_memory": True, "buffer_count": 5, "buffer_size": "auto", "max_in_cpu": "auto"}


def _zero3_with_and_without_offload_param() -> list[dict[str, torch.Tensor]]:
    rank, ws = torch.distributed.get_rank(), torch.distributed.get_world_size()
    states = []
    for zero in ({"stage": 3, "offload_param": OFFLOAD_PARAM}, {"stage": 3}):
        model = make_model(6)
        eng, *_ = engine.initialize(
            model=model,
            config={
                "train_micro_batch_size_per_gpu": MICRO,
                "zero_optimization": zero,
                "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            },
        )
        for batch in global_batches(STEPS, MICRO * ws):
            x, y = rank_micro_batch(batch, rank, ws, MICRO, 0)
            eng.backward(torch.nn.functional.mse_loss(eng(x), y))
            eng.step()
        states.append(eng.consolidated_state_dict())
        eng.destroy()
    return states


def test_offload_param_cpu_at_stage_3_trains_on_cpu_as_without_it() -> None:
    with_it, without = run_distributed(_zero3_with_and_without_offload_param, 2)[0]
    start = make_model(6).state_dict()
    assert any(not torch.equal(with_it[k], start[k]) for k in start), "the weights did not move"
    for key, want in without.items():
        torch.testing.assert_close(with_it[key], want, atol=0, rtol=0, msg=key)


def _stage_config(stage: int) -> Any:
    from engine.config import load_config

    return load_config(
        {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage, "offload_param": OFFLOAD_PARAM}},
        world_size=2,
        world_size_source="test",
    )


def test_offload_param_cpu_is_said_on_cpu_and_refused_on_cuda(caplog: pytest.LogCaptureFixture) -> None:
    from engine.config import run_checks

    cfg = _stage_config(3)
    assert cfg.zero.offload_param.device == "cpu" and cfg.zero.offload_param.pin_memory
    with caplog.at_level("INFO", logger="engine.config"):
        run_checks.check_offload(cfg, "cpu")
    assert (
        'zero_optimization.offload_param.device "cpu" at stage 3 on CPU: the partitioned parameters already '
        "live in host memory (each rank keeps its 1/2 of every parameter" in caplog.text
    )
    with pytest.raises(
        engine.ConfigError,
        match=r'^zero_optimization.offload_param.device "cpu" while training on '
        r"cuda: parameter offload to host memory on a CUDA device has not "
        r"been tested on a GPU yet; fix: remove offload_param, or train on CPU",
    ):
        run_checks.check_offload(cfg, "cuda")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_offload_param_below_stage_3_is_ignored_by_name_on_rank_0(rank: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed reads offload_param only at stage 3 (its stage 1-2 optimizer never receives it)."""
    from engine.config import ConfigWarning, run_checks
    from engine.config.warn import reset_warned

    reset_warned()
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for device in ("cpu", "cuda"):  # ignored, so not refused on CUDA either
            run_checks.check_offload(_stage_config(2), device)
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    expected = [
        (
            'zero_optimization.offload_param.device "cpu" is ignored at zero_optimization.stage 2, as '
            "DeepSpeed ignores it there: only stage 3 partitions parameters, so only stage 3 can offload them; "
            "remove offload_param, or use stage 3"
        )
    ]
    assert said == (expected if rank == "0" else []), said


# ------------------------------------------------------------------ unknown top-level keys
def _load_catching(config: dict[str, Any]) -> tuple[Any, list[str]]:
    """(EngineConfig, ConfigWarning messages) for a fresh process's first load of `config`."""
    from engine.config import ConfigWarning, load_config
    from engine.config.warn import reset_warned

    reset_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config({"train_micro_batch_size_per_gpu": 2, **config}, world_size=1, world_size_source="test")
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_other_tools_top_level_keys_are_ignored_by_name_on_rank_0(rank: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys shipped configs carry (refused before, "comms_config" as a typo of comms_logger)."""
    monkeypatch.setenv("RANK", rank)
    shipped = {"cuda_visible_devices": "0,1", "comms_config": {"verbose": False}, "monitor_config": {"enabled": True}}
    cfg, said = _load_catching({**shipped, "zero_optimization": {"stage": 2}})
    assert cfg.zero.stage == 2
    if rank != "0":
        assert said == []
        return
    assert said == [
        f"{key}: unknown top-level key, ignored (DeepSpeed ignores unknown top-level keys too); if it "
        'was meant as a setting, see docs/config-keys.md for the keys read; start its name with "_" to '
        "mark it as a comment"
        for key in shipped
    ]


def test_underscore_keys_are_comments() -> None:
    cfg, said = _load_catching({"_comment": "zero 2 for 8 GPUs", "_notes": ["a", "b"], "_x": float("nan")})
    assert said == [] and "_comment" not in cfg.raw


def test_dotted_top_level_keys_are_ignored_naming_the_nested_form() -> None:
    """TRL writes these; DeepSpeed reads only the nested section, so the value has no effect there either."""
    cfg, said = _load_catching({"zero_optimization.reduce_bucket_size": 500000, "zero_optimization": {"stage": 2}})
    assert cfg.zero.reduce_bucket_size is None
    assert said == [
        (
            "zero_optimization.reduce_bucket_size: a dotted top-level key is ignored, as DeepSpeed ignores "
            "it (it reads nested sections only); to set it, write it nested: "
            '{"zero_optimization": {"reduce_bucket_size": 500000}}'
        )
    ]


def test_each_ignored_key_is_said_once_per_process() -> None:
    from engine.config import load_config

    _, first = _load_catching({"comms_config": {}})
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        load_config({"train_micro_batch_size_per_gpu": 2, "comms_config": {}}, world_size=1, world_size_source="t")
    assert len(first) == 1 and again == []


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("zero_optimisation", "zero_optimization"),
        ("optimiser", "optimizer"),
        ("gradient_clip", "gradient_clipping"),
        ("Zero_Optimization", "zero_optimization"),
        ("train_micro_batch_size", "train_micro_batch_size_per_gpu"),
        ("activation_checkpoint", "activation_checkpointing"),
    ],
)
def test_likely_typos_of_top_level_keys_stay_refused(typo: str, meant: str) -> None:
    with pytest.raises(engine.ConfigError) as err:
        _load_catching({typo: {}})
    assert err.value.problems == [f"{typo}: unknown key; did you mean {meant}?"]


def test_sections_stay_closed_as_deepspeed_pydantic_sections_are() -> None:
    with pytest.raises(engine.ConfigError) as err:
        _load_catching({"zero_optimization": {"stage": 2, "_comment": "x", "comms_config": {}}})
    hint = "unknown key; see docs/config-keys.md for the keys this engine reads"
    assert sorted(err.value.problems) == [
        f"zero_optimization._comment: {hint}",
        f"zero_optimization.comms_config: {hint}",
    ]


# ------------------------------------------------------------------ AutoTP batch arithmetic
# DeepSpeed 0.19 reads train_batch_size against DeepSpeedConfig.world_size: mpu.get_data_parallel_world_size()
# with an mpu, else dist.get_world_size() (runtime/config.py, DeepSpeedConfig.__init__); for AutoTP
# deepspeed.initialize builds it with no mpu (__init__.py), so every rank counts. Accelerate writes
# train_batch_size = micro x gas x num_processes (accelerator.py, _prepare_deepspeed).
def _load_tp(config: dict[str, Any], world_size: int, model_parallel_size: int | None = None) -> Any:
    from engine.config import load_config

    return load_config(
        config,
        world_size=world_size,
        world_size_source="WORLD_SIZE=2 in the environment (launcher)" if world_size == 2 else "test",
        model_parallel_size=model_parallel_size,
    )


def test_autotp_train_batch_size_as_accelerate_writes_it_is_read_as_deepspeed_reads_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    autotp = {"tensor_parallel": {"autotp_size": 2}}
    with caplog.at_level("INFO", logger="engine.config"):
        cfg = _load_tp(
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, **autotp}, 2
        )
    # engine.train_batch_size() stays the samples of one step: one data-parallel rank x 2 x 2.
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
        cfg.world_size,
    ) == (4, 2, 2, 1)
    assert (
        "train_batch_size 8 counts every rank (2 x 2 x world size 2), as DeepSpeed does; samples per optimizer "
        "step (engine.train_batch_size()): 2 x 2 x data-parallel size 1 = 4"
    ) in caplog.text
    # gas inferred as DeepSpeed infers it (8 // 2 // world 4 = 1; the data-parallel count would give 2).
    cfg = _load_tp({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, **autotp}, 4)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (4, 1)
    # All three written in the data-parallel count (the engine's own rule before) still load.
    cfg = _load_tp(
        {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, **autotp}, 4
    )
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (4, 1)
    # With the groups given to initialize (mpu=), DeepSpeed counts data-parallel ranks: gas 8 // 2 // 2 = 2.
    cfg = _load_tp({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, 4, model_parallel_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 2)


def test_autotp_batch_refusal_names_world_tensor_and_data_parallel_sizes() -> None:
    with pytest.raises(engine.ConfigError) as err:
        _load_tp(
            {
                "train_batch_size": 6,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 1,
                "tensor_parallel": {"autotp_size": 2},
            },
            2,
        )
    assert err.value.problems == [
        (
            "train_batch_size (6) is neither train_micro_batch_size_per_gpu (2) x gradient_accumulation_steps (1) x world "
            "size (2) = 4 nor x data-parallel size (1) = 2; world size 2 (WORLD_SIZE=2 in the environment (launcher)), "
            "tensor-parallel size 2 (from tensor_parallel.autotp_size), data-parallel size 1 = 2 / 2; with the "
            "tensor-parallel size from tensor_parallel.autotp_size, DeepSpeed counts every rank in train_batch_size (as "
            "Accelerate writes it: micro x gas x number of processes); fix: set train_batch_size to 4 (every rank, as "
            "DeepSpeed and Accelerate count it with AutoTP) or 2 (the samples of one step), or remove one of the three "
            "keys so it is inferred from the other two"
        )
    ]
    with pytest.raises(engine.ConfigError) as err:
        _load_tp({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}}, 4)
    (message,) = err.value.problems
    assert message.startswith(
        "train_batch_size (6) is not a positive multiple of train_micro_batch_size_per_gpu "
        "(2) x world size (4) = 8, so gradient_accumulation_steps cannot be inferred; world size "
        "4 (test), tensor-parallel size 2 (from tensor_parallel.autotp_size), data-parallel "
        "size 2 = 4 / 2; with the tensor-parallel size from"
    )


def _autotp_gpt_losses(written_train: bool) -> dict[str, Any]:
    """A GPT sharded by AutoTP over both ranks (one data-parallel rank), 2 steps of 2 micro-batches."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from gpt import GPT, GPTConfig

    import engine.parallel as mpu

    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2))
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "tensor_parallel": {"autotp_size": 2},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    if written_train:
        config["train_batch_size"] = 2 * 2 * torch.distributed.get_world_size()  # Accelerate's arithmetic
    eng, *_ = engine.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(2 * 2):
        ids = torch.randint(0, 32, (2, 8), generator=g)  # the same on both ranks: one tensor-parallel group
        loss = eng(ids, torch.roll(ids, -1, dims=1))
        eng.backward(loss)
        eng.step()
        losses.append(loss.item())
    out = {"losses": losses, "steps": eng.global_steps, "train_batch_size": eng.train_batch_size()}
    eng.destroy()
    mpu.destroy_model_parallel()
    return out


def _autotp_both_ways() -> list[dict[str, Any]]:
    return [_autotp_gpt_losses(True), _autotp_gpt_losses(False)]


def test_autotp_trains_with_accelerates_train_batch_size_at_2_ranks() -> None:
    written, inferred = run_distributed(_autotp_both_ways, 2)[0]
    assert written["steps"] == 2 and written["train_batch_size"] == 4
    assert written["losses"][-1] < written["losses"][0]
    assert written == inferred  # the same training as without train_batch_size
