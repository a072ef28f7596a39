"""A tiny GPT-2 trained with Hugging Face Trainer on the engine, through the `deepspeed` compatibility
package (compat/deepspeed), on the main job's corpus (the Python standard library's sources, bytes).

    pip install ./compat/deepspeed transformers accelerate
    zrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed configs/hf/zero2.json --max_steps 50

Every TrainingArguments flag is accepted as Trainer's own examples accept them (--bf16,
--gradient_accumulation_steps, --save_steps, --resume_from_checkpoint, ...). The model is built from a
GPT2Config (nothing is downloaded); `--init_from DIR` loads one saved with save_pretrained instead.
Under ZeRO stage 3 the model is built or loaded already partitioned (transformers enters
deepspeed.zero.Init when the Trainer's config says stage 3).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import ByteWindows, stdlib_sources
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    HfArgumentParser,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    set_seed,
)


@dataclass
class ModelArguments:
    n_layer: int = field(default=2, metadata={"help": "transformer blocks"})
    n_embd: int = field(default=64, metadata={"help": "model width"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    seq_len: int = field(default=64, metadata={"help": "bytes per training window"})
    dropout: float = field(
        default=0.0,
        metadata={
            "help": "GPT-2's residual/embedding/attention dropout (0: runs at any rank count see the same numbers)"
        },
    )
    train_windows: int = field(default=4096, metadata={"help": "training windows drawn from the corpus"})
    eval_windows: int = field(default=64, metadata={"help": "validation windows"})
    init_from: str | None = field(default=None, metadata={"help": "from_pretrained(DIR) instead of from_config"})
    save_init_to: str | None = field(default=None, metadata={"help": "save the initial model here and exit"})
    evaluate_only: bool = field(
        default=False,
        metadata={"help": "only trainer.evaluate() (ZeRO inference at stage 3: no optimizer, parameters partitioned)"},
    )
    report_file: str | None = field(
        default=None,
        metadata={"help": "write the run's log history and how the model was built (partitioned or not) as JSON"},
    )
    metrics_file: str | None = field(
        default=None,
        metadata={
            "help": "every rank writes FILE.rank{R}.json: {rank, step_times (s, perf_counter from one optimizer "
            "step's end to the next, the first from train begin), peak_rss_mib (ru_maxrss at exit)}"
        },
    )


class CausalBytes(torch.utils.data.Dataset):
    """ByteWindows as Trainer expects them: input_ids and labels (GPT-2 shifts the labels itself)."""

    def __init__(self, windows: ByteWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.windows[i]
        ids = torch.cat([x, y[-1:]])
        return {"input_ids": ids, "labels": ids}


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, end to end (forward, backward, step, logging, the next batch)."""

    def __init__(self) -> None:
        self.last = 0.0
        self.step_times: list[float] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        self.last = time.perf_counter()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
    ) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self.last)
        self.last = now


def build_model(margs: ModelArguments) -> PreTrainedModel:
    if margs.init_from:
        return AutoModelForCausalLM.from_pretrained(margs.init_from)
    config = GPT2Config(
        vocab_size=256,
        n_positions=margs.seq_len + 1,
        n_embd=margs.n_embd,
        n_layer=margs.n_layer,
        n_head=margs.n_head,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=margs.dropout,
        embd_pdrop=margs.dropout,
        attn_pdrop=margs.dropout,
    )
    # from_config (not GPT2LMHeadModel(config)): under a stage-3 config transformers builds the model
    # inside deepspeed.zero.Init, partitioned as each layer is made.
    return AutoModelForCausalLM.from_config(config)


def main() -> None:
    argv = sys.argv[1:]
    if not torch.cuda.is_available() and "--use_cpu" not in argv:
        # Without use_cpu Accelerate counts one process on a CPU machine, and its batch arithmetic
        # then disagrees with the world size the engine sees. It must be known when TrainingArguments
        # is built (it sets up the process state then), so it goes in with the other flags.
        argv.append("--use_cpu")
    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    margs, targs = parser.parse_args_into_dataclasses(args=argv)
    set_seed(targs.seed)  # the model's initial weights too: every run with this seed starts from the same model
    if margs.save_init_to:  # a model to from_pretrained later (the tests' stage-3 load)
        build_model(margs).save_pretrained(margs.save_init_to)
        return
    train_bytes, val_bytes, _ = stdlib_sources(max_bytes=4 << 20)
    train = CausalBytes(ByteWindows(train_bytes, margs.seq_len, margs.train_windows, seed=targs.seed))
    val = CausalBytes(ByteWindows(val_bytes, margs.seq_len, margs.eval_windows, seed=targs.seed + 1))
    # Built after TrainingArguments: with a stage-3 config transformers builds it under zero.Init.
    model = build_model(margs)
    params = list(model.parameters())
    partitioned = sum(hasattr(p, "ds_shape") and p.numel() == 0 for p in params)
    if partitioned and targs.process_index == 0:
        print(
            f"model built partitioned (ZeRO-3 zero.Init): {partitioned} of {len(params)} parameters hold "
            f"1/{targs.world_size} of their elements on each rank"
        )
    timer = StepTimer()
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=train,
        eval_dataset=val,
        callbacks=[timer] if margs.metrics_file else None,
    )
    if not margs.evaluate_only:
        trainer.train(resume_from_checkpoint=targs.resume_from_checkpoint)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"validation loss {metrics['eval_loss']:.4f} nats/byte after {trainer.state.global_step} steps")
    if not margs.evaluate_only:
        trainer.save_model()  # every rank: at stage 3 the weights are gathered from all of them
    if margs.report_file and trainer.is_world_process_zero():
        with open(margs.report_file, "w") as f:
            json.dump(
                {"log_history": trainer.state.log_history, "params": len(params), "partitioned_at_build": partitioned},
                f,
            )
    if margs.metrics_file:
        # ru_maxrss: KiB on Linux; the whole process's peak (model build, training, evaluation, save).
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with open(f"{margs.metrics_file}.rank{targs.process_index}.json", "w") as f:
            json.dump({"rank": targs.process_index, "step_times": timer.step_times, "peak_rss_mib": peak_mib}, f)


if __name__ == "__main__":
    main()
