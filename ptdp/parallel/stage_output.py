"""What a pipeline stage may return besides its output: auxiliary losses.

A model chunk returns its boundary tensor(s) or, on the last stage, `(loss, parts)`
(ptdp/pipeline/executor.py states the whole contract). A chunk that also produces auxiliary
losses, on any stage (a mixture-of-experts router's load-balancing loss), wraps that output:
`StageOutput(output, aux_losses={"load_balancing": coefficient * value})`. The executor adds
them to the objective the stage backpropagates and reports them by name.

It lives here, below both, so that models/ can build it and ptdp/pipeline/ can read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StageOutput:
    """A chunk's `output` (what it would return without side outputs) and its auxiliary losses.

    Each aux loss is a scalar with its coefficient already applied: the objective is the main
    loss plus their sum, and each is reported (``aux/<name>``) as the term it adds. Under context
    parallelism a chunk returns its share of a micro-batch's value, as it does for the loss.
    """

    output: object
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
