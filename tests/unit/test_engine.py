import json
import math

import pytest

from pretrain.config import REPO_CONFIG_DIR, ScheduleConfig, TrainConfig, load_config
from pretrain.errors import ConfigError
from pretrain.model.transformer import Transformer
from pretrain.optim.schedules import lr_at
from pretrain.parallel.engine import deepspeed_config, param_groups, plan_batches
from tests.conftest import small_model_config

TINY = REPO_CONFIG_DIR / "train" / "tiny.yaml"


def test_batch_plan_and_mismatch():
    plan = plan_batches(TrainConfig(micro_batch_size=4, grad_accum=3), seq_len=512, world_size=2)
    assert plan.global_batch_size == 24 and plan.tokens_per_step == 24 * 512
    with pytest.raises(
        ConfigError, match=r"train.global_batch_size=32 but .*4 × .*3 × 2 processes = 24"
    ) as info:
        plan_batches(TrainConfig(micro_batch_size=4, grad_accum=3, global_batch_size=32), 512, 2)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"set train.grad_accum=4"):
        plan_batches(TrainConfig(micro_batch_size=4, grad_accum=3, global_batch_size=32), 512, 2)


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_shipped_deepspeed_configs_are_completed(name):
    cfg = load_config(TINY, [f"engine.deepspeed_config=configs/deepspeed/{name}.json", "train.grad_clip=0.5"])
    plan = plan_batches(cfg.train, cfg.data.seq_len, world_size=4)
    ds = deepspeed_config(cfg.engine, cfg.train.grad_clip, plan)
    assert ds["train_micro_batch_size_per_gpu"] == cfg.train.micro_batch_size
    assert ds["train_batch_size"] == cfg.train.micro_batch_size * cfg.train.grad_accum * 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is True
    assert ds["zero_optimization"]["stage"] == (1 if name == "zero1" else 2 if name == "zero2" else 3)


def test_deepspeed_json_that_disagrees_is_refused(tmp_path):
    def with_json(content) -> ConfigError:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(content) if not isinstance(content, str) else content)
        cfg = load_config(TINY, [f"engine.deepspeed_config={path}"])
        with pytest.raises(ConfigError) as info:
            deepspeed_config(cfg.engine, cfg.train.grad_clip, plan_batches(cfg.train, 512, 2))
        return info.value

    assert "train_batch_size=64 disagrees" in str(
        with_json({"train_batch_size": 64, "zero_optimization": {"stage": 2}})
    )
    assert "remove 'optimizer'" in str(with_json({"optimizer": {"type": "Adam"}}))
    assert "fp16 is enabled" in str(with_json({"fp16": {"enabled": True}}))
    assert "not valid JSON" in str(with_json("{oops"))
    cfg = load_config(TINY, ["engine.deepspeed_config=configs/deepspeed/nope.json"])
    with pytest.raises(ConfigError, match="no such file"):
        deepspeed_config(cfg.engine, cfg.train.grad_clip, plan_batches(cfg.train, 512, 1))


def test_weight_decay_spares_norms_and_embeddings():
    for tied in (False, True):
        model = Transformer(small_model_config(tie_embeddings=tied, positions="learned"))
        decay, no_decay = param_groups(model, 0.1)
        decayed = {id(p) for p in decay["params"]}
        names = {name for name, p in model.named_parameters() if id(p) in decayed}
        assert not any("norm" in n or "embeddings" in n for n in names), names
        assert any("qkv_proj" in n for n in names) and ("lm_head.weight" in names) == (not tied)
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_schedules():
    cosine = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(5, 1.0, 100, cosine, 64) == pytest.approx(0.5)
    assert lr_at(10, 1.0, 100, cosine, 64) == pytest.approx(1.0)
    assert lr_at(55, 1.0, 100, cosine, 64) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(100, 1.0, 100, cosine, 64) == pytest.approx(0.1)
    wsd = ScheduleConfig(name="wsd", warmup_steps=10, min_lr_ratio=0.0, decay_fraction=0.2)
    assert lr_at(50, 2.0, 100, wsd, 64) == 2.0 and lr_at(80, 2.0, 100, wsd, 64) == 2.0
    assert lr_at(90, 2.0, 100, wsd, 64) == pytest.approx(1.0) and lr_at(
        100, 2.0, 100, wsd, 64
    ) == pytest.approx(0.0)
    inv = ScheduleConfig(name="inverse_sqrt", warmup_steps=4000)
    d = 512  # Vaswani et al.: lr = d^-0.5 · min(step^-0.5, step · warmup^-1.5)
    for step in (1, 100, 4000, 10000):
        assert lr_at(step, 1.0, 10**6, inv, d) == pytest.approx(d**-0.5 * min(step**-0.5, step * 4000**-1.5))
    peak = lr_at(4000, 1.0, 10**6, inv, d)  # the peak is at the end of the warm-up
    assert lr_at(3999, 1.0, 10**6, inv, d) < peak and lr_at(4001, 1.0, 10**6, inv, d) < peak
    constant = ScheduleConfig(name="constant", warmup_steps=0)
    assert lr_at(1, 0.3, 10, constant, 64) == 0.3 and not math.isnan(lr_at(0, 0.3, 10, cosine, 64))


def _loss_and_grads(model, tokens):
    model.zero_grad()
    loss = model(tokens[:, :-1], tokens[:, 1:]).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_keeps_names_and_numbers():
    import torch

    from pretrain.parallel.engine import apply_activation_checkpointing

    torch.manual_seed(0)
    model = Transformer(small_model_config())
    names = [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, 97, (2, 17))
    loss, grads = _loss_and_grads(model, tokens)
    apply_activation_checkpointing(model)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints stay loadable
    loss2, grads2 = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss2, loss)
    for name in names:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-5, atol=1e-6)


def test_deepspeeds_muon_kernels_compile_at_their_first_call_not_at_import(monkeypatch):
    """`deepspeed.initialize` imports DeepSpeed's Muon module on every rank; its kernels'
    `torch.compile` wrappers are built when one is first called (a Muon run on a GPU compiles them
    as before; on a CPU they run eagerly: `compile_muon_kernels`), not at that import (0.8 s of
    CPU per rank start-up), and DeepSpeed's decorator is its own again afterwards."""
    import sys

    import deepspeed.runtime.zero.muon as package
    import torch
    from deepspeed.runtime import compiler

    from pretrain.optim import muon as optimizers
    from pretrain.optim.muon import MUON_MODULE, import_deepspeed_muon_compiling_lazily

    monkeypatch.setattr(optimizers, "_compile_kernels", True)  # (as on a GPU)

    for name in [MUON_MODULE, "deepspeed.runtime.zero.muon.muon_optimizer"]:
        monkeypatch.delitem(sys.modules, name, raising=False)  # imported afresh, restored after
    for name in ("original_muon", "muon_optimizer"):
        monkeypatch.setattr(package, name, getattr(package, name, None), raising=False)
    built = []
    monkeypatch.setattr(torch, "compile", lambda fn: built.append(fn.__name__) or fn)
    decorator = compiler.compile

    import_deepspeed_muon_compiling_lazily()
    muon = sys.modules[MUON_MODULE]
    assert built == [] and compiler.compile is decorator
    grad = torch.randn(8, 4)
    with monkeypatch.context() as inside:  # called while an outer graph is traced: no wrapper of its own
        inside.setattr(torch.compiler, "is_compiling", lambda: True)
        muon.muon_update(grad.clone(), torch.zeros(8, 4))
    assert built == []
    eager = muon.muon_update.__wrapped__(grad.clone(), torch.zeros(8, 4))
    assert torch.equal(muon.muon_update(grad.clone(), torch.zeros(8, 4)), eager)
    muon.muon_update(grad.clone(), torch.zeros(8, 4))
    # each kernel once, at its first call (muon_update calls a Newton-Schulz kernel)
    assert "muon_update" in built and len(built) == len(set(built)) == 2, built
