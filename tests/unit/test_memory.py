"""The memory plan (pretrain/planning/memory.py, `pretrain plan`): model states against DeepSpeed's own
estimators, the activation model against the peak memory torch's profiler measures on a CPU, the
command's output and its bad input, and `pretrain launch`'s check."""

import json

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from pretrain.bench.memory import measured_peak
from pretrain.cli.launch import check_memory_plan
from pretrain.config import REPO_CONFIG_DIR, ModelConfig, load_config, load_model_config
from pretrain.errors import UserError
from pretrain.model.loss import chunk_rows
from pretrain.model.transformer import Transformer
from pretrain.planning import memory
from pretrain.planning.flops import param_counts
from tests.helpers import assert_one_line_error


def zero(stage, offload_optimizer=False, offload_params=False):
    return memory.ZeroSettings(
        stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params, buffer_elements=0
    )


@pytest.mark.parametrize("preset", ["gpt3-125m", "gpt3-1.3b", "llama3-8b", "gpt3-175b"])
@pytest.mark.parametrize("nodes, per_node", [(1, 1), (1, 8), (8, 8)])
def test_model_states_agree_with_deepspeeds_estimators(preset, nodes, per_node):
    """Within 5% (the brief); by construction they agree to the byte, so the test holds them to 0.1%."""
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / f"{preset}.yaml")
    params, largest, gpus = param_counts(cfg).total, memory.largest_layer(cfg), nodes * per_node

    def ours(z):
        return sum(memory.model_states(params, largest, gpus, z))

    for offload in (False, True):
        _, theirs = estimate_zero2_model_states_mem_needs(params, per_node, nodes, cpu_offload=offload)
        assert ours(zero(2, offload_optimizer=offload)) == pytest.approx(theirs, rel=1e-3)
    for offload_optimizer, offload_params in ((False, False), (True, False), (True, True)):
        _, theirs, _ = estimate_zero3_model_states_mem_needs(
            params, largest, per_node, nodes, cpu_offload=offload_optimizer, cpu_offload_params=offload_params
        )
        assert ours(zero(3, offload_optimizer, offload_params)) == pytest.approx(theirs, rel=1e-3)


@pytest.mark.parametrize("preset", ["tiny", "gpt3-125m", "llama3-8b"])
def test_largest_layer_is_the_largest_module_of_the_model(preset):
    """DeepSpeed's `largest_layer_params`: the most parameters one module holds itself."""
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / f"{preset}.yaml")
    with torch.device("meta"):
        model = Transformer(cfg)
    held = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert memory.largest_layer(cfg) == held


def test_the_gpu_chunk_is_the_loss_functions():
    for vocab in (32000, 128256):
        assert max(16, memory.GPU_CHUNK_LOGITS // vocab) == chunk_rows(vocab, torch.device("cuda"))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_model_against_the_measured_peak(checkpointing):
    """A GQA model with several LM-head chunks: the model's figure within 1% of the peak torch's
    profiler measures (docs/training.md, "The memory plan", has the table; 0.0-2.2% seen)."""
    cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=1, max_seq_len=512)
    tokens = 2 * 512
    predicted = memory.activation_bytes(cfg, tokens, checkpointing, chunk_logits=2**20)  # the CPU's chunk
    assert predicted == pytest.approx(measured_peak(cfg, 2, 512, checkpointing), rel=0.01)


def hardware(gpus=8, gib=80.0):
    return memory.Hardware(gpus=gpus, gpu_memory=gib * memory.GIB, peak_flops=989e12)


def test_activations_divide_by_s_and_checkpointing_keeps_the_layer_inputs():
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / "llama3-8b.yaml")
    full = memory.activation_bytes(cfg, 8192, False)
    assert memory.activation_bytes(cfg, 4096, False) < full / 1.8
    kept = memory.activation_bytes(cfg, 8192, True)
    assert kept < full / 5
    assert kept > 8192 * cfg.n_layers * 2 * cfg.d_model  # each layer's bf16 input, at least


def test_the_plan_ranks_what_fits_and_keeps_the_global_batch():
    cfg = load_config(REPO_CONFIG_DIR / "train" / "llama3-8b.yaml")
    ds = json.loads((REPO_CONFIG_DIR / "deepspeed" / "zero3.json").read_text())
    report = memory.run_plan(cfg, ds, 8, 80.0)
    assert report["plan"]["fits"] and report["feasible"]
    speeds = [p["tokens_per_sec"] for p in report["feasible"]]
    assert speeds == sorted(speeds, reverse=True)
    for p in report["feasible"]:
        s = p["setting"]
        assert s["micro_batch_size"] * s["grad_accum"] * 8 // s["sequence_parallel"] == 512
        assert p["bytes"]["total"] <= 80 * memory.GIB
    small = memory.run_plan(cfg, ds, 8, 16.0)
    assert not small["feasible"] or all(p["bytes"]["total"] <= 16 * memory.GIB for p in small["feasible"])


def test_checkpointing_and_offload_cost_throughput():
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / "gpt3-1.3b.yaml")

    def speed(z, checkpointing=False, S=1):
        setting = memory.Setting(
            deepspeed_config="x.json",
            zero=z,
            activation_checkpointing=checkpointing,
            micro_batch_size=1,
            grad_accum=4,
            sequence_parallel=S,
        )
        return memory.throughput(cfg, 2048, setting, hardware())

    assert speed(zero(1), checkpointing=True) == pytest.approx(0.75 * speed(zero(1)), rel=0.05)
    assert speed(zero(3, True, True)) < speed(zero(3, True)) < speed(zero(3))
    assert speed(zero(2), S=2) < speed(zero(2))


def test_plan_json_and_text(cli):
    result = cli("plan", "gpt3-1.3b", "--gpus", "8", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"model", "params", "seq_len", "global_batch_windows", "assumptions", "plan", "feasible"} <= set(
        report
    )
    assert set(report["plan"]["bytes"]) == {
        "parameters",
        "gradients",
        "optimizer_states",
        "activations",
        "buffers",
        "total",
    }
    assert report["assumptions"]["mfu"] == 0.40 and report["plan"]["zero"] == "ZeRO-2"
    assert report["feasible"][0]["setting"]["overrides"][0].startswith("engine.deepspeed_config=")
    text = cli("plan", "gpt3-1.3b", "train.micro_batch_size=8", "--gpus", "8", "--gpu-memory-gib", "40")
    assert text.returncode == 0, text.stderr
    assert "of 40: does NOT fit" in text.stdout and "settings that fit" in text.stdout


def test_plan_bad_input_is_one_line(cli):
    assert_one_line_error(cli("plan", "gpt3-1.3b"), "needs --gpus N")
    assert_one_line_error(cli("plan", "gpt3-1.3b", "--gpus", "0"), "--gpus 0")
    assert_one_line_error(cli("plan", "gpt3-1.3b", "--gpus", "8", "--mfu", "1.5"), "--mfu")
    assert_one_line_error(cli("plan", "model/gpt3-1.3b", "--gpus", "8"), "not a run config")
    assert_one_line_error(cli("plan", "gpt3-1.3b", "--gpus", "8", "model.wat=1"), "model.wat")


def test_launch_refuses_a_plan_that_cannot_fit_and_skips_without_a_gpu():
    cfg = load_config(REPO_CONFIG_DIR / "train" / "gpt3-13b.yaml")
    ds = json.loads((REPO_CONFIG_DIR / "deepspeed" / "zero3.json").read_text())
    check_memory_plan(cfg, ds, 1, None)  # memory unknown (this CPU machine): nothing to check
    check_memory_plan(cfg, ds, 8, 80.0)  # the config's own setting fits 8 H100s
    with pytest.raises(UserError) as refused:
        check_memory_plan(cfg, ds, 1, 80.0)
    line = str(refused.value)
    assert "\n" not in line and "GiB per GPU (parameters" in line and "of 80.0 GiB" in line
    assert "it would fit with engine.deepspeed_config=configs/deepspeed/zero3_offload.json" in line
    with pytest.raises(UserError, match="no packaged ZeRO config, micro-batch, checkpointing or S fits"):
        check_memory_plan(load_config(REPO_CONFIG_DIR / "train" / "gpt3-175b.yaml"), ds, 8, 8.0)
    with pytest.raises(UserError, match="it would fit with engine.deepspeed_config="):
        check_memory_plan(
            load_config(REPO_CONFIG_DIR / "train" / "gpt3-13b.yaml", ["train.micro_batch_size=8"]),
            ds,
            8,
            80.0,
        )


def run_host_check(monkeypatch, capsys, tmp_path, gib: float, need: float) -> str | None:
    """monitoring/hosts.py's CHECK_SCRIPT as a host runs it, here, on two GPUs of `gib` GiB (a fake torch)."""
    import os
    import sys
    import types

    from monitoring.hosts import CHECK_SCRIPT

    gpu = types.SimpleNamespace(total_memory=int(gib * memory.GIB))
    cuda = types.SimpleNamespace(device_count=lambda: 2, get_device_properties=lambda i: gpu)
    fake = types.SimpleNamespace(cuda=cuda, __spec__=torch.__spec__)  # found installed, as torch is
    monkeypatch.setitem(sys.modules, "torch", fake)
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidia0" or real_exists(p))
    monkeypatch.setattr(sys, "argv", ["-c", str(tmp_path), "2", "0", str(int(need))])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        exec(compile(CHECK_SCRIPT, "check", "exec"), {"__name__": "__main__"})
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["problem"]


def test_a_hosts_check_refuses_gpus_smaller_than_the_plan(monkeypatch, capsys, tmp_path):
    """Over ssh `pretrain launch` does not see the GPUs: each host's check compares its own with the
    plan's bytes per GPU (HostSet.gpu_memory_needed, from check_memory_plan)."""
    assert run_host_check(monkeypatch, capsys, tmp_path, 80.0, 60 * memory.GIB) is None
    assert run_host_check(monkeypatch, capsys, tmp_path, 80.0, 0) is None  # no plan: not checked
    problem = run_host_check(monkeypatch, capsys, tmp_path, 40.0, 56.7 * memory.GIB)
    assert problem.startswith("its GPUs have 40.0 GiB but the memory plan needs 56.7 GiB per GPU")
    assert "--gpu-memory-gib 40" in problem
    cfg = load_config(REPO_CONFIG_DIR / "train" / "gpt3-13b.yaml")
    ds = json.loads((REPO_CONFIG_DIR / "deepspeed" / "zero3.json").read_text())
    assert check_memory_plan(cfg, ds, 8, None) == pytest.approx(56.7 * memory.GIB, rel=0.01)


def test_the_plan_takes_s_from_the_config_and_muon_keeps_one_moment():
    from types import SimpleNamespace

    cfg = load_config(REPO_CONFIG_DIR / "train" / "llama3-8b.yaml", ["engine.activation_checkpointing=false"])
    ds = json.loads((REPO_CONFIG_DIR / "deepspeed" / "zero3.json").read_text())
    whole = memory.run_plan(cfg, ds, 8, 80.0)["plan"]
    cfg.parallel = SimpleNamespace(sequence=2)  # parallel.sequence (the sequence-parallel section)
    split = memory.run_plan(cfg, ds, 8, 80.0)["plan"]
    assert split["setting"]["sequence_parallel"] == 2
    assert split["bytes"]["activations"] == memory.activation_bytes(cfg.model, 8192 // 2, False)
    assert split["bytes"]["activations"] < whole["bytes"]["activations"] / 1.8  # the head's V·d terms stay
    assert split["bytes"]["optimizer_states"] == whole["bytes"]["optimizer_states"]  # ZeRO over all 8
    with pytest.raises(UserError, match="not a multiple of parallel.sequence=2"):
        memory.run_plan(cfg, ds, 7, 80.0)
    muon = load_config(REPO_CONFIG_DIR / "train" / "llama3-8b.yaml", ["optim.name=muon", "train.grad_clip=0"])
    states = memory.run_plan(muon, ds, 8, 80.0)["plan"]["bytes"]["optimizer_states"]
    share = memory.muon_share(muon.model)  # the blocks' matrices: 87% of Llama 3 8B
    assert states == pytest.approx(whole["bytes"]["optimizer_states"] * (1 - share / 3))


def test_the_plan_offers_no_sequence_parallel_setting_a_run_would_refuse():
    """llama3-8b (8 key/value heads; a 525M-element embedding, over the packaged zero3.json's
    reduce_bucket_size of 5e8): with engine.compile on (its train config), no S > 1 (compiled
    blocks are refused with it); without, S > 1 only outside ZeRO-3."""
    ds = json.loads((REPO_CONFIG_DIR / "deepspeed" / "zero3.json").read_text())
    for compiled in (True, False):
        cfg = load_config(
            REPO_CONFIG_DIR / "train" / "llama3-8b.yaml", [f"engine.compile={str(compiled).lower()}"]
        )
        offered = [p["setting"] for p in memory.run_plan(cfg, ds, 8, 80.0)["feasible"]]
        parallel = [s for s in offered if s["sequence_parallel"] > 1]
        assert bool(parallel) is not compiled and len(offered) > len(parallel)
        assert all(s["zero"]["stage"] != 3 for s in parallel)


def test_the_activation_model_of_experts_against_the_measured_peak():
    """A routed model (a dense first block, then top-2 of 8 experts with a shared one, a balancing
    loss and a router z-loss): the model's figure within 1% of the peak torch's profiler measures."""
    from pretrain.config import MoEConfig

    moe = MoEConfig(
        experts=8,
        top_k=2,
        expert_ffn_dim=128,
        shared_experts=1,
        dense_layers=1,
        balance="both",
        router_z_loss=1e-3,
    )
    cfg = ModelConfig(
        vocab_size=4096, d_model=256, n_layers=3, n_heads=4, n_kv_heads=1, max_seq_len=512, moe=moe
    )
    predicted = memory.activation_bytes(cfg, 2 * 512, False, chunk_logits=2**20)
    assert predicted == pytest.approx(measured_peak(cfg, 2, 512, False), rel=0.01)


def test_experts_split_over_e_ranks_hold_a_share_of_the_parameters_and_the_same_states():
    """qwen3-30b-a3b on 64 GPUs under ZeRO-2: at E = 8 each GPU holds the dense parameters and an
    eighth of the experts (bf16); the gradients' and optimizer states' partitions are Ψ/N at any E
    (each expert's over the N/E ranks holding it)."""
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / "qwen3-30b-a3b.yaml")
    counts = param_counts(cfg)
    whole = memory.model_states(counts.total, 0, 64, zero(2))
    split = memory.model_states(counts.total, 0, 64, zero(2), counts.experts, 8)
    assert split[0] == 2 * (counts.total - counts.experts + counts.experts / 8)
    assert whole[0] == 2 * counts.total and split[1:] == whole[1:]
    assert split[2] == 12 * counts.total / 64


def test_the_plan_of_a_mixture_offers_expert_parallelism_under_zero_1_and_2_only():
    cfg = load_config(REPO_CONFIG_DIR / "train" / "qwen3-30b-a3b.yaml")
    report = memory.run_plan(
        cfg, json.loads((REPO_CONFIG_DIR / "deepspeed" / "zero2.json").read_text()), 64, 80
    )
    assert report["plan"]["fits"] and report["active_params"] == param_counts(cfg.model).active
    degrees = {p["setting"]["expert_parallel"] for p in report["feasible"]}
    assert degrees > {1} and all(
        p["setting"]["zero"]["stage"] in (1, 2)
        for p in report["feasible"]
        if p["setting"]["expert_parallel"] > 1
    )
    assert any(
        f"parallel.expert={e}" in p["setting"]["overrides"] for p in report["feasible"] for e in degrees - {1}
    )
