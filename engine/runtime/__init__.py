"""The Engine, in its parts: what `engine.initialize` returns and every user call goes through.

- engine.py: `Engine`, forward / backward / step over a `ZeroStage` (engine/zero/base.py), the LR
  schedule and the counters; it knows no stage or offload detail.
- window.py: `TrainingWindow`, the accumulation window's one explicit state (`WindowState`, checked
  moves) with the step counters, the no_sync() block and a framework's boundary override.
- saving.py, accessors.py: the Engine's save/load methods and DeepSpeed's accessors, as mixins.
- zero_optimizer.py: the optimizer `engine.initialize` returns (DeepSpeed's ZeRO optimizer surface).
- auto_cast.py: fp16.auto_cast's cast of floating inputs.

Reporting (the progress line, monitors, comm accounting) is engine/monitor/reporter.py's.
"""
