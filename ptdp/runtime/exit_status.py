"""Why a rank ended, for the launch scripts' restart loop (tools/pretrain_gpt.sh MAX_RESTARTS).

torchrun exits 1 whatever its workers' codes, so a rank that ends for a reason the loop must
tell apart writes its code to a file of its own in `PTDP_EXIT_DIR`, which the loop reads after
torchrun returns. The codes:

* 2, a configuration error: the same job fails the same way again, so it is not restarted;
* 3, divergence (a non-finite loss or gradient, fp16 giving up): replayed exactly from the
  last checkpoint it diverges again, so it is not restarted either;
* 4, a hang or a lost peer named by the hang detector (ptdp/runtime/watchdog.py): restarted,
  like a crash (a killed rank, which writes nothing);
* 5, the disk of checkpoint.dir is full (ptdp/checkpoint/retention.py says how much a save
  needs): a restart would fill it again, so it is not restarted.

The loop tells each attempt which one it is in `PTDP_RESTART` (0 for the first), so a restarted
job resumes from the newest checkpoint of its own checkpoint.dir
(ptdp/checkpoint/layout.py `resolve_load`).
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_ERROR, DIVERGED, HUNG, DISK_FULL = 2, 3, 4, 5
EXIT_DIR = "PTDP_EXIT_DIR"
RESTART = "PTDP_RESTART"


def record_exit(code: int) -> None:
    """Leave `code` for the restart loop (one file per rank); nothing when no loop asked."""
    directory = os.environ.get(EXIT_DIR)
    if not directory:
        return
    try:
        path = Path(directory) / f"rank{os.environ.get('RANK', '0')}"
        path.write_text(f"{code}\n")
    except OSError:   # the code is advice; never fail the exit over it
        pass


def restart_attempt() -> int:
    """0 for a job's first attempt, n for its n-th restart by the launch script."""
    try:
        return int(os.environ.get(RESTART) or 0)
    except ValueError:
        return 0
