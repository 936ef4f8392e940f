#!/usr/bin/python3
"""PyTorch's side of bench/ddp_bench: the same models, batch, steps and
thread settings, single process and torch.nn.parallel.DistributedDataParallel
over gloo with 2 ranks (2 processes), timed the way ddp_bench times
Trellis's DDP (docs/benchmarks.md, "DDP").

  /usr/bin/python3 bench/ddp_bench_torch.py [--steps 30] [--warmup 8]
      [--threads 1] [--timeout 300] [--out FILE]

ddp_bench runs it and reads the JSON object it writes to --out (without
--out: stdout). Notes and errors go to stderr; a failed rank or a run past
--timeout exits non-zero. The models and the figures must stay in step with
bench/ddp_bench.cc.

Internal: --rank R --world N --init FILE runs one rank of the DDP phase
(started by the driver, which is this script without --rank).
"""

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# ---- the models (bench/ddp_bench.cc defines the same) ----------------------

MLP_IN, MLP_HIDDEN, MLP_BATCH = 1024, 2048, 32
CNN_BATCH = 32


class Mlp(nn.Module):
    """1024 -> 2048 -> 2048 -> 1024, ReLU between; MSE loss."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(MLP_IN, MLP_HIDDEN)
        self.fc2 = nn.Linear(MLP_HIDDEN, MLP_HIDDEN)
        self.fc3 = nn.Linear(MLP_HIDDEN, MLP_IN)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Cnn(nn.Module):
    """3x32x32 images: three 3x3 convolutions (32, 64, 64 channels; 2x2 max
    pooling after the first two), then 4096 -> 512 -> 10; cross entropy."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make(name, rank):
    """The model (seed 1), this rank's batch (seed 2 + rank) and loss."""
    torch.manual_seed(1)
    model = Mlp() if name == "mlp" else Cnn()
    torch.manual_seed(2 + rank)
    if name == "mlp":
        x = torch.randn(MLP_BATCH, MLP_IN)
        y = torch.randn(MLP_BATCH, MLP_IN)
        return model, x, lambda out: F.mse_loss(out, y)
    x = torch.randn(CNN_BATCH, 3, 32, 32)
    y = torch.randint(0, 10, (CNN_BATCH,))
    return model, x, lambda out: F.cross_entropy(out, y)


MODELS = ["mlp", "cnn"]

# ---- timing -----------------------------------------------------------------


def union_length(intervals, lo=None, hi=None):
    """Length of the union of [a, b) intervals, clipped to [lo, hi)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if lo is not None:
            a = max(a, lo)
        if hi is not None:
            b = min(b, hi)
        if b <= a:
            continue
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


class Recorder:
    """Launch and completion times of each bucket's allreduce in a step."""

    def __init__(self):
        self.launch = {}
        self.done = {}

    def hook(self, state, bucket):
        # torch's default allreduce hook (divide, allreduce, take the
        # result), timestamped at launch and at completion.
        index = bucket.index()
        self.launch[index] = time.perf_counter()
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())
        fut = dist.all_reduce(tensor, async_op=True).get_future()

        def finished(f):
            self.done[index] = time.perf_counter()
            return f.value()[0]

        return fut.then(finished)


def cpu_ms(who):
    """CPU time (user + system, ms) of the process or the calling thread."""
    u = resource.getrusage(who)
    return (u.ru_utime + u.ru_stime) * 1e3


def run_steps(model, x, loss_fn, steps, warmup, recorder=None, kill_at=None):
    """warmup + steps training steps; per-step times in ms of the timed ones.
    With a recorder: the last-bucket wait, the allreduce busy time and the
    share of it that lies before the end of local backward compute."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    keys = ["step", "forward", "backward", "optim", "main_thread_cpu",
            "other_threads_cpu"]
    if recorder is not None:
        keys += ["last_bucket_wait", "allreduce_busy", "hidden_fraction"]
    out = {k: [] for k in keys}
    for i in range(warmup + steps):
        if kill_at is not None and i == warmup + kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if recorder is not None:
            recorder.launch.clear()
            recorder.done.clear()
        self0 = cpu_ms(resource.RUSAGE_SELF)
        thread0 = cpu_ms(resource.RUSAGE_THREAD)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        thread = cpu_ms(resource.RUSAGE_THREAD) - thread0
        others = cpu_ms(resource.RUSAGE_SELF) - self0 - thread
        if i < warmup:
            continue
        out["main_thread_cpu"].append(thread)
        out["other_threads_cpu"].append(others)
        out["step"].append((t3 - t0) * 1e3)
        out["forward"].append((t1 - t0) * 1e3)
        out["backward"].append((t2 - t1) * 1e3)
        out["optim"].append((t3 - t2) * 1e3)
        if recorder is not None:
            last = max(recorder.launch.values())
            spans = [(recorder.launch[k], recorder.done[k])
                     for k in recorder.launch]
            busy = union_length(spans)
            hidden = union_length(spans, t1, last)
            out["last_bucket_wait"].append((t2 - last) * 1e3)
            out["allreduce_busy"].append(busy * 1e3)
            out["hidden_fraction"].append(hidden / busy if busy > 0 else 0.0)
    stats = {k: statistics.median(v) for k, v in out.items()}
    step = sorted(out["step"])
    stats["step_p10"] = step[len(step) // 10]
    stats["step_p90"] = step[min(len(step) - 1, len(step) * 9 // 10)]
    if recorder is not None:
        stats["buckets"] = len(recorder.launch)
    return stats


def set_threads(n):
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set


# ---- one rank ------------------------------------------------------------


def run_rank(args):
    set_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method="file://" + args.init, rank=args.rank,
        world_size=args.world, timeout=timedelta(seconds=args.timeout))
    result = {}
    for name in MODELS:
        # The defaults, the defaults with the timestamping hook, and
        # gradient_as_bucket_view (ddp_bench.cc runs the same three).
        for mode in ("", "_hooked", "_bucket_view"):
            hooked = mode == "_hooked"
            model, x, loss_fn = make(name, args.rank)
            # Defaults: 25 MiB buckets, 1 MiB first bucket.
            ddp = DDP(model, gradient_as_bucket_view=mode == "_bucket_view")
            recorder = None
            if hooked:
                recorder = Recorder()
                ddp.register_comm_hook(None, recorder.hook)
            kill_at = None
            if args.kill_rank == args.rank and name == "mlp" and not mode:
                kill_at = 3
            dist.barrier()
            stats = run_steps(ddp, x, loss_fn, args.steps, args.warmup,
                              recorder, kill_at)
            result[f"{name}_ddp{mode}"] = stats
    dist.barrier()
    dist.destroy_process_group()
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


# ---- the driver ------------------------------------------------------------


def run_ranks(args, out_file):
    """Starts args.world ranks of this script; every wait bounded."""
    init = tempfile.mktemp(prefix="ddp_bench_torch_init_")
    procs = []
    try:
        for r in range(args.world):
            cmd = [sys.executable, os.path.abspath(__file__),
                   "--rank", str(r), "--world", str(args.world),
                   "--init", init, "--out", out_file,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--threads", str(args.threads),
                   "--timeout", str(args.timeout),
                   "--kill-rank", str(args.kill_rank)]
            procs.append(subprocess.Popen(cmd, stdout=sys.stderr))
        deadline = time.monotonic() + args.timeout
        failed = None
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                return None
            time.sleep(0.05)
        # A rank failed (the others would fail on their own at gloo's
        # timeout; no point waiting for that), or the run is past --timeout.
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        if failed is None:
            return f"the DDP ranks ran past --timeout ({args.timeout} s)"
        rank, code = failed
        how = (f"was killed by signal {-code}" if code < 0
               else f"exited with {code}")
        return f"rank {rank} of PyTorch's DDP run {how}"
    finally:
        if os.path.exists(init):
            os.unlink(init)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=int, default=300,
                   help="bound on the DDP phase, and gloo's op timeout (s)")
    p.add_argument("--out", help="write the JSON result here (else stdout)")
    p.add_argument("--kill-rank", type=int, default=-1,
                   help="testing: this rank SIGKILLs itself mid-run")
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank >= 0:
        return run_rank(args)

    # Same threads in every process: the ranks inherit these.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    set_threads(args.threads)
    result = {"torch_version": torch.__version__, "threads": args.threads,
              "steps": args.steps, "warmup": args.warmup}
    for name in MODELS:
        model, x, loss_fn = make(name, 0)
        result[f"{name}_single"] = run_steps(model, x, loss_fn, args.steps,
                                             args.warmup)
    fd, ranks_out = tempfile.mkstemp(prefix="ddp_bench_torch_")
    os.close(fd)
    try:
        error = run_ranks(args, ranks_out)
        if error is not None:
            print(f"ddp_bench_torch: {error}", file=sys.stderr)
            return 1
        with open(ranks_out) as f:
            result.update(json.load(f))
    finally:
        os.unlink(ranks_out)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
