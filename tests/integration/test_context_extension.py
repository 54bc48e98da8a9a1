"""Context extension as docs/training.md's Long context does it: the golden run's checkpoint,
trained on 512-token windows, continued on 1,024-token windows with Llama 3.1's rope scaling by a
one-process job that loads its weights only (`checkpoint.init`), then exported and read by
`transformers` with our logits past position 512."""

import json
import math

import torch

from pretrain.evaluation.inference import export_trained, load_trained
from tests.helpers import LONGER_CONTEXT
from tests.integration.runs import metrics, torchrun, train, train_state


def test_the_golden_checkpoint_continues_at_twice_the_context_and_exports(tmp_path, golden_run, train_data):
    run_dir = tmp_path / "long"
    result = train(
        torchrun(1),
        run_dir,
        train_data,
        f"checkpoint.init={golden_run}",
        *LONGER_CONTEXT,
        "train.steps=2",
        "schedule.warmup_steps=2",
        "checkpoint.every=2",
        "eval.every=0",
    )
    assert "steps 1..2 (weights from checkpoint" in result.stdout, result.stdout[-2000:]
    golden, longer = metrics(golden_run), metrics(run_dir)
    # the trained weights, not a fresh model: its first loss is near the golden run's last, far
    # below the uniform guess the golden run started from (ln 512 = 6.24)
    assert golden[1]["train/loss"] > math.log(512) - 0.3
    assert longer[1]["train/loss"] < golden[20]["train/loss"] + 0.3, (longer[1], golden[20])
    # a new schedule from its warm-up, from step 1, at the longer windows
    assert longer[1]["train/lr"] < longer[2]["train/lr"]
    assert longer[1]["train/tokens"] == 2 * 1024
    state = train_state(run_dir, 2)
    assert state["step"] == 2 and state["data"]["consumed"] == 2 * 2

    trained = load_trained(run_dir)  # (what `pretrain export-hf` does)
    out = export_trained(trained, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 1024
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 2.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    import transformers

    theirs = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    ours = trained.model
    tokens = torch.randint(0, 512, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(tokens).logits[:, 512:], theirs(tokens).logits[:, 512:]  # past the original length
    assert (a - b).abs().max().item() <= 1e-4
