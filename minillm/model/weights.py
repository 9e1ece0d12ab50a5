"""Load and save Hugging Face-format checkpoints: config.json + safetensors (sharded too).

The bundled model lives in `minillm/bundled/`; it is the default everywhere so
that every notebook and test runs offline. Real models by name ("smollm2") and GGUF files
resolve to a directory of the same format in the user cache (`minillm.model.named`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from minillm.model.checkpoint import write_checkpoint
from minillm.model.config import ModelConfig
from minillm.model.gguf import cached_hf_dir
from minillm.model.named import MODELS, named_model_dir
from minillm.model.tokenizer import Tokenizer
from minillm.model.transformer import Transformer, rope_inv_freq

BUNDLED_DIR = Path(__file__).parents[1] / "bundled"
# A smaller model with the same tokenizer: the draft for speculative decoding (chapter 10).
BUNDLED_DRAFT_DIR = Path(__file__).parents[1] / "bundled_draft"
_HUB_FILES = ["*.json", "*.safetensors"]


def resolve_model_dir(path_or_id: str | Path | None = None) -> Path:
    """A local checkpoint directory: the bundled model for None; a model name from
    `minillm.model.named.MODELS` ("smollm2"; write ./smollm2 for a folder of that name); a
    GGUF file, converted once into the user cache; a local directory; or a hub id downloaded
    (config, tokenizer and safetensors only) when the hub is reachable."""
    if path_or_id is None:
        return BUNDLED_DIR
    if isinstance(path_or_id, str) and path_or_id in MODELS:
        return named_model_dir(path_or_id)
    path = Path(path_or_id).expanduser()
    if path.suffix == ".gguf":
        return cached_hf_dir(path)
    if path.is_dir():
        return path
    looks_like_id = str(path_or_id).count("/") == 1 and not str(path_or_id).startswith((".", "/"))
    if not looks_like_id:
        raise FileNotFoundError(
            f"model directory {path} does not exist (a model is a directory, a .gguf file, "
            f"a hub id, or a name: {', '.join(MODELS)})"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path_or_id), allow_patterns=_HUB_FILES))
    except Exception as err:  # offline, gated, or a typo: say which fix applies
        raise FileNotFoundError(
            f"could not fetch {path_or_id!r} from the Hugging Face hub ({type(err).__name__}: "
            f"{err}). Offline? Use a local directory, a model name ({', '.join(MODELS)}), or "
            "None for the bundled model."
        ) from err


def load_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from config.json, with EOS/BOS from generation_config.json if present."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a checkpoint directory needs config.json")
    cfg = ModelConfig.from_hf(json.loads(path.read_text()))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        cfg.eos_token_id = gen.get("eos_token_id", cfg.eos_token_id)
        cfg.bos_token_id = gen.get("bos_token_id", cfg.bos_token_id)
    return cfg


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, from one safetensors file or an indexed set of shards."""
    model_dir = Path(model_dir)
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.exists():
        return load_file(single)
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(model_dir / shard))
        return state
    found = sorted(p.name for p in model_dir.iterdir())
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} (found: {found}). "
        "PyTorch .bin checkpoints are not read: re-save with save_pretrained(safe_serialization"
        "=True)"
    )


def _check_tensors(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Fail on a missing, unexpected or wrongly shaped tensor, naming it and both shapes."""
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    for name in [n for n in state if n.endswith("rotary_emb.inv_freq")]:
        del state[name]  # old Llama checkpoints saved the rope table: it is recomputed
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match config.json: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"shape mismatch for {name}: checkpoint has {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """ "auto" (or None): the GPU when CUDA is available, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """ "auto" (or None): on a GPU, bf16 where it has bf16 tensor cores (compute capability
    8.0 and up: A100, L4, H100, what serving engines run) and fp16 below (a T4, 7.5, has
    none: bf16 matmuls are emulated there and Triton's bf16 dots do not compile); fp32 on a
    CPU (where half-precision matmuls are slow and the course compares against fp32
    references). Or a name such as "bfloat16" / "float16" / "float32", or a torch dtype."""
    if dtype in (None, "auto"):
        device = torch.device(device)
        if device.type != "cuda":
            return torch.float32
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float16
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16}
    names |= {"fp16": torch.float16, "half": torch.float16, "float32": torch.float32}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, {', '.join(names)} or a torch dtype")
    return names[dtype]


def load_model(
    path_or_id: str | Path | None = None,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Transformer:
    """A minillm Transformer in eval mode with the checkpoint's weights. `device` and
    `dtype` accept "auto" (see `resolve_device`, `resolve_dtype`)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model_dir = resolve_model_dir(path_or_id)
    cfg = load_config(model_dir)
    with torch.device("meta"):  # no memory or init time for weights we overwrite
        model = Transformer(cfg)
    state = load_state_dict(model_dir)
    _check_tensors(model, state)
    return assign_weights(model, state, dtype, device)


def assign_weights(
    model: Transformer, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> Transformer:
    """Put `state`'s tensors (in `dtype` on `device`) into a model built on the meta device,
    tie the LM head to the embedding where the config says so, and rebuild the rotation
    frequencies there: the model, in eval mode."""
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(model.config).to(device)
    return model.eval()


def load_tokenizer(path_or_id: str | Path | None = None) -> Tokenizer:
    return Tokenizer(resolve_model_dir(path_or_id))


def save_model(model: Transformer, out_dir: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write config.json, generation_config.json and safetensors (sharded past
    `max_shard_bytes`) that both minillm and transformers load."""
    cfg = model.config
    cfg.torch_dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    state = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        del state["lm_head.weight"]
    return write_checkpoint(cfg, state, out_dir, max_shard_bytes)
