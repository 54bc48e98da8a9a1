"""Hugging Face Llama (and Qwen3) ↔ our model and tokenizer.

`save_hf(model, dir)` writes `config.json` + `model.safetensors` that
`transformers.LlamaForCausalLM.from_pretrained(dir)` loads with the same logits; `load_hf(dir)`
reads such a directory (ours, or any Llama checkpoint in safetensors) back into a `Transformer`.
A model with `qk_norm` is written as Qwen3 instead (`Qwen3ForCausalLM`: Llama's layout plus an
RMSNorm over head_dim on each head's queries and keys before rotary, `q_norm` / `k_norm`, with the
same eps as the other norms), and a Qwen3 directory without sliding-window attention is read back.
`save_hf_tokenizer(tokenizer, dir)` writes the SentencePiece model beside them together with the
files `AutoTokenizer` and `LlamaTokenizerFast` load (tokenizer.json, tokenizer_config.json,
special_tokens_map.json), built so that they give exactly our ids (see `fast_tokenizer_json`); a
Hugging Face tokenizer.json is written unchanged, with a tokenizer_config.json naming its special
tokens (`hf_tokenizer_config_dict`).
None of this needs `transformers` or `tokenizers` installed: the formats are plain JSON and safetensors.

Our fused projections map onto Llama's separate ones by row blocks:
qkv_proj = [q_proj; k_proj; v_proj] and (SwiGLU) in_proj = [gate_proj; up_proj].
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from sentencepiece import sentencepiece_model_pb2

from pretrain import atomic
from pretrain.config import ROPE_SCALING_TYPES, ModelConfig, RopeScaling
from pretrain.errors import ConfigError, UserError
from pretrain.model import hf_moe
from pretrain.model.transformer import Transformer
from pretrain.tokenizer import MODEL_FILE, HFTokenizer, Tokenizer

LLAMA_REQUIREMENTS = {  # field: (value Llama has, what to set)
    "norm": ("rmsnorm", "model.norm=rmsnorm"),
    "norm_placement": ("pre", "model.norm_placement=pre"),
    "activation": ("swiglu", "model.activation=swiglu"),
    "positions": ("rope", "model.positions=rope"),
}


def check_llama_compatible(cfg: ModelConfig) -> None:
    """What export needs: Llama's blocks (with `qk_norm`, Qwen3's: the same blocks and QK-norm)."""
    if cfg.moe is not None:
        hf_moe.moe_architecture(cfg)  # refuses a routing no transformers class computes
    for field_name, (required, fix) in LLAMA_REQUIREMENTS.items():
        value = getattr(cfg, field_name)
        if value != required:
            raise UserError(
                f"model.{field_name}={value!r} cannot be expressed as a Hugging Face Llama model "
                f"(Llama has {required!r}); only models trained with {fix} can be exported"
            )


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers architecture a model is exported as: with experts, their class
    (`hf_moe.moe_architecture`); else Qwen3 with QK-norm, Llama without."""
    if cfg.moe is not None:
        return hf_moe.moe_architecture(cfg)
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def llama_config_dict(
    cfg: ModelConfig, token_ids: dict[str, int] | None = None, dtype: str = "float32"
) -> dict:
    """config.json: a LlamaConfig, or with `qk_norm` a Qwen3Config (the same fields, no MLP bias
    field, and sliding-window attention off on every layer)."""
    check_llama_compatible(cfg)
    config = {
        "architectures": [hf_architecture(cfg)],
        "model_type": "qwen3" if cfg.qk_norm else "llama",
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
        # transformers 4.x spells the rotary settings rope_theta + rope_scaling, 5.x rope_parameters
        # (it reads the former too, rope_scaling first): both, the same (`rope_config`)
        **rope_config(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if cfg.moe is not None:
        config = hf_moe.moe_config_dict(cfg, config)
    elif cfg.qk_norm:
        del config["mlp_bias"]  # Qwen3's MLP has no bias switch
        config |= {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": cfg.n_layers,
            "layer_types": ["full_attention"] * cfg.n_layers,
        }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if token_ids and key in token_ids:
            config[key] = token_ids[key]
    return config


def rope_config(cfg: ModelConfig) -> dict:
    """config.json's rotary keys: rope_theta, rope_scaling (null, or `model.rope_scaling` as Meta's
    Llama 3.1 config.json writes it, with rope_type) and rope_parameters (transformers 5's own)."""
    scaling = None
    if cfg.rope_scaling is not None:
        values = {k: v for k, v in asdict(cfg.rope_scaling).items() if k != "type" and v is not None}
        scaling = {"rope_type": cfg.rope_scaling.type} | values
    parameters = (scaling or {"rope_type": "default"}) | {"rope_theta": cfg.rope_theta}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters}


def rope_scaling_from_llama(config: dict, source: str) -> tuple[float, RopeScaling | None]:
    """rope_theta and `model.rope_scaling` from a config.json, read as transformers 5 reads it:
    rope_scaling before rope_parameters, rope_type (or the older type), llama3's original length
    defaulting to max_position_embeddings. Other rules (yarn, dynamic, longrope) are refused."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return theta, None
    if rope_type not in ROPE_SCALING_TYPES:
        raise UserError(
            f"{source}: rope scaling {rope_type!r} is not supported; plain RoPE, llama3 and linear are"
        )
    keys = ["factor"]
    if rope_type == "llama3":
        keys += ["low_freq_factor", "high_freq_factor"]
        original = config.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings", config.get("max_position_embeddings")
        )
        rope = rope | {"original_max_position_embeddings": original}
        keys.append("original_max_position_embeddings")
    try:
        return theta, RopeScaling(type=rope_type, **{k: rope.get(k) for k in keys})
    except ConfigError as exc:
        raise UserError(f"{source}: {exc}") from None


def to_llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.tok_embeddings.weight}
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        q, k, v = layer.attn.qkv_proj.weight.split([q_size, kv_size, kv_size], dim=0)
        out |= {
            prefix + "input_layernorm.weight": layer.attn_norm.weight,
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": layer.attn.o_proj.weight,
            prefix + "post_attention_layernorm.weight": layer.mlp_norm.weight,
        }
        if layer.routed:
            out |= hf_moe.expert_tensors(cfg, layer.mlp, prefix)
        else:
            gate, up = layer.mlp.in_proj.weight.chunk(2, dim=0)
            out |= {
                prefix + "mlp.gate_proj.weight": gate,
                prefix + "mlp.up_proj.weight": up,
                prefix + "mlp.down_proj.weight": layer.mlp.out_proj.weight,
            }
        if cfg.qk_norm:
            out[prefix + "self_attn.q_norm.weight"] = layer.attn.q_norm.weight
            out[prefix + "self_attn.k_norm.weight"] = layer.attn.k_norm.weight
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
    """Write a Llama (with `qk_norm`, Qwen3) `config.json` + `model.safetensors` into out_dir
    (created; files replaced atomically)."""
    check_llama_compatible(model.cfg)
    hf_moe.check_bias_exportable(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.detach().to(hf_moe.file_dtype(name, dtype or t.dtype)).contiguous().cpu()
        for name, t in to_llama_state_dict(model).items()
    }
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = llama_config_dict(model.cfg, token_ids, dtype_name)
    with atomic.atomic_path(out_dir / "model.safetensors") as tmp:
        mode = stat.S_IMODE(tmp.stat().st_mode)  # what open() gives: 0666 minus the umask
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, mode)  # safetensors writes the file anew, readable by its owner only
    atomic.write_json(out_dir / "config.json", config)
    return out_dir


# --------------------------------------------------------------------------- tokenizer files

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
SPACE = "▁"  # SentencePiece's visible space (U+2581)
PIECE = sentencepiece_model_pb2.ModelProto.SentencePiece


def _proto(tokenizer: Tokenizer) -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.processor.serialized_model_proto())
    return proto


def check_tokenizer_exportable(tokenizer: Tokenizer) -> None:
    """Refuse what a tokenizer.json cannot reproduce id for id (our `train_tokenizer` never makes these).
    A Hugging Face tokenizer is a tokenizer.json already."""
    if isinstance(tokenizer, HFTokenizer):
        return
    proto = _proto(tokenizer)
    trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
    problems = {
        "it is a unigram model (Viterbi ties break differently in the tokenizers library)": (
            trainer.model_type != trainer.BPE
        ),
        "it has no byte fallback": not trainer.byte_fallback,
        f"it normalizes text ({normalizer.name})": bool(normalizer.precompiled_charsmap),
        "it removes extra whitespace": normalizer.remove_extra_whitespaces,
        "it does not escape spaces as ▁": not normalizer.escape_whitespaces,
        "it treats whitespace as a suffix": trainer.treat_whitespace_as_suffix,
        "it has user-defined symbols": any(p.type == PIECE.USER_DEFINED for p in proto.pieces),
    }
    for problem, present in problems.items():
        if present:
            raise UserError(
                f"{tokenizer.path}: {problem}, so a Hugging Face tokenizer.json cannot give the same ids; "
                "export a model whose tokenizer was trained by `pretrain tokenizer train --model-type bpe`"
            )


def bpe_merges(tokenizer: Tokenizer) -> list[list[str]]:
    """Every (left, right) pair of pieces that concatenates to a piece, highest-scoring result first.

    SentencePiece's BPE merges any two adjacent symbols whose concatenation is a piece, the highest
    score first; the tokenizers library merges listed pairs, the earliest listed first. Listing all
    of them in score order makes the two agree."""
    proto = _proto(tokenizer)
    # Only normal pieces: byte, control and unused ones never come out of a merge in SentencePiece.
    pieces = {p.piece: (-p.score, i) for i, p in enumerate(proto.pieces) if p.type == PIECE.NORMAL}
    merges = []
    for piece, rank in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                merges.append((rank, cut, [left, right]))
    return [pair for *_, pair in sorted(merges)]


def hf_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """bos/eos/pad ids for config.json and generation_config.json. A tokenizer without a pad piece (an
    imported one) pads with EOS, as fine-tuning does."""
    pad_id = tokenizer.pad_id if tokenizer.pad_id >= 0 else tokenizer.eos_id
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": pad_id}
    return {key: i for key, i in ids.items() if i >= 0}


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """bos/eos/pad/unk as pieces: special_tokens_map.json, and the same keys in tokenizer_config.json."""
    if isinstance(tokenizer, HFTokenizer):  # those it has (a tokenizer without a pad pads with EOS)
        names = {f"{role}_token": token for role, token in tokenizer.tokens.items()}
        names |= {"pad_token": names["pad_token"] or names["eos_token"], "unk_token": tokenizer.unk_token}
        return {key: token for key, token in names.items() if token is not None}
    processor = tokenizer.processor
    ids = {key.removesuffix("_id"): i for key, i in hf_token_ids(tokenizer).items()}
    return {name: processor.id_to_piece(i) for name, i in (ids | {"unk_token": processor.unk_id()}).items()}


def fast_tokenizer_json(tokenizer: Tokenizer) -> dict:
    """tokenizer.json (the `tokenizers` library's format) equivalent to our SentencePiece model.

    - no normalizer: ours is the identity; spaces become ▁ (a Metaspace that neither splits nor
      prepends) and the whole text is one BPE word, as in SentencePiece;
    - BPE over the same vocabulary with `bpe_merges`, and byte fallback to the <0xXX> pieces;
    - a tokenizer with a dummy prefix (older ones) puts ▁ before every text, even one starting with a
      space, as SentencePiece does: a Prepend normalizer, and the decoder strips that one space;
    - with special tokens, a text starts as a document does in training: EOS first.
    This is what transformers' LlamaTokenizerFast builds itself for legacy=False and
    add_prefix_space=False, so both it and AutoTokenizer use this pipeline."""
    proto = _proto(tokenizer)
    specials = [
        _added_token(i, p.piece)
        for i, p in enumerate(proto.pieces)
        if p.type in (PIECE.CONTROL, PIECE.UNKNOWN)
    ]
    decoders = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if tokenizer.adds_dummy_prefix:
        normalizer = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
            ],
        }
        pre_tokenizer = None
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    else:
        normalizer = None
        pre_tokenizer = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "never", "split": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": specials,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": document_template(tokenizer),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokenizer.processor.id_to_piece(tokenizer.processor.unk_id()),
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": {p.piece: i for i, p in enumerate(proto.pieces)},
            "merges": bpe_merges(tokenizer),
        },
    }


def _added_token(token_id: int, content: str) -> dict:
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    return {"id": token_id, "content": content, **flags}


def document_template(tokenizer: Tokenizer) -> dict:
    """`add_special_tokens=True`: EOS before the text, as `Tokenizer.encode_document` (and so
    training) starts every document; a pair is two documents, EOS a EOS b."""
    eos = tokenizer.processor.id_to_piece(tokenizer.eos_id)

    def piece(type_id: int) -> dict:
        return {"SpecialToken": {"id": eos, "type_id": type_id}}

    def text(name: str, type_id: int) -> dict:
        return {"Sequence": {"id": name, "type_id": type_id}}

    return {
        "type": "TemplateProcessing",
        "single": [piece(0), text("A", 0)],
        "pair": [piece(0), text("A", 0), piece(1), text("B", 1)],
        "special_tokens": {eos: {"id": eos, "ids": [tokenizer.eos_id], "tokens": [eos]}},
    }


def tokenizer_config_dict(tokenizer: Tokenizer, model_max_length: int) -> dict:
    """tokenizer_config.json. LlamaTokenizer(Fast) rebuilds its pipeline from these flags (not from
    tokenizer.json), which match ours only without a dummy prefix: a tokenizer with one is declared
    as the generic PreTrainedTokenizerFast, which runs tokenizer.json as written.
    split_special_tokens: "</s>" in a text is text, as it is to SentencePiece."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast" if tokenizer.adds_dummy_prefix else "LlamaTokenizer",
        "legacy": False,
        "add_prefix_space": tokenizer.adds_dummy_prefix,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        **special_tokens(tokenizer),
    }


def hf_tokenizer_config_dict(tokenizer: HFTokenizer, model_max_length: int) -> dict:
    """tokenizer_config.json beside an unchanged tokenizer.json: the generic PreTrainedTokenizerFast,
    which runs the file as written, and its special tokens. split_special_tokens: a special token
    written in a text is text, as our ids have it (pretrain/tokenizer.py). Our ids are
    `add_special_tokens=False`'s; with special tokens the file's own post-processor applies."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        **special_tokens(tokenizer),
    }


def generation_config_dict(tokenizer: Tokenizer) -> dict:
    """generation_config.json: the special ids, and `pretrain generate`'s sampling defaults."""
    return {
        **hf_token_ids(tokenizer),
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 50,
        "top_p": 0.95,
        "max_new_tokens": 100,
    }


def save_hf_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, model_max_length: int) -> Path:
    """Write tokenizer.model (a copy of ours), tokenizer.json, tokenizer_config.json,
    special_tokens_map.json and generation_config.json into out_dir, each atomically; for a Hugging
    Face tokenizer, its tokenizer.json byte for byte instead of the first two."""
    check_tokenizer_exportable(tokenizer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, HFTokenizer):
        atomic.write_bytes(out_dir / TOKENIZER_JSON, tokenizer.path.read_bytes())
        config = hf_tokenizer_config_dict(tokenizer, model_max_length)
    else:
        atomic.write_bytes(out_dir / MODEL_FILE, tokenizer.path.read_bytes())
        atomic.write_text(
            out_dir / TOKENIZER_JSON, json.dumps(fast_tokenizer_json(tokenizer), ensure_ascii=False)
        )
        config = tokenizer_config_dict(tokenizer, model_max_length)
    atomic.write_json(out_dir / TOKENIZER_CONFIG, config)
    atomic.write_json(out_dir / SPECIAL_TOKENS_MAP, special_tokens(tokenizer))
    atomic.write_json(out_dir / GENERATION_CONFIG, generation_config_dict(tokenizer))
    return out_dir


# --------------------------------------------------------------------------- loading


DENSE_MODEL_TYPES = ("llama", "qwen3")


def model_config_from_llama(config: dict, source: str = "config.json") -> ModelConfig:
    """Our ModelConfig for a Llama config.json, a Qwen3 one (QK-norm) without sliding windows, or
    one of the mixture-of-experts classes we export to (`hf_moe.moe_from_config`)."""
    model_type = config.get("model_type")
    if model_type not in (*DENSE_MODEL_TYPES, *hf_moe.MODEL_TYPES.values()):
        raise UserError(
            f"{source}: model_type is {model_type!r}, not 'llama' (or 'qwen3', 'qwen3_moe', 'glm4_moe', "
            "'mixtral'): only Llama, Qwen3 and these mixture-of-experts checkpoints can be loaded"
        )
    moe, qk_norm = (None, model_type == "qwen3")
    if model_type not in DENSE_MODEL_TYPES:
        moe, qk_norm = hf_moe.moe_from_config(config, source)
    check_loadable(config, source)
    rope_theta, rope_scaling = rope_scaling_from_llama(config, source)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return ModelConfig(
        preset=None,
        vocab_size=config["vocab_size"],
        d_model=hidden,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,  # (Qwen3's are wider: 32 × 128 on 2048)
        d_ff=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=config.get("initializer_range", 0.02),
        qk_norm=qk_norm,
        moe=moe,
    )


def check_loadable(config: dict, source: str) -> None:
    """What our blocks cannot compute: sliding windows, another activation, biases."""
    layer_types = config.get("layer_types") or []
    windowed = config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types)
    if windowed or (config.get("model_type") == "mixtral" and config.get("sliding_window")):
        raise UserError(f"{source}: sliding-window attention is not supported; only full attention is")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{source}: hidden_act={act!r}; only SiLU-gated (SwiGLU) Llama models are supported")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise UserError(f"{source}: {key}=true; biased Llama variants are not supported")


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
        }
        if cfg.moe is not None and i >= cfg.moe.dense_layers:
            out |= hf_moe.read_experts(cfg, take, src, dst)
        else:
            out[dst + "mlp.in_proj.weight"] = torch.cat(
                [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")]
            )
            out[dst + "mlp.out_proj.weight"] = take(src + "mlp.down_proj.weight")
        if cfg.qk_norm:
            out[dst + "attn.q_norm.weight"] = take(src + "self_attn.q_norm.weight")
            out[dst + "attn.k_norm.weight"] = take(src + "self_attn.k_norm.weight")
    out["norm.weight"] = take("model.norm.weight")
    out["lm_head.weight"] = out["tok_embeddings.weight"] if cfg.tie_embeddings else take("lm_head.weight")
    return out


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """Build our model from a Llama (or Qwen3) directory (`config.json` + safetensors)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} has no config.json: point to a Hugging Face Llama (or Qwen3) directory")
    cfg = model_config_from_llama(json.loads(config_path.read_text()), str(config_path))
    return Transformer.from_state_dict(cfg, read_llama_weights(directory, cfg), dtype)


def read_llama_weights(directory: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Llama (or Qwen3) directory's tensors by our names, for the model `cfg` describes."""
    return from_llama_state_dict(cfg, _read_llama_tensors(Path(directory)))
