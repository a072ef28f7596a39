"""engine.compile(): torch.compile of the wrapped model, as DeepSpeedEngine.compile does it.

    engine, *_ = engine.initialize(model=model, config="ds.json")
    engine.compile()                      # backend "inductor", or the config's compile.backend
    engine.is_compiled                    # True

The model is compiled in place (`module.compile()`: its state_dict keys stay as they were, no
`_orig_mod.`), so checkpoints, consolidation and the 16-bit save read the same names compiled or not.
Accelerate calls this for `TrainingArguments(torch_compile=True)`; its regional compilation calls
`compile()` on each repeated block of `engine.module` instead, which works the same way.

At stages 0-2 the whole forward is one graph: the engine acts in the gradients' hooks, which run in
the backward outside it. At stage 3 the graph breaks at each gather unit's member: the engine's forward
hooks (gather before, release after) run eagerly, and each member's forward between them is compiled
(engine/zero/stage3/hooks.py). docs/compile.md says what this gives.

The config's `compile` section (DeepSpeed 0.14's): `backend` and `kwargs` are what compile() uses when
called without them; `enabled: true` (or axolotl's `disable: false`) compiles at initialize.
DeepCompile (`deepcompile: true`) is refused when the config is loaded.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.monitor.log import get_logger

if TYPE_CHECKING:
    from engine.config.types import EngineConfig
    from engine.runtime.window import TrainingWindow
    from engine.zero.base import ZeroStage

logger = get_logger()

_COMPILE_PARAMETERS = frozenset(inspect.signature(torch.compile).parameters) - {"model", "backend"}
"""The keyword arguments torch.compile takes beside the model and the backend (fullgraph, dynamic,
mode, options, disable)."""


class CompileError(ValueError):
    """engine.compile() called with something it cannot use, or when it can no longer apply; nothing
    was changed."""


def resolve_backend(backend: Any) -> str | Callable[..., Any]:
    """A backend torch.compile knows (a registered name, a callable), or a dotted path to a callable (as
    DeepSpeed imports one); anything else is a CompileError listing the registered names."""
    if callable(backend):
        return backend
    if not isinstance(backend, str) or not backend:
        raise CompileError(f"engine.compile(backend={backend!r}): a backend is a name or a callable")
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend in known:
        return backend
    module_name, _, attr = backend.rpartition(".")
    if module_name:
        try:
            found = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            found = None
        if callable(found):
            return found
    raise CompileError(
        f"engine.compile(backend={backend!r}): no such torch.compile backend. Registered: {', '.join(known)}; "
        "or pass a callable, or the dotted path of one (my_package.my_backend)"
    )


def check_kwargs(compile_kwargs: Any) -> dict[str, Any]:
    """torch.compile's keyword arguments, checked now (torch would only say at the first forward)."""
    if compile_kwargs is None:
        return {}
    if not isinstance(compile_kwargs, Mapping):
        raise CompileError(
            f"engine.compile(compile_kwargs={compile_kwargs!r}): expected a dict of torch.compile's arguments"
        )
    kwargs = dict(compile_kwargs)
    if "backend" in kwargs:
        logger.warning(
            "engine.compile(): compile_kwargs['backend'] is overridden by the backend argument (as DeepSpeed)"
        )
        kwargs.pop("backend")
    unknown = sorted(set(kwargs) - _COMPILE_PARAMETERS)
    if unknown:
        raise CompileError(
            f"engine.compile(compile_kwargs=...): {', '.join(unknown)} not arguments of torch.compile; it takes "
            f"{', '.join(sorted(_COMPILE_PARAMETERS))}"
        )
    return kwargs


class CompileMixin:
    """engine.compile() and engine.is_compiled (see the module docstring)."""

    module: torch.nn.Module
    engine_config: EngineConfig
    _window: TrainingWindow
    _compiled: dict[str, Any] | None = None
    """What compile() was given (backend, kwargs), or None: not compiled."""
    _autograd_compiler: Callable[..., Any] | None = None
    """compiled_autograd_enabled: the compiler every backward's autograd graph goes to, made once (one
    compiler across backwards: compiled autograd's cache of graphs lives with it)."""

    def _live_stage(self) -> ZeroStage:
        raise NotImplementedError  # the Engine's: raises DestroyedEngineError after destroy()

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

    def compile(
        self,
        backend: Any = None,
        compile_kwargs: Mapping[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the wrapped model in place with torch.compile (DeepSpeedEngine.compile's signature).
        Without a backend or compile_kwargs, the config's compile section gives them ("inductor", none).
        A second call does nothing (DeepSpeed's rule). Refused, with nothing changed: an unknown backend
        or argument, a DeepCompile `schedule`, a destroyed engine, and a call after the first forward."""
        self._live_stage()
        if self._compiled is not None:
            return
        section = self.engine_config.compile
        resolved = resolve_backend(section.backend if backend is None else backend)
        kwargs = check_kwargs(section.kwargs if compile_kwargs is None else compile_kwargs)
        if schedule is not None:
            raise CompileError(
                "engine.compile(schedule=...): a schedule is DeepCompile's (its compiler passes for ZeRO), which this "
                "engine does not implement; call compile() without it"
            )
        if self._window.micro_steps > 0 or self._window.global_steps > 0:
            raise CompileError(
                f"engine.compile() after training started (micro-step {self._window.micro_steps}, step "
                f"{self._window.global_steps}): compiled kernels round differently from eager ones, so the run would "
                "change numerics mid-way, and the compile would land inside a step. Compile right after "
                'engine.initialize(), or set "compile": {"enabled": true} in the config'
            )
        self.module.compile(backend=resolved, **kwargs)
        self._compiled = {"backend": resolved, "kwargs": kwargs}
        if compiled_autograd_enabled:
            self._autograd_compiler = torch.compile(backend=resolved, **kwargs)
        arguments = ", ".join(f"{k}={v!r}" for k, v in {"backend": resolved, **kwargs}.items())
        logger.info("the model will be compiled at its first forward: torch.compile(%s)", arguments)

    def _backward_compiled(self) -> contextlib.AbstractContextManager[Any]:
        """Around engine.backward's autograd call: compiled autograd, when compile() asked for it."""
        if self._autograd_compiler is None:
            return contextlib.nullcontext()
        from torch._dynamo import compiled_autograd

        return compiled_autograd._enable(self._autograd_compiler)
