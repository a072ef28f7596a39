"""Writes the golden DeepSpeed checkpoint with tensor parallelism (AutoTP), with real DeepSpeed.

Run it in DeepSpeed's own venv with transformers installed (see SOURCES.md here):

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/deepspeed_tp_checkpoint/make_fixture.py

Two gloo ranks train a tiny Hugging Face Llama with DeepSpeed's AutoTP at tensor-parallel size 2
(data-parallel size 1, ZeRO stage 1, fp32) for SAVE_AT steps and save into stage1_fp32_tp2/ckpt
(mp_rank_00/01 model and optimizer files: q/k/v/gate/up and lm_head split along dim 0, o/down along
dim 1, embeddings and norms replicated). Two fresh ranks (another seed) load it with DeepSpeed's
load_checkpoint and train RESUME_STEPS more steps; their losses go into stage1_fp32_tp2/expected.json.
The second case, stage1_fp32_tp2_fused, does the same with FusedLM under DeepSpeed's
tensor_parallel.partition_config: its qkv_proj ([q; k; v]) and gate_up_proj ([gate; up]) are cut into
sub-parameters, several pieces per rank. stage1_fp32_tp2_ds0176 is the Llama case written by DeepSpeed
0.17.6 (its own venv), whose checkpoints record no universal_checkpoint_info. `make_fixture.py CASE`
writes one case; no argument, those of the DeepSpeed version running it.
The models and data are defined here without DeepSpeed, so tests/test_deepspeed_tp_checkpoint.py
imports them and trains the engine on the same batches.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from types import SimpleNamespace
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = "stage1_fp32_tp2"
FUSED_CASE = "stage1_fp32_tp2_fused"
"""FusedLM: DeepSpeed cuts its fused qkv_proj and gate_up_proj into sub-parameters, several pieces per rank."""
GQA_CASE = "stage1_fp32_tp2_gqa"
"""FusedLM with fewer key/value heads: DeepSpeed cuts qkv_proj into unequal sub-parameters."""
OLD_CASE = "stage1_fp32_tp2_ds0176"
"""The Llama case written by DeepSpeed 0.17.6, whose AutoTP records no universal_checkpoint_info."""
CASES = (CASE, FUSED_CASE, GQA_CASE, OLD_CASE)
WRITTEN_BY = {CASE: "0.19.8", FUSED_CASE: "0.19.8", GQA_CASE: "0.19.8", OLD_CASE: "0.17.6"}
"""The DeepSpeed version each case must be written with (its own venv)."""
WORLD, TP = 2, 2
MICRO, SEQ, VOCAB = 4, 8, 64
SAVE_AT, RESUME_STEPS = 4, 10


class FusedBlock(torch.nn.Module):
    """A pre-norm transformer block whose attention input and MLP input are each one fused Linear, as
    in Phi-3: qkv_proj holds [q; k; v] and gate_up_proj [gate; up] stacked along out_features; with
    queries_per_kv > 1, fewer key/value heads than query heads (grouped-query attention), so q is the
    larger part. Under tensor parallelism each rank's slice of the fused output is its share of every
    part, so the split by proportion and the head_dim reshape work on any slice."""

    def __init__(self, d: int, head_dim: int, ffn: int, queries_per_kv: int = 1) -> None:
        super().__init__()
        self.head_dim, self.queries_per_kv = head_dim, queries_per_kv
        self.input_norm = torch.nn.LayerNorm(d)
        self.qkv_proj = torch.nn.Linear(d, d + 2 * d // queries_per_kv)
        self.o_proj = torch.nn.Linear(d, d)
        self.post_norm = torch.nn.LayerNorm(d)
        self.gate_up_proj = torch.nn.Linear(d, 2 * ffn)
        self.down_proj = torch.nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv_proj(self.input_norm(x))
        kv = qkv.shape[-1] // (self.queries_per_kv + 2)  # this slice's key (and value) width
        q, k, v = qkv.split([kv * self.queries_per_kv, kv, kv], dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up_proj(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(torch.nn.functional.silu(gate) * up)


class FusedLM(torch.nn.Module):
    """A tiny causal LM of FusedBlocks, called as a Hugging Face model is (input_ids, labels -> .loss)."""

    def __init__(self, vocab: int, d: int, heads: int, ffn: int, layers: int, kv_heads: int | None = None) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, d)
        per_kv = heads // (kv_heads or heads)
        self.layers = torch.nn.ModuleList(FusedBlock(d, d // heads, ffn, per_kv) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def make_model(seed: int, case: str = CASE) -> Any:
    """The case's tiny model: a Hugging Face Llama (q/k/v and gate/up apart) or FusedLM."""
    torch.manual_seed(seed)
    if case == FUSED_CASE:
        return FusedLM(VOCAB, d=16, heads=2, ffn=32, layers=2)
    if case == GQA_CASE:  # 4 query heads, 2 key/value heads of 4: qkv_proj is [q 16; k 8; v 8]
        return FusedLM(VOCAB, d=16, heads=4, ffn=32, layers=2, kv_heads=2)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def batch(step: int) -> torch.Tensor:
    """The token ids of step `step`: the same on every rank (data-parallel size 1)."""
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(2000 + step))


def ds_config(case: str = CASE) -> dict[str, Any]:
    tensor_parallel: dict[str, Any] = {"autotp_size": TP}
    if case in (FUSED_CASE, GQA_CASE):
        # DeepSpeed's documented spec for a custom model: each fused Linear's parts given by `shape`.
        tensor_parallel["partition_config"] = {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*\.o_proj\.weight$", r".*\.down_proj\.weight$"], "partition_type": "row"},
                {
                    "patterns": [r".*\.qkv_proj\.weight$"],
                    "partition_type": "column",
                    # [q; k; v]: three equal parts, or (GQA_CASE) 16 query rows and 8 each of key and value
                    "shape": [[16, 8, 8], -1] if case == GQA_CASE else [3, -1],
                    "partition_dim": 0,
                },
                {
                    "patterns": [r".*\.gate_up_proj\.weight$"],
                    "partition_type": "column",
                    "shape": [2, -1],
                    "partition_dim": 0,
                },
            ],
        }
    return {
        "train_batch_size": MICRO * WORLD // TP * TP,  # DeepSpeed counts every rank under AutoTP
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": 1},
        "tensor_parallel": tensor_parallel,
    }


def _step(engine: Any, step: int) -> float:
    loss = engine(input_ids=batch(step), labels=batch(step)).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _cpu_device_for_object_broadcasts() -> None:
    """DeepSpeed 0.17.6's CPU accelerator gives current_device() as LOCAL_RANK (a string such as "0"),
    which its AutoTP input check passes to torch as a device and torch 2.13 refuses ("Invalid device
    string"); the device it means is the CPU."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().current_device = lambda: "cpu"


def _sharded(model: Any, case: str) -> Any:
    """DeepSpeed 0.17's AutoTP training shards the model in deepspeed.tp_model_init, called before
    initialize (its documented use); from 0.18 initialize does it from tensor_parallel.autotp_size."""
    if WRITTEN_BY[case] != "0.17.6":
        return model
    import deepspeed

    return deepspeed.tp_model_init(model, tp_size=TP, dtype=torch.float32)


def _rank_main(rank: int, port: int, case: str) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "deepspeed_checkpoints"))
    from make_fixtures import init_rank  # the golden checkpoints' script: one way to start a rank

    init_rank(rank, port, WORLD)
    if WRITTEN_BY[case] == "0.17.6":
        _cpu_device_for_object_broadcasts()
    import deepspeed
    import torch.distributed as dist

    folder = os.path.join(HERE, case)
    ckpt = os.path.join(folder, "ckpt")
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    dist.barrier()
    model = _sharded(make_model(seed=0, case=case), case)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(case))
    before = [_step(engine, s) for s in range(SAVE_AT)]
    engine.save_checkpoint(ckpt, client_state={"epoch": 3})
    dist.barrier()
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(ckpt, script)):
                os.remove(os.path.join(ckpt, script))
    engine.destroy()
    fresh = _sharded(make_model(seed=99, case=case), case)
    resumed, _, _, _ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=ds_config(case))
    resumed.load_checkpoint(ckpt)
    after = [_step(resumed, SAVE_AT + k) for k in range(RESUME_STEPS)]
    if rank == 0:
        import transformers

        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump(
                {
                    "deepspeed": deepspeed.__version__,
                    "transformers": transformers.__version__,
                    "torch": torch.__version__,
                    "world_size": WORLD,
                    "tp_size": TP,
                    "config": ds_config(case),
                    "global_steps": resumed.global_steps,
                    "losses_before_save": before,
                    "resumed_losses": after,
                },
                f,
                indent=1,
            )
    resumed.destroy()


def main(cases: list[str]) -> None:
    import deepspeed

    for case in cases or [c for c in CASES if WRITTEN_BY[c] == deepspeed.__version__]:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; the cases: {', '.join(CASES)}")
        if deepspeed.__version__ != WRITTEN_BY[case]:
            raise SystemExit(f"{case} is written by DeepSpeed {WRITTEN_BY[case]}; this is {deepspeed.__version__}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_rank_main, args=(port, case), nprocs=WORLD)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
