"""Run by a launcher (or as a plain process): print this process's rank and environment as one JSON line.

tests/test_recipes_fsdp.py compares what ``accelerate launch`` and ``torchrun`` give each rank with what the warm
ranks of tests/warm_ranks.py give it."""

import json
import os

print(json.dumps({"rank": os.environ.get("RANK"), "env": dict(os.environ)}), flush=True)
