"""The GPU check's variants of the step (pretrain/bench/variants.py): which run in which order, what
a CPU skips and why, each variant's row of variants.json, and the choice (the fastest whose first
loss agrees with the baseline's). The processes themselves: tests/integration/test_gpu_check.py."""

from pretrain.bench.variants import ALL, BASELINE, FIELDS, LEVERS, RELATIVE, choose, entry, planned
from pretrain.config import load_config
from tests.helpers import TINY


def test_the_order_puts_baseline_all_and_the_larger_batch_of_every_model_before_the_levers():
    names = [v.label for v in planned({"a": (16, 64), "b": (4, 8)}, cpu=False)]
    assert names[:6] == ["a/baseline", "a/all", "a/all_mb64", "b/baseline", "b/all", "b/all_mb8"]
    assert names[6:] == [f"{m}/{lever}" for m in "ab" for lever in LEVERS]
    assert all(v.skipped is None for v in planned({"a": (16, 64)}, cpu=False))
    larger = next(v for v in planned({"a": (16, 64)}, cpu=False) if v.name == "all_mb64")
    assert larger.micro_batch_size == 64 and larger.overrides == ALL


def test_each_lever_alone_is_the_baseline_with_one_change_and_all_are_run_config_keys(tmp_path):
    for variant in planned({"tiny": (2, 4)}, cpu=False):
        load_config(TINY, [f"run.dir={tmp_path}", *variant.overrides])  # (every key exists and is valid)
        if variant.name in LEVERS:
            assert (
                variant.overrides[: len(BASELINE)] == BASELINE and len(variant.overrides) == len(BASELINE) + 1
            )
    baseline = load_config(TINY, list(BASELINE))
    assert (baseline.engine.one_host_read, baseline.loss.kernel, baseline.engine.attention) == (
        False,
        "chunked",
        "flash",
    )


def test_a_cpu_skips_what_it_cannot_show_and_says_why():
    skipped = {v.name: v.skipped for v in planned({"tiny": (2, 4)}, cpu=True) if v.skipped}
    assert set(skipped) == set(LEVERS)  # (`all` is one_read alone there)
    assert "CUDA" in skipped["loss_liger"] and "CUDA" in skipped["cudnn_attention"]


def bench(tokens, loss, syncs=1):
    return {
        "ours_tokens_per_sec": tokens,
        "ours_mfu": None,
        "ours_first_loss": loss,
        "host_syncs_per_step": {"ours": syncs},
        "ours_step_peak_memory_bytes": None,
    }


def test_the_rows_keep_the_issues_fields_and_the_fastest_agreeing_variant_is_chosen():
    a, b = planned({"a": (16, 64), "b": (4, 8)}, cpu=False)[:2], planned({"b": (4, 8)}, cpu=False)[:3]
    rows = [
        entry(a[0], bench(100.0, 10.0, syncs=5)),
        entry(a[1], bench(150.0, 10.0 * (1 + 2 * RELATIVE))),  # faster, but its loss disagrees
        entry(b[0], None, "failed: exit status 1"),  # no baseline for b
        entry(b[1], bench(90.0, 9.0)),
        entry(b[2], None),
    ]
    assert all(tuple(r) == FIELDS for r in rows)
    assert rows[0]["host_syncs_per_step"] == 5 and rows[2]["skipped"] == "failed: exit status 1"
    assert choose(rows) == {"a": "a/baseline", "b": None}
    rows.append(entry(planned({"a": (16, 64)}, cpu=False)[2], bench(120.0, 10.0 * (1 + RELATIVE / 2))))
    assert choose(rows)["a"] == "a/all_mb64"
