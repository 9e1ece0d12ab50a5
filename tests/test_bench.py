"""The benchmark harness: vLLM bench serve's metric definitions on synthetic timestamps,
workloads, a tiny run over in-process backends, unavailable backends listed with a reason,
and an OpenAI-compatible server (minillm's, on a loopback port) measured over HTTP."""

import json
import math

import matplotlib
import pytest
import torch
from serving import CHATML, free_port, running  # a server on a loopback port, in a thread

from minillm import load_tokenizer
from minillm.bench import (
    Trace,
    batching,
    compute_metrics,
    format_table,
    label_of,
    load_workload,
    make_workload,
    parse_backends,
    percentiles,
    plot_results,
    run_bench,
)

matplotlib.use("Agg")
TINY = {"n": 2, "prompt_len": [4, 8], "output_median": 4, "output_clip": [3, 5]}


# ----------------------------------------------------------------- metric definitions
def test_metrics_match_vllm_definitions():
    # request 1: sent at 0, tokens at 0.1, 0.3, 0.6; request 2: sent at 1, one token at 1.5
    a = Trace(0.0, [0.1, 0.3, 0.6], end=0.6, num_tokens=3)
    b = Trace(1.0, [1.5], end=1.5, num_tokens=1)
    m = compute_metrics([a, b], duration=2.0)
    assert m["ttft_ms"]["mean"] == pytest.approx((100 + 500) / 2)
    assert m["ttft_ms"]["p50"] == pytest.approx(300)  # linear interpolation of 100, 500
    # TPOT = (E2E - TTFT) / (n - 1), only for n > 1
    assert m["tpot_ms"]["mean"] == pytest.approx((600 - 100) / 2)
    assert m["itl_ms"]["mean"] == pytest.approx(250) and m["itl_ms"]["p99"] == pytest.approx(299)
    assert m["e2e_ms"]["p50"] == pytest.approx(550)
    assert m["req_s"] == pytest.approx(1.0) and m["output_tok_s"] == pytest.approx(2.0)
    assert m["requests"] == 2 and m["output_tokens"] == 4


def test_percentiles_interpolate_like_numpy():
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5)
    assert all(math.isnan(v) for v in percentiles([]).values())


# ----------------------------------------------------------------- workloads
def test_workload_is_seeded_and_serving_compatible():
    tok = load_tokenizer()
    assert make_workload(tok, 8) == make_workload(tok, 8)
    assert make_workload(tok, 8) != make_workload(tok, 8, seed=1)
    work = make_workload(tok, 64)
    assert all(8 <= len(p) <= 64 and 4 <= n <= 160 for p, n in work)
    assert batching.make_workload(tok, 16) == make_workload(tok, 16)


def test_load_workload_forms(tmp_path):
    tok = load_tokenizer()
    desc, reqs = load_workload("tiny", tok)
    assert desc["name"] == "tiny" and len(reqs) == desc["n"]
    _, fixed = load_workload('{"prompts": ["In the beginning", "Blessed"], "max_tokens": 5}', tok)
    assert [r.max_tokens for r in fixed] == [5, 5]
    assert fixed[0].prompt_ids == tok.encode("In the beginning")
    path = tmp_path / "w.json"
    path.write_text(json.dumps(TINY))
    assert [r.prompt_ids for r in load_workload(str(path), tok)[1]] == [
        r.prompt_ids for r in load_workload(TINY, tok)[1]
    ]
    with pytest.raises(ValueError, match="use one of"):
        load_workload("nope", tok)
    with pytest.raises(ValueError, match="unknown workload keys"):
        load_workload('{"requests": 3}', tok)


def test_parse_backends():
    assert parse_backends("hf, ort") == ["hf", "ort"]
    assert parse_backends("all,hf-compile").count("hf-compile") == 1  # no duplicate rows
    assert parse_backends("all")[:2] == ["hf", "hf-compile"] and "tgi" in parse_backends("all")
    assert parse_backends("openai:http://x:1/v1") == ["openai:http://x:1/v1"]
    with pytest.raises(ValueError, match="unknown backend 'hff'"):
        parse_backends("hf,hff")


# ----------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def tiny_run():
    threads = torch.get_num_threads()
    try:
        backends = ["hf", "ort", "minillm"]
        return run_bench(backends, TINY, concurrency=[1, 2], progress=False, rounds=2)
    finally:
        torch.set_num_threads(threads)


def test_tiny_run_is_well_formed(tiny_run):
    rows = {label_of(r): r for r in tiny_run["results"]}
    assert list(rows) == ["hf", "ort", "minillm", "minillm x2"]  # one row per level if batching
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert r["requests"] == 2 and r["output_tokens"] == tiny_run["workload"]["output_tokens"]
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 < r[k]["p50"] <= r[k]["p99"]
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"] and r["peak_rss_bytes"] > 0
        assert r["same_as_minillm"] == 1.0  # the bundled model: every stack, same greedy tokens
    assert rows["hf"]["concurrency"] == 1 and rows["minillm x2"]["concurrency"] == 2
    assert all(len(r["output_tok_s_rounds"]) == 2 for r in rows.values())  # interleaved rounds
    back = json.loads(json.dumps(tiny_run))
    assert back["workload"]["requests"] == 2
    table = format_table(tiny_run)
    assert all(name in table for name in rows) and "TTFT" in table
    assert plot_results(tiny_run, "output_tok_s").get_ylabel() == "output_tok_s"


def test_unavailable_backends_are_listed_with_a_reason():
    port = free_port()  # nothing listens there
    specs = ["hf-compile", "tensorrt", "vllm", "tgi", f"openai:http://127.0.0.1:{port}"]
    skip = ["hf", "ort", "minillm"]  # measured in tiny_run
    result = run_bench(f"all,{specs[-1]}", TINY, progress=False, warmup=0, skip=skip)
    rows = {r["backend"]: r for r in result["results"]}
    assert set(specs) <= set(rows)
    for name in specs:
        if name == "tensorrt" and torch.cuda.is_available():
            continue
        assert rows[name]["status"] == "skipped" and rows[name]["reason"], name
    assert "opt-in" in rows["hf-compile"]["reason"]
    assert "openai:" in rows["vllm"]["reason"] and "openai-chat:" in rows["tgi"]["reason"]
    assert "no OpenAI-compatible server" in rows[specs[-1]]["reason"]
    assert all("--skip" in rows[name]["reason"] for name in skip)


def test_openai_backend_against_a_minillm_server(model):
    from minillm.engine import Engine
    from minillm.serving.api_server import create_app

    # the bundled model has no chat template: the server is given one (serve --chat-template)
    app = create_app(Engine(model, load_tokenizer(), max_num_seqs=4), "bundled", CHATML)
    with running(app) as url:
        result = run_bench(
            [f"openai:{url}", f"openai-text:{url}", f"openai-chat:{url}/v1"],
            TINY,
            concurrency=2,
            progress=False,
        )
    completions, text, chat = result["results"]
    assert completions["status"] == "ok", completions["reason"]
    assert completions["output_tokens"] == result["workload"]["output_tokens"]
    assert completions["same_as_minillm"] == 1.0 and completions["peak_rss_bytes"] is None
    assert completions["ttft_ms"]["p50"] > 0 and completions["concurrency"] == 2
    assert text["status"] == "ok" and text["output_tokens"] == completions["output_tokens"]
    assert chat["status"] == "ok", chat["reason"]  # a chat prompt: other text, same lengths
    assert chat["output_tokens"] == result["workload"]["output_tokens"]


def test_isolated_run_measures_in_a_child_process():
    result = run_bench(["minillm"], TINY, isolate=True, progress=False, warmup=0)
    (row,) = result["results"]
    assert row["status"] == "ok", row["reason"]
    assert row["backend"] == "minillm" and row["same_as_minillm"] == 1.0
    assert row["peak_rss_bytes"] > 0 and row["output_tokens"] == result["workload"]["output_tokens"]


def test_cli_bench_runs_and_writes_json(tmp_path, capsys):
    """`python -m minillm bench` (the README's command): a run, a table, a JSON file."""
    from minillm.cli import main

    out = tmp_path / "r.json"
    args = ["bench", "--backends", "minillm,tensorrt", "--workload", "tiny"]
    main([*args, "--no-progress", "--json", str(out)])
    result = json.loads(out.read_text())
    status = {r["backend"]: r["status"] for r in result["results"]}
    assert status["minillm"] == "ok" and status["tensorrt"] != "ok"
    assert "SUMMARY bench: 1/2 backends ran" in capsys.readouterr().out


def test_tensorrt_backend_loop_on_the_graph_tensorrt_compiles(model, prompts):
    """The TensorRT backend's cache-free greedy loop, run on CPU on the torch.export graph
    that torch_tensorrt.compile builds its engine from: same tokens as minillm."""
    from minillm import SamplingParams, generate
    from minillm.bench.backends import greedy_without_cache
    from minillm.bench.workload import Request
    from minillm.export.tensorrt import export_program, llm_profile

    context = model.config.max_position_embeddings
    graph = export_program(model, llm_profile(context, max_batch=1, opt_batch=1)).module()
    stamps = []
    req = Request(prompts[1], 6)
    tokens = greedy_without_cache(graph, req, lambda: stamps.append(1), "cpu")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert tokens == generate(model, [prompts[1]], params)[0] and len(stamps) == 6


def test_batching_model_flat_and_curve_costs():
    tokens = {"static": [4, 4, 2, 1], "continuous": [4, 4]}  # tokens computed per step
    flat = {"B=1": 1.0, "B=4": 1.0}  # a step costs the same whatever it computes: steps are time
    assert batching.batching_model(tokens, flat) == {"flat": 2.0, "curve": 2.0}
    linear = {"B=1": 1.0, "B=4": 4.0}  # cost proportional to tokens: only tokens count
    got = batching.batching_model(tokens, linear)
    assert got["flat"] == 2.0 and got["curve"] == pytest.approx(11 / 8)
    # beyond the measured sizes the last segment extends: a 40-token prefill step costs 40
    assert batching.batching_model({"static": [40], "continuous": [4]}, linear)["curve"] == 10.0
