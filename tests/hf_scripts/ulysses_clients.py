"""Sequence parallelism through the Hugging Face clients, as their users turn it on: Accelerate's
`ParallelismConfig(sp_backend="deepspeed", sp_size=N)` given to the Trainer (`TrainingArguments(
parallelism_config=...)`), to TRL's SFTTrainer (`SFTConfig(parallelism_config=...)`), or to an
`Accelerator` in a loop of one's own. Without --sp (or --sp 1) and without --deepspeed, the same client
trains plainly: the reference.

    zrun --nproc_per_node 2 tests/hf_scripts/ulysses_clients.py --client trainer --sp 2 --deepspeed ds.json --out r.json

Rank 0 writes each client's losses and gradient norms of every step to --out. Several clients in one
process (`--client accelerate,trainer,sft`) train in turn, sharing one start-up (a launch costs each rank
seconds of imports). `--runs JSON` lists runs of their own instead, each a client and the options it
changes (`[{"name": "trainer3", "client": "trainer", "deepspeed": "ds3.json"}, ...]`), reported by name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared model shapes
from models import TINY_DECODER, tiny_hf_config

MICRO, LENGTH, SAMPLES, STEPS, LR = 2, 16, 16, 4, 1e-3
EPS = 1e-4  # Adam's eps: large enough that last-bit differences in tiny gradients stay last-bit (see the test)
VOCAB = TINY_DECODER["vocab_size"]


def model() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_hf_config(attn_implementation="sdpa", pad_token_id=0))


class Samples(torch.utils.data.Dataset):
    """Token sequences whose first quarter is a prompt without loss (labels -100), with position_ids;
    `order` lists which sample each index gives (all of them in turn by default)."""

    def __init__(self, order: list[int] | None = None) -> None:
        self.order = list(range(SAMPLES)) if order is None else order

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + self.order[i])
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        labels = ids.clone()
        labels[: LENGTH // 4] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(LENGTH)}


def sequence_data_order(world: int, sp: int, micro: int) -> list[int]:
    """The samples in the order sp x (world // sp) ranks train them, sampled in sequence, for a reference
    of one process at micro x (world // sp): each rank's loader takes every world-th micro-batch, and a
    sequence-parallel group trains its ranks' micro-batches one after another (one per step), so step
    2k + t of round k holds micro-batch t of every group. Its batches of micro x dp samples are the steps'."""
    order = []
    for start in range(0, SAMPLES, world * micro):
        for t in range(sp):
            for group in range(world // sp):
                batch = start // micro + group * sp + t
                order += range(batch * micro, batch * micro + micro)
    return order


def parallelism(sp: int) -> dict[str, Any]:
    if sp == 1:
        return {}
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    config = ParallelismConfig(sp_backend="deepspeed", sp_size=sp, dp_replicate_size=world // sp, sp_handler=handler)
    return {"parallelism_config": config}


def training_args(cls: Any, out: Path, deepspeed: str | None, sp: int, micro: int, **extra: Any) -> Any:
    return cls(
        output_dir=str(out),
        per_device_train_batch_size=micro,
        max_steps=STEPS,
        logging_steps=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        adam_epsilon=EPS,
        max_grad_norm=1.0,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=7,
        deepspeed=deepspeed,
        **parallelism(sp),
        **extra,
    )


def sampling(a: argparse.Namespace) -> dict[str, str]:
    return {"train_sampling_strategy": "sequential"} if a.sequential else {}


def run_trainer(a: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import Trainer, TrainingArguments

    args = training_args(TrainingArguments, a.out.parent / a.name, a.deepspeed, a.sp, a.micro, **sampling(a))
    trainer = Trainer(model=model(), args=args, train_dataset=Samples(a.order))
    trainer.train()
    return trainer.state.log_history


def run_sft(a: argparse.Namespace) -> list[dict[str, Any]]:
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>")), pad_token="<pad>"
    )
    rows = [Samples(a.order)[i] for i in range(SAMPLES)]  # pre-tokenised: TRL trains on input_ids as they are
    data = Dataset.from_list([{"input_ids": r["input_ids"].tolist()} for r in rows])
    # SFTConfig defaults to bf16=True (autocast, and bf16 "auto" in the DeepSpeed config): these runs are
    # fp32, as the Trainer's, so that the comparison measures sequence parallelism and not bf16's rounding
    # of two different shapes.
    cfg = training_args(SFTConfig, a.out.parent / a.name, a.deepspeed, a.sp, a.micro, bf16=False, **sampling(a))
    cfg.max_length = LENGTH
    trainer = SFTTrainer(model=model(), args=cfg, train_dataset=data, processing_class=tok)
    trainer.train()
    return trainer.state.log_history


def run_accelerate(a: argparse.Namespace) -> list[dict[str, Any]]:
    """A loop of one's own: Accelerator(parallelism_config=...) prepares the model (through
    deepspeed.initialize, with the mpu register_with_transformers returns), the optimizer and the loader
    (cut along the sequence); the loss is each rank's token mean weighted over the group."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    PartialState(cpu=True)  # gloo and the real world size (tests/hf_scripts/accelerate_loop.py says why)
    plugin = DeepSpeedPlugin(hf_ds_config=json.loads(Path(a.deepspeed).read_text())) if a.deepspeed else None
    accelerator = Accelerator(deepspeed_plugin=plugin, **parallelism(a.sp))
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(Samples(a.order), batch_size=a.micro)
    net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    history = []
    for step, batch in enumerate(loader):
        if a.sp > 1:
            from engine.parallel import get_sequence_parallel_group
            from engine.sequence.loss import sequence_parallel_loss

            labels = batch["shift_labels"]
            ids, positions = batch["input_ids"], batch["position_ids"]
            local = net(input_ids=ids, position_ids=positions, labels=labels, shift_labels=labels).loss
            loss = sequence_parallel_loss(local, (labels != -100).sum(), get_sequence_parallel_group())
        else:
            loss = net(**batch).loss
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(net.parameters(), 1.0) if plugin is None else net.get_global_grad_norm()
        optimizer.step()
        optimizer.zero_grad()
        # The step's loss as the Trainer logs it: the mean over the ranks (a sequence-parallel group's ranks
        # hold the same loss, so this is the mean over the data-parallel replicas).
        mean = accelerator.reduce(loss.detach(), reduction="mean")
        history.append({"loss": float(mean), "grad_norm": float(norm)})
        if step + 1 == STEPS:
            break
    return history


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--client",
        default=None,
        help="trainer, sft or accelerate; several, comma-separated, run in turn",
    )
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--micro", type=int, default=MICRO)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--sequential", action="store_true", help="the Trainers sample in order, not shuffled")
    parser.add_argument(
        "--order-of",
        default=None,
        metavar="WORLD,SP,MICRO",
        help="train the samples in the order WORLD ranks at SP and MICRO do (sequence_data_order), in sequence",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--init_gloo", action="store_true", help="deepspeed.init_distributed('gloo') first (real DeepSpeed on CPU)"
    )
    parser.add_argument("--runs", default=None, help="a JSON list of runs: name, client, and the options changed")
    a = parser.parse_args()
    if a.init_gloo:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    if a.runs is None and a.client is None:
        parser.error("give --client or --runs")
    runs = json.loads(a.runs) if a.runs else [{"name": c, "client": c} for c in a.client.split(",")]
    report = {}
    for run in runs:
        options = argparse.Namespace(**{**vars(a), **run})
        report[run["name"]] = train(options)
    if int(os.environ.get("RANK", "0")) == 0:
        a.out.write_text(json.dumps(report))


def train(a: argparse.Namespace) -> dict[str, list[float]]:
    """One run: its client's losses and gradient norms of every step."""
    a.order = sequence_data_order(*map(int, a.order_of.split(","))) if a.order_of else None
    a.sequential = a.sequential or a.order is not None
    clients = {"trainer": run_trainer, "sft": run_sft, "accelerate": run_accelerate}
    steps = [h for h in clients[a.client](a) if "loss" in h]
    return {"losses": [h["loss"] for h in steps], "norms": [h["grad_norm"] for h in steps]}


if __name__ == "__main__":
    main()
