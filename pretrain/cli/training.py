"""`pretrain train`, `finetune`, `launch`, `monitor` and `demo`."""

from __future__ import annotations

import argparse
import os
import sys

from pretrain.errors import ExitCode


def cmd_train(args: argparse.Namespace) -> int:
    from pretrain.config import load_config
    from pretrain.parallel.distributed import ignore_late_stop_requests
    from pretrain.pretraining import pretrain

    summary = as_a_rank(lambda: pretrain(load_config(args.config, _with_fresh(args))))
    ignore_late_stop_requests()
    by = "the monitor" if summary.get("stopped_by_monitor") else summary.get("stopped_by")
    if by:  # the monitor, or another check that refused to go on (the replica check)
        if int(os.environ.get("RANK", "0")) == 0:
            why = summary.get("stopped_by_monitor") or summary.get("stopped_for")
            print(f"pretrain: stopped by {by}: {why}", file=sys.stderr)
        return ExitCode.STOPPED_BY_MONITOR  # not a crash: the supervisor does not restart it
    # a hook saved and stopped for a reason of its own (a straggler's host to move off: REPLACE_NODE)
    return summary.get("exit_code", ExitCode.DONE)


def cmd_finetune(args: argparse.Namespace) -> int:
    from pretrain.config import load_finetune_config
    from pretrain.finetune import finetune
    from pretrain.parallel.distributed import ignore_late_stop_requests

    as_a_rank(lambda: finetune(load_finetune_config(args.config, _with_fresh(args))))
    ignore_late_stop_requests()
    return ExitCode.DONE


def as_a_rank(run):
    """A rank's training: bad input it found is written to its record for the other ranks and the
    supervisor (`pretrain/lifeline.py`); a collective that fails because another rank left the job
    becomes one line (`RankFailed`) naming what is known: the step, and the other rank's reason
    when it left one (a bad-input rank's status, 2, is then this rank's too)."""
    from pretrain import lifeline
    from pretrain.errors import ExitCode, RankFailed, UserError
    from pretrain.parallel.distributed import ignore_late_stop_requests, lost_peer

    try:
        return run()
    except UserError as exc:
        lifeline.note_exit(why=str(exc), status=int(exc.exit_code), now=True)
        raise
    except Exception as exc:
        detail = lost_peer(exc)
        if detail is None:
            raise
        ignore_late_stop_requests()  # (the launcher's SIGTERM to the ranks left must not cut this short)
        step = lifeline.current_step()
        at = f" during step {step}" if step is not None else ""
        lifeline.note_exit(why=f"lost another rank{at}", now=True)
        told = lifeline.peer_reason(wait=PEER_REASON_WAIT_S)
        if told is not None:
            raise RankFailed(
                f"stopped{at}: rank {told['rank']} stopped: {told['why']}",
                told.get("status", ExitCode.FAILED),
            ) from exc
        raise RankFailed(
            f"stopped{at}: another rank left the job ({detail}); the supervisor's line names it"
        ) from exc


PEER_REASON_WAIT_S = 3.0  # how long a rank that lost another waits for that rank's reason, if any


def cmd_launch(args: argparse.Namespace) -> int:
    from pretrain.cli.launch import launch

    return launch(
        args.config,
        _with_fresh(args),
        nproc=args.nproc,
        hostfile=args.hostfile,
        master_addr=args.master_addr,
        master_port=args.master_port,
        no_ssh=args.no_ssh,
        node_rank=args.node_rank,
        nodes=args.nodes,
        min_nodes=args.min_nodes,
    )


def cmd_monitor(args: argparse.Namespace) -> int:
    from monitoring.service import serve_from_args

    return serve_from_args(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from pretrain.cli.demo import run_demo

    return run_demo(out_dir=args.out, steps=args.steps)


FRESH_HELP = (
    "start over: move an earlier run in run.dir to RUN_DIR/previous/ (never deleted); default: resume"
)


def _with_fresh(args: argparse.Namespace) -> list[str]:
    """`--fresh` is `checkpoint.resume=fresh` (last, so it wins)."""
    return [*args.overrides, "checkpoint.resume=fresh"] if args.fresh else list(args.overrides)


def register(sub) -> None:
    train = sub.add_parser(
        "train", help="train in this process (multi-process: deepspeed --module pretrain.train)"
    )
    train.add_argument("--config", required=True, help="run config (configs/train/*.yaml)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    train.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    train.set_defaults(handler=cmd_train)

    finetune = sub.add_parser(
        "finetune", help="fine-tune in this process (multi-process: deepspeed --module pretrain.finetune)"
    )
    finetune.add_argument("--config", required=True, help="configs/finetune/classification.yaml or sft.yaml")
    finetune.add_argument("overrides", nargs="*", help="dotted overrides, e.g. finetune.init=runs/demo/run")
    finetune.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    finetune.set_defaults(handler=cmd_finetune)

    monitor = sub.add_parser("monitor", help="the monitoring service for one run directory (its own process)")
    from monitoring.service import add_arguments

    add_arguments(monitor)
    monitor.set_defaults(handler=cmd_monitor)

    _register_launch(sub)

    demo = sub.add_parser(
        "demo", help="tokenizer, shards and 2-process DeepSpeed training on the built-in corpus"
    )
    demo.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    demo.add_argument(
        "--steps", type=int, default=None, help="fewer steps than configs/train/demo.yaml, for a quick look"
    )
    demo.set_defaults(handler=cmd_demo)


def _register_launch(sub) -> None:
    launch = sub.add_parser(
        "launch",
        help="the monitoring service and, under it, the DeepSpeed job (restarted if it crashes or hangs)",
    )
    launch.add_argument("--config", required=True, help="run config (configs/train/*.yaml)")
    launch.add_argument(
        "--nproc", type=int, default=None, help="processes per node (default: GPUs, or 2 on CPU)"
    )
    launch.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('HOST slots=N' lines)")
    launch.add_argument("--master-addr", default=None, help="rendezvous host (default: the first host)")
    launch.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    launch.add_argument(
        "--no-ssh", action="store_true", help="the launcher's no-ssh mode: run on every node with --node-rank"
    )
    launch.add_argument("--node-rank", type=int, default=0, help="this node's rank in --no-ssh mode")
    launch.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="train on this many of --hostfile's hosts and keep the rest as spares (default: all of them)",
    )
    launch.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        help="with no healthy spare, restart on fewer nodes down to this many, the global batch kept (default: --nodes)",
    )
    launch.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    launch.add_argument("--fresh", action="store_true", help=FRESH_HELP)
    launch.set_defaults(handler=cmd_launch)
