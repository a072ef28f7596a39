"""Plot the main job's loss and throughput from its TensorBoard event files (tensorboard's own reader).

    python examples/plot_tensorboard.py runs/tb/train_gpt --out docs/main_job_loss.png

Needs tensorboard (pip install 'zero-engine[tensorboard]') and matplotlib (pip install 'zero-engine[bench]').
"""

from __future__ import annotations

import argparse

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logdir", help="the folder holding events.out.tfevents.* (output_path/job_name)")
    parser.add_argument("--out", default="loss.png")
    parser.add_argument("--title", default="examples/train_gpt.py")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = EventAccumulator(args.logdir)
    board.Reload()
    tags = board.Tags()["scalars"]
    if "Train/Samples/train_loss" not in tags:
        raise SystemExit(f"{args.logdir}: no Train/Samples/train_loss events (scalars there: {tags or 'none'})")
    loss = board.Scalars("Train/Samples/train_loss")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([e.step for e in loss], [e.value for e in loss], lw=1)
    a.set_xlabel("samples")
    a.set_ylabel("train loss (nats/byte)")
    a.set_title(f"{args.title}: training loss")
    a.grid(alpha=0.3)
    if "Train/Samples/lr" in tags:
        lr = board.Scalars("Train/Samples/lr")
        b.plot([e.step for e in lr], [e.value for e in lr], lw=1, color="tab:orange")
        b.set_xlabel("samples")
        b.set_ylabel("learning rate")
        b.set_title("learning rate (warmup + cosine)")
        b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(loss)} steps)")


if __name__ == "__main__":
    main()
