"""Suite-wide setup: the tests run on CPU ranks with gloo, also on machines with GPUs.

Hiding the GPUs here (before anything initialises CUDA) reaches every process the tests start:
spawned ranks, torchrun jobs and tool subprocesses inherit the environment. Without it, a
machine with one visible GPU would put every multi-rank test's rank 1 on a GPU it lacks.
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
