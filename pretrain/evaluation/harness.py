"""`pretrain eval --tasks`: EleutherAI's lm-evaluation-harness on a checkpoint.

`PretrainLM` is the harness's language-model interface (`lm_eval.api.model.LM`) around our
`Transformer` and `Tokenizer` (SentencePiece or Hugging Face); `evaluate_checkpoint` runs `lm_eval.simple_evaluate`
with it and writes what that returns as the harness's own CLI does (eval_results.json).

Text is scored the way the model was trained. `prepare` packs documents as text EOS text EOS ..., so
EOS means "a document starts here":

- every scored sequence starts as a document: EOS, then the text (`Tokenizer.encode_document`); the
  rolling likelihood of a perplexity task's document uses EOS as the harness's prefix token;
- a forward sees at most `max_length` tokens, the training window (data.seq_len): longer contexts are
  cut from the left, and rolling likelihood uses the harness's disjoint windows of that size: each
  window predicts up to max_length tokens and its first prediction sees only the token before it,
  as in the windows `pretrain eval` cuts from a token stream (docs/evaluation.md compares the two);
- a run trained with data.document_masking is scored with the same document ids.

Likelihood requests (rolling windows too) are batched, longest first so that little is padded, and
right-padded (a causal model never looks right). Generation runs one request at a time with a KV
cache: our cache has no padding mask, so batching it is not simple.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pretrain import atomic
from pretrain.data.loader import document_ids
from pretrain.errors import UserError
from pretrain.evaluation.inference import Trained, load_trained, sample_token
from pretrain.model.transformer import KVCache
from pretrain.reporting.console import verbose

INSTALL_HINT = 'pip install -e ".[eval]"'
RESULTS_FILE = "eval_results.json"
MAX_GEN_TOKS = 256  # the harness's default for generation tasks that set no max_gen_toks
DEFAULT_WINDOW = 2048  # DataConfig's default seq_len

try:
    from lm_eval import utils as harness_utils
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # the optional extra is missing (or broken)
    raise UserError(
        f"`pretrain eval --tasks` needs EleutherAI's lm-evaluation-harness ({exc}): install with {INSTALL_HINT}"
    ) from None


def training_window(trained: Trained) -> int:
    """Tokens per forward: the window the model was trained on (data.seq_len), within max_seq_len;
    for a model without one (a Hugging Face model from elsewhere), its context up to DEFAULT_WINDOW."""
    limit = trained.model.cfg.max_seq_len
    seq_len = (trained.run_config.get("data") or {}).get("seq_len")
    return min(int(seq_len), limit) if seq_len else min(limit, DEFAULT_WINDOW)


@register_model("pretrain")
class PretrainLM(LM):
    """A checkpoint as the harness's LM: `simple_evaluate(model=PretrainLM(trained), ...)`, or, with
    this module imported, `simple_evaluate(model="pretrain", model_args="checkpoint=DIR")`."""

    def __init__(
        self,
        checkpoint: Trained | str | Path,
        batch_size: int | str = 8,
        device: str | None = None,
        max_batch_size: int | None = None,  # passed by the harness's loader; the batch size is fixed
    ):
        super().__init__()
        trained = checkpoint if isinstance(checkpoint, Trained) else load_trained(checkpoint)
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise UserError(f"batch size {batch_size!r} must be a positive integer")
        self.trained, self.tokenizer = trained, trained.tokenizer
        self.model = trained.model.to(device) if device else trained.model
        self._device = next(self.model.parameters()).device
        self.batch_size = int(batch_size)
        self.max_length = training_window(trained)
        masking = (trained.run_config.get("data") or {}).get("document_masking", False)
        self.masking_eos = self.tokenizer.eos_id if masking else None

    def get_model_info(self) -> dict:
        """Added to the results' "config" by the harness: which checkpoint, and how it was scored."""
        return {
            "checkpoint": str(self.trained.directory),
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(next(self.model.parameters()).dtype),
            "max_length": self.max_length,
            "prefix_token_id": self.tokenizer.eos_id,
        }

    # ----------------------------------------------------------------- likelihood

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding yields the continuation) per request."""
        results = self._score([self._encode_pair(*r.args) for r in requests], disable_tqdm)
        for request, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log P(text | document start) per request, over the harness's rolling windows."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            rolling = harness_utils.get_rolling_token_windows(
                token_list=self.tokenizer.encode(text),
                prefix_token=self.tokenizer.eos_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(harness_utils.make_disjoint_window, rolling):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows, disable_tqdm), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Ids of the context, as a new document (EOS first), and of the continuation. As in the
        harness, the context's trailing spaces move to the continuation and the continuation's ids are
        those of the whole text after the context's, so a word keeps its leading-space piece; where a
        piece would straddle the boundary, the two are encoded apart (our encodings concatenate)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + continuation)
        if whole[: len(context_ids)] == context_ids:
            continuation_ids = whole[len(context_ids) :]
        else:
            continuation_ids = self.tokenizer.encode(continuation)
        return [self.tokenizer.eos_id, *context_ids], continuation_ids

    def _score(
        self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        """`loglikelihood`'s answer for (context ids, continuation ids) pairs, batched longest first."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)  # an empty continuation: log 1
        todo = sorted(
            (i for i, (_, cont) in enumerate(pairs) if cont), key=lambda i: -sum(map(len, pairs[i]))
        )
        batches = range(0, len(todo), self.batch_size)
        for start in tqdm(
            batches, desc="loglikelihood batches", disable=disable_tqdm or not verbose(), file=sys.stderr
        ):
            batch = todo[start : start + self.batch_size]
            for index, result in zip(batch, self._score_batch([pairs[i] for i in batch]), strict=True):
                results[index] = result
        return results

    @torch.no_grad()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward: each context + continuation cut from the left to max_length + 1 tokens (the
        last is only a target), right-padded; the continuation's log-probabilities summed."""
        longest = max(len(continuation) for _, continuation in pairs)
        if longest > self.max_length:
            raise UserError(
                f"a continuation of {longest} tokens does not fit the model's window of "
                f"{self.max_length} tokens: choose tasks with shorter answers"
            )
        rows = [(context + continuation)[-(self.max_length + 1) : -1] for context, continuation in pairs]
        tokens = torch.full((len(rows), max(map(len, rows))), max(self.tokenizer.pad_id, 0), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        logits = self._logits(tokens.to(self._device))
        results = []
        for i, (row, (_, continuation)) in enumerate(zip(rows, pairs, strict=True)):
            logprobs = F.log_softmax(logits[i, len(row) - len(continuation) : len(row)].float(), dim=-1)
            target = torch.tensor(continuation, device=logprobs.device)
            greedy = bool((logprobs.argmax(-1) == target).all())
            results.append((float(logprobs.gather(-1, target[:, None]).sum()), greedy))
        return results

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.masking_eos is None:
            return self.model(tokens).logits
        return self.model(tokens, document_ids=document_ids(tokens, self.masking_eos)).logits

    # ----------------------------------------------------------------- generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each context up to the first stop string (`until`) or EOS, greedy
        unless the task asks for sampling (do_sample, temperature, top_k, top_p; other keys are ignored)."""
        outputs = []
        for request in tqdm(
            requests, desc="generate_until", disable=disable_tqdm or not verbose(), file=sys.stderr
        ):
            context, gen_kwargs = request.args
            text = self._generate(context, dict(gen_kwargs or {}))
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs

    @torch.no_grad()
    def _generate(self, context: str, kwargs: dict) -> str:
        """Decode with a KV cache inside one window: the context is cut from the left to leave room
        for max_gen_toks new tokens (but keeps at least half the window), and decoding stops when the
        window is full."""
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else [stop for stop in until if stop]
        max_new = int(kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", MAX_GEN_TOKS)))
        temperature = float(kwargs.get("temperature", 1.0)) if kwargs.get("do_sample") else 0.0
        prompt = self.tokenizer.encode_document(context)
        if self.masking_eos is not None and len(prompt) > 1:
            prompt = prompt[1:]  # with document masking a text's tokens never attended to the EOS before it
        prompt = prompt[-(self.max_length - min(max_new, self.max_length // 2)) :]
        dtype = next(self.model.parameters()).dtype
        cache = KVCache(self.model.cfg, 1, self.max_length, dtype, self._device)
        logits = self.model(torch.tensor([prompt], device=self._device), cache=cache).logits[0, -1]
        ids: list[int] = []
        while len(ids) < max_new:
            token = sample_token(logits.float(), temperature, kwargs.get("top_k"), kwargs.get("top_p"))
            if token == self.tokenizer.eos_id:
                break
            ids.append(token)
            if any(stop in self.tokenizer.decode(ids) for stop in until) or cache.length == self.max_length:
                break
            logits = self.model(torch.tensor([[token]], device=self._device), cache=cache).logits[0, -1]
        text = self.tokenizer.decode(ids)
        for stop in until:
            text = text.split(stop)[0]
        return text


# --------------------------------------------------------------------------- tasks and results


def task_manager(names: list[str], include_path: str | None):
    """The harness's TaskManager for `names`. Indexing the harness's own ~14,000 task files takes
    10 s or more, so when `include_path` defines every name as a task, only it is indexed. Unknown
    names are bad input, found before the checkpoint is loaded."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path} is not a directory")
    local_names: set[str] = set()
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_subtasks for name in names):
            return local
        local_names = set(local.all_tasks)
    candidates = [n for n in names if n not in local_names and not Path(n).is_file()]  # a YAML path is a task
    _refuse_unknown(absent_from_builtin_tasks(candidates), include_path)
    manager = TaskManager(include_path=include_path)
    _refuse_unknown([n for n in candidates if n not in manager.all_tasks], include_path)
    return manager


def absent_from_builtin_tasks(names: list[str]) -> list[str]:
    """Those of `names` that no YAML file of the harness's task directory mentions, so that are no
    task, group or tag of it (names are literal in those files): a text scan, far quicker than its index."""
    import lm_eval.tasks

    left = set(names)
    for path in Path(lm_eval.tasks.__file__).parent.rglob("*.yaml"):
        if not left:
            break
        text = path.read_text(encoding="utf-8", errors="ignore")
        left = {name for name in left if name not in text}
    return [name for name in names if name in left]


def _refuse_unknown(unknown: list[str], include_path: str | None) -> None:
    if unknown:
        where = f"the harness's tasks or {include_path}" if include_path else "the harness's tasks"
        raise UserError(
            f"unknown task(s) {', '.join(unknown)}: not among {where} "
            "(tasks of your own: --include-path DIR with their YAML files)"
        )


def parse_tasks(spec: str) -> list[str]:
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise UserError(f"--tasks {spec!r} names no task: give names separated by commas")
    return names


def results_path(out: str | Path | None, checkpoint_dir: Path) -> Path:
    """Where eval_results.json goes: `out` (a file, or a directory: existing, or ending in "/"), by
    default the current directory; never inside the checkpoint, whose files are checked against its
    manifest."""
    path = Path(out) if out is not None else Path(RESULTS_FILE)
    if path.is_dir() or str(out).endswith(("/", os.sep)):
        path = path / RESULTS_FILE
    if path.resolve().is_relative_to(checkpoint_dir.resolve()):
        raise UserError(
            f"--out {path} is inside the checkpoint {checkpoint_dir}: write the results elsewhere "
            "(a checkpoint's files are checked against its manifest)"
        )
    return path


def write_results(results: dict, path: Path) -> None:
    """As the harness's CLI writes them: numpy scalars and sets made plain, other objects as strings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=harness_utils.handle_non_serializable, ensure_ascii=False)
    atomic.write_text(path, text + "\n")


def evaluate_checkpoint(
    checkpoint: str | Path,
    tasks: str,
    include_path: str | None = None,
    limit: float | None = None,
    batch_size: int = 8,
    out: str | Path | None = None,
) -> tuple[dict, Path]:
    """`pretrain eval --tasks`: the harness's results for a checkpoint (or a Hugging Face directory
    `load_trained` reads), written to eval_results.json; returns them and the file's path."""
    from lm_eval import simple_evaluate

    names = parse_tasks(tasks)
    if limit is not None and limit <= 0:
        raise UserError(f"--limit {limit} must be positive (a count, or a fraction below 1)")
    manager = task_manager(names, include_path)
    trained = load_trained(checkpoint)
    path = results_path(out, trained.directory)
    model = PretrainLM(trained, batch_size)
    with contextlib.redirect_stdout(sys.stderr), quiet_harness():  # (what the harness prints: stderr)
        try:
            results = simple_evaluate(
                model=model,
                tasks=names,
                task_manager=manager,
                limit=limit,
                batch_size=batch_size,
                log_samples=False,
            )
        except (FileNotFoundError, ConnectionError) as exc:  # a task's data files, or the Hub, out of reach
            raise UserError(f"a task's data could not be loaded: {exc}".replace("\n", " ")) from None
    write_results(results, path)
    return results, path


@contextlib.contextmanager
def quiet_harness() -> Iterator[None]:
    """The harness's and `datasets`' chatter held back unless --verbose: progress bars (`datasets`
    loading each task's split, the harness building each task's requests; ours, scoring them), and
    the "fatal: not a git repository" that git prints when the harness records the working
    directory's commit outside a repository."""
    if verbose():
        yield
        return
    import datasets
    from lm_eval import evaluator
    from lm_eval.api import task as harness_task

    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    kept = evaluator.get_git_commit_hash, harness_task.tqdm
    evaluator.get_git_commit_hash = _git_commit_quietly
    harness_task.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        evaluator.get_git_commit_hash, harness_task.tqdm = kept
        if bars:
            datasets.enable_progress_bars()


def _git_commit_quietly() -> str | None:
    """The harness's `git_hash` of its results, as it finds it (`git describe --always`, else the
    repository files of the working directory), without git's error on stderr."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        found = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        found = None
    if found is not None and found.returncode == 0 and found.stdout.strip():
        return found.stdout.strip()
    return get_commit_from_path(os.getcwd())
