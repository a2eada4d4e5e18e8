"""Launched by the launcher tests: each rank writes its rank, world size and an all-reduce sum."""

import json
import os
import sys

import tensorplay as tp
import tensorplay.distributed as dist

dist.init_process_group("gloo")
total = tp.tensor([float(dist.get_rank())])
dist.all_reduce(total)
out = os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json")
with open(out, "w") as f:
    json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": total.item(),
               "local_rank": int(os.environ["LOCAL_RANK"])}, f)
dist.destroy_process_group()
