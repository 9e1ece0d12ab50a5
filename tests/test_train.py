"""The training script runs end to end on a slice and writes a checkpoint both libraries load."""

import json

import torch
import transformers

from minillm import load_model
from minillm.training.train import main


def test_train_a_few_steps_on_a_slice(tmp_path):
    main(
        [
            "--out",
            str(tmp_path),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--max-verses",
            "2000",
            "--vocab-size",
            "512",
            "--dim",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
        ]
    )
    metrics = json.loads((tmp_path / "train_metrics.json").read_text())
    assert metrics["val_perplexity"] > 1 and metrics["tokens_seen"] == 3 * 2 * 32
    assert "Reproduce" in (tmp_path / "README.md").read_text()
    ids = torch.randint(0, 512, (1, 16))
    ours = load_model(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_a_draft_reuses_the_target_tokenizer(tmp_path):
    small = ["--steps", "1", "--warmup", "1", "--max-verses", "2000", "--dim", "16"]
    small += ["--layers", "1", "--heads", "1", "--kv-heads", "1", "--batch-size", "1"]
    small += ["--seq-len", "32"]
    main(["--out", str(tmp_path / "target"), "--vocab-size", "300", *small])
    main(["--out", str(tmp_path / "draft"), "--tokenizer", str(tmp_path / "target"), *small])
    target, draft = (tmp_path / d / "tokenizer.json" for d in ("target", "draft"))
    assert json.loads(draft.read_text()) == json.loads(target.read_text())
    assert load_model(tmp_path / "draft").config.vocab_size == 300
