"""Step time of a GPT on one CUDA GPU: the engine at a ZeRO stage in bf16 beside PyTorch FSDP2, same
model, same batch, same optimizer (AdamW), in one process each.

    python benchmarks/bench_gpu_step.py --system engine --stage 3 --d_model 2048 --n_layers 24
    python benchmarks/bench_gpu_step.py --system fsdp2 --d_model 2048 --n_layers 24

Prints one JSON line: parameters, step time (median of the timed steps after the warm-up ones), tokens/s
and MFU against --peak_tflops (the H200's dense bf16 peak, 989 TFLOP/s, by default). FLOPs per token are
6N + 12 L d T (the PaLM paper's count: the matmuls forward and backward plus attention's scores).
Needs a CUDA GPU; world size 1 (NCCL over one rank), so ZeRO partitions nothing here: it measures the
engine's per-step overhead against FSDP2's on the same device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpt import GPT, GPTConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=["engine", "fsdp2"], required=True)
    parser.add_argument("--stage", type=int, default=3, help="the engine's ZeRO stage (default 3)")
    parser.add_argument("--d_model", type=int, default=2048)
    parser.add_argument("--n_layers", type=int, default=24)
    parser.add_argument("--n_heads", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--peak_tflops", type=float, default=989.0)
    parser.add_argument(
        "--profile", action="store_true", help="after timing, print torch.profiler's top ops of 2 steps"
    )
    return parser.parse_args()


def single_rank_env() -> None:
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29533",
    }.items():
        os.environ.setdefault(key, value)


def engine_runner(model: GPT, args: argparse.Namespace):
    import engine

    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    model_engine, _, _, _ = engine.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = model_engine(x, y)
        model_engine.backward(loss)
        model_engine.step()
        return float(loss.detach())

    return step, model_engine.device


def fsdp2_runner(model: GPT, args: argparse.Namespace):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model.to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, device


def print_profile(step, x: torch.Tensor, y: torch.Tensor) -> None:
    """Where a step's time goes: the top ops of two steps by self CPU time and by self device (CUDA) time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(x, y)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60), flush=True)
    print(averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60), flush=True)


def main() -> None:
    args = parse_args()
    assert torch.cuda.is_available(), "bench_gpu_step needs a CUDA GPU"
    single_rank_env()
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    step, device = (engine_runner if args.system == "engine" else fsdp2_runner)(model, args)
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=generator).to(device)
    y = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=generator).to(device)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        losses.append(step(x, y))  # float(loss) synchronises too
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    if args.profile:
        print_profile(step, x, y)
    step_s = statistics.median(times)
    tokens = args.micro_batch * args.seq_len
    flops_per_token = 6 * n_params + 12 * args.n_layers * args.d_model * args.seq_len
    tflops = flops_per_token * tokens / step_s / 1e12
    print(
        json.dumps(
            {
                "system": args.system if args.system == "fsdp2" else f"engine stage {args.stage}",
                "device": torch.cuda.get_device_name(0),
                "params": n_params,
                "d_model": args.d_model,
                "n_layers": args.n_layers,
                "seq_len": args.seq_len,
                "micro_batch": args.micro_batch,
                "step_s": round(step_s, 4),
                "tokens_per_s": round(tokens / step_s),
                "tflops": round(tflops, 1),
                "mfu": round(tflops / args.peak_tflops, 4),
                "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "first_loss": round(losses[0], 4),
                "last_loss": round(losses[-1], 4),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
