"""Experts across ranks (`parallel.expert`, pretrain/parallel/experts.py) against one rank, and a
real training job of a model with experts.

In fp32, one 2-process job (gloo, CPU) of this file's `worker()`: DeepSpeed engines built by
`pretrain.parallel.engine.initialize` around a model with experts, each rank on its own tokens,
against the same model in one process on both ranks' tokens (the reference, plain torch): the
routed block's outputs, the mean loss and the balancing loss from every rank's counts, every
parameter's gradient as ZeRO reduced it (the router's and the experts', each rank's own), the
gradient norm, the tokens per expert (tokens × top_k), routing forced onto one expert (the
others' gradients zero, not None), and which optimizer states each rank holds. Cases: experts
split over the 2 ranks under ZeRO-2 (softmax router, the data-parallel balancing loss, router
z-loss, a shared expert) and ZeRO-1 (sigmoid, the bias, DeepSeek-V3's sequence-wise loss), and
every expert on both ranks (parallel.expert 1). Then a checkpoint at E = 2: the loop's rollback
load gives the saved weights, bias and optimizer states back, and the step trained again is the
first bit for bit; resumed at E = 1 and E = 2 through DeepSpeed's universal format, the weights
and bias are the saved ones and the next step is E = 2's.

In bf16, one real `pretrain train` job of the packaged tiny-moe (shrunk as tests/helpers.py's FAST):
2 processes at parallel.expert=2, 3 steps, a checkpoint at step 2: the experts' metrics, the
bias moved, the checkpoint recording its split, read whole outside training, fine-tuned in one
process; a gradient bit flipped on rank 1 at step 3, which the replay finds.

Run by pytest, this file launches itself: `python -m torch.distributed.run --nproc_per_node 2
-m tests.integration.test_experts OUT_DIR` runs `worker()` on each rank, which writes
OUT_DIR/rank_N.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

E = 2
B, T = 2, 16  # each rank's micro-batch
# fp32: the largest difference over the largest element, per tensor (measured: see each test)
TOLERANCE = 1e-5


# ------------------------------------------------------------------------------ the 2-process worker


def model_config(**moe):
    from pretrain.config import MoEConfig
    from tests.conftest import small_model_config

    settings = {"experts": 4, "top_k": 2, "expert_ffn_dim": 16, "dense_layers": 1} | moe
    return small_model_config(moe=MoEConfig(**settings))


def tokens_of(rank: int):
    import torch

    generator = torch.Generator().manual_seed(10 + rank)
    window = torch.randint(0, 97, (B, T + 1), generator=generator)
    return window[:, :-1], window[:, 1:]


def deepspeed_json(stage: int) -> dict:
    """fp32 ZeRO; clipping far above the norm, so that DeepSpeed computes it and changes nothing."""
    zero = {"stage": stage, "reduce_scatter": True, "contiguous_gradients": True, "overlap_comm": False}
    return {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 1,
        "train_batch_size": B * E,
        "gradient_clipping": 1e9,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def engine_of(model, stage: int, size: int, ds: dict | None = None):
    from pretrain.config import EngineConfig, OptimConfig
    from pretrain.parallel.engine import initialize

    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    return initialize(model, EngineConfig(), optim, ds or deepspeed_json(stage), size)


def relative(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def reference_case(name: str, stage: int, size: int, bias=None, **moe) -> dict:
    """One step of the split model on this rank's tokens against the reference on every rank's."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from pretrain.model.transformer import Transformer

    cfg = model_config(**moe)
    torch.manual_seed(3)
    reference = Transformer(cfg)
    split = Transformer(cfg)
    split.load_state_dict(reference.state_dict())
    for model in (reference, split):
        if bias is not None:
            model.layers[1].mlp.router.bias.copy_(torch.tensor(bias))
    outputs = {}

    def keep(key):
        def hook(module, args, out):
            outputs.setdefault(key, out[0].detach())

        return hook

    for key, model in (("reference", reference), ("split", split)):
        model.layers[1].mlp.register_forward_hook(keep(key))
    rank = dist.get_rank()
    everyone = [tokens_of(r) for r in range(dist.get_world_size())]
    loss = reference(torch.cat([t for t, _ in everyone]), torch.cat([y for _, y in everyone])).loss
    loss.backward()
    engine, optimizer = engine_of(split, stage, size)
    mine = engine(*tokens_of(rank)).loss
    engine.backward(mine)
    found = {"case": name, "aux": [aux_of(split), aux_of(reference)]}
    found |= gradients(engine, reference, safe_get_full_grad)
    means = torch.tensor([float(mine), aux_of(split)])
    dist.all_reduce(means)
    found["loss"] = [float(means[0] / E), float(loss)]
    found["aux_mean"] = [float(means[1] / E), aux_of(reference)]
    found["output"] = relative(outputs["split"], outputs["reference"][rank * B : (rank + 1) * B])
    found |= counts_and_states(engine, optimizer, split, cfg)
    engine.step()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in reference.parameters()))
    found["grad_norm"] = [float(engine.get_global_grad_norm()), float(norm)]
    engine.destroy()
    return found


def aux_of(model) -> float:
    """The auxiliary terms the last training forward added to the loss (none: 0)."""
    return 0.0 if model.aux_loss is None else float(model.aux_loss)


def gradients(engine, reference, full_grad) -> dict:
    """Each parameter's gradient as ZeRO holds it, against the reference's (its experts' slice)."""
    want = dict(reference.named_parameters())
    errors, missing, zero_experts = {}, [], []
    for name, param in engine.module.named_parameters():
        grad = full_grad(param)
        if grad is None:
            missing.append(name)
            continue
        expected = want[name].grad
        held = getattr(param, "held_experts", None)
        if held is not None:
            expected = expected[held[0] : held[1]]
            zero_experts += [held[0] + e for e in range(grad.shape[0]) if grad[e].abs().sum() == 0]
        if expected.abs().max() == 0:
            errors[name] = float(grad.abs().max())
        else:
            errors[name] = relative(grad, expected)
    return {"grads": errors, "missing": missing, "zero_experts": sorted(set(zero_experts))}


def counts_and_states(engine, optimizer, model, cfg) -> dict:
    """Tokens per expert (this rank's, and every rank's), and the optimizer states this rank holds:
    the fp32 partitions of DeepSpeed's expert groups against its own experts' parameters."""
    import torch
    import torch.distributed as dist

    load = model.layers[1].mlp.load.clone()
    total = load.clone()
    dist.all_reduce(total)
    expert_groups = [
        part.numel()
        for group, part in zip(
            optimizer.optimizer.param_groups, optimizer.single_partition_of_fp32_groups, strict=True
        )
        if group.get("moe")
    ]
    own = sum(p.numel() for p in engine.module.parameters() if getattr(p, "held_experts", None) is not None)
    whole = 3 * cfg.moe.experts * cfg.moe.expert_ffn_dim * cfg.d_model * (cfg.n_layers - cfg.moe.dense_layers)
    return {
        "load": [float(load.sum()), float(total.sum())],
        "expert_states": [sum(expert_groups), own, whole],
        "loads": torch.stack([load, total]).tolist(),
    }


def worker() -> None:
    from pretrain.parallel.distributed import DistEnv, init_distributed

    out = Path(sys.argv[1])
    env = DistEnv.from_environ()
    init_distributed(env)
    results = {
        "cases": [
            reference_case(
                "ZeRO-2, E=2: softmax, data-parallel balancing loss, router z-loss, a shared expert",
                2,
                E,
                router="softmax",
                balance="aux_loss",
                aux_loss_coef=0.05,
                router_z_loss=0.01,
                shared_experts=1,
            ),
            reference_case(
                "ZeRO-1, E=2: sigmoid, the bias, sequence-wise loss",
                1,
                E,
                bias=[0.02, -0.01, 0.03, 0.0],
                router="sigmoid",
                balance="both",
                aux_loss_coef=0.05,
            ),
            reference_case(
                "ZeRO-2, E=1 (every expert on both ranks)", 2, 1, router="softmax", balance="aux_loss"
            ),
            reference_case(
                "ZeRO-2, E=2: every token routed to expert 0",
                2,
                E,
                bias=[100.0, 0.0, 0.0, 0.0],
                top_k=1,
                router="sigmoid",
                balance="bias",
            ),
        ],
        "checkpoints": checkpoint_case(env, out / "run"),
    }
    (out / f"rank_{env.rank}.json").write_text(json.dumps(results, indent=1))


def train_once(engine, step: int) -> float:
    """An optimizer step on this rank's tokens of `step`."""
    import torch

    generator = torch.Generator().manual_seed(1000 * step + engine.global_rank)
    window = torch.randint(0, 97, (B, T + 1), generator=generator)
    loss = engine(window[:, :-1], window[:, 1:]).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def held(engine) -> dict:
    """What a step writes: the module's weights and bias, the fp32 master partitions."""
    found = {f"module/{n}": t.detach().clone() for n, t in engine.module.state_dict().items()}
    return found | {
        f"fp32/{i}": t.clone() for i, t in enumerate(engine.optimizer.single_partition_of_fp32_groups)
    }


def checkpoint_case(env, run_dir: Path) -> dict:
    """ZeRO-2 at E=2 (sigmoid, the bias moved as the hook moves it): a checkpoint after step 1;
    step 2; the checkpoint loaded back (the loop's rollback load); step 2 again."""
    import torch

    from pretrain.checkpoint.checkpointer import Checkpointer, TrainState
    from pretrain.config import CheckpointConfig
    from pretrain.model.transformer import Transformer

    cfg = model_config(router="sigmoid", balance="both", aux_loss_coef=0.05, shared_experts=1)
    tokenizer = run_dir.parent / "tokenizer.model"  # what a checkpoint copies; nothing reads it here
    tokenizer.write_bytes(b"")
    checkpointer = Checkpointer(
        run_dir,
        env,
        CheckpointConfig(),
        run_config={},
        tokenizer=tokenizer,
        config_hash="",
        expert_parallel=E,
    )
    torch.manual_seed(4)
    engine, _ = engine_of(Transformer(cfg), 2, E)
    train_once(engine, 1)
    with torch.no_grad():  # (a balancing step's worth, as the hook moves it)
        engine.module.layers[1].mlp.router.bias.add_(torch.tensor([1e-3, -1e-3, 1e-3, -1e-3]))
    tag = checkpointer.save(engine, TrainState(step=1), None)
    saved, whole = held(engine), whole_model(engine)
    first = [train_once(engine, 2), held(engine)]
    whole_after = whole_model(engine)
    _, matches = checkpointer.load(engine, tag)
    loaded = held(engine)
    again = [train_once(engine, 2), held(engine)]
    engine.destroy()
    return {
        "matches_checkpoint": matches,
        "loaded_differ": [n for n in saved if not torch.equal(saved[n], loaded[n])],
        "again_differ": [n for n in first[1] if not torch.equal(first[1][n], again[1][n])],
        "moved_by_step_2": [n for n in saved if not torch.equal(saved[n], first[1][n])],
        "losses": [first[0], again[0]],
        "universal": universal_case(env, checkpointer, cfg, tag, whole, (first[0], whole_after)),
    }


def whole_model(engine) -> dict:
    """The module's weights and buffers, each split expert tensor gathered whole from the ranks
    (rank r holds experts [r·n/E, (r+1)·n/E): E = the world size here)."""
    import torch
    import torch.distributed as dist

    found = {}
    for name, tensor in engine.module.state_dict().items():
        param = dict(engine.module.named_parameters()).get(name)
        if param is not None and getattr(param, "held_experts", None) is not None:
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, tensor.detach().contiguous())
            tensor = torch.cat(parts)
        found[name] = tensor.detach().clone()
    return found


def universal_case(env, saver, cfg, tag: str, whole: dict, after: tuple) -> dict:
    """The E = 2 checkpoint resumed through DeepSpeed's universal format (the conversion:
    pretrain/checkpoint/universal.py) at E = 1 and at E = 2 (each rank taking its experts' slice
    of the whole), both ranks: the converted weights, and the loaded weights and bias gathered
    whole, against the saved ones (bit for bit); then step 2 against step 2 at E = 2 (its loss, and
    the weights its update gave: the optimizer states came along)."""
    import torch
    from deepspeed.utils import groups

    from pretrain.checkpoint import universal
    from pretrain.checkpoint.checkpointer import Checkpointer, Resume, read_train_state
    from pretrain.config import CheckpointConfig
    from pretrain.model.transformer import Transformer

    resume = Resume(tag, read_train_state(saver.run_dir, tag), universal=True)
    found = {}
    for size in (1, E):
        # (the E = 2 engine's groups: a run resumed at E = 1 is a new process that never made them,
        # and DeepSpeed's universal load slices experts by the largest expert group there is)
        groups._EXPERT_PARALLEL_GROUP.clear()
        checkpointer = Checkpointer(
            saver.run_dir, env, CheckpointConfig(), run_config={}, tokenizer=saver.tokenizer,
            config_hash="", expert_parallel=size,
        )  # fmt: skip
        torch.manual_seed(5)  # (other initial weights and bias: the load must set every one)
        engine, _ = engine_of(Transformer(cfg), 2, size, resume.deepspeed_config(deepspeed_json(2)))
        checkpointer.restore(engine, resume)
        converted = universal.universal_weights(checkpointer.root / "universal" / tag)
        loaded = whole_model(engine)
        loss = train_once(engine, 2)
        stepped = whole_model(engine)
        engine.destroy()
        found[f"E={size}"] = {
            "converted_differ": [
                n for n in whole if n not in converted or not torch.equal(converted[n], whole[n])
            ],
            "loaded_differ": [n for n in whole if not torch.equal(loaded[n], whole[n])],
            "losses": [loss, after[0]],
            "stepped_error": max(relative(stepped[n], after[1][n]) for n in after[1]),
        }
    return found


# ---------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def fp32_job(tmp_path_factory) -> list[dict]:
    from tests.integration.runs import worker_results

    return worker_results(2, "tests.integration.test_experts", tmp_path_factory.mktemp("experts"))


def cases(job: list[dict]):
    for rank, found in enumerate(job):
        for case in found["cases"]:
            yield rank, case


def test_the_split_model_gives_the_one_rank_references_outputs_losses_and_gradients(fp32_job):
    """Outputs of the routed block (the all-to-all there and back), the mean loss, the balancing
    loss from every rank's counts (their mean is the reference's), every gradient ZeRO reduced —
    the router's and each rank's own experts', never E times the reference's — and the norm."""
    for rank, case in cases(fp32_job):
        assert case["output"] <= TOLERANCE, (rank, case)
        assert case["loss"][0] == pytest.approx(case["loss"][1], abs=TOLERANCE), case
        assert case["aux_mean"][0] == pytest.approx(case["aux_mean"][1], abs=TOLERANCE), case
        assert case["grad_norm"][0] == pytest.approx(case["grad_norm"][1], rel=TOLERANCE), case
        assert not case["missing"], case
        worst = max(case["grads"].items(), key=lambda item: item[1])
        assert worst[1] <= TOLERANCE, (rank, case["case"], worst)


def test_tokens_per_expert_sum_to_tokens_times_top_k_and_forced_routing_leaves_zero_gradients(fp32_job):
    for _, case in cases(fp32_job):
        top_k = 1 if "expert 0" in case["case"] else 2
        assert case["load"] == [B * T * top_k, E * B * T * top_k], case
    forced = [case for _, case in cases(fp32_job) if "expert 0" in case["case"]]
    assert forced[0]["loads"][1] == [E * B * T, 0, 0, 0]
    assert forced[1]["zero_experts"] == [2, 3] and forced[0]["zero_experts"] == [1]  # (not None: checked)


def test_each_rank_holds_the_optimizer_states_of_its_own_experts_only(fp32_job):
    """At E = 2 the experts' fp32 states on each rank are its own experts' (half of them), not
    every expert's; at E = 1 every rank's share is in the dense groups, partitioned over both."""
    for _, case in cases(fp32_job):
        held, own, whole = case["expert_states"]
        if "E=1" in case["case"]:
            assert held == 0 and own == 0
        else:
            assert held == own == whole // E, case


def test_an_e_2_checkpoint_resumes_at_e_1_and_e_2_with_its_weights_bias_and_states(fp32_job):
    for found in (case for rank in fp32_job for case in rank["checkpoints"]["universal"].values()):
        assert found["converted_differ"] == [] and found["loaded_differ"] == []
        loss, expected = found["losses"]
        assert abs(loss - expected) <= TOLERANCE * abs(expected)
        assert found["stepped_error"] <= TOLERANCE  # (measured: see the report)


def test_a_rollback_at_e_2_gives_the_checkpoints_weights_bias_and_states_and_the_same_step(fp32_job):
    for found in (rank["checkpoints"] for rank in fp32_job):
        assert found["matches_checkpoint"] is True
        assert found["loaded_differ"] == [] and found["again_differ"] == []
        assert any(".experts." in n for n in found["moved_by_step_2"])  # (else the comparison proves nothing)
        assert found["losses"][0] == found["losses"][1]


# ------------------------------------------------------------------- a real bf16 job (pretrain train)


@pytest.fixture(scope="module")
def tiny_moe_run(tmp_path_factory, train_data) -> Path:
    import subprocess

    from tests.integration.runs import FAST, torchrun

    run_dir = tmp_path_factory.mktemp("tiny_moe") / "run"
    command = [*torchrun(2), "--config", "tiny-moe", f"run.dir={run_dir}", f"data.dir={train_data}", *FAST]
    command += ["parallel.expert=2", "train.steps=3", "checkpoint.every=2", "eval.every=0"]
    command += ["faults.flip_step=3", "faults.flip_rank=1"]  # (a machine fault for the replay)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return run_dir


def test_tiny_moe_trains_at_e_2_reports_its_experts_loads_and_checkpoints_its_split(tiny_moe_run):
    import math

    import torch

    from tests.integration.runs import metrics, train_state

    steps = metrics(tiny_moe_run)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert math.isfinite(record["train/loss"]) and math.isfinite(record["moe/aux_loss"])
        assert record["moe/load_max"] >= 1.0 >= record["moe/load_min"] >= 0.0
        assert record["moe/load_max/layer_1"] == record["moe/load_max"]  # (the one routed block)
        assert 0.0 < record["moe/top_share"] <= 1.0
    assert train_state(tiny_moe_run, 2)["expert_parallel"] == 2
    model_file = tiny_moe_run / "checkpoints" / "step_00000002" / "mp_rank_00_model_states.pt"
    bias = torch.load(model_file, weights_only=False)["module"]["layers.1.mlp.router.bias"]
    # moved by ±bias_rate (1e-3) after each of the 2 steps: each expert's sum of two signs
    assert bias.dtype == torch.float32 and bias.abs().max() > 0
    assert torch.allclose(bias / 1e-3, (bias / 1e-3).round(), atol=1e-4) and bias.abs().max() <= 2e-3 + 1e-9


def test_the_replay_tells_a_flipped_gradient_bit_at_e_2_from_the_data(tiny_moe_run):
    """monitor.replay (on by default) replays step 3 through the all-to-all on both ranks: rank 1's
    gradient changed (a machine fault), the update skipped."""
    from monitoring.protocol import MachineFault, read_events
    from tests.integration.runs import metrics

    (fault,) = [e for e in read_events(tiny_moe_run) if isinstance(e, MachineFault)]
    assert fault.step == 3 and fault.ranks == [1]
    assert float(fault.first[0][1]) > 1e6 * float(fault.replay[0][1])  # its gradient norm: the flip, then not
    per_step = metrics(tiny_moe_run)
    assert per_step[2]["train/skipped_steps"] == 0 and per_step[3]["train/skipped_steps"] == 1


def test_the_e_2_checkpoint_resumes_in_one_process(tiny_moe_run, tmp_path, train_data):
    """2 processes at E = 2 → 1 process (E = 1, grad_accum 2 keeping the global batch) through the
    universal conversion: step 3's loss, on the same windows, is the 2-process run's."""
    import subprocess

    from tests.integration.runs import FAST, copy_checkpoint, metrics, torchrun

    copy_checkpoint(tiny_moe_run, tmp_path, 2)
    command = [*torchrun(1), "--config", "tiny-moe", f"run.dir={tmp_path}", f"data.dir={train_data}", *FAST]
    command += ["train.steps=3", "train.grad_accum=2", "checkpoint.resume=auto", "eval.every=0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "resumed from step_00000002" in result.stdout
    assert (tmp_path / "checkpoints" / "universal" / "step_00000002" / "complete.json").is_file()
    ours, theirs = metrics(tmp_path)[3]["train/loss"], metrics(tiny_moe_run)[3]["train/loss"]
    assert abs(ours - theirs) <= 1e-3 * theirs, (ours, theirs)


def test_a_checkpoint_with_split_experts_is_read_whole_outside_training(tiny_moe_run):
    """What eval, sample, export and fine-tuning read (pretrain/evaluation/inference.py): every
    expert, in the global order: rank 0's half rounds to the module file's (rank 0's) bf16 experts."""
    import torch

    from pretrain.evaluation.inference import read_checkpoint

    tag = tiny_moe_run / "checkpoints" / "step_00000002"
    _, run_config, weights = read_checkpoint(tag)
    module = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    experts = run_config["model"]["moe"]["experts"]
    assert set(weights) == set(module)
    for name, held in module.items():
        whole = weights[name]
        if ".experts." in name:
            assert whole.shape == (experts, *held.shape[1:]) and held.shape[0] == experts // E
            whole = whole[: experts // E]
        assert torch.equal(whole.to(held.dtype), held), name


def test_fine_tuning_starts_from_the_checkpoint_saved_at_e_2(tiny_moe_run, tmp_path):
    """Classification from the E = 2 checkpoint in one process (every expert on it): the model
    read whole, its experts trained and balanced as in pretraining."""
    from pretrain.cli import main as cli_main
    from tests.finetune_data import CLASSIFICATION, TINY_FT, sentiment_rows, write_csv
    from tests.integration.runs import metrics

    train_csv = write_csv(tmp_path / "train.csv", sentiment_rows(32, 1))
    val_csv = write_csv(tmp_path / "val.csv", sentiment_rows(16, 2))
    run_dir = tmp_path / "run"
    data = [f"finetune.init={tiny_moe_run}", f"data.train={train_csv}", f"data.validation={val_csv}"]
    code = cli_main(
        ["finetune", "--config", CLASSIFICATION, *data, f"run.dir={run_dir}", "train.steps=3", *TINY_FT]
    )
    assert code == 0
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert results["task"] == "classification" and results["examples"] == 16
    steps = metrics(run_dir)
    assert steps and all(record["moe/load_max"] >= 1.0 for record in steps.values())


def test_the_checkpoint_saved_at_e_2_exports_as_glm4_moe_with_its_logits(tiny_moe_run, tmp_path):
    """`pretrain export-hf`'s path (load_trained, export_trained) on tiny-moe (sigmoid, a shared
    expert, a dense block, its trained bias): transformers' Glm4-MoE computes the checkpoint's
    logits (fp32), and our commands read the export back equal."""
    import torch
    import transformers

    from pretrain.evaluation.inference import export_trained, load_trained

    trained = load_trained(tiny_moe_run)  # (one universal conversion: the experts were split)
    assert trained.model.layers[1].mlp.router.bias.abs().max() > 0  # trained: the bias moved
    out = export_trained(trained, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Glm4MoeForCausalLM"
    ids = torch.randint(0, trained.model.cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    bias = trained.model.layers[1].mlp.router.bias
    with torch.no_grad():
        ours = trained.model(ids).logits
        kept, _ = bias.clone(), bias.zero_()
        unbiased = trained.model(ids).logits  # these tokens' choice depends on the trained bias
        bias.copy_(kept)
        assert (ours - unbiased).abs().max().item() > 1e-4
        assert (theirs(ids).logits - ours).abs().max().item() <= 1e-5  # (seen: 0.0; bias dropped: 0.027)
        assert torch.equal(load_trained(out).model(ids).logits, ours)


if __name__ == "__main__":
    worker()
