"""`pretrain config show`, `pretrain flops` and `pretrain plan`."""

from __future__ import annotations

import argparse
import json

from pretrain.cli.arguments import add_config_argument
from pretrain.errors import CommandParser


def cmd_config_show(args: argparse.Namespace) -> int:
    from pretrain.config import load_any, to_yaml

    print(to_yaml(load_any(args.config, args.overrides, runnable=False)), end="")  # what it says, set or not
    return 0


def cmd_config_list(args: argparse.Namespace) -> int:
    from pretrain.config import packaged_configs

    configs = packaged_configs()
    width = max(map(len, configs))
    for name, path in configs.items():
        print(f"{name:<{width}}  {_summary(path)}")
    return 0


def _summary(path) -> str:
    """The first sentence of a config file's opening comment."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# ").strip())
    text = " ".join(lines)
    text = text[: text.find(". ")] if ". " in text else text.rstrip(".")
    return text if len(text) <= 100 else text[:99].rstrip(" ,:") + "…"


def cmd_flops(args: argparse.Namespace) -> int:
    from pretrain.config import RunConfig, load_any
    from pretrain.planning.flops import flops_report, format_report
    from pretrain.planning.scaling import format_scaling, scaling_report

    cfg = load_any(args.config, args.overrides)
    model_cfg, seq_len = (
        (cfg.model, cfg.data.seq_len) if isinstance(cfg, RunConfig) else (cfg, cfg.max_seq_len)
    )
    seq_len = args.seq_len if args.seq_len is not None else seq_len
    report = flops_report(model_cfg, seq_len, args.tokens_per_sec, args.device, args.peak_flops)
    if args.scale is not None:
        report["scaling"] = scaling_report(
            report,
            args.scale,
            args.single_gpu_mfu,
            args.global_batch_tokens,
            args.zero_stage,
            args.inter_node_gbs,
        )
    if args.json:
        print(json.dumps(report))
    else:
        print(
            format_report(report) + ("\n" + format_scaling(report["scaling"]) if "scaling" in report else "")
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pretrain.config import RunConfig, load_any
    from pretrain.errors import UserError
    from pretrain.parallel.engine import resolve_deepspeed_path
    from pretrain.planning.memory import format_plan, run_plan

    if args.gpus is None:
        raise UserError(
            "pretrain plan needs --gpus N: the number of GPUs the job runs on, all nodes together"
        )
    cfg = load_any(args.config, args.overrides)
    if not isinstance(cfg, RunConfig):
        raise UserError(
            f"{args.config} is not a run config: give one from configs/train/ (`pretrain config list`)"
        )
    path = resolve_deepspeed_path(cfg.engine.deepspeed_config)
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON (line {exc.lineno}): fix it") from None
    report = run_plan(
        cfg,
        ds,
        args.gpus,
        args.gpu_memory_gib,
        mfu=args.mfu,
        gpus_per_node=args.gpus_per_node,
        host_memory_gib=args.host_memory_gib,
    )
    print(json.dumps(report) if args.json else format_plan(report))
    return 0


def register(sub) -> None:
    config = sub.add_parser("config", help="inspect run configs")
    actions = config.add_subparsers(
        dest="config_command", required=True, parser_class=CommandParser, metavar="ACTION"
    )
    show = actions.add_parser("show", help="print the resolved config (defaults ← preset ← file ← overrides)")
    add_config_argument(
        show,
        "a config name (`pretrain config list`) or file: run, fine-tuning or model preset",
        overrides=True,
    )
    show.set_defaults(handler=cmd_config_show)
    listing = actions.add_parser("list", help="the packaged configs, by the name --config takes")
    listing.set_defaults(handler=cmd_config_list)

    flops = sub.add_parser("flops", help="parameter counts, training FLOPs per token, and MFU")
    add_config_argument(flops, "a run config or model preset, by name or file", overrides=True)
    flops.add_argument(
        "--seq-len", type=int, help="sequence length (default: data.seq_len, or the preset's max_seq_len)"
    )
    flops.add_argument("--json", action="store_true", help="print one JSON object")
    flops.add_argument("--tokens-per-sec", type=float, help="measured tokens/s per device, to compute MFU")
    peak = flops.add_mutually_exclusive_group()
    peak.add_argument("--device", help="device name for the peak (H100, H200, A100)")
    peak.add_argument("--peak-flops", type=float, help="peak FLOP/s per device, instead of the table")
    scaling = flops.add_argument_group(
        "scaling on paper (ZeRO data parallelism, pretrain/planning/scaling.py)"
    )
    scaling.add_argument("--scale", metavar="GPUS", help="project to these GPU counts, e.g. 8,64,512")
    scaling.add_argument(
        "--single-gpu-mfu", type=float, help="one GPU's MFU (or measure it: --tokens-per-sec)"
    )
    scaling.add_argument(
        "--global-batch-tokens",
        type=int,
        default=2**20,
        help="tokens per optimizer step, all GPUs (default 2^20)",
    )
    scaling.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=1)
    scaling.add_argument(
        "--inter-node-gbs",
        type=float,
        default=40.0,
        help="bus bandwidth per GPU across nodes, GB/s (default 40)",
    )
    flops.set_defaults(handler=cmd_flops)

    _register_plan(sub)


def _register_plan(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="memory per GPU (parameters, gradients, optimizer, activations) and the settings that fit",
    )
    add_config_argument(plan, "a run config, by name or file", overrides=True)
    plan.add_argument("--gpus", type=int, help="GPUs in the job, all nodes (required)")
    plan.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU (default 80: H100)")
    plan.add_argument(
        "--host-memory-gib",
        type=float,
        help="host memory per node: settings that need more are left out (default: not checked)",
    )
    plan.add_argument("--mfu", type=float, default=0.40, help="MFU assumed for throughput (default 0.40)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="for the interconnect (default 8)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(handler=cmd_plan)
