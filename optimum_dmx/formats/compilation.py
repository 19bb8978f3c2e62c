"""Compiled MX kernels: inductor (C++ on CPU, Triton on GPU) with the eager path as fallback.

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
(once per kernel: its cost is one eager call). A compiler that gets a kernel wrong (for example a kernel cached for
one instruction set and loaded under another) thus never yields a wrong value: that kernel runs eagerly from then
on, with one warning that names it.

A kernel function also returns its per-block tensors (the block scales or shared exponents), which its callers
drop: these *block outputs* make inductor compute them once per block, vectorised across blocks, and store them,
where an intermediate would be inlined into every vector of elements that reads it, recomputing its few dozen
scalar operations for each (without block outputs the casts take about 1.4x and the continuous quantizer's kernels
several times as long on activations that fit in cache). Storing a value instead of recomputing it changes no bit of
the results.

Each set of constant arguments (format, block size, scale rule) with each input dtype, device and row width gets
a kernel of its own, with the number of rows (tokens) left symbolic: a calibration step, a last short batch or a
generation loop with a growing sequence reuses the kernel of its layer width instead of recompiling. The width is
static in the compiled graph, not only in the key: inductor's on-disk cache keys a graph by its operations, which
are the same for every width, so a graph with a symbolic width could be served a kernel specialised on another
width. Keys of zero or one row (a token being generated) get kernels with static sizes.

A kernel is the function traced into a graph (``make_fx``, over fake tensors whose first size is a symbol) and
compiled by inductor directly (``torch._inductor.standalone_compile``), not through ``torch.compile``: a call then
costs the kernel and a few microseconds, where ``torch.compile``'s frame evaluation, guards and wrappers cost tens
of microseconds on every call: more than the kernel itself on a small activation, and on a GPU time the device
waits.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import StatelessSymbolicContext

__all__ = ["COMPILE_ENV_VAR", "CompiledKernel", "compile_enabled", "set_compile_enabled"]

COMPILE_ENV_VAR = "OPTIMUM_DMX_COMPILE"
# Inductor keeps an intermediate read more than `realize_reads_threshold` (default 4) times in a buffer. Inside one
# fused kernel that becomes a per-block local buffer, and boolean ones (the continuous quantizer's subnormal and
# saturation masks, read by both of its derivatives) are stored element by element: with the default, the gradient
# kernel took about 8x the values kernel, several times what recomputing the masks where they are read costs
# (tests/test_compilation.py bounds it). The values are the same either way (the same operations, no reductions).
INDUCTOR_OPTIONS = {"realize_reads_threshold": 64}
# On a GPU, inductor's Triton code by default divides approximately (`div.full`) and contracts a multiply and an add
# into one fused multiply-add: either moves a result by an ulp away from eager PyTorch's (the continuous quantizer's
# gradients, where `q / v` and `dm + de * s * ln2` meet both). These options make it round as eager does (IEEE
# division; no contraction, which `emulate_precision_casts` turns off along with keeping eager's bfloat16 roundings).
# The C++ backend needs neither. Options this torch lacks are left out.
GPU_EAGER_NUMERICS = {"eager_numerics.division_rounding": True, "emulate_precision_casts": True}
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
    """``fn`` compiled by inductor when compilation is enabled and works here, else run eagerly.

    ``fn`` must be free of host synchronisation (no ``.item()``, no data-dependent Python branches) so that it
    traces into one graph; its arguments other than tensors (formats, block sizes) are compile-time constants and
    must be hashable. Tensors of two or more dimensions have their rows (tokens) first: their row count is
    symbolic, their other sizes are part of the kernel's key, as are 0- and 1-dim tensors' sizes. `options`:
    inductor options of this kernel, added to `INDUCTOR_OPTIONS`.
    """

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None):
        self.fn = fn
        self.options = dict(options or {})
        # key -> what runs for it: the compiled kernel once its first call matched the eager function, else `fn`
        self._kernels: dict[tuple, Callable[..., Any]] = {}
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
        return sum(kernel is self.fn for kernel in self._kernels.values())

    def __call__(self, *args: Any) -> Any:
        if not self.active:
            return self.fn(*args)
        # Kernels are compiled for contiguous tensors (a view, e.g. a slice of a wider activation, is copied first).
        args = tuple(arg.contiguous() if isinstance(arg, torch.Tensor) else arg for arg in args)
        key = tuple(map(_signature, args))
        kernel = self._kernels.get(key)  # one lookup per call: this runs once per quantized tensor
        first_call = kernel is None
        try:
            if first_call:
                kernel = _compile(self.fn, args, {**inductor_options(args), **self.options})
            result = kernel(*args)
        except Exception as error:  # a missing compiler or backend must never break quantization
            global _compilation_failed
            _compilation_failed = True
            message = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warnings.warn(
                f"optimum-dmx: inductor could not build the MX kernel {self.fn.__name__!r} "
                f"({type(error).__name__}: {message}); it runs eagerly from now on, with identical results but "
                f"more slowly. Set {COMPILE_ENV_VAR}=0 to skip compilation and this warning.",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args)
        if first_call:
            return self._checked_result(key, kernel, result, args)
        return result

    def _checked_result(self, key: tuple, kernel: Callable[..., Any], result: Any, args: tuple) -> Any:
        """A new kernel's first result, checked: ``key`` keeps ``kernel`` if ``result`` equals the eager function's
        bit for bit; otherwise it keeps the eager function (with one warning), and its result is returned."""
        expected = self.fn(*args)
        if _same_bits(result, expected):
            self._kernels[key] = kernel
            return result
        self._kernels[key] = self.fn
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


def inductor_options(args: tuple) -> dict[str, Any]:
    """The inductor options of a kernel for ``args``: ``INDUCTOR_OPTIONS``, and on a GPU ``GPU_EAGER_NUMERICS``."""
    on_gpu = any(isinstance(arg, torch.Tensor) and arg.device.type != "cpu" for arg in args)
    if not on_gpu:
        return dict(INDUCTOR_OPTIONS)
    from torch._inductor import config as inductor_config  # imported when first needed, as in `_compile`

    known = inductor_config.get_config_copy()
    return {**INDUCTOR_OPTIONS, **{key: value for key, value in GPU_EAGER_NUMERICS.items() if key in known}}


def _compile(fn: Callable[..., Any], args: tuple, options: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` for arguments like ``args``, traced into a graph and compiled by inductor with ``options``.

    The tensors are traced as fake tensors whose row count is a symbol when it is 2 or more (0 or 1 stays static,
    as its key says), so one kernel serves every row count of its key. The other arguments than tensors are
    constants of the graph.
    """
    # The tracer and inductor are imported when a first kernel is compiled, not with the package: their imports take
    # about a second, which a process that compiles nothing (`--help`, eager runs) does not pay.
    from torch._inductor import config as inductor_config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    try:
        from torch._inductor import standalone_compile
    except ImportError:  # compiling then fails once, with the warning, and every kernel runs eagerly
        raise RuntimeError(
            f"torch {torch.__version__} has no torch._inductor.standalone_compile (torch >= 2.8 has)"
        ) from None
    positions = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
    constants = [None if isinstance(arg, torch.Tensor) else arg for arg in args]
    returned: dict[str, Any] = {}  # what fn returns besides tensors: inductor's graphs return tensors only

    def of_tensors(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        full = list(constants)
        for position, tensor in zip(positions, tensors):
            full[position] = tensor
        outputs = fn(*full)
        returned["tuple"] = isinstance(outputs, tuple)
        outputs = outputs if returned["tuple"] else (outputs,)
        returned["none"] = [output is None for output in outputs]
        return tuple(output for output in outputs if output is not None)

    # Copies, never views: traced from a view of a caller's tensor, AOT autograd may treat the input as aliased and,
    # with torch's stricter aliasing checks on (as when `$CI` is set), inductor then built a kernel returning garbage.
    examples = [args[i].clone() for i in positions]
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(example, symbolic_context=_rows_symbolic(example)) for example in examples]
    with fake_mode:
        graph = make_fx(of_tensors)(*fakes)
    _mark_fake_mode(graph)
    with inductor_config.patch(options):
        artifact = standalone_compile(graph, examples, dynamic_shapes="from_graph")

    def kernel(*call_args: Any) -> Any:
        tensors = iter(artifact(*[call_args[i] for i in positions]))
        outputs = tuple(None if none else next(tensors) for none in returned["none"])
        return outputs if returned["tuple"] else outputs[0]

    return kernel


def _mark_fake_mode(graph: torch.fx.GraphModule) -> None:
    """Tag ``graph``'s outputs with their fake tensors as ``example_value``, where ``standalone_compile``'s
    "from_graph" looks for the fake mode (and so the sizes, symbolic or static) the graph was traced with. ``make_fx``
    records them as ``val`` only; untagged, inductor fakifies the examples afresh with every size symbolic."""
    output = next(node for node in reversed(graph.graph.nodes) if node.op == "output")
    for node in output.args[0]:
        if isinstance(node, torch.fx.Node) and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def _has_rows(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s first size is a row count its kernel leaves symbolic: it has two or more dimensions
    (rows first) and two or more rows. 0- and 1-dim tensors (format parameters, code tables) are static."""
    return tensor.dim() >= 2 and tensor.shape[0] >= 2


def _rows_symbolic(tensor: torch.Tensor) -> StatelessSymbolicContext:
    """Fake-tensor sizes for tracing: the row count symbolic (``_has_rows``), every other size static."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    sizes = [DimDynamic.STATIC] * tensor.dim()
    if _has_rows(tensor):
        sizes[0] = DimDynamic.DYNAMIC
    return StatelessSymbolicContext(dynamic_sizes=sizes, constraint_sizes=[None] * tensor.dim())


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
        return torch.equal(a_nan, b_nan) and torch.equal(
            a.masked_fill(a_nan, 0).view(bits), b.masked_fill(b_nan, 0).view(bits)
        )


def _signature(arg: Any) -> Any:
    """What a kernel is specialised on: a (contiguous) tensor's dtype, device and sizes, of a tensor with rows
    (two or more dimensions) only whether it has 0, 1 or more rows (a kernel keeps 0 and 1 static); any other
    argument's value."""
    if isinstance(arg, torch.Tensor):
        if arg.dim() >= 2:
            return (arg.dtype, arg.device, min(arg.shape[0], 2), tuple(arg.shape[1:]))
        return (arg.dtype, arg.device, tuple(arg.shape))
    return arg
