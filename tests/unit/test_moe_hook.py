"""The experts' step hook (pretrain/train/moe_hook.py): the loads it reports against the counts,
the balancing bias's step (its sign, its size, never on a skipped update), and the same in the
loop with a stand-in engine (metrics.jsonl, TensorBoard's histograms, the checkpointed bias, the
monitor's warning of a collapsed expert over HTTP, one host read per step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pretrain.config import ModelConfig, MoEConfig, load_config
from pretrain.model.transformer import Transformer
from pretrain.train.moe_hook import ExpertBalance
from tests.helpers import FAST, TINY
from tests.helpers import metrics_by_step as records
from tests.unit.fakes import pretraining_trainer
from tests.unit.test_host_reads import host_reads, step_starts  # noqa: F401 (a fixture)


class Writer:
    def __init__(self):
        self.histograms = {}

    def histogram(self, tag, values, step):
        self.histograms[tag] = values


def hook_on(balance: str = "bias", rate: float = 0.01):
    cfg = ModelConfig(
        vocab_size=97,
        d_model=32,
        n_layers=3,
        n_heads=4,
        max_seq_len=64,
        moe=MoEConfig(experts=4, top_k=2, expert_ffn_dim=16, balance=balance, bias_rate=rate, dense_layers=1),
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    engine = SimpleNamespace(module=model, device=torch.device("cpu"), skipped_steps=0)
    return ExpertBalance(engine, Writer(), lambda step: True, world_size=1, grad_accum=2), model


def one_step(hook, model, tokens, skipped: bool = False) -> dict:
    hook.before_step(1)
    for part in tokens:
        model(part, part).loss.backward()
    vote = hook.vote()
    hook.agreed(1, vote)
    if skipped:
        hook.engine.skipped_steps += 1
    values = hook.readings(1)
    hook.after_step(1, {}, [], vote.tolist())
    return values


def test_the_loads_are_the_counts_over_their_mean_and_the_bias_moves_against_them():
    hook, model = hook_on(rate=0.01)
    tokens = torch.randint(0, 97, (2, 3, 10))  # 2 micro-batches of 3 × 10 tokens
    values = one_step(hook, model, tokens)
    for i in (1, 2):
        mlp = model.layers[i].mlp
        counts = mlp.load
        assert counts.sum() == 2 * 30 * 2  # tokens × top_k, both micro-batches
        load = counts / counts.mean()
        assert values[f"moe/load_max/layer_{i}"] == pytest.approx(load.max().item())
        assert torch.equal(hook.writer.histograms[f"moe/loads/layer_{i}"], load)
        expected = 0.01 * torch.sign(counts.mean() - counts)  # overloaded down, underloaded up
        assert torch.equal(mlp.router.bias, expected)
    loads = torch.stack([model.layers[i].mlp.load for i in (1, 2)])
    assert values["moe/load_max"] == pytest.approx((loads / loads.mean(1, keepdim=True)).max().item())
    assert values["moe/top_share"] == pytest.approx((loads.max(1).values / 60).max().item())


def test_a_skipped_update_leaves_the_bias_and_without_the_bias_nothing_moves():
    hook, model = hook_on()
    one_step(hook, model, torch.randint(0, 97, (2, 3, 10)), skipped=True)
    assert all(model.layers[i].mlp.router.bias.eq(0).all() for i in (1, 2))
    hook, model = hook_on(balance="aux_loss")
    values = one_step(hook, model, torch.randint(0, 97, (2, 3, 10)))
    assert model.layers[1].mlp.router.bias is None and values["moe/aux_loss"] > 0


def test_the_loop_reports_the_experts_checkpoints_the_bias_and_the_monitor_warns_of_a_collapse(
    tmp_path,
    train_data,
    host_reads,  # noqa: F811 (the fixture imported above)
    capsys,
):
    """Three steps of a model with experts, with the stand-in engine, reporting to the real service
    over HTTP (its server on a thread): every step's moe/ metrics, the histograms in TensorBoard's
    own reader, and the bias the step left in the checkpoint. Expert 0 of layer 1 is never chosen
    (its bias far below the others'), so after monitor.expert_collapse_steps (2) reports the
    service warns, once, and the trainer says so on the console; still one host read per step."""
    import threading

    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from monitoring.protocol import read_events
    from monitoring.service import serve
    from pretrain.reporting.metrics import tensorboard_dir

    moe = [
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "model.moe.expert_ffn_dim=64",
        "model.moe.dense_layers=1",
    ]
    monitor = ["monitor.enabled=true", "monitor.expert_collapse_steps=2", "monitor.expert_collapse_share=0.9"]
    cfg = load_config(
        TINY,
        [
            *FAST,
            *moe,
            *monitor,
            f"run.dir={tmp_path}",
            f"data.dir={train_data}",
            "train.steps=3",
            "eval.every=0",
        ],
    )
    server, _ = serve(tmp_path, cfg.monitor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    trainer = pretraining_trainer(cfg)
    with torch.no_grad():
        trainer.engine.module.layers[1].mlp.router.bias[0] = -100.0  # (it moves by ±bias_rate: 1e-3)
    began = step_starts(trainer, host_reads)
    try:
        trainer.train()
    finally:
        server.shutdown()
        server.server_close()
    assert [began[step + 1] - began[step] for step in (1, 2)] == [1, 1], host_reads
    rows = records(tmp_path)
    assert all({"moe/load_max", "moe/aux_loss", "moe/load_max/layer_1"} <= set(rows[s]) for s in (1, 2, 3))
    assert all(rows[s]["moe/load_max"] >= 1.0 and rows[s]["moe/load_min"] == 0.0 for s in (1, 2, 3))
    events = EventAccumulator(str(tensorboard_dir(tmp_path)), size_guidance={"histograms": 0})
    events.Reload()
    assert [e.step for e in events.Histograms("moe/loads/layer_1")] == [1, 2, 3]
    saved = load_file(tmp_path / "checkpoints" / "step_00000003" / "model.safetensors")
    bias = trainer.engine.module.layers[1].mlp.router.bias
    assert bias.abs().sum() > 0 and torch.equal(saved["layers.1.mlp.router.bias"], bias)
    (warning,) = [e for e in read_events(tmp_path) if e.type == "warning"]
    assert warning.step == 2 and warning.findings == ["expert_collapse"]
    assert warning.reason.startswith(
        "experts of layer 1 collapsed: expert 0 starved (least load 0x the mean)"
    )
    assert not [e for e in read_events(tmp_path) if e.type == "rollback"]
    assert f"monitor: warning at step 2: {warning.reason}" in capsys.readouterr().out
