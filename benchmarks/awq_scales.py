"""Chapter 06 benchmark: AWQ's two scale families, compared on training text only.

    python -m benchmarks.awq_scales [--model smollm2] [--group G] [--threads N]
                                    [--json out.json]

`minillm.quant.awq` searches either activation scales s = mean|x|^alpha (the paper's) or
duo scales mean|x|^alpha / mean|w_hat|^(1 - alpha) (AutoAWQ's). Which one is the default
is a modelling choice, so it is made here on KJV *training* text, never on the held-out
text `quant_methods` scores: both families are fitted on `calibration_batches` (4 x 4 x
256 tokens, as `quant_methods`), and the perplexity of fp32, round-to-nearest and each
AWQ model is measured on those fitted tokens and on as many other training pieces, each
halfway between two calibration pieces (text the search never saw). The figure of merit
is the share of round-to-nearest's perplexity loss each family wins back
(`minillm.bench.awq_scales.compare_families`).
"""

from __future__ import annotations

from typing import Any

from benchmarks import report
from minillm import load_model, load_tokenizer
from minillm.bench import awq_scales as bench
from minillm.bench.quant_decode import group_size_for


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = report.parser(__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--group", type=int, default=None, help="int4 group size")
    args = ap.parse_args(argv)
    name = None if args.model == "bundled" else args.model
    base, tok = load_model(name), load_tokenizer(name)
    scheme = f"int4-g{args.group or group_size_for(base)}"
    run = report.start(f"awq_scales {args.model} {scheme}", args)
    result = {"model": args.model, "scheme": scheme, **bench.compare_families(base, tok, scheme)}
    parts = [
        f"{k} recovers {v['fitted']:.0%} (fitted) / {v['unseen']:.0%} (unseen training text)"
        for k, v in result["recovered"].items()
    ]
    return run.finish(result, "; ".join(parts))


if __name__ == "__main__":
    main()
