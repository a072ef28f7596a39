"""trainer.evaluate() and then trainer.train() in one Trainer at ZeRO stage 3: transformers 5.24 builds
an evaluation-only engine for evaluate(), destroys it at the start of train() (Accelerate's
free_memory) and then trains with it. Real DeepSpeed fails there with an AttributeError; the engine
must stop with its named error saying what to do. Arguments: CONFIG OUTPUT_DIR."""

from __future__ import annotations

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Windows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(i, i + 16) % 256
        return {"input_ids": ids, "labels": ids}


def main(config: str, out: str) -> None:
    args = TrainingArguments(
        output_dir=out,
        deepspeed=config,
        use_cpu=True,
        max_steps=2,
        report_to="none",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        save_strategy="no",
    )
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    trainer = Trainer(model=model, args=args, train_dataset=Windows(), eval_dataset=Windows())
    trainer.evaluate()
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
