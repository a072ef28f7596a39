"""engine.checkpointing (ZeRO-R activation checkpointing) on real processes: with dropout on, the
checkpointed model's training is bit for bit the model's without checkpointing, at tensor-parallel
size 1 (DP 2) and 2 (TP 2 x DP 2), every ZeRO stage, both checkpoint forms, with the inputs kept
partitioned (P_a), in the contiguous arena (M_D) and with cpu_checkpointing (no effect on CPU, said
once). Partitioned checkpoints at TP 2 hold half the bytes of whole ones, and each recompute
all-gathers its input once.

Every block is checkpointed. Dropout draws twice per block: on the replicated residual stream from
the default generator (the same mask on every TP rank) and inside the tensor-parallel region from
the tracker's model-parallel stream (a different mask per TP rank), so a recompute that did not
replay both streams exactly would change the gradients and every later step.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
import engine.parallel as mpu
from engine import checkpointing, comm
from engine.config.errors import ConfigError
from tests.distributed import run_distributed

STEPS, MICRO, SEQ, GAS = 1, 2, 8, 2
VOCAB, D, FFN, LAYERS = 16, 16, 32, 3
P_DROP = 0.2


class Block(nn.Module):
    def __init__(self, tp: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        if tp == 1:
            self.up: nn.Module = nn.Linear(D, FFN)
            self.down: nn.Module = nn.Linear(FFN, D)
        else:
            self.up = mpu.ColumnParallelLinear(D, FFN, gather_output=False)
            self.down = mpu.RowParallelLinear(FFN, D, input_is_parallel=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.up(self.ln(h)))
        with mpu.get_rng_tracker().fork():  # this rank's columns: its own mask
            hidden = F.dropout(hidden, P_DROP)
        return h + F.dropout(self.down(hidden), P_DROP)  # the replicated stream: one mask for the group


class Net(nn.Module):
    def __init__(self, tp: int, form: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(tp) for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            if self.form == "reentrant":
                h = checkpointing.checkpoint(block, h)
            elif self.form == "non_reentrant":
                h = checkpointing.non_reentrant_checkpoint(block, h)
            else:
                h = block(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def _config(stage: int, section: dict[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 2000},
    }
    if section is not None:
        config["activation_checkpointing"] = section
    return config


def _batch(step: int, micro: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + dp_rank)
    return torch.randint(VOCAB, (MICRO, SEQ), generator=g), torch.randint(VOCAB, (MICRO, SEQ), generator=g)


def _tp_gathered() -> int:
    return comm.comm_stats()["bytes_sent"].get("tp.all_gather", 0)


def _train(
    tp: int, stage: int, form: str | None, section: dict[str, Any] | None
) -> tuple[dict[str, torch.Tensor], list[float], checkpointing.ledger.LedgerStats, int]:
    """(consolidated state, losses, checkpoint bytes at the end of the first forward, bytes this rank
    sent in all-gathers over the tensor-parallel group while training)."""
    mpu.model_parallel_manual_seed(1234)  # the default generator and the tracker's stream, as at the start of a run
    model = Net(tp, form)
    eng, _, _, _ = engine.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, section), mpu=mpu if tp > 1 else None
    )
    losses = []
    checkpointing.reset_peak()
    peak = checkpointing.stats()
    gathered = _tp_gathered()
    for step in range(STEPS):
        for micro in range(GAS):
            loss = eng(*_batch(step, micro, eng.parallel.dp_rank))
            if step == 0 and micro == 0:
                peak = checkpointing.stats()  # at the end of the first forward: every checkpoint alive
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
    gathered = _tp_gathered() - gathered
    state = eng.consolidated_state_dict()
    eng.destroy()
    checkpointing.unconfigure()
    return state, losses, peak, gathered


PARTITIONED = {"partition_activations": True}
CONTIGUOUS = {"partition_activations": True, "contiguous_memory_optimization": True, "number_checkpoints": LAYERS}
CPU = {"partition_activations": True, "cpu_checkpointing": True}


def _bitwise_parity(tp: int) -> dict[str, Any]:
    if tp > 1:
        mpu.initialize_model_parallel(tp)
    found: dict[str, Any] = {"mismatch": [], "bytes": {}, "gathers": {}}
    for stage in range(4):
        ref_state, ref_losses, whole, ref_gathered = _train(tp, stage, None, None)
        assert whole.peak_checkpoints == 0  # the reference keeps no checkpoint
        for form, section in (("reentrant", CONTIGUOUS), ("non_reentrant", CPU), ("reentrant", None)):
            state, losses, peak, gathered = _train(tp, stage, form, section)
            same = losses == ref_losses and all(torch.equal(state[k], ref_state[k]) for k in ref_state)
            if not same:
                worst = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
                found["mismatch"].append((stage, form, section, worst, losses, ref_losses))
            key = f"{stage}/{form}/{'partitioned' if section else 'whole'}"
            found["bytes"][key] = (peak.peak_bytes, peak.whole_bytes, peak.peak_checkpoints)
            found["gathers"][key] = gathered - ref_gathered  # what checkpointing added
    if tp > 1:
        mpu.destroy_model_parallel()
    return found


@pytest.mark.parametrize("tp", [1, 2])
def test_checkpointed_training_is_bitwise_the_plain_one(tp: int) -> None:
    results = run_distributed(_bitwise_parity, world_size=2 * tp, args=(tp,), timeout=300)
    for rank, found in enumerate(results):
        assert not found["mismatch"], f"rank {rank}: checkpointed training differs: {found['mismatch']}"
        one_checkpoint = MICRO * SEQ * D * 4  # a block's input, fp32
        for key, (kept, whole, count) in found["bytes"].items():
            assert count == LAYERS, (key, count)
            assert whole == LAYERS * one_checkpoint, (key, whole)
            # P_a at TP 2 keeps exactly half; at TP 1 (or unpartitioned) the whole input.
            expected = whole // tp if key.endswith("partitioned") else whole
            assert kept == expected, (rank, key, kept, whole)
        for key, sent in found["gathers"].items():
            # One all-gather of the input per recompute (LAYERS per micro-step), half of it sent per rank.
            expected = STEPS * GAS * LAYERS * one_checkpoint // 2 if tp > 1 and key.endswith("partitioned") else 0
            assert sent == expected, (rank, key, sent, expected)


def _too_few_checkpoints() -> tuple[str, str, bool]:
    """number_checkpoints below the layers: a ConfigError after the forward that names the count needed,
    and after configure() with the right count the same engine trains."""
    mpu.model_parallel_manual_seed(1234)
    model = Net(1, "reentrant")
    config = _config(2, {"contiguous_memory_optimization": True, "number_checkpoints": LAYERS - 1})
    eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    try:
        eng(*_batch(0, 0, 0))
        message = ""
    except ConfigError as err:
        message = str(err)
    checkpointing.configure(None, deepspeed_config=config, num_checkpoints=LAYERS)
    loss = eng(*_batch(0, 0, 0))
    eng.backward(loss)
    eng.step()
    arena = checkpointing.arena_stats()
    eng.destroy()
    checkpointing.unconfigure()
    return message, str(arena), bool(arena and arena["peak_in_use"] > 0 and arena["in_use"] == 0)


def test_too_few_number_checkpoints_is_named_and_the_run_can_go_on() -> None:
    message, arena, arena_used = run_distributed(_too_few_checkpoints, world_size=2)[0]
    assert "activation_checkpointing.number_checkpoints is 2" in message, message
    assert f"kept {LAYERS} checkpoints" in message and f"at least {LAYERS}" in message, message
    assert arena_used, arena  # the retry used the arena and gave every block back


def test_partition_without_tensor_parallelism_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    checkpointing.unconfigure()
    with caplog.at_level(logging.WARNING, logger="engine.checkpointing"):
        checkpointing.configure(None, partition_activations=True, checkpoint_in_cpu=True)
        layer = nn.Linear(4, 4)
        x = torch.randn(3, 4, requires_grad=True)
        for _ in range(3):
            checkpointing.checkpoint(layer, x).sum().backward()
    checkpointing.unconfigure()
    no_tp = [r for r in caplog.records if "no tensor parallelism" in r.message]
    no_cpu = [r for r in caplog.records if "cpu_checkpointing has no effect" in r.message]
    assert len(no_tp) == 1 and len(no_cpu) == 1, [r.message for r in caplog.records]


def test_contiguous_without_number_checkpoints_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="needs activation_checkpointing.number_checkpoints"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    assert not checkpointing.is_configured()  # the failed call left the previous setting


def _megatron_order() -> tuple[str, int | None]:
    """Megatron configures checkpointing before initialize; its arguments take precedence over the
    config's section, which alone would be refused (contiguous without number_checkpoints)."""
    mpu.model_parallel_manual_seed(1234)
    checkpointing.configure(None, num_checkpoints=LAYERS)
    model = Net(1, "reentrant")
    config = _config(2, {"contiguous_memory_optimization": True})
    eng, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = eng(*_batch(0, 0, 0))
    eng.backward(loss)
    eng.step()
    settings = checkpointing.current()
    eng.destroy()
    checkpointing.unconfigure()
    return settings.configured_by, settings.options.number_checkpoints


def test_configure_before_initialize_takes_precedence_over_the_section() -> None:
    """Refused before: initialize checked the config's section although configure() had been called."""
    assert run_distributed(_megatron_order, world_size=2)[0] == ("user", LAYERS)


def test_configure_reads_the_section_of_a_config_file_and_arguments_override_it(tmp_path: Any) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 4, "activation_checkpointing": {"cpu_checkpointing": true, '
        '"contiguous_memory_optimization": true, "number_checkpoints": 6, "profile": true}}'
    )
    checkpointing.unconfigure()
    checkpointing.configure(None, deepspeed_config=str(path), num_checkpoints=8, profile=False)
    options = checkpointing.current().options
    assert checkpointing.is_configured() and checkpointing.current().configured_by == "user"
    assert (
        options.cpu_checkpointing,
        options.contiguous_memory_optimization,
        options.number_checkpoints,
        options.profile,
        options.partition_activations,
    ) == (True, True, 8, False, False)
    checkpointing.unconfigure()
    assert not checkpointing.is_configured()
    loaded = engine.load_config(str(path), world_size=1, world_size_source="test")
    assert loaded.activation_checkpointing is not None and loaded.activation_checkpointing.number_checkpoints == 6


def test_keyword_tensors_and_non_tensor_outputs_pass_through_both_forms() -> None:
    checkpointing.unconfigure()
    layer = nn.Linear(4, 4)

    def block(x: torch.Tensor, *, scale: torch.Tensor, tag: str) -> tuple[torch.Tensor, str, torch.Tensor]:
        return layer(x) * scale, tag, (x > 0).sum()

    x = torch.randn(3, 4, requires_grad=True)
    scale = torch.tensor(2.0, requires_grad=True)
    plain = block(x, scale=scale, tag="t")
    plain[0].sum().backward()
    expected = [t.grad.clone() for t in (x, scale, layer.weight)]
    for form in (checkpointing.checkpoint, checkpointing.non_reentrant_checkpoint):
        for t in (x, scale, layer.weight):
            t.grad = None
        out, tag, count = form(block, x, scale=scale, tag="t")
        assert tag == "t" and torch.equal(count, plain[2]) and torch.equal(out, plain[0])
        out.sum().backward()
        assert all(torch.equal(t.grad, e) for t, e in zip((x, scale, layer.weight), expected)), form.__name__


def test_an_input_modified_in_place_after_the_forward_is_refused() -> None:
    checkpointing.unconfigure()
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 1.0
    out = checkpointing.checkpoint(layer, h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after its forward"):
        out.sum().backward()


def test_non_reentrant_reaches_parameters_when_no_input_requires_grad(caplog: pytest.LogCaptureFixture) -> None:
    checkpointing.unconfigure()
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4)  # e.g. the output of a frozen embedding
    checkpointing.non_reentrant_checkpoint(layer, x).sum().backward()
    assert layer.weight.grad is not None and torch.equal(layer.weight.grad, torch.ones(4, 3) @ x)
    with caplog.at_level(logging.WARNING, logger="engine.checkpointing"):
        out = checkpointing.checkpoint(layer, x)
    assert not out.requires_grad and any(
        "use engine.checkpointing.non_reentrant_checkpoint" in r.message for r in caplog.records
    )


def test_profile_logs_each_forward_and_recompute(caplog: pytest.LogCaptureFixture) -> None:
    checkpointing.unconfigure()
    checkpointing.configure(None, profile=True, synchronize=True)
    layer = nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="engine.checkpointing"):
        checkpointing.checkpoint(layer, torch.randn(3, 4, requires_grad=True)).sum().backward()
    checkpointing.unconfigure()
    phases = [r.message.split(":")[0] for r in caplog.records if r.message.startswith("activation checkpoint ")]
    assert phases == ["activation checkpoint forward", "activation checkpoint recompute+backward"], phases


def test_checkpoints_of_a_forward_without_backward_are_freed_with_its_graph() -> None:
    """An evaluation forward with grad on keeps checkpoints only while its output lives; reset() drops
    the arena (DeepSpeed's reset for evaluation loops)."""
    checkpointing.unconfigure()
    checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    layers = [nn.Linear(4, 4) for _ in range(2)]
    for _ in range(3):  # a third forward would overflow if the first two kept their blocks
        h = torch.randn(3, 4, requires_grad=True)
        for layer in layers:
            h = checkpointing.checkpoint(layer, h)
        del h
        checkpointing.after_forward()
    assert checkpointing.stats().live_checkpoints == 0
    arena = checkpointing.arena_stats()
    assert arena is not None and arena["in_use"] == 0 and arena["peak_in_use"] == arena["capacity"]
    checkpointing.reset()
    assert checkpointing.arena_stats() is None
    checkpointing.unconfigure()
