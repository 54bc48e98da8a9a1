"""What the data allows, said before a job starts or when a corpus is prepared: enough training and
validation windows per rank for the run's micro-batches (`check_data`, run by `pretrain launch`
before any process), the validation windows `data prepare` gives at common sequence lengths, and
the faults `data inspect` must not blame on the documents."""

import json

import pytest

from pretrain.config import load_config
from pretrain.data import read_manifest
from pretrain.data.prepare import validation_report
from pretrain.data.provenance import injected_at
from pretrain.data.shards import split_windows
from pretrain.data.stream import WindowStream
from pretrain.errors import UserError
from pretrain.evaluation.held_out import RunEvaluation
from pretrain.pretraining import preflight
from tests.conftest import write_synthetic_dataset
from tests.helpers import FAST, TINY


def run_config(data_dir, *overrides):
    return load_config(TINY, [*FAST, f"data.dir={data_dir}", "run.dir=unused", *overrides])


def test_split_windows_counts_what_the_stream_serves(tmp_path):
    write_synthetic_dataset(tmp_path, (41, 100, 17, 1), val_shard_tokens=(50, 30))
    manifest = read_manifest(tmp_path)
    for seq_len in (4, 16, 40):
        for split in ("train", "validation"):
            assert (
                split_windows(manifest, split, seq_len)
                == WindowStream(tmp_path, seq_len, split=split).num_windows
            )


def test_too_few_validation_windows_per_rank_is_refused_before_the_job_starts(train_data):
    # 5,824 validation tokens: 11 windows of 513, 5 per rank on 2 ranks.
    cfg = run_config(train_data, "train.micro_batch_size=8")
    with pytest.raises(UserError) as refused:
        preflight(cfg, 2)
    line = str(refused.value)
    assert "\n" not in line
    for fragment in (
        "the validation split of",
        "gives 5 window(s) of 513 tokens per rank",
        "(11 over 2 rank(s))",
        "train.micro_batch_size",
        "--val-fraction (this one was prepared with 0.1)",
        "eval.every=0",
    ):
        assert fragment in line, line
    preflight(run_config(train_data, "train.micro_batch_size=8", "eval.every=0"), 2)  # no evaluation
    preflight(run_config(train_data, "train.micro_batch_size=5"), 2)  # one micro-batch per rank: enough


def test_too_few_training_windows_per_rank_is_refused_before_the_job_starts(train_data, code_data):
    # 237,391 training tokens: 7 windows of 32,769.
    long = ["data.seq_len=32768", "model.max_seq_len=32768", "eval.every=0"]
    with pytest.raises(
        UserError,
        match=r"the train split of .* gives 7 window\(s\) of 32769 tokens per rank .*"
        r"fewer than one micro-batch \(train.micro_batch_size=8\): lower data.seq_len",
    ):
        preflight(run_config(train_data, *long, "train.micro_batch_size=8"), 1)
    with pytest.raises(UserError, match=r"gives 3 window\(s\) .*\(7 over 2 rank\(s\)\)"):
        preflight(run_config(train_data, *long, "train.micro_batch_size=4"), 2)
    preflight(run_config(train_data, *long, "train.micro_batch_size=7"), 1)
    # A mixture counts its corpora's windows together (a small corpus repeats by design): 7 + 1.
    mixture = f"data.mixture=[{{name: a, dir: '{train_data}', weight: 1}}, {{name: b, dir: '{code_data}', weight: 1}}]"
    cfg = load_config(TINY, [*FAST, "run.dir=unused", mixture, *long, "train.micro_batch_size=8"])
    preflight(cfg, 1)
    with pytest.raises(UserError, match=r"the mixture's train splits give 4 window\(s\)"):
        preflight(load_config(TINY, [*FAST, "run.dir=unused", mixture, *long, "train.micro_batch_size=5"]), 2)


def test_prepare_reports_validation_windows_and_warns_below_one_default_micro_batch(
    tmp_path, tokenizer_dir, cli
):
    source = tmp_path / "docs.jsonl"
    source.write_text(
        "".join(json.dumps({"text": f"document {i}: " + "some words here " * 40}) + "\n" for i in range(40))
    )
    result = cli(
        "data",
        "prepare",
        "--source",
        source,
        "--tokenizer",
        tokenizer_dir,
        "--out",
        tmp_path / "data",
        "--val-fraction",
        "0.1",
        "--workers",
        "1",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(tmp_path / "data")
    counts = [split_windows(manifest, "validation", n) for n in (512, 1024, 2048, 4096)]
    assert (
        f"validation windows by data.seq_len: 512: {counts[0]}, 1024: {counts[1]}, 2048: {counts[2]}, "
        f"4096: {counts[3]}" in result.stdout
    )
    assert counts[2] < 8
    warning, comparing = result.stderr.strip().splitlines()
    assert comparing.startswith("warning: the validation split holds 4 document(s)")
    assert warning.startswith(
        f"warning: the validation split gives {counts[2]} window(s) at data.seq_len=2048"
    )
    assert "--val-fraction (this one: 0.1)" in warning and "eval.every=0" in warning
    # The rule's edge: 8 windows of 2,049 tokens at 2048 (8 · 2048 + 1 tokens) is one micro-batch at the defaults.
    write_synthetic_dataset(tmp_path / "edge", (10,), val_shard_tokens=(8 * 2048 + 1,))
    assert not any("micro-batch" in w for w in validation_report(read_manifest(tmp_path / "edge"))[1])
    write_synthetic_dataset(tmp_path / "short", (10,), val_shard_tokens=(8 * 2048,))
    assert "gives 7 window(s)" in validation_report(read_manifest(tmp_path / "short"))[1][0]


def split_manifest(documents: tuple[int, int], tokens: tuple[int, int]) -> dict:
    """A manifest's splits: (train, validation) documents and tokens, one shard each."""
    return {
        "splits": {
            name: {"documents": d, "tokens": t, "shards": [{"tokens": t}]}
            for name, d, t in zip(("train", "validation"), documents, tokens, strict=True)
        }
    }


@pytest.mark.parametrize(
    ("documents", "tokens", "expected"),
    [
        # 206 documents at the default --val-fraction 0.01: an optimizer comparison was judged on 2
        ((204, 2), (5_000_000, 60_000), "holds 2 document(s) and 29 window(s) at data.seq_len=2048"),
        ((204, 2), (5_000_000, 60_000), "prepare again with --val-fraction 0.15"),  # 30 of 206
        # enough documents, too few windows: 100 windows of 2,049 tokens out of 10M tokens
        ((9_900, 100), (9_950_000, 50_000), "--val-fraction 0.021"),
        (
            (60, 10),
            (100_000, 20_000),
            "too small to hold that out: compare runs with `pretrain eval --data DIR`",
        ),
        ((3_000, 30), (99_000_000, 1_000_000), None),  # 30 documents, 488 windows: enough
    ],
)
def test_a_validation_split_too_small_to_compare_runs_is_warned_with_what_to_pass(
    documents, tokens, expected
):
    from pretrain.data.prepare import comparison_warning

    warning = comparison_warning(split_manifest(documents, tokens), 2048)
    assert warning == expected if expected is None else expected in warning, warning


def test_injected_faults_come_from_the_fired_record_or_else_the_recorded_config(tmp_path):
    config = {"faults.spike_steps": [45], "faults.spike_factor": 50.0, "faults.nan_steps": [7]}
    (spike,) = injected_at(tmp_path, config, 45)  # no faults_fired.json: the config says
    assert spike["fault"] == "spike" and spike["line"] == (
        "step 45: the loss spike was injected (faults.spike_steps, the loss × 50): "
        "the documents below are not its cause"
    )
    assert injected_at(tmp_path, config, 44) == []
    (nan,) = injected_at(tmp_path, config, 7, attempts=2)
    assert nan["line"].startswith(
        "step 7: the NaN loss was injected (faults.nan_steps, in the first attempt)"
    )
    (tmp_path / "faults_fired.json").write_text(json.dumps(["grad_spike:9", "kill:3"]))
    assert [f["fault"] for f in injected_at(tmp_path, {"faults.grad_spike_factor": 20.0}, 9)] == [
        "grad_spike"
    ]
    assert injected_at(tmp_path, config, 45) == []  # the record says it did not fire (yet)
    assert injected_at(tmp_path, config, 3) == []  # a killed rank is no loss fault


def test_the_runs_evaluation_reads_whole_micro_batches_of_each_ranks_share(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000020"
    checkpoint.mkdir(parents=True)
    sources = {
        "prose": {"served": 9, "stream": {"fingerprint": "aaa"}},
        "code": {"stream": {"fingerprint": "bbb"}},
    }
    (checkpoint / "train_state.json").write_text(
        json.dumps({"step": 20, "world_size": 2, "data": {"sources": sources}})
    )
    config = {
        "data": {"seq_len": 512, "document_masking": True},
        "train": {"micro_batch_size": 2},
        "eval": {"batches": 2},
    }
    run = RunEvaluation.of(checkpoint, config)
    assert run.windows(11) == 8  # 5 per rank: 2 micro-batches of 2 each
    assert run.windows(7) == 4  # 3 per rank: 1 micro-batch
    assert run.windows(3) == 0  # 1 per rank: none (refused before a run starts)
    assert run.describe() == "eval.batches=2 × train.micro_batch_size=2 × 2 ranks, document masking"
    assert run.metric("bbb") == "eval/loss/code" and run.metric("ccc") is None
    with pytest.raises(UserError, match="is not a corpus the run evaluated"):
        run.metric_of("ccc", tmp_path)
    summary = {"eval": [{"step": 10, "loss/code": 6.0}, {"step": 20, "loss": 5.5, "loss/code": 5.25}]}
    (tmp_path / "run" / "train_summary.json").write_text(json.dumps(summary))
    assert run.logged(checkpoint, "eval/loss/code") == 5.25 and run.logged(checkpoint, "eval/loss") == 5.5
    assert RunEvaluation.of(checkpoint, {"finetune": {"task": "sft"}, **config}) is None  # a fine-tune
