"""Small real models and tokenizers for the calibration and evaluation tests (built in-process, offline)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def tiny_llama(seed: int = 0, initializer_range: float = 0.02, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama with 14 decoder linears (hidden 64, vocab 128)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        initializer_range=initializer_range,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def sensitive_llama_and_data(num_samples: int = 16, seq_len: int = 32):
    """A tiny Llama with large weights and its own greedy continuations as data.

    The float model predicts this data well and quantization hurts it, so the task loss prefers more bits.
    """
    model = tiny_llama(seed=0, initializer_range=0.2)
    start = torch.randint(0, model.config.vocab_size, (num_samples, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ids = model.generate(
            start, max_new_tokens=seq_len - 1, min_new_tokens=seq_len - 1, do_sample=False, pad_token_id=0
        )
    return model, ids


def word_tokenizer(num_words: int = 120) -> PreTrainedTokenizerFast:
    """A whitespace word tokenizer over the words `w0 .. w{num_words-1}`: one token per word."""
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(num_words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def words(start: int, count: int, num_words: int = 120) -> str:
    """`count` consecutive words of the `word_tokenizer` vocabulary, cycling, as one line."""
    return " ".join(f"w{(start + i) % num_words}" for i in range(count))


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models run much faster on one thread, especially on a shared machine (import into a test module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
