"""Muon's parts that need no process group (pretrain/optim/muon.py, engine.make_optimizer and
set_lr): the reference against torch.optim.Muon and against DeepSpeed's own kernel, the split of
the parameters, the learning-rate ratios, the checks before a run. The real 2-process ZeRO-1/2
jobs against the reference are tests/integration/test_muon.py."""

import math

import pytest
import torch

from pretrain.config import OptimConfig
from pretrain.errors import ConfigError
from pretrain.model.transformer import Transformer
from pretrain.optim.muon import (
    LR_SCALE,
    deepspeed_muon_differences,
    eager_muon_kernels,
    muon_direction,
    muon_groups,
    newton_schulz,
    shape_factor,
)
from pretrain.parallel.engine import make_optimizer, param_groups, set_lr
from tests.conftest import small_model_config
from tests.muon_reference import ReferenceMuon, reference_optimizers

ZERO2 = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.0}


def muon(**overrides) -> OptimConfig:
    return OptimConfig(name="muon", lr=1e-3, **overrides)


@pytest.mark.parametrize("shape", [(12, 40), (40, 12), (24, 24)])
def test_the_gram_form_is_the_standard_iteration(shape):
    g = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gram, standard = newton_schulz(g, "gram", torch.float64), newton_schulz(g, "standard", torch.float64)
    assert float((gram - standard).abs().max()) < 1e-12


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
def test_the_reference_is_torch_optim_muon(rule):
    """torch.optim.Muon (2.9+) runs the standard iteration in bf16, fusing each step's products
    and sums (addmm): with `standard` in bf16 the reference takes the same steps to bf16's
    rounding (measured 2.0% of the distance moved in 3 steps, where Nesterov off is 8.5% away),
    and the shape rule as a group's lr and weight decay (muon_groups) is its adjust_lr_fn. The
    gradients have full rank (batch 64 > 48): NS sends a direction a gradient lacks to a singular
    value near 1 from rounding noise alone."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(48, 16, bias=False), torch.nn.Linear(48, 16, bias=False)
    theirs.load_state_dict(ours.state_dict())
    start = ours.weight.detach().clone()
    factor = shape_factor(rule, tuple(ours.weight.shape))
    group = {"params": [ours.weight], "use_muon": True, "momentum": 0.95, "ns_method": "standard"}
    reference = ReferenceMuon([group | {"lr": 0.02 * factor, "weight_decay": 0.1 / factor}], torch.bfloat16)
    torch_muon = torch.optim.Muon(
        theirs.parameters(), lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn=rule
    )
    for step in range(3):
        x = torch.randn(64, 48, generator=torch.Generator().manual_seed(step))
        for layer, optimizer in ((ours, reference), (theirs, torch_muon)):
            layer(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    ours, theirs = ours.weight.detach(), theirs.weight.detach()
    assert float((ours - theirs).norm() / (theirs - start).norm()) < 0.04


def test_deepspeeds_muon_update_is_the_references_bit_for_bit():
    """DeepSpeed 0.19.8's `muon_update` (eager) and `muon_direction`: the same operations in the
    same dtypes, so the same bits; `deepspeed_muon_differences` (the check before every Muon run)
    finds nothing."""
    assert deepspeed_muon_differences() == ()  # (imports DeepSpeed's Muon module as the engine does)
    from deepspeed.runtime.zero.muon import original_muon

    generator = torch.Generator().manual_seed(1)
    for shape in ((64, 32), (32, 96), (32, 32)):
        for method in ("gram", "standard"):
            grad, momentum = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
            with eager_muon_kernels():
                theirs = original_muon.muon_update(grad.clone(), momentum.clone(), 0.95, ns_method=method)
            assert torch.equal(theirs, muon_direction(grad.clone(), momentum.clone(), 0.95, method))


def test_block_matrices_take_muon_and_everything_else_adamw():
    from pretrain.model.classifier import SequenceClassifier

    for model in (Transformer(small_model_config()), Transformer(small_model_config(tie_embeddings=True))):
        groups = muon_groups(model, muon(), param_groups(model, 0.1))
        chosen = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
        for name, param in model.named_parameters():
            expected = name.startswith("layers.") and param.ndim == 2
            assert (id(param) in chosen) is expected and param.use_muon is expected, name
        assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    classifier = SequenceClassifier(Transformer(small_model_config()), num_labels=3)
    groups = muon_groups(classifier, muon(), param_groups(classifier, 0.1))
    assert not classifier.score.weight.use_muon  # a classifier's head is an output head: AdamW


def test_the_shape_rule_is_each_groups_lr_and_weight_decay():
    model = Transformer(small_model_config())
    optim = muon(muon_lr=0.02, weight_decay=0.1, muon_scale="match_rms_adamw")
    groups = muon_groups(model, optim, param_groups(model, 0.1))
    for group in (g for g in groups if g["use_muon"]):
        for param in group["params"]:
            rows, cols = param.shape
            update = group["lr"] * math.sqrt(max(1, rows / cols))  # DeepSpeed's own scale, then the lr
            assert update == pytest.approx(0.02 * 0.2 * math.sqrt(max(rows, cols)))
            assert group["lr"] * group["weight_decay"] == pytest.approx(0.02 * 0.1)  # W decays by lr·wd
    original = muon_groups(model, muon(muon_lr=0.02), param_groups(model, 0.1))
    assert [g["lr"] for g in original if g["use_muon"]] == [0.02]
    assert [g[LR_SCALE] for g in original] == [20.0, 1.0, 1.0]  # each group's rate over optim.lr


def test_set_lr_scales_both_halves():
    """The schedule's lr (with every hook's factor: the escalation's lower_lr among them) lands on
    AdamW's groups as it is and on Muon's times muon_lr / lr."""
    model = Transformer(small_model_config())
    optimizer = make_optimizer(model, muon(muon_lr=0.02), ZERO2, on_gpu=False)
    assert optimizer.param_groups[0][LR_SCALE] == 20.0
    set_lr(optimizer, 0.5e-3)
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(0.01 if group["use_muon"] else 0.5e-3)
    adamw = make_optimizer(model, OptimConfig(lr=1e-3), ZERO2, on_gpu=False)
    set_lr(adamw, 0.5e-3)
    assert {g["lr"] for g in adamw.param_groups} == {0.5e-3}


def test_deepspeeds_optimizer_on_whole_matrices_is_the_reference():
    """DeepSpeed's MuonWithAuxAdam without ZeRO (whole matrices: its stage-0 path, which once ran
    SGD, #8441) takes the reference's steps, AdamW's half included."""
    torch.manual_seed(0)
    ours, theirs = Transformer(small_model_config()), Transformer(small_model_config())
    theirs.load_state_dict(ours.state_dict())
    optim = muon(muon_lr=0.01)
    deepspeed = make_optimizer(ours, optim, ZERO2, on_gpu=False)
    reference = reference_optimizers(muon_groups(theirs, optim, param_groups(theirs, optim.weight_decay)))
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model in (ours, theirs):
            model(tokens=tokens, targets=tokens).loss.backward()
        with eager_muon_kernels():
            deepspeed.step()
        for optimizer in reference:
            optimizer.step()
        for optimizer in (deepspeed, *reference):
            optimizer.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("ds", "fragment"),
    [
        ({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.0}, "momentum before the gradient-norm"),
        ({"gradient_clipping": 0.0}, "ZeRO stage 0"),
        (
            {
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                "gradient_clipping": 0.0,
            },
            "offloaded",
        ),
    ],
)
def test_muon_where_it_is_not_proven_is_refused(ds, fragment):
    from pretrain.parallel.engine import check_optimizer

    with pytest.raises(ConfigError, match="optim.name=muon") as info:
        check_optimizer(muon(), ds)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    check_optimizer(OptimConfig(), ds)  # AdamW: anything DeepSpeed takes
    check_optimizer(muon(), {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0})
    check_optimizer(muon(), {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0})  # the AdamW half
    check_optimizer(muon(), {**ZERO2, "checkpoint": {"load_universal": True}})  # another world size


def test_a_shipped_zero3_json_with_muon_is_refused_where_the_json_is_completed():
    """deepspeed_config checks the optimizer when given it (before any process group)."""
    from pretrain.config import REPO_CONFIG_DIR, load_config
    from pretrain.parallel.engine import deepspeed_config, plan_batches

    cfg = load_config(
        REPO_CONFIG_DIR / "train" / "tiny.yaml", ["engine.deepspeed_config=configs/deepspeed/zero3.json"]
    )
    plan = plan_batches(cfg.train, cfg.data.seq_len, 2)
    with pytest.raises(
        ConfigError, match="ZeRO stage 3: DeepSpeed's Muon is proven here under ZeRO-1 and ZeRO-2"
    ):
        deepspeed_config(cfg.engine, 0.0, plan, muon())
    assert deepspeed_config(cfg.engine, 0.0, plan)["zero_optimization"]["stage"] == 3  # (not asked)


def test_another_deepspeed_muon_is_refused(monkeypatch):
    from pretrain.optim import muon as optimizers
    from pretrain.parallel.engine import check_optimizer

    monkeypatch.setattr(
        optimizers,
        "deepspeed_muon_differences",
        lambda: ("muon_update's nesterov default is no longer True",),
    )
    with pytest.raises(ConfigError, match="not the one proven here.*nesterov default"):
        check_optimizer(muon(), ZERO2)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ({"name": "sgd"}, "optim.name='sgd' is not one of adamw, muon"),
        ({"muon_lr": 0.0}, "optim.muon_lr=0.0 must be > 0"),
        ({"muon_momentum": 1.0}, "optim.muon_momentum=1.0 must be in [0, 1)"),
        ({"muon_ns_method": "svd"}, "optim.muon_ns_method='svd' is not one of gram, standard"),
        ({"muon_scale": "none"}, "optim.muon_scale='none' is not one of original, match_rms_adamw"),
    ],
)
def test_bad_optimizer_settings_are_one_line(cli, tmp_path, override, fragment):
    from tests.helpers import TINY, assert_one_line_error

    with pytest.raises(ConfigError) as info:
        OptimConfig(**override)
    assert fragment in str(info.value)
    ((key, value),) = override.items()
    assert_one_line_error(cli("config", "show", TINY, f"optim.{key}={value}"), fragment)


def test_newton_schulz_flops_count_the_iterations():
    """flops.newton_schulz_flops (per optimizer step; MFU leaves it out) is what a FLOP counter
    sees the reference's iterations do on every block matrix."""
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.planning.flops import newton_schulz_flops

    for cfg in (small_model_config(), small_model_config(activation="gelu", n_kv_heads=4)):
        matrices = [
            p.detach()
            for n, p in Transformer(cfg).named_parameters()
            if n.startswith("layers.") and p.ndim == 2
        ]
        for method in ("gram", "standard"):
            with FlopCounterMode(display=False) as counter:
                for matrix in matrices:
                    newton_schulz(matrix, method, torch.float32)
            assert counter.get_total_flops() == newton_schulz_flops(cfg, method), (cfg, method)


def test_the_loop_with_muon_rolls_back_and_lowers_the_rate_of_both_halves(tmp_path, train_data, monkeypatch):
    """The loop in this process (a FakeEngine around DeepSpeed's MuonWithAuxAdam on whole matrices)
    with the real service on a thread: spikes at steps 6 and 8, two rollbacks, the second one's
    lower_lr (x0.5 for steps 7-10) on AdamW's groups and on Muon's (times muon_lr / lr)."""
    import threading

    from monitoring.service import serve
    from pretrain.config import MonitorConfig, load_config
    from pretrain.train import loop
    from tests.helpers import FAST, TINY, metrics_by_step
    from tests.unit.fakes import pretraining_trainer

    settings = {"on_repeat": ["lower_lr"], "repeat_window": 10, "repeat_lr_steps": 4}
    server, _ = serve(tmp_path, MonitorConfig(warmup=4, window=16, **settings))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen = {}

    def recorded(optimizer, lr):
        set_lr(optimizer, lr)
        seen[lr] = [(g["use_muon"], g["lr"]) for g in optimizer.param_groups]

    monkeypatch.setattr(loop, "set_lr", recorded)
    overrides = [
        *FAST,
        f"run.dir={tmp_path}",
        f"data.dir={train_data}",
        "monitor.enabled=true",
        "eval.every=0",
    ]
    overrides += ["train.steps=12", "checkpoint.every=2", "checkpoint.keep=20", "faults.spike_steps=[6,8]"]
    overrides += ["optim.name=muon", "optim.muon_lr=0.01", "train.grad_clip=0"]
    try:
        trainer = pretraining_trainer(load_config(TINY, overrides))
        with eager_muon_kernels():  # (however an earlier test imported them)
            summary = trainer.train()
    finally:
        server.shutdown()
        server.server_close()
    assert summary["completed"] and summary["rollbacks"] == 2
    steps = metrics_by_step(tmp_path)
    for step in range(1, 13):
        lr = trainer.lr_at(step) * (0.5 if 7 <= step <= 10 else 1.0)
        assert steps[step]["train/lr"] == pytest.approx(lr, rel=1e-12), step
        groups = seen[steps[step]["train/lr"]]
        assert groups[0] == (True, pytest.approx(lr * 0.01 / 3e-3)) and all(
            g == (False, lr) for g in groups[1:]
        )


def test_muon_where_it_is_not_proven_is_refused_before_the_run_directory_is_touched(
    tmp_path, train_data, cli
):
    """A Muon setting that cannot train (ZeRO-3 here) is one line and exit status 2 from the run's
    checks, before any process group or run directory exists; optim.name=muon alone, with the
    config's train.grad_clip, passes them (it clips the AdamW half: pretrain/optim/muon.py)."""
    from pretrain.config import load_config
    from pretrain.pretraining import preflight
    from tests.helpers import FAST, TINY, assert_one_line_error

    run_dir = tmp_path / "run"
    common = ["--config", TINY, f"run.dir={run_dir}", f"data.dir={train_data}", *FAST]
    for command in ("train", "launch"):
        result = cli(
            command, *common, "optim.name=muon", "engine.deepspeed_config=configs/deepspeed/zero3.json"
        )
        assert_one_line_error(result, "ZeRO stage 3")
    assert not run_dir.exists()
    cfg = load_config(TINY, [f"run.dir={run_dir}", f"data.dir={train_data}", *FAST, "optim.name=muon"])
    assert cfg.train.grad_clip == 1.0
    preflight(cfg, 1)
