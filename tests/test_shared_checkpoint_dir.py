"""Several nodes save into one checkpoint.dir, which every node must see: `ptdp check` warns
when it lies on the node's own disk, and `ptdp train` stops at start-up (before any training)
when the ranks do not see the same folder, naming those that do not."""

from pathlib import Path

from ptdp import checks
from ptdp.runtime.local_ranks import run_on_ranks


def test_check_warns_when_a_multi_node_job_saves_to_a_local_disk(tmp_path, monkeypatch):
    overrides = [f"checkpoint.dir={tmp_path}/ckpt", "train.global_batch_size=16"]
    monkeypatch.setattr(checks, "filesystem_type", lambda path: "ext4")
    two_nodes = checks.check_job(None, overrides, world_size=8, ranks_per_node=4)
    one_node = checks.check_job(None, overrides, world_size=8, ranks_per_node=8)
    assert not two_nodes.errors and len(two_nodes.warnings) == 1
    assert "own ext4 file system, but the job spans 2 nodes" in two_nodes.warnings[0]
    assert one_node.warnings == []
    monkeypatch.setattr(checks, "filesystem_type", lambda path: "nfs4")
    assert checks.check_job(None, overrides, world_size=8, ranks_per_node=4).warnings == []


def test_filesystem_type_reads_the_mount_table():
    assert checks.filesystem_type(Path("/proc/self/does/not/exist")) == "proc"


def _views(root: str) -> list:
    """Rank 1 sees another folder than rank 0 (a node-local disk), then the same one."""
    import torch.distributed as dist

    from ptdp.checkpoint.safety import NotSharedError, check_shared_directory
    out = []
    for shared in (False, True):
        mine = f"{root}/shared" if shared or dist.get_rank() == 0 else f"{root}/node1"
        try:
            check_shared_directory(mine, patience_s=0.5)
            out.append(None)
        except NotSharedError as err:
            out.append(str(err))
    out.append(sorted(p.name for p in Path(f"{root}/shared").iterdir()))
    return out


def test_start_up_stops_when_ranks_do_not_see_the_same_folder(tmp_path):
    for rank, (local, shared, left) in enumerate(run_on_ranks(2, _views, str(tmp_path),
                                                              timeout_s=60)):
        mine = tmp_path / ("shared" if rank == 0 else "node1")   # as each rank's config says
        assert local.startswith(f"checkpoint.dir {mine} is not shared: rank(s) 1 on ")
        assert "do not see what rank 0 (on " in local and "docs/clusters.md" in local
        assert shared is None
        assert left == []   # the marker is gone
