"""The next-token choice of sparsekit's generate loop: Hugging Face's logits processors for the
options it supports, as pure functions of fixed-shape tensors (nothing grows with the
sequence, nothing waits for the GPU), and the pick (argmax or a draw).

Scores are float32 ``(batch, vocab)``. Per step, in HF's order: the repetition penalty (over
the tokens a sequence holds, its left padding excluded: HF >= 5.2x's
``RepetitionPenaltyLogitsProcessor(prompt_ignore_length=...)``), end-of-sequence tokens
barred while fewer than ``min_new_tokens`` tokens are new, then with sampling only:
temperature, top-k, top-p (each HF's warper, with its ``-inf`` filter value).

>>> import torch
>>> scores = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
>>> seen = torch.tensor([[True, True, False, False]])
>>> penalize(scores, seen, 2.0)
tensor([[ 1.0000, -2.0000,  0.5000,  0.0000]])
>>> top_k(scores, 2)
tensor([[2.0000,   -inf, 0.5000,   -inf]])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sparsekit.accel.decoding import Decoding

NEG_INF = float("-inf")


def seen_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(batch, vocab) bool: which tokens each row of ``ids`` holds where ``mask`` is nonzero."""
    # masked positions (and ids past the scores' vocabulary, which no score can penalize)
    # write to an extra column, dropped: a token at a padded position and at a real one both
    # set True, in any order
    seen = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.bool, device=ids.device)
    seen.scatter_(1, torch.where(mask.bool() & (ids < vocab), ids, vocab), True)
    return seen[:, :vocab]


def penalize(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty: a seen token's score divided by ``penalty`` when positive,
    multiplied when negative (the CTRL paper's rule)."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """HF's ``TopKLogitsWarper``: scores below the k-th largest set to -inf (ties kept)."""
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k)[0][..., -1, None]
    return scores.masked_fill(scores < kth, NEG_INF)


def top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """HF's ``TopPLogitsWarper``: the smallest set of top tokens whose probability reaches
    ``p`` is kept (at least one), the others set to -inf."""
    ascending, order = torch.sort(scores, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p)
    drop[..., -1:] = False
    return scores.masked_fill(drop.scatter(1, order, drop), NEG_INF)


def process(scores: torch.Tensor, *, seen: torch.Tensor | None, penalty: float,
            bar_eos: torch.Tensor | None, do_sample: bool, temperature: float, k: int,
            p: float) -> torch.Tensor:
    """One step's scores after HF's processors (see the module's docstring): ``seen`` the
    tokens each row holds (None: no penalty), ``bar_eos`` a (vocab,) bool of the
    end-of-sequence tokens to bar at this step (None: none barred)."""
    if seen is not None and penalty != 1.0:
        scores = penalize(scores, seen, penalty)
    if bar_eos is not None:
        scores = scores.masked_fill(bar_eos, NEG_INF)
    if do_sample:
        if temperature != 1.0:
            scores = scores / temperature
        if k:
            scores = top_k(scores, k)
        if p < 1.0:
            scores = top_p(scores, p)
    return scores


def pick(scores: torch.Tensor, do_sample: bool,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token per row, (batch,) int64: the highest score, or a draw from the softmax
    (``torch.multinomial``, as HF draws: with ``generator`` None, from torch's global
    generator, so a seed set by ``torch.manual_seed`` gives HF's draws)."""
    if not do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


class NextToken:
    """The token choice of one generate call, step after step: ``choose(logits, t)`` returns
    each sequence's token at step ``t`` (0: the prefill's), ``pad`` for a sequence that had
    ended, and keeps what the next steps need (the tokens each sequence holds for the
    repetition penalty, which sequences are unfinished). ``prompt``/``mask``: the padded
    prompt (batch, tokens) and its attention mask."""

    def __init__(self, opts: Decoding, prompt: torch.Tensor, mask: torch.Tensor, vocab: int):
        device = prompt.device
        self.opts = opts
        self.seen = seen_tokens(prompt, mask, vocab) if opts.repetition_penalty != 1.0 else None
        self.eos = torch.tensor(opts.eos, dtype=torch.long, device=device) if opts.eos else None
        self.bar = None  # the end-of-sequence tokens, barred for the first min_new_tokens
        if self.eos is not None and opts.min_new_tokens:
            self.bar = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.bar[self.eos[self.eos < vocab]] = True
        self.unfinished = torch.ones(prompt.shape[0], dtype=torch.bool, device=device)

    def __call__(self, logits: torch.Tensor, t: int) -> torch.Tensor:
        o = self.opts
        scores = process(logits.float(), seen=self.seen, penalty=o.repetition_penalty,
                         bar_eos=self.bar if t < o.min_new_tokens else None,
                         do_sample=o.do_sample, temperature=o.temperature, k=o.top_k, p=o.top_p)
        token = pick(scores, o.do_sample, o.generator)
        if self.eos is not None:
            token = torch.where(self.unfinished, token, o.pad)
            self.unfinished &= ~torch.isin(token, self.eos)
        if self.seen is not None:
            self.seen.scatter_(1, token[:, None], True)
        return token


__all__ = ["NextToken", "penalize", "pick", "process", "seen_tokens", "top_k", "top_p"]
