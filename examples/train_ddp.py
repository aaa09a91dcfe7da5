"""Train a torchvision ResNet (random weights) with DDP, fed by gpufeed.Loader on every rank.

    torchrun --nproc-per-node N examples/train_ddp.py --store STORE [--steps 300]

NCCL on GPUs (one per process, LOCAL_RANK), gloo on CPU (`--device cpu`). The Loader picks up
rank and world size from torch.distributed: each rank reads its own disjoint, equal shard.
Multi-node: the same command on every node with torchrun's rendezvous flags, e.g.
`torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 ...`,
with the store on a shared filesystem or copied to the same path on each node.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchvision.models import resnet18

import gpufeed
from gpufeed.augment import Normalize, RandomHorizontalFlip, RandomResizedCrop
from gpufeed.bench.common import mapped_mb


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=0, help="steps before the clock starts (first batch, cuDNN tuning)")
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--report", help="write this rank's numbers as JSON to REPORT.rank<N>.json")
    a = p.parse_args()

    cuda = a.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    store = gpufeed.open(a.store)
    loader = gpufeed.Loader(store, batch_size=a.batch_size, device=device, dtype=torch.float32 if not cuda else
                            torch.float16, augment=[RandomResizedCrop(a.image_size), RandomHorizontalFlip(),
                                                    Normalize()])
    model = resnet18(num_classes=max(len(store.classes), 1)).to(device, memory_format=torch.channels_last)
    model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    batches = torch.tensor([len(loader)], device=device)
    dist.all_reduce(batches, op=dist.ReduceOp.MIN)
    assert int(batches) == len(loader), "every rank must see the same number of batches per epoch"

    seen, step, t0 = [], 0, time.perf_counter()
    while step < a.steps:
        epoch = loader.epoch
        for number, (images, labels) in enumerate(loader):
            if epoch == 0:
                seen += loader.plan(0, number)[0].tolist()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(images.contiguous(memory_format=torch.channels_last)),
                                                         labels.clamp(min=0))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step == a.warmup:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            if step >= a.steps:
                break
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    timed = step - min(a.warmup, step)
    result = {"rank": rank, "world_size": world, "steps": step, "img_per_s": timed * a.batch_size / seconds,
              "batches_per_epoch": len(loader), "loss": float(loss), "tier": loader.tier.name,
              "epoch0_indices": seen, "state": loader.state_dict(), "store_mb": store.nbytes / 2**20}
    loader.close()
    dist.barrier()  # every rank has read all it will: a page one rank maps later would count twice in the sum
    result["store_memory_mb"] = mapped_mb(store.path)
    print(f"rank {rank}/{world}: {result['img_per_s']:.0f} img/s, loss {result['loss']:.3f}, "
          f"{len(loader)} batches per epoch, tier {loader.tier.name}", flush=True)
    if a.report:
        with open(f"{a.report}.rank{rank}.json", "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
