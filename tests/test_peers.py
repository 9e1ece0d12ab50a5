"""The CPU peers benchmark's pieces (`minillm.bench.peers`; the run itself needs llama-server
and minutes, so it is `python -m benchmarks.peers`, not a test)."""

from __future__ import annotations

import pytest
import torch

from minillm import load_model
from minillm.bench import peers
from minillm.export.gguf import export_gguf
from minillm.quant.linear import QuantLinear


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_the_minillm_formats_are_the_model_in_each_format(model):
    formats = peers.minillm_formats(model)
    int4 = "int4 q4_1-g32" if peers.int_backend() == "c" else "int4 int4-g128"
    assert list(formats) == ["fp32", "int8", int4]
    ids = torch.tensor([[1, 5, 9, 200, 31]])
    with torch.inference_mode():
        want = model(ids)
        assert torch.allclose(formats["fp32"](ids), want, atol=1e-5)  # the decode layout
        for name in ("int8", int4):
            m = formats[name]
            quantized = [n for n, mod in m.named_modules() if isinstance(mod, QuantLinear)]
            assert "lm_head" in quantized and all(
                mod.kernel is not None for mod in m.modules() if isinstance(mod, QuantLinear)
            ), f"{name}: every linear, the head included, on a CPU kernel"
            agree = (m(ids).argmax(-1) == want.argmax(-1)).float().mean().item()
            assert agree >= 0.6, f"{name} agrees with fp32 on {agree:.0%} of next tokens"


def test_a_gguf_reads_each_tensor_once(tmp_path):
    f32 = peers.gguf_bytes(export_gguf(None, tmp_path / "f32.gguf"))
    q8 = peers.gguf_bytes(export_gguf(None, tmp_path / "q8.gguf", "q8_0"))
    params = sum(p.numel() for p in load_model().parameters())  # the tied head counts once
    assert f32 == 4 * params
    assert 34 / 32 * params * 0.98 < q8 < 34 / 32 * params + 4 * 8192  # Q8_0 blocks, f32 norms


def test_pair_ratios_pair_the_rounds():
    result = {
        "formats": {
            "minillm fp32": {"tokens_per_s": [10.0, 12.0]},
            "minillm int8": {"tokens_per_s": [20.0, 18.0]},
            "minillm int4 q4_1-g32": {"tokens_per_s": [30.0, 33.0]},
            "llama.cpp f32": {"tokens_per_s": [20.0, 24.0]},
            "llama.cpp Q8_0": {"tokens_per_s": [20.0, 20.0]},
            "llama.cpp Q4_1": {"tokens_per_s": [60.0, 33.0]},
        }
    }
    assert peers.pair_ratios(result) == {
        "fp32 / f32": [0.5, 0.5],
        "int8 / Q8_0": [1.0, 0.9],
        "int4 q4_1-g32 / Q4_1": [0.5, 1.0],
    }
