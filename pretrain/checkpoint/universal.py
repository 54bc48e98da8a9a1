"""Resuming at another world size: DeepSpeed's universal checkpoint, with Muon's momentum.

A checkpoint saved by N processes is converted once into DeepSpeed's universal form (each
parameter's states whole, in files of their own: `checkpoints/universal/<tag>`) and loaded with
`load_universal`. DeepSpeed 0.19.8's converter (`deepspeed.checkpoint.ds_to_universal`) knows a
parameter's fp32 master weight and Adam's `exp_avg`, `exp_avg_sq` and `step`; its loader
(`load_hp_checkpoint_state`, then `map_to_flat_opt_states`) reads every `<key>.pt` of a parameter
back into the new rank's fp32 partition, in that partition's layout. Muon's momentum fits
neither: under ZeRO-1/2 a Muon group's state is one flat `momentum_buffer` per rank holding every
matrix the rank's partition touches, whole and back to back (a matrix split between two ranks is
whole on both; `stage_1_and_2.py`, `get_flat_partition`). The converter stops at it (KeyError
'exp_avg'), and the loader's layout is not Muon's. So here:

- `convert` runs the converter's own steps with its extraction of each rank's fragments
  (`extract_zero_shards`) replaced by `_extract_fragments`, which converts the states a group
  holds (an AdamW group's moments and step, a Muon group's fp32 weights) and writes each Muon
  matrix's momentum whole, as saved (its dtype), to `muon_momentum/<name>.pt` beside DeepSpeed's
  `zero/`, where the loader does not look;
- `load_momentum`, on every rank after DeepSpeed's universal load, puts each Muon group's momentum
  back in the layout ZeRO-1/2 keeps for this rank's partition.

Nothing is recomputed or rounded: the resumed run's momentum is the one saved, bit for bit.

Experts split across ranks (`parallel.expert: E`, pretrain/parallel/experts.py) are in the optimizer
groups DeepSpeed marks `moe` (named `ep_size_E`), each rank's file holding its own experts'
fragments (rank r: experts of expert-parallel position r % E, partitioned over the ranks r // E of
its expert-data-parallel group). `_extract_fragments` files them under the index
(r % E)·(W / E) + r // E, so DeepSpeed's merge, which concatenates in index order, lays them out in
the global experts' order; `_merge_whole_experts` gives the merge their whole shapes (E times the
first dimension); and `mark_experts` marks each such tensor as DeepSpeed's loader expects an
expert parameter (`is_expert_param`, `ep_num_experts`), so that a run at any E takes its
`[ep_rank·n/E, …)` slice (DeepSpeed's `load_hp_checkpoint_state`) and a run at E = 1 the whole.
The model's buffers (the balancing bias), which DeepSpeed's universal load leaves as they are,
`load_buffers` puts back from the module file's copy (every rank holds the same).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
from pathlib import Path

import torch

MOMENTUM_DIR = "muon_momentum"  # beside zero/ in a universal checkpoint: one file per Muon matrix
MOMENTUM = "momentum_buffer"  # DeepSpeed's key for a Muon group's state
ADAM_STATES = ("exp_avg", "exp_avg_sq", "step")  # what ds_to_universal converts, where a group has it


def convert(source: Path, target: Path) -> None:
    """Convert the DeepSpeed checkpoint in `source` to the universal form in `target`, Muon's
    momentum included (a ZeRO-3 checkpoint, which holds no Muon, as DeepSpeed converts it). In
    this process, its output held back (shown if it fails): a process of its own cost 1.7 s of
    CPU to import DeepSpeed again."""
    from deepspeed.checkpoint import ds_to_universal as converter

    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(target),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    experts: dict[str, int] = {}  # each expert parameter's expert-parallel size, as saved
    extract, merge = converter.extract_zero_shards, converter._merge_tp_slice_files
    converter.extract_zero_shards = functools.partial(_extract_fragments, experts=experts)
    converter._merge_tp_slice_files = functools.partial(_merge_whole_experts, merge, experts)
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            converter.main(args)
    except Exception as exc:
        raise RuntimeError(
            f"converting {source} to a universal checkpoint failed: {exc!r}\n{output.getvalue()[-2000:]}"
        ) from exc
    finally:
        converter.extract_zero_shards, converter._merge_tp_slice_files = extract, merge
    mark_experts(target, experts)


def _extract_fragments(
    temp_dir: str, ds_checkpoint, indices: tuple[int, int, int], experts: dict[str, int] | None = None
) -> None:
    """ds_to_universal's `extract_zero_shards` for one rank's file of a ZeRO-1/2 checkpoint (no
    pipeline or tensor parallelism here): each parameter's fragment of each state its group holds,
    for DeepSpeed's merge (split experts' in the global order: module docstring, their names and
    E added to `experts`); and each Muon matrix's momentum, whole, from the first rank holding it.
    The file is read as saved (`strip_tensor_paddings=False`): the fragments never reach a group's
    padding, and the momentum, which has none, keeps its last matrix."""
    from deepspeed.checkpoint import ds_to_universal as converter
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        OPTIMIZER_STATE_DICT,
        PARAM_SHAPES,
        PARAM_SLICE_MAPPINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    pp_index, tp_index, dp_index = indices
    optim = ds_checkpoint.get_zero_checkpoint_state(
        pp_index=pp_index, tp_index=tp_index, dp_index=dp_index, strip_tensor_paddings=False
    )[OPTIMIZER_STATE_DICT]
    states = optim[BASE_OPTIMIZER_STATE]["state"]
    shapes = ds_checkpoint.model_state_metadata[0][1][PARAM_SHAPES]  # every parameter's, by name
    settings = optim[BASE_OPTIMIZER_STATE]["param_groups"]
    for group, mapping in enumerate(optim[PARAM_SLICE_MAPPINGS]):
        state = states.get(group, {})
        flat = {key: state[key] for key in ADAM_STATES if key in state}
        flat["fp32"] = optim[SINGLE_PARTITION_OF_FP32_GROUPS][group]
        size = expert_parallel_size(settings[group])
        index = dp_index if size == 1 else expert_order(dp_index, size, ds_checkpoint.dp_degree)
        if size > 1 and experts is not None:
            experts.update(dict.fromkeys(mapping, size))
        for name, fragment in mapping.items():
            for key, value in flat.items():
                converter.dump_param_fragment(
                    temp_dir, tp_index, index, key, value, name, fragment.start, fragment.numel
                )
        if MOMENTUM in state:
            _write_momentum(state[MOMENTUM], mapping, shapes, Path(temp_dir).parent / MOMENTUM_DIR)


def expert_parallel_size(group: dict) -> int:
    """E of an optimizer group of split experts (DeepSpeed's `moe` groups, named `ep_size_E`), else 1."""
    if not group.get("moe"):
        return 1
    return int(str(group["name"]).removeprefix("ep_size_"))


def expert_order(rank: int, size: int, world_size: int) -> int:
    """Where rank `rank`'s fragment of a split expert parameter goes among every rank's: its
    expert-parallel position first (which experts), then its place in its expert-data-parallel group."""
    return (rank % size) * (world_size // size) + rank // size


def _merge_whole_experts(
    merge, experts: dict[str, int], args, uc_info, tp_degree, slice_shapes, *rest, **kwargs
):
    """DeepSpeed's merge with the split experts' whole shapes (E × the saved first dimension)."""
    whole = {
        name: [
            None if shape is None else torch.Size((shape[0] * experts[name], *shape[1:])) for shape in shapes
        ]
        if name in experts
        else shapes
        for name, shapes in slice_shapes.items()
    }
    return merge(args, uc_info, tp_degree, whole, *rest, **kwargs)


def mark_experts(target: Path, experts: dict[str, int]) -> None:
    """Each split expert parameter's universal files marked as DeepSpeed's loader reads an expert
    parameter: `is_expert_param`, and its experts, `ep_num_experts` (the first dimension)."""
    from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM

    for name in experts:
        for path in (Path(target) / "zero" / name).glob("*.pt"):
            saved = torch.load(path, weights_only=False)
            if isinstance(saved, dict) and PARAM in saved:
                saved |= {EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: saved[PARAM].shape[0]}
                torch.save(saved, path)


def load_buffers(module, checkpoint: Path) -> None:
    """Every rank, after DeepSpeed's universal load (which restores parameters only): the module's
    persistent buffers (the experts' balancing bias) from the checkpoint's module file."""
    from deepspeed.checkpoint.constants import PARAM

    for name, buffer in module.named_buffers():
        path = Path(checkpoint) / "zero" / name / "fp32.pt"
        if path.is_file():
            buffer.copy_(torch.load(path, weights_only=False)[PARAM])


def universal_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights (and persistent buffers) of a universal checkpoint, whole, by name."""
    from deepspeed.checkpoint.constants import PARAM

    folder = Path(checkpoint) / "zero"
    return {
        path.parent.relative_to(folder).as_posix(): torch.load(path, weights_only=False)[PARAM]
        for path in sorted(folder.glob("*/fp32.pt"))
    }


def _write_momentum(buffer: torch.Tensor, mapping: dict, shapes: dict, folder: Path) -> None:
    """Each matrix of one rank's Muon buffer to `folder/<name>.pt`, unless an earlier rank wrote
    it. The buffer holds the matrices the partition touches in the partition's order (that of
    their fragments), each whole."""
    folder.mkdir(parents=True, exist_ok=True)
    offset = 0
    for name in sorted(mapping, key=lambda n: mapping[n].start):
        shape = torch.Size(shapes[name])
        path = folder / f"{name}.pt"
        if not path.exists():
            torch.save(buffer.narrow(0, offset, shape.numel()).view(shape).clone(), path)
        offset += shape.numel()
    if offset != buffer.numel():
        raise RuntimeError(
            f"a Muon momentum buffer of {buffer.numel()} values for matrices of {offset}: "
            "not the layout DeepSpeed 0.19.8's ZeRO-1/2 keeps (pretrain/checkpoint/universal.py)"
        )


def load_momentum(optimizer, checkpoint: Path) -> None:
    """Every rank, once DeepSpeed has loaded universal checkpoint `checkpoint` into `optimizer`
    (its ZeRO-1/2 optimizer): each Muon group's momentum, whole matrices back to back for the
    matrices this rank's partition touches, as `get_flat_partition` reads it. Nothing to do for a
    checkpoint without Muon."""
    folder = checkpoint / MOMENTUM_DIR
    if not folder.is_dir():
        return
    for group, params in enumerate(optimizer.params_in_partition):
        if not params or not getattr(params[0], "use_muon", False):
            continue
        names = [optimizer.param_names[p] for p in params]
        missing = [n for n in names if not (folder / f"{n}.pt").is_file()]
        if missing:
            raise RuntimeError(f"{folder} holds no momentum for {', '.join(missing)}")
        momenta = [torch.load(folder / f"{n}.pt", weights_only=True).flatten() for n in names]
        flat = optimizer.optimizer.param_groups[group]["params"][0]
        optimizer.optimizer.state[flat][MOMENTUM] = torch.cat(momenta).to(flat.device)
