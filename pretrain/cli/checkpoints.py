"""Commands that read trained checkpoints: `eval`, `generate`, `export-hf`, `predict`, `attention`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_HARNESS_OPTIONS = ("--include-path", "--limit", "--out")  # `pretrain eval --tasks` only


def cmd_eval(args: argparse.Namespace) -> int:
    """Validation perplexity over a prepared dataset (--data), or the lm-evaluation-harness (--tasks)."""
    from pretrain.errors import UserError

    if (args.data is None) == (args.tasks is None):
        raise UserError(
            "`pretrain eval` takes exactly one of --data PREPARED_DIR (validation loss and perplexity) "
            "and --tasks T1,T2 (lm-evaluation-harness tasks)"
        )
    harness = args.tasks is not None
    mode, other = ("--tasks", ("--max-batches", "--as-run")) if harness else ("--data", _HARNESS_OPTIONS)
    if args.as_run and not harness:
        mode, other = "--as-run", ("--batch-size", "--max-batches")  # the run's micro-batches, all of them
    given = [flag for flag in other if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    if given:
        raise UserError(f"{', '.join(given)} cannot be used with {mode}")
    args.batch_size = args.batch_size or 8
    return _eval_tasks(args) if harness else _eval_perplexity(args)


def _eval_perplexity(args: argparse.Namespace) -> int:
    """The whole validation split (or --max-batches of it) in fp32; or, with --as-run, the windows,
    micro-batches and bf16 weights of the run's own evaluation. Either way, says what it read."""
    from pretrain.data import WindowStream, read_manifest
    from pretrain.data.shards import fingerprint
    from pretrain.evaluation.held_out import RunEvaluation
    from pretrain.evaluation.inference import load_trained, perplexity, window_length

    trained = load_trained(args.checkpoint)
    run = RunEvaluation.of(trained.directory, trained.run_config)
    seq_len = window_length(trained)
    if args.as_run:
        result = _as_run(trained, run, args.data)  # (a directory or a URL: not a Path, s3:/b/x)
    else:
        result = perplexity(trained, args.data, args.batch_size, args.max_batches)
        result["windows"] = result["tokens"] // seq_len
    total = WindowStream(args.data, seq_len, split="validation").num_windows
    result |= {"split": "validation", "data": str(args.data), "split_windows": total, "seq_len": seq_len}
    if args.json:
        print(json.dumps(result))
        return 0
    how = (
        f"as the run's evaluation read them ({run.describe()}, bf16)"
        if args.as_run
        else (f"in batches of {args.batch_size}, fp32")
    )
    print(
        f"{result['checkpoint']}: validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
        f"over {result['windows']:,} of the {total:,} windows of {seq_len} tokens ({result['tokens']:,} tokens) "
        f"of the validation split of {args.data}, {how}"
    )
    if args.as_run:
        if result["logged"] is not None:
            print(f"the run logged {result['logged_as']} {result['logged']:.4f} at step {run.step}")
        return 0
    metric = run.metric(fingerprint(read_manifest(args.data))) if run is not None else None
    if metric is not None:  # the run evaluated this corpus: say how its number differs
        print(
            f"the run's own {metric} reads {run.windows(total):,} of these windows ({run.describe()}) "
            "in bf16: --as-run evaluates exactly those"
        )
    return 0


def _as_run(trained, run, data_dir: str) -> dict:
    """What the run's evaluation computes at the checkpoint's step on `data_dir` (a directory or a URL),
    one of its corpora."""
    import torch

    from pretrain.data import read_manifest
    from pretrain.data.shards import fingerprint
    from pretrain.errors import UserError
    from pretrain.evaluation.held_out import run_validation_loss

    if run is None:
        raise UserError(
            f"{trained.directory} is not a pretraining checkpoint of ours (no train_state.json, or a fine-tune): "
            "--as-run reproduces a pretraining run's own evaluation; drop --as-run"
        )
    manifest = read_manifest(data_dir)
    metric = run.metric_of(fingerprint(manifest), data_dir)
    eos_id = manifest["tokenizer"]["eos_id"] if run.document_masking else None
    model = trained.model.to(torch.bfloat16)  # the engine's bf16 copy of the fp32 master weights
    result = run_validation_loss(model, data_dir, run, eos_id)
    return result | {
        "checkpoint": str(trained.directory),
        "step": run.step,
        "logged_as": metric,
        "logged": run.logged(trained.directory, metric),
    }


def _eval_tasks(args: argparse.Namespace) -> int:
    from pretrain.evaluation.harness import evaluate_checkpoint, harness_utils

    results, path = evaluate_checkpoint(
        args.checkpoint, args.tasks, args.include_path, args.limit, args.batch_size, args.out
    )
    if args.json:
        summary = {key: results[key] for key in ("results", "groups") if results.get(key)}
        print(
            json.dumps(summary | {"eval_results": str(path)}, default=harness_utils.handle_non_serializable)
        )
    else:
        print(harness_utils.make_table(results))
        if results.get("groups"):
            print(harness_utils.make_table(results, "groups"))
        print(f"wrote {path}")
    return 0


def count_or_fraction(text: str) -> float | int:
    """--limit: a number of examples per task, or a fraction of each task's examples below 1."""
    value = float(text)
    return int(value) if value >= 1 and value.is_integer() else value


def cmd_generate(args: argparse.Namespace) -> int:
    from pretrain.evaluation.inference import continue_text

    text = continue_text(
        args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed
    )
    print(args.prompt + text)
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from pretrain.evaluation.inference import export_hf

    source, out = export_hf(args.checkpoint, args.out, args.dtype)
    architecture = json.loads((Path(out) / "config.json").read_text())["architectures"][0]
    tokenizer = (
        "the tokenizer for SentencePiece and for AutoTokenizer"
        if (Path(out) / "tokenizer.model").is_file()
        else "its Hugging Face tokenizer.json unchanged, with a tokenizer_config.json for AutoTokenizer"
    )
    print(
        f"exported {source} to {out}: {architecture} weights and config, generation config, {tokenizer} "
        "(see docs/huggingface.md)"
    )
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from pretrain.finetune import predict

    written = predict(args.checkpoint, args.input, args.out, args.max_new_tokens)
    skipped = (
        f" ({written.skipped} row(s) without text marked skipped, no prediction)" if written.skipped else ""
    )
    print(f"wrote {written.rows} predictions to {args.out}{skipped}")
    if written.accuracy is not None:
        print(f"accuracy {written.accuracy:.4f} on the {written.labelled} labelled rows")
    return 0


def cmd_attention(args: argparse.Namespace) -> int:
    from pretrain.evaluation.attention_maps import render

    result = render(args.checkpoint, args.text, args.out)
    print(
        f"{result['layers']} layers x {result['heads']} heads over {result['tokens']} tokens: "
        f"{result['png']} (grid), {result['html']} (interactive head view)"
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pretrain import checkpoint
    from pretrain.checkpoint.integrity import timed_verify
    from pretrain.errors import UserError

    path = Path(args.checkpoint)
    if checkpoint.TAG_PATTERN.match(path.name) and path.is_dir():
        directories = [path]
    else:
        run_dir = path.parent if path.name == "checkpoints" else path
        directories = [checkpoint.checkpoints_dir(run_dir) / t for t in checkpoint.tags_on_disk(run_dir)]
    if not directories:
        raise UserError(f"{path} holds no checkpoint: pass a run directory or a checkpoint directory")
    bad = 0
    for directory in directories:
        reason, size, seconds = timed_verify(directory)
        bad += reason is not None
        print(
            f"{directory}: {'intact' if reason is None else reason} "
            f"({size / 1e6:,.1f} MB in {seconds:.2f} s, {size / max(seconds, 1e-9) / 1e9:.2f} GB/s)"
        )
    if bad:
        raise UserError(f"{bad} of {len(directories)} checkpoint(s) failed verification (above)")
    return 0


def _with_checkpoint(sub, name: str, help: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help)
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory, a run directory (its newest), or a Hugging Face Llama directory",
    )
    return parser


def register(sub) -> None:
    evaluate = _with_checkpoint(
        sub, "eval", "validation perplexity (--data) or lm-evaluation-harness tasks (--tasks) of a checkpoint"
    )
    evaluate.add_argument("--data", help="prepared dataset: loss and perplexity over its validation split")
    evaluate.add_argument(
        "--tasks", help="lm-evaluation-harness tasks, comma-separated (needs the `eval` extra)"
    )
    evaluate.add_argument("--batch-size", type=int, default=None, help="sequences per forward (default 8)")
    evaluate.add_argument(
        "--max-batches", type=int, default=None, help="--data: stop after this many batches"
    )
    evaluate.add_argument(
        "--as-run",
        action="store_true",
        help="--data: evaluate what the run's own evaluation did (its windows, micro-batches, ranks, bf16)",
    )
    evaluate.add_argument("--include-path", help="--tasks: a directory of task YAML files of your own")
    evaluate.add_argument(
        "--limit",
        type=count_or_fraction,
        help="--tasks: examples per task (a fraction of them, below 1); for testing",
    )
    evaluate.add_argument("--out", help="--tasks: results file or directory (default ./eval_results.json)")
    evaluate.add_argument("--json", action="store_true", help="print one JSON object")
    evaluate.set_defaults(handler=cmd_eval)

    gen = _with_checkpoint(sub, "generate", "sample text from a checkpoint (KV cache)")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int, default=50, help="0 disables")
    gen.add_argument("--top-p", type=float, default=0.95, help="1.0 disables")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(handler=cmd_generate)

    export = _with_checkpoint(sub, "export-hf", "write a checkpoint as a Hugging Face Llama directory")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    export.set_defaults(handler=cmd_export_hf)

    predict = _with_checkpoint(sub, "predict", "labels (classification) or completions (sft) for a file")
    predict.add_argument("--input", required=True, help=".csv/.jsonl/.parquet with the fine-tuning columns")
    predict.add_argument(
        "--out", required=True, help="output .jsonl or .csv (the input rows plus predictions)"
    )
    predict.add_argument("--max-new-tokens", type=int, default=64, help="sft: tokens per completion")
    predict.set_defaults(handler=cmd_predict)

    verify = _with_checkpoint(
        sub, "verify", "check checkpoints against their manifests (sizes, sha256); read-only"
    )
    verify.set_defaults(handler=cmd_verify)

    attention = _with_checkpoint(
        sub, "attention", "attention maps of a text: a PNG grid and an HTML head view"
    )
    attention.add_argument("--text", required=True, help="the text to look at")
    attention.add_argument("--out", required=True, help="output prefix: writes PREFIX.png and PREFIX.html")
    attention.set_defaults(handler=cmd_attention)
