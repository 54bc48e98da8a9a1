"""The training step's variants that the GPU check tries in one call (`scripts/gpu_check.sh --parts
variants`, docs/gpu.md): per model, the baseline (the step before issue 55's levers), each lever
alone, all of them together, and all of them at the larger micro-batch the memory plan allows —
each a `pretrain bench train MODEL --ours-only` process of its own. This module is the pure part:
which variants, in which order, what each one's entry in `variants.json` holds, and the choice.

The levers are run-config keys, so that the chosen variant becomes a train config's settings:
`engine.one_host_read` (the step's one host read: pretrain/parallel/norm_gate.py), `loss.kernel`
(`compiled`, `liger`: pretrain/model/loss.py), `engine.attention` (cuDNN's SDPA first) and
`engine.compile_head` (the final norm, head and loss compiled as one graph).

`chosen`, per model: the fastest variant (tokens/s) whose first-step loss is within RELATIVE of the
baseline's — a lever that changes the numbers beyond rounding is never chosen. The larger
micro-batch's batch starts with the baseline's windows (`bench train` makes its batch from the
seed on the host), so its first loss is the same function of more windows of random tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

RELATIVE = 1e-3  # a variant's first-step loss against the baseline's, relative
BASELINE = (
    "engine.one_host_read=false",
    "loss.kernel=chunked",
    "engine.attention=flash",
    "engine.compile_head=false",
)
LEVERS = {  # each alone: the baseline with this one change
    "one_read": ("engine.one_host_read=true",),
    "loss_liger": ("loss.kernel=liger",),
    "loss_compiled": ("loss.kernel=compiled",),
    "cudnn_attention": ("engine.attention=cudnn",),
    "compiled_head": ("engine.compile_head=true",),
}
ALL = ("engine.one_host_read=true", "loss.kernel=liger", "engine.attention=cudnn", "engine.compile_head=true")
# What a CPU cannot show (`--cpu`): the lever's variant is skipped with this reason.
NOT_ON_A_CPU = {
    "one_read": "on a CPU the variant `all` is this lever alone: the others cannot run here",
    "loss_liger": "Liger-Kernel's kernels are Triton's, for CUDA GPUs: on a CPU loss.kernel=liger runs as chunked",
    "cudnn_attention": "cuDNN attention is a CUDA backend: a CPU runs SDPA's own kernels either way",
    "loss_compiled": "compiling the chunk takes minutes on this CPU and is not faster there (docs/performance.md); "
    "tests/integration/test_compile.py runs it against the reference",
    "compiled_head": "--cpu runs with compile off (minutes of compiling here); tests/unit/test_compiled_path.py "
    "traces it as one graph",
}
FIELDS = (
    "name",
    "tokens_per_second",
    "mfu",
    "first_loss",
    "host_syncs_per_step",
    "peak_memory_bytes",
    "skipped",
)


@dataclass(frozen=True)
class Variant:
    model: str  # a config `bench train` takes
    name: str  # baseline, all, all_mbN, or a lever's name
    overrides: tuple[str, ...]  # KEY=VALUE on the run config
    micro_batch_size: int
    skipped: str | None = None  # why it is not run (a CPU cannot show it)

    @property
    def label(self) -> str:
        return f"{self.model}/{self.name}"


def planned(batches: dict[str, tuple[int, int]], cpu: bool) -> list[Variant]:
    """The variants in the order they run, most telling first, so that a call cut short loses only
    attribution: per model the baseline, all together and all at the larger micro-batch; then each
    lever alone, model by model. `batches`: model → (micro-batch, the larger one)."""
    first, levers = [], []
    for model, (micro, larger) in batches.items():
        first += [
            Variant(model, "baseline", BASELINE, micro),
            Variant(model, "all", ALL, micro),
            Variant(model, f"all_mb{larger}", ALL, larger),
        ]
        levers += [
            Variant(model, name, BASELINE + change, micro, NOT_ON_A_CPU.get(name) if cpu else None)
            for name, change in LEVERS.items()
        ]
    return first + levers


def entry(variant: Variant, bench: dict | None, skipped: str | None = None) -> dict:
    """A variant's row of variants.json from its `bench train --json` result (None: not run, and why)."""
    if bench is None:
        return {
            "name": variant.label,
            **{k: None for k in FIELDS[1:-1]},
            "skipped": skipped or variant.skipped,
        }
    return {
        "name": variant.label,
        "tokens_per_second": bench["ours_tokens_per_sec"],
        "mfu": bench["ours_mfu"],
        "first_loss": bench["ours_first_loss"],
        "host_syncs_per_step": bench["host_syncs_per_step"]["ours"],
        "peak_memory_bytes": bench["ours_step_peak_memory_bytes"],
        "skipped": None,
    }


def choose(entries: list[dict]) -> dict[str, str | None]:
    """Per model: the fastest entry whose first-step loss is within RELATIVE of its baseline's
    (None: no baseline ran)."""
    chosen: dict[str, str | None] = {}
    for model in dict.fromkeys(e["name"].split("/")[0] for e in entries):
        ran = [e for e in entries if e["name"].startswith(f"{model}/") and e["tokens_per_second"]]
        base = next((e["first_loss"] for e in ran if e["name"] == f"{model}/baseline"), None)
        agree = [e for e in ran if base is not None and abs(e["first_loss"] - base) <= RELATIVE * abs(base)]
        chosen[model] = max(agree, key=lambda e: e["tokens_per_second"])["name"] if agree else None
    return chosen
