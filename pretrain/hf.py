"""Hugging Face Llama ↔ our model.

`save_hf(model, dir)` writes `config.json` + `model.safetensors` that
`transformers.LlamaForCausalLM.from_pretrained(dir)` loads with the same logits; `load_hf(dir)`
reads such a directory (ours, or any Llama checkpoint in safetensors) back into a `Transformer`.
Neither needs `transformers` installed: the format is plain JSON and safetensors.

Our fused projections map onto Llama's separate ones by row blocks:
qkv_proj = [q_proj; k_proj; v_proj] and (SwiGLU) in_proj = [gate_proj; up_proj].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pretrain import atomic
from pretrain.config import ModelConfig
from pretrain.errors import UserError
from pretrain.model import Transformer

LLAMA_REQUIREMENTS = {  # field: (value Llama has, what to set)
    "norm": ("rmsnorm", "model.norm=rmsnorm"),
    "norm_placement": ("pre", "model.norm_placement=pre"),
    "activation": ("swiglu", "model.activation=swiglu"),
    "positions": ("rope", "model.positions=rope"),
}


def check_llama_compatible(cfg: ModelConfig) -> None:
    for field_name, (required, fix) in LLAMA_REQUIREMENTS.items():
        value = getattr(cfg, field_name)
        if value != required:
            raise UserError(
                f"model.{field_name}={value!r} cannot be expressed as a Hugging Face Llama model "
                f"(Llama has {required!r}); only models trained with {fix} can be exported"
            )


def llama_config_dict(
    cfg: ModelConfig, token_ids: dict[str, int] | None = None, dtype: str = "float32"
) -> dict:
    check_llama_compatible(cfg)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if token_ids and key in token_ids:
            config[key] = token_ids[key]
    return config


def to_llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.tok_embeddings.weight}
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        q, k, v = layer.attn.qkv_proj.weight.split([q_size, kv_size, kv_size], dim=0)
        gate, up = layer.mlp.in_proj.weight.chunk(2, dim=0)
        out |= {
            prefix + "input_layernorm.weight": layer.attn_norm.weight,
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": layer.attn.o_proj.weight,
            prefix + "post_attention_layernorm.weight": layer.mlp_norm.weight,
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": layer.mlp.out_proj.weight,
        }
    out["model.norm.weight"] = model.norm.weight
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    return out


def save_hf(
    model: Transformer,
    out_dir: str | Path,
    token_ids: dict[str, int] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a Llama `config.json` + `model.safetensors` into out_dir (created; files replaced atomically)."""
    check_llama_compatible(model.cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to(dtype or t.dtype).contiguous().cpu()
        for name, t in to_llama_state_dict(model).items()
    }
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = llama_config_dict(model.cfg, token_ids, dtype_name)
    with atomic.atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    atomic.write_json(out_dir / "config.json", config)
    return out_dir


# --------------------------------------------------------------------------- loading


def model_config_from_llama(config: dict, source: str = "config.json") -> ModelConfig:
    model_type = config.get("model_type")
    if model_type != "llama":
        raise UserError(
            f"{source}: model_type is {model_type!r}, not 'llama': only Llama checkpoints can be loaded"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{source}: hidden_act={act!r}; only SiLU-gated (SwiGLU) Llama models are supported")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise UserError(f"{source}: {key}=true; biased Llama variants are not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise UserError(f"{source}: rope scaling {rope_type!r} is not supported; only plain RoPE is")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise UserError(
            f"{source}: head_dim={head_dim} × {heads} heads != hidden_size={hidden}; not supported"
        )
    return ModelConfig(
        preset=None,
        vocab_size=config["vocab_size"],
        d_model=hidden,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        d_ff=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=config.get("initializer_range", 0.02),
    )


def _read_llama_tensors(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise UserError(
            f"{directory}: no model.safetensors (or index): only safetensors checkpoints are loaded"
        )
    tensors = {}
    for name in files:
        with safe_open(directory / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = f.get_tensor(key)
    return tensors


def from_llama_state_dict(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise UserError(f"checkpoint lacks tensor {name!r}: the files do not match config.json")
        return tensors[name]

    out = {"tok_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out |= {
            dst + "attn_norm.weight": take(src + "input_layernorm.weight"),
            dst + "attn.qkv_proj.weight": torch.cat(
                [take(src + f"self_attn.{p}_proj.weight") for p in ("q", "k", "v")], dim=0
            ),
            dst + "attn.o_proj.weight": take(src + "self_attn.o_proj.weight"),
            dst + "mlp_norm.weight": take(src + "post_attention_layernorm.weight"),
            dst + "mlp.in_proj.weight": torch.cat(
                [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]
            ),
            dst + "mlp.out_proj.weight": take(src + "mlp.down_proj.weight"),
        }
    out["norm.weight"] = take("model.norm.weight")
    out["lm_head.weight"] = out["tok_embeddings.weight"] if cfg.tie_embeddings else take("lm_head.weight")
    return out


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """Build our model from a Llama directory (`config.json` + safetensors)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} has no config.json: point to a Hugging Face Llama model directory")
    cfg = model_config_from_llama(json.loads(config_path.read_text()), str(config_path))
    return Transformer.from_state_dict(cfg, from_llama_state_dict(cfg, _read_llama_tensors(directory)), dtype)
