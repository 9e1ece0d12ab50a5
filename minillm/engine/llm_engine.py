"""The engine: requests in, tokens out, one scheduled forward per `step()`.

`add_request` turns a prompt into sequences (n samples share the prompt's blocks by
forking after its prefill), `step` runs what the scheduler picked, samples, detokenizes,
applies stop conditions and retires finished sequences (their blocks return at once),
and `abort` retires a request's sequences wherever they are. Outputs are vLLM-shaped
`RequestOutput`s; a per-request callback sees each one as it is produced (streaming).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from minillm.cache.block_manager import BlockManager
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import SamplingParams, Sequence, as_engine_params
from minillm.generation.loop import check_length, stop_ids
from minillm.generation.sampling import SamplingParams as BaseSamplingParams
from minillm.model.tokenizer import Tokenizer
from minillm.model.transformer import Transformer


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's names)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall times (time.perf_counter) for the serving metrics: TTFT, ITL, E2E."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # of sample 0


@dataclass
class RequestOutput:
    """A snapshot of a request: prompt, its samples so far, finished or not."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    on_output: Callable[[RequestOutput], None] | None = None

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


def stop_text_holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string (so a
    stream must not send them yet): the longest suffix that is a proper prefix of one."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class Engine:
    """Continuous batching (or the static-batching baseline) over a paged KV cache."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 2048,
        prefix_cache: bool = True,
        static: bool = False,
        use_kernel: bool | None = None,
    ) -> None:
        self.model, self.tokenizer = model.eval(), tokenizer
        if (
            use_kernel is None
        ):  # decode attention: Triton paged kernel on a GPU, PyTorch gather on CPU
            use_kernel = model.lm_head.weight.is_cuda
        self.context = model.config.max_position_embeddings
        if num_blocks is None:  # every running sequence can reach the full context
            num_blocks = max_num_seqs * -(-self.context // block_size)
        self.manager = BlockManager(num_blocks, block_size, prefix_cache)
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens, static)
        self.runner = ModelRunner(model, self.manager, use_kernel)
        self.requests: dict[str, Request] = {}
        self._counter = itertools.count()
        self.num_steps = self.num_prompt_tokens = self.num_generated_tokens = 0
        self.num_aborted = self.num_finished = 0
        # Set to [] to record (step, is_prefill, request ids run, request ids preempted).
        self.trace: list[tuple[int, bool, list[str], list[str]]] | None = None

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        params: BaseSamplingParams | None = None,
        request_id: str | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a prompt (text or token ids). Raises ValueError, queuing nothing, if it
        can never run: empty, longer than the context, or more blocks than the pool has."""
        params = as_engine_params(params)
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = Sequence(ids, params, request_id, index=0)
        metrics = RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time)
        self.requests[request_id] = Request(
            request_id, text, ids, params, [parent], metrics, on_output
        )
        self.scheduler.add(parent)
        return request_id

    def check_request(self, prompt_ids: list[int], params: BaseSamplingParams) -> None:
        """Raise ValueError naming the fix if this request could never run here: empty,
        past the context, n above max_num_seqs, or more KV blocks than the pool has."""
        n = getattr(params, "n", 1)
        check_length(self.model, len(prompt_ids), params.max_tokens)
        if n > self.scheduler.max_num_seqs:
            raise ValueError(
                f"n={n} exceeds max_num_seqs={self.scheduler.max_num_seqs}: "
                "lower n or start the engine with more sequences"
            )
        bs = self.manager.block_size
        need = -(-(len(prompt_ids) + params.max_tokens) // bs)
        if need > self.manager.num_blocks:
            raise ValueError(
                f"prompt + max_tokens needs {need} KV blocks but the pool has "
                f"{self.manager.num_blocks}: lower max_tokens or give the engine more blocks"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its sequences leave the queues and free their blocks.
        Returns its final output (finish_reason "abort"), None if it was not running."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None  # already finished (or never existed): nothing to free
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self.num_aborted += 1
        return self._emit(request, finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; the outputs of the requests that moved."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        seqs = batch.seqs
        if batch.seqs:
            logits = self.runner.run(batch)
            rows = list(range(len(seqs)))
            if batch.is_prefill:  # n > 1: children fork from the prompt's blocks now
                self.num_prompt_tokens += batch.num_tokens
                for i, parent in enumerate(list(seqs)):
                    if parent.params.n > 1 and not parent.children and not parent.output_ids:
                        for j in range(1, parent.params.n):
                            child = parent.fork(j)
                            parent.children.append(child)
                            self.requests[parent.request_id].seqs.append(child)
                            self.scheduler.fork(parent, child)
                            seqs.append(child)
                            rows.append(i)
            tokens = self.runner.sample(logits[rows], seqs)
        else:
            tokens = []
        if self.trace is not None:
            preempted = [s.request_id for s in batch.preempted]
            self.trace.append(
                (self.num_steps, batch.is_prefill, [s.request_id for s in seqs], preempted)
            )
        self.num_steps += 1
        touched: dict[str, Request] = {}
        for seq, token in zip(seqs, tokens, strict=True):
            self._append(seq, token)
            touched[seq.request_id] = self.requests[seq.request_id]
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = time.perf_counter()
                del self.requests[request.request_id]
                self.num_finished += 1
            outputs.append(self._emit(request, request.finished))
        return outputs

    def _append(self, seq: Sequence, token: int) -> None:
        """Record a sampled token; finish the sequence on a stop token/string or length."""
        seq.append(token)
        self.num_generated_tokens += 1
        metrics = self.requests[seq.request_id].metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = seq.token_times[-1]
        if seq.index == 0:
            metrics.token_times.append(seq.token_times[-1])
        params, reason = seq.params, None
        seq.text = self.tokenizer.decode(seq.output_ids)
        if token in stop_ids(self.model, params):
            reason, seq.stop_reason = "stop", (token if token in params.stop_token_ids else None)
        elif params.stop:
            hits = [(seq.text.find(s), s) for s in params.stop if s in seq.text]
            if hits:
                cut, stop = min(hits)
                seq.text, reason, seq.stop_reason = seq.text[:cut], "stop", stop
        if reason is None and len(seq.output_ids) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _emit(self, request: Request, finished: bool) -> RequestOutput:
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            text = seq.text
            if not seq.is_finished:  # streaming: hold back what may still change
                text = text.rstrip("\ufffd")  # an unfinished multi-byte character
                text = text[: len(text) - stop_text_holdback(text, seq.params.stop)]
            outputs.append(
                CompletionOutput(
                    seq.index, text, list(seq.output_ids), seq.finish_reason, seq.stop_reason
                )
            )
        out = RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_ids,
            outputs,
            finished,
            request.metrics,
            request.seqs[0].num_cached,
        )
        if request.on_output is not None:
            request.on_output(out)
        return out

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_blocks_used(self) -> int:
        return self.manager.num_blocks - self.manager.num_free_blocks

    def run_to_completion(self) -> list[RequestOutput]:
        """Step until every queued request is done; finished outputs in arrival order."""
        done: dict[str, RequestOutput] = {}
        order = list(self.requests)
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in order if r in done]
