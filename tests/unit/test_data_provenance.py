"""A two-corpus mixture with document masking, in this process: a spike is rolled back, its event
names the documents behind it (their text really is in the corpus), `pretrain data inspect` shows
them, the quarantine keeps the spike's windows out for the rest of their epoch while every other
window is served, and the evaluation reports each corpus and samples the model's writing (read back
with EventAccumulator)."""

import json
import pydoc_data.topics
import threading
from pathlib import Path

import pytest

from monitoring.protocol import read_events
from monitoring.service import serve
from pretrain.config import MonitorConfig, load_config
from pretrain.data import MixtureStream, prepare_dataset, resolve_source
from tests.helpers import FAST, TINY
from tests.unit.fakes import pretraining_trainer

TOPICS = pydoc_data.topics.topics
CORPORA = {"prose": sorted(TOPICS)[:12], "reference": sorted(TOPICS)[12:20]}  # half of each held out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tokenizer_dir):
    out = {}
    for name, keys in CORPORA.items():
        directory = tmp_path_factory.mktemp(name)
        source = directory / f"{name}.jsonl"
        source.write_text("".join(json.dumps({"text": TOPICS[k]}) + "\n" for k in keys))
        prepare_dataset(
            resolve_source(str(source)), tokenizer_dir, directory / "data", val_fraction=0.5, progress=False
        )
        out[name] = directory / "data"
    return out


@pytest.fixture(scope="module")
def spiked_run(tmp_path_factory, corpora):
    run_dir = tmp_path_factory.mktemp("mixture_run")
    server, _ = serve(run_dir, MonitorConfig(warmup=4, window=16))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    mixture = ",".join(f"{{name: {n}, dir: '{d}', weight: 0.5}}" for n, d in corpora.items())
    cfg = load_config(
        TINY,
        [
            *FAST,
            f"run.dir={run_dir}",
            f"data.mixture=[{mixture}]",
            "data.document_masking=true",
            "monitor.enabled=true",
            "monitor.quarantine=true",
            "train.steps=34",
            "checkpoint.every=3",
            "eval.every=17",
            "faults.spike_steps=[8]",
            "eval.sample_prompts=['The list', 'for x in']",
            "eval.sample_tokens=6",
        ],
    )
    trainer = pretraining_trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        server.shutdown()
        server.server_close()
    return run_dir, cfg, summary, trainer.engine.module


def surviving_windows(run_dir) -> list[int]:
    """The windows of the timeline that survived, in the order trained (a step trained again after
    the rollback replaces its first try)."""
    by_step = {}
    for line in (run_dir / "data_trace" / "rank_00000.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["windows"]
    return [w for step in sorted(by_step) for w in by_step[step]]


def test_the_rollback_event_names_the_spike_documents_and_inspect_shows_their_text(spiked_run, cli):
    run_dir, _, summary, _ = spiked_run
    assert summary["completed"] and summary["rollbacks"] == 1
    (applied,) = [e for e in read_events(run_dir) if e.type == "rollback_applied"]
    assert applied.decided_at == 8 and len(applied.windows) == 2
    result = cli("data", "inspect", "--run-dir", str(run_dir), "--step", "8", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    first, again = report["attempts"]  # the spike's try, then the re-run on the reshuffled data
    assert [w["window"] for w in first["windows"]] == applied.windows and first["windows"] != again["windows"]
    named = set()
    for window in first["windows"]:
        texts = []
        for doc in window["documents"]:
            lines = Path(doc["origin"]).read_text().splitlines()
            texts.append(json.loads(lines[doc["record"]])["text"])  # the record, from the corpus file
            named.add((window["source"], doc["origin"], doc["record"]))
        assert window["source"] in CORPORA and len(window["text"]) > 40
        assert window["text"][:40] in "".join(texts)  # the window's text is its documents' text
    assert named == {(d["source"], d["origin"], d["record"]) for d in applied.documents}
    human = cli("data", "inspect", "--run-dir", str(run_dir), "--step", "8")
    assert "attempt 2 of 2" in human.stdout and "record" in human.stdout and "text: " in human.stdout
    bad = cli("data", "inspect", "--run-dir", str(run_dir), "--step", "999")
    assert bad.returncode == 2 and "not in the data trace" in bad.stderr


def test_quarantined_windows_are_not_served_again_in_their_epoch_and_every_other_one_is(spiked_run, corpora):
    run_dir, cfg, _, _ = spiked_run
    (entry,) = [json.loads(line) for line in (run_dir / "quarantine.jsonl").read_text().splitlines()]
    assert entry["step"] == 8 and len(entry["windows"]) == 2 and entry["documents"]
    stream = MixtureStream(cfg.data.sources(), cfg.data.seq_len)
    trained = surviving_windows(run_dir)
    quarantined = {(w, e) for w, e in entry["windows"]}
    for source, windows in enumerate(stream.streams):
        first = int(stream.offsets[source])
        mine = [w for w in trained if stream.locate(w)[0] == source]
        # Walk the epochs: the quarantined epoch serves every window but the set-aside ones, once.
        position, epoch = 0, 0
        while position < len(mine):
            held = {w for w, e in quarantined if e == epoch and stream.locate(w)[0] == source}
            size = windows.num_windows - len(held)
            served = mine[position : position + size]
            if len(served) < size:
                break  # the run ended inside this epoch
            assert sorted(served) == sorted(set(range(first, first + windows.num_windows)) - held)
            position, epoch = position + size, epoch + 1
        assert epoch >= 1, f"the run served a whole epoch of {stream.names[source]}"


def test_evaluation_reports_each_corpus_and_tokens_per_corpus(spiked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.reporting.metrics import tensorboard_dir

    run_dir, _, summary, _ = spiked_run
    board = EventAccumulator(str(tensorboard_dir(run_dir)), size_guidance={"scalars": 0})
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {
        "eval/loss",
        "eval/loss/prose",
        "eval/loss/reference",
        "train/tokens/prose",
        "train/tokens/reference",
    } <= tags
    for name in CORPORA:
        losses = [e.value for e in board.Scalars(f"eval/loss/{name}")]
        assert [e.step for e in board.Scalars(f"eval/loss/{name}")] == [0, 17, 34]
        assert losses[-1] < losses[0] - 0.3  # the loss falls on both corpora
    last = summary["eval"][-1]
    assert last["loss"] == pytest.approx(0.5 * last["loss/prose"] + 0.5 * last["loss/reference"])
    tokens = {name: board.Scalars(f"train/tokens/{name}")[-1].value for name in CORPORA}
    assert sum(tokens.values()) == 34 * 2 * 512 and abs(tokens["prose"] - tokens["reference"]) <= 512


def test_each_evaluation_samples_the_prompts_into_the_text_tab(spiked_run):
    """The samples are what `pretrain generate` (greedy) writes with the trained weights."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pretrain.evaluation.inference import generate
    from pretrain.reporting.metrics import literal_markdown, tensorboard_dir
    from pretrain.tokenizer import Tokenizer

    run_dir, cfg, _, model = spiked_run
    board = EventAccumulator(str(tensorboard_dir(run_dir)), size_guidance={"tensors": 0})
    board.Reload()
    tok = Tokenizer.load(run_dir / "checkpoints" / "step_00000034")
    for index, prompt in enumerate(cfg.eval.sample_prompts):
        texts = {
            e.step: e.tensor_proto.string_val[0].decode()
            for e in board.Tensors(f"samples/{index}/text_summary")
        }
        assert sorted(texts) == [0, 17, 34]
        ids = generate(model.eval(), tok.encode_document(prompt), 6, temperature=0.0, stop_id=tok.eos_id)
        assert texts[34] == f"**{literal_markdown(prompt)}**{literal_markdown(tok.decode(ids))}"
        assert texts[0] != texts[34]  # the model learnt something to write in between


def test_inspect_says_first_that_the_spike_was_injected(spiked_run, cli):
    run_dir, _, _, _ = spiked_run
    human = cli("data", "inspect", "--run-dir", str(run_dir), "--step", "8")
    assert human.returncode == 0, human.stderr
    assert human.stdout.splitlines()[0] == (
        "step 8: the loss spike was injected (faults.spike_steps, the loss × 50, in the first attempt): "
        "the documents below are not its cause"
    )
    report = json.loads(cli("data", "inspect", "--run-dir", str(run_dir), "--step", "8", "--json").stdout)
    assert [f["fault"] for f in report["injected"]] == ["spike"]
    clean = cli("data", "inspect", "--run-dir", str(run_dir), "--step", "9")
    assert clean.returncode == 0 and "injected" not in clean.stdout
