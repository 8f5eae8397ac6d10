"""ParallelMesh on real ranks: typed groups equal RankLayout's tables, and the DeviceMesh view
runs DTensor over the very same groups."""

from tests.dist_harness import run_ranks


def _mesh_facts(rank, world):
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron_lite.parallel.mesh import ParallelMesh, RankLayout

    layout = RankLayout(world, tp=2, cp=2, ep=2)  # dp=2, pp=1
    mesh = ParallelMesh(layout)
    facts = {}
    for name in layout.group_names():
        g = getattr(mesh, name)
        mine = [r for r in layout.groups(name) if rank in r]
        facts[name] = (list(g.ranks), g.rank, g.size, mine[0] if mine else [])
    dm = mesh.device_mesh
    same = {d: dm[d].get_group() is getattr(mesh, d).group for d in dm.mesh_dim_names}
    em = mesh.expert_device_mesh
    same |= {f"expert {d}": em[d].get_group() is getattr(mesh, d).group for d in em.mesh_dim_names}
    full = torch.arange(16.0).reshape(4, 4)
    t = distribute_tensor(full, dm["tp"], [Shard(0)])
    local_ok = torch.equal(t.to_local(), full.chunk(2)[mesh.tp.rank])
    return facts, dm.mesh_dim_names, em.mesh_dim_names, same, local_ok, t.full_tensor().sum().item()


def test_typed_groups_and_device_mesh():
    for rank, (facts, dims, edims, same, local_ok, total) in enumerate(
        run_ranks(8, _mesh_facts, timeout=60)
    ):
        for name, (ranks, index, size, expected) in facts.items():
            assert ranks == expected and ranks[index] == rank and size == len(ranks), (rank, name)
        assert dims == ("pp", "dp", "cp", "tp") and edims == ("pp", "edp", "ep", "tp")
        assert all(same.values()), (rank, same)
        assert local_ok and total == 120.0
