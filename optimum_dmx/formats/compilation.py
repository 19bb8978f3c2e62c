"""Compiled MX kernels: ``torch.compile`` (inductor: C++ on CPU, Triton on GPU) with the eager path as fallback.

The MX casts are chains of cheap element-wise operations and one block reduction. Run eagerly, each operation is
a pass over memory; compiled, the chain fuses into one kernel that reads each block once and writes it once. The
eager functions stay the reference: a compiled kernel is the same function, so its results are bit-identical
(tested).

Compilation is on by default. It is skipped, and the eager function runs instead, when:

* the environment variable ``OPTIMUM_DMX_COMPILE`` is ``0`` (or ``set_compile_enabled(False)`` was called);
* the caller is itself being traced by ``torch.compile`` (the outer compilation then fuses the kernel itself);
* compiling any kernel failed once in this process (no C++ compiler, no Triton, an unsupported device): one
  warning says so and every later call of every kernel runs eagerly, with the same results, more slowly.

Each kernel's first call also runs the eager function on the same arguments and compares the results bit for bit
(once per kernel: its cost is one eager call). A compiler that gets a kernel wrong (inductor's AVX2 code once
selected the wrong side of an integer ``where``; a kernel cached for one instruction set and loaded under another)
thus never yields a wrong value: that kernel runs eagerly from then on, with one warning that names it.

A kernel function also returns its per-block tensors (the block scales or shared exponents), which its callers
drop: these *block outputs* make inductor compute them once per block, vectorised across blocks, and store them,
where an intermediate would be inlined into every vector of elements that reads it, recomputing its few dozen
scalar operations for each (without block outputs the casts take about 1.4x and the continuous quantizer's kernels
6-14x as long on activations that fit in cache: benchmarks/README.md, "Block outputs"). Storing a value instead of
recomputing it changes no bit of the results.

Each set of constant arguments (format, block size, scale rule) with each input dtype, device and row width gets
a kernel of its own, with the number of rows (tokens) left dynamic: a calibration step, a last short batch or a
generation loop with a growing sequence reuses the kernel of its layer width instead of recompiling, and a model's
many formats, widths and dtypes never reach ``torch.compile``'s recompilation limit. (A kernel with every size
dynamic would need no width key, but the inductor C++ backend then stops vectorising it: 3-4x slower.) A key of
single rows (a token being generated) has only static sizes: its kernel is traced and compiled by inductor directly
(``_compile_single_row``), without ``torch.compile``'s frame evaluation and guards, which cost more than such a
kernel on every call.
"""

from __future__ import annotations

import functools
import os
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch._inductor import config as inductor_config

try:  # torch >= 2.8
    from torch._inductor import standalone_compile as _standalone_compile
except ImportError:
    _standalone_compile = None

__all__ = ["COMPILE_ENV_VAR", "CompiledKernel", "compile_enabled", "set_compile_enabled"]

COMPILE_ENV_VAR = "OPTIMUM_DMX_COMPILE"
# Inductor keeps an intermediate read more than `realize_reads_threshold` (default 4) times in a buffer. Inside one
# fused kernel that becomes a per-block local buffer, and boolean ones (the continuous quantizer's subnormal and
# saturation masks, read by both of its derivatives) are stored element by element: several times slower than
# recomputing them where they are read (tests/test_compilation.py measures it). The values are the same either way
# (the same operations, no reductions).
INDUCTOR_OPTIONS = {"realize_reads_threshold": 64}
_FALSE_VALUES = ("0", "false", "no", "off")
_SAME_SIZE_INTEGER = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_enabled_override: bool | None = None
_compilation_failed = False  # set by the first failure of any kernel: a missing compiler fails them all


def compile_enabled() -> bool:
    """Whether the MX kernels are compiled: ``set_compile_enabled``'s setting, else ``$OPTIMUM_DMX_COMPILE``
    (compiled unless it is ``0``, ``false``, ``no`` or ``off``)."""
    if _enabled_override is not None:
        return _enabled_override
    return os.environ.get(COMPILE_ENV_VAR, "1").strip().lower() not in _FALSE_VALUES


def set_compile_enabled(enabled: bool | None) -> None:
    """Turn compiled MX kernels on or off for this process (``None``: follow ``$OPTIMUM_DMX_COMPILE`` again)."""
    global _enabled_override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_compile_enabled takes True, False or None, got {enabled!r}.")
    _enabled_override = enabled


class CompiledKernel:
    """``fn`` run through ``torch.compile`` when compilation is enabled and works here, else run eagerly.

    ``fn`` must be free of host synchronisation (no ``.item()``, no data-dependent Python branches) so that it
    compiles into one graph; its arguments other than tensors (formats, block sizes) are compile-time
    constants and must be hashable. Tensors' first dimension (rows, tokens) is dynamic; the other sizes are part
    of the kernel's key.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._kernels: dict[tuple, Callable[..., Any]] = {}
        self._checked: set[tuple] = set()  # keys whose kernel matched the eager function on its first call
        self._rejected: set[tuple] = set()  # keys whose kernel did not: they run eagerly
        functools.update_wrapper(self, fn)

    @property
    def active(self) -> bool:
        """Whether a call now would run a compiled kernel."""
        return compile_enabled() and not _compilation_failed and not torch.compiler.is_compiling()

    @property
    def compiled_variants(self) -> int:
        """How many kernels were compiled (one per constant arguments and tensor dtypes, devices and widths)."""
        return len(self._kernels)

    @property
    def rejected_variants(self) -> int:
        """How many compiled kernels gave other bits than the eager function on their first call (they run eagerly)."""
        return len(self._rejected)

    def _kernel(self, key: tuple, args: tuple) -> Callable[..., Any]:
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = self._compile(args)
        return kernel

    def _compile(self, args: tuple) -> Callable[..., Any]:
        """A kernel for the key of ``args``: compiled by inductor directly where all its sizes are static (single
        rows), else by ``torch.compile`` with the rows dynamic."""
        if _single_row(args) and _standalone_compile is not None:
            return _compile_single_row(self.fn, args)
        # A copy of fn's code object per key, under a name of its own: torch.compile keeps its cache and
        # recompilation limit per code object, and its shape history per code name, so each key compiles once
        # with its own static sizes and never evicts or generalises another key's kernel.
        name = f"{self.fn.__name__}_{len(self._kernels)}"
        names = {"co_name": name, **({"co_qualname": name} if sys.version_info >= (3, 11) else {})}
        code = self.fn.__code__.replace(**names)
        copy = types.FunctionType(code, self.fn.__globals__, name, self.fn.__defaults__)
        return torch.compile(copy, options=INDUCTOR_OPTIONS)

    def __call__(self, *args: Any) -> Any:
        if not self.active:
            return self.fn(*args)
        key = tuple(_signature(arg) for arg in args)
        if key in self._rejected:
            return self.fn(*args)
        try:
            kernel = self._kernel(key, args)
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] > 1:
                    torch._dynamo.mark_dynamic(arg, 0)  # the rows (tokens): one kernel for every count
            result = kernel(*args)
        except Exception as error:  # a missing compiler or backend must never break quantization
            global _compilation_failed
            _compilation_failed = True
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warnings.warn(
                f"optimum-dmx: torch.compile could not build the MX kernel {self.fn.__name__!r} "
                f"({type(error).__name__}: {message}); it runs eagerly from now on, with identical results but "
                f"more slowly. Set {COMPILE_ENV_VAR}=0 to skip compilation and this warning.",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args)
        if key not in self._checked:
            return self._checked_result(key, result, args)
        return result

    def _checked_result(self, key: tuple, result: Any, args: tuple) -> Any:
        """The eager result where the kernel's first result differs from it (and the key rejected), else ``result``."""
        expected = self.fn(*args)
        if _same_bits(result, expected):
            self._checked.add(key)
            return result
        self._rejected.add(key)
        warnings.warn(
            f"optimum-dmx: the compiled MX kernel {self.fn.__name__!r} gave other values than its eager reference "
            f"(inputs {[s for s in key if isinstance(s, tuple)]}, torch {torch.__version__}); this kernel runs "
            f"eagerly from now on, with correct results but more slowly. Set {COMPILE_ENV_VAR}=0 to skip compilation "
            "and this warning; an empty inductor cache (TORCHINDUCTOR_CACHE_DIR) may help if the instruction set "
            "changed since it was filled.",
            RuntimeWarning,
            stacklevel=3,
        )
        return expected


def _single_row(args: tuple) -> bool:
    """Whether every tensor argument is 0-dim or has exactly one row: a key's sizes are then all static (a kernel's
    key tells one row from any other count, ``_signature``)."""
    return all(arg.dim() == 0 or arg.shape[0] == 1 for arg in args if isinstance(arg, torch.Tensor))


def _compile_single_row(fn: Callable[..., Any], args: tuple) -> Callable[..., Any]:
    """``fn`` for arguments of ``args``' sizes, traced into a graph and compiled by inductor directly.

    A call then skips ``torch.compile``'s frame evaluation and guards, which cost more than the kernel itself on
    one row (a token being generated: benchmarks/README.md, "Inference"). The sizes are static, so only single-row
    keys get such a kernel; the other arguments than tensors are constants of the graph, as in ``torch.compile``.
    """
    positions = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
    constants = [None if isinstance(arg, torch.Tensor) else arg for arg in args]

    def of_tensors(*tensors: torch.Tensor) -> Any:
        full = list(constants)
        for position, tensor in zip(positions, tensors):
            full[position] = tensor
        return fn(*full)

    examples = [args[i] for i in positions]
    graph = make_fx(of_tensors)(*examples)
    with inductor_config.patch(INDUCTOR_OPTIONS):
        artifact = _standalone_compile(graph, examples, dynamic_shapes="from_example_inputs")

    def kernel(*call_args: Any) -> Any:
        result = artifact(*[call_args[i] for i in positions])
        return tuple(result) if isinstance(result, list) else result

    return kernel


def _same_bits(a: Any, b: Any) -> bool:
    """Whether two kernel results (tensors, or tuples of them) hold the same values bit for bit (any NaN equal to
    any NaN: its payload is not part of a format)."""
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor):
        return a == b
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    with torch.no_grad():
        a_nan, b_nan = a.isnan(), b.isnan()
        bits = _SAME_SIZE_INTEGER[a.element_size()]  # compares -0.0 and 0.0 as different, as they are
        return torch.equal(a_nan, b_nan) and torch.equal(a.masked_fill(a_nan, 0).view(bits),
                                                         b.masked_fill(b_nan, 0).view(bits))


def _signature(arg: Any) -> Any:
    """What a kernel is specialised on: a tensor's dtype, device and sizes after the first, and which sizes of it
    (or of the tensor it views) are 1 (torch.compile specialises a size of 1); any other argument's value."""
    if isinstance(arg, torch.Tensor):
        viewed = arg if arg._base is None else arg._base
        return (arg.dtype, arg.device, tuple(arg.shape[1:]), tuple(size == 1 for size in (*arg.shape, *viewed.shape)))
    return arg
