"""Weights & Biases for `MetricsWriter` (extra `[wandb]`, `logging.wandb`): the scalars and text that
go to TensorBoard, under the same tags, in one W&B run per run directory.

Steps: W&B's own step (`_step`) may only increase, but the trainer logs steps again (a monitor
rollback runs again the steps after its checkpoint; so does a resumed job). So nothing is logged
at a W&B step: every row carries the training step as `train/step`, every metric is charted
against it (`define_metric("*", step_metric="train/step")`), and `_step` only counts rows. A step
run again is a second point at the same `train/step`, as on TensorBoard; nothing is dropped.

Resume: the run's W&B id is kept in RUN_DIR/wandb/run_id (written before the first start), so
every later start of the job continues the same W&B run (`resume="allow"`); `--fresh` moves the
file aside with the rest of the run, and the next start is a new W&B run.
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
from pathlib import Path

from pretrain import atomic
from pretrain.errors import ConfigError

STEP_METRIC = "train/step"
RUN_ID_FILE = Path("wandb") / "run_id"  # in the run directory, beside W&B's own files
ALERTS = {"monitor/rollbacks": "rollback"}  # text tags that also raise a W&B alert: tag → title
NATIVE = ("config",)  # text tags W&B holds natively (the run's config), not logged again as text


def check_available(cfg) -> None:
    """At startup: a W&B project without the package is bad input, said in one line."""
    if cfg is not None and cfg.project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb.project={cfg.project!r} needs the wandb package, which is not installed: "
            f'pip install -e ".[wandb]" (or set logging.wandb.project=null)'
        )


class WandbSink:
    """One W&B run for the run directory, started by rank 0's writer. A W&B failure (at the start
    or later) is one warning line on stderr and the end of W&B logging: training goes on."""

    def __init__(self, cfg, run_dir: str | Path, run_config: dict | None, say=print):
        self._run = None
        self._texts: dict[str, list[list]] = {}  # tag → its [step, text] rows so far (this process)
        run_dir = Path(run_dir)
        try:
            self._run = start_run(cfg, run_dir, run_config)
        except Exception as exc:  # (see _guarded)
            self._give_up("starting the run", exc)
            return
        if cfg.mode == "online":
            say(f"W&B: {self._run.url}")
        elif cfg.mode == "offline":
            say(
                f"W&B: offline run {self._run.id} in {self._run.settings.sync_dir} "
                f"(upload with `wandb sync {run_dir / 'wandb'}`)"
            )

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        row = {tag: value for tag, value in values.items() if value is not None}
        if row:
            self._guarded("logging", lambda: self._run.log(row | {STEP_METRIC: step}))

    def text(self, tag: str, text: str, step: int) -> None:
        """A table per tag, logged again with every new row (W&B shows a table's latest version);
        a rollback's text is also an alert."""
        if tag in NATIVE:
            return
        self._guarded("logging text", lambda: self._log_text(tag, text, step))
        if tag in ALERTS:
            title = f"{ALERTS[tag]} at step {step}"  # one title per step: W&B holds back repeats of a title
            self._guarded("raising an alert", lambda: self._run.alert(title=title, text=text, level="WARN"))

    def _log_text(self, tag: str, text: str, step: int) -> None:
        import wandb

        rows = self._texts.setdefault(tag, [])
        rows.append([step, text])
        self._run.log({tag: wandb.Table(columns=["step", "text"], data=[*rows]), STEP_METRIC: step})

    def close(self) -> None:
        self._guarded("finishing the run", lambda: self._run.finish())
        self._run = None

    def _guarded(self, what: str, call) -> None:
        if self._run is None:
            return
        try:
            call()
        except Exception as exc:  # W&B's errors differ between versions, and none may stop training
            self._give_up(what, exc)

    def _give_up(self, what: str, exc: Exception) -> None:
        self._run = None
        print(
            f"W&B: {what} failed ({type(exc).__name__}: {exc}); training goes on without W&B",
            file=sys.stderr,
            flush=True,
        )


def start_run(cfg, run_dir: Path, run_config: dict | None):
    """The run directory's W&B run: resumed when its id has a run, else started; every metric
    charted against `train/step`."""
    import wandb

    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name or run_dir.resolve().name,
        id=run_id(run_dir),
        resume="allow",
        mode=cfg.mode,
        dir=str(run_dir),
        config=run_config,
        # No banner or hints, and our console output stays ours (not captured into the run).
        settings=wandb.Settings(silent=True, console="off"),
    )
    run.define_metric(STEP_METRIC)
    run.define_metric("*", step_metric=STEP_METRIC)
    return run


def run_id(run_dir: Path) -> str:
    """The run directory's W&B id: the one recorded, else a new one, recorded before W&B starts."""
    path = run_dir / RUN_ID_FILE
    try:
        recorded = path.read_text().strip()
    except OSError:
        recorded = ""
    if recorded:
        return recorded
    new = secrets.token_hex(6)  # (W&B's ids are letters, digits, - and _)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(path, new + "\n")
    return new
