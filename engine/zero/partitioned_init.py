"""`engine.zero.Init`: build a model already partitioned, so one larger than a rank's memory can exist.

    with engine.zero.Init():
        model = GPT(cfg)             # each submodule's parameters are partitioned as soon as it is built
    engine, *_ = engine.initialize(model=model, config="zero3.json")

As in DeepSpeed, every nn.Module subclass's `__init__` is wrapped while the context is open. When
the outermost `__init__` of a module returns, that module's own parameters (not its children's,
which were partitioned when *they* were built) are broadcast from rank 0, flattened, padded to a
multiple of the world size, and rank r keeps slice r (`param._zero_init_shard`); `param.data`
becomes empty and `param.ds_shape`/`param.ds_numel` keep the full shape. Peak memory while building
is therefore this rank's shards plus the largest module under construction, never the whole model.

Initialisation equals the unpartitioned model's with the same seed: rank 0 builds every module with
the same random stream it would have used without Init, and its values are the ones kept.
`Module.apply(fn)` (the usual `self.apply(self._init_weights)` at the end of a model's `__init__`,
run after the children are partitioned) is patched inside the context too: each module's own
parameters are gathered whole for fn and partitioned again afterwards from rank 0's result. Other
writes to a partitioned parameter after its module was built must go through
`engine.zero.GatheredParameters(param, modifier_rank=0)`.

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

import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from engine import comm
from engine.accelerator import get_accelerator  # noqa: F401 - DeepSpeed's partition_parameters has it; transformers calls pp.get_accelerator()
from engine.config import zero_stage
from engine.monitor.log import get_logger

logger = get_logger()

# torch's constructors as they were when the engine was imported (DeepSpeed's names: transformers
# compares against `_orig_torch_arange`). Init wraps these and puts them back.
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn
_CONSTRUCTORS: dict[str, Callable[..., torch.Tensor]] = {
    "tensor": _orig_torch_tensor, "empty": _orig_torch_empty, "zeros": _orig_torch_zeros,
    "ones": _orig_torch_ones, "full": _orig_torch_full, "arange": _orig_torch_arange,
    "eye": _orig_torch_eye, "randn": _orig_torch_randn,
}


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None = None) -> Callable[..., torch.Tensor]:
    """`fn` (a torch tensor constructor) making floating-point tensors in `target_fp_dtype` and, when
    no device is given, on `target_device`. A dtype the caller names is kept; `out=` is left alone."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        named_dtype = kwargs.get("dtype") is not None
        tensor = fn(*args, **kwargs)
        if (target_fp_dtype is not None and not named_dtype and "out" not in kwargs
                and tensor.is_floating_point() and tensor.dtype != target_fp_dtype):
            tensor.data = tensor.data.to(target_fp_dtype)  # in place of .to(): a leaf stays a leaf (requires_grad=)
        return tensor

    return wrapped


def is_partitioned(param: torch.Tensor) -> bool:
    return getattr(param, "_zero_init_shard", None) is not None


def _slice_numel(numel: int, world: int) -> int:
    return -(-numel // world) if numel else 0


def partition(params: list[torch.nn.Parameter], dtype: torch.dtype | None = None, src: int | None = 0) -> None:
    """Partition `params` (whole, not yet partitioned) from rank `src`'s values (None: each rank's own,
    when they are known to be equal)."""
    params = [p for p in params if not is_partitioned(p)]
    if not params:
        return
    if src is not None:
        comm.broadcast_coalesced([p.data for p in params], src=src)
    world, rank = comm.get_world_size(), comm.get_rank()
    for p in params:
        numel = p.numel()
        size = _slice_numel(numel, world)
        flat = p.data.reshape(-1)
        if dtype is not None:
            flat = flat.to(dtype)
        shard = torch.zeros(size, dtype=flat.dtype, device=flat.device)
        mine = flat[rank * size:min((rank + 1) * size, numel)]
        shard[:mine.numel()].copy_(mine)
        p.ds_shape, p.ds_numel = tuple(p.shape), numel  # DeepSpeed's names for the full shape
        p._zero_init_shard = shard
        p.data = torch.empty(0, dtype=shard.dtype, device=shard.device)
    del flat, mine
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the pages of the whole values just freed back to the OS.

    glibc raises its mmap threshold after the first large free, so later layers' whole values come
    from the heap, interleaved with the small shards that stay: without a trim the freed holes stay
    resident and a rank's peak while building measured up to the whole model (0.33-1.1x on 4 ranks
    for a 400 MB model) instead of its quarter.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; other allocators return memory by themselves
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()


def full_value(param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole value of a partitioned parameter (an all-gather; every rank must call it)."""
    shard = param._zero_init_shard
    full = torch.empty(shard.numel() * comm.get_world_size(), dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard)
    value = full[:param.ds_numel].view(param.ds_shape)
    return value if dtype is None else value.to(dtype)


def unpartition(param: torch.nn.Parameter) -> None:
    """Make a partitioned parameter whole again, in its current dtype and device."""
    param.data = full_value(param, param.dtype).to(param.device)
    del param._zero_init_shard


def materialize(module: torch.nn.Module) -> int:
    """Gather every partitioned parameter of `module` whole (stages 0-2); returns how many."""
    params = [p for p in {id(p): p for p in module.parameters()}.values() if is_partitioned(p)]
    for p in params:
        unpartition(p)
    return len(params)


def _own_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters(recurse=False)]


def _all_module_classes() -> Iterator[type]:
    seen: set[type] = set()
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
    _saved_inits: ClassVar[dict[type, Callable[..., None]]] = {}
    _saved_apply: ClassVar[Callable[..., Any] | None] = None
    _saved_init_subclass: ClassVar[Any] = None
    _wrapped_constructors: ClassVar[bool] = False
    _building: ClassVar[set[int]] = set()
    """ids of modules whose outermost __init__ is running."""
    _dtype: ClassVar[torch.dtype | None] = None

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **unsupported: Any) -> None:
        del mem_efficient_linear, pin_memory  # no effect here: no special linear, CPU memory is not pinned
        if unsupported:
            raise TypeError(f"engine.zero.Init: unsupported argument(s) {sorted(unsupported)}")
        if data_parallel_group is not None or mpu is not None:
            raise ValueError("engine.zero.Init: data_parallel_group/mpu are not supported; parameters are "
                             "partitioned over the default process group")
        if remote_device not in (None, "cpu"):
            raise ValueError(f"engine.zero.Init: remote_device={remote_device!r} is not supported (parameters "
                             "stay on the device they are built on); use None")
        self.enabled = enabled
        self.dtype = dtype
        source = config_dict_or_path if config_dict_or_path is not None else config
        if enabled and source is not None and (stage := zero_stage(source)) != 3:
            raise ValueError(f"engine.zero.Init partitions parameters for zero_optimization.stage 3, but the "
                             f"config has stage {stage}; set it to 3 or build the model without Init "
                             "(enabled=False)")
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
        module_cls = torch.nn.Module
        cls._saved_init_subclass = module_cls.__dict__.get("__init_subclass__")

        saved = cls._saved_init_subclass

        def init_subclass(sub: type, **kwargs: Any) -> None:  # classes defined inside the context
            if saved is not None:
                saved.__get__(None, sub)(**kwargs)
            else:
                super(module_cls, sub).__init_subclass__(**kwargs)
            cls._wrap_init(sub)

        module_cls.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        cls._saved_apply = module_cls.apply
        module_cls.apply = cls._partitioned_apply  # type: ignore[method-assign]
        if cls._dtype is not None:
            for name, original in _CONSTRUCTORS.items():
                # A global looked up at each __enter__, never bound at import: transformers replaces the
                # module attribute around Init (see the module docstring). Keywords, as it reads them.
                setattr(torch, name, zero_wrapper_for_fp_tensor_constructor(
                    original, target_fp_dtype=cls._dtype, target_device=None))
            cls._wrapped_constructors = True

    @classmethod
    def _unpatch(cls) -> None:
        for sub, original in cls._saved_inits.items():
            sub.__init__ = original  # type: ignore[misc]
        cls._saved_inits.clear()
        module_cls = torch.nn.Module
        if cls._saved_init_subclass is None:
            del module_cls.__init_subclass__
        else:
            module_cls.__init_subclass__ = cls._saved_init_subclass  # type: ignore[assignment]
        module_cls.apply = cls._saved_apply  # type: ignore[method-assign]
        if cls._wrapped_constructors:
            for name, original in _CONSTRUCTORS.items():
                setattr(torch, name, original)
            cls._wrapped_constructors = False
        cls._building.clear()

    @classmethod
    def _wrap_init(cls, sub: type) -> None:
        original = sub.__dict__.get("__init__")
        if original is None or sub in cls._saved_inits:
            return
        cls._saved_inits[sub] = original

        @functools.wraps(original)
        def init(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
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

        sub.__init__ = init  # type: ignore[misc]

    @staticmethod
    def _partitioned_apply(module: torch.nn.Module, fn: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
        """torch's Module.apply (children first, then the module) with the module's own parameters
        whole while fn runs."""
        for child in module.children():
            child.apply(fn)
        params = [p for p in _own_params(module) if is_partitioned(p)]
        for p in params:
            unpartition(p)
        fn(module)
        partition(params, Init._dtype)
        return module
