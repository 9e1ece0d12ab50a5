"""Any OpenAI-compatible server over HTTP, streamed (minillm serve, vLLM, SGLang, llama.cpp
server, TGI's OpenAI route)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from minillm.bench.backends import Backend, Unavailable
from minillm.bench.metrics import Trace
from minillm.bench.workload import Request


class OpenAIBackend(Backend):
    """Any OpenAI-compatible server, streaming (`openai:URL` completions with token-id
    prompts, `openai-text:URL` completions with text prompts, for servers that take no token
    ids, `openai-chat:URL` chat completions with text prompts)."""

    concurrent = True
    measures_memory = False  # the server is another process

    def load(self) -> None:
        import httpx

        kind, _, url = self.spec.partition(":")
        self.chat, self.text = kind == "openai-chat", kind == "openai-text"
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        try:
            models = httpx.get(f"{self.base}/models", timeout=5).json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as err:
            raise Unavailable(f"no OpenAI-compatible server at {self.base}: {err}") from None
        self.model_name = models[0]["id"] if models else "default"

    async def _one(self, client: Any, req: Request) -> Trace:
        body: dict[str, Any] = {
            "model": self.model_name,
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt_text}]
        else:
            body["prompt"] = req.prompt_text if self.text else req.prompt_ids
        url = f"{self.base}/chat/completions" if self.chat else f"{self.base}/completions"
        trace, parts, usage = Trace(time.perf_counter()), [], None
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices") or []:
                    text = c["delta"].get("content") if self.chat else c.get("text")
                    if text:
                        trace.token_times.append(time.perf_counter())
                        parts.append(text)
        trace.end, trace.text = time.perf_counter(), "".join(parts)
        trace.num_tokens = usage if usage is not None else len(trace.token_times)
        return trace

    async def _all(self, requests: list[Request], concurrency: int, bar: Any) -> list[Trace]:
        import httpx

        gate = asyncio.Semaphore(concurrency)

        async def one(client: Any, req: Request) -> Trace:
            async with gate:
                trace = await self._one(client, req)
            bar.update()
            return trace

        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*(one(client, r) for r in requests))

    def run_all(self, requests: list[Request], concurrency: int, bar: Any) -> list[Trace]:
        return run_async(self._all(requests, concurrency, bar))


def run_async(coro: Any) -> Any:
    """asyncio.run, also from inside a running loop (Jupyter): then on a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
