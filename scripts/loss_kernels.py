"""The fused loss's kernels against each other on this machine (docs/performance.md, The GPU fast
path): `loss.kernel` chunked (eager) and compiled, the loss and both gradients through
`linear_cross_entropy`, timed in interleaved repeats (medians), and whether they agree bit for bit.

    python scripts/loss_kernels.py [--repeats 7] [--threads 1] [--device cpu]

Prints one line per shape (tokens N, d_model d, vocabulary V; bf16, every 7th target ignored).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pretrain.model.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy

SHAPES = ((1024, 64, 512), (2048, 192, 4096))  # (N, d, V): the tests' tiny head, the demo's size


def loss_and_grads(hidden, weight, targets, kernel):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, targets, kernel=kernel)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def timed(hidden, weight, targets, kernel) -> float:
    if hidden.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss_and_grads(hidden, weight, targets, kernel)
    if hidden.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def compare(n: int, d: int, v: int, repeats: int, device: torch.device) -> str:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=g).bfloat16().to(device)
    weight = (torch.randn(v, d, generator=g) * 0.02).bfloat16().to(device)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE_INDEX
    targets = targets.to(device)
    eager = loss_and_grads(hidden, weight, targets, "chunked")
    compiled = loss_and_grads(hidden, weight, targets, "compiled")  # (compiles)
    equal = [torch.equal(a, b) for a, b in zip(eager, compiled, strict=True)]
    apart = [(a.float() - b.float()).abs().max().item() for a, b in zip(eager, compiled, strict=True)]
    times = {"chunked": [], "compiled": []}
    for _ in range(repeats):
        for kernel, seconds in times.items():
            seconds.append(timed(hidden, weight, targets, kernel))
    e, c = statistics.median(times["chunked"]), statistics.median(times["compiled"])
    return (
        f"N {n}, d {d}, V {v} ({chunk_rows(v, device)} rows per chunk): chunked {e * 1e3:.1f} ms, "
        f"compiled {c * 1e3:.1f} ms ({e / c:.2f}x); bit-equal loss/grad_hidden/grad_weight {equal}, "
        f"largest difference {apart}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for n, d, v in SHAPES:
        print(compare(n, d, v, args.repeats, torch.device(args.device)), flush=True)


if __name__ == "__main__":
    main()
