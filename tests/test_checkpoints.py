"""Checkpoint loading fails loudly and clearly, naming what is wrong."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minillm import load_model, save_model


@pytest.fixture
def checkpoint(tmp_path, tiny_model):
    save_model(tiny_model(), tmp_path)
    return tmp_path


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(checkpoint)


def test_missing_weights_names_the_files_looked_for(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(checkpoint)


def test_unsupported_architecture(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(checkpoint)


def test_shape_mismatch_names_tensor_and_both_shapes(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"model.layers.0.mlp.down_proj.weight.*\(64, 128\).*\(64, 80\)"
    ):
        load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    state = load_file(checkpoint / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        load_model(checkpoint)


def test_unsupported_rope_type_and_sliding_window(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(
        json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn"}})
    )
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        load_model(checkpoint)
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "sliding_window": 16}))
    with pytest.raises(ValueError, match="sliding_window"):
        load_model(checkpoint)


def test_dtype_and_tied_weights_after_load(checkpoint):
    model = load_model(checkpoint, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training


@pytest.mark.parametrize(
    "capability, expected",
    [((7, 5), torch.float16), ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)],
)
def test_auto_dtype_is_bf16_only_where_the_gpu_has_it(monkeypatch, capability, expected):
    """A T4 (7.5) has no bf16 tensor cores: "auto" gives it fp16; an A100 or H100, bf16.
    The capability is faked, so this runs on a CPU; the CPU itself stays fp32."""
    from minillm.model.weights import resolve_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", "cuda") == expected
    assert resolve_dtype("auto", "cuda:0") == expected
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float32", "cuda") == torch.float32  # an explicit name wins


def test_hub_id_downloads_only_config_tokenizer_and_safetensors(checkpoint, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(checkpoint)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    model = load_model("someorg/tiny-llama")
    assert calls == [("someorg/tiny-llama", ["*.json", "*.safetensors"])]
    assert model.config.hidden_size == 64


def test_unreachable_hub_gives_an_error_that_names_the_fix(monkeypatch):
    import huggingface_hub

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="Offline\\? Use a local directory"):
        load_model("someorg/tiny-llama")
