"""The compiled CPU ops (csrc/cpu, a plain C++ shared library) bound with ctypes: what builder.load() returns.

    ops = builder.load()                      # a CpuOps, or None (then every op uses its torch fallback)
    ops.copy_into(dst, srcs, offsets, 0.5)    # the ops of engine/ops/*.py, on CPU tensors
    ops.simd_level()                          # "avx512", "avx2" or "scalar"

See [Note: a plain C++ library behind a ctypes binding] in csrc/cpu/ops.h. C++ gets raw pointers, so
every method here checks its tensors before a pointer leaves Python: one scan collects the pointers
and sees whether every tensor is a contiguous CPU tensor of a dtype the op takes; only when one is not
do the op's own named checks run (engine/ops/flatten.py, overflow.py, accumulate.py, adam.py), raised
as the pybind11 extension raised them: RuntimeError from copy_into, copy_out, sum_squares_and_overflow
and accumulate, TypeError/ValueError from adam_step. ctypes releases the GIL for every call, so other
Python threads (communication) run meanwhile; the tensors stay referenced here until the call returns.
"""

from __future__ import annotations

import array
import ctypes
import operator
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.ops import checks

CHUNK = 1 << 14
"""Elements per partial sum of the norm (csrc/cpu/ops.h, kChunk)."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""torch dtype -> the C API's dtype code (csrc/cpu/ops.h, DType)."""
_FP32 = {torch.float32: 0}
_LOW_PRECISION = {torch.bfloat16: 1, torch.float16: 2}

# Arrays go in as the address of an array.array's buffer (a void pointer): building one from a list
# costs a fifth of a ctypes array's.
_P, _I64, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_double
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "ze_simd_level": (ctypes.c_char_p, []),
    "ze_copy": (None, [_P, _P, _P, _P, _P, _I64, _F64, _I32]),
    "ze_sum_squares_and_overflow": (_F64, [_P, _P, _P, _I64, _F64, _I32, ctypes.POINTER(_I32)]),
    "ze_chunk_sum_squares": (_I32, [_P, _P, _P, _I64, _F64, _I32, _P]),
    "ze_accumulate": (_I32, [_P, _P, _I64, _I32, _I32, _F64, _I32]),
    "ze_adam_step": (
        None,
        [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _F64, _F64, _F64, _F64, _F64, _I32, _I64, _I32, _F64, _I32],
    ),
    "ze_arena_create": (_P, [_I64, _I32]),
    "ze_arena_destroy": (None, [_P]),
    "ze_arena_base": (_P, [_P]),
    "ze_arena_take": (_I64, [_P, _I64, ctypes.POINTER(_I64)]),
    "ze_arena_give_back": (None, [_P, _I64, _I64]),
    "ze_arena_usage": (None, [_P, ctypes.POINTER(_I64)]),
    "ze_aio_create": (_P, [_I32, _I64, _I32]),
    "ze_aio_destroy": (None, [_P]),
    "ze_aio_submit": (_I64, [_P, _I32, _I32, _I32, _P, _I64, _I64]),
    "ze_aio_wait": (_I64, [_P, _I64, ctypes.POINTER(_I64)]),
    "ze_aio_poll": (_I32, [_P, _I64]),
}
"""Each C entry point's (restype, argtypes), as declared in csrc/cpu/ops.h."""


def open_library(path: Path) -> ctypes.CDLL:
    """The library with every entry point's signature declared (AttributeError names a missing one)."""
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def _address(values: array.array[int] | array.array[float]) -> int:
    return values.buffer_info()[0]


_data_ptr, _numel, _is_contiguous = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
_dtype, _is_cpu = operator.attrgetter("dtype"), operator.attrgetter("is_cpu")


class _Scan:
    """The data pointers, sizes and dtype codes of a list of tensors, gathered by one map() per attribute
    (about 0.3 us a tensor here, a third less than a Python loop); `ok` is False, and nothing else is
    set, when some tensor is not a contiguous CPU tensor of one of the dtypes asked for. The arrays live
    as long as this object: keep it referenced until the call that reads them returns."""

    def __init__(self, tensors: Sequence[torch.Tensor], codes: dict[torch.dtype, int]) -> None:
        self.ok = False
        try:
            types = list(map(codes.__getitem__, map(_dtype, tensors)))
            if not (all(map(_is_cpu, tensors)) and all(map(_is_contiguous, tensors))):
                return
        except (KeyError, TypeError):  # a dtype the op does not take, or not a tensor
            return
        self.ok = True
        self.numels: list[int] = list(map(_numel, tensors))
        self.types: list[int] = types
        self._ptrs = array.array("Q", map(_data_ptr, tensors))
        self._numels = array.array("q", self.numels)
        self._types = array.array("i", types)  # C int: int32_t on every platform torch builds for

    @property
    def ptrs(self) -> int:
        return _address(self._ptrs)

    @property
    def numel_array(self) -> int:
        return _address(self._numels)

    @property
    def type_array(self) -> int:
        return _address(self._types)


def _named(
    check: Callable[[], None], tensors: list[tuple[str, torch.Tensor]], op: str, runtime_error: bool = True
) -> Exception:
    """The error for arguments a scan refused: the first of the (name, tensor) pairs off the CPU, else
    what the op's own named check raises; as RuntimeError when `runtime_error` (the pybind11 extension's
    TORCH_CHECK raised that from these ops), else as raised (ValueError for a device)."""
    problem: Exception | None = None
    off_cpu = [(name, t) for name, t in tensors if isinstance(t, torch.Tensor) and not t.is_cpu]
    if off_cpu:
        name, t = off_cpu[0]
        problem = ValueError(f"{op}: {name} is on {t.device}; the compiled op takes CPU tensors only")
    else:
        try:
            check()
        except (TypeError, ValueError) as error:
            problem = error
    if problem is None:
        problem = ValueError(f"{op}: an argument the compiled op cannot take (its checks name nothing)")
    return RuntimeError(str(problem)) if runtime_error else problem


def _indexed(name: str, tensors: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(f"{name}[{i}]", t) for i, t in enumerate(tensors)]


_VERSIONS_IN_ONE_CALL = True  # until a torch that takes one tensor at a time says otherwise


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    """torch.autograd.graph.increment_version of every tensor: one call where torch takes a list (2.8 does),
    one per tensor on the older torch versions setup.cfg allows, which take a single tensor."""
    global _VERSIONS_IN_ONE_CALL
    if _VERSIONS_IN_ONE_CALL:
        try:
            torch.autograd.graph.increment_version(tensors)
            return
        except TypeError:
            _VERSIONS_IN_ONE_CALL = False
    for t in tensors:
        torch.autograd.graph.increment_version(t)


def thread_count() -> int:
    """torch's intra-op thread count: torch.set_num_threads governs these ops as it does torch's own."""
    return torch.get_num_threads()


class CpuOps:
    """The compiled CPU ops, with the signatures of the pybind11 module they replace (engine/ops/*.py
    call them through engine.ops.select)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = open_library(path)

    def simd_level(self) -> str:
        """The SIMD instruction set the library was compiled for ("avx512", "avx2", "scalar")."""
        return str(self._lib.ze_simd_level().decode())

    def copy_into(
        self, dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0
    ) -> None:
        """dst[offsets[i]:offsets[i] + srcs[i].numel()] = cast(float(srcs[i]) * scale) (flatten.copy_into)."""
        self._copy("copy_into", dst, "dst", srcs, "srcs", offsets, scale, into_flat=True)

    def copy_out(
        self, src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int], scale: float = 1.0
    ) -> None:
        """dsts[i] = cast(float(src[offsets[i]:offsets[i] + dsts[i].numel()]) * scale) (flatten.copy_out)."""
        self._copy("copy_out", src, "src", dsts, "dsts", offsets, scale, into_flat=False)

    def _copy(
        self,
        op: str,
        flat: torch.Tensor,
        flat_name: str,
        many: Sequence[torch.Tensor],
        many_name: str,
        offsets: Sequence[int],
        scale: float,
        *,
        into_flat: bool,
    ) -> None:
        flat_scan, scan = _Scan([flat], DTYPE_CODES), _Scan(many, DTYPE_CODES)
        size = flat.numel() if flat_scan.ok else 0
        ok = (
            flat_scan.ok
            and scan.ok
            and flat.dim() == 1
            and len(offsets) == len(many)
            and all(0 <= o <= size - n for o, n in zip(offsets, scan.numels))
        )
        if not ok:
            raise _named(
                lambda: checks.check_copy_args(op, flat, flat_name, many, many_name, offsets),
                [(flat_name, flat), *_indexed(many_name, many)],
                op,
            )
        base, step = flat.data_ptr(), flat.element_size()
        flat_ptrs = array.array("Q", [base + int(o) * step for o in offsets])
        flat_types = array.array("i", [flat_scan.types[0]] * len(many))
        ins, outs = (scan.ptrs, _address(flat_ptrs)) if into_flat else (_address(flat_ptrs), scan.ptrs)
        in_types, out_types = (
            (scan.type_array, _address(flat_types)) if into_flat else (_address(flat_types), scan.type_array)
        )
        self._lib.ze_copy(ins, outs, scan.numel_array, in_types, out_types, len(many), float(scale), thread_count())

    def sum_squares_and_overflow(self, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> tuple[float, bool]:
        """(sum of (float(x) * scale)^2 over all elements in double, whether any element is inf/nan)."""
        scan = _Scan(tensors, DTYPE_CODES)
        if not scan.ok:
            raise _named(
                lambda: checks.check_overflow_args(tensors), _indexed("tensors", tensors), "sum_squares_and_overflow"
            )
        overflow = ctypes.c_int32(0)
        total = self._lib.ze_sum_squares_and_overflow(
            scan.ptrs,
            scan.numel_array,
            scan.type_array,
            len(tensors),
            float(scale),
            thread_count(),
            ctypes.byref(overflow),
        )
        return float(total), bool(overflow.value)

    def chunk_sum_squares(self, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> tuple[array.array[float], bool]:
        """The partial sums sum_squares_and_overflow adds in order (one per CHUNK elements of each tensor;
        none spans two), and whether any element is inf/nan."""
        scan = _Scan(tensors, DTYPE_CODES)
        if not scan.ok:
            raise _named(lambda: checks.check_overflow_args(tensors), _indexed("tensors", tensors), "chunk_sum_squares")
        sums = array.array("d", bytes(8 * sum(-(-t.numel() // CHUNK) for t in tensors)))
        overflow = self._lib.ze_chunk_sum_squares(
            scan.ptrs, scan.numel_array, scan.type_array, len(tensors), float(scale), thread_count(), _address(sums)
        )
        return sums, bool(overflow)

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
        """dst += float(src) * scale in place (float32 math, one rounding into dst): accumulate.accumulate."""
        ok = isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and dst.is_cpu and src.is_cpu
        if ok:
            try:
                checks.check_accumulate_args(dst, src)  # two tensors: the named check costs what a scan would
            except (TypeError, ValueError):
                ok = False
        if not ok:
            raise _named(lambda: checks.check_accumulate_args(dst, src), [("dst", dst), ("src", src)], "accumulate")
        self._lib.ze_accumulate(
            dst.data_ptr(),
            src.data_ptr(),
            dst.numel(),
            DTYPE_CODES[dst.dtype],
            DTYPE_CODES[src.dtype],
            float(scale),
            thread_count(),
        )

    def adam_step(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor],
        exp_avg_sqs: Sequence[torch.Tensor],
        lp_params: Sequence[torch.Tensor],
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw_mode: bool,
        step: int,
        bias_correction: bool,
        grad_scale: float,
    ) -> None:
        """One fused Adam/AdamW step of every tensor in place (adam.adam_step, whose checks of the lists and
        hyperparameters have run)."""
        lp_params = list(lp_params or [])
        scans = [_Scan(params, _FP32), _Scan(grads, DTYPE_CODES), _Scan(exp_avgs, _FP32), _Scan(exp_avg_sqs, _FP32)] + (
            [_Scan(lp_params, _LOW_PRECISION)] if lp_params else []
        )
        if not all(scan.ok and scan.numels == scans[0].numels for scan in scans):

            def check() -> None:
                tensors = checks.AdamTensors(params, grads, exp_avgs, exp_avg_sqs, lp_params)
                checks.check_lists(tensors)
                checks.check_tensors(tensors)

            named = [
                *_indexed("params", params),
                *_indexed("grads", grads),
                *_indexed("exp_avgs", exp_avgs),
                *_indexed("exp_avg_sqs", exp_avg_sqs),
                *_indexed("lp_params", lp_params),
            ]
            raise _named(check, named, "adam_step", runtime_error=False)
        # Written through raw pointers: bump the version counters as an in-place torch op would, so a
        # backward that saved one of these tensors fails loudly instead of using the new values.
        _increment_versions([*params, *exp_avgs, *exp_avg_sqs, *lp_params])
        lp = scans[4] if lp_params else None
        self._lib.ze_adam_step(
            scans[0].ptrs,
            scans[1].ptrs,
            scans[2].ptrs,
            scans[3].ptrs,
            lp.ptrs if lp else None,
            scans[0].numel_array,
            scans[1].type_array,
            lp.type_array if lp else None,
            len(params),
            float(lr),
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
            int(bool(adamw_mode)),
            int(step),
            int(bool(bias_correction)),
            float(grad_scale),
            thread_count(),
        )

    @property
    def library(self) -> ctypes.CDLL:
        """The loaded library (engine/ops/arena.py builds its compiled free list on it, engine/ops/aio.py its
        thread pool)."""
        return self._lib
