"""Train a model sharded with FSDP2 on several machines, gradients and parameters sent in 8-bit block codes: the script
each node runs under torchrun.

Each machine is one replica group: its processes shard the model among themselves (a reduce-scatter of the
gradients and an all-gather of the parameters in int8 codes over the machine's fast links), and the machines average
their shards' gradients in int8 codes over the slow link between them (hybrid sharding). 2 nodes x 4 processes, run
on every node with its own --node-rank:

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
        examples/sharded.py --nodes 2 --devices 4

On one machine, 2 processes sharding one model: ``torchrun --nproc-per-node 2 examples/sharded.py --devices 2``.
With --out, each process saves the whole parameters and the bytes it sent there.
"""

import argparse
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_gravac import GraVACModelParallelStrategy
from lightning_gravac.zoo.gpt import ByteGPT, Windows, synthetic_bytes


class ShardedByteGPT(ByteGPT):
    """The zoo's byte-level GPT, each transformer block and then the whole model sharded by ``fully_shard``."""

    def configure_model(self) -> None:
        if isinstance(self, FSDPModule):  # Lightning calls this again for each fit, validate or test
            return
        mesh = self.device_mesh["data_parallel"]  # this machine's processes, with replica groups
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--code", default="int8", choices=["int8", "int4", "none"])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    pl.seed_everything(0)
    strategy = GraVACModelParallelStrategy(
        args.code,
        replica_groups=args.nodes,  # each machine a group
        data_parallel_size=args.nodes * args.devices,
        tensor_parallel_size=1,
        process_group_backend="gloo" if args.accelerator == "cpu" else None,
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model = ShardedByteGPT(width=args.width, layers=2, heads=4, context=64)
    windows = Windows(synthetic_bytes(200_000), 64, args.steps * 16 * args.nodes * args.devices, seed=1)
    trainer.fit(model, DataLoader(windows, batch_size=16))
    whole = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for k, p in model.named_parameters()}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {"weights": whole, "within": strategy.bytes_sent, "between": strategy.bytes_between_groups}
        torch.save(result, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
