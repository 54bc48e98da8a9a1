"""`pretrain bench data / masking / monitor / detection / train / profile / ablation /
stability / optimizers / memory`: benchmarks that print figures."""

from __future__ import annotations

import argparse

from pretrain.cli.arguments import add_config_argument
from pretrain.errors import CommandParser


def cmd_bench_data(args: argparse.Namespace) -> int:
    from pretrain.bench.data import run

    run(as_json=args.json, quick=args.quick, source=args.source)
    return 0


def cmd_bench_masking(args: argparse.Namespace) -> int:
    from pretrain.bench.masking import run

    run(
        args.config,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        document_tokens=args.document_tokens,
        steps=args.steps,
        dtype=args.dtype,
        as_json=args.json,
    )
    return 0


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from pretrain.bench.memory import run

    run(as_json=args.json)
    return 0


def cmd_bench_monitor(args: argparse.Namespace) -> int:
    from pretrain.bench.monitor import run

    run(as_json=args.json, quick=args.quick, batch_size=args.batch_size)
    return 0


def cmd_bench_detection(args: argparse.Namespace) -> int:
    from pretrain.bench.detection import run

    run(args.run_dirs, every=args.every, as_json=args.json, defaults=args.defaults)
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    from pretrain.bench.train import BenchSettings, run

    settings = BenchSettings(
        dtype=args.dtype,
        zero_stage=args.zero_stage,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        compile=args.compile,
        overrides=tuple(args.overrides),
        reference=not args.ours_only,
    )
    run(args.config, settings, as_json=args.json)
    return 0


def cmd_bench_profile(args: argparse.Namespace) -> int:
    from pretrain.bench.profile import run
    from pretrain.bench.train import BenchSettings

    settings = BenchSettings(
        dtype=args.dtype,
        zero_stage=args.zero_stage,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        compile=args.compile,
    )
    run(args.config, settings, as_json=args.json, trace=args.trace)
    return 0


def cmd_bench_ablation(args: argparse.Namespace) -> int:
    from pretrain.bench.ablation import parse_lrs, run

    run(
        args.source,
        args.out,
        parse_lrs(args.lrs),
        steps=args.steps,
        eval_every=args.eval_every,
        as_json=args.json,
    )
    return 0


def cmd_bench_optimizers(args: argparse.Namespace) -> int:
    from pretrain.bench.ablation import parse_lrs
    from pretrain.bench.optimizers import run

    run(
        tuple(c for c in args.corpora.split(",") if c),
        args.out,
        adamw_lrs=parse_lrs(args.adamw_lrs),
        muon_lrs=parse_lrs(args.muon_lrs),
        steps=args.steps,
        ns_method=args.ns_method,
        timing_pairs=args.timing_pairs,
        timing_steps=args.timing_steps,
        jobs=args.jobs,
        as_json=args.json,
    )
    return 0


def cmd_bench_stability(args: argparse.Namespace) -> int:
    from pretrain.bench.ablation import parse_lrs
    from pretrain.bench.stability import run

    run(
        tuple(c for c in args.corpora.split(",") if c),
        args.out,
        parse_lrs(args.lrs),
        parts=tuple(p for p in args.parts.split(",") if p)
        if args.parts is not None
        else ("sweep", "escalation", *(("calibration",) if args.calibration else ())),
        escalation_lrs=parse_lrs(args.escalation_lrs) if args.escalation_lrs else (),
        calibration_dirs=tuple(args.calibration),
        as_json=args.json,
        steps=args.steps,
        warmup=args.warmup,
        micro_batch_size=args.micro_batch_size,
        eval_every=args.eval_every,
        precursors_every=args.precursors_every,
    )
    return 0


def register_data(whats) -> None:
    data = whats.add_parser("data", help="window-stream and prepare throughput")
    data.add_argument("--json", action="store_true", help="print one JSON object")
    data.add_argument("--quick", action="store_true", help="smaller and shorter (for smoke tests)")
    data.add_argument(
        "--source",
        metavar="URL",
        help="a prepared dataset in an object store (s3://...): its stream, cache and first window "
        "against a local copy",
    )
    data.set_defaults(handler=cmd_bench_data)


def register_memory(whats) -> None:
    memory = whats.add_parser(
        "memory", help="the memory plan's activation model against the peak measured on small models"
    )
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    memory.set_defaults(handler=cmd_bench_memory)


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    whats = bench.add_subparsers(
        dest="bench_command", required=True, parser_class=CommandParser, metavar="WHAT"
    )
    register_data(whats)
    register_memory(whats)
    register_masking(whats)
    register_monitor(whats)
    register_detection(whats)
    register_train(whats)
    register_profile(whats)
    register_ablation(whats)
    add_stability_parser(whats)
    add_optimizers_parser(whats)


def register_masking(whats) -> None:
    masking = whats.add_parser(
        "masking", help="training step time with document masking against without (same model and batch)"
    )
    add_config_argument(masking, "model preset (configs/model/*.yaml) or run config")
    masking.add_argument("--seq-len", type=int, help="tokens per window (default: the config's)")
    masking.add_argument("--micro-batch-size", type=int, help="windows per step (default: the config's)")
    masking.add_argument(
        "--document-tokens",
        type=float,
        default=512.0,
        help="mean document length packed into the windows (default 512)",
    )
    masking.add_argument("--steps", type=int, default=10, help="measured steps per arm (default 10)")
    masking.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    masking.add_argument("--json", action="store_true", help="print one JSON object")
    masking.set_defaults(handler=cmd_bench_masking)


def register_monitor(whats) -> None:
    monitor = whats.add_parser(
        "monitor", help="step time with and without the monitoring service; how fast a spike is acted on"
    )
    monitor.add_argument("--json", action="store_true", help="print one JSON object")
    monitor.add_argument("--quick", action="store_true", help="fewer steps (for smoke tests)")
    monitor.add_argument(
        "--batch-size",
        type=int,
        default=2,
        help="512-token sequences per step (default 2: ~100 ms steps here)",
    )
    monitor.set_defaults(handler=cmd_bench_monitor)


def register_detection(whats) -> None:
    detection = whats.add_parser(
        "detection",
        help="the monitor's warnings and rollbacks on real runs, and its detection of injected faults",
    )
    detection.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of `pretrain launch`"
    )
    detection.add_argument(
        "--every", type=int, default=5, help="replay: inject at every N-th step (default 5)"
    )
    detection.add_argument(
        "--defaults",
        action="store_true",
        help="replay with the default monitor settings instead of each run's",
    )
    detection.add_argument("--json", action="store_true", help="print one JSON object")
    detection.set_defaults(handler=cmd_bench_detection)


def register_train(whats) -> None:
    train = whats.add_parser(
        "train",
        help="training tokens/s of our model vs transformers' LlamaForCausalLM, same engine and batch",
    )
    add_step_arguments(train, overrides=True)
    train.add_argument("--steps", type=int, default=20, help="measured steps per model (default 20)")
    train.add_argument(
        "--ours-only",
        action="store_true",
        help="our model only, without Transformers' (the GPU check's variants)",
    )
    train.add_argument("--warmup", type=int, default=3, help="unmeasured steps per model first")
    train.add_argument("--json", action="store_true", help="print one JSON object")
    train.set_defaults(handler=cmd_bench_train)


def register_profile(whats) -> None:
    profile = whats.add_parser(
        "profile",
        help="torch.profiler capture of our model's training step, summarised (top kernels, categories, host gaps)",
    )
    add_step_arguments(profile)
    profile.add_argument("--warmup", type=int, default=3, help="steps before the recording (default 3)")
    profile.add_argument("--steps", type=int, default=3, help="steps recorded (default 3)")
    profile.add_argument("--trace", metavar="FILE", help="also write the Chrome trace (.json, or .json.gz)")
    profile.add_argument("--json", action="store_true", help="print one JSON object")
    profile.set_defaults(handler=cmd_bench_profile)


def register_ablation(whats) -> None:
    ablation = whats.add_parser(
        "ablation", help="Transformer++ vs the original Transformer recipe: compute to reach the same loss"
    )
    ablation.add_argument("--source", default="builtin:pydoc", help="corpus (default builtin:pydoc)")
    ablation.add_argument("--out", default="runs/ablation", help="runs, curves and results go here")
    ablation.add_argument(
        "--lrs",
        default="1e-4,3e-4,1e-3,3e-3,1e-2",
        help="learning rates searched for each arm (comma-separated)",
    )
    ablation.add_argument("--steps", type=int, help="training steps per run (default: the configs')")
    ablation.add_argument("--eval-every", type=int, help="steps between evaluations (default: the configs')")
    ablation.add_argument("--json", action="store_true", help="print one JSON object")
    ablation.set_defaults(handler=cmd_bench_ablation)


def add_optimizers_parser(whats) -> None:
    optimizers = whats.add_parser(
        "optimizers",
        help="AdamW vs Muon at each one's best learning rate: steps and time to AdamW's final loss",
    )
    optimizers.add_argument(
        "--corpora", default="builtin:pydoc", help="comma-separated corpora (default builtin:pydoc)"
    )
    optimizers.add_argument("--out", default="runs/optimizers", help="runs and results go here")
    optimizers.add_argument(
        "--adamw-lrs", default="5e-4,1e-3,2e-3,4e-3", help="AdamW's peak learning rates (optim.lr)"
    )
    optimizers.add_argument(
        "--muon-lrs", default="0.005,0.01,0.02,0.04", help="Muon's peak learning rates (optim.muon_lr)"
    )
    optimizers.add_argument("--steps", type=int, help="training steps per run (default: the config's, 300)")
    optimizers.add_argument(
        "--ns-method",
        choices=("gram", "standard"),
        default="gram",
        help="optim.muon_ns_method (default gram)",
    )
    optimizers.add_argument(
        "--timing-pairs", type=int, default=3, help="short runs of each optimizer timed in turn (default 3)"
    )
    optimizers.add_argument("--timing-steps", type=int, default=40, help="steps per timing run (default 40)")
    optimizers.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs of a search at a time (default 1; a GPU has room for several)",
    )
    optimizers.add_argument("--json", action="store_true", help="print one JSON object")
    optimizers.set_defaults(handler=cmd_bench_optimizers)


def add_stability_parser(whats) -> None:
    stability = whats.add_parser(
        "stability",
        help="the stability ladder's evidence: loss against learning rate with and without qk_norm + z_loss, "
        "precursor lead, escalation, the calibration's faults with skip_step off and on",
    )
    stability.add_argument(
        "--corpora", default="builtin:pydoc", help="comma-separated corpora (default builtin:pydoc)"
    )
    stability.add_argument("--out", default="runs/stability", help="runs and results go here")
    stability.add_argument(
        "--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1", help="peak learning rates (comma-separated)"
    )
    stability.add_argument(
        "--parts",
        help="which of sweep,escalation,calibration (default: the first two, and calibration with --calibration)",
    )
    stability.add_argument(
        "--escalation-lrs",
        help="diverging rates for the escalation runs, comma-separated (default: 2)",
    )
    stability.add_argument(
        "--calibration",
        nargs="+",
        default=[],
        metavar="DIR",
        help="directories of scripts/monitor_calibration.py runs (clean, and faults with skip_step off and on)",
    )
    stability.add_argument("--steps", type=int, help="training steps per run (default 200)")
    stability.add_argument("--warmup", type=int, help="learning-rate warm-up steps (default 100)")
    stability.add_argument("--micro-batch-size", type=int, help="sequences per step (default 4)")
    stability.add_argument("--eval-every", type=int, help="steps between evaluations (default 50)")
    stability.add_argument(
        "--precursors-every", type=int, help="steps between precursor measurements (default 2)"
    )
    stability.add_argument("--json", action="store_true", help="print one JSON object")
    stability.set_defaults(handler=cmd_bench_stability)


def add_step_arguments(parser, overrides: bool = False) -> None:
    """What `bench train` and `bench profile` share: the config and the step they run."""
    add_config_argument(
        parser,
        "a packaged config's name (tiny, gpt3-125m, model/gpt3-1.3b), a run config or a model preset file",
        overrides=overrides,
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    parser.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: the run config's; a preset's max_seq_len, ≤ 2048)",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        help="sequences per step per rank (default: the run config's; 8 for a preset)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the blocks (default: the run config's engine.compile; off for a preset)",
    )
