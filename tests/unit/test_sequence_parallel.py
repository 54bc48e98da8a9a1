"""Sequence parallelism's parts that need no process group (pretrain/parallel/sequence.py,
docs/training.md, Long context): each rank's shard of a window, the checks before a job, the
batch plan and DeepSpeed's settings. The attention across ranks and the jobs against one process
are in tests/integration/test_sequence_parallel.py."""

import pytest
import torch

from pretrain.config import ModelConfig, load_config
from pretrain.config.schema import ParallelConfig
from pretrain.errors import ConfigError, UserError
from pretrain.model.transformer import Transformer, positions_in_document
from pretrain.parallel.engine import check_zero3_buckets, deepspeed_config, plan_batches
from pretrain.parallel.sequence import SequenceShard, UlyssesAttention, own_document_ids, unsplit
from pretrain.pretraining import preflight
from tests.conftest import packed_document_ids, small_model_config
from tests.helpers import FAST, TINY


def window_batch(T: int = 16, masking: bool = True) -> dict[str, torch.Tensor]:
    tokens = torch.arange(2 * T).reshape(2, T)
    batch = {"tokens": tokens, "targets": tokens + 1}
    if masking:
        batch["document_ids"] = packed_document_ids(2, [5, 6, 5])  # documents across the middle
    return batch


def test_each_rank_keeps_its_share_of_the_window_with_its_tokens_positions_in_the_window():
    batch = window_batch()
    ids = batch["document_ids"]
    parts = [SequenceShard.of(rank, 4, 2).split(batch) for rank in (0, 1)]
    assert [SequenceShard.of(rank, 4, 2).data_rank for rank in range(4)] == [0, 0, 1, 1]
    assert torch.equal(torch.cat([p["tokens"] for p in parts], dim=1), batch["tokens"])
    assert torch.equal(torch.cat([p["targets"] for p in parts], dim=1), batch["targets"])
    # RoPE's positions restart at each document, and continue across the shards' boundary
    assert torch.equal(torch.cat([p["positions"] for p in parts], dim=1), positions_in_document(ids))
    assert parts[1]["positions"][0, 0] > 0 or parts[1]["positions"][1, 0] > 0
    assert all(p["document_ids"] is ids for p in parts)  # the mask is the whole window's
    plain = SequenceShard.of(1, 2, 2).split(window_batch(masking=False))
    assert torch.equal(plain["positions"], torch.arange(8, 16))
    assert SequenceShard.of(1, 2, 1).split(batch) is batch  # S = 1: the batch itself


def test_a_shards_own_document_ids_say_which_of_its_tokens_share_a_document():
    batch = window_batch()
    ids = batch["document_ids"]
    for rank in (0, 1):
        shard = SequenceShard.of(rank, 2, 2).split(batch)
        own = own_document_ids(shard)
        theirs = ids[:, rank * 8 : (rank + 1) * 8]
        assert torch.equal(own[:, :, None] == own[:, None, :], theirs[:, :, None] == theirs[:, None, :])
    assert own_document_ids(batch) is ids and own_document_ids(window_batch(masking=False)) is None


def test_the_model_given_its_tokens_positions_computes_what_it_computes_from_the_document_ids():
    torch.manual_seed(0)
    model = Transformer(small_model_config())
    tokens, ids = torch.randint(0, 97, (2, 16)), packed_document_ids(2, [5, 6, 5])
    expected = model(tokens, document_ids=ids).logits
    assert torch.equal(model(tokens, document_ids=ids, positions=positions_in_document(ids)).logits, expected)
    for positions in ("learned", "sinusoidal"):
        torch.manual_seed(0)
        other = Transformer(small_model_config(positions=positions))
        assert torch.equal(
            other(tokens, document_ids=ids, positions=positions_in_document(ids)).logits,
            other(tokens, document_ids=ids).logits,
        )


def test_a_split_core_attends_locally_while_unsplit():
    """What the instability precursors' probe uses: no all-to-all, no process group."""
    torch.manual_seed(0)
    model = Transformer(small_model_config())
    tokens = torch.randint(0, 97, (2, 16))
    expected = model(tokens).logits
    for block in model.layers:
        block.attn.core = UlyssesAttention(group=None, n_kv_heads=2, size=2)
    with unsplit(model):
        assert torch.equal(model(tokens).logits, expected)
    assert all(block.attn.core.split for block in model.layers)


@pytest.mark.parametrize(
    ("fields", "seq_len", "fragment"),
    [
        ({}, 1004, "data.seq_len=1004 is not divisible by parallel.sequence=8"),
        ({"n_heads": 12, "d_model": 768}, 1024, "model.n_heads=12 is not divisible by parallel.sequence=8"),
        (
            {"n_heads": 24, "n_kv_heads": 12, "d_model": 768},
            1024,
            "model.n_kv_heads=12 and parallel.sequence=8",
        ),
    ],
)
def test_what_sequence_parallelism_cannot_split_is_refused_in_one_line(fields, seq_len, fragment):
    model = ModelConfig(**({"n_heads": 16, "d_model": 1024} | fields))
    with pytest.raises(ConfigError) as refused:
        ParallelConfig(sequence=8).check(model, seq_len)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
    ParallelConfig(sequence=8).check(ModelConfig(n_heads=16, n_kv_heads=2, d_model=1024), 1024)  # replicated
    with pytest.raises(ConfigError, match="parallel.sequence"):
        ParallelConfig(sequence=0)


def test_the_batch_plan_counts_data_parallel_ranks_and_deepspeed_gets_the_groups_size(tmp_path):
    cfg = load_config(TINY, [*FAST, "run.dir=unused", "parallel.sequence=2", "train.grad_accum=3"])
    plan = plan_batches(cfg.train, 512, 4, 2)
    assert (plan.world_size, plan.sequence_parallel, plan.global_batch_size) == (2, 2, 2 * 3 * 2)
    with pytest.raises(ConfigError, match=r"× 2 data-parallel ranks \(4 processes / parallel.sequence=2\)"):
        plan_batches(load_config(TINY, [*FAST, "train.global_batch_size=5"]).train, 512, 4, 2)
    ds = deepspeed_config(cfg.engine, 1.0, plan)
    assert ds["sequence_parallel_size"] == 2 and ds["train_batch_size"] == 12
    assert "sequence_parallel_size" not in deepspeed_config(cfg.engine, 1.0, plan_batches(cfg.train, 512, 4))


def test_zero3_reduces_gradients_on_its_path_that_averages_over_data_parallel_ranks(tmp_path):
    """DeepSpeed 0.19.8's ZeRO-3 reduce-scatter divides by every process (half the gradient at
    S = 2, measured); its contiguous path by the data-parallel ones."""
    cfg = load_config(TINY, [*FAST, "engine.deepspeed_config=configs/deepspeed/zero3.json"])
    ds = deepspeed_config(cfg.engine, 1.0, plan_batches(cfg.train, 512, 2, 2))
    assert ds["zero_optimization"]["reduce_scatter"] is False
    assert ds["zero_optimization"]["contiguous_gradients"] is True
    unchanged = deepspeed_config(cfg.engine, 1.0, plan_batches(cfg.train, 512, 2))
    assert "reduce_scatter" not in unchanged["zero_optimization"]
    given = tmp_path / "zero3.json"
    given.write_text('{"zero_optimization": {"stage": 3, "reduce_scatter": true}}')
    engine = load_config(TINY, [*FAST, f"engine.deepspeed_config={given}"]).engine
    with pytest.raises(ConfigError, match="zero_optimization.reduce_scatter=True with parallel.sequence > 1"):
        deepspeed_config(engine, 1.0, plan_batches(cfg.train, 512, 2, 2))
    check_zero3_buckets(ds, 5 * 10**8)
    with pytest.raises(ConfigError, match="reduce_bucket_size to at least 617803776"):
        check_zero3_buckets(ds, 617_803_776)  # GPT-3 175B's embedding
    check_zero3_buckets(unchanged, 617_803_776)


def test_a_job_whose_processes_s_does_not_divide_is_refused_before_it_starts(train_data):
    cfg = load_config(TINY, [*FAST, f"data.dir={train_data}", "run.dir=unused", "parallel.sequence=2"])
    with pytest.raises(UserError) as refused:
        preflight(cfg, 3)
    assert "parallel.sequence=2 but the job has 3 process(es)" in str(refused.value)
    preflight(cfg, 2)
    compiled = load_config(
        TINY,
        [*FAST, f"data.dir={train_data}", "run.dir=unused", "parallel.sequence=2", "engine.compile=true"],
    )
    with pytest.raises(UserError, match="engine.compile=true with parallel.sequence=2"):
        preflight(compiled, 2)


def test_pretrain_eval_as_run_reads_each_data_parallel_ranks_share(tmp_path):
    """A run at S = 2 on 4 processes evaluated 2 data-parallel ranks' shares (`pretrain eval
    --as-run` recomputes them one after another)."""
    import json

    from pretrain.evaluation.held_out import RunEvaluation

    (tmp_path / "train_state.json").write_text(
        json.dumps({"step": 20, "world_size": 4, "data": {"fingerprint": "aaa"}})
    )
    config = {
        "data": {"seq_len": 512, "document_masking": False},
        "train": {"micro_batch_size": 2},
        "eval": {"batches": 2},
        "parallel": {"sequence": 2},
    }
    assert RunEvaluation.of(tmp_path, config).world_size == 2
    assert RunEvaluation.of(tmp_path, {k: v for k, v in config.items() if k != "parallel"}).world_size == 4
