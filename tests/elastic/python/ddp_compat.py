"""A plain PyTorch DDP script (gloo backend), run unchanged under torchrun
and under elastic-run by tests/elastic/python_compat_test.sh.

Every rank prints one line with the launcher variables it was given
("env NAME=value ..."), and rank 0 prints the trained parameters' sum
("result <repr>"): the test compares both between the launchers.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

NAMES = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
]


def main():
    env = " ".join(f"{n}={os.environ.get(n, '<unset>')}" for n in NAMES)
    rank = int(os.environ["RANK"])
    print(f"env rank{rank} {env}", flush=True)
    dist.init_process_group("gloo")
    torch.manual_seed(7)
    x = torch.randn(12, 8)
    y = torch.randn(12, 2)
    world = dist.get_world_size()
    rows = 12 // world
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    torch.manual_seed(100 + rank)  # rank 0's values win at construction
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    if rank == 0:
        print(f"result {total!r}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
