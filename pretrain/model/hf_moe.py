"""Models with experts (`model.moe`) ↔ the mixture-of-experts classes transformers ships.

Each routing is written as the one class that computes it exactly (docs/huggingface.md, Models
with experts), or refused in one line that names what no class expresses:

- sigmoid scores → `Glm4MoeForCausalLM` (DeepSeek-V3's router with one expert group: sigmoid in
  fp32, top-k on the scores plus `e_score_correction_bias` (our balancing bias), weights from the
  unbiased scores, renormalised with `norm_topk_prob`; `n_shared_experts` shared experts of
  `moe_intermediate_size` each, the first `first_k_dense_replace` blocks dense, QK-norm optional);
- softmax with `qk_norm` → `Qwen3MoeForCausalLM` (softmax in fp32, top-k, `norm_topk_prob`,
  `mlp_only_layers` dense);
- softmax without `qk_norm` → `MixtralForCausalLM` (always renormalised, every block routed).

Neither softmax class has shared experts or a bias on the scores that choose, so a softmax model
with either is refused (a bias still all zeros chooses as none: exported).

The experts are written per expert (`mlp.experts.J.gate_proj.weight`, …; Mixtral's `w1`/`w3`/`w2`),
the layout of the released checkpoints and of transformers' own `save_pretrained`, which 4.x reads
as is and 5.x fuses into its 3-D `gate_up_proj`/`down_proj` on load.
"""

from __future__ import annotations

import torch

from pretrain.config import ModelConfig, MoEConfig
from pretrain.errors import UserError

GLM4_MOE, QWEN3_MOE, MIXTRAL = "Glm4MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"
EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
MODEL_TYPES = {GLM4_MOE: "glm4_moe", QWEN3_MOE: "qwen3_moe", MIXTRAL: "mixtral"}
# each class's names for the feed-forward module and an expert's gate, up and down projections
EXPERT_NAMES = {
    GLM4_MOE: ("mlp", "gate_proj", "up_proj", "down_proj"),
    QWEN3_MOE: ("mlp", "gate_proj", "up_proj", "down_proj"),
    MIXTRAL: ("block_sparse_moe", "w1", "w3", "w2"),
}


def moe_architecture(cfg: ModelConfig) -> str:
    """The transformers class that computes this routing exactly, or a one-line refusal."""
    moe = cfg.moe
    if moe.router == "sigmoid":
        if moe.experts < 2:  # Glm4-MoE ranks its expert group by its two best scores
            raise UserError("model.moe.experts=1 cannot be exported (Glm4-MoE needs 2 experts or more)")
        return GLM4_MOE
    if moe.shared_experts:
        raise UserError(
            "model.moe: softmax routing with shared_experts has no transformers class (Qwen3-MoE and "
            "Mixtral have no shared experts); only router=sigmoid (Glm4-MoE) or shared_experts=0 export"
        )
    if cfg.qk_norm:
        return QWEN3_MOE
    if moe.dense_layers or not moe.normalize_top_k:
        raise UserError(
            "model.moe: softmax routing without qk_norm exports as Mixtral, which routes every block "
            "and always renormalises the top-k: it needs dense_layers=0 and normalize_top_k=true "
            "(or qk_norm=true: Qwen3-MoE; router=sigmoid: Glm4-MoE)"
        )
    return MIXTRAL


def check_bias_exportable(model: torch.nn.Module) -> None:
    """A softmax class has no bias on the scores that choose: refused unless every bias is still
    zero (then the choice is the same without it)."""
    cfg = model.cfg
    if cfg.moe is None or moe_architecture(cfg) == GLM4_MOE:
        return
    for i, layer in enumerate(model.layers):
        bias = layer.mlp.router.bias if layer.routed else None
        if bias is not None and bool(bias.ne(0).any()):
            raise UserError(
                f"model.moe: block {i}'s balancing bias is non-zero and {moe_architecture(cfg)} has no "
                "bias on the routing scores (only Glm4-MoE has: router=sigmoid); train with "
                "balance=aux_loss to export softmax routing"
            )


def moe_config_dict(cfg: ModelConfig, config: dict) -> dict:
    """config.json for a model with experts: the dense keys `config` holds, adapted to its class."""
    moe, arch = cfg.moe, moe_architecture(cfg)
    config = {k: v for k, v in config.items() if k != "mlp_bias"}
    config |= {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
    }
    if arch == MIXTRAL:
        return config | {
            "intermediate_size": moe.expert_ffn_dim,
            "num_local_experts": moe.experts,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    config |= {"moe_intermediate_size": moe.expert_ffn_dim, "norm_topk_prob": moe.normalize_top_k}
    if arch == QWEN3_MOE:
        return config | {
            "num_experts": moe.experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.dense_layers)),
            "use_sliding_window": False,
            "sliding_window": None,
        }
    rotary = {"partial_rotary_factor": 1.0}  # (Glm4-MoE's default rotates half of each head)
    return config | {
        "n_routed_experts": moe.experts,
        "n_shared_experts": moe.shared_experts,
        "first_k_dense_replace": moe.dense_layers,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "use_qk_norm": cfg.qk_norm,
        "num_nextn_predict_layers": 0,
        "rope_parameters": config["rope_parameters"] | rotary,
        **rotary,
    }


def expert_tensors(cfg: ModelConfig, mlp: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """One routed block's tensors by the class's names (`prefix`: 'model.layers.N.')."""
    arch = moe_architecture(cfg)
    module, gate, up, down = EXPERT_NAMES[arch]
    base = f"{prefix}{module}."
    out = {base + "gate.weight": mlp.router.gate.weight}
    if arch == GLM4_MOE:
        bias = mlp.router.bias if mlp.router.bias is not None else torch.zeros(cfg.moe.experts)
        out[base + "gate.e_score_correction_bias"] = bias
    for j in range(cfg.moe.experts):
        w_gate, w_up = mlp.experts.w_in[j].chunk(2, dim=0)
        name = f"{base}experts.{j}."
        out |= {name + f"{gate}.weight": w_gate, name + f"{up}.weight": w_up}
        out[name + f"{down}.weight"] = mlp.experts.w_out[j]
    if arch == GLM4_MOE:  # Glm4-MoE always has the shared SwiGLU: without ours, one 0 wide
        shared_in = mlp.shared.in_proj.weight if mlp.shared else torch.empty(0, cfg.d_model)
        shared_out = mlp.shared.out_proj.weight if mlp.shared else torch.empty(cfg.d_model, 0)
        shared_gate, shared_up = shared_in.chunk(2, dim=0) if mlp.shared else (shared_in, shared_in)
        out |= {
            base + "shared_experts.gate_proj.weight": shared_gate,
            base + "shared_experts.up_proj.weight": shared_up,
            base + "shared_experts.down_proj.weight": shared_out,
        }
    return out


def file_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The balancing bias stays fp32 in a bf16 or fp16 export, as in training (and Glm4-MoE's
    buffer): rounded to bf16's 8 mantissa bits, steps of bias_rate would change the choice."""
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype


# --------------------------------------------------------------------------- reading back


def moe_from_config(config: dict, source: str) -> tuple[MoEConfig, bool]:
    """`model.moe` and `qk_norm` of a Qwen3-MoE, Glm4-MoE or Mixtral config.json; what we do not
    compute (expert groups, a scaling factor, partial rotary, sliding windows, sparse steps) refused."""
    model_type = config["model_type"]
    if model_type == "mixtral":
        return MoEConfig(**_routing(config, "softmax", source), normalize_top_k=True), False
    if model_type == "qwen3_moe":
        dense = list(config.get("mlp_only_layers") or [])
        if config.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
            raise UserError(
                f"{source}: experts only in some blocks are not supported; first N dense blocks are"
            )
        routing = _routing(config, "softmax", source)
        return MoEConfig(**routing, dense_layers=len(dense), normalize_top_k=config["norm_topk_prob"]), True
    for key, value in (("n_group", 1), ("topk_group", 1), ("routed_scaling_factor", 1.0)):
        if config.get(key, value) != value:
            raise UserError(f"{source}: {key}={config[key]} is not supported; only {key}={value} is")
    rotary = (config.get("rope_parameters") or {}).get("partial_rotary_factor")
    if config.get("partial_rotary_factor", rotary) != 1.0:
        raise UserError(
            f"{source}: a partial rotary factor is not supported; only partial_rotary_factor=1.0 is"
        )
    moe = MoEConfig(
        **_routing(config, "sigmoid", source) | {"balance": "both", "aux_loss_coef": 1e-4},
        shared_experts=config.get("n_shared_experts", 1),
        dense_layers=config.get("first_k_dense_replace", 1),
        normalize_top_k=config.get("norm_topk_prob", True),
    )
    return moe, bool(config.get("use_qk_norm", False))


def _routing(config: dict, router: str, source: str) -> dict:
    """The MoEConfig fields the classes share; softmax classes train with the auxiliary loss. The
    experts' count is spelt three ways (transformers 5 writes num_local_experts for Qwen3-MoE)."""
    experts = [config[key] for key in EXPERTS_KEYS if config.get(key)]
    if not experts:
        raise UserError(f"{source}: no number of experts ({', '.join(EXPERTS_KEYS)})")
    return {
        "experts": experts[0],
        "top_k": config["num_experts_per_tok"],
        "expert_ffn_dim": config.get("moe_intermediate_size") or config["intermediate_size"],
        "router": router,
        "balance": "aux_loss",
        "aux_loss_coef": config.get("router_aux_loss_coef", 1e-3),
    }


def read_experts(cfg: ModelConfig, take, src: str, dst: str) -> dict[str, torch.Tensor]:
    """One routed block's tensors by our names, from the class's per-expert ones (what
    `save_pretrained` writes too); `take(name)` gives a tensor or refuses."""
    arch = moe_architecture(cfg)
    module, gate, up, down = EXPERT_NAMES[arch]
    base = f"{src}{module}."
    out = {dst + "mlp.router.gate.weight": take(base + "gate.weight")}
    if cfg.moe.uses_bias:
        out[dst + "mlp.router.bias"] = take(base + "gate.e_score_correction_bias").float()
    experts = [f"{base}experts.{j}." for j in range(cfg.moe.experts)]
    out[dst + "mlp.experts.w_in"] = torch.stack(
        [torch.cat([take(e + f"{gate}.weight"), take(e + f"{up}.weight")]) for e in experts]
    )
    out[dst + "mlp.experts.w_out"] = torch.stack([take(e + f"{down}.weight") for e in experts])
    if cfg.moe.shared_experts:
        shared = base + "shared_experts."
        out[dst + "mlp.shared.in_proj.weight"] = torch.cat(
            [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")]
        )
        out[dst + "mlp.shared.out_proj.weight"] = take(shared + "down_proj.weight")
    return out
