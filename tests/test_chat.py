"""`Tokenizer.apply_chat_template` and `python -m minillm chat`, on the bundled model given a
ChatML template (fast); tests/test_smollm2.py checks the real chat model against transformers.
"""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

import minillm
from minillm import BUNDLED_DIR, load_tokenizer
from minillm.cli import main

CHATML = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ bos_token + m['role'] + '\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)


@pytest.fixture
def chat_dir(tmp_path):
    """The bundled model with a chat template in tokenizer_config.json."""
    shutil.copytree(BUNDLED_DIR, tmp_path / "chat")
    path = tmp_path / "chat" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": CHATML}))
    return tmp_path / "chat"


def test_template_ids_equal_transformers_from_either_file(chat_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = transformers.AutoTokenizer.from_pretrained(chat_dir).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert load_tokenizer(chat_dir).apply_chat_template(messages) == want
    # transformers 5 writes the template to chat_template.jinja, which wins over the config
    (chat_dir / "chat_template.jinja").write_text(CHATML.replace("\\n", " "))
    assert load_tokenizer(chat_dir).apply_chat_template(messages) != want


def test_template_errors_name_the_fix(chat_dir):
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer().apply_chat_template([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="unknown role tool"):
        load_tokenizer(chat_dir).apply_chat_template([{"role": "tool", "content": "{}"}])
    with pytest.raises(SystemExit, match="no chat template"):
        main(["chat", "--model", str(BUNDLED_DIR)])


def _run_chat(monkeypatch, chat_dir, lines, stop_after=None):
    """Run `chat` on `lines` of input (an exception in the list is raised by input()); with
    `stop_after`, Ctrl-C arrives after that many tokens of the first reply. Returns the
    rendered prompts the model saw."""
    prompts, real_generate, tok = [], minillm.generate, load_tokenizer(chat_dir)
    replies = iter(lines)

    def fake_input(_prompt: str) -> str:
        line = next(replies, EOFError())
        if isinstance(line, BaseException):
            raise line
        return line

    def spy_generate(model, prompt_ids, params, on_token):
        prompts.append(tok.decode(prompt_ids[0], skip_special_tokens=False))
        if stop_after is None or len(prompts) > 1:
            return real_generate(model, prompt_ids, params, on_token=on_token)
        seen = []

        def interrupt(row: int, token: int) -> None:
            on_token(row, token)
            seen.append(token)
            if len(seen) == stop_after:
                raise KeyboardInterrupt

        return real_generate(model, prompt_ids, params, on_token=interrupt)

    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr(minillm, "generate", spy_generate)
    main(["chat", "--model", str(chat_dir), "--temperature", "0", "--max-tokens", "8"])
    return prompts


def test_chat_keeps_history_resets_and_quits(monkeypatch, chat_dir, capsys):
    prompts = _run_chat(
        monkeypatch, chat_dir, ["In the beginning", "", "And God said", "/reset", "Amen", "/exit"]
    )
    assert len(prompts) == 3
    assert prompts[1].startswith(prompts[0]) and prompts[1].count("<|endoftext|>user") == 2
    assert prompts[2].count("<|endoftext|>user") == 1 and "Amen" in prompts[2]
    assert "(conversation cleared)" in capsys.readouterr().out


def test_ctrl_c_stops_the_reply_not_the_program(monkeypatch, chat_dir, capsys):
    prompts = _run_chat(
        monkeypatch, chat_dir, ["In the beginning", KeyboardInterrupt(), "Amen"], stop_after=3
    )
    out = capsys.readouterr().out
    assert out.count("[stopped]") == 1 and "(/exit or Ctrl-D quits)" in out
    assert len(prompts) == 2  # it went on, then EOF ended it
    partial = prompts[1][len(prompts[0]) :].split("<|endoftext|>")[0]
    assert partial and f"{partial} [stopped]" in out  # the cut reply, kept in the history
