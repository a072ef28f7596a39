"""What HF Trainer and Accelerate call of DeepSpeed beyond initialize/backward/step, under DeepSpeed's
names, so an alias package named `deepspeed` can re-export them (the Hugging Face integration surfaces
DeepSpeed users rely on): clone_tensors_for_torch_save, the accelerator object,
Init's tensor-constructor wrappers, optimizer.overflow, the 16-bit consolidated state dict and
ZeRO inference (initialize without an optimizer)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

import engine
from engine import accelerator as accel
from engine.zero.clone import clone_tensors_for_torch_save

# ----------------------------------------------------------------- clone_tensors_for_torch_save


def test_clone_tensors_for_torch_save_makes_views_small_files(tmp_path: Path) -> None:
    flat = torch.arange(1_000_000, dtype=torch.float32)  # a 4 MB flat buffer
    view = flat[10:20].view(2, 5)
    torch.save({"w": view}, tmp_path / "view.pt")
    torch.save(clone_tensors_for_torch_save({"w": view}), tmp_path / "cloned.pt")
    assert os.path.getsize(tmp_path / "view.pt") > 4_000_000  # the whole storage went in
    assert os.path.getsize(tmp_path / "cloned.pt") < 4_000
    loaded = torch.load(tmp_path / "cloned.pt", weights_only=True)["w"]
    assert torch.equal(loaded, view)


def test_clone_tensors_for_torch_save_nesting_sharing_and_device() -> None:
    weight = torch.nn.Parameter(torch.randn(3, 2))
    Point = collections.namedtuple("Point", "x y")
    item = collections.OrderedDict(
        a=weight, tied=weight, nested=[weight[0], (torch.ones(2), "text", 3)], point=Point(torch.zeros(1), 5)
    )
    out = clone_tensors_for_torch_save(item, device="cpu")
    assert type(out) is collections.OrderedDict and list(out) == list(item)
    assert out["a"] is out["tied"]  # tied weights stay one tensor, as in module.state_dict()
    assert out["a"].data_ptr() != weight.data_ptr() and not out["a"].requires_grad
    assert torch.equal(out["a"], weight.detach())
    first, rest = out["nested"]
    assert torch.equal(first, weight[0].detach()) and first.untyped_storage().nbytes() == 2 * 4
    assert type(rest) is tuple and rest[1:] == ("text", 3) and torch.equal(rest[0], torch.ones(2))
    assert type(out["point"]) is Point and out["point"].y == 5
    assert clone_tensors_for_torch_save("plain") == "plain"
    tied = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
    tied[1].weight = tied[0].weight
    state = clone_tensors_for_torch_save(tied.state_dict())  # a detached view per name, one clone
    assert state["0.weight"] is state["1.weight"] and state["0.weight"].data_ptr() != tied[0].weight.data_ptr()


# --------------------------------------------------------------------------------- accelerator


def test_accelerator_cpu_methods_hf_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    acc = accel.choose("cpu")
    assert isinstance(acc, accel.CpuAccelerator)
    assert acc.current_device_name() == "cpu" and acc.device_name() == "cpu"
    assert acc.device_name(os.environ["LOCAL_RANK"]) == "cpu"  # transformers passes the string
    assert torch.device(acc.device_name(1)) == torch.device("cpu")
    assert acc.current_device() == 1 and acc.device_count() == 2
    assert acc.is_available() and acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert acc.on_accelerator(torch.ones(1)) and not acc.on_accelerator(torch.ones(1, device="meta"))
    acc.set_device(1)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(7)
    first = torch.rand(3)
    acc.manual_seed_all(7)
    assert torch.equal(torch.rand(3), first) and acc.initial_seed() == 7
    before = acc.memory_allocated()
    assert before > 0 and acc.max_memory_allocated() >= before and acc.total_memory() > before


def test_accelerator_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: auto-detection and DS_ACCELERATOR=cpu give the CPU; cuda and unknown names are named errors.
    assert isinstance(accel.choose(None), accel.CpuAccelerator)
    assert isinstance(accel.choose(" CPU "), accel.CpuAccelerator)
    with pytest.raises(accel.AcceleratorError, match=r"DS_ACCELERATOR='cuda' but torch cannot use CUDA"):
        accel.choose("cuda")
    with pytest.raises(accel.AcceleratorError, match=r"DS_ACCELERATOR='xpu': this engine runs on cpu or cuda"):
        accel.choose("xpu")
    monkeypatch.setattr(accel, "_accelerator", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert accel.get_accelerator() is accel.get_accelerator()  # one per process, as DeepSpeed's
    assert accel.get_accelerator().device_name() == "cpu"
    # CUDA's device names are pure string work, so they can be checked without a GPU.
    cuda = accel.CudaAccelerator()
    assert (cuda.device_name(), cuda.device_name("1"), cuda.device("1")) == ("cuda", "cuda:1", torch.device("cuda", 1))
    assert cuda.communication_backend_name() == "nccl" and not cuda.on_accelerator(torch.ones(1))


def _device_choice() -> tuple[str, str]:
    model = torch.nn.Linear(2, 2)
    eng, *_ = engine.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1})
    out = (str(eng.device), engine.comm.default_backend())
    eng.destroy()
    return out


def test_initialize_takes_its_device_from_the_accelerator() -> None:
    results = run_distributed(_device_choice, 2, env={"DS_ACCELERATOR": "cpu"})
    assert results == [("cpu", "gloo")] * 2
    with pytest.raises(RuntimeError, match=r"DS_ACCELERATOR='tpu': this engine runs on cpu or cuda"):
        run_distributed(_device_choice, 2, env={"DS_ACCELERATOR": "tpu"})


# ------------------------------------------------------------ Init's tensor-constructor wrappers


class _Rope(torch.nn.Module):
    """Float tensors made by torch's constructors, with and without an explicit dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 2))
        torch.nn.init.normal_(self.weight)
        self.register_buffer("inv_freq", torch.arange(0, 4, 2, dtype=torch.float32) / 4)
        self.register_buffer("steps", torch.arange(4.0))
        self.register_buffer("index", torch.arange(3))


def _hf_prevent_arange_dtype_change(pp: object) -> tuple[object, object]:
    """transformers' prevent_arange_dtype_change, as it patches `deepspeed.runtime.zero.partition_parameters`:
    replace the module's wrapper by one that leaves torch.arange's dtype alone. Returns (saved, patched)."""
    original_wrapper = pp.zero_wrapper_for_fp_tensor_constructor

    def wrapper_without_arange(fn: object, *args: object, **kwargs: object) -> object:
        if fn is pp._orig_torch_arange:

            def wrapped_fn(*inner_args: object, **inner_kwargs: object) -> object:
                if inner_kwargs.get("device") is None:
                    inner_kwargs["device"] = kwargs["target_device"]  # KeyError unless passed as a keyword
                return fn(*inner_args, **inner_kwargs)

            return wrapped_fn
        return original_wrapper(fn, *args, **kwargs)

    return original_wrapper, wrapper_without_arange


def _constructors_under_init() -> dict[str, object]:
    from engine.zero import partitioned_init as pp

    with engine.zero.Init(dtype=torch.bfloat16):
        model = _Rope()
        inside = {
            "zeros": torch.zeros(2).dtype,
            "tensor": torch.tensor([1.5]).dtype,
            "full": torch.full((1,), 2.0).dtype,
            "ones_fp32": torch.ones(1, dtype=torch.float32).dtype,
            "long": torch.tensor([1]).dtype,
            "grad_leaf": torch.zeros(2, requires_grad=True).is_leaf,
        }
    saved, patched = _hf_prevent_arange_dtype_change(pp)
    pp.zero_wrapper_for_fp_tensor_constructor = patched
    try:
        with engine.zero.Init(dtype=torch.bfloat16):
            hf_arange, hf_zeros = torch.arange(4.0).dtype, torch.zeros(1).dtype
    finally:
        pp.zero_wrapper_for_fp_tensor_constructor = saved
    return {
        "weight_shard": model.weight._zero_init_shard.dtype,
        "buffers": {n: b.dtype for n, b in model.named_buffers()},
        "inside": inside,
        "hf": (hf_arange, hf_zeros),
        "restored": torch.zeros(1).dtype is torch.float32 and torch.arange is pp._orig_torch_arange,
    }


def test_init_dtype_wraps_tensor_constructors_and_honours_a_patched_wrapper() -> None:
    for result in run_distributed(_constructors_under_init, 2):
        assert result["weight_shard"] is torch.bfloat16
        # Made without a dtype: Init's; an explicit fp32 (a RoPE inv_freq) is kept; integers are left alone.
        assert result["buffers"] == {"inv_freq": torch.float32, "steps": torch.bfloat16, "index": torch.int64}
        assert result["inside"] == {
            "zeros": torch.bfloat16,
            "tensor": torch.bfloat16,
            "full": torch.bfloat16,
            "ones_fp32": torch.float32,
            "long": torch.int64,
            "grad_leaf": True,
        }
        # transformers' patch of the module attribute reaches Init: arange unwrapped, the rest still bf16.
        assert result["hf"] == (torch.float32, torch.bfloat16)
        assert result["restored"]


# ---------------------------------------------------------------------------- optimizer.overflow


def _overflow_flags(precision: str, stages: list[int]) -> dict[int, list[object]]:
    from models import make_model

    rank = torch.distributed.get_rank()
    out: dict[int, list[object]] = {}
    for stage in stages:
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
            **({precision: {"enabled": True}} if precision != "fp32" else {}),
        }
        eng, opt, _, _ = engine.initialize(model=make_model(), config=config)
        flags: list[object] = [opt is eng.optimizer, hasattr(opt, "overflow") and opt.overflow]
        for poison in (False, True, False):  # the middle step overflows on rank 1 only
            x = torch.randn(2, 16, dtype={"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32))
            loss = eng(x).float().pow(2).mean()
            if poison and rank == 1:
                loss = loss * float("inf")
            eng.backward(loss)
            eng.step()
            flags.append((opt.overflow, eng.was_step_applied()))
        eng.destroy()
        out[stage] = flags
    return out


def test_optimizer_overflow_says_a_fp16_step_was_skipped() -> None:
    for flags in run_distributed(_overflow_flags, 2, args=("fp16", [0, 1, 2, 3]), timeout=240):
        for stage in (0, 1, 2, 3):
            # present (False) from initialize on, True exactly for the skipped step, on every rank
            assert flags[stage] == [True, False, (False, True), (True, False), (False, True)], stage


def test_optimizer_overflow_says_a_non_finite_step_was_skipped_without_loss_scaling() -> None:
    # bf16 and fp32 skip a step whose gradient norm is inf/nan as fp16 does (issue 30; before, the inf
    # loss was applied and wrote NaN into every weight while overflow stayed False).
    for flags in run_distributed(_overflow_flags, 2, args=("bf16", [2]), timeout=240):
        assert flags[2] == [True, False, (False, True), (True, False), (False, True)]
    for flags in run_distributed(_overflow_flags, 2, args=("fp32", [0]), timeout=240):
        assert flags[0] == [True, False, (False, True), (True, False), (False, True)]


# ---------------------------------------------- zero_gather_16bit_weights_on_model_save and the 16-bit state dict


class _TiedLM(torch.nn.Module):
    """Tied embedding/head, two blocks (one frozen bias), a persistent and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.blocks[0].bias.requires_grad_(False)
        self.register_buffer("pos", torch.arange(4.0))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def _tied_lm(seed: int = 0) -> _TiedLM:
    torch.manual_seed(seed)
    return _TiedLM()


def _consolidated_16bit(stage: int, gather_flag: bool | None) -> dict[str, object]:
    zero: dict[str, object] = {"stage": stage}
    if gather_flag is not None:
        zero["stage3_gather_16bit_weights_on_model_save"] = gather_flag
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    }
    eng, *_ = engine.initialize(model=_tied_lm(seed=torch.distributed.get_rank()), config=config)
    out: dict[str, object] = {"flag": eng.zero_gather_16bit_weights_on_model_save()}
    if stage != 3:
        try:
            eng._zero3_consolidated_16bit_state_dict()
        except ValueError as err:
            out["error"] = str(err)
        eng.destroy()
        return out
    state = eng._zero3_consolidated_16bit_state_dict()
    trainable = eng._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    out["partitioned_after"] = all(p.numel() == 0 for p in eng.module.parameters())
    eng.destroy()
    if state is None:
        return {**out, "state": None, "trainable": trainable}
    reference = _tied_lm(seed=0).state_dict()  # rank 0's model is the one every rank trains
    out.update(
        {
            "keys": list(state),
            "reference_keys": list(reference),
            "dtypes": {k: v.dtype for k, v in state.items()},
            "devices": {v.device.type for v in state.values()},
            "equal": all(torch.equal(state[k].float(), reference[k].to(state[k].dtype).float()) for k in reference),
            "tied": state["embed.weight"] is state["head.weight"],
            "trainable_keys": list(trainable),
        }
    )
    return out


def test_zero3_consolidated_16bit_state_dict() -> None:
    rank0, rank1 = run_distributed(_consolidated_16bit, 2, args=(3, True))
    assert rank0["flag"] is True and rank0["partitioned_after"] and rank1["partitioned_after"]
    assert rank0["keys"] == rank0["reference_keys"]  # module.state_dict()'s names and order, no scratch buffer
    assert rank0["dtypes"]["embed.weight"] is torch.bfloat16 and rank0["dtypes"]["blocks.0.bias"] is torch.bfloat16
    assert rank0["devices"] == {"cpu"} and rank0["equal"] and rank0["tied"]
    assert rank0["trainable_keys"] == [k for k in rank0["keys"] if k != "blocks.0.bias"]
    assert rank1["state"] is None and rank1["trainable"] is None  # DeepSpeed returns None off rank 0


def test_zero_gather_16bit_flag_and_stage_check() -> None:
    for result in run_distributed(_consolidated_16bit, 2, args=(3, None)):
        assert result["flag"] is False  # absent: False, as in DeepSpeed
    for result in run_distributed(_consolidated_16bit, 2, args=(2, True)):
        assert result["flag"] is True
        assert "needs zero_optimization.stage 3, this engine runs stage 2" in result["error"]


# ------------------------------------------------------------ ZeRO inference: no optimizer at any stage


def _evaluate_without_optimizer(stage: int, build_under_init: bool, bf16: bool) -> dict[str, object]:
    from engine.runtime.engine import NoOptimizerError

    rank = torch.distributed.get_rank()
    ids = torch.tensor([[1, 5, 2, 7], [0, 3, 3, 6]])
    dtype = torch.bfloat16 if bf16 else torch.float32
    with torch.no_grad():
        expected = _tied_lm(seed=0).to(dtype)(ids)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    with engine.zero.Init(enabled=build_under_init):
        model = _tied_lm(seed=rank)  # rank 0's values are the ones every rank keeps
    eng, opt, _, scheduler = engine.initialize(model=model, config=config)
    out: dict[str, object] = {"returned": (opt, scheduler, eng.optimizer)}
    eng.eval()
    with torch.no_grad():
        first, second = eng(ids), eng(ids)
    out["equal"] = torch.equal(first, expected) and torch.equal(second, expected)
    out["partitioned"] = all(p.numel() == 0 for p in eng.module.parameters())
    eng.train()
    errors = []
    loss = eng(ids).float().sum()
    for call in (lambda: eng.backward(loss), eng.step):
        try:
            call()
        except NoOptimizerError as err:
            errors.append(str(err))
    out["errors"] = errors
    with torch.no_grad():  # a refused call leaves the engine usable
        out["equal_after"] = torch.equal(eng(ids), expected) and eng.micro_steps == 0
    eng.destroy()
    return out


def test_stage3_without_optimizer_evaluates_partitioned() -> None:
    for build_under_init in (False, True):
        for result in run_distributed(_evaluate_without_optimizer, 2, args=(3, build_under_init, False)):
            assert result["returned"] == (None, None, None)
            assert result["equal"] and result["partitioned"] and result["equal_after"]
            backward, step = result["errors"]
            assert backward.startswith(
                "engine.backward() needs an optimizer, and this engine "
                "(zero_optimization.stage 3) was built without one"
            )
            assert step.startswith("engine.step() needs an optimizer") and 'add an "optimizer" section' in step


def test_stages_0_to_2_without_optimizer_evaluate() -> None:
    for stage, bf16 in ((0, True), (1, False), (2, True)):
        for result in run_distributed(_evaluate_without_optimizer, 2, args=(stage, False, bf16)):
            assert result["returned"] == (None, None, None)
            assert result["equal"] and not result["partitioned"] and result["equal_after"]
            assert [e.split("(")[0] for e in result["errors"]] == ["engine.backward", "engine.step"]
            assert f"(zero_optimization.stage {stage}) was built without one" in result["errors"][0]
