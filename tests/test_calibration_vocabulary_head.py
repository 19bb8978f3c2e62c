"""The KL scan's divergence from the vocabulary's head and a second-order tail (`calibration.vocabulary_head`),
against torch's `F.kl_div` over the whole vocabulary, and in the scan."""

from contextlib import contextmanager

import pytest
import torch
from scipy.stats import spearmanr
from torch.nn import functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM

from optimum_dmx.calibration import CalibrationSettings, kl_sensitivities
from optimum_dmx.calibration.vocabulary_head import VocabularyHeadReference

from .helpers import sensitive_llama_and_data


def exact_kl(hidden, shifted, weight, bias):
    """`sum KL(p || q)` over the positions, by `F.kl_div` in float64 over every token."""
    p = F.linear(hidden.double(), weight.double(), bias.double()).log_softmax(-1)
    q = F.linear(shifted.double(), weight.double(), bias.double()).log_softmax(-1)
    return F.kl_div(q, p, log_target=True, reduction="sum").item()


def embedding_and_hidden(positions=40, scale=2.0, vocab=300, width=16):
    """An output embedding and final hidden states; the larger `scale`, the more peaked the distributions."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, width, generator=generator)
    bias = torch.randn(vocab, generator=generator)
    hidden = scale * torch.randn(positions, width, generator=generator)
    direction = torch.randn(positions, width, generator=generator)
    return weight, bias, hidden, direction


def test_with_the_whole_vocabulary_as_head_it_is_the_kl_divergence():
    weight, bias, hidden, direction = embedding_and_hidden()
    reference = VocabularyHeadReference.from_hidden(hidden, weight, bias, head_tokens=300)
    assert reference.head_rows.shape == (300, 16) and torch.isneginf(reference.tail_log_mass).all()
    for scale in [1e-2, 1e-1, 1.0]:
        shifted = hidden + scale * direction
        # float32 rounding: about 1e-8 per position against divergences of 1e-4 (at 1e-2) to 1 per position
        assert reference.kl(shifted).item() == pytest.approx(exact_kl(hidden, shifted, weight, bias), rel=1e-3)
    assert abs(reference.kl(hidden).item()) < 1e-3 * exact_kl(hidden, hidden + 1e-2 * direction, weight, bias)


def test_weighted_positions_sum_each_positions_divergence_times_its_weight():
    """`kl(hidden, weights)`: each position's divergence (the whole vocabulary as head: exact) times its weight."""
    weight, bias, hidden, direction = embedding_and_hidden()
    reference = VocabularyHeadReference.from_hidden(hidden, weight, bias, head_tokens=300)
    shifted = hidden + 0.1 * direction
    weights = torch.rand(len(hidden), generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    exact = sum(w.item() * exact_kl(hidden[i : i + 1], shifted[i : i + 1], weight, bias) for i, w in enumerate(weights))
    assert reference.kl(shifted, weights).item() == pytest.approx(exact, rel=1e-3)
    assert reference.kl(shifted, torch.ones_like(weights)).item() == pytest.approx(reference.kl(shifted).item())


def test_the_tail_is_exact_to_second_order_at_one_position():
    """At one position the pooled tail covariance is that position's: the error is third order in the shift, so
    the relative error falls with it; without the covariance term it does not."""
    weight, bias, hidden, direction = embedding_and_hidden(positions=1, scale=0.3)
    reference = VocabularyHeadReference.from_hidden(hidden, weight, bias, head_tokens=30)
    tail_mass = reference.tail_log_mass.exp().item()
    assert 0.05 < tail_mass < 0.95  # the tail matters
    first_order = VocabularyHeadReference(**{**vars(reference), "tail_covariance": 0 * reference.tail_covariance})
    errors, first_order_errors = [], []
    for scale in [1e-1, 1e-2]:
        shifted = hidden + scale * direction
        exact = exact_kl(hidden, shifted, weight, bias)
        errors.append(abs(reference.kl(shifted).item() / exact - 1))
        first_order_errors.append(abs(first_order.kl(shifted).item() / exact - 1))
    assert errors[1] < errors[0] / 5 and errors[1] < 1e-2
    assert min(first_order_errors) > 10 * errors[1]


def test_over_many_positions_the_pooled_tail_stays_close():
    weight, bias, hidden, direction = embedding_and_hidden(positions=200, scale=0.3)
    reference = VocabularyHeadReference.from_hidden(hidden, weight, bias, head_tokens=60)
    for scale in [1e-2, 1e-1]:
        shifted = hidden + scale * direction
        assert reference.kl(shifted).item() == pytest.approx(exact_kl(hidden, shifted, weight, bias), rel=0.05)


@pytest.fixture(scope="module")
def sensitive():
    model, ids = sensitive_llama_and_data()
    return model, ids[:4]


@contextmanager
def counting_forwards(module):
    """The forward passes `module` computes within the block (a forward installed on the instance, as
    accelerate's hooks install theirs)."""
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        return type(module).forward(module, *args, **kwargs)

    module.forward = forward
    try:
        yield calls
    finally:
        del module.forward


def test_the_scan_skips_the_output_embedding_and_gives_the_whole_vocabularys_divergences(sensitive):
    model, ids = sensitive
    settings = CalibrationSettings(batch_size=4)
    with counting_forwards(model.lm_head) as calls:
        whole = kl_sensitivities(model, ids, settings, progress=False, head_tokens=None, matmul_dtype=torch.float32)
    assert len(calls) == 1 + len(whole)  # the reference pass and one per layer
    with counting_forwards(model.lm_head) as calls:  # 128 tokens: the head is the vocabulary
        headed = kl_sensitivities(model, ids, settings, progress=False, matmul_dtype=torch.float32)
    assert len(calls) == 1  # only the reference pass runs it
    assert headed == pytest.approx(whole, rel=1e-5)


def test_a_small_head_ranks_the_layers_as_the_whole_vocabulary(sensitive):
    model, ids = sensitive
    settings = CalibrationSettings(batch_size=4)
    whole = kl_sensitivities(model, ids, settings, progress=False, head_tokens=None)
    headed = kl_sensitivities(model, ids, settings, progress=False, head_tokens=16)  # of 128
    names = list(whole)
    assert spearmanr([whole[n] for n in names], [headed[n] for n in names]).statistic > 0.99
    assert headed == pytest.approx(whole, rel=0.1)
    assert headed != pytest.approx(whole, rel=1e-5)  # the tail is approximated


def test_soft_capped_logits_are_scanned_over_the_whole_vocabulary():
    """Gemma 2 caps its logits after the output embedding: the divergence cannot come from the embedding's input,
    so the scan computes it from the model's logits, as without a head."""
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, final_logit_softcapping=2.0, initializer_range=0.2,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    settings = CalibrationSettings(batch_size=4)
    with counting_forwards(model.lm_head) as calls:
        headed = kl_sensitivities(model, ids, settings, progress=False)
    assert len(calls) == 1 + len(headed)
    assert headed == kl_sensitivities(model, ids, settings, progress=False, head_tokens=None)


@pytest.mark.parametrize("bias", [False, True])
def test_under_bfloat16_products_the_whole_vocabularys_divergences_are_those_of_the_head_over_it(bias):
    """In a bfloat16 scan a pass's logits are the reference's float32 logits plus the bfloat16 product of the final
    hidden states' shift, the `dz` of the divergence on the vocabulary's head: over the whole vocabulary both give the
    same values. An output embedding with a bias multiplies in float32 instead (the bias would round with the shift's
    product): the same values, within the head's bfloat16 `dz`. (With the logits rounded to bfloat16 whole, each pass
    anew, this model's values were up to 2.0% off the head's without a bias, 1.5% with one.)"""
    model, ids = sensitive_llama_and_data()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # larger logits, as a trained model's: the rounding of whole logits grows with them
        embedding = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=bias)
        embedding.weight.copy_(4 * model.lm_head.weight)
        if bias:
            embedding.bias.normal_(0, 2.0, generator=generator)
    model.lm_head = embedding
    settings = CalibrationSettings(batch_size=4)
    bfloat16 = dict(progress=False, matmul_dtype=torch.bfloat16)
    whole = kl_sensitivities(model, ids[:4], settings, head_tokens=None, **bfloat16)
    headed = kl_sensitivities(model, ids[:4], settings, head_tokens=model.config.vocab_size, **bfloat16)
    assert whole == pytest.approx(headed, rel=5e-3)


def test_a_pause_of_autocast_around_the_output_embedding_by_another_hook_nests_with_the_scans(sensitive):
    """A user's hooks that pause autocast while the output embedding runs (registered before the scan's own) end
    their pause after the scan's: the scan's other products stay in bfloat16, its values those of a float32
    embedding's shift."""
    model, ids = sensitive
    paused = []

    def pause(module, args):
        paused.append(torch.is_autocast_enabled("cpu"))
        torch.set_autocast_enabled("cpu", False)

    def resume(module, args, output):
        torch.set_autocast_enabled("cpu", paused.pop())

    settings = CalibrationSettings(batch_size=4)
    bfloat16 = dict(progress=False, head_tokens=None, matmul_dtype=torch.bfloat16)
    handles = [model.lm_head.register_forward_pre_hook(pause), model.lm_head.register_forward_hook(resume)]
    try:
        hooked = kl_sensitivities(model, ids, settings, **bfloat16)
    finally:
        for handle in handles:
            handle.remove()
    assert not paused
    assert hooked == pytest.approx(kl_sensitivities(model, ids, settings, **bfloat16), rel=5e-3)


@pytest.mark.parametrize("head_tokens", [60, 300])
def test_the_heads_products_in_bfloat16_keep_the_divergence_of_float32(head_tokens):
    """With the head's `dz` multiplied in bfloat16 both sums of the divergence read the same rounded `dz`: against
    the exact divergence it is within 0.2% of the float32 products' error, down to shifts whose divergence is 1e-5
    per position, and 0 unshifted."""
    weight, bias, hidden, direction = embedding_and_hidden(positions=40, scale=0.3)
    single = VocabularyHeadReference.from_hidden(hidden, weight, bias, head_tokens)
    half = VocabularyHeadReference.from_hidden(hidden, weight, bias, head_tokens, product_dtype=torch.bfloat16)
    assert half.head_rows.dtype == torch.bfloat16
    assert torch.equal(half.head_rows, single.head_rows.bfloat16())
    for scale in [1e-3, 1e-2, 1e-1]:
        shifted = hidden + scale * direction
        exact = exact_kl(hidden, shifted, weight, bias)
        assert exact / 40 > 7e-6
        assert abs(half.kl(shifted).item() / exact - 1) < abs(single.kl(shifted).item() / exact - 1) + 2e-3
    assert half.kl(hidden).item() == pytest.approx(0, abs=1e-6)
