"""Python side of the C++/CUDA extension in csrc/: the builder/loader and each op with its pure-torch
fallback (same results). `python -m engine.report` says which path is active and why."""
