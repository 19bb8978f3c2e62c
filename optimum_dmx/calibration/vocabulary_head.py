"""KL divergence between next-token distributions from the vocabulary's head and a second-order tail.

The KL scan (`calibration.sensitivity`) measures, per layer, `KL(p || q)` between the float model's next-token
distribution `p` and the distribution `q` with that layer alone in the low format, at every position of a few
sequences. Over the whole vocabulary, each of its passes multiplies by the full output embedding and normalises
over every token: on SmolLM2-135M (49,152 tokens, hidden size 576) about a third of the scan.

Both distributions come from final hidden states through the same output embedding (`z = W h + b`), so with
`dh = h' - h` and `dz = W dh`:

    KL(p || q) = log sum_v p_v exp(dz_v) - sum_v p_v dz_v

Both sums are split between the *head*, the `head_tokens` tokens with the most reference probability over the
scanned positions, summed exactly, and the *tail*, every other token. The tail's `log sum_tail p_v exp(dz_v)` is
taken to second order in `dh`: `log a + mu . dh + 1/2 dh^T C dh`, with `a` the position's tail mass and `mu` the
mean of its tail's rows of `W` (both exact per position) and `C` the covariance of the tail's rows, pooled over the
positions (one `d x d` matrix); its share of the second sum is `a mu . dh`. A pass then multiplies `dh` by
`head_tokens` rows of `W` instead of all of them, and never normalises over the vocabulary. When the head is the
whole vocabulary the result is the exact divergence.

The head's `dz` may be a product in bfloat16 (`product_dtype`, as the scan's other products): both sums read the
same rounded `dz`, so their first-order terms still cancel and the result is the divergence of the rounded
perturbation, within a fraction of a percent of the float32 one. (Rounding `dz` in the first sum only leaves an
error of first order in `dh`, which grows against the divergence as the shift shrinks.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

HEAD_TOKENS = 8192  # on SmolLM2-135M: 3% tail mass, ranking 0.9999 against the whole vocabulary's
_BLOCK_ELEMENTS = 2**22  # float64 logits per block of positions while building a reference (32 MiB)


@dataclass(frozen=True)
class VocabularyHeadReference:
    """What `kl` needs from the float model's pass, per position (`[positions, ...]`, float32).

    Attributes:
        hidden: the final hidden states (the output embedding's input), `[positions, hidden]`.
        head_rows: the head tokens' rows of the output embedding, `[head, hidden]`, in the dtype of `kl`'s product
            with them.
        head_log_probs: the head tokens' reference log-probabilities, `[positions, head]`.
        head_probabilities: their exponentials (every `kl` reads them).
        log_total: the log of the stored head probabilities plus the tail mass (0 up to rounding): subtracted in
            `kl` so that the stored log-probabilities' rounding cancels instead of adding a bias.
        tail_log_mass: `log a`, the log probability of the tokens outside the head (`-inf` when there are none).
        tail_mean_row: `mu`, the tail tokens' rows averaged by their probabilities.
        tail_covariance: `C`, the tail rows' covariance pooled over the positions (weighted by tail mass).
    """

    hidden: torch.Tensor
    head_rows: torch.Tensor
    head_log_probs: torch.Tensor
    head_probabilities: torch.Tensor
    log_total: torch.Tensor
    tail_log_mass: torch.Tensor
    tail_mean_row: torch.Tensor
    tail_covariance: torch.Tensor

    @classmethod
    @torch.no_grad()
    def from_hidden(
        cls,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head_tokens: int = HEAD_TOKENS,
        product_dtype: torch.dtype = torch.float32,
    ) -> VocabularyHeadReference:
        """The reference for final hidden states `hidden` (`[..., hidden]`) under the output embedding `weight`
        (`[vocab, hidden]`) and `bias`, a block of positions at a time. The logits are normalised in float64: in
        float32 the log-probabilities' rounding is of the order of the smallest divergences. `product_dtype`: the
        dtype of `kl`'s products with the head's rows (bfloat16 where the scan multiplies in it)."""
        weight = weight.detach().float()  # a float32 copy of a bfloat16 embedding, for the length of this call
        vocab = weight.shape[0]
        hidden = hidden.reshape(-1, hidden.shape[-1]).to(weight)
        bias = None if bias is None else bias.detach().float()
        rows = max(1, _BLOCK_ELEMENTS // vocab)
        blocks = [slice(start, start + rows) for start in range(0, len(hidden), rows)]

        def log_probs(block: slice) -> torch.Tensor:
            return F.linear(hidden[block], weight, bias).double().log_softmax(-1)

        token_mass = sum(log_probs(block).exp().sum(0) for block in blocks)
        head = token_mass.topk(min(head_tokens, vocab)).indices.sort().values
        in_tail = torch.ones(vocab, device=weight.device)
        in_tail[head] = 0

        head_log_probs, tail_masses, tail_means = [], [], []
        for block in blocks:
            block_log_probs = log_probs(block)
            tail_probabilities = block_log_probs.exp().float() * in_tail
            tail_mass = tail_probabilities.sum(-1)
            head_log_probs.append(block_log_probs[:, head].float())
            tail_masses.append(tail_mass)
            tail_means.append((tail_probabilities @ weight) / tail_mass.clamp_min(1e-30).unsqueeze(-1))
        head_log_probs, tail_mass, tail_mean = torch.cat(head_log_probs), torch.cat(tail_masses), torch.cat(tail_means)
        tail_log_mass = tail_mass.log()  # -inf where the head is the whole vocabulary
        covariance = torch.zeros(weight.shape[1], weight.shape[1], device=weight.device)
        if tail_mass.sum() > 0:
            second_moment = _weighted_gram(weight, token_mass.float() * in_tail)
            covariance = (second_moment - (tail_mean.T * tail_mass) @ tail_mean) / tail_mass.sum()
        return cls(
            hidden=hidden,
            head_rows=weight[head].to(product_dtype).contiguous(),
            head_log_probs=head_log_probs,
            head_probabilities=head_log_probs.exp(),
            log_total=torch.logaddexp(head_log_probs.logsumexp(-1), tail_log_mass),
            tail_log_mass=tail_log_mass,
            tail_mean_row=tail_mean,
            tail_covariance=covariance,
        )

    @torch.no_grad()
    def kl(self, hidden: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """`sum KL(p_reference || q)` over every position (float64), `q` the distribution of final hidden states
        `hidden` (the shape of the reference's); with `weights` (float64, one per position, in the order of the
        flattened leading dimensions), each position's divergence times its weight."""
        shift = hidden.reshape(self.hidden.shape).to(self.hidden) - self.hidden
        head_shift = (shift.to(self.head_rows.dtype) @ self.head_rows.T).float()  # the head's dz
        tail_shift = (shift * self.tail_mean_row).sum(-1)  # mu . dh
        head = (self.head_log_probs + head_shift).logsumexp(-1)
        tail = self.tail_log_mass + tail_shift + 0.5 * ((shift @ self.tail_covariance) * shift).sum(-1)
        mean_shift = (self.head_probabilities * head_shift).sum(-1) + self.tail_log_mass.exp() * tail_shift
        divergences = (torch.logaddexp(head, tail) - self.log_total - mean_shift).double()
        return divergences.sum() if weights is None else divergences @ weights


def _weighted_gram(weight: torch.Tensor, weights: torch.Tensor, rows: int = 8192) -> torch.Tensor:
    """`sum_v weights_v w_v w_v^T` over the rows `w_v` of `weight`, a block of rows at a time (no copy of it whole)."""
    gram = torch.zeros(weight.shape[1], weight.shape[1], device=weight.device)
    for block, block_weights in zip(weight.split(rows), weights.split(rows)):
        gram += block.T @ (block * block_weights.unsqueeze(-1))
    return gram
