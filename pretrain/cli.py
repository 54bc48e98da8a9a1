"""The `pretrain` command line (also `python -m pretrain`).

Each subcommand parses its arguments here and calls into the library. Bad input raises
`UserError`, which becomes one line on stderr and exit status 2; `--debug` (anywhere on the
command line) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from pretrain.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2) like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# --------------------------------------------------------------------------- subcommands


def cmd_config_show(args: argparse.Namespace) -> int:
    from pretrain.config import load_any, to_yaml

    print(to_yaml(load_any(args.config, args.overrides)), end="")
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    from pretrain.config import RunConfig, load_any
    from pretrain.flops import PEAK_FLOPS, flops_report, mfu, peak_flops_for

    cfg = load_any(args.config, args.overrides)
    model_cfg = cfg.model if isinstance(cfg, RunConfig) else cfg
    seq_len = args.seq_len
    if seq_len is None:
        seq_len = cfg.data.seq_len if isinstance(cfg, RunConfig) else model_cfg.max_seq_len
    for flag, value in (
        ("--seq-len", seq_len),
        ("--tokens-per-sec", args.tokens_per_sec),
        ("--peak-flops", args.peak_flops),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"{flag} {value} must be a positive number")
    report = flops_report(model_cfg, seq_len)
    report["model"] = model_cfg.preset
    peak = args.peak_flops
    if args.device is not None:
        peak = peak_flops_for(args.device)
        if peak is None:
            raise UserError(
                f"--device {args.device!r}: no known peak; use one of {', '.join(PEAK_FLOPS)} or --peak-flops"
            )
    if args.tokens_per_sec is not None:
        if peak is None:
            raise UserError("--tokens-per-sec needs --device NAME or --peak-flops F to compute MFU")
        report["tokens_per_sec"] = args.tokens_per_sec
        report["peak_flops"] = peak
        report["mfu"] = mfu(args.tokens_per_sec, report["flops_per_token"], peak)
    if args.scale is not None:
        report["scaling"] = _scaling(args, report, peak)
    if args.json:
        print(json.dumps(report))
        return 0
    total = report["flops_per_token"]
    print(
        f"model {report['model']}: {report['params'] / 1e6:.1f}M params "
        f"({report['non_embedding_params'] / 1e6:.1f}M non-embedding), seq_len {seq_len}"
    )
    print(
        f"training FLOPs per token: {total / 1e6:.1f}M  (6·N with N = {report['matmul_params'] / 1e6:.1f}M, plus attention)"
    )
    for part, value in report["breakdown"].items():
        print(f"  {part:<24} {value / 1e6:>12.1f}M  {100 * value / total:5.1f}%")
    if "mfu" in report:
        print(
            f"MFU at {args.tokens_per_sec:,.0f} tokens/s per device: {100 * report['mfu']:.1f}% of {peak / 1e12:.0f} TFLOP/s"
        )
    if "scaling" in report:
        _print_scaling(report["scaling"])
    return 0


def _scaling(args: argparse.Namespace, report: dict, peak: float | None) -> dict:
    """`pretrain flops --scale`: ZeRO data parallelism projected from one GPU (pretrain/scaling.py)."""
    from dataclasses import asdict

    from pretrain.scaling import Interconnect, project

    try:
        counts = [int(v) for v in args.scale.split(",")]
    except ValueError:
        raise UserError(f"--scale {args.scale!r}: give GPU counts such as 8,64,512") from None
    if not counts or min(counts) < 1:
        raise UserError(f"--scale {args.scale!r}: GPU counts must be at least 1")
    if peak is None:
        raise UserError("--scale needs --device NAME or --peak-flops F (the per-GPU peak)")
    single = report.get("mfu", args.single_gpu_mfu)
    if single is None or not 0 < single <= 1:
        raise UserError(
            "--scale needs the one-GPU MFU: --tokens-per-sec (measured) or --single-gpu-mfu in (0, 1]"
        )
    for flag, value in (
        ("--global-batch-tokens", args.global_batch_tokens),
        ("--inter-node-gbs", args.inter_node_gbs),
    ):
        if not value > 0:
            raise UserError(f"{flag} {value} must be positive")
    net = Interconnect(inter_node_bytes_per_sec=args.inter_node_gbs * 1e9)
    rows = [
        project(
            report["params"],
            report["flops_per_token"],
            n,
            args.global_batch_tokens,
            single,
            peak,
            args.zero_stage,
            net,
        )
        for n in counts
    ]
    return {
        "single_gpu_mfu": single,
        "global_batch_tokens": args.global_batch_tokens,
        "zero_stage": args.zero_stage,
        "interconnect": asdict(net),
        "projections": [asdict(r) for r in rows],
    }


def _print_scaling(scaling: dict) -> None:
    net = scaling["interconnect"]
    print(
        f"ZeRO-{scaling['zero_stage']} data parallelism, global batch {scaling['global_batch_tokens']:,} tokens, "
        f"one-GPU MFU {100 * scaling['single_gpu_mfu']:.0f}%, bus bandwidth {net['intra_node_bytes_per_sec'] / 1e9:.0f} GB/s "
        f"within {net['gpus_per_node']}-GPU nodes, {net['inter_node_bytes_per_sec'] / 1e9:.0f} GB/s per GPU across them:"
    )
    print(
        f"  {'GPUs':>5} {'tokens/GPU/step':>16} {'compute':>9} {'comm':>9} {'exposed':>9} {'MFU':>6} {'tokens/s':>12}"
    )
    for r in scaling["projections"]:
        print(
            f"  {r['gpus']:>5} {r['tokens_per_gpu_per_step']:>16,.0f} {1000 * r['compute_seconds']:>7.0f}ms "
            f"{1000 * r['communication_seconds']:>7.0f}ms {1000 * r['exposed_seconds']:>7.0f}ms "
            f"{100 * r['mfu']:>5.1f}% {r['tokens_per_sec']:>12,.0f}"
        )


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from pretrain.data.sources import resolve_source
    from pretrain.tokenizer import MODEL_FILE, train_tokenizer

    out = Path(args.out)
    if (out / MODEL_FILE).exists() and not args.overwrite:
        raise UserError(f"{out / MODEL_FILE} exists: choose another --out, or pass --overwrite")
    source = resolve_source(args.input or args.source, text_field=args.text_field)
    print(
        f"training a {args.model_type} tokenizer of {args.vocab_size} pieces on {source.description}",
        file=sys.stderr,
    )
    tokenizer = train_tokenizer(
        source.documents(),
        out,
        args.vocab_size,
        model_type=args.model_type,
        sample_sentences=args.sample_sentences,
    )
    print(f"wrote {tokenizer.path} (vocab {tokenizer.vocab_size}, sha256 {tokenizer.sha256[:12]}...)")
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from pretrain.data.prepare import prepare
    from pretrain.data.sources import resolve_source

    source = resolve_source(args.source, text_field=args.text_field)
    manifest, written = prepare(
        source,
        args.tokenizer,
        args.out,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    if not written:
        return 0  # prepare said "... already holds this dataset; nothing to do"
    for name, split in manifest["splits"].items():
        print(
            f"{name}: {split['documents']:,} documents, {split['tokens']:,} tokens in {len(split['shards'])} shard(s)"
        )
    print(f"wrote {Path(args.out) / 'manifest.json'} (corpus fingerprint {manifest['fingerprint']})")
    return 0


def cmd_bench_data(args: argparse.Namespace) -> int:
    from pretrain.bench.data import run

    run(as_json=args.json, quick=args.quick)
    return 0


def cmd_bench_monitor(args: argparse.Namespace) -> int:
    from pretrain.bench.monitor import run

    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be at least 1")
    run(as_json=args.json, quick=args.quick, batch_size=args.batch_size)
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
    )
    run(args.config, settings, as_json=args.json)
    return 0


def cmd_bench_ablation(args: argparse.Namespace) -> int:
    from pretrain.bench.ablation import run

    try:
        lrs = tuple(float(v) for v in args.lrs.split(","))
    except ValueError:
        raise UserError(f"--lrs {args.lrs!r}: give comma-separated numbers, such as 1e-3,3e-3") from None
    run(args.source, args.out, lrs, steps=args.steps, eval_every=args.eval_every, as_json=args.json)
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from pretrain.config import load_finetune_config
    from pretrain.finetune import finetune

    finetune(load_finetune_config(args.config, args.overrides))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from pretrain.finetune import predict

    count = predict(args.checkpoint, args.input, args.out, args.max_new_tokens)
    print(f"wrote {count} predictions to {args.out}")
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    from pretrain.attention import render

    result = render(args.checkpoint, args.text, args.out)
    print(
        f"{result['layers']} layers x {result['heads']} heads over {result['tokens']} tokens: "
        f"{result['png']} (grid), {result['html']} (interactive head view)"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from pretrain.config import load_config
    from pretrain.train import train

    train(load_config(args.config, args.overrides))
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    import shutil

    import torch

    from pretrain.hf import save_hf
    from pretrain.inference import load_trained
    from pretrain.tokenizer import MODEL_FILE

    trained = load_trained(args.checkpoint)
    tok = trained.tokenizer
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    out = save_hf(trained.model, args.out, token_ids=ids, dtype=getattr(torch, args.dtype))
    shutil.copyfile(tok.path, out / MODEL_FILE)
    print(f"exported {trained.directory} to {out} (config.json, model.safetensors, {MODEL_FILE})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pretrain.inference import load_trained, perplexity

    result = perplexity(load_trained(args.checkpoint), args.data, args.batch_size, args.max_batches)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['checkpoint']}: validation loss {result['loss']:.4f}, "
            f"perplexity {result['perplexity']:.2f} over {result['tokens']:,} tokens"
        )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from pretrain.inference import generate, load_trained

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    trained = load_trained(args.checkpoint)
    tok = trained.tokenizer
    generator = torch.Generator().manual_seed(args.seed)
    prompt_ids = [tok.eos_id, *tok.encode(args.prompt)]  # EOS: "a new document starts here", as in training
    ids = generate(
        trained.model,
        prompt_ids,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        tok.eos_id,
        generator,
    )
    print(args.prompt + tok.decode(ids))
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from monitoring.service import run_service
    from pretrain.config import load_config, load_defaults

    cfg = load_config(args.config, args.overrides) if args.config else load_defaults(args.overrides)
    if not Path(args.run_dir).is_dir():
        Path(args.run_dir).mkdir(parents=True)
    run_service(args.run_dir, cfg.monitor, base_seed=cfg.run.seed)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from monitoring.supervisor import launch

    return launch(
        args.config,
        args.overrides,
        nproc=args.nproc,
        hostfile=args.hostfile,
        master_addr=args.master_addr,
        master_port=args.master_port,
        no_ssh=args.no_ssh,
        node_rank=args.node_rank,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from pretrain.demo import run_demo

    return run_demo(out_dir=args.out, steps=args.steps)


# --------------------------------------------------------------------------- parser


def _add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", required=True, help="checkpoint directory, or a run directory (its newest)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pretrain", description="Llama-style pretraining with DeepSpeed ZeRO.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    config = sub.add_parser("config", help="inspect run configs")
    config_sub = config.add_subparsers(
        dest="config_command", required=True, parser_class=_Parser, metavar="ACTION"
    )
    show = config_sub.add_parser(
        "show", help="print the resolved config (defaults ← preset ← file ← overrides)"
    )
    show.add_argument(
        "config", help="run config (configs/train/*.yaml) or model preset (configs/model/*.yaml)"
    )
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=12")
    show.set_defaults(handler=cmd_config_show)

    flops = sub.add_parser("flops", help="parameter counts, training FLOPs per token, and MFU")
    flops.add_argument("config", help="run config or model preset")
    flops.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=12")
    flops.add_argument(
        "--seq-len", type=int, help="sequence length (default: data.seq_len, or the preset's max_seq_len)"
    )
    flops.add_argument("--json", action="store_true", help="print one JSON object")
    flops.add_argument("--tokens-per-sec", type=float, help="measured tokens/s per device, to compute MFU")
    peak = flops.add_mutually_exclusive_group()
    peak.add_argument("--device", help="device name for the peak (H100, H200, A100)")
    peak.add_argument("--peak-flops", type=float, help="peak FLOP/s per device, instead of the table")
    scaling = flops.add_argument_group("scaling on paper (ZeRO data parallelism, pretrain/scaling.py)")
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

    tokenizer = sub.add_parser("tokenizer", help="train SentencePiece tokenizers")
    tokenizer_sub = tokenizer.add_subparsers(
        dest="tokenizer_command", required=True, parser_class=_Parser, metavar="ACTION"
    )
    train_tok = tokenizer_sub.add_parser("train", help="train a byte-fallback SentencePiece model")
    inputs = train_tok.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--input", nargs="+", metavar="PATH", help="text files or globs (.txt, .jsonl, .parquet)"
    )
    inputs.add_argument(
        "--source", nargs="+", metavar="SRC", help="files/globs, a Hub dataset name, or builtin:pydoc"
    )
    train_tok.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    train_tok.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    train_tok.add_argument(
        "--out", required=True, help="output directory (tokenizer.model, tokenizer_meta.json)"
    )
    train_tok.add_argument(
        "--text-field", default="text", help="field holding the text in .jsonl/.parquet/Hub data"
    )
    train_tok.add_argument(
        "--sample-sentences", type=int, default=2_000_000, help="sentences sampled for training"
    )
    train_tok.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer in --out")
    train_tok.set_defaults(handler=cmd_tokenizer_train)

    data = sub.add_parser("data", help="prepare token shards")
    data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser, metavar="ACTION")
    prep = data_sub.add_parser("prepare", help="tokenize a corpus into shards + manifest.json")
    prep.add_argument(
        "--source",
        nargs="+",
        required=True,
        metavar="SRC",
        help="files/globs, a Hub dataset name, or builtin:pydoc",
    )
    prep.add_argument("--tokenizer", required=True, help="tokenizer directory or tokenizer.model")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument(
        "--val-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)"
    )
    prep.add_argument("--shard-tokens", type=int, default=1 << 27, help="tokens per shard (default 2^27)")
    prep.add_argument(
        "--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)), help="tokenizer processes"
    )
    prep.add_argument(
        "--text-field", default="text", help="field holding the text in .jsonl/.parquet/Hub data"
    )
    prep.add_argument("--overwrite", action="store_true", help="replace a different dataset in --out")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(handler=cmd_data_prepare)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bench_sub = bench.add_subparsers(
        dest="bench_command", required=True, parser_class=_Parser, metavar="WHAT"
    )
    bench_data = bench_sub.add_parser("data", help="window-stream and prepare throughput")
    bench_data.add_argument("--json", action="store_true", help="print one JSON object")
    bench_data.add_argument("--quick", action="store_true", help="smaller and shorter (for smoke tests)")
    bench_data.set_defaults(handler=cmd_bench_data)
    bench_monitor = bench_sub.add_parser(
        "monitor", help="step time with and without the monitoring service; how fast a spike is acted on"
    )
    bench_monitor.add_argument("--json", action="store_true", help="print one JSON object")
    bench_monitor.add_argument("--quick", action="store_true", help="fewer steps (for smoke tests)")
    bench_monitor.add_argument(
        "--batch-size",
        type=int,
        default=2,
        help="512-token sequences per step (default 2: ~100 ms steps here)",
    )
    bench_monitor.set_defaults(handler=cmd_bench_monitor)
    bench_train = bench_sub.add_parser(
        "train",
        help="training tokens/s of our model vs transformers' LlamaForCausalLM, same engine and batch",
    )
    bench_train.add_argument(
        "config", metavar="CONFIG", help="model preset (configs/model/*.yaml) or run config"
    )
    bench_train.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    bench_train.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1)
    bench_train.add_argument(
        "--seq-len",
        type=int,
        help="tokens per sequence (default: the run config's; a preset's max_seq_len, ≤ 2048)",
    )
    bench_train.add_argument(
        "--micro-batch-size", type=int, help="sequences per step per rank (default: the run config's; 8)"
    )
    bench_train.add_argument("--steps", type=int, default=20, help="measured steps per model (default 20)")
    bench_train.add_argument("--warmup", type=int, default=3, help="unmeasured steps per model first")
    bench_train.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the blocks of both models (default: the run config's engine.compile; off)",
    )
    bench_train.add_argument("--json", action="store_true", help="print one JSON object")
    bench_train.set_defaults(handler=cmd_bench_train)
    bench_ablation = bench_sub.add_parser(
        "ablation",
        help="Transformer++ vs the original Transformer recipe: compute to reach the same loss",
    )
    bench_ablation.add_argument("--source", default="builtin:pydoc", help="corpus (default builtin:pydoc)")
    bench_ablation.add_argument("--out", default="runs/ablation", help="runs, curves and results go here")
    bench_ablation.add_argument(
        "--lrs",
        default="1e-4,3e-4,1e-3,3e-3,1e-2",
        help="learning rates searched for each arm (comma-separated)",
    )
    bench_ablation.add_argument("--steps", type=int, help="training steps per run (default: the configs')")
    bench_ablation.add_argument(
        "--eval-every", type=int, help="steps between evaluations (default: the configs')"
    )
    bench_ablation.add_argument("--json", action="store_true", help="print one JSON object")
    bench_ablation.set_defaults(handler=cmd_bench_ablation)

    train = sub.add_parser(
        "train", help="train in this process (multi-process: deepspeed --module pretrain.train)"
    )
    train.add_argument("--config", required=True, help="run config (configs/train/*.yaml)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    train.set_defaults(handler=cmd_train)

    finetune = sub.add_parser(
        "finetune", help="fine-tune in this process (multi-process: deepspeed --module pretrain.finetune)"
    )
    finetune.add_argument("--config", required=True, help="configs/finetune/classification.yaml or sft.yaml")
    finetune.add_argument("overrides", nargs="*", help="dotted overrides, e.g. finetune.init=runs/demo/run")
    finetune.set_defaults(handler=cmd_finetune)

    predict = sub.add_parser("predict", help="labels (classification) or completions (sft) for a file")
    _add_checkpoint_argument(predict)
    predict.add_argument("--input", required=True, help=".csv/.jsonl/.parquet with the fine-tuning columns")
    predict.add_argument(
        "--out", required=True, help="output .jsonl or .csv (the input rows plus predictions)"
    )
    predict.add_argument("--max-new-tokens", type=int, default=64, help="sft: tokens per completion")
    predict.set_defaults(handler=cmd_predict)

    attention = sub.add_parser("attention", help="attention maps of a text: a PNG grid and an HTML head view")
    _add_checkpoint_argument(attention)
    attention.add_argument("--text", required=True, help="the text to look at")
    attention.add_argument("--out", required=True, help="output prefix: writes PREFIX.png and PREFIX.html")
    attention.set_defaults(handler=cmd_attention)

    export = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face Llama directory")
    _add_checkpoint_argument(export)
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    export.set_defaults(handler=cmd_export_hf)

    evaluate = sub.add_parser("eval", help="validation loss and perplexity of a checkpoint")
    _add_checkpoint_argument(evaluate)
    evaluate.add_argument("--data", required=True, help="prepared dataset (its validation split is used)")
    evaluate.add_argument("--batch-size", type=int, default=8)
    evaluate.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.set_defaults(handler=cmd_eval)

    gen = sub.add_parser("generate", help="sample text from a checkpoint (KV cache)")
    _add_checkpoint_argument(gen)
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int, default=50, help="0 disables")
    gen.add_argument("--top-p", type=float, default=0.95, help="1.0 disables")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(handler=cmd_generate)

    monitor = sub.add_parser("monitor", help="the monitoring service for one run directory (its own process)")
    monitor.add_argument("--run-dir", required=True, help="the run directory to watch (run.dir)")
    monitor.add_argument(
        "--config", help="run config whose monitor section sets the detector (default: defaults)"
    )
    monitor.add_argument("overrides", nargs="*", help="dotted overrides, e.g. monitor.grad_norm_sigma=8")
    monitor.set_defaults(handler=cmd_monitor)

    launch = sub.add_parser(
        "launch",
        help="the monitoring service and, under it, the DeepSpeed job (restarted if it crashes or hangs)",
    )
    launch.add_argument("--config", required=True, help="run config (configs/train/*.yaml)")
    launch.add_argument(
        "--nproc", type=int, default=None, help="processes per node (default: GPUs, or 2 on CPU)"
    )
    launch.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('HOST slots=N' lines)")
    launch.add_argument("--master-addr", default=None, help="rendezvous host (default: the first host)")
    launch.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    launch.add_argument(
        "--no-ssh", action="store_true", help="the launcher's no-ssh mode: run on every node with --node-rank"
    )
    launch.add_argument("--node-rank", type=int, default=0, help="this node's rank in --no-ssh mode")
    launch.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    launch.set_defaults(handler=cmd_launch)

    demo = sub.add_parser(
        "demo", help="tokenizer, shards and 2-process DeepSpeed training on the built-in corpus"
    )
    demo.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument(
        "--steps", type=int, default=None, help="fewer steps than configs/train/demo.yaml, for a quick look"
    )
    demo.set_defaults(handler=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    # The DeepSpeed launcher appends --local_rank=N (also in the LOCAL_RANK variable, which is read).
    argv = [a for a in argv if not a.startswith(("--local_rank=", "--local-rank="))]
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UserError as exc:
        if debug:
            raise
        print(f"pretrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("pretrain: interrupted", file=sys.stderr)
        return 130
