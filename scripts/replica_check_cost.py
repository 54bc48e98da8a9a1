"""What the replicas' comparison costs (`monitor.consistency_every`; docs/monitoring.md, "Replay
and replica checks"): in a real DeepSpeed job, one training step (forward, backward, update) and
one check (`ReplicaCheck.check`: the digests, each rank's partition against its fp32 masters, the
all-gather), timed alternately in the same processes so that a busy machine slows both alike.

    python -m torch.distributed.run --nproc_per_node 2 scripts/replica_check_cost.py \
        [--zero 2] [--d-model 192] [--layers 4] [--seq-len 512] [--micro-batch 8] [--repeats 20]

Rank 0 prints one JSON line: the median step and check times and the check's share of a step at
every 100 steps (the default interval).
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
from pretrain.stability.replay import FaultCounts
from pretrain.train.machine_faults import FaultLedger
from pretrain.train.move_off import HostMoves
from pretrain.train.replica_hook import ReplicaCheck

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--zero", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--d-model", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    env = DistEnv.from_environ()
    init_distributed(env)
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
    with tempfile.TemporaryDirectory() as run_dir:
        moves = HostMoves(env=env, run_dir=Path(run_dir), writer=None)
        check = ReplicaCheck(
            env=env,
            run_dir=Path(run_dir),
            writer=None,
            engine=engine,
            rollbacks=None,  # (a clean model: nothing to roll back)
            ledger=FaultLedger(env=env, run_dir=Path(run_dir), counts=FaultCounts(2), moves=moves),
            every=100,
        )
        check.open(None)
        generator = torch.Generator().manual_seed(env.rank)
        steps, checks = [], []
        for repeat in range(args.repeats + 2):
            tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len + 1), generator=generator)
            started = time.perf_counter()
            loss = engine(tokens[:, :-1], tokens[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            float(loss)  # (the step's end on a GPU)
            middle = time.perf_counter()
            check.check(repeat)
            ended = time.perf_counter()
            if repeat >= 2:  # (the first steps warm up)
                steps.append(middle - started)
                checks.append(ended - middle)
    if env.is_main:
        step, one = statistics.median(steps), statistics.median(checks)
        print(
            json.dumps(
                {
                    "zero": args.zero,
                    "processes": env.world_size,
                    "parameters": param_counts(model_config).total,
                    "tokens_per_step": args.micro_batch * args.seq_len * env.world_size,
                    "median_step_ms": round(1e3 * step, 2),
                    "median_check_ms": round(1e3 * one, 3),
                    "check_share_of_a_step": round(one / step, 5),
                    "share_at_every_100_steps": round(one / step / 100, 6),
                }
            )
        )


if __name__ == "__main__":
    main()
