"""Compile time of one layer whose tiling Helix declines (min_gain 0.9), first step = compile."""
import sys, os, time, json
root = os.environ["ROOT"]; sys.path.insert(0, os.path.join(root, "tests/helix")); sys.path.insert(0, root)
import torch
from helix_helpers import B, H, S, build_block, fake_world
from megatron_ext.helix import HelixBackend
from megatron_ext.helix.measure import train_step
out = {}
for kind in ("tp", "moe", "tpep"):
    torch._dynamo.reset()
    with fake_world(0) as g:
        torch.manual_seed(0)
        m = build_block(kind, g)
        be = HelixBackend(tiles=2, interconnect="intra_node", min_gain=0.9)
        c = torch.compile(m, backend=be)
        x = torch.randn(B, S, H, requires_grad=True); gy = torch.randn(B, S, H)
        t = time.perf_counter(); train_step(c, x, gy, m.parameters()); out[kind] = time.perf_counter() - t
        assert not be.summaries[0].tiled
print(json.dumps(out))
