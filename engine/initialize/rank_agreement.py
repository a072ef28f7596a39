"""The ranks agree before engine.initialize() issues its first collective.

# [Note: why initialize agrees first]
# Everything initialize does before its first collective (reading the config, checking it against
# the device, describing the model) is local, and can fail on one rank only: a config file missing
# on one node, a model built from another branch of the code. A rank that raised there while the
# others went on into the parameter broadcast left them blocked (gloo aborts, or waits 30 minutes),
# or, with different parameter shapes, trained silently to different losses at stages 2 and 3.
# So every rank, failed or not, takes part in one small exchange (`agree`): its local error, if any,
# and a digest of its model's signature (parameter and buffer names, shapes, dtypes,
# requires_grad). If any rank failed or any digest differs, every rank raises, naming the ranks and
# the first difference, and no rank issues another collective: the process group stays usable, so
# initialize can be called again (see engine/initialize/entry.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine import comm

Entry = tuple[str, str, tuple[int, ...], str, bool]
"""(kind, name, shape, dtype, requires_grad): one parameter or buffer of the model."""


class RankMismatchError(RuntimeError):
    """The ranks disagree at initialize: another rank failed, or the ranks built different models."""


def model_signature(module: torch.nn.Module) -> list[Entry]:
    """What must be equal on every rank for data parallelism to mean anything. A parameter already
    partitioned by engine.zero.Init has an empty `.data`; its full shape is `ds_shape`."""
    entries: list[Entry] = []
    for name, p in module.named_parameters():
        shape = tuple(getattr(p, "ds_shape", None) or p.shape)
        entries.append(("parameter", name, shape, str(p.dtype).removeprefix("torch."), p.requires_grad))
    for name, b in module.named_buffers():
        entries.append(("buffer", name, tuple(b.shape), str(b.dtype).removeprefix("torch."), False))
    return entries


def _digest(entries: list[Entry]) -> str:
    return hashlib.sha256(repr(entries).encode()).hexdigest()


def _describe(entry: Entry) -> str:
    kind, name, shape, dtype, requires_grad = entry
    grad = ", requires_grad" if requires_grad else (", frozen" if kind == "parameter" else "")
    return f"{kind} {name!r} (shape {list(shape)}, {dtype}{grad})"


def first_difference(ref: list[Entry], other: list[Entry], ref_rank: int, other_rank: int) -> str:
    """The first entry where two signatures differ, in words."""
    for i, (a, b) in enumerate(zip(ref, other)):
        if a == b:
            continue
        if a[:2] == b[:2]:
            return f"{_describe(a)} on rank {ref_rank} is {_describe(b)} on rank {other_rank}"
        names_b, names_a = {e[:2] for e in other}, {e[:2] for e in ref}
        if a[:2] not in names_b:
            return f"{_describe(a)} exists on rank {ref_rank} but not on rank {other_rank}"
        if b[:2] not in names_a:
            return f"{_describe(b)} exists on rank {other_rank} but not on rank {ref_rank}"
        return (
            f"entry {i} is {a[0]} {a[1]!r} on rank {ref_rank} but {b[0]} {b[1]!r} on rank {other_rank} "
            "(the modules were registered in another order)"
        )
    longer, shorter, extra_rank, other_r = (
        (ref, other, ref_rank, other_rank) if len(ref) > len(other) else (other, ref, other_rank, ref_rank)
    )
    return f"{_describe(longer[len(shorter)])} exists on rank {extra_rank} but not on rank {other_r}"


@dataclass(frozen=True)
class _Report:
    error: str | None
    """'TypeName: message' of the exception this rank raised before the exchange, or None."""
    digest: str


def agree(module: torch.nn.Module, local_error: BaseException | None) -> None:
    """Every rank calls this at the same point, whether its local work failed or not (see the Note).

    Raises `local_error` on the ranks where it happened and RankMismatchError on the others; raises
    RankMismatchError on every rank when the models differ. Two small all-gathers when all agree.
    """
    signature = model_signature(module) if local_error is None else []
    error = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    if comm.get_world_size() == 1:
        if local_error is not None:
            raise local_error
        return
    reports: list[_Report] = comm.all_gather_object(_Report(error, _digest(signature)))
    failed = {r: rep.error for r, rep in enumerate(reports) if rep.error is not None}
    if local_error is not None:
        raise local_error
    if failed:
        listed = "; ".join(f"rank {r}: {msg}" for r, msg in failed.items())
        raise RankMismatchError(
            f"engine.initialize failed on rank(s) {sorted(failed)} ({listed}); this rank (rank {comm.get_rank()}) "
            "stopped too, so no rank waits for the others. Fix the error above; initialize can then be called again"
        )
    digests = [rep.digest for rep in reports]
    if len(set(digests)) == 1:
        return
    # Different models: the slow path (whole signatures) runs only to name the difference.
    signatures: list[list[Entry]] = comm.all_gather_object(signature)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    first = differing[0]
    raise RankMismatchError(
        f"the ranks built different models: {first_difference(signatures[0], signatures[first], 0, first)} "
        f"(rank(s) {differing} differ from rank 0). Data parallelism needs the same model on every rank; "
        "build it from the same code and config on every rank (the values may differ: rank 0's are broadcast)"
    )
