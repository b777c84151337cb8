"""Probe (not committed): PD + MTP K=2 on the 1,000-request workload with the decode worker asynchronous and
multi-step, as the colocated engine runs, to see what PD's synchronous scheduling costs."""
import json
import sys

from jaxgdn.engine.config import EngineConfig

EngineConfig.uses_async_scheduling = property(lambda self: self.async_scheduling is not False)
EngineConfig.resolved_decode_steps = lambda self, platform: (
    (4 if platform in ("gpu", "cuda") else 1) if self.decode_steps_per_launch is None else self.decode_steps_per_launch)
from jaxgdn.bench.__main__ import build_parser  # noqa: E402
from jaxgdn.bench.serve import child_run  # noqa: E402

args = build_parser().parse_args(["serve", "--pd", "--num-speculative-tokens", "2", "--no-peer", *sys.argv[1:]])
args.child = "workload"
out = child_run(args)
w = out["warm"]
print(json.dumps({"warm_wall_s": w["wall_s"], "total_tokens_per_s": w["total_tokens_per_s"],
                  "cold_wall_s": out["cold"]["wall_s"], "startup_s": out["startup_s"],
                  "compiles_after_startup": out["compiles_after_startup"], "handoffs": w["handoffs"]}))
