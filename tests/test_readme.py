"""What a learner reads first stays true and short.

- README.md's headline-results table is what `python -m benchmarks.readme_table` writes from
  benchmarks/results/*.json now (no figure typed by hand, none left stale);
- README.md stays at most 2,000 words: the minutiae live in docs/;
- README.md, CLAIMS.md and docs/*.md tell no internal history (issue numbers, re-measures,
  "added in ...", sessions, branches): they describe the course as it is;
- every page the README links to exists, and so does every relative link in the docs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import FIGURE

from benchmarks import readme_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_WORDS = 2000
PAGES = [README, ROOT / "CLAIMS.md", *sorted((ROOT / "docs").glob("*.md"))]
REQUIRED_DOCS = ["docs/benchmarks.md", "docs/llama_cpp.md", "docs/server.md"]
# Commands other tests and the Makefile rely on the README to show.
COMMANDS = [
    "make course",
    "make test",
    "make grade CH=",
    "make venv GPU=1",
    "python -m minillm serve",
    "python -m minillm bench",
    "python -m benchmarks.readme_table",
]
HISTORY = {
    "an issue number": r"\b[Ii]ssues? #?\d+",
    "a #N reference": r"(?<![\w&#/])#\d+\b",
    "a pull request": r"\b(?:PR|[Pp]ull request) #?\d+",
    "a re-measure": r"\b[Rr]e-?measur",
    "'added in'": r"\b[Aa]dded in\b",
    "a session": r"\b(?:this|that|earlier|previous|last) session\b",
    "a previous run": r"\bprevious (?:committed )?run\b",
    "'earlier that day'": r"\bearlier that day\b",
    "a branch or tree": r"\b(?:this|that) (?:branch|tree)\b",
    "an old default": r"\b(?:now the default|old default)\b",
    "a dated change": r"\b(?:[Bb]efore|[Aa]fter|[Ss]ince|[Uu]ntil) 20\d\d-\d\d-\d\d\b",
}
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def history_in(text: str) -> list[str]:
    """'what: the matched text' for each piece of internal history in `text`."""
    found = []
    for what, pattern in HISTORY.items():
        found += [f"{what}: {m.group(0)!r}" for m in re.finditer(pattern, text)]
    return found


def relative_links(path: Path) -> list[str]:
    """The targets of `path`'s Markdown links that point into the repository."""
    links = [link.split("#")[0] for link in LINK_RE.findall(path.read_text())]
    return [link for link in links if link and not re.match(r"[a-z]+:", link)]


def test_the_results_table_is_what_the_script_writes_now():
    text = README.read_text()
    block = readme_table.current(text)
    assert block is not None, (
        f"README.md lacks {readme_table.BEGIN!r} ... {readme_table.END!r}: put them back, "
        f"then run {readme_table.COMMAND}"
    )
    assert block == readme_table.block(), (
        f"README.md's results table is out of date with benchmarks/results/: run "
        f"{readme_table.COMMAND}"
    )


def test_every_row_names_a_results_file_that_exists():
    rows = [make() for make in readme_table.ROWS]
    assert 6 <= len(rows) <= 12
    for row in rows:
        assert row.files and all((readme_table.RESULTS / f).is_file() for f in row.files), row


def test_a_range_is_never_only_the_best():
    assert readme_table.span([1.0, 1.5, 1.2]) == "1.00-1.50x"
    assert readme_table.span([1.004, 0.996]) == "1.00x"
    assert readme_table.span([0.1, 0.2], readme_table.delta) == "+10.0% to +20.0%"


def test_the_readme_is_at_most_2000_words():
    words = len(README.read_text().split())  # what `wc -w` counts
    assert words <= MAX_WORDS, (
        f"README.md has {words} words (at most {MAX_WORDS}): move detail to a docs/ page "
        "and link it"
    )


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_internal_history(page):
    found = history_in(page.read_text())
    assert not found, (
        f"{page.relative_to(ROOT)} narrates internal history; say what is true now, and "
        f"where a figure comes from (its results file), instead: {found}"
    )


def test_the_history_check_catches_what_it_should():
    caught = "issue 12's goal; see #14; a re-measure on 2026-12-01; added in issue 16"
    assert len(history_in(caught)) >= 4
    assert history_in("a measured 1.3x; chapter 08, section 6; `--threads 1`; [x](#top)") == []


def test_the_readme_links_its_docs_pages_and_they_exist():
    links = relative_links(README)
    for page in REQUIRED_DOCS:
        assert page in links, f"README.md does not link {page}"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to pages that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES[1:], ids=[str(p.relative_to(ROOT)) for p in PAGES[1:]])
def test_every_relative_link_in_the_docs_exists(page):
    missing = [link for link in relative_links(page) if not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: {missing}"


def test_the_readme_shows_the_commands_the_course_relies_on():
    text = README.read_text()
    missing = [command for command in COMMANDS if command not in text]
    assert not missing, f"README.md no longer shows {missing}"


def test_claims_decode_roofline_figures_are_the_results_files():
    """CLAIMS 05.5 quotes the committed roofline runs: each range it states is the one the
    results file gives now (a re-run that moves a figure fails this until the row follows)."""
    d = readme_table.load("decode-roofline-smollm2.json")
    runs = d["runs"]
    compiled, layout = "compiled (frozen weights, max-autotune)", "decode layout"

    def over(fn, fmt=readme_table.x):
        return readme_table.span([fn(r) for r in runs], fmt)

    peer = [r["variants"][compiled]["tokens_per_s"] / x for r in runs for x in r["peer"]["rounds"]]
    want = [
        f"{over(lambda r: r['variants'][compiled]['speedup'])} the eager step as loaded",
        f"{over(lambda r: r['variants'][compiled]['tokens_per_s'] / r['variants'][layout]['tokens_per_s'])}"  # noqa: E501
        " the eager step with the decode layout",
        f"{over(lambda r: r['variants'][compiled]['fraction_of_bound'], readme_table.pct)} of the"
        " read-bandwidth bound",
        f"{readme_table.span(peer)} llama.cpp f32",
        f"the first compile took {runs[0]['variants'][compiled]['compile_s']:.0f} s",
        f"{len(runs)} committed runs (`python -m benchmarks.kv_cache --model smollm2 --roofline "
        f"--llama-cpp --runs {len(runs)}`)",
    ]
    row = next(line for line in (ROOT / "CLAIMS.md").read_text().splitlines() if "| 05.5 |" in line)
    missing = [w for w in want if w not in row]
    assert not missing, f"CLAIMS 05.5 should state {missing} (from the results file)"


KEYS, SERVERS = ("output_tok_s", "ttft.p50", "tpot.p50"), ("minillm", "llama-server")


def test_claims_llama_server_figures_are_the_results_files():
    """CLAIMS 08.8 quotes the committed minillm-vs-llama-server run: medians over its rounds
    and the range of the per-round ratio, as the results file gives them now."""
    from minillm.bench.llama_cpp import median_of, round_ratios

    d = readme_table.load("llama-server-smollm2.json")
    res = d["8"]
    med = {
        name: {
            "tok_s": median_of(res[name], "output_tok_s"),
            "ttft": median_of(res[name], "ttft", "p50"),
            "tpot": median_of(res[name], "tpot", "p50"),
        }
        for name in ("minillm", "llama-server")
    }
    a, b = med["minillm"], med["llama-server"]
    rounds = round_ratios(res["minillm"], res["llama-server"])
    want = [
        f"{d['meta']['repeats']} rounds",
        f"minillm {a['tok_s']:.0f} vs llama-server {b['tok_s']:.0f} output tok/s, "
        f"{a['tok_s'] / b['tok_s']:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f}x)",
        f"TTFT p50 {1e3 * a['ttft']:.0f} vs {1e3 * b['ttft']:.0f} ms",
        f"TPOT p50 {1e3 * a['tpot']:.0f} vs {1e3 * b['tpot']:.0f} ms",
        f"same greedy text {sum(res['same_greedy'])}/{len(res['same_greedy'])}",
    ]
    row = next(line for line in (ROOT / "CLAIMS.md").read_text().splitlines() if "| 08.8 |" in line)
    missing = [w for w in want if w not in row]
    assert not missing, f"CLAIMS 08.8 should state {missing} (from the results file)"
    page = (ROOT / "docs" / "llama_cpp.md").read_text()
    for level in d["meta"]["concurrency"]:  # a table for each C, in its own section
        res = d[str(level)]
        a, b = ({k: median_of(res[name], *k.split(".")) for k in KEYS} for name in SERVERS)
        rounds = round_ratios(res["minillm"], res["llama-server"])
        section = page.split(f"### {level} request")[1].split("###")[0]
        table = [
            f"| output tok/s, median of {len(rounds)} rounds | {a['output_tok_s']:.1f} | "
            f"{b['output_tok_s']:.1f} |",
            f"| TTFT p50, ms (median of rounds) | {1e3 * a['ttft.p50']:.0f} | "
            f"{1e3 * b['ttft.p50']:.0f} |",
            f"| TPOT p50, ms (median of rounds) | {1e3 * a['tpot.p50']:.0f} | "
            f"{1e3 * b['tpot.p50']:.0f} |",
            f"{a['output_tok_s'] / b['output_tok_s']:.2f}x llama-server's "
            f"({min(rounds):.2f}-{max(rounds):.2f}x",
        ]
        missing = [w for w in table if w not in section]
        assert not missing, f"docs/llama_cpp.md's C={level} part should state {missing}"


# A figure a docs page states is a setting, a test's bound or arithmetic (listed here with
# why), or a measurement a test holds to its results file (docs/llama_cpp.md's table, above).
# Anything measured otherwise belongs in a notebook or a results file.
DOCS_FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x|\s?(?:%|ms|µs|s|GB/s|MiB|GiB|tok/s))(?![\w/])"
)
DOCS_STATED = {
    "benchmarks.md": {"30 s": "how long a command takes, roughly"},
    "choosing.md": {"5 ms": "PeakMemory's sampling interval, a setting"},
    "kv_cache.md": {"512 MiB": "the size of the buffer whose sum measures the read bandwidth"},
    "onnx.md": {"4x": "fp32 to int8 is 4 bytes to 1: arithmetic"},
    "server.md": {"2 MiB": "the --max-request-bytes default", "0.3 s": "a test's bound"},
    "llama_cpp.md": {"90%": "a test's bound"},
}


def _llama_server_ratios() -> set[str]:
    """The ratios docs/llama_cpp.md states beside its tables, which the test above holds
    to the results file: each C's ratio of medians and its range over rounds."""
    from minillm.bench.llama_cpp import median_of, round_ratios

    d = readme_table.load("llama-server-smollm2.json")
    stated = set()
    for level in d["meta"]["concurrency"]:
        ours, theirs = d[str(level)]["minillm"], d[str(level)]["llama-server"]
        rounds = round_ratios(ours, theirs)
        ratio = median_of(ours, "output_tok_s") / median_of(theirs, "output_tok_s")
        stated |= {f"{v:.2f}x" for v in (ratio, min(rounds), max(rounds))}
    return stated


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_a_docs_page_states_no_untested_measurement(page):
    stated = set(DOCS_STATED.get(page.name, {}))
    if page.name == "llama_cpp.md":
        stated |= _llama_server_ratios()
    strays = [f for f in FIGURE.findall(page.read_text()) if f not in stated]
    assert not strays, (
        f"docs/{page.name} states {strays}: a measurement belongs in a notebook's output or "
        "a results file (read by code); a setting or arithmetic goes in DOCS_STATED with why"
    )


def test_a_generated_part_is_checked_without_being_written(tmp_path, capsys):
    from benchmarks import generated

    page = tmp_path / "PAGE.md"
    page.write_text("old")
    assert generated.rewrite(page, "new", "table", "make it", check=True) == 1
    assert page.read_text() == "old" and "out of date, run make it" in capsys.readouterr().err
    assert generated.rewrite(page, "new", "table", "make it", check=False) == 0
    assert page.read_text() == "new"
    assert generated.rewrite(page, "new", "table", "make it", check=True) == 0


def test_the_results_files_table_says_who_reads_each_file():
    """docs/benchmarks.md lists every committed results file with the notebooks whose code
    reads it and whether the README's table does: a reader added or dropped shows up here."""
    rows = re.findall(
        r"^\| (`[^|]+`) \| [^|]+ \| ([^|]+) \|$",
        (ROOT / "docs" / "benchmarks.md").read_text(),
        re.M,
    )
    code = {
        p.name[:2]: "\n".join(
            "".join(c["source"])
            for c in json.loads(p.read_text())["cells"]
            if c["cell_type"] == "code"
        )
        for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    }
    table_code = (ROOT / "benchmarks" / "readme_table.py").read_text()
    listed = set()
    for names, readers in rows:
        first, *more = re.findall(r"`([^`]+)`", names)
        stem = first.split("-smollm2")[0] + "-smollm2"  # `-zen4.json`: another machine's file
        files = [first] + [stem + m if m.startswith("-") else m for m in more]
        for name in files:
            listed.add(name)
            family = re.escape(name.split("-smollm2")[0]) + r"-smollm2\*"
            want = {n for n, text in code.items() if name in text or re.search(family, text)}
            if name in table_code or re.search(family, table_code):
                want.add("README")
            got = set(re.findall(r"\b(\d\d|README)\b", readers.split(";")[0]))
            assert got == want, (
                f"docs/benchmarks.md: {name} is read by {sorted(want)}, not {sorted(got)}"
            )
    committed = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    assert committed == listed, f"results files not listed: {sorted(committed - listed)}"
