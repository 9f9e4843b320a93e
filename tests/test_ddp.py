"""Two CPU processes under DistributedDataParallel (gloo): every parameter must receive a gradient.

DDP without ``find_unused_parameters`` fails on the second step when a parameter got no gradient in the
first, which is what happens to Longformer's global projections when no token is global.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_xformers import HfxLongformerConfig, HfxLongformerForSequenceClassification


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, world: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    torch.set_num_threads(1)  # two processes on a 2-core machine: more threads only oversubscribe it
    torch.manual_seed(0)
    config = HfxLongformerConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=40, attention_window=4, num_labels=2,
    )  # fmt: skip
    model = torch.nn.parallel.DistributedDataParallel(HfxLongformerForSequenceClassification(config))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(5, 50, (2, 12), generator=torch.Generator().manual_seed(rank))
    no_globals = torch.zeros_like(ids)
    for _ in range(3):
        loss = model(input_ids=ids, global_attention_mask=no_globals, labels=torch.tensor([0, 1])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    # Tear down in order: gloo can hang in the DDP reducer's destructor once the peer process has gone.
    dist.barrier()
    del model, opt
    dist.destroy_process_group()


def test_ddp_trains_without_global_tokens():
    context = mp.spawn(_worker, args=(_free_port(), 2), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):  # raises if a worker failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError("DDP workers did not finish within 120 s")
