"""Iteration-level scheduling: which tokens of which sequences the next forward computes,
and what a step's sampled tokens do to the sequences afterwards.

Every sequence knows how many of its tokens are computed (K/V written); a decoding
sequence has one uncomputed token (the last one sampled), a new prompt all of its tokens.
With **chunked prefill** (the default, vLLM V1's policy) one token budget per step,
`max_num_batched_tokens`, is shared by everything, in this order:

1. decodes of running sequences, oldest first (one token each): generation never stalls;
2. the next chunk of each running prompt that is not done yet;
3. swapped-out sequences coming back, then new requests, first come first served, while
   the budget, `max_num_seqs` (a request counts `n` times) and the free blocks allow; a new
   prompt's first chunk runs in the same step.

All of it goes through the model in ONE forward. A long prompt is cut into chunks, so the
decodes around it keep their pace instead of waiting for its whole prefill.

Without chunking (`chunked_prefill=False`, the policy before vLLM V1) a step either admits
and prefills whole prompts or decodes: a long prompt then stalls every decode for a step.
`static=True` admits only when nothing runs: the static-batching baseline.

When a sequence needs a block and none is free, the **most recently admitted** running
sequence is preempted (vLLM's default), repeatedly, down to itself: **recompute** frees its
blocks and requeues it at the front (its tokens are prefilled again on readmission);
**swap** copies its blocks to the CPU pool and resumes it from there. A preempting step
admits nothing new.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.cache.block_manager import BlockManager
from minillm.engine.sequence import Sequence, Status
from minillm.generation.processors import Logprob


@dataclass
class Scheduled:
    """One sequence's share of a step: `num_tokens` of its uncomputed tokens, and the
    sequences that sample a token from the logits after the last of them (itself, plus the
    children of a request with n > 1 forked as its prompt finishes; none for a chunk that
    leaves the prompt unfinished)."""

    seq: Sequence
    start: int  # the first token computed in this step (the sequence's computed count then)
    num_tokens: int
    samplers: list[Sequence] = field(default_factory=list)
    # Set by the model runner: the logprobs of the prompt tokens this share computed (when
    # the request asked for them), or why running this share failed.
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    error: str | None = None


@dataclass
class Sampled:
    """One sampler's result in a step: its token and, if wanted, the token's logprobs; or
    the error that stopped this one sequence (its request is aborted, nobody else's)."""

    token: int
    logprobs: dict[int, Logprob] | None = None
    error: str | None = None


@dataclass
class StepRecord:
    """What one step did (engine.trace, for timelines and utilisation)."""

    step: int
    start: float
    end: float
    decode_ids: list[str]  # requests that generated a token from a one-token row
    prefill_tokens: dict[str, int]  # request -> prompt tokens computed in this step
    preempted: list[str]


@dataclass
class Batch:
    """A step: one-token rows (decodes) first, then prompt chunks, and the block copies the
    cache must make before the forward (swap-outs, swap-ins, copy-on-write, in that order)."""

    items: list[Scheduled]
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # A pipeline's earlier steps still in flight: their sequences, neither scheduled nor
    # preempted here, and the most items a step takes (so that each stage gets a share).
    in_flight: frozenset[Sequence] = frozenset()
    max_items: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.items)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of prompts (or of preempted sequences being recomputed) in this step."""
        return sum(i.num_tokens for i in self.items if i.start < i.seq.num_prompt_tokens)

    def sequences(self) -> set[Sequence]:
        """Every sequence this step computes or samples for."""
        return {s for item in self.items for s in (item.seq, *item.samplers)}

    def busy(self) -> set[Sequence]:
        """This step's sequences and those in flight: not to be scheduled again or
        preempted now."""
        return self.sequences() | self.in_flight

    @property
    def full(self) -> bool:
        return self.max_items is not None and len(self.items) >= self.max_items

    def record(self, step: int, start: float, end: float) -> StepRecord:
        prefill: dict[str, int] = {}
        for item in self.items:
            if item.start < item.seq.num_prompt_tokens:
                prefill[item.seq.request_id] = prefill.get(item.seq.request_id, 0) + item.num_tokens
        decode = [i.seq.request_id for i in self.items if i.start >= i.seq.num_prompt_tokens]
        preempted = [s.request_id for s in self.preempted]
        return StepRecord(step, start, end, decode, prefill, preempted)


class Scheduler:
    """Waiting, running and swapped queues over one BlockManager."""

    def __init__(
        self,
        manager: BlockManager,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
        chunked_prefill: bool = True,
        static: bool = False,
        preemption_mode: str = "recompute",
    ) -> None:
        self.manager, self.static, self.preemption_mode = manager, static, preemption_mode
        self.chunked = chunked_prefill and not static
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------------ schedule
    def schedule(
        self, in_flight: frozenset[Sequence] = frozenset(), max_items: int | None = None
    ) -> Batch | None:
        """The next step, or None when nothing is left to run. A pipeline's steps
        `in_flight` keep their sequences; `max_items`: its share."""
        batch = Batch([], in_flight=in_flight, max_items=max_items)
        if not self.chunked:  # a step admits and prefills, or decodes: never both
            if not self.static or not self.running:
                self._admit(batch, budget=self.max_num_batched_tokens)
            if not batch.items:
                self._run_running(batch, self.max_num_batched_tokens, prompts=False)
        else:
            budget = self._run_running(batch, self.max_num_batched_tokens, prompts=False)
            budget = self._run_running(batch, budget, prompts=True)
            if not batch.preempted:
                budget = self._swap_in(batch, budget)
                self._admit(batch, budget)
        if not batch.items and not batch.preempted:
            return None
        batch.items.sort(key=lambda item: item.num_tokens > 1)  # one-token rows first
        return batch

    def _run_running(self, batch: Batch, budget: int, prompts: bool) -> int:
        """Schedule the running decodes (or, `prompts`, the unfinished prompts' next chunks)
        within `budget` tokens, preempting the newest running sequences for blocks."""
        busy = batch.busy()
        queue = [s for s in self.running if (s.num_uncomputed > 1) == prompts and s not in busy]
        while queue and budget > 0 and not batch.full:
            seq = queue.pop(0)
            while not self.manager.can_append(seq):
                busy = batch.busy()
                victim = [s for s in self.running if s not in busy][-1]  # newest: seq at worst
                self._preempt(victim, batch)
                if victim in queue:
                    queue.remove(victim)
                if victim is seq:
                    break
            else:
                n = min(seq.num_uncomputed, budget)
                batch.copies += self.manager.append_slots(seq)
                batch.items.append(self._item(seq, n))
                budget -= n
        return budget

    def _swap_in(self, batch: Batch, budget: int) -> int:
        while self.swapped and budget > 0 and not batch.full:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.swapped[0]
            if not self.manager.can_swap_in(seq):
                break
            batch.swap_in += self.manager.swap_in(self.swapped.popleft())
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.copies += self.manager.append_slots(seq)
            n = min(seq.num_uncomputed, budget)
            batch.items.append(self._item(seq, n))
            budget -= n
        return budget

    def _admit(self, batch: Batch, budget: int) -> None:
        slots = len(self.running) + len(self.swapped)
        while self.waiting and budget > 0 and not batch.full:
            seq = self.waiting[0]
            samples = seq.params.num_samples
            width = samples if samples > 1 and not seq.num_output_tokens else 1
            if slots + width > self.max_num_seqs and (batch.items or self.running):
                break
            if not self.manager.can_allocate(seq):
                break
            if not self.chunked and batch.items and len(seq) > budget:
                break  # a whole prompt per step without chunking (the first always fits)
            self.manager.allocate(seq)
            n = min(seq.num_uncomputed, budget) if self.chunked else seq.num_uncomputed
            seq.status = Status.RUNNING
            self.running.append(self.waiting.popleft())
            batch.copies += self.manager.append_slots(seq)
            batch.items.append(self._item(seq, n))
            budget -= n
            slots += width

    def _item(self, seq: Sequence, n: int) -> Scheduled:
        """A scheduled share; when it finishes the prompt of a request with n > 1 samples,
        the children are forked here, sharing the blocks this step fills."""
        item = Scheduled(seq, seq.num_computed_tokens, n)
        if n < seq.num_uncomputed:
            return item  # a chunk in the middle of the prompt: nothing to sample yet
        item.samplers.append(seq)
        if seq.params.num_samples > 1 and not seq.num_output_tokens and seq.index == 0:
            for j in range(1, seq.params.num_samples):
                child = seq.fork(j)
                self.manager.fork(seq, child)
                child.status = Status.RUNNING
                self.running.append(child)
                item.samplers.append(child)
        return item

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        """Swap the sequence out to the CPU pool if that mode is on and it fits; otherwise
        recompute: free its blocks and requeue it at the front of waiting."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(seq)
        if self.preemption_mode == "swap" and self.manager.can_swap_out(seq):
            batch.swap_out += self.manager.swap_out(seq)
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
        else:
            self.manager.free(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the forward
    def postprocess(self, batch: Batch, sampled: list[Sampled]) -> tuple[list[Sequence], list]:
        """Record a step: mark the computed tokens (which publishes full blocks to the prefix
        cache) and append each sampled token. A share or a sampler that failed finishes its
        sequences with "abort" and their `error`, and publishes nothing. Returns (sequences
        that got a token, sequences that failed); whether a token ends its sequence is the
        engine's to say (it detokenizes)."""
        moved, failed, it = [], [], iter(sampled)
        for item in batch.items:
            draws = [next(it) for _ in item.samplers]
            if item.seq.is_finished:  # aborted while its step was in a pipeline
                for child in item.samplers:  # forked by this step: not its request's yet
                    if not child.is_finished:
                        self.finish(child, "abort")
                continue
            if item.error is not None:
                failed += [s for s in (item.seq, *item.samplers) if self.fail(s, item.error)]
                continue
            computed = item.start + item.num_tokens
            for seq in item.samplers or [item.seq]:
                self.manager.mark_computed(seq, computed)
            if item.prompt_logprobs:
                item.seq.prompt_logprobs += item.prompt_logprobs
                item.seq.reads_prefix_cache = not item.seq.needs_prompt_logprobs
            for seq, draw in zip(item.samplers, draws, strict=True):
                if draw.error is not None:
                    failed += [seq] if self.fail(seq, draw.error) else []
                    continue
                seq.append(draw.token, draw.logprobs)
                moved.append(seq)
        return moved, failed

    def fail(self, seq: Sequence, error: str) -> bool:
        """Abort one sequence with `error` (its request is aborted by the engine); False if
        it was already finished."""
        if seq.is_finished:
            return False
        seq.error = error
        self.finish(seq, "abort")
        return True

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire a sequence (done or aborted): its blocks go back to the pool at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
        self.manager.free(seq)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop_reason
