"""A launched training script as the README writes it, ending without ``destroy_distributed()`` (the exit
teardown does it), plus the Accelerate example's loss average, ``all_reduce(op=AVG)``, on ``loss.detach()``: the
workaround for torch 2.13's race of gloo's in-place AVG division with autograd (tests/stress/avg_race.py).
``make stress`` launches it repeatedly under load and counts native crashes."""

import torch
import torch.distributed as dist

import ndparallel as ndp

cfg = ndp.ParallelismConfig(dp_shard_size=-1)
mesh = ndp.init_distributed(cfg)
model = ndp.parallelize(ndp.models.Transformer(ndp.models.TransformerConfig.from_preset("tiny")), cfg, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
torch.manual_seed(0)
tokens = torch.randint(0, 256, (2, 32))
for _ in range(2):
    loss = ndp.cross_entropy_loss(model(tokens, torch.arange(32)), tokens.roll(1, 1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG, group=mesh["dp_cp"].get_group())
print("DONE", dist.get_rank(), f"{loss.item():.6f}", flush=True)
