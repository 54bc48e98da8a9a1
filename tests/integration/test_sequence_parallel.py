"""Sequence parallelism (`parallel.sequence`, pretrain/parallel/sequence.py) against one rank
(docs/training.md, Long context).

In fp32, one 2-process job (gloo, CPU) of this file's `worker()`: one attention layer split across
the 2 ranks by DeepSpeed's `DistributedAttention` gives the unsplit layer's outputs and gradients
(multi-head; GQA with one key/value head, replicated; document masking with documents across the
shards' boundary), and the whole model on an 8,192-token window gives the unsplit model's loss
and, summed over the group, its gradients.

In bf16, real `pretrain train` jobs on 8,192-token windows with document masking and ZeRO-3: 2
processes at parallel.sequence=2 train steps 1-2 and stop (saving step 2); 1 process trains
steps 1-3 with the same global batch; 1 process at parallel.sequence=1 resumes the first job's
step 2 (another S and world size: DeepSpeed's universal conversion) and trains step 3; 2 processes
at parallel.sequence=2 under ZeRO-2 train step 1. Losses, gradient norms (whole and per layer
group), the held-out loss and the data position agree.

Run by pytest, this file launches itself: `python -m torch.distributed.run --nproc_per_node 2
-m tests.integration.test_sequence_parallel OUT_DIR` runs `worker()` on each rank, which writes
OUT_DIR/rank_N.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

S = 2
# fp32 (the worker; docs/training.md, Long context). Outputs and losses: the largest absolute
# difference (measured 0: the same sums per head); gradients: the largest difference over the
# largest element, per tensor (measured 7.7e-7 for a layer, 5.3e-7 for the model).
LAYER_TOLERANCE = 1e-5  # the bound for one layer's outputs
MODEL_LOSS_TOLERANCE, MODEL_GRAD_TOLERANCE = 1e-5, 1e-5
# bf16 jobs, about 4-6x the largest difference measured between the split and the unsplit job:
LOSS_TOLERANCE = 1e-4  # measured 2.4e-6 at step 2, 2.6e-5 at step 3 after the resume
GRAD_NORM_TOLERANCE = 0.01  # relative, step 1's whole norm and each group's: measured 0.17%


# ------------------------------------------------------------------------------ the 2-process worker


def layer_case(name: str, n_kv_heads: int, masking: bool, group) -> dict:
    """One attention layer's outputs and parameter gradients, split and whole, in fp32."""
    import torch
    import torch.distributed as dist

    from pretrain.config import ModelConfig
    from pretrain.data.loader import document_ids
    from pretrain.model.transformer import Attention, document_mask, positions_in_document, rope_tables
    from pretrain.parallel.sequence import UlyssesAttention

    T, B = 2048, 2
    cfg = ModelConfig(d_model=64, n_heads=4, n_kv_heads=n_kv_heads, n_layers=1, max_seq_len=T, vocab_size=97)
    torch.manual_seed(1)
    whole = Attention(cfg)
    x = torch.randn(B, T, cfg.d_model)
    tokens = torch.randint(3, 97, (B, T))
    tokens[:, [100, 1000, 1500]] = 2  # EOS: documents across the shards' boundary at 1024
    tokens[1, 1023] = 2  # and one that ends just before it
    ids = document_ids(tokens, 2) if masking else None
    positions = positions_in_document(ids) if masking else torch.arange(T).expand(B, T)
    cos, sin = rope_tables(T, cfg.head_dim, cfg.rope_theta)
    mask = document_mask(ids, "dense") if masking else None

    def rope(part):
        return cos[positions[:, part]].unsqueeze(-2), sin[positions[:, part]].unsqueeze(-2)

    everything = slice(0, T)
    expected, _ = whole(x, rope(everything), mask=mask)
    expected.pow(2).sum().backward()
    split = Attention(cfg)
    split.load_state_dict(whole.state_dict())
    split.core = UlyssesAttention(group, n_kv_heads, S)
    rank = dist.get_rank(group)
    part = slice(rank * T // S, (rank + 1) * T // S)
    out, _ = split(x[:, part], rope(part), mask=mask)
    out.pow(2).sum().backward()
    gathered = [torch.empty_like(out) for _ in range(S)]
    dist.all_gather(gathered, out.detach().contiguous(), group=group)
    grads = {n: p.grad for n, p in split.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad, group=group)
    wanted = {n: p.grad for n, p in whole.named_parameters()}
    return {
        "case": name,
        "output": float((torch.cat(gathered, dim=1) - expected.detach()).abs().max()),
        "output_scale": float(expected.detach().abs().max()),
        "grad": max(float((grads[n] - wanted[n]).abs().max() / wanted[n].abs().max()) for n in wanted),
    }


def model_case(group, masking: bool) -> dict:
    """The whole (tiny) model on one 8,192-token window, in fp32: the window's loss on every rank,
    and the gradients summed over the group."""
    import torch
    import torch.distributed as dist

    from pretrain.config import ModelConfig
    from pretrain.data.loader import document_ids
    from pretrain.model.transformer import Transformer
    from pretrain.parallel.sequence import SequenceShard, UlyssesAttention, window_mean_loss

    T = 8192
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=T)
    torch.manual_seed(2)
    whole = Transformer(cfg)
    window = torch.randint(3, 97, (1, T + 1))
    window[0, torch.randint(0, T, (12,))] = 2
    batch = {"tokens": window[:, :-1], "targets": window[:, 1:].clone()}
    batch["targets"][0, :7] = -100  # a few ignored targets, all in rank 0's shard
    if masking:
        batch["document_ids"] = document_ids(batch["tokens"], 2)
    expected = whole(**batch).loss
    expected.backward()
    split = Transformer(cfg)
    split.load_state_dict(whole.state_dict())
    for block in split.layers:
        block.attn.core = UlyssesAttention(group, cfg.n_kv_heads, S)
    split.register_forward_hook(window_mean_loss(group), with_kwargs=True)
    shard = SequenceShard.of(dist.get_rank(), dist.get_world_size(), S)
    loss = split(**shard.split(batch)).loss
    loss.backward()
    worst = 0.0
    for p, q in zip(split.parameters(), whole.parameters(), strict=True):
        dist.all_reduce(p.grad, group=group)
        worst = max(worst, float((p.grad - q.grad).abs().max() / q.grad.abs().max()))
    return {"loss": float(loss), "expected": float(expected), "grad": worst}


def worker() -> None:
    from pretrain.parallel.distributed import DistEnv, init_distributed
    from pretrain.parallel.sequence import sequence_groups

    out = Path(sys.argv[1])
    env = DistEnv.from_environ()
    init_distributed(env)
    group = sequence_groups(S).get_sequence_parallel_group()
    results = {
        "layers": [
            layer_case("multi-head, causal", 4, False, group),
            layer_case("GQA, 1 key/value head (replicated), document masking", 1, True, group),
            layer_case("GQA, 2 key/value heads, document masking", 2, True, group),
        ],
        "model": [model_case(group, masking=True), model_case(group, masking=False)],
    }
    (out / f"rank_{env.rank}.json").write_text(json.dumps(results, indent=1))


# ---------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def fp32_job(tmp_path_factory) -> list[dict]:
    from tests.integration.runs import worker_results

    return worker_results(2, "tests.integration.test_sequence_parallel", tmp_path_factory.mktemp("sp"))


def test_a_split_attention_layer_gives_the_unsplit_layers_outputs_and_gradients_in_fp32(fp32_job):
    for rank in fp32_job:
        for case in rank["layers"]:
            assert case["output"] <= LAYER_TOLERANCE, case
            assert case["grad"] <= LAYER_TOLERANCE, case


def test_the_split_model_gives_the_windows_loss_and_gradients_in_fp32(fp32_job):
    """The loss is the mean over the whole window (7 ignored targets on one shard included), on
    every rank of the group; the group's gradients add up to the unsplit model's."""
    for rank in fp32_job:
        for model in rank["model"]:  # with document masking, and without
            assert abs(model["loss"] - model["expected"]) <= MODEL_LOSS_TOLERANCE, model
            assert model["grad"] <= MODEL_GRAD_TOLERANCE, model


# 8,192-token windows of a 1-layer model with 2 query heads and 1 key/value head (replicated at S=2)
LONG = [
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.max_seq_len=8192",
    "data.seq_len=8192",
    "data.document_masking=true",
    "train.micro_batch_size=1",
    "train.steps=3",
    "checkpoint.every=2",
    "eval.every=2",
    "eval.batches=1",
    "logging.layer_grad_norms_every=1",
    "engine.deepspeed_config=configs/deepspeed/zero3.json",
]


@pytest.fixture(scope="module")
def long_data(tmp_path_factory, tokenizer_dir) -> Path:
    """The pydoc topics with 40% held out: enough validation tokens for 8,192-token windows."""
    import pydoc_data.topics

    from pretrain.data import prepare_dataset, resolve_source

    directory = tmp_path_factory.mktemp("long_data")
    corpus = directory / "topics.jsonl"
    topics = pydoc_data.topics.topics
    corpus.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
    prepare_dataset(
        resolve_source(str(corpus)), tokenizer_dir, directory / "data", val_fraction=0.4, progress=False
    )
    return directory / "data"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, long_data) -> dict[str, Path]:
    """The split job (stopped after step 2), the one-process job, the split job resumed by one
    process at S = 1, and the split job's first step under ZeRO-2."""
    from tests.integration.runs import FAST, TINY, torchrun

    def train(nproc: int, run_dir: Path, *overrides: str) -> None:
        # one thread per process (torchrun's default for 2): under xdist the other worker has the
        # other core, and a 1-process job's 2 threads took 2.5x the CPU time
        command = [*torchrun(nproc), "--config", TINY, f"run.dir={run_dir}", f"data.dir={long_data}"]
        result = subprocess.run(
            [*command, *FAST, *LONG, *overrides],
            capture_output=True,
            text=True,
            timeout=600,
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    split, single = tmp_path_factory.mktemp("split"), tmp_path_factory.mktemp("single")
    train(2, split, f"parallel.sequence={S}", "train.stop_at_step=2")
    train(1, single)
    resumed = tmp_path_factory.mktemp("resumed")
    shutil.copytree(split, resumed, dirs_exist_ok=True)
    train(1, resumed, "checkpoint.resume=auto")
    zero2 = tmp_path_factory.mktemp("zero2")  # (ZeRO-2 divides by the data-parallel ranks itself)
    train(
        2,
        zero2,
        f"parallel.sequence={S}",
        "train.stop_at_step=1",
        "engine.deepspeed_config=configs/deepspeed/zero2.json",
    )
    return {"split": split, "single": single, "resumed": resumed, "zero2": zero2}


def test_two_ranks_sharing_each_window_train_as_one_process_does(jobs):
    from tests.integration.runs import metrics, train_state

    split, single, resumed = (metrics(jobs[k]) for k in ("split", "single", "resumed"))
    assert sorted(split) == [1, 2] and sorted(single) == [1, 2, 3]
    for step in (1, 2):
        assert abs(split[step]["train/loss"] - single[step]["train/loss"]) <= LOSS_TOLERANCE, step
        assert split[step]["train/tokens"] == single[step]["train/tokens"] == step * 8192
    first = [k for k in single[1] if k.startswith("train/grad_norm")]
    assert len(first) == 4  # the whole norm and three layer groups
    for key in first:
        assert split[1][key] == pytest.approx(single[1][key], rel=GRAD_NORM_TOLERANCE), key
    assert train_state(jobs["split"], 2)["data"] == train_state(jobs["single"], 2)["data"]
    # resumed at S = 1 by one process (universal conversion): the one-process job's step 3
    assert abs(resumed[3]["train/loss"] - single[3]["train/loss"]) <= LOSS_TOLERANCE
    assert train_state(jobs["resumed"], 3)["data"] == train_state(jobs["single"], 3)["data"]


def test_under_zero2_the_split_jobs_first_step_is_the_one_process_jobs(jobs):
    """ZeRO-2's own reduction at S = 2 (not the ZeRO-3 path the run reroutes): the loss and every
    gradient norm of step 1 as one process computes them."""
    from tests.integration.runs import metrics

    zero2, single = metrics(jobs["zero2"])[1], metrics(jobs["single"])[1]
    assert abs(zero2["train/loss"] - single["train/loss"]) <= LOSS_TOLERANCE
    norms = [k for k in single if k.startswith("train/grad_norm")]
    assert len(norms) == 4
    for key in norms:
        assert zero2[key] == pytest.approx(single[key], rel=GRAD_NORM_TOLERANCE), key


def test_the_held_out_loss_of_a_split_job_is_the_one_process_jobs(jobs):
    from monitoring.protocol import SUMMARY_FILE

    def evaluations(run_dir):
        return {e["step"]: e["loss"] for e in json.loads((run_dir / SUMMARY_FILE).read_text())["eval"]}

    split, single = evaluations(jobs["split"]), evaluations(jobs["single"])
    assert split.keys() == {0, 2}
    for step in (0, 2):
        assert abs(split[step] - single[step]) <= LOSS_TOLERANCE, (step, split, single)


if __name__ == "__main__":
    worker()
