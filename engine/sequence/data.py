"""`UlyssesSPDataLoaderAdapter`: each batch of a DataLoader, shared out along the sequence over the ranks
of a sequence-parallel group (DeepSpeed's `ulysses_sp.UlyssesSPDataLoaderAdapter`).

Every rank's loader yields its own samples, as in data parallelism. The adapter takes one batch from each
rank of the group and gives every rank its slice of each of them in turn: after p steps the group has
trained on p batches, each by all p ranks together, as p data-parallel ranks would have in one step
(so a loader of n batches yields n x p here). Each batch must carry `input_ids` and `position_ids`
(numbered per sample, or per document when packed: attention sees whole sequences through them);
`labels` become `shift_labels` (the next token's label at each position, -100 at the end), shifted
before the cut so that a slice's last token keeps its label. Tensors are cut along dim 1; other
values are given to every rank as they are.

A length that the group's size does not divide is padded at the end: input_ids and every other tensor
with 0, shift_labels with -100 (no loss), position_ids by counting on, attention_mask with 0. Under
causal attention no real token sees the padding, and the loss weighs only labelled tokens, so the
result is that of the unpadded batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine import comm
from engine.comm import ProcessGroup
from engine.comm.torch_style import all_gather_object
from engine.monitor.log import get_logger

logger = get_logger()

IGNORE_INDEX = -100


class UlyssesSPDataLoaderAdapter:
    def __init__(
        self, dl: Iterable[Any], sp_rank: int, sp_group: ProcessGroup, sp_world_size: int, device: Any = None
    ) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self._iter: Iterator[Any] = iter(dl)
        self._ready: deque[dict[str, Any]] = deque()
        self._padded_warned = False
        if comm.group_size(sp_group) != sp_world_size or comm.group_rank(sp_group) != sp_rank:
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: sp_rank={sp_rank}, sp_world_size={sp_world_size}, but this rank is "
                f"{comm.group_rank(sp_group)} of {comm.group_size(sp_group)} in sp_group"
            )

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self._ready:
            self._refill()
        return self._ready.popleft()

    def __getattr__(self, name: str) -> Any:
        # The wrapped loader's attributes (batch_size, dataset, sampler, set_epoch...), as the Trainer reads them.
        if name == "dl":
            raise AttributeError(name)
        return getattr(self.dl, name)

    def _refill(self) -> None:
        try:
            batch = next(self._iter)
        except StopIteration:
            self._iter = iter(self.dl)  # the next epoch starts over
            raise
        _check(batch)
        cpu = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
        batches: list[Any] = [None] * self.sp_world_size
        all_gather_object(batches, cpu, group=self.sp_group)
        for whole in batches:
            self._ready.append(self._my_slice(dict(whole)))

    def _my_slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        p = self.sp_world_size
        if "labels" in batch:
            labels = batch.pop("labels")
            batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        length = batch["input_ids"].shape[1]
        pad = -length % p
        if pad:
            batch = _padded(batch, pad)
            if not self._padded_warned:
                logger.info(
                    "sequence parallelism: a batch of %d tokens a sample was padded to %d (a multiple of "
                    "sequence_parallel_size %d); the padding is unlabelled and after every real token",
                    length,
                    length + pad,
                    p,
                )
                self._padded_warned = True
        chunk = (length + pad) // p
        lo, hi = chunk * self.sp_rank, chunk * (self.sp_rank + 1)
        return {
            k: (v[:, lo:hi].contiguous().to(self.device) if self.device is not None else v[:, lo:hi].contiguous())
            if torch.is_tensor(v) and v.dim() >= 2
            else v
            for k, v in batch.items()
        }


def _check(batch: Any) -> None:
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError(
            "UlyssesSPDataLoaderAdapter: each batch must be a dict with input_ids (and position_ids, labels), got "
            f"{type(batch).__name__}{'' if not isinstance(batch, dict) else ' with keys ' + str(sorted(batch))}"
        )
    if "position_ids" not in batch:
        raise ValueError(
            "sequence parallelism needs position_ids in every batch, before it is cut: each rank holds a slice of "
            "every sample and attention numbers tokens by them (torch.arange(seq_len) per sample; per document when "
            "packed). Make the data collator return them (TRL's DataCollatorForLanguageModeling: "
            "return_position_ids=True; or add them in your collate_fn)"
        )
    length = batch["input_ids"].shape[1]
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] != length:
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: {k} has shape {tuple(v.shape)} but input_ids {tuple(batch['input_ids'].shape)}:"
                " every tensor of [batch, seq, ...] is cut along the sequence"
            )


def _padded(batch: dict[str, Any], pad: int) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if not (torch.is_tensor(v) and v.dim() >= 2):
            out[k] = v
        elif k == "position_ids":
            last = v[:, -1:]
            steps = torch.arange(1, pad + 1, dtype=v.dtype).expand(v.shape[0], pad)
            out[k] = torch.cat([v, last + steps], dim=1)
        else:
            value = IGNORE_INDEX if k in ("shift_labels", "labels") else 0
            widths = [0, 0] * (v.dim() - 2) + [0, pad]
            out[k] = torch.nn.functional.pad(v, widths, value=value)
    return out
