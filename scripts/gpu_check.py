"""The GPU check: what a lent GPU machine must measure, as parts with their own time budgets.

Started by scripts/gpu_check.sh (which installs what the machine lacks first); docs/gpu.md says
how to run it and what each output holds. Each part runs as its own process group and is stopped
when its budget, or the whole check's, runs out; the check then goes on with the next part, so a
broken part costs its minutes, not the call. `--cpu` runs the same parts on a CPU with the tiny
config (no kernels, no wheels): the integration tier runs that, so the script cannot rot.

Files written to OUT (at most 8: what the device tool brings back):
    summary.json      versions, and every part's status, seconds and headline figures
    gpu_check.log     every command, its output and its end, in order
    bench-MODEL.json  `pretrain bench train --json` of each model, as printed
    launch.json       the supervised run: the spike's rollback, the kill's restart, the resume
    profile.json      `pretrain bench profile --json` of each profiled model
    variants.json     the step's variants (`--parts variants`): each one's figures, and the one chosen
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

PYTHON = sys.executable
PRETRAIN = [PYTHON, "-m", "pretrain"]
MINIMUM = 10.0  # seconds: a part with less time left than this is skipped,
START_SHARE = 0.5  # and so is a part with less than this share of its own budget left


@dataclass(frozen=True)
class Drill:
    """The supervised run: a spike (rolled back), a kill (restarted), then the same command with
    more steps (resumed)."""

    config: str
    overrides: str  # space-separated KEY=VALUE
    steps: int
    checkpoint_every: int
    spike_step: int
    kill_step: int
    more_steps: int  # the resume trains this many more
    vocab_size: int
    workers: int


@dataclass(frozen=True)
class Mode:
    name: str
    budget: float  # seconds for the whole check, from the shell script's start
    budgets: dict[str, float]  # per part
    order: tuple[str, ...]  # the parts, most needed first: what does not fit is skipped
    pytest: str  # extra pytest arguments
    bench: dict[str, str]  # config → arguments of `pretrain bench train`
    profile: dict[str, str]  # config → arguments of `pretrain bench profile`
    drill: Drill
    variants: str  # the `bench train` arguments every variant shares (the part `variants`)
    variant_batches: dict[str, tuple[int, int]]  # config → (its micro-batch, the larger one)
    variant_timeout: float  # seconds for each variant's process
    on_request: tuple[str, ...] = ("variants",)  # parts run only when --parts names them
    # Where set (a CPU, shared with whatever else runs there): the seconds each part takes on a
    # machine as fast as the one measured; a part's budget is then its own times the slowdown
    # measured so far (`Check.slowdown`), so that a busy or slow machine stretches every budget and
    # a hang is still stopped.
    expected: dict[str, float] | None = None


GPU = Mode(
    name="gpu",
    budget=530.0,
    budgets={
        "versions": 30,
        "fused_adam": 150,
        "pytest": 200,
        "launch": 300,
        "bench gpt3-125m": 120,
        "bench gpt3-1.3b": 150,
        "profile": 150,
        "bench gpt3-350m": 120,
        "variants": 440,
    },
    order=(
        "versions",
        "fused_adam",
        "pytest",
        "launch",
        "bench gpt3-125m",
        "bench gpt3-1.3b",
        "profile",
        "bench gpt3-350m",
    ),
    pytest="",
    bench={
        model: f"--seq-len 2048 --micro-batch-size {batch} --zero-stage 1 --compile --steps 10 --warmup 3"
        for model, batch in (("gpt3-125m", 16), ("gpt3-350m", 8), ("gpt3-1.3b", 4))
    },
    profile={
        model: f"--seq-len 2048 --micro-batch-size {batch} --compile --steps 3 --warmup 3"
        for model, batch in (("gpt3-125m", 16), ("gpt3-1.3b", 4))
    },
    drill=Drill(
        config="gpt3-125m",
        overrides="train.micro_batch_size=16 schedule.warmup_steps=10 eval.every=50 eval.batches=1 "
        "eval.attention_probe=null logging.every=10 logging.layer_grad_norms_every=10 "
        "monitor.warmup=20 monitor.window=64",
        steps=100,
        checkpoint_every=20,
        spike_step=50,
        kill_step=75,
        more_steps=20,
        vocab_size=8192,
        workers=8,
    ),
    variants="--seq-len 2048 --zero-stage 1 --compile --steps 10 --warmup 2",
    # the micro-batch of the first H200 run, and the largest `pretrain plan` fits in 80 GB
    variant_batches={"gpt3-125m": (16, 64), "gpt3-1.3b": (4, 8)},
    variant_timeout=150.0,
)

# On a CPU the check is a test of the script (tests/integration/test_gpu_check.py) on a machine
# that other work slows down by a factor that changes as it runs (2 cores and a suite's workers:
# 3-8 times here). `expected` is what each part took in CI's suite run (an AMD EPYC of 2 cores,
# bf16 without kernels, loaded), bench tiny rounded up from its 36 s here as it is now, with the
# launch 3.3 times CI's; the budgets are 5 times that, stretched by the slowdown measured so far.
CPU_EXPECTED = {"versions": 6, "fused_adam": 1, "pytest": 9, "launch": 91, "bench tiny": 30, "profile": 10}
CPU = Mode(
    name="cpu",
    budget=1800.0,
    budgets={part: max(60.0, 5 * seconds) for part, seconds in CPU_EXPECTED.items()}
    # on request only (not in `order`, so never stretched by the parts before it): three processes
    # of ~15 s of CPU each, 146 s in all at load 17 on 2 cores
    | {"variants": 360.0},
    expected=CPU_EXPECTED,
    order=("versions", "fused_adam", "pytest", "launch", "bench tiny", "profile"),
    # the GPU tier's file only: collecting the whole suite to deselect it costs the check (itself a
    # test of the suite) about 5 s, and on a CPU every GPU test skips anyway
    pytest="-n 0 tests/integration/test_gpu.py",
    # (a bf16 step of the tiny model at 128 x 2 tokens takes 4-5 s on that CPU: 64 x 1 is enough)
    bench={"tiny": "--seq-len 64 --micro-batch-size 1 --no-compile --steps 1 --warmup 0"},
    profile={"tiny": "--seq-len 128 --micro-batch-size 2 --no-compile --steps 1 --warmup 1"},
    drill=Drill(
        config="tiny",
        overrides="model.n_layers=2 model.d_model=64 train.micro_batch_size=2 optim.lr=3e-3 "
        "schedule.warmup_steps=2 eval.every=12 eval.batches=1 eval.attention_probe=null "
        "logging.every=1 monitor.warmup=4 monitor.window=16",
        steps=12,
        checkpoint_every=4,
        spike_step=9,
        kill_step=11,
        more_steps=2,
        vocab_size=512,
        workers=2,
    ),
    variants="--seq-len 64 --no-compile --steps 1 --warmup 0",
    variant_batches={"tiny": (1, 2)},
    variant_timeout=150.0,
)


@dataclass
class Finished:
    returncode: int | None  # None: stopped at its budget
    stdout: str
    seconds: float


@dataclass
class Check:
    mode: Mode
    out: Path
    work: Path
    started: float
    log_file: object = None
    summary: dict = field(default_factory=dict)
    part_started: float = 0.0

    def __post_init__(self) -> None:
        self.summary = {
            "mode": self.mode.name,
            "budget_s": self.mode.budget,
            "work": str(self.work),
            "parts": [],
        }

    def remaining(self) -> float:
        return self.mode.budget - (time.time() - self.started)

    def slowdown(self) -> float:
        """How much slower than `mode.expected` the finished parts ran, the most of them (1 at
        least, and 1 without `expected`): a part stopped at its budget counts too, as slow as that."""
        expected = self.mode.expected or {}
        ratios = [
            p["seconds"] / expected[p["name"]] for p in self.summary["parts"] if expected.get(p["name"])
        ]
        return max([1.0, *ratios])

    def budget_of(self, name: str) -> float:
        """The part's own budget, stretched by the slowdown where the mode expects seconds."""
        return self.mode.budgets[name] * (self.slowdown() if self.mode.expected else 1.0)

    def log(self, text: str) -> None:
        self.log_file.write(text if text.endswith("\n") else text + "\n")
        self.log_file.flush()

    def run(self, command: list[str], budget: float, env: dict | None = None) -> Finished:
        """`command` in its own process group, stderr to the log, stdout kept (and logged); stopped
        (SIGTERM, then SIGKILL) when `budget` seconds have passed."""
        self.log(f"$ {' '.join(command)}")
        started = time.time()
        env = {k: v for k, v in (env or os.environ).items() if k not in RENDEZVOUS}  # each part its own
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=self.log_file,
            text=True,
            start_new_session=True,
            env=env,
            cwd=repo_path(),
        )
        try:
            stdout, _ = process.communicate(timeout=max(budget, 1.0))
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            stop_group(process)
            stdout, _ = process.communicate()
            returncode = None
            self.log(f"(stopped after {budget:.0f} s)")
        self.log(stdout)
        return Finished(returncode, stdout, time.time() - started)

    def write_json(self, name: str, value) -> None:
        path = self.out / name
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(value, indent=1) + "\n")
        temporary.replace(path)


RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class PartFailed(Exception):
    """A part's own verdict: what went wrong, in one line."""


def failed_command(finished: Finished, what: str) -> PartFailed:
    if finished.returncode is None:
        return PartFailed(f"{what}: stopped at its time budget")
    return PartFailed(f"{what}: exit status {finished.returncode} (gpu_check.log)")


# --------------------------------------------------------------------------- the parts


def versions(check: Check, budget: float) -> dict:
    probe = (
        "import json, platform, torch\n"
        "found = {'python': platform.python_version(), 'torch': torch.__version__,\n"
        "         'cuda': torch.version.cuda, 'gpus': torch.cuda.device_count(),\n"
        "         'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}\n"
        "for name in ('deepspeed', 'transformers', 'triton'):\n"
        "    try:\n"
        "        found[name] = __import__(name).__version__\n"
        "    except ImportError:\n"
        "        found[name] = None\n"
        "print(json.dumps(found))\n"
    )
    finished = check.run([PYTHON, "-c", probe], budget)
    if finished.returncode != 0:
        raise failed_command(finished, "the version probe")
    found = json.loads(finished.stdout.strip().splitlines()[-1])
    found["driver"] = None
    if check.mode.name == "gpu":
        smi = check.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], 15
        )
        if smi.returncode == 0 and smi.stdout.strip():
            name, driver, memory = (s.strip() for s in smi.stdout.strip().splitlines()[0].split(",")[:3])
            found |= {"driver": driver, "gpu_memory": memory, "gpu": name}
    check.summary["versions"] = found
    return {"line": ", ".join(f"{k} {v}" for k, v in found.items() if v is not None)}


def fused_adam(check: Check, budget: float) -> dict:
    """DeepSpeed's fused Adam (the GPU optimizer) compiles at its first use; done here, its time is
    its own and not hidden in the first benchmark."""
    if check.mode.name == "cpu":
        return {"status": "skipped", "line": "no CUDA: torch's AdamW is the CPU optimizer"}
    load = "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load()"
    finished = check.run([PYTHON, "-c", load], budget)
    if finished.returncode != 0:
        raise failed_command(finished, "building DeepSpeed's FusedAdam")
    return {"line": f"built or loaded in {finished.seconds:.0f} s"}


def pytest(check: Check, budget: float) -> dict:
    junit = check.work / "pytest.xml"
    command = [
        PYTHON,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "-v",
        "-rs",
        "--basetemp",
        str(check.work / "pytest"),
        f"--junitxml={junit}",
        *check.mode.pytest.split(),
    ]
    finished = check.run(command, budget)
    if not junit.exists():
        raise failed_command(finished, "pytest")
    counts, failures, properties = junit_results(junit)
    result = {"tests": counts, "failures": failures, "figures": properties}
    result["line"] = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no tests"
    if finished.returncode not in (0, 5) or failures:  # (5: no tests collected)
        raise PartFailed(result["line"] + ": " + "; ".join(f["test"] for f in failures[:5]))
    return result


def junit_results(path: Path) -> tuple[dict, list, dict]:
    """The counts, the failures, and what each test measured (pytest's `record_property`), by test."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures, properties = [], {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        measured = {p.get("name"): p.get("value") for p in case.iter("property")}
        if measured:
            properties[name] = measured
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[{"failure": "failed"}.get(outcome, outcome)] += 1
        if outcome in ("failure", "error"):
            message = next(c for c in case if c.tag == outcome).get("message", "")
            failures.append({"test": name, "message": message[:300]})
    return counts, failures, properties


def bench(model: str, arguments: str) -> Callable[[Check, float], dict]:
    def part(check: Check, budget: float) -> dict:
        finished = check.run([*PRETRAIN, "bench", "train", model, *arguments.split(), "--json"], budget)
        if finished.returncode != 0:
            raise failed_command(finished, f"bench train {model}")
        result = json.loads(finished.stdout.strip().splitlines()[-1])
        check.write_json(f"bench-{model}.json", result)
        nominal, measured = result.get("ours_mfu"), result["ours_mfu_of_measured_matmul"]
        peak = result.get("ours_step_peak_memory_bytes")
        line = (
            f"ours {result['ours_tokens_per_sec']:,.0f} tok/s, MFU "
            + (f"{100 * nominal:.1f}% of nominal, " if nominal else "")
            + f"{100 * measured:.1f}% of the measured matmul, {result['ratio']:.2f}x transformers"
            + (f", step peak {peak / 2**30:.1f} GiB" if peak else "")
        )
        return {"line": line, "figures": {k: result.get(k) for k in FIGURES}}

    return part


FIGURES = (
    "ours_tokens_per_sec",
    "hf_tokens_per_sec",
    "ratio",
    "ours_mfu",
    "ours_mfu_of_measured_matmul",
    "ours_step_peak_memory_bytes",
    "measured_matmul_flops",
    "first_loss_difference",
)


def profile(check: Check, budget: float) -> dict:
    results, lines = {}, []
    for model, arguments in check.mode.profile.items():
        left = budget - (time.time() - check.part_started)
        if left < MINIMUM:
            raise PartFailed(f"no time left for {model}")
        finished = check.run([*PRETRAIN, "bench", "profile", model, *arguments.split(), "--json"], left)
        if finished.returncode != 0:
            raise failed_command(finished, f"bench profile {model}")
        results[model] = json.loads(finished.stdout.strip().splitlines()[-1])
        check.write_json("profile.json", results)
        lines.append(f"{model}: {profile_line(results[model])}")
    return {"line": "; ".join(lines)}


def profile_line(result: dict) -> str:
    line = f"matmul {100 * result['matmul_share']:.0f}%, attention {100 * result['attention_share']:.0f}%"
    gaps = result.get("host_gaps") or {}
    if gaps.get("share") is not None:
        line += f", device idle {100 * gaps['share']:.1f}%"
    return line + f" of the {result['timeline']} timeline"


def launch(check: Check, budget: float) -> dict:
    """Prepare the built-in corpus, then the drill's two `pretrain launch` runs."""
    drill = check.mode.drill
    data, run_dir = check.work / "drill" / "data", check.work / "drill" / "run"
    deadline = time.time() + budget
    steps = [
        [
            *PRETRAIN,
            "tokenizer",
            "train",
            "--source",
            "builtin:pydoc",
            "--vocab-size",
            str(drill.vocab_size),
            "--out",
            str(data.parent / "tokenizer"),
        ],
        [
            *PRETRAIN,
            "data",
            "prepare",
            "--source",
            "builtin:pydoc",
            "--tokenizer",
            str(data.parent / "tokenizer"),
            "--out",
            str(data),
            "--workers",
            str(drill.workers),
            "--val-fraction",
            "0.1",
        ],
    ]
    for command in steps:
        finished = check.run(command, deadline - time.time())
        if finished.returncode != 0:
            raise failed_command(finished, " ".join(command[3:5]))
    common = [
        *PRETRAIN,
        "launch",
        "--nproc",
        "1",
        "--config",
        drill.config,
        f"data.dir={data}",
        f"run.dir={run_dir}",
        f"model.vocab_size={drill.vocab_size}",
        *drill.overrides.split(),
        f"checkpoint.every={drill.checkpoint_every}",
        "checkpoint.keep=3",
        f"faults.spike_steps=[{drill.spike_step}]",
        f"faults.kill_step={drill.kill_step}",
        "faults.kill_rank=0",
    ]
    first = check.run([*common, f"train.steps={drill.steps}"], deadline - time.time())
    if first.returncode != 0:
        raise failed_command(first, "the first launch")
    total = drill.steps + drill.more_steps
    second = check.run([*common, f"train.steps={total}"], deadline - time.time())
    if second.returncode != 0:
        raise failed_command(second, "the resuming launch")
    result = drill_report(run_dir, drill, first, second)
    check.write_json("launch.json", result)
    if not result["ok"]:
        raise PartFailed("not as on CPU: " + ", ".join(k for k, v in result["checks"].items() if not v))
    return {"line": drill_line(result), "figures": result["figures"]}


def drill_report(run_dir: Path, drill: Drill, first: Finished, second: Finished) -> dict:
    """What the two launches did, from the run directory's events, metrics and summary, and the
    checks that say it did what it does on CPU."""
    from monitoring.protocol import Restart, RollbackApplied, RollbackDecided, read_events
    from pretrain.reporting.metrics import read_metrics

    events = read_events(run_dir)
    rollbacks = [e.to_json() for e in events if isinstance(e, RollbackDecided)]
    applied = [e.to_json() for e in events if isinstance(e, RollbackApplied)]
    restarts = [e.to_json() for e in events if isinstance(e, Restart)]
    summary = json.loads((run_dir / "train_summary.json").read_text())
    records = read_metrics(run_dir)
    total = drill.steps + drill.more_steps
    newest_before_spike = (drill.spike_step - 1) // drill.checkpoint_every * drill.checkpoint_every
    resumed = re.search(r"resumed from (step_\d+)", second.stdout)
    saves = [
        float(s)
        for s in re.findall(r"checkpoint step_\d+ saved \(([\d.]+) s\)", first.stdout + second.stdout)
    ]
    step_times = [r["train/step_time"] for r in records if r.get("train/step_time")]
    checks = {
        "spike_rolled_back": any(e["step"] == drill.spike_step for e in rollbacks)
        and any(e.get("matches_checkpoint") for e in applied)
        and any(e.get("target") == f"step_{newest_before_spike:08d}" for e in rollbacks),
        "no_other_rollback": all(e["step"] == drill.spike_step for e in rollbacks),
        "kill_restarted": len(restarts) == 1,
        "first_launch_completed": "done:" in first.stdout,
        "resumed_at_the_last_checkpoint": resumed is not None
        and resumed.group(1) == f"step_{drill.steps:08d}",
        "completed": bool(summary.get("completed")) and summary.get("step") == total,
    }
    tokens = [r["train/tokens_per_sec"] for r in records if r.get("train/tokens_per_sec")]
    mfus = [r["train/mfu"] for r in records if r.get("train/mfu")]
    figures = {
        "first_launch_seconds": round(first.seconds, 1),
        "resume_launch_seconds": round(second.seconds, 1),
        "step_time_median_s": statistics.median(step_times) if step_times else None,
        "tokens_per_sec_median": statistics.median(tokens) if tokens else None,
        "mfu_median": statistics.median(mfus) if mfus else None,
        "checkpoint_save_seconds": saves,
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "figures": figures,
        "rollbacks": rollbacks,
        "rollbacks_applied": applied,
        "restarts": restarts,
        "resumed_from": resumed.group(1) if resumed else None,
        "summary": {
            k: summary.get(k) for k in ("step", "tokens", "completed", "rollbacks", "restarts", "world_size")
        },
    }


def drill_line(result: dict) -> str:
    r, f = result, result["figures"]
    spike = r["rollbacks"][0] if r["rollbacks"] else {}
    restart = r["restarts"][0] if r["restarts"] else {}
    return (
        f"spike at {spike.get('step')} rolled back to {spike.get('target')}; "
        f"restart from {restart.get('resume_from')}; resumed from {r['resumed_from']}; "
        f"{f['step_time_median_s'] or 0:.3f} s/step, checkpoints saved in "
        + ", ".join(f"{s:.1f}" for s in f["checkpoint_save_seconds"])
        + " s"
    )


def variants(check: Check, budget: float) -> dict:
    """Each variant of the step (`pretrain/bench/variants.py`) in a `bench train --ours-only`
    process of its own, with its own timeout; variants.json rewritten after each, so a call cut
    short keeps what ran. The part fails only when no baseline ran."""
    from pretrain.bench.variants import choose, entry, planned

    mode, deadline, rows = check.mode, time.time() + budget, []
    for variant in planned(mode.variant_batches, cpu=mode.name == "cpu"):
        left = deadline - time.time()
        if variant.skipped is not None or left < MINIMUM:
            rows.append(
                entry(variant, None, None if variant.skipped else "no time left in the part's budget")
            )
        else:
            command = [*PRETRAIN, "bench", "train", variant.model, *mode.variants.split()]
            command += ["--micro-batch-size", str(variant.micro_batch_size), "--ours-only", "--json"]
            finished = check.run([*command, *variant.overrides], min(mode.variant_timeout, left))
            if finished.returncode == 0:
                rows.append(entry(variant, json.loads(finished.stdout.strip().splitlines()[-1])))
            else:
                rows.append(entry(variant, None, str(failed_command(finished, variant.label))))
        check.write_json("variants.json", {"variants": rows, "chosen": choose(rows)})
    chosen = choose(rows)
    ran = sum(r["tokens_per_second"] is not None for r in rows)
    if not any(chosen.values()):
        raise PartFailed(f"no baseline ran ({ran} of {len(rows)} variants ran: variants.json)")
    return {"line": f"{ran} of {len(rows)} variants ran; chosen: " + ", ".join(filter(None, chosen.values()))}


# --------------------------------------------------------------------------- the check


def parts(mode: Mode) -> list[tuple[str, Callable[[Check, float], dict]]]:
    """The mode's parts in its order: the GPU tests and the drill (correctness) before the
    benchmarks, and the benchmarks the targets name (125m, 1.3b) before the others; then the
    parts run only on request (`variants`)."""
    named = {
        "versions": versions,
        "fused_adam": fused_adam,
        "pytest": pytest,
        "launch": launch,
        "profile": profile,
        "variants": variants,
    }
    named |= {f"bench {model}": bench(model, arguments) for model, arguments in mode.bench.items()}
    return [(name, named[name]) for name in mode.order + mode.on_request]


def repo_path() -> str:
    return str(Path(__file__).resolve().parent.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "out", nargs="?", default=os.environ.get("OUT"), help="where the files go (default: $OUT)"
    )
    parser.add_argument("--cpu", action="store_true", help="the same parts on a CPU, with the tiny config")
    parser.add_argument("--parts", help="only these parts, comma-separated (names as in summary.json)")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default: 530 on a GPU)")
    parser.add_argument("--work", help="run directories and caches (default: a new temporary directory)")
    args = parser.parse_args(argv)
    mode = CPU if args.cpu else GPU
    if args.budget:
        mode = Mode(**{**mode.__dict__, "budget": args.budget})
    if not args.out:
        print("gpu_check: give an output directory (or set OUT)", file=sys.stderr)
        return 2
    selected = parts(mode)
    if args.parts:
        wanted = [p.strip() for p in args.parts.split(",")]
        unknown = sorted(set(wanted) - {name for name, _ in selected})
        if unknown:
            print(
                f"gpu_check: unknown parts {unknown}: choose from {[n for n, _ in selected]}", file=sys.stderr
            )
            return 2
        selected = [(name, part) for name, part in selected if name in wanted]
    else:
        selected = [(name, part) for name, part in selected if name not in mode.on_request]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    started = float(os.environ.get("GPU_CHECK_STARTED", time.time()))
    check = Check(mode, out, work, started)
    with open(out / "gpu_check.log", "a") as log:
        check.log_file = log
        for name, part in selected:
            run_part(check, name, part)
    check.summary["seconds"] = round(time.time() - started, 1)
    check.write_json("summary.json", check.summary)
    print(table(check.summary), flush=True)
    return 0 if all(p["status"] in ("ok", "skipped") for p in check.summary["parts"]) else 1


def run_part(check: Check, name: str, part: Callable[[Check, float], dict]) -> None:
    own = check.budget_of(name)
    budget = min(own, check.remaining())
    record = {"name": name, "budget_s": round(budget, 1)}
    check.log(f"\n===== {name} (budget {budget:.0f} s) =====")
    check.part_started = time.time()
    if budget < max(MINIMUM, START_SHARE * own):
        record |= {"status": "skipped", "line": "no time left in the check's budget", "seconds": 0.0}
    else:
        try:
            record |= {"status": "ok"} | part(check, budget)
        except PartFailed as failure:
            record |= {"status": "failed", "line": str(failure)}
        except Exception as error:  # a bug or a surprise in one part must not end the check
            record |= {"status": "failed", "line": f"{type(error).__name__}: {error}"[:300]}
        record["seconds"] = round(time.time() - check.part_started, 1)
        if record["status"] == "failed":
            release_build_locks()
    check.log(f"----- {name}: {record['status']} in {record['seconds']:.0f} s: {record.get('line', '')}")
    print(f"[{name}] {record['status']} in {record['seconds']:.0f} s: {record.get('line', '')}", flush=True)
    check.summary["parts"].append(record)
    check.write_json("summary.json", check.summary)  # as it stands: kept if the call is cut off


def release_build_locks() -> None:
    """A process stopped while it compiled a torch extension (DeepSpeed's fused Adam) leaves the
    build's lock file behind, and every later build waits for it forever: nothing builds now
    (the part's processes are gone), so the locks go."""
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR")
    if extensions:
        for lock in Path(extensions).glob("*/*/lock"):
            lock.unlink(missing_ok=True)


def table(summary: dict) -> str:
    rows = [
        f"gpu_check ({summary['mode']}): {len(summary['parts'])} parts in {summary['seconds']:.0f} s "
        f"of {summary['budget_s']:.0f}"
    ]
    rows += [
        f"  {p['name']:<17}{p['status']:<9}{p['seconds']:>5.0f} s  {p.get('line', '')}"
        for p in summary["parts"]
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
