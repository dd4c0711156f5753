"""Which node each rank of the (p, t, d) grid lands on, and which groups leave their node.

torchrun gives node n the world ranks n*G .. n*G+G-1 (G ranks per node, `--nproc-per-node`).
With t varying fastest (ptdp/parallel/grid.py), a tensor group is t adjacent ranks: it stays
inside one node exactly when t divides G, and then the groups that cross nodes are the
pipeline groups (and the data groups once t*d > G), whose traffic is a few point-to-point
activations per micro-batch and one all-reduce per iteration rather than two all-reduces
per layer (the source's §4.3: tensor parallelism inside a node, pipeline across).
"""

from __future__ import annotations

from ptdp.parallel.grid import group_rows


def nodes_of(ranks: list[int], ranks_per_node: int) -> list[int]:
    """The nodes a group's ranks sit on, in order, without repeats."""
    return sorted({r // ranks_per_node for r in ranks})


def groups_across_nodes(p: int, t: int, d: int, ranks_per_node: int,
                        c: int = 1) -> dict[str, list[list[int]]]:
    """For each kind of group (tensor, data, pipeline, ...), the groups that span several
    nodes."""
    return {kind: [row for row in rows if len(nodes_of(row, ranks_per_node)) > 1]
            for kind, rows in group_rows(p, d, t, c).items()}


def placement_warnings(p: int, t: int, d: int, c: int, ranks_per_node: int) -> list[str]:
    """One line when tensor groups straddle nodes (t does not divide the ranks per node on a
    multi-node job): their per-layer all-reduces then cross the slow inter-node link."""
    world = p * t * d * c
    if t == 1 or ranks_per_node >= world or ranks_per_node % t == 0:
        return []
    crossing = groups_across_nodes(p, t, d, ranks_per_node, c)["tensor"]
    if not crossing:
        return []
    first = crossing[0]
    nodes = nodes_of(first, ranks_per_node)
    fits = [k for k in range(t, 0, -1) if ranks_per_node % k == 0][0]
    return [f"parallel.tensor={t} does not divide the {ranks_per_node} ranks per node: "
            f"{len(crossing)} of {world // t} tensor groups span nodes (e.g. ranks "
            f"{first[0]}..{first[-1]} on nodes {nodes[0]}..{nodes[-1]}), and their per-layer "
            f"all-reduces cross the inter-node link; use a tensor size that divides "
            f"{ranks_per_node} (e.g. parallel.tensor={fits}) and pipeline parallelism across nodes"]
