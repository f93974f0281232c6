"""Run by a launcher (or as a plain process) with a directory: write this process's rank and environment there, as
``rank-<RANK>.json`` (a file per rank: two ranks printing long lines to one pipe can interleave them).

tests/test_recipes_fsdp.py compares what ``accelerate launch`` and ``torchrun`` give each rank with what the warm
ranks of tests/warm_ranks.py give it."""

import json
import os
import sys
from pathlib import Path

Path(sys.argv[1], f"rank-{os.environ.get('RANK')}.json").write_text(json.dumps(dict(os.environ)))
