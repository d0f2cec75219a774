"""Worker of ``test_multiprocess.py::test_fsdp2_on_cpu_matches_one_process``: trains a micro model for a few AdamW
steps with FSDP2 (``torch.distributed.fsdp.fully_shard``), one unit per block named in the model's
``_no_split_modules`` and one for the root, on a gloo CPU mesh; each process takes its slice of one global batch.
Rank 0 prints the per-step mean loss and the number of sharded (DTensor) parameters as JSON. Without a process group
(``--single``) it trains the same steps on the whole batch in one process."""

import argparse
import json

import torch
import torch.distributed as dist

from helpers import micro_model, random_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("family")
    parser.add_argument("--single", action="store_true")
    args = parser.parse_args()
    rank, world = 0, 1
    if not args.single:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = micro_model(args.family).train()
    if not args.single:
        blocks = set(model._no_split_modules)
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = random_ids(8, 12)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        batch = ids[rank::world]
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        if not args.single:
            dist.all_reduce(value)
        losses.append(value.item() / world)
    if rank == 0:
        from torch.distributed.tensor import DTensor

        sharded = sum(isinstance(p, DTensor) for p in model.parameters())
        print(json.dumps({"losses": losses, "sharded_parameters": sharded}), flush=True)
    if not args.single:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
