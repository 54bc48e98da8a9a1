"""What the machine-fault checks cost on a clean step (docs/monitoring.md, "Replay and replica
checks"), in a real DeepSpeed job, timed in the same processes so that a busy machine slows both
sides alike:

* `--check replicas` (`monitor.consistency_every`): one training step (forward, backward, update)
  and one comparison (`ReplicaCheck.check`: the digests, each rank's partition against its fp32
  masters, the all-gather), alternated.
* `--check replay` (`monitor.replay`): training steps with the replay's gradient tally
  (`GradientTally`: each rank's own gradient norm, kept on the device) and without it, in the
  order A B B A, so that drift falls on both; and the share of a tallied step spent in the
  tally's hooks, which noise between steps does not hide.

    python -m torch.distributed.run --nproc_per_node 2 scripts/stability_costs.py --check replay \
        [--zero 2] [--d-model 192] [--layers 4] [--seq-len 512] [--micro-batch 8] [--repeats 20]

The defaults are the demo's model and batch (configs/train/demo.yaml). Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pretrain.config import EngineConfig, ModelConfig, OptimConfig
from pretrain.model.transformer import Transformer
from pretrain.parallel.distributed import DistEnv, init_distributed
from pretrain.parallel.engine import BatchPlan, deepspeed_config, initialize
from pretrain.planning.flops import param_counts
from pretrain.stability.replay import FaultCounts, GradientTally
from pretrain.train.machine_faults import FaultLedger
from pretrain.train.move_off import HostMoves
from pretrain.train.replica_hook import ReplicaCheck

REPO = Path(__file__).resolve().parent.parent
WARMUP = 2  # steps not timed: the first ones warm up


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", choices=("replicas", "replay"), default="replicas")
    parser.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--d-model", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args()


def build(args: argparse.Namespace, env: DistEnv):
    """The demo-shaped model in its engine; (engine, model config)."""
    engine_config = EngineConfig(
        deepspeed_config=str(REPO / "configs" / "deepspeed" / f"zero{args.zero}.json")
    )
    ds = deepspeed_config(engine_config, 1.0, BatchPlan(args.micro_batch, 1, env.world_size, args.seq_len))
    torch.manual_seed(0)
    model_config = ModelConfig(
        vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=6, n_kv_heads=2,
        max_seq_len=args.seq_len,
    )  # fmt: skip
    engine, _ = initialize(Transformer(model_config), engine_config, OptimConfig(lr=1e-3), ds)
    return engine, model_config


def timed_step(engine, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    loss = engine(tokens[:, :-1], tokens[:, 1:]).loss
    engine.backward(loss)
    engine.step()
    float(loss)  # (the step's end on a GPU)
    return time.perf_counter() - started


def replica_costs(args, env, engine, batches) -> dict:
    """Steps and checks alternated: (median step, median check)."""
    with tempfile.TemporaryDirectory() as run_dir:
        moves = HostMoves(env=env, run_dir=Path(run_dir), writer=None)
        ledger = FaultLedger(env=env, run_dir=Path(run_dir), counts=FaultCounts(2), moves=moves)
        check = ReplicaCheck(
            env=env, run_dir=Path(run_dir), writer=None, engine=engine, rollbacks=None,  # (nothing to roll back)
            ledger=ledger, every=100,
        )  # fmt: skip
        check.open(None)
        steps, checks = [], []
        for repeat, tokens in enumerate(batches):
            step = timed_step(engine, tokens)
            started = time.perf_counter()
            check.check(repeat)
            if repeat >= WARMUP:
                steps.append(step)
                checks.append(time.perf_counter() - started)
    step, one = statistics.median(steps), statistics.median(checks)
    return {
        "median_step_ms": round(1e3 * step, 2),
        "median_check_ms": round(1e3 * one, 3),
        "check_share_of_a_step": round(one / step, 5),
        "share_at_every_100_steps": round(one / step / 100, 6),
    }


class TimedTally(GradientTally):
    """The tally, with the time its hooks take (on a CPU the kernels run in the call: the whole
    cost; on a GPU the host's part, the launches)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.seconds = 0.0

    def _seen(self, grad: torch.Tensor) -> None:
        started = time.perf_counter()
        super()._seen(grad)
        self.seconds += time.perf_counter() - started


def replay_costs(args, env, engine, batches) -> dict:
    """Steps with the tally and without it, A B B A: (median without, median with, the share); and
    the time inside the tally's hooks, which a busy machine's noise between steps does not hide."""
    times: dict[bool, list[float]] = {False: [], True: []}
    in_hooks = []
    for repeat, tokens in enumerate(batches):
        tallied = repeat % 4 in (1, 2)
        tally = TimedTally(engine.module) if tallied else None
        step = timed_step(engine, tokens)
        if tally is not None:
            tally.take()  # (what a rejected step reads; on a clean step the norms are dropped)
            tally.remove()
        if repeat >= WARMUP:
            times[tallied].append(step)
            if tally is not None:
                in_hooks.append(tally.seconds / step)
    without, with_tally = statistics.median(times[False]), statistics.median(times[True])
    return {
        "median_step_ms": round(1e3 * without, 2),
        "median_step_with_tally_ms": round(1e3 * with_tally, 2),
        "tally_share_of_a_step": round(with_tally / without - 1, 5),
        "share_in_the_tallys_hooks": round(statistics.median(in_hooks), 6),
        "steps_each": len(times[False]),
    }


def main() -> None:
    args = arguments()
    env = DistEnv.from_environ()
    init_distributed(env)
    engine, model_config = build(args, env)
    generator = torch.Generator().manual_seed(env.rank)
    batches = [
        torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=generator)
        for _ in range(args.repeats + WARMUP)
    ]
    measure = replica_costs if args.check == "replicas" else replay_costs
    figures = measure(args, env, engine, batches)
    if env.is_main:
        print(
            json.dumps(
                {
                    "check": args.check,
                    "zero": args.zero,
                    "processes": env.world_size,
                    "parameters": param_counts(model_config).total,
                    "tokens_per_step": args.micro_batch * args.seq_len * env.world_size,
                    **figures,
                }
            )
        )


if __name__ == "__main__":
    main()
