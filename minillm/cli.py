"""`python -m minillm generate | serve | bench | doctor`: the course's command line."""

from __future__ import annotations

import argparse
import sys

import torch


def _generate(args: argparse.Namespace) -> None:
    from minillm import SamplingParams, generate_naive, load_model, load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model, device=device)
    tokenizer = load_tokenizer(args.model)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    prompt_ids = tokenizer.encode(args.prompt)
    out: list[int] = []
    printed = ""

    def stream(token: int) -> None:  # decode the whole tail so multi-byte characters print whole
        nonlocal printed
        out.append(token)
        text = tokenizer.decode(out)
        if not text.endswith("\ufffd"):
            print(text[len(printed) :], end="", flush=True)
            printed = text

    print(args.prompt, end="", flush=True)
    generate_naive(model, prompt_ids, params, on_token=stream)
    print(tokenizer.decode(out)[len(printed) :])
    if args.print_token_ids:
        print(out)


def _serve(args: argparse.Namespace) -> None:
    from minillm.serving.api_server import serve

    serve(
        model=args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
    )


def _bench(args: argparse.Namespace) -> None:
    from minillm.bench import run_from_args

    run_from_args(args)


def _doctor(_args: argparse.Namespace) -> None:
    from minillm.doctor import main as doctor_main

    sys.exit(doctor_main())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (bundled model by default, offline)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="checkpoint directory or hub id")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0, help="0 or -1 disables")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--device", default=None, help="cpu, cuda, mps (default: cuda if present)")
    gen.add_argument(
        "--print-token-ids", action="store_true", help="print the generated ids as a last line"
    )
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible server (bundled model by default)")
    srv.add_argument("--model", default=None, help="checkpoint directory or hub id")
    srv.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to accept other machines")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="the name clients send")
    srv.add_argument("--device", default=None, help="cpu, cuda, mps (default: cuda if present)")
    srv.add_argument("--max-num-seqs", type=int, default=32, help="most sequences per step")
    srv.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: all full-length)"
    )
    srv.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
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
