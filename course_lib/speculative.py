"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one forward.

Introduced in notebooks/18_serving_across_devices.ipynb. Decoding runs the large model once per
token, and each run is memory-bound: reading the weights costs the same for 1 token as for 5
(notebook 18's roofline). Leviathan et al. (2023) let a small *draft* model guess the next ``k``
tokens one by one; the *target* then scores all ``k`` in one forward and keeps the longest
prefix it agrees with, plus one token of its own. With the acceptance rule below the tokens are
distributed exactly as the target's own sampling would draw them:

* draft token ``x`` (drawn from the draft's ``q``) is kept with probability
  ``min(1, p(x) / q(x))``, ``p`` the target's distribution at that position;
* at the first rejection, a token is drawn from ``max(0, p - q)``, normalised, and the round
  ends; if all ``k`` are kept, one more is drawn from the target's next ``p``.

Greedy decoding is the case of one-hot ``p`` and ``q``: a draft token is kept when it is the
target's argmax, so the output is token for token the target's greedy output. With ``alpha``
the expected acceptance (``sum min(p, q)``), a round yields ``(1 - alpha^(k+1)) / (1 - alpha)``
tokens on average (:func:`expected_tokens`) for one target forward and ``k`` draft ones::

    tokens, stats = speculative_generate(target, draft, prompt, 100, k=4)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from course_lib import gpu
from course_lib.decoding import Decoder


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` normalised: where to draw from after a rejection (the mass the target
    gives beyond the draft's). Introduced in notebooks/18_serving_across_devices.ipynb."""
    r = (p - q).clamp(min=0)
    return r / r.sum(-1, keepdim=True)


def accept(p: torch.Tensor, q: torch.Tensor, token: torch.Tensor | int,
           u: torch.Tensor | float) -> torch.Tensor | bool:
    """Whether draft ``token`` is kept, ``u`` uniform in [0, 1): ``u < p(x) / q(x)``, written
    ``u q(x) < p(x)`` (``q(x) > 0``: the draft drew it). Works on rows of ``p``, ``q`` with a
    token and a ``u`` per row. Introduced in notebooks/18_serving_across_devices.ipynb."""
    if isinstance(token, int):
        return bool(u * q[token] < p[token])
    picked = token[:, None]
    return u * q.gather(-1, picked)[:, 0] < p.gather(-1, picked)[:, 0]


def one_step(p: torch.Tensor, q: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` tokens, each from one proposal of the draft ``q`` checked against the target ``p``
    (accepted, or replaced by a draw from :func:`residual`): by the rule, they are distributed
    as ``p``. Introduced in notebooks/18_serving_across_devices.ipynb."""
    gen = torch.Generator().manual_seed(seed)
    proposed = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=gen)[:, 0]
    u = torch.rand(n, generator=gen)
    kept = accept(p.expand(n, -1), q.expand(n, -1), proposed, u)
    fallback = torch.multinomial(residual(p, q), n, replacement=True, generator=gen)
    return torch.where(kept, proposed, fallback)


def distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)``, or the one-hot of the argmax at temperature 0.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    if temperature == 0:
        return nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)


def expected_tokens(alpha: float | np.ndarray, k: int) -> float | np.ndarray:
    """Tokens a round yields on average when each draft token is accepted with probability
    ``alpha``: ``(1 - alpha^(k+1)) / (1 - alpha)`` (Leviathan et al., eq. 1).
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    alpha = np.asarray(alpha, dtype=float)
    return np.where(alpha < 1, (1 - alpha ** (k + 1)) / np.maximum(1 - alpha, 1e-12), k + 1.0)


def expected_speedup(alpha: float | np.ndarray, k: int, cost: float,
                     verify: float = 1.0) -> float | np.ndarray:
    """Speed-up over decoding with the target alone when a draft forward costs ``cost`` target
    forwards and the target's forward over ``k + 1`` tokens costs ``verify`` (1 in Leviathan et
    al.: a memory-bound forward costs the same for 1 token as for k + 1):
    ``expected_tokens / (k cost + verify)``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    return expected_tokens(alpha, k) / (k * cost + verify)


def feed_seconds(model: nn.Module | NGramDraft, prompt: torch.Tensor, n_tokens: int = 1,
                 repeats: int = 20) -> float:
    """Median seconds for ``model`` (a transformer with its cache, or an n-gram draft) to take
    ``n_tokens`` more tokens after ``prompt`` ``(1, T0)``: what a forward costs in a round.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    decoder = model if isinstance(model, NGramDraft) else Decoder(model)
    decoder.truncate(0)
    decoder.feed(prompt)
    new = prompt[:, -n_tokens:]

    def forward():
        decoder.feed(new)
        decoder.truncate(prompt.shape[-1])
    return gpu.timed(forward, repeats, device="cpu")


class NGramDraft:
    """A draft with no network: the next token's counts after the previous ``n - 1`` tokens in
    ``data``, add-one smoothed (Leviathan et al. try a bigram draft too). Offers what a
    :class:`decoding.Decoder` offers: ``feed``, ``truncate``, ``length``.
    Introduced in notebooks/18_serving_across_devices.ipynb."""

    def __init__(self, data: np.ndarray, n: int = 2, vocab_size: int = 256) -> None:
        if n < 2:
            raise ValueError(f"n={n}: an n-gram draft looks at n - 1 >= 1 tokens")
        self.n, self.vocab_size, self.seen = n, vocab_size, []
        keys = np.zeros(len(data) - n + 1, dtype=np.int64)
        for i in range(n - 1):  # the previous n - 1 tokens, as one number
            keys = keys * vocab_size + data[i:len(data) - n + 1 + i]
        counts: dict[int, np.ndarray] = {}
        for key, nxt in zip(keys.tolist(), data[n - 1:].tolist(), strict=True):
            counts.setdefault(key, np.ones(vocab_size))[nxt] += 1
        self.log_probs = {key: torch.from_numpy(np.log(c / c.sum())).float()
                          for key, c in counts.items()}
        self.unseen = torch.full((vocab_size,), -float(np.log(vocab_size)))

    @property
    def length(self) -> int:
        return len(self.seen)

    def feed(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (log-probabilities) after each of ``idx`` ``(1, t)``: ``(1, t, vocab)``."""
        out = []
        for token in idx[0].tolist():
            self.seen.append(token)
            key = 0
            for t in self.seen[-(self.n - 1):]:
                key = key * self.vocab_size + t
            short = len(self.seen) < self.n - 1
            out.append(self.unseen if short else self.log_probs.get(key, self.unseen))
        return torch.stack(out)[None]

    def truncate(self, length: int) -> None:
        del self.seen[length:]


def verify(p: torch.Tensor, q: torch.Tensor, proposed: Sequence[int],
           gen: torch.Generator) -> tuple[int, int]:
    """One round's check: ``p`` ``(k + 1, vocab)`` the target's distributions after the last
    kept token and after each proposal, ``q`` ``(k, vocab)`` the draft's for each proposal.
    Returns how many proposals are kept (up to the first rejection) and the token the target
    adds. Introduced in notebooks/18_serving_across_devices.ipynb."""
    k = len(proposed)
    if k:
        kept = accept(p[:k], q, torch.tensor(proposed), torch.rand(k, generator=gen))
        rejected = (~kept).nonzero()
        if len(rejected):
            i = int(rejected[0])
            return i, int(torch.multinomial(residual(p[i], q[i]), 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


@torch.no_grad()
def speculative_generate(target: nn.Module, draft: nn.Module | NGramDraft,
                         prompt: torch.Tensor, n_tokens: int, k: int = 4,
                         temperature: float = 0.0, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """``prompt`` ``(1, T0)`` and ``n_tokens`` more, each round ``k`` draft proposals checked by
    one target forward. Returns the tokens ``(1, T0 + n_tokens)`` and counts: target forwards
    (``rounds``), draft forwards, proposals, accepted, and ``alpha``, the mean of
    ``sum min(p, q)`` over the checked positions.
    Introduced in notebooks/18_serving_across_devices.ipynb."""
    if prompt.shape[-1] + n_tokens > target.cfg.context:
        raise ValueError(f"{prompt.shape[-1]} + {n_tokens} tokens exceed the target's context "
                         f"{target.cfg.context}")
    gen = torch.Generator().manual_seed(seed)
    checker = Decoder(target)
    if isinstance(draft, NGramDraft):
        draft.truncate(0)  # a fresh history: it has seen nothing of this prompt
        drafter = draft
    else:
        drafter = Decoder(draft)
    tokens, end = prompt[0].tolist(), prompt.shape[-1] + n_tokens
    stats = {"rounds": 0, "draft_forwards": 0, "proposed": 0, "accepted": 0, "overlap": []}
    # both have seen every token but the last kept one at the start of a round
    if prompt.shape[-1] > 1:
        checker.feed(prompt[:, :-1])
    while len(tokens) < end:
        k_now = min(k, end - len(tokens) - 1)  # the last token of the budget: the target's
        proposed, q, pending = [], [], tokens[drafter.length:]
        for _ in range(k_now):  # the draft guesses, one token at a time
            logits = drafter.feed(torch.tensor(pending)[None])[0, -1]
            q.append(distribution(logits, temperature))
            proposed.append(int(torch.multinomial(q[-1], 1, generator=gen)))
            pending = proposed[-1:]
        logits = checker.feed(torch.tensor(tokens[checker.length:] + proposed)[None])[0]
        p = distribution(logits[-(k_now + 1):], temperature)  # one forward checks them all
        q = torch.stack(q) if q else p[:0]
        kept, extra = verify(p, q, proposed, gen)
        checked = min(kept + 1, k_now)  # the positions the rule looked at
        stats["overlap"] += torch.minimum(p[:checked], q[:checked]).sum(-1).tolist()
        tokens += proposed[:kept] + [extra]
        checker.truncate(len(tokens) - 1)
        drafter.truncate(min(drafter.length, len(tokens) - 1))
        stats["rounds"] += 1
        stats["draft_forwards"] += k_now
        stats["proposed"] += k_now
        stats["accepted"] += kept
    overlap = stats.pop("overlap")
    stats["alpha"] = sum(overlap) / max(1, len(overlap))
    return torch.tensor(tokens)[None], stats
