"""Iteration-level scheduling: which sequences run in the next forward.

Every engine step is either a **prefill** step (admit waiting sequences and run their
prompts) or a **decode** step (one new token for every running sequence); like
nano-vllm, the two are not mixed in one forward. Policy, in order:

1. Admission (continuous mode, every step; static mode only when nothing is running):
   take waiting sequences first-come-first-served while the step's token budget
   (`max_num_batched_tokens`, counting the tokens that actually run, i.e. past the prefix
   cache hit), `max_num_seqs` (a request counts `n` times) and the free KV blocks allow.
   The first one is always admitted if its blocks fit, so a long prompt never starves.
   If anything was admitted, the step is a prefill step.
2. Otherwise decode every running sequence, oldest first. A sequence that needs a new
   block when none is free **preempts the most recently admitted** running sequence
   (recompute: its blocks are freed and it goes back to the *front* of the waiting
   queue with all its tokens), repeatedly, down to itself if nothing else is left.
   Newest-first keeps the work already invested in old sequences and mirrors vLLM's
   default; the recompute costs one prefill of prompt + output when it is readmitted.

No chunked prefill: a prompt runs whole in one step. The bundled model's context is 256
tokens, so a prefill is never long enough to stall decodes much, and the prefix cache
registers a prompt's full blocks at allocation, so a half-computed prompt could be
"hit" by another sequence before its K/V exist; chunking would need that deferred.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.cache.block_manager import BlockManager
from minillm.engine.sequence import Sequence, Status


@dataclass
class Batch:
    """What the model runs next: prefill (whole prompts past their cached prefix) or
    decode (one token per sequence), plus copy-on-write block copies to do first."""

    seqs: list[Sequence]
    is_prefill: bool
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        if self.is_prefill:
            return sum(len(s) - s.num_cached for s in self.seqs)
        return len(self.seqs)


class Scheduler:
    """Waiting and running queues over one BlockManager."""

    def __init__(
        self,
        manager: BlockManager,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
        static: bool = False,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.manager, self.static = manager, static
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _width(self, seq: Sequence) -> int:
        """Running slots a waiting sequence takes: its future forks count too."""
        return seq.params.n if seq.params.n > 1 and not seq.output_ids else 1

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when nothing is left to run."""
        if not self.static or not self.running:
            batch = self._admit()
            if batch.seqs:
                return batch
        return self._decode() if self.running else None

    def _admit(self) -> Batch:
        admitted: list[Sequence] = []
        tokens, slots = 0, len(self.running)
        while self.waiting:
            seq = self.waiting[0]
            width = self._width(seq)
            if slots + width > self.max_num_seqs and (admitted or self.running):
                break
            if not self.manager.can_allocate(seq.token_ids):
                break
            if admitted and tokens + len(seq) > self.max_num_batched_tokens:
                break  # (an estimate before the prefix-cache hit, to leave state untouched)
            seq.num_cached = self.manager.allocate(seq.seq_id, seq.token_ids)
            tokens += len(seq) - seq.num_cached
            slots += width
            seq.status = Status.RUNNING
            admitted.append(self.waiting.popleft())
            self.running.append(seq)
        return Batch(admitted, is_prefill=True)

    def _decode(self) -> Batch:
        batch = Batch([], is_prefill=False)
        queue, self.running = self.running, deque()
        while queue:
            seq = queue.popleft()
            while not self.manager.can_append(seq.seq_id):
                victim = queue.pop() if queue else seq
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                slot, copy = self.manager.append_slot(seq.seq_id, seq.output_ids[-1])
                if copy is not None:
                    batch.copies.append(copy)
                batch.seqs.append(seq)
                self.running.append(seq)
        return batch

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, requeue at the front of waiting."""
        self.manager.free(seq.seq_id)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start a child sample on its parent's blocks (shared until one writes)."""
        self.manager.fork(parent.seq_id, child.seq_id)
        child.status = Status.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (done or aborted): its blocks go back to the pool at once."""
        if seq.status is Status.RUNNING:
            self.manager.free(seq.seq_id)
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
