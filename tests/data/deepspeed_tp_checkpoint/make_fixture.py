"""Writes the golden DeepSpeed checkpoint with tensor parallelism (AutoTP), with real DeepSpeed.

Run it in DeepSpeed's own venv with transformers installed (see SOURCES.md here):

    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/deepspeed_tp_checkpoint/make_fixture.py

Two gloo ranks train a tiny Hugging Face Llama with DeepSpeed's AutoTP at tensor-parallel size 2
(data-parallel size 1, ZeRO stage 1, fp32) for SAVE_AT steps and save into stage1_fp32_tp2/ckpt
(mp_rank_00/01 model and optimizer files: q/k/v/gate/up and lm_head split along dim 0, o/down along
dim 1, embeddings and norms replicated). Two fresh ranks (another seed) load it with DeepSpeed's
load_checkpoint and train RESUME_STEPS more steps; their losses go into stage1_fp32_tp2/expected.json.
The model and data are defined here without DeepSpeed, so tests/test_deepspeed_tp_checkpoint.py
imports them and trains the engine on the same batches.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = "stage1_fp32_tp2"
WORLD, TP = 2, 2
MICRO, SEQ, VOCAB = 4, 8, 64
SAVE_AT, RESUME_STEPS = 4, 10


def make_model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
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


def ds_config() -> dict[str, Any]:
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
        "tensor_parallel": {"autotp_size": TP},
    }


def _step(engine: Any, step: int) -> float:
    loss = engine(input_ids=batch(step), labels=batch(step)).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _rank_main(rank: int, port: int) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "deepspeed_checkpoints"))
    from make_fixtures import init_rank  # the golden checkpoints' script: one way to start a rank

    init_rank(rank, port, WORLD)
    import deepspeed
    import torch.distributed as dist

    folder = os.path.join(HERE, CASE)
    ckpt = os.path.join(folder, "ckpt")
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    dist.barrier()
    model = make_model(seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    before = [_step(engine, s) for s in range(SAVE_AT)]
    engine.save_checkpoint(ckpt, client_state={"epoch": 3})
    dist.barrier()
    if rank == 0:
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(ckpt, script)):
                os.remove(os.path.join(ckpt, script))
    engine.destroy()
    fresh = make_model(seed=99)
    resumed, _, _, _ = deepspeed.initialize(model=fresh, model_parameters=fresh.parameters(), config=ds_config())
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
                    "config": ds_config(),
                    "global_steps": resumed.global_steps,
                    "losses_before_save": before,
                    "resumed_losses": after,
                },
                f,
                indent=1,
            )
    resumed.destroy()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_main, args=(port,), nprocs=WORLD)


if __name__ == "__main__":
    sys.exit(main())
