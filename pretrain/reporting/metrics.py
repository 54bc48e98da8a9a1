"""What rank 0 reports: TensorBoard scalars and text under stable tags, a console line, and
RUN_DIR/metrics.jsonl (every step's metrics at full precision, appended across restarts).

TensorBoard tags (in RUN_DIR/tensorboard/<the run directory's name>/: TensorBoard names a run after
the directory holding its event files, so `--logdir RUN_DIR/tensorboard` shows this run by name and
`--logdir runs/` tells runs apart):
    train/loss  train/lr  train/grad_norm  train/tokens_per_sec  train/tokens_per_sec_per_device
    train/mfu (where a peak is known)  train/step_time  train/memory_gb  train/skipped_steps
    train/tokens  train/grad_norm/<group> (embeddings, layers.N, head; every
    logging.layer_grad_norms_every steps)  eval/loss  eval/perplexity  config (text)
    with the monitor, at every step it judged: monitor/loss  monitor/grad_norm (the values judged)
    monitor/warning  monitor/rollback (1 at a step that warned / was rolled back, else 0)
    and, the three together, at the steps a series (loss, grad_norm) has a band (not in the warm-up):
    monitor/<series>_in_band (the value judged)  monitor/<series>_level  monitor/<series>_threshold
    (TensorBoard's Margin chart refuses value, lower and upper tags whose steps differ)
    monitor/rollbacks (text)
    with experts (model.moe; pretrain/train/moe_hook.py): moe/load_max  moe/load_min  moe/top_share
    moe/aux_loss  moe/load_max/layer_N (every step)  moe/loads/layer_N (a histogram, logged steps)

With logging.wandb.project set, the same scalars and text (but the config, which is the run's W&B
config) also go to Weights & Biases (pretrain/reporting/wandb_sink.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pretrain.reporting.wandb_sink import WandbSink, check_available

METRICS_FILE = "metrics.jsonl"  # RUN_DIR/metrics.jsonl: one JSON object per logged step


def read_metrics(run_dir: str | Path) -> list[dict]:
    """RUN_DIR/metrics.jsonl, a dict per logged step in the order written (empty: no such file).
    A step re-run after a rollback or restart appears again, where it was re-run."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# The monitor's TensorBoard tags, named here once: the verdict marks (1 at a judged step that was
# warned about or rolled back, else 0), and each judged series' value, level and threshold.
MARK_TAGS = ("monitor/rollback", "monitor/warning")


def band_tags(series: str) -> tuple[str, str, str]:
    """The Margin chart's tags of a judged series: its value, its band's level and threshold."""
    return f"monitor/{series}_in_band", f"monitor/{series}_level", f"monitor/{series}_threshold"


class MetricsWriter:
    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        enabled: bool,
        tensorboard: bool = True,
        wandb=None,  # WandbConfig: also log to Weights & Biases while its project is set
        run_config: dict | None = None,  # the run's config, for W&B
    ):
        if enabled:
            check_available(wandb)  # (before anything is opened)
        self.enabled = enabled
        self.total_steps = total_steps
        self.writer = None
        self.wandb: WandbSink | None = None
        self._start_time: float | None = None
        self._start_step = 0
        self._jsonl = open(Path(run_dir) / METRICS_FILE, "a") if enabled else None  # noqa: SIM115
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tensorboard_dir(run_dir)))
        if enabled and wandb is not None and wandb.project:
            self.wandb = WandbSink(wandb, run_dir, run_config, say=self.message)

    def record(self, step: int, values: dict[str, float]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
            self._jsonl.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                if value is not None:
                    self.writer.add_scalar(tag, value, step)
        if self.wandb is not None:
            self.wandb.scalars(step, values)

    def band_layout(self) -> None:
        """TensorBoard 'Custom Scalars': each series the monitor judged inside its band, from the
        robust level to the threshold (a Margin chart, whose tags are exact names and must share
        their steps: `_in_band`, not the every-step value, which the warm-up has no band for), and
        its marks at every judged step (a Multiline chart, whose tags are regular expressions: anchored)."""
        if self.writer is not None:
            self.writer.add_custom_scalars(
                {
                    "monitor": {
                        "gradient norm in its band (level .. threshold)": [
                            "Margin",
                            list(band_tags("grad_norm")),
                        ],
                        "loss in its band (level .. threshold)": ["Margin", list(band_tags("loss"))],
                        "rollbacks and warnings (1 at the step judged)": [
                            "Multiline",
                            [f"^{t}$" for t in MARK_TAGS],
                        ],
                    }
                }
            )

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, step)
        if self.wandb is not None:
            self.wandb.text(tag, text, step)

    def histogram(self, tag: str, values, step: int) -> None:
        """A TensorBoard histogram of `values` (a 1-D tensor)."""
        if self.writer is not None:
            self.writer.add_histogram(tag, values, step)

    def image(self, tag: str, image, step: int) -> None:
        """An RGB image, (height, width, 3)."""
        if self.writer is not None:
            self.writer.add_image(tag, image, step, dataformats="HWC")

    def console(self, step: int, values: dict[str, float]) -> None:
        """One line per logging step: step, loss, tokens/s and ETA (rank 0 only)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start_time is None:  # the first line: this step's time (the only one measured yet)
            self._start_time, self._start_step = now, step
            seconds_per_step = values.get("train/step_time") or 0.0
        else:  # then the mean since the first line (a long-run rate, without start-up costs)
            seconds_per_step = (now - self._start_time) / max(step - self._start_step, 1)
        eta = seconds_per_step * (self.total_steps - step)
        parts = [
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}",
            f"loss {values['train/loss']:.4f}",
        ]
        if values.get("train/lr") is not None:
            parts.append(f"lr {values['train/lr']:.2e}")
        if values.get("train/grad_norm") is not None:
            parts.append(f"gnorm {values['train/grad_norm']:.3f}")
        parts.append(f"{values['train/tokens_per_sec']:,.0f} tok/s")
        if values.get("train/mfu") is not None:
            parts.append(f"mfu {100 * values['train/mfu']:.1f}%")
        parts.append(f"eta {_duration(eta)}")
        print(" | ".join(parts), flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stdout, flush=True)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def tensorboard_dir(run_dir: str | Path) -> Path:
    """Where a run's event files go (what TensorBoard's readers, such as EventAccumulator, need):
    RUN_DIR/tensorboard/<the run directory's name>, the name TensorBoard shows for the run. A run
    started before this layout keeps its older event files in RUN_DIR/tensorboard itself (TensorBoard
    then shows them as a second run, ".")."""
    return Path(run_dir) / "tensorboard" / (Path(run_dir).resolve().name or "run")


def literal_markdown(text: str) -> str:
    """Text as TensorBoard's text tab (markdown) shows it literally: markdown characters escaped,
    line breaks kept."""
    escaped = "".join("\\" + c if c in MARKDOWN_CHARACTERS else c for c in text)
    return escaped.replace("\n", "  \n")


MARKDOWN_CHARACTERS = frozenset("\\`*_{}[]()#+-.!|<>")


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
