"""Shared fixtures: one torch thread, tiny random float checkpoints saved as real safetensors, a local Hub server.

Helper functions (models, tokenizers, tensors, subprocesses) are in helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .helpers import tiny_llama, word_tokenizer, words

DEFAULT_SUITE_TEST_TIMEOUT_S = 900  # the longest default-suite test takes a few minutes on two busy cores


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A default-suite test that runs past 15 minutes has hung (a lock never released, a subprocess never answering):
    pytest-timeout fails it with every thread's stack, so the run ends with the cause instead of at CI's limit. Slow
    tests (a long calibration on a real model) are left unbounded."""
    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_SUITE_TEST_TIMEOUT_S))


@pytest.fixture(autouse=True, scope="session")
def single_thread():
    """Tiny models run much faster on one thread, especially on a shared machine; results do not depend on
    the machine's core count (the float reduction order changes with the number of threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def eager_kernels_unless_a_test_compiles():
    """The tests (and the subprocesses they start) run the eager MX functions, the reference that every compiled
    kernel is checked against, unless a test asks for compiled kernels (the `compiled` fixture, or
    `OPTIMUM_DMX_COMPILE=1` in a subprocess's environment). Compiling is the suite's largest cost on a machine whose
    inductor cache is empty (a few seconds of C++ compilation per kernel, and each format, dtype and layer width
    has one): `test_compilation.py` checks the kernels bit for bit against the eager functions, from single casts to
    a whole calibration and its model. Compiled kernels are not stored between processes either (`formats.compilation`):
    what a test of the kernels checks does not depend on what the machine ran before, and the tests of stored kernels
    name their folders themselves."""
    from optimum_dmx.formats.compilation import COMPILE_ENV_VAR, KERNEL_CACHE_ENV_VAR

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(COMPILE_ENV_VAR, "0")
        patch.setenv(KERNEL_CACHE_ENV_VAR, "0")
        yield


@pytest.fixture(autouse=True, scope="session")
def own_torch_extensions_folder(tmp_path_factory):
    """amd-quark compiles a C++ extension when it is first imported (`torch.utils.cpp_extension.load`, about 6 s),
    by default into the user's `~/.cache/torch_extensions`, under a lock file that a process killed mid-build leaves
    behind: every later import then waits on it forever (a CI run hung on one left by an interrupted run). Each test
    process (and the subprocesses it starts) builds into a folder of its own run instead, so no earlier run, and
    nothing the user keeps in their cache, can stall the suite or be rewritten by it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path_factory.mktemp("torch_extensions")))
        yield


@pytest.fixture(scope="session")
def bench():
    """The benchmarks' asset module (the SmolLM2-135M benchmark model and texts, fetched and cached on first use),
    loaded from its file: for the slow tests on the real model."""
    import importlib.util
    import sys

    from .helpers import REPO_ROOT

    spec = importlib.util.spec_from_file_location("benchmark_common", REPO_ROOT / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def compiled():
    """Compilation of the MX kernels on for the test (whatever the environment says), back to the environment's
    setting after."""
    from optimum_dmx.formats import set_compile_enabled

    set_compile_enabled(True)
    yield
    set_compile_enabled(None)


def _save_tiny(model_cls, config, path: Path) -> Path:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """Float Llama checkpoint whose linears all have in_features a multiple of 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return _save_tiny(LlamaForCausalLM, config, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """Float Qwen3 checkpoint with in_features 48 and 80: not multiples of the MX block size."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return _save_tiny(Qwen3ForCausalLM, config, tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture
def local_hub():
    """A Hub API server on 127.0.0.1 (see `hf_hub_server.py`)."""
    from .hf_hub_server import LocalHub

    with LocalHub() as hub:
        yield hub


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved with a real (word-level) tokenizer, plus `calibration.txt` and `heldout.txt` beside it.

    What a user points the CLI and the examples at, only small: `<root>/model`, `<root>/calibration.txt`,
    `<root>/heldout.txt`.
    """
    root = tmp_path_factory.mktemp("tiny-text-model")
    tiny_llama(seed=0).to(torch.bfloat16).save_pretrained(root / "model")  # stored in bf16, like most LLMs
    word_tokenizer().save_pretrained(root / "model")
    (root / "calibration.txt").write_text("\n".join(words(7 * i, 40) for i in range(60)))
    (root / "heldout.txt").write_text("\n".join(words(11 * i + 3, 40) for i in range(30)))
    return root
