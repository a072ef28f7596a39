"""What HF Trainer and Accelerate call of DeepSpeed beyond initialize/backward/step, under DeepSpeed's
names, so an alias package named `deepspeed` can re-export them (see
/work/shared/reference/hf-integration.md): clone_tensors_for_torch_save, the accelerator object,
Init's tensor-constructor wrappers, optimizer.overflow, the 16-bit consolidated state dict and
ZeRO inference (initialize without an optimizer)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import torch

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
