"""engine.profiling: flops counted by FlopCounterMode against analytic matmul counts, DeepSpeed's
report layout, get_model_profile's inputs, and the cached peak probe."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.profiling import FlopsProfiler, get_model_profile, measured_peak_flops, peak
from engine.profiling.flops_profiler import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, Block, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
B, T, D, V = 2, CFG.seq_len, CFG.d_model, CFG.vocab_size


def block_flops(b: int, t: int, d: int) -> dict[str, int]:
    """Forward matmul flops of one Block (2 per multiply-accumulate; biases and norms not counted)."""
    return {
        "qkv": 2 * b * t * d * 3 * d,
        "attention": 2 * b * t * t * d + 2 * b * t * t * d,  # scores q k^T, then weights @ v: full, not causal
        "proj": 2 * b * t * d * d,
        "mlp": 2 * b * t * d * 4 * d * 2,
    }


def gpt_flops() -> int:
    return CFG.n_layers * sum(block_flops(B, T, D).values()) + 2 * B * T * D * V  # blocks + head


def profiled(model: nn.Module, *inputs: torch.Tensor, **start: object) -> FlopsProfiler:
    prof = FlopsProfiler(model)
    prof.start_profile(**start)  # type: ignore[arg-type]
    model(*inputs)
    prof.stop_profile()
    return prof


def tokens() -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))


def rel_err(counted: float, expected: float) -> float:
    return abs(counted - expected) / expected


def test_block_flops_match_the_analytic_count() -> None:
    block = Block(CFG)
    prof = profiled(block, torch.randn(B, T, D))
    expected = block_flops(B, T, D)
    assert rel_err(prof.get_total_flops(), sum(expected.values())) < 0.01  # type: ignore[arg-type]
    assert prof.get_total_macs() * 2 == prof.get_total_flops()
    assert prof.module_profile(block.qkv).flops == expected["qkv"]
    assert prof.module_profile(block.proj).flops == expected["proj"]
    assert prof.module_profile(block.mlp).flops == expected["mlp"]
    # What no submodule ran is the attention Block.forward calls itself (F.scaled_dot_product_attention).
    children = sum(prof.module_profile(m).flops for m in block.children())
    assert prof.module_profile(block).flops - children == expected["attention"]


def test_attention_counts_in_full_even_when_causal() -> None:
    q = torch.randn(B, CFG.n_heads, T, D // CFG.n_heads)
    counts = []
    for causal in (False, True):
        prof = FlopsProfiler(nn.Identity())
        prof.start_profile()
        nn.Identity()(F.scaled_dot_product_attention(q, q, q, is_causal=causal))
        prof.stop_profile()
        counts.append(prof._counter.get_total_flops())  # type: ignore[union-attr]
    assert counts[0] == counts[1] == 4 * B * T * T * D


def test_gpt_flops_match_blocks_plus_head() -> None:
    model = GPT(CFG)
    prof = profiled(model, tokens())
    assert rel_err(prof.get_total_flops(), gpt_flops()) < 0.01  # type: ignore[arg-type]
    assert prof.module_profile(model.head).flops == 2 * B * T * D * V
    assert prof.module_profile(model.blocks).flops == CFG.n_layers * sum(block_flops(B, T, D).values())
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())


def test_a_module_called_twice_counts_twice() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin(x))

    model = Twice()
    prof = profiled(model, torch.randn(B, D))
    assert prof.module_profile(model.lin).flops == 2 * (2 * B * D * D)
    assert 0 < prof.module_profile(model.lin).latency <= prof.get_total_duration()  # type: ignore[operator]


def test_partitioned_parameters_count_their_full_size() -> None:
    lin = nn.Linear(D, D)
    lin.weight.data = torch.empty(0)  # what a ZeRO-3 rank holds between forwards
    lin.weight.ds_numel = D * D  # type: ignore[attr-defined]
    assert FlopsProfiler(lin).get_total_params() == D * D + D


def test_stop_profile_stops_counting_and_start_resets() -> None:
    model = GPT(CFG)
    prof = profiled(model, tokens())
    model(tokens())
    assert prof.get_total_flops() == gpt_flops()
    prof.start_profile()
    model(tokens())
    prof.stop_profile()
    assert prof.get_total_flops() == gpt_flops()
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.print_model_profile()


def test_ignore_list_drops_a_module_type() -> None:
    model = GPT(CFG)
    prof = profiled(model, tokens(), ignore_list=[nn.Linear])
    assert prof.get_total_flops() == CFG.n_layers * block_flops(B, T, D)["attention"]
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters())  # still stored
    text = prof.print_model_profile(output_file=None)
    assert re.search(r"\(head\): Linear\([^,]+ = [\d.]+% Params, not profiled \(ignore_list\)", text), text


def test_get_model_profile_input_shape_and_args_agree() -> None:
    block = Block(CFG)
    by_shape = get_model_profile(block, input_shape=(B, T, D), print_profile=False, as_string=False)
    by_args = get_model_profile(block, args=(torch.randn(B, T, D),), print_profile=False, as_string=False)
    params = sum(p.numel() for p in block.parameters())
    assert by_shape == by_args == (sum(block_flops(B, T, D).values()), sum(block_flops(B, T, D).values()) // 2, params)
    assert block.training  # restored after the eval-mode profile
    as_text = get_model_profile(block, kwargs={"x": torch.randn(B, T, D)}, print_profile=False)
    assert as_text == (number_to_string(by_args[0]), macs_to_string(by_args[1]), params_to_string(params))


def test_printed_profile_has_depth_limited_tree_and_top_modules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nested" / "profile.txt"
    get_model_profile(GPT(CFG), args=(tokens(),), module_depth=2, top_modules=2, output_file=str(out))
    assert capsys.readouterr().out == ""  # written to the file only
    text = out.read_text()
    for needed in (
        "Flops Profiler",
        "Profile Summary at step 1:",
        "Aggregated Profile per GPU",
        "Top 2 modules in terms of params, MACs or fwd latency at different model depths:",
        "depth 0:",
        "depth 2:",
        "Detailed Profile per GPU",
        "(blocks): ModuleList(",
        "(1): Block(",
    ):
        assert needed in text, needed
    assert re.search(r"\nfwd flops per GPU: +" + re.escape(number_to_string(gpt_flops())), text)
    assert "depth 3:" not in text and "(qkv)" not in text  # below module_depth=2
    depth1_params = re.search(r"depth 1:\n    params      - (\{.*\})", text)
    assert depth1_params and len(eval(depth1_params.group(1))) == 2  # the top 2 classes at depth 1


def test_detailed_lines_carry_params_macs_and_latency(capsys: pytest.CaptureFixture[str]) -> None:
    model = GPT(CFG)
    prof = profiled(model, tokens())
    text = prof.print_model_profile(top_modules=3)
    assert capsys.readouterr().out == text
    qkv = next(line for line in text.splitlines() if "(qkv): Linear(" in line)
    params = 3 * D * D + 3 * D
    macs = block_flops(B, T, D)["qkv"] // 2
    assert f"({params_to_string(params)} = {round(100 * params / prof.get_total_params(), 2):g}% Params" in qkv
    assert f"{macs_to_string(macs)} = {round(100 * macs / (gpt_flops() // 2), 2):g}% MACs" in qkv
    assert re.search(r"[\d.]+ [mu]?s = [\d.]+% latency, [\d.]+ [KMGT]?FLOPS", qkv), qkv
    assert prof.module_profile(model.blocks[0].qkv).latency > 0


def test_summary_uses_engine_sizes_and_timings() -> None:
    model = GPT(CFG)
    engine = SimpleNamespace(world_size=4, dp_world_size=2, mp_world_size=2, train_micro_batch_size_per_gpu=lambda: B)
    prof = FlopsProfiler(model, ds_engine=engine, recompute_fwd_factor=1.0)
    prof.start_profile()
    model(tokens())
    prof.stop_profile()
    plain = prof.print_model_profile(output_file="")
    assert "\nbwd latency: " not in plain and "\nsamples/second: " not in plain
    fwd, bwd, step = 0.01, 0.025, 0.005
    prof.timings = {"fwd": fwd, "bwd": bwd, "step": step}
    lines = {
        line.split(":")[0]: line.split(":", 1)[1].strip()
        for line in prof.print_model_profile(detailed=False, output_file="").splitlines()
        if ": " in line
    }
    flops = gpt_flops()
    assert lines["world size"] == "4" and lines["data parallel size"] == "2" and lines["model parallel size"] == "2"
    assert lines["batch size per GPU"] == str(B)
    assert lines["fwd flops of model = fwd flops per GPU * mp_size"] == number_to_string(2 * flops)
    assert lines["fwd latency"] == duration_to_string(fwd)
    assert lines["bwd FLOPS per GPU = 3 * fwd flops per GPU / bwd latency"] == flops_to_string(3 * flops / bwd)
    assert lines["fwd+bwd FLOPS per GPU = 4 * fwd flops per GPU / (fwd+bwd latency)"] == flops_to_string(
        4 * flops / (fwd + bwd)
    )
    assert lines["iter latency"] == duration_to_string(fwd + bwd + step)
    assert lines["samples/second"] == str(round(B * 2 / (fwd + bwd + step), 2))


def test_numbers_read_like_deepspeeds() -> None:
    assert number_to_string(1_234_567) == "1.23 M"
    assert params_to_string(1.5e9) == "1.5 B" and params_to_string(512) == "512"
    assert macs_to_string(4.56e9) == "4.56 GMACs"
    assert duration_to_string(0.0078) == "7.8 ms"
    assert flops_to_string(12.3e12) == "12.3 TFLOPS"


def test_measured_peak_flops_is_positive_and_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peak, "_CACHE", {})
    probes = []
    real_probe = peak._probe

    def counting_probe(*args: object) -> float:
        probes.append(args)
        return real_probe(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(peak, "_probe", counting_probe)
    first = measured_peak_flops()
    assert first > 0 and measured_peak_flops() == first and len(probes) == 1
    monkeypatch.setattr(peak, "_PROBE_SECONDS", 0.01)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1000)  # another thread count: probed again
    measured_peak_flops()
    assert len(probes) == 2


@pytest.mark.parametrize(
    "call, error, names",
    [
        (lambda m: get_model_profile(m), ValueError, "input_shape=.*args="),
        (lambda m: get_model_profile(m, input_shape=(B, D), args=(torch.ones(B, D),)), ValueError, "not both"),
        (
            lambda m: get_model_profile(m, input_shape=[B, D]),
            TypeError,  # type: ignore[arg-type]
            "input_shape must be a tuple",
        ),
        (lambda m: get_model_profile(m, input_shape=(B, 0)), ValueError, "positive ints"),
        (lambda m: get_model_profile(m, args=torch.ones(B, D)), TypeError, r"args=\(x,\)"),  # type: ignore[arg-type]
        (lambda m: get_model_profile(m, input_shape=(B, D), mode="backward"), ValueError, "mode"),
        (lambda m: get_model_profile(m, input_shape=(B, D), mode="generate"), ValueError, "model.generate"),
        (
            lambda m: get_model_profile(lambda x: x, input_shape=(B, D)),
            TypeError,  # type: ignore[arg-type]
            "torch.nn.Module",
        ),
    ],
)
def test_bad_input_is_named(call: object, error: type[Exception], names: str) -> None:
    with pytest.raises(error, match=names):
        call(nn.Linear(D, D))  # type: ignore[operator]
