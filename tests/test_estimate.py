"""engine.estimate: per-rank model-state bytes per ZeRO stage (the paper's Table 1, this engine's dtypes)."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys

import pytest
import torch

import engine
from engine.estimate import (
    PAPER_COSTS,
    MemoryEstimate,
    engine_costs,
    estimate_memory,
    format_table,
    main,
    matches_printed,
    paper_cells,
)
from engine.estimate.paper_table import PAPER_TABLE
from engine.zero.layout import build_layout
from engine.zero.stage3.unit_plan import leaf_test, plan_units

ROOT = pathlib.Path(__file__).resolve().parents[1]

PSI = 7_500_000_000  # the paper's example: 7.5B parameters on 64-way data parallelism
N = 64
SHARD = PSI // N  # 117,187,500: divides exactly


def _states(e: MemoryEstimate) -> tuple[int, int, int, int]:
    return e.params, e.gradients, e.master, e.optimizer_state


# ------------------------------------------------------------------------ element counts
def test_bf16_adam_per_state_formulas() -> None:
    # b = 2 (bf16), g = 2 (gradients in the accumulation dtype, default bf16), m = 4 (fp32 master),
    # s = 8 (Adam's two fp32 moments); a count has no padding: P = Psi, S = Psi / N.
    b, g, m, s = 2, 2, 4, 8
    expected = {
        0: (b * PSI, g * PSI, m * PSI, s * PSI),
        1: (b * PSI, g * PSI, m * SHARD, s * SHARD),
        2: (b * PSI, g * SHARD, m * SHARD, s * SHARD),
        3: (0, g * SHARD, m * SHARD, s * SHARD),  # no bf16 shard: gathers cast from the fp32 master
    }
    estimates = estimate_memory(PSI, world_size=N, dtype="bf16", optimizer="adam")
    assert [e.stage for e in estimates] == [0, 1, 2, 3]
    for e in estimates:
        assert _states(e) == expected[e.stage]
        assert e.total == sum(expected[e.stage])
        assert (e.world_size, e.numel, e.padded_numel) == (N, PSI, PSI)
        assert e.shard_numel == (PSI if e.stage == 0 else SHARD)
        assert (e.dtype, e.grad_accum_dtype, e.optimizer) == ("bf16", "bf16", "adam")
    # The paper's 16 Psi = 120 GB, 4 Psi + 12 Psi/N = 31.4 GB and 2 Psi + 14 Psi/N = 16.6 GB hold as
    # they are; at stage 3 this engine holds 14 Psi/N (1.64 GB) where the paper has 16 Psi/N (1.88 GB).
    assert [e.total for e in estimates] == [16 * PSI, 4 * PSI + 12 * SHARD, 2 * PSI + 14 * SHARD, 14 * SHARD]


def test_fp32_has_no_master_copy() -> None:
    # The optimizer updates the fp32 parameter storage in place: m = 0, and at stage 3 the fp32
    # shard is the parameters (4 S).
    estimates = estimate_memory(PSI, world_size=N, dtype="float32")
    assert [_states(e) for e in estimates] == [
        (4 * PSI, 4 * PSI, 0, 8 * PSI),
        (4 * PSI, 4 * PSI, 0, 8 * SHARD),
        (4 * PSI, 4 * SHARD, 0, 8 * SHARD),
        (4 * SHARD, 4 * SHARD, 0, 8 * SHARD),
    ]


def test_grad_accum_dtype_overrides_and_single_stage_matches_list() -> None:
    everything = estimate_memory(PSI, world_size=N, dtype=torch.bfloat16, grad_accum_dtype="fp32")
    for stage in range(4):
        one = estimate_memory(PSI, stage=stage, world_size=N, dtype="bfloat16", grad_accum_dtype=torch.float32)
        assert isinstance(one, MemoryEstimate)
        assert one == everything[stage]
    assert [e.gradients for e in everything] == [4 * PSI, 4 * PSI, 4 * SHARD, 4 * SHARD]
    assert everything[0].grad_accum_dtype == "fp32"
    # fp32 training with bf16 accumulation: the explicit dtype wins at every stage.
    assert [e.gradients for e in estimate_memory(PSI, world_size=N, grad_accum_dtype="bf16")] == [
        2 * PSI,
        2 * PSI,
        2 * SHARD,
        2 * SHARD,
    ]


@pytest.mark.parametrize(
    ("optimizer", "state_bytes"),
    [("adam", 8), ("AdamW", 8), ("LAMB", 8), ("sgd", 4), ("Adagrad", 4), ("lion", 4)],
)
def test_optimizer_state_bytes(optimizer: str, state_bytes: int) -> None:
    assert estimate_memory(1000, stage=0, optimizer=optimizer).optimizer_state == state_bytes * 1000
    assert estimate_memory(1000, stage=1, world_size=4, optimizer=optimizer).optimizer_state == state_bytes * 250


def test_uneven_shards_round_up() -> None:
    e = estimate_memory(10, stage=3, world_size=4, dtype="fp16")
    assert (e.padded_numel, e.shard_numel) == (10, 3)
    assert _states(e) == (0, 2 * 3, 4 * 3, 8 * 3)


# ------------------------------------------------------------------------------- modules
class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)  # 800
        self.frozen = torch.nn.Linear(8, 8)  # 72, frozen below
        self.head = torch.nn.Linear(8, 100, bias=True)  # weight tied to embed; bias 100
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)


def test_module_counts_tied_once_and_skips_frozen() -> None:
    e = estimate_memory(_Tied(), stage=0)
    assert e.numel == 800 + 100
    assert (e.padded_numel, e.shard_numel) == (928, 928)  # padded to 128 bytes = 32 fp32 elements
    assert _states(e) == (4 * 928, 4 * 928, 0, 8 * 900)


def _linears() -> torch.nn.Sequential:
    # 7*5+5 + 5*3+3 + 3*11+11 = 40 + 18 + 44 = 102 elements: no multiple of an alignment, so padding shows.
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 11))


def _by_hand(model: torch.nn.Sequential, stage: int, world_size: int, b: int) -> tuple[int, int]:
    """(P, S) from build_layout directly: one flat group at stages 0-2 (world size 1 at stage 0); at
    stage 3 a Sequential of three Linears is a repeated block list, so each layer is a gather unit."""
    if stage == 3:
        layouts = [
            build_layout(
                [p.shape for p in layer.parameters()],
                world_size=world_size,
                bucket_size=sum(p.numel() for p in layer.parameters()),
                element_size=b,
            )
            for layer in model
        ]
        return sum(lay.padded_numel for lay in layouts), sum(lay.shard_numel for lay in layouts)
    layout = build_layout(
        [p.shape for p in reversed(list(model.parameters()))],
        world_size=1 if stage == 0 else world_size,
        bucket_size=500_000_000,
        element_size=b,
    )
    return layout.padded_numel, layout.shard_numel


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_module_sizes_follow_the_layout(stage: int, world_size: int, dtype: str) -> None:
    model = _linears()
    b = 4 if dtype == "fp32" else 2
    P, S = _by_hand(model, stage, world_size, b)
    assert P > 102  # padding is counted
    assert S == (P if stage == 0 else P // world_size)
    e = estimate_memory(model, stage=stage, world_size=world_size, dtype=dtype)
    assert isinstance(e, MemoryEstimate)
    assert (e.numel, e.padded_numel, e.shard_numel) == (102, P, S)
    m = 0 if dtype == "fp32" else 4
    expected = {
        0: (b * P, b * P, m * P, 8 * 102),
        1: (b * P, b * P, m * S, 8 * S),
        2: (b * P, b * S, m * S, 8 * S),
        3: (4 * S if dtype == "fp32" else 0, b * S, m * S, 8 * S),
    }
    assert _states(e) == expected[stage]


def test_module_bucket_size_adds_padding_per_bucket() -> None:
    model = torch.nn.Linear(12, 10)  # 130 elements; fp32 on 2 ranks pads to multiples of 2 x 32 = 64
    one_bucket = estimate_memory(model, stage=2, world_size=2)
    assert (one_bucket.padded_numel, one_bucket.shard_numel) == (192, 96)
    two_buckets = estimate_memory(model, stage=2, world_size=2, bucket_size=70)  # 2 buckets of 128
    layout = build_layout([p.shape for p in model.parameters()], world_size=2, bucket_size=70, element_size=4)
    assert layout.num_buckets == 2
    assert (
        (two_buckets.padded_numel, two_buckets.shard_numel) == (layout.padded_numel, layout.shard_numel) == (256, 128)
    )
    assert estimate_memory(model, stage=3, world_size=2, bucket_size=70).padded_numel == 192  # a unit: one bucket


class _TwoBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(10, 13), torch.nn.Linear(13, 10)])  # 143, 140
        self.head = torch.nn.Linear(10, 3)  # 33
        self.blocks[1].bias.requires_grad_(False)  # frozen: no model states


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_stage3_sums_over_gather_units(world_size: int) -> None:
    model = _TwoBlocks()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = plan_units(model, leaf_test(None), merge_below=0)
    # The repeated block list gives one unit per block; the head goes to the root unit.
    assert [u.name for u in units] == ["<root>", "blocks.0", "blocks.1"]
    groups = [[p.shape for p in u.params if p.requires_grad] for u in units]
    assert [sum(math.prod(s) for s in g) for g in groups] == [33, 143, 130]
    layouts = [
        build_layout(g, world_size=world_size, bucket_size=sum(math.prod(s) for s in g), element_size=2) for g in groups
    ]
    P, S = sum(lay.padded_numel for lay in layouts), sum(lay.shard_numel for lay in layouts)
    assert all(lay.padded_numel > lay.numel for lay in layouts)  # each unit is padded on its own
    e = estimate_memory(model, stage=3, world_size=world_size, dtype="bf16")
    assert isinstance(e, MemoryEstimate)
    assert (e.numel, e.padded_numel, e.shard_numel) == (306, P, S)
    assert _states(e) == (0, 2 * S, 4 * S, 8 * S)
    one_group = build_layout([s for g in groups for s in g], world_size=world_size, bucket_size=306, element_size=2)
    assert S > one_group.shard_numel  # per-unit padding, not one flat group's
    # Planning the units left the module as it was.
    assert [n for n, _ in model.named_parameters()] == list(before)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(getattr(m, "_z3_leaf", False) for m in model.modules())


# --------------------------------------------------------------------------- the paper
def test_paper_table_all_54_cells() -> None:
    cells = paper_cells()
    assert len(cells) == len(PAPER_TABLE) == 54
    mismatched = [(c.model, c.stage, c.world_size, c.estimate.total / 1e9, c.printed) for c in cells if not c.matches]
    assert mismatched == []
    # The formulas the paper states: 4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N, 16 Psi/N (Psi/N rounded up).
    for c in cells:
        psi, shard = c.estimate.numel, -(-c.estimate.numel // c.world_size)
        assert c.estimate.total == {1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[c.stage]
        assert c.estimate.costs == PAPER_COSTS


def test_paper_cells_tell_the_engine_apart() -> None:
    # With the engine's bf16 costs only stage 3 differs: 14 Psi/N (no bf16 parameter shard), not 16.
    cells = paper_cells(engine_costs("bf16"))
    assert all(c.matches for c in cells if c.stage in (1, 2))
    at_64 = [c for c in cells if c.stage == 3 and c.world_size == 64]
    assert len(at_64) == 3 and not any(c.matches for c in at_64)
    assert next(c for c in at_64 if c.model == "7.5B").estimate.total == 14 * SHARD  # 1.64 GB, printed 1.88


def test_matches_printed_rounding() -> None:
    gb = 10**9
    assert matches_printed(25775 * gb // 100, "257")  # 257.75, truncated as the paper does
    assert matches_printed(25775 * gb // 100, "258")  # rounded half-up
    assert not matches_printed(25775 * gb // 100, "256")
    assert matches_printed(4125 * gb // 100, "41.3")  # 41.25: half-up, not half-even
    assert not matches_printed(4125 * gb // 100, "41.4")
    assert matches_printed(1875 * gb // 1000, "1.88") and not matches_printed(1875 * gb // 1000, "1.89")
    assert matches_printed(120 * gb, "120") and not matches_printed(120 * gb + gb, "120")


# ---------------------------------------------------------------------------- errors, table
def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'fp32'.*'bf16'.*'fp16'"):
        estimate_memory(10, dtype="fp8")
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        estimate_memory(10, grad_accum_dtype=torch.int8)
    with pytest.raises(ValueError, match="'adam'.*'sgd'.*'lion'"):
        estimate_memory(10, optimizer="rmsprop")
    with pytest.raises(ValueError, match="stage"):
        estimate_memory(10, stage=4)
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(10, world_size=0)
    with pytest.raises(ValueError, match="bucket_size"):
        estimate_memory(_linears(), bucket_size=0)
    with pytest.raises(ValueError, match=">= 0"):
        estimate_memory(-1)
    with pytest.raises(TypeError):
        estimate_memory(7.5e9)  # type: ignore[call-overload]


def test_format_table() -> None:
    table = format_table(estimate_memory(PSI, world_size=N, dtype="bf16"))
    assert "Psi = 7,500,000,000" in table and "N = 64" in table and "bf16" in table
    assert "accumulation dtype" in table and "fp32 shard from stage 2" not in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4
    assert "111.76 GiB" in rows[0]  # 16 Psi = 120e9 bytes
    assert rows[3].startswith("| 3 (P_os+g+p) | 0 B |") and "117,187,500 |" in rows[3]
    assert "bucket buffers" in table  # says what is excluded
    assert "no bf16 parameter shard" in table
    assert len(format_table(estimate_memory(PSI, stage=2, world_size=N)).splitlines()) == 7


def test_exported_from_package() -> None:
    assert engine.estimate_memory is estimate_memory
    assert "estimate_memory" in engine.__all__


# ------------------------------------------------------------------------------------ CLI
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.estimate", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_prints_four_stages() -> None:
    proc = _cli("--params", "7.5e9", "--world-size", "64", "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # notably no runpy double-import warning
    for label in ("0 (baseline)", "1 (P_os)", "2 (P_os+g)", "3 (P_os+g+p)"):
        assert f"| {label} |" in proc.stdout
    assert "N = 64" in proc.stdout and "accumulation dtype bf16" in proc.stdout


def test_cli_one_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "1.5B", "--world-size", "8", "--optimizer", "SGD", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 3 (P_os+g+p) |" in out and "| 0 (baseline) |" not in out


def test_cli_paper() -> None:
    proc = _cli("--paper")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert "| N_d | 7.5B P_os | 7.5B P_os+g | 7.5B P_os+g+p | 128B P_os |" in out
    assert "| 64 | 31.4063 = 31.4 | 16.6406 = 16.6 | 1.875 = 1.88 |" in out
    assert "257.75 = 257" in out and "!=" not in out.split("\n\n")[1]
    assert "54 of 54 cells match" in out
    assert "K = 12 B" in out and "no fp16/bf16 parameter shard" in out and "accumulation dtype" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7.5e9", "--dtype", "fp8"], "--dtype: invalid choice"),
        (["--params", "7.5e9", "--optimizer", "rmsprop"], "--optimizer: invalid choice"),
        (["--params", "lots"], "not a parameter count"),
        (["--params", "1e6", "--world-size", "0"], "--world-size"),
        (["--params", "1e6", "--stage", "4"], "--stage: invalid choice"),
        ([], "required: --params"),
        (["--world-size", "8"], "required: --params"),
        (["--paper", "--params", "7.5e9"], "drop --params"),
        (["--paper", "--dtype", "bf16", "--stage", "3"], "drop --dtype, --stage"),
    ],
)
def test_cli_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    # In-process (argparse exits with status 2) to spare a torch import per case.
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
