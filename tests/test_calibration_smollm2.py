"""End-to-end checks on the real SmolLM2-135M benchmark model and texts (slow; both are fetched and cached by
`benchmarks/common.py` on first use)."""

import functools
import json

import pytest
import torch

from optimum_dmx.calibration import (
    CalibrationSettings,
    PaperRecipe,
    build_calibration_batches,
    calibrate,
    uniform_format_map,
)
from optimum_dmx.evaluation import evaluate_perplexity
from optimum_dmx.nn import emulate_format_map

from .helpers import REPO_ROOT, held_out

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(bench):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = bench.benchmark_model()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def texts(bench):
    return bench.benchmark_texts()


@pytest.mark.parametrize(
    "fmt, reference, rel", [(None, 27.05, 1e-3), ("mxfp8_e4m3", 28.65, 1e-2), ("mxfp4_e2m1", 101.35, 1e-2)]
)
def test_reproduces_the_reference_perplexities(smollm2, texts, fmt, reference, rel):
    """The data README's numbers: 4,096 tokens of Pride and Prejudice from 10% in, 512-token windows.

    Float matches to the printed digits; with `quantize_mx` emulation all-MXFP4 gives 102.13 (0.8% above
    the README's 101.35, whose quantizer is not documented), hence the 1% tolerance for quantized rows.
    """
    model, tokenizer = smollm2
    format_map = uniform_format_map(model, fmt, ["lm_head"]) if fmt else {}
    with emulate_format_map(model, format_map):
        result = evaluate_perplexity(model, tokenizer, held_out(texts, "pride_prejudice"), 512, 4096, 4)
    assert result.perplexity == pytest.approx(reference, rel=rel)


def test_short_paper_calibration_on_austen_raises_offsets_below_the_target(smollm2, texts):
    model, tokenizer = smollm2
    ids = build_calibration_batches(texts.calibration, tokenizer, seq_len=128, num_samples=16, seed=0)
    settings = CalibrationSettings(
        method="paper",
        target_bits=5.0,
        num_samples=16,
        seq_len=128,
        batch_size=2,
        steps=6,
        paper=PaperRecipe(t_warmup_ratio=1.0),
    )
    result = calibrate(model, ids, settings, progress=False)
    assert len(result.format_map) == 210
    # All layers start in MXFP4 (4.07 bits at T = 8), below the target: the task loss raises the offsets.
    offsets = torch.tensor(list(result.beta_hat.values()))
    assert offsets.mean() > 0 and offsets.max() > 0.2


@pytest.fixture
def one_thread():
    """torch on one thread for the test, as its fixture was made: the thread count changes float reduction order,
    and so the result (with two threads this run's map differed from the fixture's in 8 layers on the machine that
    made it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# How far another CPU's float arithmetic may move the 0.1.0.dev0 regression run below, per pair: (layers of 210 whose
# format may differ, largest offset difference). Measured on an AMD EPYC (AVX-512 BF16) against the fixture: MXFP8
# pair 8 layers and 0.035, MXFP6 pair none and 2e-7; on an AMD EPYC with AVX2 only, MXFP6 pair at most 2 layers and
# 0.00176 (the MXFP8 pair within its bound); the same run with `seed=1` on the first CPU (a one-off run, not a test)
# differs from the fixture by 14 layers and 0.12, 8 layers and 0.026, beyond both bounds.
MOVED_BY_ANOTHER_CPU = {"mxfp8-mxfp4": (12, 0.08), "mxfp6-mxfp4": (2, 3e-3)}


@pytest.mark.parametrize("pair, target", [("mxfp8-mxfp4", 5.0), ("mxfp6-mxfp4", 4.5)])
def test_short_default_calibration_on_austen_lands_on_the_budget(smollm2, texts, one_thread, monkeypatch, pair, target):
    from optimum_dmx.calibration import sensitivity, trainer

    # the scan of 0.1.0.dev0 read its sequences whole, in float32; it now reads their first half (`KL_POSITIONS`),
    # later positions weighing more, in bfloat16 where the CPU multiplies it natively, and the map moves with each
    # (`research/README.md`): the old scan here, so that the rest of the method is what is compared
    old_scan = functools.partial(sensitivity.kl_sensitivities, positions=1.0, matmul_dtype=torch.float32)
    monkeypatch.setattr(trainer, "kl_sensitivities", old_scan)
    model, tokenizer = smollm2
    ids = build_calibration_batches(texts.calibration, tokenizer, seq_len=128, num_samples=40, seed=0)
    settings = CalibrationSettings(  # the 0.1.0.dev0 default budget: per layer
        format_pair=pair, target_bits=target, num_samples=40, seq_len=128, batch_size=2, steps=20, bit_average="simple"
    )
    result = calibrate(model, ids, settings, progress=False)
    assert target - 0.05 <= result.bits_simple <= target + 0.05
    # Every layer was probed at its low format at least once, so every offset is a measured value.
    assert all(torch.isfinite(torch.tensor(list(result.beta_hat.values()))))
    # The map, offsets and bits of the default recipe of optimum-dmx 0.1.0.dev0 (commit 1a46da0) on one torch thread:
    # bit for bit on the machine that made the fixture. On another CPU the matrix products add in another order, and
    # the MXFP8 pair's 20 steps of maps sampled at the budget carry that on about as far as another seed would; so the
    # check is agreement within what another CPU was measured to move (`MOVED_BY_ANOTHER_CPU`).
    reference = json.loads((REPO_ROOT / "tests" / "fixtures" / "smollm2_short_default_calibration.json").read_text())
    wanted = reference[pair]
    assert set(result.format_map) == set(wanted["format_map"])
    flipped = [name for name in wanted["format_map"] if result.format_map[name] != wanted["format_map"][name]]
    moved = max(abs(result.beta_hat[name] - beta) for name, beta in wanted["beta_hat"].items())
    most_flipped, most_moved = MOVED_BY_ANOTHER_CPU[pair]
    assert len(flipped) <= most_flipped, flipped
    assert moved <= most_moved
