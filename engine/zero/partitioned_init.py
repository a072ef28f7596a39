"""`engine.zero.Init`: build a model already partitioned, so one larger than a rank's memory can exist.

    with engine.zero.Init():
        model = GPT(cfg)             # each submodule's parameters are partitioned as soon as it is built
    engine, *_ = engine.initialize(model=model, config="zero3.json")

As in DeepSpeed, every nn.Module subclass's `__init__` is wrapped while the context is open. When
the outermost `__init__` of a module returns, that module's own parameters (not its children's,
which were partitioned when *they* were built) are broadcast from rank 0, flattened, padded to a
multiple of the world size, and rank r keeps slice r (its shard); `param.data` becomes empty and
`param.ds_shape`/`param.ds_numel` keep the full shape. Peak memory while building is therefore this
rank's shards plus the largest module under construction, never the whole model.

Initialisation equals the unpartitioned model's with the same seed: rank 0 builds every module with
the same random stream it would have used without Init, and its values are the ones kept.
`Module.apply(fn)` (the usual `self.apply(self._init_weights)` at the end of a model's `__init__`,
run after the children are partitioned) is patched inside the context too: each module's own
parameters are gathered whole for fn and partitioned again afterwards from rank 0's result. So is
transformers' `PreTrainedModel._initialize_weights`, which its `post_init` calls for every module by
a walk of its own (transformers 5 does not use apply): a model built from its config under Init
equals the one built without it, bitwise. Other writes to a partitioned parameter after its module
was built must go through `engine.zero.GatheredParameters(param, modifier_rank=0)`; a parameter made
with `torch.empty` that nothing wrote is refused by name at initialize (engine/zero/unwritten.py).

`engine.initialize` at stage 3 re-lays these slices into its gather units (one all-gather per
parameter, a unit at a time); at stages 0-2 it gathers the parameters whole again.

With `Init(dtype=...)` torch's tensor constructors (torch.tensor/empty/zeros/ones/full/arange/eye/
randn) are wrapped while the context is open, as DeepSpeed does: a floating-point tensor created
without an explicit dtype gets Init's dtype, so a layer is never materialised in fp32 first. An
explicit `dtype=` is kept (DeepSpeed overrides it too; transformers patches DeepSpeed's wrapper to keep
fp32 `torch.arange` RoPE buffers). The wrapper is this module's `zero_wrapper_for_fp_tensor_constructor`,
looked up when the outermost Init opens, so a caller that replaces that module attribute (transformers'
`prevent_arange_dtype_change`, comparing `fn is _orig_torch_arange`) changes what Init installs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import torch

from engine import comm
from engine.accelerator import get_accelerator  # also DeepSpeed's partition_parameters.get_accelerator (transformers)
from engine.config import run_checks, zero_stage
from engine.monitor.log import get_logger
from engine.ops.heap import return_freed_memory
from engine.zero.init_constructors import (  # noqa: F401 - DeepSpeed's partition_parameters has these (transformers)
    _CONSTRUCTORS,
    _orig_torch_arange,
    _orig_torch_empty,
    _orig_torch_eye,
    _orig_torch_full,
    _orig_torch_ones,
    _orig_torch_randn,
    _orig_torch_tensor,
    _orig_torch_zeros,
    zero_wrapper_for_fp_tensor_constructor,
)
from engine.zero.released import ZeroParamStatus  # noqa: F401 - DeepSpeed's partition_parameters has it (TRL imports it)
from engine.zero.unwritten import poisoning_empty

logger = get_logger()

# [Note: what a partitioned parameter carries]
# `ds_shape`/`ds_numel` are DeepSpeed's public names for the whole shape and size; Hugging Face
# transformers (and engine/zero/stage3/, released.py, checkpoint/store.py) read them on the Parameter,
# so they are set there, through set_full_shape/full_shape: torch.nn.Parameter declares neither.
# The shard (this rank's slice) is Init's own state. It stays an attribute of the Parameter rather than
# an entry of a side table (as engine/zero/owners.py keeps a stage's) only because stage 3 deletes it by
# name when it re-lays the parameter; every access here goes through local_shard/drop_shard, so moving it to
# a WeakIdKeyDictionary is a change to those two once stage 3 calls drop_shard.
DS_SHAPE, DS_NUMEL = "ds_shape", "ds_numel"
_SHARD = "_zero_init_shard"
_INITIALIZER = "_initialize_weights"  # transformers' PreTrainedModel method Init wraps (see Init._wrap_initializer)
_BUILT_ON = "_zero_init_built_on"  # the device a parameter was built on, where apply's fn runs (see _partitioned_apply)


def set_full_shape(param: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Record the whole shape (and size) of `param` under DeepSpeed's names, before `.data` is emptied."""
    setattr(param, DS_SHAPE, shape)
    setattr(param, DS_NUMEL, math.prod(shape))


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The whole shape of `param`: `ds_shape` once it was partitioned (its `.data` empty), else its own."""
    shape = getattr(param, DS_SHAPE, None)
    return tuple(shape) if shape is not None else tuple(param.shape)


def local_shard(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's slice of `param` (flat, padded to the world size), or None when not partitioned."""
    shard: torch.Tensor | None = getattr(param, _SHARD, None)
    return shard


def drop_shard(param: torch.Tensor) -> None:
    """Forget the partition of `param` once its values live elsewhere (whole again, or re-laid by stage 3)."""
    delattr(param, _SHARD)


def is_partitioned(param: torch.Tensor) -> bool:
    return local_shard(param) is not None


def _slice_numel(numel: int, world: int) -> int:
    return -(-numel // world) if numel else 0


def partition(params: Iterable[torch.Tensor], dtype: torch.dtype | None = None, src: int | None = 0) -> None:
    """Partition `params` (whole, not yet partitioned) from rank `src`'s values (None: each rank's own,
    when they are known to be equal)."""
    whole = [p for p in params if not is_partitioned(p)]
    if not whole:
        return
    device = _collective_device()
    for p in whole:
        if not hasattr(p, _BUILT_ON):
            setattr(p, _BUILT_ON, p.device)
        if device is not None:  # NCCL moves device tensors only: partition where the collectives run, as
            p.data = p.data.to(device)  # DeepSpeed's Init does on its local_device (an H200: a CPU gather failed)
    if src is not None:
        comm.broadcast_coalesced([p.data for p in whole], src=src)
    world, rank = comm.get_world_size(), comm.get_rank()
    for p in whole:
        numel = p.numel()
        size = _slice_numel(numel, world)
        flat = p.data.reshape(-1)
        if dtype is not None:
            flat = flat.to(dtype)
        shard = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        mine = flat[rank * size : min((rank + 1) * size, numel)]
        shard[: mine.numel()].copy_(mine)
        set_full_shape(p, tuple(p.shape))
        setattr(p, _SHARD, shard)
        p.data = torch.empty(0, dtype=shard.dtype, device=shard.device)
    del flat, mine
    return_freed_memory()  # the whole values' pages (engine/ops/heap.py says why)


def _collective_device() -> torch.device | None:
    """The accelerator's device when it is not the CPU (parameters partitioned there), else None."""
    accelerator = get_accelerator()
    return None if accelerator.device_name() == "cpu" else accelerator.device()


def full_value(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole value of a partitioned parameter (an all-gather; every rank must call it)."""
    shard = local_shard(param)
    if shard is None:
        raise ValueError("engine.zero.Init: full_value() of a parameter that is not partitioned")
    shape = full_shape(param)
    full = torch.empty(shard.numel() * comm.get_world_size(), dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard)
    value = full[: math.prod(shape)].view(shape)
    return value if dtype is None else value.to(dtype)


def unpartition(param: torch.Tensor, device: torch.device | None = None) -> None:
    """Make a partitioned parameter whole again, in its current dtype, on `device` (default: its current one)."""
    param.data = full_value(param, param.dtype).to(param.device if device is None else device)
    drop_shard(param)


def materialize(module: torch.nn.Module) -> int:
    """Gather every partitioned parameter of `module` whole (stages 0-2); returns how many."""
    params = [p for p in {id(p): p for p in module.parameters()}.values() if is_partitioned(p)]
    for p in params:
        unpartition(p)
    return len(params)


_M = TypeVar("_M", bound=torch.nn.Module)
_Apply = Callable[[torch.nn.Module, Callable[[torch.nn.Module], None]], torch.nn.Module]
"""torch.nn.Module.apply's signature (Init replaces it while open)."""


def _own_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters(recurse=False)]


def _all_module_classes() -> Iterator[type[torch.nn.Module]]:
    seen: set[type[torch.nn.Module]] = set()
    stack = [torch.nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
                yield sub


class Init:
    """Partition parameters as modules are built (DeepSpeed's `deepspeed.zero.Init`).

    Accepted like DeepSpeed's: `module` (partition an already built module now), `enabled`,
    `dtype` (the parameters' dtype, and that of floating-point tensors torch's constructors make
    inside the context), `config_dict_or_path`/`config` (only checked to be stage 3 when
    given), `remote_device` None/"cpu", `pin_memory`, `mem_efficient_linear`. Needs the process group,
    so it initialises it like engine.initialize does when there is none yet.
    """

    # Process-wide patch state: one patch however deeply Init contexts nest.
    _depth: ClassVar[int] = 0
    _saved: ClassVar[dict[tuple[type[torch.nn.Module], str], tuple[Callable[..., Any], Callable[..., Any]]]] = {}
    """(class, "__init__" or "_initialize_weights") -> (its own function, Init's wrapper). A class whose
    function was replaced after Init wrapped it (transformers' use_experts_implementation decorates MixtralExperts
    right after the class is made, inside Init when its module is first imported there) keeps the replacement
    at exit: the wrapper, still in its chain, does nothing outside Init."""
    _saved_apply: ClassVar[_Apply | None] = None
    _saved_init_subclass: ClassVar[classmethod[Any, ..., None] | None] = None
    """Module's own `__init_subclass__` (its __dict__ entry), None when it inherits object's."""
    _wrapped_constructors: ClassVar[bool] = False
    _saved_empty: ClassVar[Callable[..., torch.Tensor] | None] = None
    """torch.empty as it was when the outermost Init opened (see engine/zero/unwritten.py)."""
    _building: ClassVar[set[int]] = set()
    """ids of modules whose outermost __init__ is running."""
    _dtype: ClassVar[torch.dtype | None] = None

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **unsupported: Any,
    ) -> None:
        del mem_efficient_linear, pin_memory  # no effect here: no special linear, CPU memory is not pinned
        if unsupported:
            raise TypeError(f"engine.zero.Init: unsupported argument(s) {sorted(unsupported)}")
        if data_parallel_group is not None or mpu is not None:
            raise ValueError(
                "engine.zero.Init: data_parallel_group/mpu are not supported; parameters are "
                "partitioned over the default process group"
            )
        if remote_device not in (None, "cpu"):
            raise ValueError(
                f"engine.zero.Init: remote_device={remote_device!r} is not supported (parameters "
                "stay on the device they are built on); use None"
            )
        if remote_device == "cpu" and enabled and _collective_device() is not None:
            raise ValueError(
                "engine.zero.Init: remote_device='cpu' on a GPU is not supported yet (it has not run "
                "on one); use None: the partitions live on the GPU"
            )
        self.enabled = enabled
        self.dtype = dtype
        source = config_dict_or_path if config_dict_or_path is not None else config
        if enabled and source is not None:
            run_checks.check_init_stage(zero_stage(source))
        if enabled and module is not None:
            comm.init_distributed()
            for m in module.modules():
                partition(_own_params(m), dtype)

    # ------------------------------------------------------------------------------ context
    def __enter__(self) -> Init:  # noqa: PYI034 (Self needs Python 3.11)
        if not self.enabled:
            return self
        comm.init_distributed()
        if Init._depth == 0:
            Init._dtype = self.dtype
            self._patch()
        Init._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        Init._depth -= 1
        if Init._depth == 0:
            self._unpatch()

    @classmethod
    def _patch(cls) -> None:
        for sub in _all_module_classes():
            cls._wrap_init(sub)
            cls._wrap_initializer(sub)
        module_cls = torch.nn.Module
        cls._saved_init_subclass = module_cls.__dict__.get("__init_subclass__")

        saved = cls._saved_init_subclass

        # Module subclasses defined inside the context get their __init__ wrapped too.
        def init_subclass(sub: type[torch.nn.Module], /, **kwargs: Any) -> None:
            if saved is not None:
                saved.__get__(None, sub)(**kwargs)
            else:
                super(module_cls, sub).__init_subclass__(**kwargs)
            cls._wrap_init(sub)
            cls._wrap_initializer(sub)

        # [Note: patching Module] Replacing Module's methods is this context's purpose, which the stubs
        # cannot express: mypy refuses any assignment to a method ([method-assign]), and it types the
        # class attribute as the method bound to the class (`() -> None` for __init_subclass__, apply
        # with Module's `Self`), not as what the class __dict__ holds (a classmethod object, a plain
        # function), so a correct replacement is also an [assignment] error. Each replacement's own
        # signature is checked where it is declared (init_subclass above, `apply: _Apply`, _wrap_init's init).
        module_cls.__init_subclass__ = classmethod(init_subclass)  # type: ignore[method-assign, assignment]
        cls._saved_apply = module_cls.apply
        apply: _Apply = cls._partitioned_apply
        module_cls.apply = apply  # type: ignore[method-assign, assignment]  # See [Note: patching Module]
        if cls._dtype is not None:
            for name, constructor in _CONSTRUCTORS.items():
                # A global looked up at each __enter__, never bound at import: transformers replaces the
                # module attribute around Init (see the module docstring). Keywords, as it reads them.
                setattr(
                    torch,
                    name,
                    zero_wrapper_for_fp_tensor_constructor(constructor, target_fp_dtype=cls._dtype, target_device=None),
                )
            cls._wrapped_constructors = True
        cls._saved_empty = torch.empty
        torch.empty = poisoning_empty(torch.empty)

    @classmethod
    def _unpatch(cls) -> None:
        for (sub, name), (original, wrapper) in cls._saved.items():
            if sub.__dict__.get(name) is wrapper:
                setattr(sub, name, original)
        cls._saved.clear()
        if cls._saved_empty is not None:  # before the dtype wrappers below put the original back
            torch.empty = cls._saved_empty
            cls._saved_empty = None
        module_cls = torch.nn.Module
        if cls._saved_init_subclass is None:
            del module_cls.__init_subclass__
        else:  # See [Note: patching Module] for these ignores
            module_cls.__init_subclass__ = cls._saved_init_subclass  # type: ignore[method-assign]
        if cls._saved_apply is not None:  # See [Note: patching Module]
            module_cls.apply = cls._saved_apply  # type: ignore[method-assign, assignment]
        if cls._wrapped_constructors:
            for name, constructor in _CONSTRUCTORS.items():
                setattr(torch, name, constructor)
            cls._wrapped_constructors = False
        cls._building.clear()

    @classmethod
    def _wrap_init(cls, sub: type[torch.nn.Module]) -> None:
        original = sub.__dict__.get("__init__")
        if original is None or (sub, "__init__") in cls._saved:
            return

        @functools.wraps(original)
        def init(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            if not cls._depth:  # Init closed; a later decorator kept this wrapper in its chain
                return original(self, *args, **kwargs)
            outermost = id(self) not in cls._building
            if outermost:
                cls._building.add(id(self))
            try:
                original(self, *args, **kwargs)
            finally:
                if outermost:
                    cls._building.discard(id(self))
            if outermost:
                partition(_own_params(self), cls._dtype)

        cls._saved[(sub, "__init__")] = (original, init)
        sub.__init__ = init  # type: ignore[method-assign]  # See [Note: patching Module]

    @classmethod
    def _wrap_initializer(cls, sub: type[torch.nn.Module]) -> None:
        """transformers' models initialise their weights in `post_init`, at the end of the model's own
        `__init__`, after every submodule was partitioned: `initialize_weights` walks the modules (its own
        walk, not Module.apply) calling `self._initialize_weights(module, ...)`, which runs `_init_weights`.
        The wrapper gathers that module's own parameters and its direct children's (`_init_weights` may write
        `module.q_proj.weight`), whole on the device they were built on, for the call, and partitions them
        again from rank 0's result: the values equal the model built without Init (as _partitioned_apply).
        A module transformers already initialised (`_is_hf_initialized`) is skipped by the call itself, so
        nothing is gathered for it."""
        original = sub.__dict__.get(_INITIALIZER)
        if original is None or (sub, _INITIALIZER) in cls._saved or not callable(original):
            return

        @functools.wraps(original)
        def initialize(self: torch.nn.Module, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not cls._depth or getattr(module, "_is_hf_initialized", False):
                return original(self, module, *args, **kwargs)
            params = [p for m in (module, *module.children()) for p in _own_params(m)]
            return _whole_while(params, lambda: original(self, module, *args, **kwargs))

        cls._saved[(sub, _INITIALIZER)] = (original, initialize)
        setattr(sub, _INITIALIZER, initialize)

    @staticmethod
    def _partitioned_apply(module: _M, fn: Callable[[torch.nn.Module], None]) -> _M:
        """torch's Module.apply (children first, then the module) with the module's own parameters
        whole while fn runs, on the device they were built on: an init function's random draws then
        come from the same generator (the CPU's, for a model built on the CPU) as without Init, so
        the values equal the unpartitioned model's on a GPU too (there the partitions live on the GPU,
        and drawing there gave other weights: found on an H200, stage 3 started from another model)."""
        for child in module.children():
            child.apply(fn)
        _whole_while(_own_params(module), lambda: fn(module))
        return module


_R = TypeVar("_R")


def _whole_while(params: list[torch.nn.Parameter], call: Callable[[], _R]) -> _R:
    """`call()` with the partitioned ones of `params` whole, on the device they were built on, then partitioned
    again from rank 0's values (this rank's own after a failure: no collective then)."""
    loose = [p for p in {id(p): p for p in params}.values() if is_partitioned(p)]
    for p in loose:
        unpartition(p, getattr(p, _BUILT_ON, None))
    try:
        result = call()
    except BaseException:
        partition(loose, Init._dtype, src=None)
        raise
    partition(loose, Init._dtype)
    return result
