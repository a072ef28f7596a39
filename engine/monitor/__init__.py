"""What a run tells the user: the engine's logger (log.py), the wall-clock timers of
`wall_clock_breakdown` (timers.py), the `memory_breakdown` line (memory.py), and the monitors the
config turns on (monitors.py: csv_monitor, tensorboard, wandb, comet), fed each optimizer step's
events under DeepSpeed's names (events.py)."""
