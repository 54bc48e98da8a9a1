from pathlib import Path

import pytest

from pretrain.config import (
    REPO_CONFIG_DIR,
    ModelConfig,
    RunConfig,
    available_presets,
    config_hash,
    load_any,
    load_config,
    load_finetune_config,
    load_model_config,
    to_yaml,
)
from pretrain.errors import ConfigError

GPT3_TABLE = {  # preset: (n_layers, d_model, n_heads, d_ff = 8/3·d rounded up to 256)
    "gpt3-125m": (12, 768, 12, 2048),
    "gpt3-350m": (24, 1024, 16, 2816),
    "gpt3-760m": (24, 1536, 16, 4096),
    "gpt3-1.3b": (24, 2048, 16, 5632),
    "gpt3-2.7b": (32, 2560, 32, 6912),
    "gpt3-6.7b": (32, 4096, 32, 11008),
    "gpt3-13b": (40, 5120, 40, 13824),  # GPT-3's d_model 5140 is not 40 heads of 128
    "gpt3-175b": (96, 12288, 96, 32768),
}


@pytest.mark.parametrize("name", sorted(GPT3_TABLE))
def test_gpt3_presets(name):
    cfg = load_model_config(REPO_CONFIG_DIR / "model" / f"{name}.yaml")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff) == GPT3_TABLE[name]
    assert cfg.max_seq_len == 2048 and cfg.n_kv_heads == cfg.n_heads
    assert (cfg.norm, cfg.norm_placement, cfg.activation, cfg.positions) == (
        "rmsnorm",
        "pre",
        "swiglu",
        "rope",
    )


def test_every_shipped_config_loads():
    assert {"tiny", *GPT3_TABLE} <= set(available_presets())
    paths = sorted(REPO_CONFIG_DIR.rglob("*.yaml"))
    kinds = {type(load_any(path)) for path in paths if path.parent.name != "finetune"}
    assert kinds == {RunConfig, ModelConfig}
    finetune = [p for p in paths if p.parent.name == "finetune"]
    assert {p.stem for p in finetune} == {"classification", "sft"}
    for path in finetune:  # they name no model or data of their own: the run supplies both
        cfg = load_finetune_config(path, ["finetune.init=runs/demo/run", "data.train=train.csv"])
        assert cfg.finetune.task == path.stem
    with pytest.raises(ConfigError, match="finetune.init is not set"):
        load_finetune_config(finetune[0])


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_precedence_defaults_preset_file_overrides(tmp_path):
    path = write(tmp_path, "model:\n  preset: gpt3-350m\n  n_layers: 6\ndata:\n  seq_len: 1024\n")
    cfg = load_config(path, ["model.d_model=512", "optim.lr=1e-4", "faults.spike_steps=[3,7]"])
    assert cfg.model.preset == "gpt3-350m"
    assert cfg.model.n_layers == 6  # file over preset
    assert cfg.model.d_model == 512  # override over preset
    assert cfg.model.n_heads == 16  # preset over default
    assert cfg.model.d_ff == 1536  # derived from the final d_model, not the preset's or the default's
    assert cfg.optim.lr == 1e-4 and cfg.faults.spike_steps == [3, 7]
    assert cfg.train.steps == RunConfig().train.steps


def test_override_can_switch_preset(tmp_path):
    path = write(tmp_path, "model:\n  preset: tiny\ndata:\n  seq_len: 512\n")
    cfg = load_config(path, ["model.preset=gpt3-125m"])
    assert cfg.model.preset == "gpt3-125m" and cfg.model.d_model == 768


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(REPO_CONFIG_DIR / "train" / "tiny.yaml", ["train.steps=7"])
    again = load_config(write(tmp_path, to_yaml(cfg)))
    assert again == cfg and config_hash(again) == config_hash(cfg)
    assert config_hash(load_config(REPO_CONFIG_DIR / "train" / "tiny.yaml")) != config_hash(cfg)


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        (
            "model:\n  preset: tiny\n  n_layer: 3\n",
            [],
            r"unknown key 'model.n_layer'.*valid keys in 'model' are .*n_layers",
        ),
        ("modle:\n  n_layers: 3\n", [], r"unknown key 'modle'.*valid keys are run, model"),
        ("model:\n  preset: tiny\n", ["train.stepz=3"], r"override: unknown key 'train.stepz'"),
        ("model:\n  preset: tiny\n  n_layers: three\n", [], r"model.n_layers: Value 'three'.*Integer"),
        (
            "model:\n  preset: tiny\n",
            ["run.deterministic=maybe"],
            r"run.deterministic: .*not a valid bool.*value of the field's type",
        ),
        (
            "model:\n  preset: tiny\n  d_model: 100\n  n_heads: 3\n",
            [],
            r"model.d_model=100 is not divisible by model.n_heads=3",
        ),
        (
            "model:\n  preset: tiny\n  n_heads: 4\n  n_kv_heads: 3\n",
            [],
            r"model.n_heads=4 is not divisible by model.n_kv_heads=3",
        ),
        (
            "model:\n  preset: tiny\n  norm: batchnorm\n",
            [],
            r"model.norm='batchnorm' is not one of rmsnorm, layernorm",
        ),
        ("model:\n  preset: tiny\ndata:\n  seq_len: 128\n", [], r"data.seq_len=128 is below 512"),
        (
            "model:\n  preset: tiny\ndata:\n  seq_len: 1024\n",
            [],
            r"data.seq_len=1024 exceeds model.max_seq_len=512",
        ),
        ("model:\n  preset: tiny\ncheckpoint:\n  keep: 1\n", [], r"checkpoint.keep=1: keep at least 2"),
        ("model:\n  preset: nope\n", [], r"unknown model preset 'nope'.*available presets: .*gpt3-125m"),
        ("model:\n  preset: tiny\n", ["model.n_layers"], r"override 'model.n_layers' is not KEY=VALUE"),
        ("model: [1, 2\n", [], r"not valid YAML at line"),
        ("- a\n- b\n", [], r"expected a mapping"),
        ("model: 3\n", [], r"model must be a section .*got 3"),
        ("model:\n  preset: tiny\ntrain: 5\n", [], r"train must be a section"),
        ("model:\n  preset: tiny\n", ["model=3"], r"override: model must be a section"),
        ("model:\n  preset: tiny\nfaults:\n  spike_steps: 3\n", [], r"faults.spike_steps must be a list"),
        ("model:\n  preset: tiny\n", ["model.n_layers=[1"], r"could not parse overrides"),
        ("model:\n  preset: tiny\n", ["optim.lr=nan"], r"optim.lr=nan must be a finite number"),
        ("model:\n  preset: tiny\n", ["optim.lr=inf"], r"optim.lr=inf must be a finite number"),
        ("model:\n  preset: tiny\n", ["model.norm_eps=nan"], r"model.norm_eps=nan must be a finite"),
        ("model:\n  preset: tiny\n", ["engine.peak_flops=-1"], r"engine.peak_flops=-1.0 must be > 0"),
        ("model:\n  preset: tiny\n", ["faults.kill_step=-5"], r"faults.kill_step=-5 must be > 0"),
        ("model:\n  preset: tiny\n", ["loss.z_loss=-1e-4"], r"loss.z_loss=-0.0001 must be >= 0"),
        ("model:\n  preset: tiny\n", ["loss.z_loss=nan"], r"loss.z_loss=nan must be a finite number"),
        ("model:\n  preset: tiny\n", ["loss.z_loss=inf"], r"loss.z_loss=inf must be a finite number"),
        (
            "model:\n  preset: tiny\nloss:\n  zloss: 1\n",
            [],
            r"unknown key 'loss.zloss'.*in 'loss' are z_loss",
        ),
        ("model:\n  preset: tiny\nloss: 1e-4\n", [], r"loss must be a section"),
        ("model:\n  preset: tiny\n", ["model.qk_norm=maybe"], r"model.qk_norm: .*not a valid bool"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(write(tmp_path, text), overrides)
    assert "\n" not in str(info.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/config.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    binary = write(tmp_path, "", "binary.yaml")
    binary.write_bytes(b"\xff\xfe\x00model")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)


def test_model_preset_files(tmp_path):
    tiny = REPO_CONFIG_DIR / "model" / "tiny.yaml"
    # Overrides may carry the run config's `model.` prefix or not.
    assert load_model_config(tiny, ["model.n_layers=2"]).n_layers == 2
    assert load_model_config(tiny, ["n_layers=3"]).n_layers == 3
    assert load_any(tiny, ["model.d_model=64"]).d_model == 64
    with pytest.raises(ConfigError, match="cannot name another preset"):
        load_model_config(write(tmp_path, "preset: tiny\nn_layers: 2\n", "p.yaml"))
    # A typo in a preset file is reported against the model's fields.
    with pytest.raises(ConfigError, match=r"unknown key 'n_layer'.*valid keys are preset, vocab_size"):
        load_any(write(tmp_path, "d_model: 64\nn_layer: 2\n", "typo.yaml"))


def test_model_preset_is_not_a_run_config():
    with pytest.raises(ConfigError, match="is a model preset, not a run config"):
        load_config(REPO_CONFIG_DIR / "model" / "tiny.yaml")


def test_model_config_direct_construction_derives_values():
    cfg = ModelConfig(d_model=1024, n_heads=16)
    assert cfg.n_kv_heads == 16 and cfg.d_ff == 2816 and cfg.head_dim == 64
    assert ModelConfig(d_model=64, n_heads=4, activation="relu").d_ff == 256
    with pytest.raises(ConfigError, match="rotary embeddings need an even head_dim"):
        ModelConfig(d_model=60, n_heads=4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "monitor.on_loss_spike=explode",
            "monitor.on_loss_spike='explode' is not one of ignore, warn, rollback, stop",
        ),
        ("monitor.warmup=1", "monitor.warmup=1, monitor.window=128: need 2 <= warmup <= window"),
        ("monitor.max_restarts=-1", "monitor.max_restarts=-1 must be >= 0"),
    ],
)
def test_a_bad_monitor_setting_is_the_loaders_one_line_config_error(override, message):
    """The `monitor:` section is monitoring's own (monitoring/config.py, no pretrain imports); its
    range checks reach the user as every other section's do: a ConfigError, one line, exit 2."""
    with pytest.raises(ConfigError) as error:
        load_config("tiny", [override])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_mixtures_corpora_are_checked_where_the_config_is_read():
    """data.mixture's names and weights are refused by the loader, in one line, before any data
    is opened: the same rule (pretrain.config.check_mixture) a MixtureStream applies."""
    base = [
        "data.dir=null",
        "data.mixture=[{name: web, dir: a, weight: 0.7}, {name: web, dir: b, weight: 0.3}]",
    ]
    with pytest.raises(ConfigError, match="mixture source name 'web' appears twice"):
        load_config("tiny", base)
    with pytest.raises(ConfigError, match="mixture source name 'a b': use letters"):
        load_config("tiny", ["data.dir=null", "data.mixture=[{name: 'a b', dir: a}]"])
    with pytest.raises(ConfigError, match="mixture source 'web' has weight 0.0: use a positive number"):
        load_config("tiny", ["data.dir=null", "data.mixture=[{name: web, dir: a, weight: 0}]"])


def test_the_monitor_section_is_the_services_the_trainers_and_the_supervisors_each_read_by_its_owner():
    """`monitor:` stays one flat section (its keys are a contract), made of the service's settings,
    the trainer's and the supervisor's, which do not overlap; the service, its policy and its
    detectors never read a trainer's or a supervisor's setting (they are typed to take a
    ServiceConfig), and the trainer's side reads only its own and `monitor.enabled`."""
    import ast
    import dataclasses

    from monitoring.config import ServiceConfig, SupervisorConfig
    from pretrain.config import MonitorConfig
    from pretrain.stability.settings import ReplaySettings, ReplicaSettings, SkipSettings
    from pretrain.train.settings import LinkSettings, StragglerSettings

    trainer_parts = (LinkSettings, SkipSettings, StragglerSettings, ReplaySettings, ReplicaSettings)
    owners = (ServiceConfig, *trainer_parts, SupervisorConfig)
    names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in owners}
    assert sum(len(n) for n in names.values()) == len(set.union(*names.values()))  # no overlap
    assert {f.name for f in dataclasses.fields(MonitorConfig)} == set.union(*names.values())
    trainers = set.union(*(names[cls] for cls in trainer_parts))
    assert names[SkipSettings] == {"skip_step", "skip_ratio", "skip_grad_norm_ratio", "skip_window"}
    assert names[StragglerSettings] == {"straggler_factor", "straggler_windows", "on_straggler"}
    assert names[ReplaySettings] | names[ReplicaSettings] == {
        "replay", "machine_faults_to_exclude", "consistency_every"
    }  # fmt: skip
    assert names[LinkSettings] == {"timeout", "quarantine"}
    cfg = load_config(
        "tiny",
        ["monitor.max_restarts=5", "monitor.window=64", "monitor.hang_factor=4", "monitor.timeout=0.5"],
    )
    assert all(isinstance(cfg.monitor, cls) for cls in owners)
    assert (cfg.monitor.max_restarts, cfg.monitor.window, cfg.monitor.hang_factor) == (5, 64, 4.0)
    assert cfg.monitor.timeout == 0.5 and cfg.monitor.skip_window == 64
    for key, value in (("timeout", 0), ("skip_ratio", 1), ("skip_grad_norm_ratio", 1), ("skip_window", 1)):
        with pytest.raises(ConfigError, match=f"monitor.{key}={value}"):
            load_config("tiny", [f"monitor.{key}={value}"])
    root = Path(__file__).resolve().parents[2]

    def read(path: str, owner: str) -> set[str]:
        return {
            node.attr
            for node in ast.walk(ast.parse((root / path).read_text()))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute | ast.Name)
            and getattr(node.value, "attr", getattr(node.value, "id", None)) == owner
        }

    others = names[SupervisorConfig] | trainers
    for module in ("service.py", "policy.py", "detectors.py", "page.py"):
        wrong = read(f"monitoring/{module}", "config") & others
        assert not wrong, (module, wrong)
    trainer = read("pretrain/pretraining.py", "monitor")
    assert trainer and trainer <= trainers | {"enabled"}, trainer


def test_qk_norm_and_z_loss_load_from_files_and_overrides_and_default_off(tmp_path):
    """The stability switches (issue 31): off by default, read like any key, written back by
    to_yaml; a config or checkpoint from before them (no `loss` section, no `model.qk_norm`) loads."""
    import json
    from dataclasses import asdict

    tiny = REPO_CONFIG_DIR / "train" / "tiny.yaml"
    default = load_config(tiny)
    assert default.model.qk_norm is False and default.loss.z_loss == 0.0
    cfg = load_config(
        write(
            tmp_path,
            "model:\n  preset: tiny\n  qk_norm: true\ndata:\n  seq_len: 512\nloss:\n  z_loss: 1e-4\n",
        )
    )
    assert cfg.model.qk_norm is True and cfg.loss.z_loss == 1e-4
    assert load_config(tiny, ["model.qk_norm=true", "loss.z_loss=0.001"]).loss.z_loss == 0.001
    assert load_config(write(tmp_path, to_yaml(cfg), "again.yaml")) == cfg
    before = (
        to_yaml(default)
        .replace("loss:\n  z_loss: 0.0\n  kernel: chunked\n", "")
        .replace("  qk_norm: false\n", "")
    )
    assert "\nloss:" not in before and "qk_norm" not in before
    assert load_config(write(tmp_path, before, "before.yaml")) == default
    saved = json.loads(json.dumps(asdict(default)))["model"]  # a checkpoint's run_config.json
    del saved["qk_norm"]
    assert ModelConfig(**saved) == default.model  # how checkpoint readers build the model


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.moe.top_k=9"], r"model.moe.top_k=9 exceeds model.moe.experts=8"),
        (["model.moe.experts=0"], r"model.moe.experts=0 must be > 0"),
        (["model.moe.router=relu"], r"model.moe.router='relu' is not one of softmax, sigmoid"),
        (["model.moe.balance=none"], r"model.moe.balance='none' is not one of aux_loss, bias, both"),
        (["model.moe.bias_rate=-1"], r"model.moe.bias_rate=-1.0 must be >= 0"),
        (["model.moe.dense_layers=4"], r"model.moe.dense_layers=4 leaves no block of model.n_layers=4"),
        (["model.moe.experts=4", "model.activation=gelu"], r"model.moe with model.activation='gelu'"),
        (["model.moe.expert=4"], r"unknown key 'model.moe.expert'"),
        (["parallel.expert=2"], r"parallel.expert=2 but the model has no experts"),
        (
            ["model.moe.experts=6", "parallel.expert=4"],
            r"model.moe.experts=6 is not divisible by parallel.expert=4",
        ),
        (["model.moe.experts=4", "parallel.sequence=2"], r"model.moe with parallel.sequence=2: .*not proven"),
        (["model.d_model=100", "model.n_heads=3"], r"or set model.head_dim"),
    ],
)
def test_bad_moe_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(REPO_CONFIG_DIR / "train" / "tiny.yaml", overrides)
    assert "\n" not in str(info.value)


def test_moe_and_head_dim_load_derive_and_round_trip(tmp_path):
    """`model.moe` is null unless set (a dense run's config is as before); set, its expert size
    defaults to model.d_ff; `model.head_dim` is derived (d_model / n_heads) unless set; both
    written back by to_yaml and read back from a checkpoint's run_config.json."""
    import json
    from dataclasses import asdict

    tiny = REPO_CONFIG_DIR / "train" / "tiny.yaml"
    assert load_config(tiny).model.moe is None and load_config(tiny).model.head_dim == 32
    cfg = load_config(tiny, ["model.moe.experts=4", "model.head_dim=48", "parallel.expert=2"])
    assert (cfg.model.moe.experts, cfg.model.moe.expert_ffn_dim, cfg.model.head_dim) == (4, 512, 48)
    assert cfg.parallel.expert == 2
    assert load_config(write(tmp_path, to_yaml(cfg))) == cfg
    saved = json.loads(json.dumps(asdict(cfg)))["model"]
    assert ModelConfig(**saved) == cfg.model
    with pytest.raises(ConfigError, match=r"model.moe: unknown key 'routers'"):
        ModelConfig(**saved | {"moe": saved["moe"] | {"routers": 2}})
    wider = load_config(tiny, ["model.d_model=256"])
    assert wider.model.head_dim == 64  # derived again from the override, not kept from the preset
