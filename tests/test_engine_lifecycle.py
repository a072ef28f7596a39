"""Engine API surface and lifecycle in one process (world size 1, the same code path as N)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource

import pytest
import torch
from models import make_model

import engine
from engine.config import ConfigWarning
from engine.config.warn import reset_warned
from engine.runtime.engine import DestroyedEngineError

CONFIG = {
    "train_batch_size": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000,
}


def _one_step(eng: engine.Engine) -> None:
    eng.backward(eng(torch.randn(4, 16)).pow(2).mean())
    eng.step()


def _rss_mib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS measures live memory
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_create_destroy_loop_does_not_grow_memory() -> None:
    # A 4M-parameter model: leaking one engine's gradient buffer and Adam state (48 MiB) per
    # round adds 576 MiB over 12 rounds; 144 MiB leaves room for allocator noise.
    def round_trip() -> None:
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        eng, _, _, _ = engine.initialize(model=model, config=CONFIG)
        eng.backward(eng(torch.randn(4, 1024)).pow(2).mean())
        eng.step()
        eng.destroy()
        del eng, model
        gc.collect()

    for _ in range(3):
        round_trip()  # warm up allocator pools
    before = _rss_mib()
    for _ in range(12):
        round_trip()
    grown = _rss_mib() - before
    assert grown < 144, f"RSS grew {grown:.0f} MiB over 12 create/destroy rounds"
    assert not torch.distributed.is_initialized(), "destroy() must tear down the group it created"


def test_destroyed_engine_refuses_use_and_destroy_is_idempotent() -> None:
    eng, _, _, _ = engine.initialize(model=make_model(), config=CONFIG)
    eng.destroy()
    eng.destroy()
    with pytest.raises(DestroyedEngineError, match=r"this engine was destroyed \(engine.destroy\(\), or Accelerate's "):
        _one_step(eng)


def test_accessors_and_module_fallthrough() -> None:
    eng, opt, loader, sched = engine.initialize(model=make_model(), config=CONFIG)
    try:
        assert loader is None and sched is None and opt is eng.optimizer
        assert (eng.train_batch_size(), eng.train_micro_batch_size_per_gpu(), eng.gradient_accumulation_steps()) == (
            4,
            4,
            1,
        )
        assert eng.zero_optimization_stage() == 0 and not eng.fp16_enabled() and not eng.bfloat16_enabled()
        assert eng.gradient_clipping() == 1.0  # DeepSpeed 0.19.8's default when the key is absent
        assert eng.world_size == 1 and eng.global_rank == 0 and eng.device.type in ("cpu", "cuda")
        assert eng.get_lr() == [1e-3]
        assert eng.layers is eng.module.layers  # unknown attributes come from the module
        _one_step(eng)
        assert eng.global_steps == 1 and eng.global_samples == 4 and eng.was_step_applied()
        assert eng.get_global_grad_norm() > 0
        assert eng.train() is eng and eng.module.training
        eng.eval()
        assert not eng.module.training
    finally:
        eng.destroy()


def test_config_from_args_and_add_config_arguments(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 4, // comments load, as in DeepSpeed\n'
        ' "optimizer": {"type": "SGD", "params": {"lr": 0.1}},}'
    )
    parser = engine.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert not hasattr(args, "local_rank")
    eng, opt, _, _ = engine.initialize(args=args, model=make_model())
    try:
        assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt.optimizer, torch.optim.SGD)
    finally:
        eng.destroy()
    with pytest.raises(engine.ConfigError, match="given twice"):
        engine.initialize(args=args, model=make_model(), config=CONFIG)
    assert not torch.distributed.is_initialized(), "a failed initialize must not leak the process group"


def test_deprecated_deepscale_config_is_moved_onto_deepspeed_config(tmp_path) -> None:
    """DeepSpeed's --deepscale / --deepscale_config: accepted with a warning, the path moved onto
    args.deepspeed_config as deepspeed.initialize moves it; both paths given is refused naming both."""
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD"}}')
    parser = engine.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepscale", "--deepscale_config", str(path)])
    assert args.deepscale and args.deepspeed_config is None
    reset_warned()
    with pytest.warns(
        ConfigWarning, match="--deepscale_config .* is deprecated, as in DeepSpeed; use --deepspeed_config"
    ):
        eng, _, _, _ = engine.initialize(args=args, model=make_model())
    try:
        assert eng.gradient_accumulation_steps() == 4  # the file's config: 8 rows of micro-batches of 2
        assert (args.deepspeed_config, args.deepscale_config) == (str(path), None)
    finally:
        eng.destroy()
    only_deepscale = argparse.Namespace(deepscale_config=str(path))  # no deepspeed_config attribute at all
    eng, _, _, _ = engine.initialize(args=only_deepscale, model=make_model())
    eng.destroy()
    assert only_deepscale.deepspeed_config == str(path)

    both = parser.parse_args(["--deepscale_config", str(path), "--deepspeed_config", "other.json"])
    with pytest.raises(
        engine.ConfigError,
        match=r"both deepscale_config \('.*ds.json'\) and deepspeed_config \('other.json'\).*pass only --deepspeed_config",
    ):
        engine.initialize(args=both, model=make_model())
    assert not torch.distributed.is_initialized(), "a failed initialize must not leak the process group"


def test_client_optimizer_scheduler_and_param_groups() -> None:
    model = make_model()
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
        {"params": []},
    ]
    config = {k: v for k, v in CONFIG.items() if k != "optimizer"}
    eng, opt, _, sched = engine.initialize(
        model=model,
        model_parameters=groups,
        config=config,
        optimizer=lambda g: torch.optim.AdamW(g, lr=0.01),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    try:
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # empty group dropped
        _one_step(eng)
        assert eng.get_lr() == [0.005, 0.005]  # the engine steps the client scheduler
    finally:
        eng.destroy()
    twice = [{"params": list(model.parameters())}, {"params": [next(model.parameters())]}]
    with pytest.raises(ValueError, match="one group only"):
        engine.initialize(model=model, model_parameters=twice, config=CONFIG)
    stranger = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="not part of the model"):
        engine.initialize(model=model, model_parameters=stranger, config=CONFIG)


def test_gradient_accumulation_boundaries_and_step_counters() -> None:
    config = {**CONFIG, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
    eng, _, _, _ = engine.initialize(model=make_model(), config=config)
    try:
        assert eng.gradient_accumulation_steps() == 4
        boundaries = []
        for _ in range(8):
            boundaries.append(eng.is_gradient_accumulation_boundary())
            eng.backward(eng(torch.randn(2, 16)).pow(2).mean())
            eng.step()
        assert boundaries == [False, False, False, True] * 2
        assert eng.global_steps == 2 and eng.micro_steps == 8 and eng.global_samples == 16
        with eng.no_sync(), pytest.raises(RuntimeError, match="no_sync"):
            eng.step()
    finally:
        eng.destroy()


def test_backward_divides_loss_by_accumulation_steps() -> None:
    config = {
        **CONFIG,
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
    }
    eng, _, _, _ = engine.initialize(model=make_model(), config=config)
    try:
        x = torch.randn(2, 16)
        eng.backward(eng(x).sum())
        scaled = eng.module.layers[0].bias.grad.clone()
        eng.zero_grad()
        eng.backward(eng(x).sum(), scale_wrt_gas=False)
        torch.testing.assert_close(eng.module.layers[0].bias.grad, scaled * 4)
    finally:
        eng.destroy()


def test_step_log_wall_clock_breakdown_and_csv_monitor(tmp_path, capsys) -> None:
    config = {
        **CONFIG,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "job"},
    }
    eng, _, _, _ = engine.initialize(model=make_model(), config=config)
    try:
        for _ in range(4):
            _one_step(eng)
    finally:
        eng.destroy()
    err = capsys.readouterr().err
    assert "step 2 | loss" in err and "step 4 | loss" in err and "samples/s" in err and "skipped 0" in err
    assert "time (ms) | forward:" in err and "backward:" in err and "step:" in err
    rows = (tmp_path / "job" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,Train/Samples/train_loss"
    assert [int(r.split(",")[0]) for r in rows[1:]] == [4, 8, 12, 16]  # global samples after each step
    assert (tmp_path / "job" / "Train_Samples_lr.csv").exists()


def test_objects_given_to_initialize_take_precedence_over_the_config_sections() -> None:
    """DeepSpeed's contract (Megatron relies on it): an optimizer or schedule passed to initialize wins over
    the config's section, which is ignored unchecked with a warning. Refused before ("remove one of them"),
    and the section's optimizer.params.max_grad_norm (refused when the engine builds the optimizer) with it."""
    from engine.config.warn import ConfigWarning

    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(ConfigWarning) as caught:
        eng, opt, _, sched = engine.initialize(
            model=model, optimizer=sgd, config=config, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)
        )
    try:
        said = " ".join(str(w.message) for w in caught)
        assert "optimizer section (type 'Adam') is ignored" in said and "given optimizer=" in said, said
        assert "scheduler section (type 'WarmupLR') is ignored" in said and "given lr_scheduler=" in said, said
        assert opt.optimizer is sgd and isinstance(sched, torch.optim.lr_scheduler.StepLR)
        assert eng.config["optimizer"]["type"] == "Adam"  # engine.config still shows the user's whole config
        eng.backward(eng(torch.randn(4, 16)).pow(2).mean())
        eng.step()
        assert eng.get_lr() == [0.05]  # the given schedule stepped the given optimizer
    finally:
        eng.destroy()


class _Clock:
    """A stand-in for the reporter's `time`: perf_counter() advances 1 ms per call, and `stall` seconds
    more at once when asked (no wall time, so the test holds on any machine)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.001
        return self.now


class _SlowFirstForward(torch.nn.Module):
    """Its first forward takes 100 s of the fake clock, as the first step does while the extension builds."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.inner = make_model()
        self.clock = clock
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            self.clock.now += 100.0
        return self.inner(x)


def test_progress_rate_does_not_count_the_first_steps_one_time_costs(capsys, monkeypatch) -> None:
    """Issue 32: the progress line reported 9.1 samples/s at step 50 of a run going at 66, the first
    step's build counted in; the rate now counts from the end of the first step."""
    import engine.monitor.reporter as engine_module

    clock = _Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    eng, _, _, _ = engine.initialize(model=_SlowFirstForward(clock), config={**CONFIG, "steps_per_print": 3})
    try:
        for _ in range(3):
            _one_step(eng)
    finally:
        eng.destroy()
    line = next(line for line in capsys.readouterr().err.splitlines() if "step 3 | loss" in line)
    rate = float(line.split(" samples/s")[0].rsplit("| ", 1)[1])
    # Steps 2-3 (8 samples) over a few fake milliseconds; counting the stalled first step gives 12 / 100 s.
    assert rate > 100, line
