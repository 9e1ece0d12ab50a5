"""The engine: requests in, tokens out. One `step()` runs one way, as nano-vLLM's does:

    schedule  -> which tokens of which sequences (decodes, prompt chunks, admissions)
    run       -> one forward, sampling inside: token ids out
    postprocess -> append, detokenize, stop, finish (blocks back to the pool at once)
    emit      -> a vLLM-shaped RequestOutput per request that moved

`add_request` turns a prompt into a sequence (its siblings, up to n or best_of, are forked
from it when its prompt is done, sharing its blocks); `abort` retires a request wherever its
sequences are. Each sequence is the one owner of its tokens and blocks; the engine owns the
requests.

A request that fails inside a step (its forward, its draw, its detokenization) is aborted
with the error in its last output (`RequestOutput.error`); the other requests of the step go
on with exactly the tokens they would have had. `check_request` refuses up front what would
fail later: token ids outside the vocabulary, too many samples or logprobs, too long.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from minillm.cache.block_manager import BlockManager
from minillm.engine.config import EngineConfig
from minillm.engine.detokenizer import Detokenizer
from minillm.engine.limits import check_request
from minillm.engine.memory import SWAP_SPACE, pool_blocks
from minillm.engine.model_runner import ModelRunner
from minillm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minillm.engine.scheduler import Batch, Sampled, Scheduler, StepRecord
from minillm.engine.sequence import Sequence
from minillm.engine.worker import CacheSettings, Worker
from minillm.generation.loop import finish_reason, stop_ids
from minillm.generation.sampling import SamplingParams
from minillm.model.tokenizer import Tokenizer
from minillm.model.transformer import Transformer

if TYPE_CHECKING:
    from minillm.engine.parallel import Ranks


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    sent: list[int] = field(default_factory=list)  # token ids already emitted, per sample
    prompt_logprobs_sent: bool = False
    error: str | None = None

    @property
    def finished(self) -> bool:
        done = all(s.is_finished for s in self.seqs)
        return len(self.seqs) == self.params.num_samples and done


class Engine:
    """Continuous batching over a paged KV cache, chunked prefill by default."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        parallel: Ranks | None = None,
        **settings: Any,
    ) -> None:
        """`settings` are `EngineConfig`'s fields, a shorthand for `config=EngineConfig(...)`
        (`Engine(model, tok, max_num_seqs=8)`). `parallel`: the ranks of a tensor- or
        pipeline-parallel model, `model` being rank 0's part (`minillm.engine.parallel`)."""
        if config is not None and settings:
            raise ValueError(f"give config= or settings {sorted(settings)}, not both")
        self.config = cfg = config or EngineConfig.of(**settings)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_logprobs = cfg.max_logprobs  # vLLM's limit on logprobs / prompt_logprobs
        # vLLM's LLM(seed=...): unseeded requests draw their seeds from this, in arrival order
        self.seeds = random.Random(cfg.seed) if cfg.seed is not None else None
        on_gpu = model.lm_head.weight.is_cuda
        use_kernel = cfg.use_kernel
        if use_kernel is None:  # decode attention: the Triton kernel on a GPU, a gather on CPU
            use_kernel = on_gpu and cfg.kv_cache_dtype == "auto"  # it reads unquantized K/V
        # a recorded step would hold the ranks' collectives too: parallel engines run eager
        decode_mode = cfg.decode_mode or ("cuda_graph" if on_gpu and not parallel else "eager")
        if parallel is not None and parallel.pipeline and decode_mode != "eager":
            raise ValueError(
                f"decode_mode={decode_mode!r} pads token ids into fixed buffers, and a "
                "pipeline's stages after the first take hidden states: use 'eager'"
            )
        if parallel is not None and decode_mode in ("compile", "cuda_graph"):
            raise ValueError(
                f"decode_mode={decode_mode!r} records the forward, and a tensor-parallel "
                "forward waits on the other ranks in Python: use 'eager' or 'static'"
            )
        self.context = model.config.max_position_embeddings
        # num_blocks, else a fraction of memory (memory.py), else every sequence at full context
        num_blocks, self.pool_plan = pool_blocks(
            model, cfg.num_blocks, cfg.gpu_memory_utilization, cfg.block_size,
            cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_dtype,
        )  # fmt: skip
        num_swap_blocks = cfg.num_swap_blocks
        if num_swap_blocks is None:  # swap space: the pool's size (sized from memory: <= 4 GiB)
            cap = SWAP_SPACE // (self.pool_plan.bytes_per_block if self.pool_plan else 1)
            num_swap_blocks = min(num_blocks, cap) if cfg.preemption_mode == "swap" else 0
        self.manager = BlockManager(
            num_blocks, cfg.block_size, cfg.prefix_cache, num_swap_blocks=num_swap_blocks
        )
        self.scheduler = Scheduler(
            self.manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.chunked_prefill,
            cfg.static, cfg.preemption_mode,
        )  # fmt: skip
        settings = CacheSettings(
            num_blocks, cfg.block_size, use_kernel, num_swap_blocks, decode_mode,
            cfg.kv_cache_dtype,
        )  # fmt: skip
        worker = Worker(model, settings)
        ranks = worker if parallel is None else parallel.attach(worker, settings)
        self.runner = ModelRunner(model, self.manager, ranks, cfg.max_num_seqs)
        # a pipeline's steps in flight, oldest first
        self.in_flight: deque[tuple[Batch, Callable[[], list[Sampled]]]] = deque()
        self.requests: dict[str, Request] = {}
        self._counter = itertools.count()
        self.num_steps = self.num_prompt_tokens = self.num_generated_tokens = 0
        self.num_aborted = self.num_finished = 0
        self.time_in = {"schedule": 0.0, "run": 0.0, "postprocess": 0.0}  # seconds, cumulative
        self.trace: list[StepRecord] | None = None  # set to [] to record every step

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a prompt (text or token ids). Raises ValueError, queuing nothing, if it
        can never run: empty, longer than the context, or more blocks than the pool has."""
        params = params or SamplingParams()
        if params.seed is None and self.seeds is not None:  # the engine's seed decides it
            params = replace(params, seed=self.seeds.randrange(2**62))
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        request_id = str(next(self._counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(ids, params=params, request_id=request_id)
        metrics = RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time)
        self.requests[request_id] = Request(request_id, text, params, [seq], metrics)
        self.scheduler.add(seq)
        return request_id

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the fix if this request could never run here (`limits`)."""
        check_request(
            self.model,
            self.manager,
            self.scheduler.max_num_seqs,
            self.max_logprobs,
            prompt_ids,
            params,
        )

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """Stop a request now: its sequences leave the queues and free their blocks.
        Returns its final output (finish_reason "abort", and `error` if one is given), None
        if it was not running."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None  # already finished (or never existed): nothing to free
        request.error = request.error or error
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self.num_aborted += 1
        return self._emit(request, force=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def close(self) -> None:
        """Stop the parallel ranks, if any (one device: nothing to do)."""
        self.runner.worker.close()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess, emit: the outputs of the requests that moved. A
        pipeline first starts a step a stage, each from the sequences not in one."""
        t0 = time.perf_counter()
        depth, sched = self.runner.worker.depth, self.scheduler
        while len(self.in_flight) < depth:
            in_flight = frozenset(s for batch, _ in self.in_flight for s in batch.sequences())
            # an even share of the sequences a stage (one device: all of them)
            share = len(sched.running) + len(sched.waiting) + len(sched.swapped)
            batch = sched.schedule(in_flight, -(-share // depth) if depth > 1 else None)
            if batch is None:
                break
            self.in_flight.append((batch, self.runner.submit(batch)))  # moves, if no items
        if not self.in_flight:
            return []
        batch, tokens = self.in_flight.popleft()
        t1 = time.perf_counter()
        sampled = tokens()
        t2 = time.perf_counter()
        moved, failed = self.scheduler.postprocess(batch, sampled)
        moved = [seq for seq in moved if self._check_stop(seq, failed)]
        self.num_prompt_tokens += batch.num_prefill_tokens
        self.num_generated_tokens += len(moved)
        if self.trace is not None:
            self.trace.append(batch.record(self.num_steps, t1, t2))
        self.num_steps += 1
        outputs = []
        for seq in failed:  # its whole request goes, with the error; nobody else's
            outputs.append(self.abort(seq.request_id, f"the engine failed on it: {seq.error}"))
        moved_requests = [self.requests.get(s.request_id) for s in moved]
        outputs += [self._emit(r) for r in dict.fromkeys(moved_requests) if r is not None]
        t3 = time.perf_counter()
        for name, dt in (("schedule", t1 - t0), ("run", t2 - t1), ("postprocess", t3 - t2)):
            self.time_in[name] += dt
        return [out for out in outputs if out is not None]

    def _check_stop(self, seq: Sequence, failed: list[Sequence]) -> bool:
        """After a token was appended: detokenize it and finish the sequence if it ends
        (stop token, stop string on the new text, or length). A sequence whose detokenizing
        raises fails alone (into `failed`). False: it failed."""
        try:
            reason = self._stop_reason(seq)
        except Exception as err:  # this one sequence's text could not be made
            self.scheduler.fail(seq, f"{type(err).__name__}: {err}")
            failed.append(seq)
            return False
        if reason is not None:
            self.scheduler.finish(seq, *reason)
        return True

    def _stop_reason(self, seq: Sequence) -> tuple[str, int | str | None] | None:
        request = self.requests[seq.request_id]
        if seq not in request.seqs:  # a child forked this step
            request.seqs.append(seq)
        if seq.detokenizer is None:
            seq.detokenizer = Detokenizer(self.tokenizer, seq.params)
        metrics = request.metrics
        metrics.first_token_time = metrics.first_token_time or seq.token_times[-1]
        if seq.index == 0:
            metrics.token_times.append(seq.token_times[-1])
        stops = stop_ids(self.model, seq.params)
        reason = finish_reason(seq.token_ids[-1], seq.num_output_tokens, seq.params, stops)
        stops_count = seq.num_output_tokens > seq.params.min_tokens  # vLLM's min_tokens rule
        stop_string = seq.detokenizer.update(
            seq.token_ids, seq.num_prompt_tokens, reason is not None, stops_count
        )
        if reason is None and stop_string is not None:
            return "stop", stop_string
        return reason

    def _emit(self, request: Request, force: bool = False) -> RequestOutput | None:
        """The request's output for its output_kind (None when final_only and running).
        With best_of above n only the finished output is emitted: the n samples with the
        highest cumulative logprob (vLLM's ranking), renumbered 0..n-1."""
        finished = request.finished or force
        if finished and request.request_id in self.requests:
            del self.requests[request.request_id]
            request.metrics.finished_time = time.perf_counter()
            self.num_finished += 1
        params = request.params
        kind, best_of = params.output_kind, params.num_samples > params.n
        if (kind == "final_only" or best_of) and not finished:
            return None
        seqs = sorted(request.seqs, key=lambda s: s.index)
        if best_of:
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: params.n]
        request.sent += [0] * (params.num_samples - len(request.sent))
        outputs = []
        for number, seq in enumerate(seqs):
            detok, done, sent = seq.detokenizer, seq.is_finished, request.sent[seq.index]
            if kind == "delta":
                text = detok.delta(done) if detok else ""
            else:
                text, sent = (detok.visible_text(done) if detok else ""), 0
            request.sent[seq.index] = seq.num_output_tokens
            outputs.append(
                CompletionOutput(
                    number if best_of else seq.index,
                    text,
                    seq.output_ids_from(sent),
                    seq.finish_reason,
                    seq.stop_reason,
                    seq.logprobs[sent:] if params.logprobs is not None else None,
                    seq.cumulative_logprob if params.needs_logprobs else None,
                )
            )
        first = request.seqs[0]
        prompt_logprobs = None
        if params.prompt_logprobs is not None and (
            kind != "delta" or not request.prompt_logprobs_sent
        ):
            prompt_logprobs = [None, *first.prompt_logprobs]
            request.prompt_logprobs_sent = True
        out = RequestOutput(
            request.request_id,
            request.prompt,
            first.prompt_ids,
            outputs,
            finished,
            request.metrics,
            first.num_cached_tokens,
            prompt_logprobs,
            request.error,
        )
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


def final_only(params: SamplingParams | None) -> SamplingParams:
    """The same parameters, emitting only the finished output (offline generation)."""
    return replace(params or SamplingParams(), output_kind="final_only")
