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

Compiled kernels are kept on disk (``kernel_cache_dir``: ``$OPTIMUM_DMX_KERNEL_CACHE``, else a folder in inductor's
cache directory) and loaded by later processes instead of traced and compiled again, which costs a process seconds
even when inductor's own cache holds the kernels' code (the CLI's default run: its first calibration step 5.7 s with
the kernels loaded against 8.1 s, `benchmarks/results/cli_default_run.md`). A stored kernel is keyed by
everything its code depends on (this package's source, torch's version, the device and its instruction set, the
constant arguments, dtypes and width), and its first call is checked like any other: a stored kernel that gives
other bits is deleted and compiled anew.

A kernel is the function traced into a graph (``make_fx``, over fake tensors whose first size is a symbol) and
compiled by inductor directly (``torch._inductor.standalone_compile``), not through ``torch.compile``: a call then
costs the kernel and a few microseconds, where ``torch.compile``'s frame evaluation, guards and wrappers cost tens
of microseconds on every call: more than the kernel itself on a small activation, and on a GPU time the device
waits.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import StatelessSymbolicContext

__all__ = [
    "COMPILE_ENV_VAR",
    "KERNEL_CACHE_ENV_VAR",
    "CompiledKernel",
    "compile_enabled",
    "kernel_cache_dir",
    "kernel_setup_seconds",
    "set_compile_enabled",
]

COMPILE_ENV_VAR = "OPTIMUM_DMX_COMPILE"
KERNEL_CACHE_ENV_VAR = "OPTIMUM_DMX_KERNEL_CACHE"
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
_setup_seconds = 0.0  # wall time of the kernels' first calls in this process (`kernel_setup_seconds`)


def compile_enabled() -> bool:
    """Whether the MX kernels are compiled: ``set_compile_enabled``'s setting, else ``$OPTIMUM_DMX_COMPILE``
    (compiled unless it is ``0``, ``false``, ``no`` or ``off``)."""
    if _enabled_override is not None:
        return _enabled_override
    return os.environ.get(COMPILE_ENV_VAR, "1").strip().lower() not in _FALSE_VALUES


def kernel_cache_dir() -> Path | None:
    """The folder where compiled kernels are kept between processes: ``$OPTIMUM_DMX_KERNEL_CACHE``, else
    ``optimum_dmx`` in inductor's cache directory (``$TORCHINDUCTOR_CACHE_DIR``, by default in the system's temporary
    folder), so that emptying inductor's cache empties it too; None (kernels are not kept) when the variable is
    ``0``, ``false``, ``no`` or ``off``."""
    value = os.environ.get(KERNEL_CACHE_ENV_VAR, "").strip()
    if value.lower() in _FALSE_VALUES:
        return None
    if value:
        return Path(value)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "optimum_dmx"


def kernel_setup_seconds() -> float:
    """Wall time this process has spent making compiled kernels ready: each kernel's first call, which compiles it
    (seconds on a machine whose inductor cache is cold, a fraction of one when warm) or loads the one an earlier
    process stored (milliseconds), and checks its result against the eager function. A cost paid once per kernel,
    which a calibration reports apart from its steps' and its scan's other work (`CalibrationResult.kernel_seconds`)."""
    return _setup_seconds


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

    `writes_into` names a tensor parameter that ``fn`` writes its main result into (``out.copy_(values)``) instead
    of returning it: the kernel then stores the values straight into that tensor, which may be rows of a larger one
    (a chunk of an activation's output), where a returned result would be copied there once more. It must be
    contiguous; the first call's check compares what both write there as well as what they return.
    """

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None, writes_into: str | None = None):
        self.fn = fn
        self.options = dict(options or {})
        parameters = list(inspect.signature(fn).parameters)
        if writes_into is not None and writes_into not in parameters:
            raise ValueError(f"{fn.__name__} has no parameter {writes_into!r} to write into; it has {parameters}")
        self._written = None if writes_into is None else parameters.index(writes_into)  # its position in a call
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
        if self._written is not None and not args[self._written].is_contiguous():
            raise ValueError(f"{self.fn.__name__} writes into a contiguous tensor only (a copy would lose the values)")
        # Kernels are compiled for contiguous tensors (a view, e.g. a slice of a wider activation, is copied first).
        args = tuple(arg.contiguous() if isinstance(arg, torch.Tensor) else arg for arg in args)
        key = tuple(map(_signature, args))
        kernel = self._kernels.get(key)  # one lookup per call: this runs once per quantized tensor
        try:
            return kernel(*args) if kernel is not None else self._timed_first_call(key, args)
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

    def _timed_first_call(self, key: tuple, args: tuple) -> Any:
        """`_first_call`, its wall time added to `kernel_setup_seconds()`."""
        global _setup_seconds
        start = time.perf_counter()
        try:
            return self._first_call(key, args)
        finally:
            _setup_seconds += time.perf_counter() - start

    def _first_call(self, key: tuple, args: tuple) -> Any:
        """The result for a new ``key``, which from now on runs a kernel stored or compiled for it if its result is
        the eager function's bit for bit (a stored kernel that differs is compiled anew), else the eager function
        (with one warning)."""
        options = {**inductor_options(args), **self.options}
        kernel = _stored_kernel(self.fn, args, options)
        expected = self._eager_result(args)
        result = self._kernel_result(kernel, args)
        if kernel.loaded and not _same_bits(result, expected):  # stored by another build or machine, or damaged
            kernel.discard()
            kernel = _stored_kernel(self.fn, args, options)
            result = self._kernel_result(kernel, args)
        if _same_bits(result, expected):
            self._kernels[key] = kernel
            return result if self._written is None else result[0]
        self._kernels[key] = self.fn
        if self._written is not None:  # the caller's tensor gets the eager values
            args[self._written].copy_(expected[1])
            expected = expected[0]
        warnings.warn(
            f"optimum-dmx: the compiled MX kernel {self.fn.__name__!r} gave other values than its eager reference "
            f"(inputs {[s for s in key if isinstance(s, tuple)]}, torch {torch.__version__}); this kernel runs "
            f"eagerly from now on, with correct results but more slowly. Set {COMPILE_ENV_VAR}=0 to skip compilation "
            "and this warning; an empty inductor cache (TORCHINDUCTOR_CACHE_DIR) may help if the instruction set "
            "changed since it was filled.",
            RuntimeWarning,
            stacklevel=4,
        )
        return expected

    def _kernel_result(self, kernel: Callable[..., Any], args: tuple) -> Any:
        """What `kernel` returns for `args`, with a copy of what it wrote (`writes_into`) when it writes."""
        returned = kernel(*args)
        return returned if self._written is None else (returned, args[self._written].clone())

    def _eager_result(self, args: tuple) -> Any:
        """What ``fn`` returns for `args`, with what it wrote (`writes_into`) when it writes, into a tensor of its own:
        the caller's is left to the kernel."""
        if self._written is None:
            return self.fn(*args)
        own = list(args)
        own[self._written] = torch.empty_like(args[self._written])
        return self.fn(*own), own[self._written]


def inductor_options(args: tuple) -> dict[str, Any]:
    """The inductor options of a kernel for ``args``: ``INDUCTOR_OPTIONS``, and on a GPU ``GPU_EAGER_NUMERICS``."""
    on_gpu = any(isinstance(arg, torch.Tensor) and arg.device.type != "cpu" for arg in args)
    if not on_gpu:
        return dict(INDUCTOR_OPTIONS)
    from torch._inductor import config as inductor_config  # imported when first needed, as in `_compile`

    known = inductor_config.get_config_copy()
    return {**INDUCTOR_OPTIONS, **{key: value for key, value in GPU_EAGER_NUMERICS.items() if key in known}}


class _Kernel:
    """A compiled kernel: inductor's artifact, called with the tensors among a call's arguments, and what its
    outputs stand for (inductor's graphs return tensors only: whether the function returns a tuple, and which of its
    outputs are None). `stored`: its files, when it is kept on disk; `loaded`: whether it came from them."""

    def __init__(self, artifact: Any, returns_tuple: bool, none_outputs: list[bool]):
        self.artifact, self.returns_tuple, self.none_outputs = artifact, returns_tuple, none_outputs
        self.stored: Path | None = None
        self.loaded = False

    def __call__(self, *call_args: Any) -> Any:
        tensors = iter(self.artifact(*[arg for arg in call_args if isinstance(arg, torch.Tensor)]))
        outputs = tuple(None if none else next(tensors) for none in self.none_outputs)
        return outputs if self.returns_tuple else outputs[0]

    def store(self, path: Path) -> None:
        """Write the kernel to ``path`` (its artifact) and ``path.json`` (its outputs), each replaced whole, the
        description last: a process that finds it finds the artifact complete. A kernel that cannot be stored only
        costs later processes a compilation."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
                self.artifact.save(path=os.path.join(scratch, "artifact"), format="binary")
                os.replace(os.path.join(scratch, "artifact"), path)
                description = os.path.join(scratch, "description")
                Path(description).write_text(json.dumps({"tuple": self.returns_tuple, "none": self.none_outputs}))
                os.replace(description, _description_path(path))
        except Exception:  # a folder that cannot be written, or an artifact that cannot be saved: not kept
            return
        self.stored = path

    @classmethod
    def load(cls, path: Path) -> _Kernel | None:
        """The kernel stored at ``path``, or None when there is none (or it cannot be read)."""
        from torch._inductor import CompiledArtifact

        try:
            described = json.loads(_description_path(path).read_text())
            kernel = cls(CompiledArtifact.load(path=str(path), format="binary"), described["tuple"], described["none"])
        except Exception:  # none stored, or damaged or unreadable: compiled anew (and stored over it)
            return None
        kernel.stored, kernel.loaded = path, True
        return kernel

    def discard(self) -> None:
        """Delete the kernel's files."""
        if self.stored is not None:
            for path in (self.stored, _description_path(self.stored)):
                path.unlink(missing_ok=True)


def _description_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _stored_kernel(fn: Callable[..., Any], args: tuple, options: dict[str, Any]) -> _Kernel:
    """The kernel of ``fn`` for arguments like ``args``: loaded from ``kernel_cache_dir()`` when a process stored
    it there, else compiled (``_compile``) and stored (where no path can be made for it, compiled only: storing
    kernels saves time and never decides whether one is compiled)."""
    try:
        path = _kernel_path(fn, args, options)
    except Exception:
        path = None
    kernel = None if path is None else _Kernel.load(path)
    if kernel is None:
        kernel = _compile(fn, args, options)
        if path is not None:
            kernel.store(path)
    return kernel


def _kernel_path(fn: Callable[..., Any], args: tuple, options: dict[str, Any]) -> Path | None:
    """Where ``fn``'s kernel for arguments like ``args`` is stored: a file named by the hash of everything the
    kernel's code depends on (``_build``, the function, its constant arguments and its tensors' dtypes, devices and
    widths, inductor's options). None when kernels are not kept, or an argument has no lasting description."""
    folder = kernel_cache_dir()
    devices = sorted({str(arg.device) for arg in args if isinstance(arg, torch.Tensor)})
    described = repr((fn.__module__, fn.__qualname__, tuple(map(_signature, args)), sorted(options.items())))
    if folder is None or " at 0x" in described:  # an object described by its address: never the same twice
        return None
    digest = hashlib.sha256(repr((described, [_build(device) for device in devices])).encode()).hexdigest()
    return folder / f"{fn.__name__}-{digest[:40]}"


@functools.cache
def _build(device: str) -> tuple:
    """What a kernel's code depends on besides its function and arguments: this package's source, torch's version
    and, for a CPU, the instruction set inductor writes for (``ATEN_CPU_CAPABILITY`` changes it, and inductor's own
    cache does not key on it); for a GPU, its name, compute capability and Triton's version."""
    package = Path(__file__).resolve().parents[1]
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    target: tuple = ()
    if device.startswith("cuda"):
        import triton

        target = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), triton.__version__)
    elif device == "cpu":
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        target = (torch.backends.cpu.get_cpu_capability(), str(pick_vec_isa()))
    return source.hexdigest(), torch.__version__, device, target


def _compile(fn: Callable[..., Any], args: tuple, options: dict[str, Any]) -> _Kernel:
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

    return _Kernel(artifact, returned["tuple"], returned["none"])


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
