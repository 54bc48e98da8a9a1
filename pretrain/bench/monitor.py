"""`pretrain bench monitor`: what the monitoring service costs a training step, and how fast it acts.

A real monitoring service runs in its own process (`python -m monitoring`), as under `pretrain
launch`. In this process a small Llama-style model trains (forward, backward, AdamW) on random
tokens, with steps of at least ~100 ms on a CPU. Steps alternate between plain steps and steps
that also report their metrics to the service as rank 0 does (hand the report to the reporter
thread, which posts it while the next step computes, and look for an answer that waits); the
overhead is the difference of the step times, paired. The answer's round trip is also timed on
its own. Last, a spike (the gradient norm times 50) is reported after the warm-up: the service
must answer `rollback` to that very report, and the answer reach the training loop.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from monitoring.protocol import ENDPOINT_FILE, RollbackDecided, StepMetrics, monitor_dir, read_events
from pretrain.config import ModelConfig
from pretrain.errors import UserError
from pretrain.model.transformer import Transformer
from pretrain.monitor_link import MonitorClient, Reporter


def _start_service(run_dir: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "monitoring",
            "--run-dir",
            str(run_dir),
            "monitor.warmup=8",
            "monitor.window=64",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    endpoint = monitor_dir(run_dir) / ENDPOINT_FILE
    deadline = time.time() + 60
    while not endpoint.exists():
        if process.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the monitoring service did not start: {process.stderr.read()[-2000:]}")
        time.sleep(0.05)
    return process


def _fake_checkpoint(run_dir: Path) -> None:
    """A complete checkpoint the spike can be rolled back to (the policy only needs it to exist)."""
    from pretrain import checkpoint

    directory = checkpoint.checkpoints_dir(run_dir) / checkpoint.tag_for(1)
    directory.mkdir(parents=True)
    checkpoint.mark_complete(directory, {"step": 1})


def _measure(run_dir: Path, train_step, pairs: int) -> tuple[list, list, list, str, int]:
    """Interleaved plain and reported steps, the round trip on its own, and a spike's answer."""
    reporter = Reporter(run_dir, timeout=5.0)
    step, plain, reported = 0, [], []

    def report(loss: float, grad_norm: float, step_time: float) -> bool:
        reporter.report(
            StepMetrics(
                step=step, loss=loss, grad_norm=grad_norm, lr=1e-4, step_time=step_time, tokens=step * 2048
            )
        )
        return reporter.pending()  # what the loop asks at each step boundary

    for _ in range(3):  # warm-up: allocator, autocast caches, the first connection
        step += 1
        report(*train_step(), 0.1)
    reporter.drain(30)
    for pair in range(pairs):
        for with_monitor in (pair % 2 == 0, pair % 2 == 1):  # alternate which goes first
            step += 1
            started = time.perf_counter()
            loss, grad_norm = train_step()
            if with_monitor:
                report(loss, grad_norm, time.perf_counter() - started)
                reported.append(time.perf_counter() - started)
            else:
                plain.append(time.perf_counter() - started)
    reporter.drain(30)
    round_trips = []
    client = MonitorClient(run_dir, timeout=5.0)
    for _ in range(50):  # the answer's round trip, on its own connection
        step += 1
        started = time.perf_counter()
        client.post(
            "/v1/metrics",
            StepMetrics(
                step=step, loss=loss, grad_norm=grad_norm, lr=1e-4, step_time=0.1, tokens=step * 2048
            ).to_json(),
        )
        round_trips.append(time.perf_counter() - started)
    client.close()
    _fake_checkpoint(run_dir)
    step += 1
    loss, grad_norm = train_step()
    report(loss, grad_norm * 50, 0.1)
    reporter.drain(30)
    action = reporter.take()
    reporter.close()
    return plain, reported, round_trips, action.kind if action else "continue", step


def run(
    as_json: bool = False, quick: bool = False, d_model: int = 192, n_layers: int = 4, batch_size: int = 2
) -> dict:
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size} must be at least 1")
    torch.manual_seed(0)
    if quick:  # a smoke test of the machinery, not a measurement
        d_model, n_layers = 64, 2
    cfg = ModelConfig(vocab_size=4096, d_model=d_model, n_layers=n_layers, n_heads=4, max_seq_len=512)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, cfg.vocab_size, (batch_size, 513))
    pairs = 10 if quick else 150

    def train_step() -> tuple[float, float]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], batch[:, 1:]).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), grad_norm

    with tempfile.TemporaryDirectory(prefix="pretrain-bench-monitor-") as tmp:
        run_dir = Path(tmp)
        service = _start_service(run_dir)
        try:
            plain, reported, round_trips, spike_answer, step = _measure(run_dir, train_step, pairs)
            rollback_steps = [e.step for e in read_events(run_dir) if isinstance(e, RollbackDecided)]
        finally:
            service.terminate()
            service.wait(timeout=30)

    without, with_ = statistics.median(plain), statistics.median(reported)
    paired = statistics.median(b - a for a, b in zip(plain, reported, strict=True))
    result = {
        "device": "cpu",
        "model": f"d_model {d_model}, {n_layers} layers, {batch_size} x 512 tokens",
        "step_ms_without_monitor": without * 1e3,
        "step_ms_with_monitor": with_ * 1e3,
        "overhead_pct": 100 * (with_ - without) / without,
        "overhead_pct_paired": 100 * paired / without,  # median of (with - without) over adjacent pairs
        "report_round_trip_ms_median": statistics.median(round_trips) * 1e3,
        "report_round_trip_ms_max": max(round_trips) * 1e3,
        "report_share_of_step_pct": 100 * statistics.median(round_trips) / without,
        "steps_each": pairs,
        "spike_reported_at_step": step,
        "spike_answer": spike_answer,
        "rollback_event_steps": rollback_steps,
    }
    if as_json:
        print(json.dumps(result))
    else:
        _print_overhead(result)
    return result


def _print_overhead(result: dict) -> None:
    print(f"monitoring overhead, {result['model']}, {result['steps_each']} steps each way, interleaved:")
    print(f"  step without the service: {result['step_ms_without_monitor']:8.1f} ms (median)")
    print(f"  step with the service:    {result['step_ms_with_monitor']:8.1f} ms (median)")
    print(
        f"  difference:               {result['overhead_pct']:+8.2f} % of medians, "
        f"{result['overhead_pct_paired']:+.2f} % paired (median over adjacent pairs)"
    )
    print(
        f"  report round trip:        {result['report_round_trip_ms_median']:8.2f} ms median, "
        f"{result['report_round_trip_ms_max']:.2f} ms max "
        f"({result['report_share_of_step_pct']:.2f} % of a step)"
    )
    print(
        f"  spike reported at step {result['spike_reported_at_step']}: answered "
        f"'{result['spike_answer']}' for that same step; rollback events at steps {result['rollback_event_steps']}"
    )
