"""One rank of one attempt of benchmarks/bench_long_context.py (its docstring says what is measured).

    python -m launcher.zrun --nproc_per_node 2 benchmarks/long_context_worker.py --system engine --sp 2 --tricks \
        --seq 8192 --cap-gib 3 --steps 2 --out DIR [--layers 4 --hidden 256 ...]

The rank caps its own memory first, before torch is imported: RLIMIT_DATA bounds its private writable
mappings (the heap and anonymous mmaps, so every tensor; Linux >= 4.7 counts mmaps), and an allocation past
it fails in this rank. It then trains `--steps` steps of a Llama (transformers' LlamaConfig, sdpa attention)
on one random sequence of `--seq` tokens per step with one of:

- engine: engine.initialize, ZeRO `--stage`; with `--sp` 2 the attention is wrapped by the engine's
  UlyssesSPAttentionHF, each rank feeds its slice and the loss is engine.sequence.sequence_parallel_loss;
- deepspeed: the real DeepSpeed (deepspeed.initialize; its ulysses_sp classes), the same model and loss
  (its token-weighted aggregation as in DeepSpeed's own Ulysses test: torch.distributed.nn all_gather);
- fsdp2: torch's fully_shard on every decoder layer and the root, each rank a whole sequence of its own.

`--tricks`: TiledMLP in every LlamaMLP (tiles of `hidden` tokens, DeepSpeed's example), the loss from the
hidden states by TiledFusedLogitsLoss (lm_head + cross entropy per tile of `--loss-tile` tokens) and
activation checkpointing of every decoder layer (transformers' own). The classes are the system's own.

Writes DIR/rank<r>.json when every step completed; on any failure prints one line
`LONGCTX-FAIL: <type>: <message>` and exits 1 (the launcher then ends the other ranks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORE = -100
LR = 1e-5
FAIL = "LONGCTX-FAIL:"
BUCKET = 2_000_000
"""reduce_bucket_size and allgather_bucket_size (elements) of the engine and DeepSpeed rows."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=("engine", "deepspeed", "fsdp2"), required=True)
    p.add_argument("--sp", type=int, default=1, help="sequence-parallel size (engine, deepspeed)")
    p.add_argument("--tricks", action="store_true", help="TiledMLP, tiled logits loss, activation checkpointing")
    p.add_argument("--seq", type=int, required=True, help="tokens of the whole sequence")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cap-gib", type=float, default=0.0, help="RLIMIT_DATA of this rank (0: none)")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    for name, default in (("layers", 2), ("hidden", 256), ("intermediate", 688), ("heads", 4), ("kv-heads", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--loss-tile", type=int, default=512, help="tokens per tile of the tiled logits loss")
    p.add_argument("--out", required=True)
    return p.parse_args()


def cap_memory(gib: float) -> None:
    if gib > 0:
        limit = int(gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def proc_status(field: str) -> int:
    """A /proc/self/status field (VmData, VmRSS, VmHWM), bytes."""
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)


def max_rss() -> int:
    """This process's peak RSS, bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------ the model
def build_llama(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 2048),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    lm = LlamaForCausalLM(config)
    if args.tricks:
        enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
        enable()  # every decoder layer; transformers' default (non-reentrant torch.utils.checkpoint)
    lm.train()
    return lm


def mlp_forward(module: Any, x: Any) -> Any:
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def tile_llama_mlp(tiled_mlp: Any) -> None:
    """Every LlamaMLP runs through `tiled_mlp` in tiles of `hidden` tokens (DeepSpeed's TiledMLP example). Every
    rank has as many local tokens, so all ranks agree on the tile count without an all-reduce."""
    from transformers.models.llama import modeling_llama

    def forward(self: Any, x: Any) -> Any:
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        return tiled_mlp.apply(mlp_forward, self, x, shards, params)

    modeling_llama.LlamaMLP.forward = forward


def ce_sum(logits: Any, labels: Any) -> Any:
    """Cross entropy summed over the labelled tokens, in fp32 as transformers' loss computes it."""
    import torch

    flat = logits.float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE, reduction="sum")


def head_loss(lm: Any, x: Any, y: Any) -> Any:
    return ce_sum(lm.lm_head(x), y)


def loss_model(lm: Any, tiled_loss: Any, loss_tile: int) -> Any:
    """A module whose forward is the summed loss of a batch: from the whole logits, or (`tiled_loss`, the
    system's TiledFusedLogitsLoss) from the hidden states, lm_head and loss per tile of `loss_tile` tokens."""
    import torch

    class CausalLMLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids: Any, position_ids: Any, shift_labels: Any) -> Any:
            if tiled_loss is None:
                return ce_sum(self.lm(input_ids=input_ids, position_ids=position_ids).logits, shift_labels)
            hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
            shards = math.ceil(hidden.shape[0] * hidden.shape[1] / loss_tile)
            params = [self.lm.lm_head.weight]
            return tiled_loss.apply(head_loss, self.lm, hidden, shift_labels, None, shards, params, "sum")

    return CausalLMLoss()


def batch(args: argparse.Namespace, seed: int, rank: int) -> dict[str, Any]:
    """One random sequence of `--seq` tokens (`seed`), and this rank's slice of it under sequence parallelism:
    labels shifted before the cut, so a slice's last token keeps its label."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=g)
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE)], dim=1)
    positions = torch.arange(args.seq).unsqueeze(0)
    sp = args.sp if args.system != "fsdp2" else 1
    chunk = args.seq // sp
    lo, hi = chunk * (rank % sp), chunk * (rank % sp + 1)
    return {"input_ids": ids[:, lo:hi], "position_ids": positions[:, lo:hi], "shift_labels": shift[:, lo:hi]}


# ------------------------------------------------------------------------------------------ the systems
def zero_config(args: argparse.Namespace) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        # Both systems' buckets at 2M elements: DeepSpeed's default (5e8 elements, a 1 GB bf16 buffer at stage 2)
        # is more than the whole cap; the engine sizes its own from the link unless told.
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
    }
    if args.sp > 1:
        conf["sequence_parallel_size"] = args.sp
    if args.dtype == "bf16":
        conf["bf16"] = {"enabled": True}
    return conf


Step = Callable[[dict[str, Any]], float]


def build_engine(args: argparse.Namespace) -> tuple[Step, Callable[[], None]]:
    import engine
    from engine.sequence import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF, sequence_parallel_loss

    if args.tricks:
        tile_llama_mlp(TiledMLP)
    lm = build_llama(args)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        lm, core_attn_implementation="sdpa", sequence_parallel_size=args.sp, micro_batch_size=1
    )
    model = loss_model(lm, TiledFusedLogitsLoss if args.tricks else None, args.loss_tile)
    eng, *_ = engine.initialize(model=model, config=zero_config(args), mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None

    def step(inputs: dict[str, Any]) -> float:
        count = (inputs["shift_labels"] != IGNORE).sum()
        loss = eng(**inputs) / count.clamp(min=1)
        if group is not None:
            loss = sequence_parallel_loss(loss, count, group)
        eng.backward(loss)
        eng.step()
        return float(loss.detach())

    return step, eng.destroy


def build_deepspeed(args: argparse.Namespace) -> tuple[Step, Callable[[], None]]:
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    if args.tricks:
        tile_llama_mlp(ulysses_sp.TiledMLP)
    lm = build_llama(args)
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
        lm, core_attn_implementation="sdpa", sequence_parallel_size=args.sp, micro_batch_size=1
    )
    model = loss_model(lm, ulysses_sp.TiledFusedLogitsLoss if args.tricks else None, args.loss_tile)
    conf = zero_config(args)
    conf["optimizer"]["params"]["torch_adam"] = True  # its fused CPU Adam needs a compiled op
    conf["zero_force_ds_cpu_optimizer"] = False
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf, mpu=mpu)
    group = mpu.get_sequence_parallel_group() if mpu is not None else None

    def step(inputs: dict[str, Any]) -> float:
        count = (inputs["shift_labels"] != IGNORE).sum()
        loss = eng(**inputs) / count.clamp(min=1)
        if group is not None:  # DeepSpeed's test_ulysses_sp_hf: a differentiable, token-weighted gather
            losses = torch.distributed.nn.functional.all_gather(loss, group=group)
            counts = torch.distributed.nn.functional.all_gather(count, group=group)
            loss = sum(x * n for x, n in zip(losses, counts)) / sum(counts)
        eng.backward(loss)
        eng.step()
        return float(loss.detach())

    return step, eng.destroy


def build_fsdp2(args: argparse.Namespace) -> tuple[Step, Callable[[], None]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    lm = build_llama(args)
    model = loss_model(lm, None, args.loss_tile)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    bf16 = args.dtype == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": mesh} | ({"mp_policy": policy} if policy is not None else {})
    for layer in lm.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step(inputs: dict[str, Any]) -> float:
        count = (inputs["shift_labels"] != IGNORE).sum()
        loss = model(**inputs) / count.clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, lambda: None


# ------------------------------------------------------------------------------------------ the rank
def init_distributed(system: str) -> None:
    import torch

    if system == "engine":
        from engine import comm

        comm.init_distributed(dist_backend="gloo", verbose=False)
    elif system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed("gloo")
    else:
        torch.distributed.init_process_group("gloo")


def versions(system: str) -> dict[str, str]:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    if system == "deepspeed":
        import deepspeed

        out["deepspeed"] = deepspeed.__version__
        out["deepspeed_is_compat"] = str(os.path.abspath(deepspeed.__file__).startswith(ROOT + os.sep))
    return out


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_distributed(args.system)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    rec: dict[str, Any] = {"rank": rank, "world": world, "threads": torch.get_num_threads()}
    rec["versions"] = versions(args.system)
    build = {"engine": build_engine, "deepspeed": build_deepspeed, "fsdp2": build_fsdp2}[args.system]
    step, close = build(args)
    rec.update(rss_ready=proc_status("VmRSS"), data_ready=proc_status("VmData"), max_rss_ready=max_rss())
    times, losses = [], []
    for i in range(args.steps):
        # the same sequence on every rank of a sequence-parallel group; FSDP2's ranks each train their own
        seed = 1000 * (i + 1) + (rank if args.system == "fsdp2" else 0)
        inputs = batch(args, seed, rank)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        losses.append(step(inputs))
        times.append(time.perf_counter() - t0)
        print(f"[rank {rank}] step {i}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", flush=True)
    rec.update(times=times, losses=losses, max_rss=max_rss(), data_end=proc_status("VmData"))
    rec["local_tokens"] = int(inputs["input_ids"].numel())
    close()
    return rec


def main() -> None:
    args = parse()
    cap_memory(args.cap_gib)  # before torch: every allocation of the rank counts
    if args.system == "engine":
        sys.path.insert(0, ROOT)  # measure the engine of this checkout
    try:
        rec = train(args)
        with open(os.path.join(args.out, f"rank{rec['rank']}.json"), "w") as f:
            json.dump(rec, f)
        import torch

        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - any failure ends the attempt, named on one line
        traceback.print_exc()
        message = " ".join(str(e).split())[:300]
        print(f"{FAIL} {type(e).__name__}: {message}", file=sys.stderr, flush=True)
        os._exit(1)  # no destructors, no waiting in a collective the other rank will never join


if __name__ == "__main__":
    main()
