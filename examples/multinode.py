"""Train with GraVACStrategy on several machines: the script each node runs under torchrun (or SLURM's srun).

torchrun, 2 nodes x 4 processes (run on every node, with its own --node-rank):

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
        examples/multinode.py --nodes 2 --devices 4

SLURM (Lightning's SLURMEnvironment reads the job's variables; one task per process): see examples/multinode.sbatch.

Every process trains the same model on its shard of the data; the gradients cross the network compressed (Top-K at a
fixed factor here, or GraVAC adapting it with --adaptive). With --out, each process saves its final weights and the
last gravac/* metrics there (the multi-node test compares them across nodes).
"""

import argparse
import os
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_gravac import GraVAC, GraVACStrategy, Static
from lightning_gravac.zoo import TeacherRegression, teacher_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cf", type=float, default=8)
    parser.add_argument("--adaptive", action="store_true", help="GraVAC chooses the factor")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    pl.seed_everything(0)
    controller = GraVAC() if args.adaptive else Static(cf=args.cf)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=GraVACStrategy("topk", process_group_backend="gloo" if args.accelerator == "cpu" else None),
        callbacks=[controller],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model = TeacherRegression(width=64)
    trainer.fit(model, DataLoader(teacher_dataset(), batch_size=32, shuffle=True))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gravac/")}
        result = {
            "node": int(os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "0"))),
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "metrics": metrics,
        }
        torch.save(result, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
