"""What both test tiers share: the small training config and assertions."""

from pretrain.config import REPO_CONFIG_DIR

TINY = str(REPO_CONFIG_DIR / "train" / "tiny.yaml")
# configs/train/tiny.yaml shrunk to a 2-layer, d_model 64 model on the session's 512-piece corpus.
FAST = [
    "model.vocab_size=512",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.micro_batch_size=2",
    "optim.lr=3e-3",
    "schedule.warmup_steps=2",
    "eval.batches=2",
    "logging.every=1",
    "logging.layer_grad_norms_every=2",
    "run.deterministic=true",
    "eval.attention_probe=null",  # drawing it takes ~0.8 s per evaluation; the golden run draws it
]

# FAST's model continued at twice the session corpus's 512-token windows, with Llama 3.1's rope
# scaling (docs/training.md, Long context)
LONGER_CONTEXT = [
    "model.max_seq_len=1024",
    "data.seq_len=1024",
    "model.rope_scaling.type=llama3",
    "model.rope_scaling.factor=2",
    "model.rope_scaling.original_max_position_embeddings=512",
]


def assert_one_line_error(result, *fragments: str) -> None:
    """Bad input: status 2, one line on stderr naming the problem, no traceback, nothing on stdout.
    `result` is a CompletedProcess or the unit tier's in-process equivalent."""
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""


def metrics_by_step(run_dir) -> dict[int, dict]:
    """metrics.jsonl per step, the last record of each (a resumed run appends)."""
    from pretrain.reporting.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(run_dir)}
