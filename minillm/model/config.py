"""Model hyper-parameters, named as in Hugging Face's `config.json`, and the reading and
writing of that file (transformers 4.x and 5.x layouts)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


# config.json keys that from_hf turns into fields (the rest is carried through unread).
_HF_KEYS_READ = (
    "architectures",
    "model_type",
    "hidden_act",
    "rope_parameters",
    "attention_bias",
    "dtype",
)


@dataclass
class ModelConfig:
    """Hyper-parameters, named as in Hugging Face's `config.json`."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: True
    o_bias: bool = False
    mlp_bias: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # keys we carry unread

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read an HF `config.json` dict (transformers 4.x and 5.x layouts)."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: minillm implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama-style decoders)"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: only 'silu'")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window is not None and window < cfg.get("max_position_embeddings", 0):
            raise ValueError(
                f"sliding_window={window} is not implemented: minillm attends to the full "
                "context; use a checkpoint without a sliding window"
            )
        # transformers 5 nests rope settings under rope_parameters; 4.x uses two keys.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r}: use default, linear or llama3")
        is_qwen = arch == "Qwen2ForCausalLM"
        bias = cfg.get("attention_bias", False)
        consumed = {*cls.__dataclass_fields__, *_HF_KEYS_READ}
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=is_qwen or bias,
            o_bias=bias and not is_qwen,
            mlp_bias=cfg.get("mlp_bias", False),
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            extra={k: v for k, v in cfg.items() if k not in consumed},
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict that transformers (4.x and 5.x) and minillm both read."""
        d = asdict(self)
        extra, arch = d.pop("extra"), d.pop("architecture")
        qkv_bias, o_bias = d.pop("qkv_bias"), d.pop("o_bias")
        is_qwen = arch == "Qwen2ForCausalLM"
        if (is_qwen and o_bias) or (not is_qwen and qkv_bias != o_bias):
            raise ValueError(f"{arch} cannot express qkv_bias={qkv_bias}, o_bias={o_bias}")
        if not is_qwen:
            d["attention_bias"] = qkv_bias
        if d["rope_scaling"] is None:
            del d["rope_scaling"]
        model_type = {"Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
        return {
            **extra,
            **d,
            "architectures": [arch],
            "model_type": model_type.get(arch, "llama"),
            "hidden_act": "silu",
        }
