"""What HF Trainer and Accelerate call of DeepSpeed beyond initialize/backward/step, under DeepSpeed's
names, so an alias package named `deepspeed` can re-export them (see
/work/shared/reference/hf-integration.md): clone_tensors_for_torch_save, the accelerator object,
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
from engine.checkpoint.clone import clone_tensors_for_torch_save

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
        a=weight, tied=weight, nested=[weight[0], (torch.ones(2), "text", 3)], point=Point(torch.zeros(1), 5))
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
