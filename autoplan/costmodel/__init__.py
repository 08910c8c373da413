"""The cost model: what turns a traced graph and a cluster into seconds and bytes.

`timing`: seconds for an op's compute and for a collective on a cluster (analytic constants,
or the cluster file's `measured` curves). `pricer`: what one strategy of a node, and one
edge between strategies, costs over a whole train step on one logical mesh (`Pricer`).
`step_price`: a step's time, memory and collectives recomputed from a strategy assignment,
whoever chose it (`price_step`). `pipeline_price`: a stage's and a pipeline's time and memory
under a schedule, for stages searched or given (`price_stages`, `price_pipeline`).

The cluster itself (devices, links, the file) is `autoplan.cluster`; the solvers see only the
numbers these modules produce. Import the submodules directly; this package re-exports
nothing.
"""
