"""Models nobody here wrote (tests/models/zoo.py) plan on one 8-GPU A100 node; each trains
like one process on 4 gloo ranks in tests/test_distributed.py (zoo-*).

The batch is large enough that splitting it pays: at a few dozen short sequences these models
run faster replicated on every GPU (no gradient to reduce) than split, and their plans would
exercise no sharding rule."""

from __future__ import annotations

from pathlib import Path

import pytest

import autoplan
from autoplan.workload import load_workload
from tests.models.zoo import NAMES, SWEPT, SWEPT_IMAGES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
# the model sweep's are planned on 4 CPUs by their training cases (tests/test_distributed.py);
# planned here too they would cost minutes (Swin's alone, 8 windowed blocks: 4.6 beside other work)
@pytest.mark.parametrize("model", sorted(set(NAMES) - set(SWEPT + SWEPT_IMAGES)))
def test_zoo_model_plans_on_eight_a100s(model: str) -> None:
    cluster = autoplan.Cluster.load(ROOT / "costmodels/dgx-a100-80gb.json")
    w = load_workload(ROOT / "tests/models/zoo.py", model=model, batch_size=512, seq_len=128)
    # one 2-D mesh, one stage: both axes' rules on each model's ops, in one ILP (the search
    # over meshes and pipelines is tested on models of our own; here it would cost minutes).
    # 20 s: DeepSeek-V3's ILP (209 groups, 132k variables) stopped at the 60 s default unproven
    options = autoplan.PlanOptions(mesh_shape=(4, 2), pipeline=False, time_limit_s=20.0)
    plan = w.plan(cluster, options=options)
    assert plan.mesh.shape == (4, 2)
    assert plan.predicted.peak_memory_bytes <= plan.predicted.memory_limit_bytes
    assert plan.collectives, "a plan of 8 devices without collectives: all replicated"
    # every parameter is placed (the plan also places constants the model makes in forward)
    assert {n for n, _ in w.model.named_parameters()} <= set(plan.params)
