"""The fused Adam op (csrc/cpu/adam.cpp via engine/ops/adam.py) and CPUAdam.

Tolerances: the compiled op evaluates torch's float32 expression with the fused multiply-adds where
torch's kernels have them, so m and v match torch bitwise on this platform; the parameter can differ
by about an ulp of the update (lr * m / denom) because torch's CPU sqrt (MKL) is one ulp off the
correctly rounded one on ~0.6% of inputs. Hence rtol 1e-6 plus atol 1e-7 (lr 1e-2) on parameters
against the fallback and atol 1e-6 after 100 steps against torch. The fallback *is* torch's op
sequence, so there we demand bitwise equality. Low-precision copies must equal `master.to(dtype)`
bit for bit on either path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.ops import adam as adam_ops
from engine.ops import builder
from engine.ops.adam import AdamScalars, AdamTensors, CPUAdam, adam_step, adam_step_reference
from engine.optim.adam import ReferenceAdam

KCHUNK = 1 << 14  # zero_engine::kChunk (csrc/cpu/ops.h): sizes below straddle its boundaries
SIZES = [1, 15, 17, 0, KCHUNK - 1, KCHUNK + 1, 2 * KCHUNK + 33, 5]
HYPER = {
    "lr": 1e-2,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "adamw_mode": True,
    "step": 3,
    "bias_correction": True,
    "grad_scale": 1.0,
}


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The compiled path; ZERO_ENGINE_OPS=require turns a broken build into a failure, not a fallback."""
    monkeypatch.setenv(builder.ENV_MODE, "require")
    builder.reset_for_tests()
    ext = builder.load()
    assert ext is not None and hasattr(ext, "adam_step")
    yield ext
    builder.reset_for_tests()


@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(builder.ENV_MODE, "fallback")
    builder.reset_for_tests()
    assert builder.load() is None
    yield
    builder.reset_for_tests()


def _tensors(sizes: list[int], grad_dtype: torch.dtype, lp_dtype: torch.dtype | None, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "params": [torch.randn(n, generator=gen) for n in sizes],
        "grads": [(torch.randn(n, generator=gen) * 3e-2).to(grad_dtype) for n in sizes],
        "exp_avgs": [torch.randn(n, generator=gen) * 1e-2 for n in sizes],
        "exp_avg_sqs": [torch.rand(n, generator=gen) * 1e-3 for n in sizes],
        "lp_params": [torch.zeros(n, dtype=lp_dtype) for n in sizes] if lp_dtype else None,
    }


def _clone(tensors: dict) -> dict:
    return {k: None if v is None else [t if t is None else t.clone() for t in v] for k, v in tensors.items()}


def _lists(tensors: dict) -> AdamTensors:
    return AdamTensors(*(tensors[k] for k in AdamTensors._fields))


def _run(fn: Any, tensors: dict, **hyper: Any) -> dict:
    out = _clone(tensors)
    fn(_lists(out), AdamScalars(**{**HYPER, **hyper}))
    return out


HYPER_CASES = {
    "adamw_decay": {"weight_decay": 0.1},
    "adam_l2": {"adamw_mode": False, "weight_decay": 0.1},
    "no_bias_correction": {"bias_correction": False, "weight_decay": 0.05},
    "grad_scale": {"grad_scale": 0.37, "weight_decay": 0.1},
    "l2_scaled_first_step": {"adamw_mode": False, "weight_decay": 0.01, "grad_scale": 1 / 1024, "step": 1},
    "beta1_large_lerp_weight": {"beta1": 0.3, "beta2": 0.9, "step": 1000},
}


@pytest.mark.parametrize("case", list(HYPER_CASES))
@pytest.mark.parametrize("lp_dtype", [None, torch.bfloat16, torch.float16], ids=["no_lp", "lp_bf16", "lp_fp16"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["g32", "gbf16", "g16"])
def test_compiled_matches_fallback(
    compiled: Any, grad_dtype: torch.dtype, lp_dtype: torch.dtype | None, case: str
) -> None:
    tensors = _tensors(SIZES, grad_dtype, lp_dtype)
    if HYPER_CASES[case].get("grad_scale", 1.0) < 0.01:  # as if unscaling a loss scale of 1024
        tensors["grads"] = [(g.float() * 1024).to(grad_dtype) for g in tensors["grads"]]
    got = _run(adam_step, tensors, **HYPER_CASES[case])
    want = _run(adam_step_reference, tensors, **HYPER_CASES[case])
    for key, atol in (("params", 1e-7), ("exp_avgs", 1e-9), ("exp_avg_sqs", 1e-9)):
        for i, (g, w) in enumerate(zip(got[key], want[key])):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=atol, msg=lambda m, k=key, i=i: f"{k}[{i}]: {m}")
    assert all(torch.equal(g, t) for g, t in zip(got["grads"], tensors["grads"])), "grads must not be modified"
    if lp_dtype is not None:
        for p, lp in zip(got["params"], got["lp_params"]):
            assert torch.equal(lp, p.to(lp_dtype))  # round to nearest even, bit for bit


@pytest.mark.parametrize("path", ["compiled", "fallback"])
def test_empty_and_zero_size(path: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    adam_step(AdamTensors([], [], [], [], None), AdamScalars(**HYPER))
    adam_step(AdamTensors([], [], [], [], []), AdamScalars(**HYPER))
    out = _run(adam_step, _tensors([0, 0], torch.bfloat16, torch.bfloat16))
    assert [p.numel() for p in out["params"]] == [0, 0]


@pytest.mark.parametrize("path", ["compiled", "fallback"])
def test_version_counters_bumped(path: str, request: pytest.FixtureRequest) -> None:
    # In-place semantics: autograd must see that the tensors changed (a stale saved tensor then errors).
    request.getfixturevalue(path)
    t = _tensors([5, KCHUNK + 1], torch.float32, torch.bfloat16)
    before = {k: [x._version for x in t[k]] for k in ("params", "exp_avgs", "exp_avg_sqs", "lp_params")}
    adam_step(_lists(t), AdamScalars(**HYPER))
    for key, versions in before.items():
        assert all(x._version > v for x, v in zip(t[key], versions)), key


def test_compiled_path_is_taken(compiled: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the torch fallback ran although the extension is loaded")

    monkeypatch.setattr(adam_ops, "adam_step_reference", fail)
    _run(adam_step, _tensors([7, KCHUNK + 3], torch.bfloat16, torch.bfloat16))


def test_fallback_is_the_reference(fallback: None) -> None:
    tensors = _tensors(SIZES, torch.float16, torch.bfloat16)
    got = _run(adam_step, tensors, weight_decay=0.1, grad_scale=0.5)
    want = _run(adam_step_reference, tensors, weight_decay=0.1, grad_scale=0.5)
    for key in ("params", "exp_avgs", "exp_avg_sqs", "lp_params"):
        assert all(torch.equal(g, w) for g, w in zip(got[key], want[key])), key


def test_bitwise_identical_at_any_thread_count(compiled: Any) -> None:
    tensors = _tensors([5 * KCHUNK + 3, 7, 3 * KCHUNK, 2 * KCHUNK - 1], torch.bfloat16, torch.bfloat16, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(adam_step, tensors, weight_decay=0.1, grad_scale=0.25)
        torch.set_num_threads(2)
        two = _run(adam_step, tensors, weight_decay=0.1, grad_scale=0.25)
    finally:
        torch.set_num_threads(threads)
    for key in ("params", "exp_avgs", "exp_avg_sqs", "lp_params"):
        assert all(torch.equal(a, b) for a, b in zip(one[key], two[key])), key


def _bad(kind: str) -> tuple[dict, dict]:
    t = _tensors([4, 6], torch.float32, torch.bfloat16)
    hyper: dict = {}
    if kind == "lengths":
        t["grads"] = t["grads"][:1]
    elif kind == "lp_length":
        t["lp_params"] = t["lp_params"][:1]
    elif kind == "grad_dtype":
        t["grads"][1] = t["grads"][1].to(torch.int32)
    elif kind == "param_dtype":
        t["params"][0] = t["params"][0].double()
    elif kind == "lp_dtype":
        t["lp_params"][0] = t["lp_params"][0].float()
    elif kind == "not_contiguous":
        t["exp_avgs"][1] = torch.zeros(6, 2)[:, 0]
    elif kind == "numel":
        t["exp_avg_sqs"][0] = torch.zeros(3)
    elif kind == "not_tensor":
        t["grads"][0] = None
    elif kind == "step":
        hyper["step"] = 0
    elif kind == "beta":
        hyper["beta2"] = 1.0
    elif kind == "grad_scale":
        hyper["grad_scale"] = float("inf")
    return t, hyper


BAD = {
    "lengths": (ValueError, r"one grad, exp_avg and exp_avg_sq per param expected; got 2 params, 1 grads"),
    "lp_length": (ValueError, r"lp_params must be empty or hold one tensor per param; got 1 for 2"),
    "grad_dtype": (TypeError, r"grads\[1\] has dtype .*; expected float32, bfloat16 or float16"),
    "param_dtype": (TypeError, r"params\[0\] has dtype .*; expected float32"),
    "lp_dtype": (TypeError, r"lp_params\[0\] has dtype .*; expected bfloat16 or float16"),
    "not_contiguous": (ValueError, r"exp_avgs\[1\] is not contiguous; pass .contiguous\(\)"),
    "numel": (ValueError, r"exp_avg_sqs\[0\] has 3 elements but params\[0\] has 4"),
    "not_tensor": (TypeError, r"grads\[0\] is NoneType, not a tensor"),
    "step": (ValueError, r"step must be an int >= 1"),
    "beta": (ValueError, r"betas must be in \[0, 1\), got \(0.9, 1.0\)"),
    "grad_scale": (ValueError, r"grad_scale must be finite"),
}


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("path", ["compiled", "fallback"])
def test_bad_arguments_are_named(path: str, kind: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    tensors, hyper = _bad(kind)
    error, pattern = BAD[kind]
    with pytest.raises(error, match=pattern):  # not through _run: clone() would make tensors contiguous
        adam_step(_lists(tensors), AdamScalars(**{**HYPER, **hyper}))


# ---- CPUAdam against torch's optimizers -------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 7))


def _groups(model: torch.nn.Module) -> list[dict]:
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 3e-3}]


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, loss_scale: float = 1.0, **step_kwargs: Any
) -> None:
    """`steps` steps with a StepLR that cuts the LR 3x half-way; the same batches for every call."""
    gen = torch.Generator().manual_seed(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=max(steps // 2, 1), gamma=1 / 3)
    for _ in range(steps):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 7, generator=gen)
        opt.zero_grad()
        (torch.nn.functional.mse_loss(model(x), y) * loss_scale).backward()
        opt.step(**step_kwargs)
        sched.step()


def _assert_same_params(got: torch.nn.Module, want: torch.nn.Module, exact: bool) -> None:
    for (name, g), w in zip(got.named_parameters(), want.parameters()):
        if exact:
            assert torch.equal(g, w), name
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("path", ["compiled", "fallback"])
def test_cpu_adam_matches_torch(path: str, adamw_mode: bool, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(path)
    ours, theirs = _model(), _model()
    opt = CPUAdam(_groups(ours), lr=1e-2, adamw_mode=adamw_mode)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = torch_cls(_groups(theirs), lr=1e-2, foreach=False)
    _train(ours, opt, 100)
    _train(theirs, ref, 100)
    _assert_same_params(ours, theirs, exact=path == "fallback")
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < 1e-2  # the scheduler's cut was applied


@pytest.mark.parametrize("path", ["compiled", "fallback"])
def test_cpu_adam_grad_scale_unscales(path: str, request: pytest.FixtureRequest) -> None:
    # A loss scaled by 2^10 gives gradients exactly 2^10 larger; grad_scale=2^-10 undoes it exactly.
    request.getfixturevalue(path)
    ours, theirs = _model(), _model()
    _train(ours, CPUAdam(_groups(ours), lr=1e-2), 30, loss_scale=1024.0, grad_scale=1 / 1024)
    _train(theirs, torch.optim.AdamW(_groups(theirs), lr=1e-2, foreach=False), 30)
    _assert_same_params(ours, theirs, exact=path == "fallback")


@pytest.mark.parametrize("lp_dtype", [torch.bfloat16, torch.float16])
def test_cpu_adam_lp_copy_is_master_rounded(compiled: Any, lp_dtype: torch.dtype) -> None:
    model = _model()
    opt = CPUAdam(_groups(model), lr=1e-2)
    flat = [p for group in opt.param_groups for p in group["params"]]
    lp = [torch.zeros_like(p, dtype=lp_dtype) for p in flat]
    lp[-1] = None  # no copy wanted for this one
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 12, generator=gen)).square().mean().backward()
        opt.step(lp_params=lp)
        for p, copy in zip(flat[:-1], lp[:-1]):
            assert torch.equal(copy, p.detach().to(lp_dtype))
    with pytest.raises(ValueError, match=r"lp_params has 3 entries but the optimizer has 4 params"):
        opt.step(lp_params=lp[:3])


def test_cpu_adam_without_bias_correction(compiled: Any) -> None:
    ours, theirs = _model(), _model()
    _train(ours, CPUAdam(_groups(ours), lr=1e-2, bias_correction=False), 40)
    _train(theirs, ReferenceAdam(_groups(theirs), lr=1e-2, bias_correction=False), 40)
    _assert_same_params(ours, theirs, exact=False)


def test_state_dict_interchangeable_with_torch_adamw(compiled: Any) -> None:
    ours, theirs = _model(), _model()
    opt, ref = CPUAdam(_groups(ours), lr=1e-2), torch.optim.AdamW(_groups(theirs), lr=1e-2, foreach=False)
    _train(ours, opt, 10)
    _train(theirs, ref, 10)
    state, ref_state = opt.state_dict()["state"], ref.state_dict()["state"]
    assert state.keys() == ref_state.keys() and state[0].keys() == ref_state[0].keys()
    assert state[0]["step"].dtype == ref_state[0]["step"].dtype == torch.float32 and state[0]["step"].item() == 10
    # Swap: torch continues from our state and we from torch's; both runs stay on the same trajectory.
    swapped_ref = torch.optim.AdamW(_groups(ours), lr=1e-2, foreach=False)
    swapped_ref.load_state_dict(opt.state_dict())
    swapped_ours = CPUAdam(_groups(theirs))
    swapped_ours.load_state_dict(ref.state_dict())
    _train(ours, swapped_ref, 10)
    _train(theirs, swapped_ours, 10)
    _assert_same_params(ours, theirs, exact=False)


def test_cpu_adam_rejects_what_it_does_not_implement() -> None:
    with pytest.raises(NotImplementedError, match="amsgrad"):
        CPUAdam(_model().parameters(), amsgrad=True)
    model = _model()
    opt = CPUAdam(model.parameters())
    opt.load_state_dict(torch.optim.AdamW(model.parameters(), maximize=True).state_dict())
    model(torch.ones(1, 12)).sum().backward()
    with pytest.raises(NotImplementedError, match="maximize"):
        opt.step()


def test_fallback_works_in_bounded_pieces_with_the_same_result() -> None:
    # The torch path upcasts a low-precision gradient piece by piece (adam_ops._PIECE elements), never
    # the whole tensor: the result equals the same math done on whole tensors, bit for bit.
    n = 2 * adam_ops._PIECE + 77
    tensors = _tensors([n], torch.bfloat16, torch.bfloat16)
    got = _run(adam_step_reference, tensors, weight_decay=0.1, grad_scale=0.37)
    hyper = {**HYPER, "weight_decay": 0.1}
    p, m, v = (tensors[k][0].clone() for k in ("params", "exp_avgs", "exp_avg_sqs"))
    g = tensors["grads"][0].float() * 0.37
    step = hyper["step"]
    p.mul_(1 - hyper["lr"] * hyper["weight_decay"])
    m.lerp_(g, 1 - hyper["beta1"])
    v.mul_(hyper["beta2"]).addcmul_(g, g, value=1 - hyper["beta2"])
    denom = (v.sqrt() / (1 - hyper["beta2"] ** step) ** 0.5).add_(hyper["eps"])
    p.addcdiv_(m, denom, value=-hyper["lr"] / (1 - hyper["beta1"] ** step))
    assert torch.equal(got["params"][0], p)
    assert torch.equal(got["exp_avgs"][0], m) and torch.equal(got["exp_avg_sqs"][0], v)
    assert torch.equal(got["lp_params"][0], p.bfloat16())
