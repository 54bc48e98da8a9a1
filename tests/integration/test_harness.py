"""`pretrain eval --tasks` end to end on the golden run's checkpoint, in this process: EleutherAI's
lm-evaluation-harness (`simple_evaluate`, which starts subprocesses to record the environment) over
two local tasks written here, a multiple-choice one and a perplexity one, evaluated once and shared."""

import contextlib
import io
import json
import math
import os
import pydoc_data.topics
import subprocess

import pytest

from pretrain.cli import main
from pretrain.data import prepare_dataset, resolve_source
from pretrain.tokenizer import Tokenizer
from tests.helpers import assert_one_line_error

pytest.importorskip("lm_eval")  # the `eval` extra (in `dev`)

TOPICS = pydoc_data.topics.topics
WINDOW = 512  # data.seq_len of the golden run
LIMIT = 4  # questions evaluated (of 8)
TASKS = "pydoc_titles,pydoc_title_generation,pydoc_perplexity"

MC_YAML = """\
task: pydoc_titles
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{passage}}}}\\nThis section is titled:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

GEN_YAML = """\
task: pydoc_title_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{passage}}}}\\nThis section is titled:"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
"""

PPL_YAML = """\
task: pydoc_perplexity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def run(*args: str) -> tuple[int, str]:
    """`pretrain ARGS...` in this process: its exit status and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(a) for a in args])
    return code, out.getvalue()


def text_of_tokens(tokenizer: Tokenizer, source: str, count: int) -> str:
    """A prefix of `source` that encodes to exactly `count` tokens, ending in no whitespace."""
    start = len(tokenizer.decode(tokenizer.encode(source)[: count + 8]))
    for end in range(start, 0, -1):
        text = source[:end]
        if not text[-1].isspace() and len(tokenizer.encode(text)) == count:
            return text
    raise AssertionError(f"no prefix of {count} tokens")


def title_questions() -> list[dict]:
    """Which pydoc section is this? The first lines of a section's body, and four section titles."""
    keys = sorted(TOPICS)[:32]
    titles = [TOPICS[k].split("\n", 1)[0] for k in keys]
    rows = []
    for i in range(8):
        choices = [titles[(i * 4 + j) % len(titles)] for j in range(4)]
        answer = i % 4
        body = TOPICS[keys[(i * 4 + answer) % len(keys)]].split("\n", 2)[2].strip()
        rows.append({"passage": body[:300], "choices": choices, "label": answer})
    return rows


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, tokenizer_dir):
    """The two task directories' files, and the perplexity task's text: 2 windows of tokens exactly."""
    directory = tmp_path_factory.mktemp("harness_tasks")
    tokenizer = Tokenizer.load(tokenizer_dir)
    text = text_of_tokens(tokenizer, TOPICS["assignment"], 2 * WINDOW)
    (directory / "titles.jsonl").write_text("".join(json.dumps(r) + "\n" for r in title_questions()))
    (directory / "text.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (directory / "pydoc_titles.yaml").write_text(MC_YAML.format(data=directory / "titles.jsonl"))
    (directory / "pydoc_title_generation.yaml").write_text(GEN_YAML.format(data=directory / "titles.jsonl"))
    (directory / "pydoc_perplexity.yaml").write_text(PPL_YAML.format(data=directory / "text.jsonl"))
    return directory, text


@contextlib.contextmanager
def stderr_of_this_process(path):
    """Everything written to stderr inside, by Python (`sys.stderr`, which pytest replaces) or by a
    subprocess (file descriptor 2), into `path`."""
    saved = os.dup(2)
    with open(path, "w", buffering=1) as sink:
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stderr(sink):
                yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, golden_run, tasks):
    """One harness run of both tasks, from a directory outside any git repository, as a user's
    run directory often is: (the printed JSON, eval_results.json, its path, what reached stderr)."""
    out = tmp_path_factory.mktemp("harness_out") / "results" / "eval_results.json"
    import datasets

    elsewhere, here = tmp_path_factory.mktemp("not_a_repository"), os.getcwd()
    cache = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = elsewhere / "datasets"  # (a first load: `datasets` has bars to show)
    os.chdir(elsewhere)
    try:
        with stderr_of_this_process(elsewhere / "stderr.txt"):
            code, stdout = run(
                "eval",
                "--checkpoint",
                golden_run,
                "--tasks",
                TASKS,
                "--include-path",
                tasks[0],
                "--limit",
                LIMIT,
                "--out",
                out,
                "--json",
            )
    finally:
        os.chdir(here)
        datasets.config.HF_DATASETS_CACHE = cache
    assert code == 0
    return json.loads(stdout), json.loads(out.read_text()), out, (elsewhere / "stderr.txt").read_text()


def test_the_harness_and_datasets_say_nothing_without_verbose(evaluated):
    """No git error (the harness asks git for the working directory's commit) and no progress
    bars of `datasets` or the harness on stderr; with --verbose they come back."""
    stderr = evaluated[3]
    assert "fatal:" not in stderr and "not a git repository" not in stderr, stderr[-2000:]
    assert "it/s]" not in stderr and "examples/s]" not in stderr, stderr[-2000:]


def test_multiple_choice_results_are_written_in_the_harness_format(evaluated, golden_run):
    printed, written, out, _ = evaluated
    assert printed["eval_results"] == str(out) and printed["results"] == written["results"]
    mc = written["results"]["pydoc_titles"]
    for metric in ("acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"):
        assert isinstance(mc[metric], float), metric
    assert mc["acc,none"] * LIMIT == pytest.approx(round(mc["acc,none"] * LIMIT))  # k of 4 right
    assert written["n-samples"]["pydoc_titles"] == {"original": 8, "effective": LIMIT}
    assert written["configs"]["pydoc_titles"]["output_type"] == "multiple_choice"
    assert set(TASKS.split(",")) == set(written["versions"]) == set(written["configs"])
    assert written["config"]["limit"] == LIMIT and written["config"]["max_length"] == WINDOW
    assert written["config"]["checkpoint"] == str(golden_run / "checkpoints" / "step_00000020")
    assert written["higher_is_better"]["pydoc_perplexity"]["bits_per_byte"] is False


def test_the_generation_task_decodes_until_its_stop_string(evaluated):
    _, written, _, _ = evaluated
    generation = written["results"]["pydoc_title_generation"]
    assert 0.0 <= generation["exact_match,none"] <= 1.0
    assert written["configs"]["pydoc_title_generation"]["generation_kwargs"]["until"] == ["\n"]


def test_the_perplexity_task_agrees_with_pretrain_eval_on_the_same_tokens(
    evaluated, tasks, tokenizer_dir, golden_run, tmp_path
):
    """The harness scores the text from an EOS prefix in windows of 512 predicted tokens; `pretrain
    eval` scores a prepared validation split holding a newline, the text and EOS, in windows of 512
    + 1 tokens. Both predict the text's 1,024 tokens with the same contexts, but for the first window's
    first token (EOS there, the newline here)."""
    _, written, _, _ = evaluated
    _, text = tasks
    tokenizer = Tokenizer.load(tokenizer_dir)
    newline = tokenizer.encode("\n")
    assert len(newline) == 1 and tokenizer.encode("\n" + text) == newline + tokenizer.encode(text)
    source = tmp_path / "corpus.jsonl"  # document 0 is trained on, document 1 held out (val_fraction 0.5)
    source.write_text(
        json.dumps({"text": TOPICS["assert"]}) + "\n" + json.dumps({"text": "\n" + text}) + "\n"
    )
    manifest = prepare_dataset(
        resolve_source(str(source)), tokenizer_dir, tmp_path / "data", val_fraction=0.5, progress=False
    )
    assert manifest["splits"]["validation"]["tokens"] == 1 + 2 * WINDOW + 1
    code, stdout = run("eval", "--checkpoint", golden_run, "--data", tmp_path / "data", "--json")
    assert code == 0
    ours = json.loads(stdout)
    assert ours["tokens"] == 2 * WINDOW
    # bits_per_byte = -sum(log P) / ln 2 / bytes over the document: back to nats per token.
    bits_per_byte = written["results"]["pydoc_perplexity"]["bits_per_byte,none"]
    harness_loss = bits_per_byte * math.log(2) * len(text.encode("utf-8")) / (2 * WINDOW)
    assert math.exp(harness_loss) == pytest.approx(ours["perplexity"], rel=0.01)
    assert written["results"]["pydoc_perplexity"]["byte_perplexity,none"] == pytest.approx(2**bits_per_byte)


def test_unknown_tasks_are_one_line_naming_them(golden_run, tasks, tmp_path, capsys):
    code = main(
        [
            "eval",
            "--checkpoint",
            str(golden_run),
            "--tasks",
            "pydoc_titles,hellaswagg",
            "--include-path",
            str(tasks[0]),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    captured = capsys.readouterr()
    assert_one_line_error(
        subprocess.CompletedProcess([], code, captured.out, captured.err), "unknown task(s) hellaswagg:"
    )
    assert "pydoc_titles" not in captured.err and not (tmp_path / "r.json").exists()
