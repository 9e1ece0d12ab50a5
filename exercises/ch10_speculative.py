"""Chapter 10 exercises: speculative decoding's acceptance rule, and when it pays.

Notebook 10 (the FAQ lab, question on speculative decoding) runs
`minillm/generation/speculative.py`: a small draft model proposes k tokens, the target
scores all of them in one forward, and a rule decides how many to keep. Greedy decoding
keeps a proposal when it is the target's argmax; sampling needs a rule that keeps the
target's distribution intact. Here you write both rules, the rollback of the KV cache
past the rejected proposals, and the arithmetic that says when the trick is worth it:

    greedy_verify              keep proposals while each is the target's argmax, then
                               the target's own token (a correction, or a bonus)
    rollback_kv                cut every layer's cached K/V back to the committed tokens
    accept_or_resample         keep proposal i with probability min(1, p/q), else
                               resample from max(0, p - q): output ~ the target's p
    expected_tokens_per_round  tokens per target forward at acceptance rate a
    speculative_speedup        the speed-up once the draft's own cost is paid

Replace each `raise NotImplementedError(...)` with your code, in plain torch/Python.
Grade them with

    make grade CH=10    # = MINILLM_IMPL=exercises pytest tests/exercises -k ch10

and one exercise with `-k "ch10 and accept"`. The notebook grades `greedy_verify` and
`rollback_kv` in place: `check("ch10.greedy_verify", greedy_verify)`. The answers are in
`solutions/ch10_speculative.py`: try first.
"""

from __future__ import annotations

import torch


def greedy_verify(target_logits: torch.Tensor, proposal: list[int]) -> tuple[int, int]:
    """Greedy verification: (proposals kept, the token that follows them).

    The draft proposed k tokens; the target ran once over the last committed token and the
    k proposals, so its logits have k + 1 rows: row i is its prediction for the place of
    proposal[i], and row k the prediction after the last proposal. Greedy decoding of the
    target would emit argmax(row 0), then argmax(row 1) if that was proposal[0], and so on.
    So keep proposal[i] while it equals the argmax of row i; at the first mismatch stop,
    and the next token is the argmax of that row (the target's correction). If all k are
    kept, row k is still unused: its argmax is a free extra token (the bonus).

    The output is then exactly the target's greedy output, whatever the draft proposed:
    the test decodes with your function and compares with plain greedy decoding.

    Args:
        target_logits: [k + 1, vocab], the target's logits at the k + 1 places.
        proposal: k token ids (k >= 0; k = 0 is a plain decode step).

    Returns:
        (kept, next_token): 0 <= kept <= k, and the token emitted after the kept ones.

    Pitfalls: the proposals after the first mismatch are never checked (the target saw them
    after a wrong token: its rows there predict the continuation of a text that will not
    exist); the bonus row is row k, not row k - 1.
    """
    raise NotImplementedError("ch10: implement greedy_verify")


def rollback_kv(
    cache: list[tuple[torch.Tensor, torch.Tensor]], length: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forget every cached token from position `length` on: the rejected proposals.

    The target's forward over the k proposals wrote their keys and values into its cache,
    and so did the draft while proposing. After verification only `length` tokens are
    committed; the K/V of the rejected ones must go, or the next round attends to tokens
    that are not in the text (and places the new ones at the wrong positions). This cache
    is Hugging Face's layout (a list, one (K, V) pair per layer, each
    [batch, kv_heads, tokens, head_dim], grown by concatenation); `DynamicCache.crop` does
    this job there, and minillm's fixed-slot `KVCache` just lowers its count of cached
    tokens (`_Runner.keep` in minillm/generation/speculative.py).

    Args:
        cache: per layer (K, V), each [batch, kv_heads, tokens, head_dim].
        length: tokens to keep, >= 0. A cache holding `length` tokens or fewer is returned
            unchanged (the draft's cache may lag one token behind the target's).

    Returns:
        The cache with every layer's K and V holding min(tokens, length) tokens.

    Pitfalls: the token axis is 2 (axis 1 is the kv heads); cut K *and* V of *every* layer;
    raise ValueError for a negative length (Python's slicing would silently drop from the
    end instead).
    """
    raise NotImplementedError("ch10: implement rollback_kv")


def accept_or_resample(
    p: torch.Tensor,
    q: torch.Tensor,
    proposal: list[int],
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling's acceptance rule: (proposals kept, the token that follows them).

    The draft proposed k tokens, proposal[i] drawn from its distribution q[i]; the
    target, in one forward, gave its own distributions p[0..k]: p[i] is the target's
    distribution for the position of proposal[i], and p[k] the one after the last
    proposal. Walk the proposals in order:

        draw u uniform in [0, 1)
        keep proposal[i] if u < p[i][x] / q[i][x]        (x = proposal[i]; probability
                                                          min(1, p/q) of keeping it)
        else: stop, and draw the replacement from  max(0, p[i] - q[i])  renormalised

    If every proposal is kept, the next token is drawn from p[k] (a free extra token).
    Return (number kept, next token). With this rule the emitted tokens are distributed
    exactly as if sampled from the target alone, whatever the draft (Leviathan et al.
    2023, Chen et al. 2023): the test counts thousands of draws to check that.

    Args:
        p: [k + 1, vocab] target probabilities (rows sum to 1).
        q: [k, vocab] draft probabilities (rows sum to 1).
        proposal: k token ids, proposal[i] drawn from q[i].
        generator: the RNG for every draw (`torch.rand(..., generator=generator)`,
            `torch.multinomial(..., generator=generator)`), so a seeded run repeats.

    Pitfalls: compare u * q < p rather than dividing (q can be tiny); resampling from p
    instead of the residual max(0, p - q) over-weights the tokens the draft already
    had its chance to propose, and the output drifts towards the draft. If p == q the
    residual is all zeros, but then rejection cannot happen (u < 1 = p/q).
    """
    raise NotImplementedError("ch10: implement accept_or_resample")


def expected_tokens_per_round(acceptance: float, k: int) -> float:
    """Mean tokens one round emits when each proposal is kept with probability `acceptance`.

    A round stops at the first rejection (and then emits the target's replacement), or
    after k kept proposals (and then emits the bonus token). With each proposal kept
    independently with probability a, the number of tokens is 1 + (kept proposals) and

        E[tokens] = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

    Args:
        acceptance: a in [0, 1].
        k: proposals per round, >= 0 (k = 0 is plain decoding: 1 token per round).

    Returns:
        The expected number of tokens per target forward, between 1 and k + 1.

    Pitfalls: a = 1 makes the closed form 0/0 (the answer is k + 1); raise ValueError
    for a outside [0, 1] or k < 0.
    """
    raise NotImplementedError("ch10: implement expected_tokens_per_round")


def speculative_speedup(acceptance: float, k: int, draft_cost: float) -> float:
    """Speed-up over plain decoding, in the simple cost model of speculative decoding.

    One round costs k draft forwards and one target forward: k * c + 1 target-forward
    units, where c = draft_cost is a draft forward's time over a target forward's (the
    target's forward over k + 1 tokens is taken to cost as much as over 1: at batch 1
    decode reads the weights, it barely computes). Plain decoding makes 1 token per
    unit, so

        speed-up = expected_tokens_per_round(a, k) / (k * c + 1)

    Args:
        acceptance: a in [0, 1].
        k: proposals per round, >= 0.
        draft_cost: c > 0.

    Returns:
        The factor (> 1 means faster than plain decoding). It shows why a draft must be
        both good (a high) and cheap (c small), and that k has a best value: more
        proposals cost c each but the chance all are kept falls like a^k.
    """
    raise NotImplementedError("ch10: implement speculative_speedup")
