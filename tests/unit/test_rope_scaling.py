"""`model.rope_scaling` (Llama 3.1's rule and linear) against transformers, its config checks, and
`checkpoint.init`'s checks (docs/training.md, Long context)."""

import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch

from pretrain.config import ModelConfig, RopeScaling, load_config
from pretrain.errors import ConfigError, UserError
from pretrain.model.hf import load_hf, save_hf
from pretrain.model.transformer import Transformer, rope_frequencies, rope_tables
from pretrain.pretraining import check_init, init_mismatch
from tests.conftest import random_weights_model, small_model_config
from tests.helpers import FAST, LONGER_CONTEXT, TINY, assert_one_line_error

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

LLAMA3 = RopeScaling(type="llama3", factor=4.0, original_max_position_embeddings=64)
LINEAR = RopeScaling(type="linear", factor=4.0)
# transformers' spelling of each (config.json's rope_scaling, as Meta's Llama 3.1 writes it)
THEIRS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [
        (8, 10000.0, LLAMA3),  # wavelengths 6.3, 63, 628, 6283 against 64/4 and 64/1: every band
        (128, 500000.0, RopeScaling(type="llama3", factor=8.0, original_max_position_embeddings=8192)),
        (64, 10000.0, replace(LLAMA3, low_freq_factor=2.0, high_freq_factor=8.0)),
        (8, 10000.0, LINEAR),
        (128, 500000.0, RopeScaling(type="linear", factor=2.5)),
    ],
    ids=["llama3-tiny", "llama3.1-8b", "llama3-other-factors", "linear-tiny", "linear-2.5"],
)
def test_rope_frequencies_equal_transformers(head_dim, theta, scaling):
    """The rule transformers applies (modeling_rope_utils.ROPE_INIT_FUNCTIONS), bit for bit."""
    parameters = {k: v for k, v in asdict(scaling).items() if k != "type" and v is not None}
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": scaling.type, "rope_theta": theta} | parameters,
    )
    theirs, attention_factor = ROPE_INIT_FUNCTIONS[scaling.type](config, "cpu")
    ours = rope_frequencies(head_dim, theta, scaling)
    plain = rope_frequencies(head_dim, theta)
    assert attention_factor == 1.0  # (neither rule rescales the logits)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, plain)
    if scaling.type == "llama3":  # the highest frequency kept, the lowest divided by the factor
        assert ours[0] == plain[0] and ours[-1] == plain[-1] / scaling.factor


def test_no_rope_scaling_computes_the_tables_as_before():
    """None is today's computation, bit for bit (the golden run checks the whole model)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    angles = torch.outer(torch.arange(128, dtype=torch.float32), inv_freq)
    cos, sin = rope_tables(128, 16, 10000.0)
    assert torch.equal(cos, torch.cat([angles, angles], -1).cos())
    assert torch.equal(sin, torch.cat([angles, angles], -1).sin())
    saved = asdict(small_model_config())
    del saved["rope_scaling"]  # a run config saved before the key existed
    assert ModelConfig(**saved).rope_scaling is None


def logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_the_export_gives_transformers_our_logits_beyond_the_original_length(tmp_path, scaling):
    """config.json carries rope_scaling (and transformers 5's rope_parameters); LlamaForCausalLM's
    logits equal ours within 1e-4 (fp32) at positions up to 4x the original 64, and the comparison
    can fail: without the scaling, transformers' logits there differ from ours by over 100x that
    (0.13 for llama3, 0.21 for linear, measured)."""
    ours = random_weights_model(qkv_scale=8.0, max_seq_len=256, rope_scaling=scaling).eval()
    save_hf(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_scaling"] == THEIRS[scaling.type]
    assert config["rope_parameters"] == THEIRS[scaling.type] | {"rope_theta": 10000.0}
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert theirs.config.rope_parameters["rope_type"] == scaling.type
    tokens = torch.randint(0, 97, (2, 256), generator=torch.Generator().manual_seed(0))
    a, b = logits(ours, tokens), logits(theirs, tokens)
    beyond = slice(64, None)  # positions past original_max_position_embeddings
    assert a[:, beyond].std() > 0.1
    assert (a - b).abs().max().item() <= 1e-4
    plain = {
        **config,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    (tmp_path / "config.json").write_text(json.dumps(plain))
    unscaled = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert (a[:, beyond] - logits(unscaled, tokens)[:, beyond]).abs().max().item() > 1e-2


def test_a_llama_directory_with_rope_scaling_reads_back(tmp_path):
    """Both spellings: transformers 5's own save (rope_parameters only) and a 4.x config.json
    (rope_theta + rope_scaling, llama3's original length left to max_position_embeddings)."""
    shape = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    config = transformers.LlamaConfig(
        **shape,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 500000.0} | THEIRS["llama3"],
    )
    torch.manual_seed(3)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path, safe_serialization=True)
    assert "rope_scaling" not in json.loads((tmp_path / "config.json").read_text())
    ours = load_hf(tmp_path).eval()
    assert ours.cfg.rope_scaling == LLAMA3 and ours.cfg.rope_theta == 500000.0
    tokens = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(1))
    assert (logits(ours, tokens) - logits(theirs, tokens)).abs().max().item() <= 1e-4
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["rope_parameters"]
    older = {k: v for k, v in THEIRS["llama3"].items() if k != "original_max_position_embeddings"}
    saved |= {"rope_theta": 500000.0, "rope_scaling": older, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_hf(tmp_path).cfg.rope_scaling == LLAMA3
    (tmp_path / "config.json").write_text(
        json.dumps(saved | {"rope_scaling": {"type": "linear", "factor": 4}})
    )
    assert load_hf(tmp_path).cfg.rope_scaling == LINEAR
    (tmp_path / "config.json").write_text(
        json.dumps(saved | {"rope_scaling": {"type": "linear", "factor": 0.5}})
    )
    with pytest.raises(UserError, match=r"config.json: model.rope_scaling.factor=0.5"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model.rope_scaling.factor=4"], "model.rope_scaling.type is not set"),
        (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4"], "model.rope_scaling.type='yarn'"),
        (["model.rope_scaling.type=linear"], "model.rope_scaling.factor is not set"),
        (["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"], "factor=0.5 must be"),
        (["model.rope_scaling.type=linear", "model.rope_scaling.factor=inf"], "factor=inf must be"),
        (
            [
                "model.rope_scaling.type=linear",
                "model.rope_scaling.factor=2",
                "model.rope_scaling.high_freq_factor=4",
            ],
            "high_freq_factor is llama3's",
        ),
        (
            ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=2"],
            "original_max_position_embeddings is not set",
        ),
        (
            [
                "model.rope_scaling.type=llama3",
                "model.rope_scaling.factor=2",
                "model.rope_scaling.original_max_position_embeddings=512",
                "model.rope_scaling.low_freq_factor=4",
            ],
            "high_freq_factor=4.0 must be above low_freq_factor=4.0",
        ),
        (
            ["model.rope_scaling.type=linear", "model.rope_scaling.factor=2", "model.positions=learned"],
            "model.positions='learned'",
        ),
        (["model.rope_scaling.typo=2"], "valid keys in 'model.rope_scaling' are type, factor"),
        (["model.rope_scaling=8"], "model.rope_scaling must be a section"),
    ],
)
def test_rope_scaling_refusals(overrides, fragment):
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, overrides)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_rope_scaling_loads_with_llama31_defaults_and_round_trips():
    cfg = load_config(
        TINY,
        [
            "model.max_seq_len=2048",
            "model.rope_scaling.type=llama3",
            "model.rope_scaling.factor=4",
            "model.rope_scaling.original_max_position_embeddings=512",
        ],
    )
    assert cfg.model.rope_scaling == RopeScaling(
        type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=512,
    )
    assert ModelConfig(**asdict(cfg.model)) == cfg.model  # as a checkpoint's run_config.json reads back
    assert load_config(TINY, ["model.rope_scaling=null"]).model.rope_scaling is None


# --------------------------------------------------------------------------- checkpoint.init


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"max_seq_len": 256, "rope_scaling": LLAMA3, "rope_theta": 500000.0}, None),
        ({"preset": "other", "init_std": 0.01}, None),
        ({"d_model": 64}, "model.d_model 32 → 64"),
        ({"n_kv_heads": 4}, "model.n_kv_heads 2 → 4"),
        ({"norm_placement": "post"}, "model.norm_placement 'pre' → 'post'"),  # same shapes, other model
        ({"qk_norm": True}, "model.qk_norm"),
    ],
)
def test_init_mismatch(change, refused):
    problem = init_mismatch(small_model_config(), small_model_config(**change))
    assert problem == refused if refused is None else refused in problem
    learned = small_model_config(positions="learned")
    assert "learned positions" in init_mismatch(learned, replace(learned, max_seq_len=128))


@pytest.fixture
def hf_init(tmp_path, tokenizer_dir):
    """A Hugging Face directory of the unit tier's FAST shape, with the session's tokenizer."""
    cfg = ModelConfig(vocab_size=512, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=512)
    directory = tmp_path / "init"
    save_hf(Transformer(cfg), directory)
    shutil.copy(tokenizer_dir / "tokenizer.model", directory)
    return directory


def test_checkpoint_init_loads_the_weights_into_the_longer_context(hf_init, train_data):
    cfg = load_config(TINY, [*FAST, f"checkpoint.init={hf_init}", *LONGER_CONTEXT])
    sha = json.loads((train_data / "manifest.json").read_text())["tokenizer"]["sha256"]
    initial = check_init(cfg, sha)
    model = initial.load_model(cfg.model)
    assert model.cfg == cfg.model and model.rope_cos.shape == (1024, 16)
    for (name, a), (_, b) in zip(
        load_hf(hf_init).state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with pytest.raises(UserError, match="its tokenizer"):
        check_init(cfg, "0" * 64)


def test_a_run_starts_from_the_init_weights_and_resumes_without_reading_them(
    tmp_path, hf_init, train_data, monkeypatch
):
    """In this process with a FakeEngine: the first start trains from checkpoint.init's weights at
    step 0; a restart resumes from the run's own checkpoint and never reads checkpoint.init's weights."""
    from pretrain.initial_model import InitialModel
    from tests.unit.fakes import pretraining_trainer

    def config(steps: int, init=hf_init):
        return load_config(
            TINY,
            [
                *FAST,
                f"run.dir={tmp_path / 'run'}",
                f"data.dir={train_data}",
                f"checkpoint.init={init}",
                *LONGER_CONTEXT,
                f"train.steps={steps}",
                "checkpoint.every=1",
                "eval.every=0",
            ],
        )

    first = pretraining_trainer(config(1))
    assert first.state.step == 0 and first.engine.module.rope_cos.shape == (1024, 16)
    initial = load_hf(hf_init).state_dict()
    for name, value in first.engine.module.state_dict().items():
        assert torch.equal(value, initial[name]), name
    assert first.train()["step"] == 1
    monkeypatch.setattr(
        InitialModel, "load_model", lambda *_: pytest.fail("checkpoint.init read on a resume")
    )
    second = pretraining_trainer(config(2))
    assert second.state.step == 1 and second.train()["step"] == 2
    third = pretraining_trainer(config(3, init=tmp_path / "moved"))  # (the source gone: a note)
    assert third.state.step == 2 and third.train()["step"] == 3


def test_checkpoint_init_of_other_shapes_is_refused_in_one_line(tmp_path, hf_init, train_data, cli):
    run_dir = tmp_path / "run"
    common = ["--config", TINY, f"run.dir={run_dir}", f"data.dir={train_data}", *FAST]
    result = cli("train", *common, f"checkpoint.init={hf_init}", "model.d_model=128")
    assert_one_line_error(result, "checkpoint.init=", "model.d_model 64 → 128", "only model.max_seq_len")
    assert not run_dir.exists()
