"""`python -m minillm generate | chat | serve | bench | doctor`: the course's command line."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minillm import SamplingParams, Tokenizer, Transformer


def _load(args: argparse.Namespace) -> tuple[Transformer, Tokenizer]:
    from minillm import load_model, load_tokenizer
    from minillm.model.layout import decode_layout, matvec_applies, use_matvec

    model = load_model(args.model, device=args.device or "auto")  # auto: CUDA if present
    if matvec_applies(model):  # faster CPU decode (chapters 02 and 05)
        use_matvec(model)
    elif model.lm_head.weight.device.type == "cpu":
        decode_layout(model)
    return model, load_tokenizer(args.model)


def _params(args: argparse.Namespace) -> SamplingParams:
    from minillm import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=getattr(args, "ignore_eos", False),
    )


class _Printer:
    """Prints a reply while its tokens arrive (the `on_token` of `minillm.generate`).

    It decodes the whole reply so far and prints the new tail: one character can span
    several byte-level tokens, and a tail that ends in U+FFFD is half a character, which
    waits for the next token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.tokens, self.printed = tokenizer, [], ""

    def __call__(self, _row: int, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if not text.endswith("\ufffd"):
            print(text[len(self.printed) :], end="", flush=True)
            self.printed = text

    def finish(self, end: str = "\n") -> str:
        """Print what is left and `end`; return the whole reply's text."""
        text = self.tokenizer.decode(self.tokens)
        print(text[len(self.printed) :], end=end, flush=True)
        return text


def _generate(args: argparse.Namespace) -> None:
    from minillm import generate

    model, tokenizer = _load(args)
    if args.chat:  # the prompt is one user message, in the model's own chat template
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
        print(args.prompt, end="", flush=True)
    printer = _Printer(tokenizer)
    out = generate(model, [prompt_ids], _params(args), on_token=printer)[0]
    printer.finish()
    if args.print_token_ids:
        print(out)


def _chat(args: argparse.Namespace) -> None:
    """An interactive conversation: each turn renders the whole history with the model's
    template and generates the reply (a new prefill per turn: simple, and cheap next to
    decoding at this size)."""
    from minillm import generate

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # Windows
        pass
    model, tokenizer = _load(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    tokenizer.render_chat(start + [{"role": "user", "content": ""}])  # no template: fail now
    params, history = _params(args), list(start)
    print("/reset starts over, /exit or Ctrl-D quits, Ctrl-C stops a reply")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D quits)")
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = list(start)
            print("(conversation cleared)")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        printer = _Printer(tokenizer)
        try:
            generate(model, [tokenizer.apply_chat_template(history)], params, on_token=printer)
            end = "\n"
        except KeyboardInterrupt:
            end = " [stopped]\n"
        except ValueError as err:  # past the context window
            history.pop()
            print(f"error: {err}. /reset starts a new conversation")
            continue
        history.append({"role": "assistant", "content": printer.finish(end)})


def _serve(args: argparse.Namespace) -> None:
    from minillm.engine.config import EngineConfig
    from minillm.engine.rank import launched_by_torchrun, run_rank

    rank = int(os.environ["RANK"]) if launched_by_torchrun() else 0
    size = max(args.tensor_parallel_size, args.pipeline_parallel_size)
    if size > 1 and rank > 0:  # a rank of a multi-launch: rank 0 serves (and says which kind)
        run_rank(rank, size)
        return
    from minillm.serving.api_server import serve
    from minillm.serving.http import Timeouts

    names = ("idle", "header", "body", "shutdown")
    given = {name: getattr(args, f"{name}_timeout") for name in names}
    config = EngineConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
    )  # checked here, before the model loads
    serve(
        model=args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        device=args.device,
        chat_template=args.chat_template,
        max_body_bytes=args.max_request_bytes,
        timeouts=Timeouts(**{k: v for k, v in given.items() if v is not None}),
        config=config,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )


def _bench(args: argparse.Namespace) -> None:
    from minillm.bench import run_from_args

    run_from_args(args)


def _doctor(_args: argparse.Namespace) -> None:
    from minillm.doctor import main as doctor_main

    sys.exit(doctor_main())


MODEL_HELP = "checkpoint directory, .gguf file, hub id, or a name: smollm2"


def _generation_arguments(
    parser: argparse.ArgumentParser, max_tokens: int, temperature: float, top_p: float
) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=top_p)
    parser.add_argument("--top-k", type=int, default=0, help="0 or -1 disables")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default=None, help="cpu, cuda, mps (default: cuda if present)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (bundled model by default, offline)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message: apply the model's chat template, print the reply",
    )
    _generation_arguments(gen, max_tokens=64, temperature=0.8, top_p=0.95)
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument(
        "--print-token-ids", action="store_true", help="print the generated ids as a last line"
    )
    gen.set_defaults(func=_generate)

    chat = sub.add_parser("chat", help="talk to a chat model (default: smollm2, offline)")
    chat.add_argument("--model", default="smollm2", help=MODEL_HELP)
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    # SmolLM2's model card samples at temperature 0.2, top_p 0.9.
    _generation_arguments(chat, max_tokens=256, temperature=0.2, top_p=0.9)
    chat.set_defaults(func=_chat)

    srv = sub.add_parser("serve", help="OpenAI-compatible server (bundled model by default)")
    srv.add_argument("--model", default=None, help=MODEL_HELP)
    srv.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the name clients send")
    srv.add_argument("--device", default=None, help="cpu, cuda, mps (default: cuda if present)")
    srv.add_argument("--max-num-seqs", type=int, default=32, help="most sequences per step")
    srv.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: all full-length)"
    )
    srv.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    srv.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="size the KV pool from this fraction of memory, as vLLM does (unless --num-blocks)",
    )
    srv.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget per step"
    )
    srv.add_argument("--seed", type=int, default=None, help="seeds the unseeded requests")
    srv.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split every layer over this many ranks (processes); with torchrun's variables "
        "set, each rank is launched on its own and rank 0 serves",
    )
    srv.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="split the layers over this many ranks, one stage each (launched as above)",
    )
    srv.add_argument(
        "--chat-template", default=None, help="a Jinja file used instead of the model's own"
    )
    srv.add_argument(
        "--max-request-bytes", type=int, default=2 * 2**20, help="larger bodies get 413"
    )
    for name, what in (  # the defaults are minillm.serving.http.Timeouts'
        ("idle", "a kept-alive connection may wait between requests (default 5)"),
        ("header", "a client may take to send a request's headers (default 10)"),
        ("body", "a client may take to send a request's body, then 408 (default 30)"),
        ("shutdown", "SIGTERM lets open requests finish, then 503 (default 5)"),
    ):
        srv.add_argument(f"--{name}-timeout", type=float, help=f"seconds {what}")
    srv.set_defaults(func=_serve)

    from minillm.bench import add_arguments as bench_arguments

    bench = sub.add_parser(
        "bench", help="one workload on every backend: TTFT/TPOT/ITL/E2E, throughput, memory"
    )
    bench_arguments(bench)
    bench.set_defaults(func=_bench)

    doc = sub.add_parser("doctor", help="check packages, device and what each chapter can run")
    doc.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
        sys.exit(f"error: {err}")
