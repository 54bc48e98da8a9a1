"""`pretrain tokenizer train` and `pretrain data prepare | verify | inspect`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pretrain.errors import CommandParser


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from pretrain.data.prepare import train_tokenizer_on
    from pretrain.object_store import refuse_url

    refuse_url(args.out, "--out")  # (a local directory: upload it, or prepare a dataset into a bucket)

    tokenizer = train_tokenizer_on(
        args.input or args.source,
        args.out,
        args.vocab_size,
        model_type=args.model_type,
        sample_sentences=args.sample_sentences,
        text_field=args.text_field,
        overwrite=args.overwrite,
        announce=lambda line: print(line, file=sys.stderr),
    )
    print(f"wrote {tokenizer.path} (vocab {tokenizer.vocab_size}, sha256 {tokenizer.sha256[:12]}...)")
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from pretrain.data.prepare import prepare, skipped_report, validation_report
    from pretrain.data.sources import resolve_source
    from pretrain.object_store import refuse_url

    refuse_url(args.tokenizer, "--tokenizer")
    if args.format == "megatron":  # token ids already (pretrain/data/megatron.py)
        from pretrain.data.megatron import resolve_megatron_source

        for spec in args.source:  # (memory-mapped where they lie)
            refuse_url(spec, "--source (with --format megatron)")
        source = resolve_megatron_source(args.source)
    else:
        _refuse_megatron_pairs(args.source)
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
        special_tokens={"eos": args.eos_token, "bos": args.bos_token, "pad": args.pad_token},
    )
    if not written:
        return 0  # prepare said "... already holds this dataset; nothing to do"
    for name, split in manifest["splits"].items():
        print(
            f"{name}: {split['documents']:,} documents, {split['tokens']:,} tokens in {len(split['shards'])} shard(s)"
        )
    skipped = skipped_report(manifest, source)
    if skipped:
        print(skipped)
    windows, warnings = validation_report(manifest)
    print(windows)
    for warning in warnings:
        print(warning, file=sys.stderr)
    from pretrain.object_store import is_url, join

    where = join(args.out, "manifest.json") if is_url(args.out) else Path(args.out) / "manifest.json"
    print(f"wrote {where} (corpus fingerprint {manifest['fingerprint']})")
    return 0


def _refuse_megatron_pairs(specs: list[str]) -> None:
    """A Megatron dataset passed without --format megatron: say so, not "does not exist"."""
    from pretrain.errors import UserError

    for spec in specs:
        prefix = spec[:-4] if spec.endswith((".bin", ".idx")) else spec
        if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
            raise UserError(
                f"{spec} is a Megatron indexed dataset ({prefix}.bin + {prefix}.idx): pass --format megatron"
            )


def cmd_data_verify(args: argparse.Namespace) -> int:
    from pretrain.data.shards import verify_dataset
    from pretrain.errors import UserError

    result = verify_dataset(args.dir)
    for problem in result["problems"]:
        print(f"pretrain data verify: {problem}", file=sys.stderr)
    rate = result["bytes"] / max(result["seconds"], 1e-9) / 1e9
    print(
        f"{args.dir}: {result['shards']} shard(s), {result['tokens']:,} tokens, {result['bytes'] / 1e6:,.1f} MB "
        f"read in {result['seconds']:.2f} s ({rate:.2f} GB/s)"
    )
    if result["problems"]:
        raise UserError(
            f"{args.dir} failed verification ({len(result['problems'])} problem(s) above): "
            "prepare the dataset again"
        )
    print("every shard matches its sha256 and every id is below the vocabulary size")
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    """The windows a run trained at one step: corpus, token range, documents and text."""
    import json

    from pretrain.data.provenance import Provenance, injected_at, trained_at
    from pretrain.errors import UserError
    from pretrain.run_dir import read_run_file

    run_dir = Path(args.run_dir)
    recorded = read_run_file(run_dir)
    if recorded is None:
        raise UserError(f"{run_dir} is not a run directory (no readable run.json): pass the run's run.dir")
    config = recorded["config"]  # flat keys: "data.dir", "data.mixture", "data.seq_len"
    sources = [(m["name"], m["dir"], m["weight"]) for m in config.get("data.mixture") or []]
    provenance = Provenance(
        sources or [("data", config["data.dir"], 1.0)], config["data.seq_len"], config.get("data.tokenizer")
    )
    attempts = trained_at(run_dir, args.step)
    if not attempts:
        raise UserError(
            f"step {args.step} is not in the data trace of {run_dir}: pick a step the run trained"
        )
    report = {
        "run_dir": str(run_dir),
        "step": args.step,
        "attempts": [
            {
                "attempt": a["attempt"],
                "windows": [
                    {"rank": rank, **provenance.window(w)}
                    for rank, ids in sorted(a["windows"].items())
                    for w in ids
                ],
            }
            for a in attempts
        ],
    }
    report["injected"] = injected_at(run_dir, config, args.step, len(attempts))  # the data is not the cause
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for fault in report["injected"]:  # first: a user reading on would blame the documents
        print(fault["line"])
    for attempt in report["attempts"]:
        again = " (trained again after a rollback or restart)" if attempt["attempt"] > 1 else ""
        print(
            f"step {args.step}, attempt {attempt['attempt']} of {len(attempts)}{again}: "
            f"{len(attempt['windows'])} windows"
        )
        for w in attempt["windows"]:
            first, last = w["tokens"]
            print(f"  rank {w['rank']}  window {w['window']}  {w['source']}  tokens {first:,}..{last:,}")
            for doc in w["documents"]:
                a, b = doc["tokens"]
                # A Megatron dataset's record is its document index (Megatron's document_indices).
                record = "document" if doc["origin"].startswith("megatron:") else "record"
                print(f"    {doc['origin']}  {record} {doc['record']}  (document tokens {a:,}..{b:,})")
            print(f"    text: {w['text']!r}")
    return 0


def register(sub) -> None:
    _register_tokenizer(sub)
    data = sub.add_parser("data", help="prepare token shards")
    actions = data.add_subparsers(
        dest="data_command", required=True, parser_class=CommandParser, metavar="ACTION"
    )
    _register_prepare(actions)

    verify = actions.add_parser(
        "verify", help="check every shard's sha256 and that every id fits the vocabulary"
    )
    verify.add_argument("dir", help="a prepared dataset directory")
    verify.set_defaults(handler=cmd_data_verify)

    inspect = actions.add_parser(
        "inspect",
        help="the windows a run trained at a step: corpus, documents and text (from its data trace)",
    )
    inspect.add_argument("--run-dir", required=True, help="the run directory (run.dir)")
    inspect.add_argument("--step", type=int, required=True, help="the training step")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(handler=cmd_data_inspect)


def _register_tokenizer(sub) -> None:
    tokenizer = sub.add_parser("tokenizer", help="train SentencePiece tokenizers")
    actions = tokenizer.add_subparsers(
        dest="tokenizer_command", required=True, parser_class=CommandParser, metavar="ACTION"
    )
    train = actions.add_parser("train", help="train a byte-fallback SentencePiece model")
    inputs = train.add_mutually_exclusive_group(required=True)
    inputs.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="files, globs or directories (.txt, .jsonl, .parquet, ..., also compressed: docs/data.md)",
    )
    inputs.add_argument(
        "--source", nargs="+", metavar="SRC", help="files/globs, a Hub dataset name, or builtin:pydoc"
    )
    train.add_argument("--vocab-size", type=int, required=True, help="number of pieces")
    train.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    train.add_argument("--out", required=True, help="output directory (tokenizer.model, tokenizer_meta.json)")
    train.add_argument(
        "--text-field", default="text", help="field holding the text in .jsonl/.parquet/Hub data"
    )
    train.add_argument(
        "--sample-sentences", type=int, default=2_000_000, help="sentences sampled for training"
    )
    train.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer in --out")
    train.set_defaults(handler=cmd_tokenizer_train)


def _register_prepare(actions) -> None:
    prep = actions.add_parser("prepare", help="tokenize a corpus into shards + manifest.json")
    prep.add_argument(
        "--source",
        nargs="+",
        required=True,
        metavar="SRC",
        help="files/globs (local, or URLs such as s3://bucket/*.jsonl), a Hub dataset name, or builtin:pydoc; "
        "with --format megatron, PREFIX (of "
        "PREFIX.bin + PREFIX.idx), a glob or a directory of them",
    )
    prep.add_argument(
        "--format",
        choices=["text", "megatron"],
        default="text",
        help="text: documents to tokenize (default); megatron: a Megatron-LM / GPT-NeoX indexed dataset, "
        "its ids converted as they are (--tokenizer: the one they came from)",
    )
    prep.add_argument(
        "--tokenizer",
        required=True,
        help="a SentencePiece tokenizer.model, a Hugging Face tokenizer.json, or a directory holding one",
    )
    for role, example in (("eos", "<|endoftext|>"), ("bos", "<s>"), ("pad", "<pad>")):
        prep.add_argument(
            f"--{role}-token",
            metavar="TOKEN",
            help=f"a Hugging Face tokenizer's {role.upper()} token (e.g. {example}), where it does not say "
            "itself (docs/data.md)",
        )
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
