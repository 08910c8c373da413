"""The planner's search: the strategies of a step on one logical mesh (intra-operator), and
pipelines of stages on submeshes (inter-operator), each priced as the executor would run it.

One logical mesh
    `intra_op`: a graph, its candidate strategies and their costs made into the ILP of
    `autoplan.solvers.ilp` (decision groups), solved and decoded, and the logical meshes
    tried (`candidate_meshes`). `mesh_plans`: a mesh's plan (`solve_mesh`), priced by
    `autoplan.costmodel`, solved again where its priced peak is over the memory limit.

Pipelines
    `stage_layout`: the devices of a uniform stage, its logical meshes and the boundary
    placement of the tensors passed between stages. `layer_plans`: each layer's intra-op plan
    on one stage layout, memoized by structure, and a layer range priced as the sum of its
    layers. `pipeline_search`: Alpa's stage DP (`autoplan.solvers.stages`) over those
    ranges for each stage size, logical mesh, boundary placement and microbatch count
    (`search_pipelines`), priced by `autoplan.costmodel.pipeline_price`.

Import the submodules directly; this package re-exports nothing.
"""
