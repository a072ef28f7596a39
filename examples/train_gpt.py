"""The main job: train a small byte-level GPT on the Python standard library's sources.

    zrun --nproc_per_node 2 examples/train_gpt.py --config configs/zero0.json

Works with any config in configs/; a plain `python examples/train_gpt.py` runs one process.
A DeepSpeed script needs nothing else: `import engine as deepspeed` and the same calls.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import ByteWindows, stdlib_sources
from gpt import GPT, GPTConfig
from progress import progress

import engine
from engine.config import zero_stage
from engine.config.source import read_source


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config",
        default=os.path.join(os.path.dirname(__file__), "..", "configs", "zero0.json"),
        help="DeepSpeed-format JSON config (default: configs/zero0.json)",
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--eval_windows", type=int, default=128, help="validation windows (default 128)")
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end (engine.save_checkpoint)")
    parser.add_argument(
        "--load_dir",
        default=None,
        help="resume from this checkpoint directory's latest tag (any world size or ZeRO stage)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel size: AutoTP splits each block's "
        "Linear layers over this many ranks and ZeRO partitions over the rest (sets the config's "
        "tensor_parallel.autotp_size; default: the config's, else 1)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="checkpoint every block with engine.checkpointing.checkpoint: its activations are "
        "recomputed in the backward instead of kept; the config's activation_checkpointing "
        "section says how the checkpoints are kept (partitioned over TP, in an arena)",
    )
    parser.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write TensorBoard event files under DIR/train_gpt (sets the config's tensorboard "
        "section; needs pip install 'zero-engine[tensorboard]'); open with tensorboard --logdir DIR",
    )
    engine.add_config_arguments(parser)
    return parser.parse_args()


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: ByteWindows, batch: int, device: torch.device) -> float:
    """Mean next-byte cross-entropy (nats) over the validation windows; same on every rank."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        xs, ys = zip(*(windows[i] for i in range(start, min(start + batch, len(windows)))))
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        total += float(model(x, y)) * len(xs)
        count += len(xs)
    model.train(was_training)
    return total / count


def main() -> None:
    args = parse_args()
    if args.deepspeed_config:  # DeepSpeed's flag wins over the script's default
        args.config = None
    torch.manual_seed(args.seed)
    train_bytes, val_bytes, files = stdlib_sources()
    config_path = args.deepspeed_config or args.config
    raw, _ = read_source(config_path)
    config: object = config_path
    if args.tp is not None:  # the config file with tensor_parallel.autotp_size set to --tp
        raw.setdefault("tensor_parallel", {})["autotp_size"] = args.tp
        config = raw
    if args.tensorboard is not None:  # and with its tensorboard section turned on
        raw["tensorboard"] = {"enabled": True, "output_path": args.tensorboard, "job_name": "train_gpt"}
        config = raw
    tensor_parallel = int(raw.get("tensor_parallel", {}).get("autotp_size") or 0) > 1
    # Stage 3: every module is partitioned as soon as it is built (DeepSpeed's zero.Init idiom). Not with
    # tensor parallelism: AutoTP splits whole layers at initialize, and ZeRO then partitions the slices.
    with engine.zero.Init(
        config_dict_or_path=config_path, enabled=zero_stage(config_path) == 3 and not tensor_parallel
    ):
        model = GPT(GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers))
    if args.activation_checkpointing:
        model.checkpoint_blocks = engine.checkpointing.checkpoint

    # One window per seq_len bytes of the training text: far more than a few hundred steps use.
    train_set = ByteWindows(train_bytes, args.seq_len, len(train_bytes) // args.seq_len, seed=args.seed)
    val_set = ByteWindows(val_bytes, args.seq_len, args.eval_windows, seed=args.seed + 1)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ds_numel: partitioned
    model_engine, _, loader, _ = engine.initialize(
        model=model, model_parameters=model.parameters(), training_data=train_set, config=config
    )
    global_batch = model_engine.train_batch_size()
    rank0 = model_engine.global_rank == 0
    if rank0:
        print(
            f"corpus: {files} stdlib files, {len(train_bytes) / 1e6:.1f} MB train / "
            f"{len(val_bytes) / 1e6:.1f} MB validation; model {n_params / 1e6:.2f}M params; "
            f"{model_engine.world_size} rank(s) = TP {model_engine.mp_world_size} x DP {model_engine.dp_world_size}, "
            f"global batch {global_batch} x {args.seq_len} bytes, "
            f"ZeRO stage {model_engine.zero_optimization_stage()}",
            flush=True,
        )
        if args.activation_checkpointing:
            options = engine.checkpointing.current().options
            kept = "partitioned over TP" if engine.checkpointing.current().partitions else "whole"
            print(
                f"activation checkpointing: every block ({args.n_layers}), inputs kept {kept}"
                f"{', in a contiguous arena' if options.contiguous_memory_optimization else ''}",
                flush=True,
            )

    if args.load_dir:
        loaded_at = time.perf_counter()
        path, _ = model_engine.load_checkpoint(args.load_dir)
        if rank0:
            print(
                f"resumed from {path} at step {model_engine.global_steps} in {time.perf_counter() - loaded_at:.2f} s",
                flush=True,
            )
    micro_eval = model_engine.train_micro_batch_size_per_gpu()
    val_before = evaluate(model_engine.module, val_set, micro_eval, model_engine.device)
    if rank0:
        print(f"validation loss before training: {val_before:.4f} nats/byte", flush=True)

    bar = progress(args.steps, model_engine.global_steps, "train", "step", disable=not rank0)
    started = time.perf_counter()
    samples_before = model_engine.global_samples  # a resumed run counts its samples from here
    rate_from: tuple[float, int] | None = None
    model_engine.train()
    for x, y in loader:
        loss = model_engine(x.to(model_engine.device), y.to(model_engine.device))
        model_engine.backward(loss)
        model_engine.step()
        if model_engine.was_step_applied():
            if rate_from is None:  # the rate counts from the end of the first step (its one-time costs apart)
                rate_from = (time.perf_counter(), model_engine.global_samples)
            elapsed = time.perf_counter() - rate_from[0]
            rate = (model_engine.global_samples - rate_from[1]) / elapsed if elapsed > 0 else 0.0
            # refresh=False: one bar line per step (set_postfix and update each printed one)
            bar.set_postfix(
                loss=f"{model_engine.get_loss():.3f}", samples_s=f"{rate:.0f}" if rate else "-", refresh=False
            )
            bar.update(1)
        if model_engine.global_steps >= args.steps:
            break
    bar.close()
    ended = time.perf_counter()

    val_after = evaluate(model_engine.module, val_set, micro_eval, model_engine.device)
    if rank0:
        done = model_engine.global_samples - samples_before
        line = f"done: step {model_engine.global_steps}, {done} samples in {ended - started:.1f} s"
        if rate_from is not None and model_engine.global_samples > rate_from[1]:
            # As the bar's samples_s: from the end of the first step, whose one-time costs (the C++ ops'
            # first build, first-touch allocations) say nothing about the training speed.
            timed, seconds = model_engine.global_samples - rate_from[1], ended - rate_from[0]
            line += (
                f"; {timed / seconds:.1f} samples/s ({timed * args.seq_len / seconds:.0f} bytes/s) after the "
                f"first step, which took {rate_from[0] - started:.1f} s"
            )
        print(line)
        print(
            f"final train loss {model_engine.get_loss():.4f}; validation loss {val_before:.4f} -> "
            f"{val_after:.4f} nats/byte ({val_after / math.log(2):.3f} bits/byte)",
            flush=True,
        )
    if args.save_dir:
        saved_at = time.perf_counter()
        path = model_engine.save_checkpoint(args.save_dir)
        if rank0:
            size = sum(f.stat().st_size for f in os.scandir(path))
            print(f"checkpoint {path}: {size / 2**20:.1f} MiB in {time.perf_counter() - saved_at:.2f} s", flush=True)
    model_engine.destroy()


if __name__ == "__main__":
    main()
