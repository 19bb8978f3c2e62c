import math

import pytest
import torch
from torch.nn import functional as F

from optimum_dmx.evaluation import evaluate_perplexity

from .helpers import tiny_llama, word_tokenizer, words

TEXT = words(0, 100) + "\n" + words(7, 60)  # 160 tokens


@pytest.fixture(scope="module")
def setup():
    return tiny_llama(initializer_range=0.2), word_tokenizer()


def manual_perplexity(model, tokenizer, text, seq_len, max_tokens=None):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    nll, count = 0.0, 0
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        window = torch.tensor([ids[start : start + seq_len]])
        with torch.no_grad():
            logits = model(window).logits
        nll += F.cross_entropy(logits[0, :-1], window[0, 1:], reduction="sum").item()
        count += seq_len - 1
    return math.exp(nll / count), count


def test_matches_a_manual_computation_and_reports_the_protocol(setup):
    model, tokenizer = setup
    result = evaluate_perplexity(model, tokenizer, TEXT, seq_len=32)
    expected, predicted = manual_perplexity(model, tokenizer, TEXT, 32)
    assert result.perplexity == pytest.approx(expected, rel=1e-5)
    assert (result.windows, result.tokens, result.predicted_tokens, result.seq_len) == (5, 160, predicted, 32)
    assert result.nll == pytest.approx(math.log(result.perplexity))
    assert result.protocol == "160 tokens, 5 non-overlapping windows of 32, no start token"
    assert "5 non-overlapping windows of 32" in str(result) and result.to_dict()["windows"] == 5


def test_max_tokens_partial_window_and_batching(setup):
    model, tokenizer = setup
    limited = evaluate_perplexity(model, tokenizer, TEXT, seq_len=50, max_tokens=120)
    assert (limited.windows, limited.tokens) == (2, 100)  # the trailing 20 tokens are dropped
    assert limited.perplexity == pytest.approx(manual_perplexity(model, tokenizer, TEXT, 50, 120)[0], rel=1e-5)
    batched = evaluate_perplexity(model, tokenizer, TEXT, seq_len=32, batch_size=3)
    assert batched.perplexity == pytest.approx(
        evaluate_perplexity(model, tokenizer, TEXT, seq_len=32).perplexity, rel=1e-5
    )


def test_restores_training_mode(setup):
    model, tokenizer = setup
    model.train()
    evaluate_perplexity(model, tokenizer, TEXT, seq_len=32)
    assert model.training
    model.eval()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(text=""), ValueError, "non-empty"),
        (dict(text=TEXT, seq_len=1), ValueError, "seq_len=1"),
        (dict(text=TEXT, seq_len=500), ValueError, "160 tokens.*seq_len=500"),
        (dict(text=TEXT, seq_len=32, max_tokens=10), ValueError, "max_tokens=10"),
        (dict(text=TEXT, batch_size=0), ValueError, "batch_size=0"),
    ],
)
def test_errors(setup, kwargs, error, message):
    model, tokenizer = setup
    with pytest.raises(error, match=message):
        evaluate_perplexity(model, tokenizer, **kwargs)


def test_windows_start_with_the_tokenizers_bos_and_the_protocol_says_so():
    model, tokenizer = tiny_llama(initializer_range=0.2), word_tokenizer(bos=True)
    bos = tokenizer.bos_token_id
    model.resize_token_embeddings(bos + 1)
    result = evaluate_perplexity(model, tokenizer, TEXT, seq_len=32)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    nll = 0.0
    for start in range(0, 5 * 31, 31):  # 160 text tokens -> 5 windows of BOS + 31 tokens
        window = torch.tensor([[bos, *ids[start : start + 31]]])
        with torch.no_grad():
            nll += F.cross_entropy(model(window).logits[0, :-1], window[0, 1:], reduction="sum").item()
    assert result.windows == 5 and result.predicted_tokens == 5 * 31 and result.start_tokens == (bos,)
    assert result.perplexity == pytest.approx(math.exp(nll / (5 * 31)), rel=1e-5)
    assert result.protocol == f"160 tokens, 5 non-overlapping windows of 32, each starting with token(s) [{bos}]"
