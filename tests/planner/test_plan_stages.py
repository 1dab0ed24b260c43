"""plan.py's stages: one build per distinct stage shape, the other stages derived from it (plan.restage), with
the figures every stage's own build gives, exactly (Role equality: persistent bytes, activations and their
in-flight count, temporaries, every message's calls and payload, coordinates, groups, logical tensors)."""

import pytest

from cli import flags
import plan
from planner import time_model
import train

TINY = ["--preset", "tiny", "--dtype", "fp32", "--seq-len", "32", "--micro-batch", "1"]
CASES = [  # (flags, world): P = 4 has a first, a last and two middle stages of one shape
    (["--pp", "4", "--n-layer", "8", "--global-batch", "8"], 4),
    (["--pp", "4", "--n-layer", "9", "--global-batch", "8", "--tp", "2"], 8),  # uneven: 3, 2, 2, 2 layers
    (["--pp", "4", "--n-layer", "8", "--pp-schedule", "interleaved", "--global-batch", "8"], 4),
    (["--pp", "4", "--n-layer", "8", "--pp-schedule", "zb", "--global-batch", "4", "--zero", "1"], 4),
    (["--pp", "4", "--n-layer", "8", "--global-batch", "8", "--moe-experts", "4", "--moe-every", "2"], 4),
    (["--pp", "4", "--n-layer", "8", "--global-batch", "16", "--zero", "2"], 8),  # parallel/zero_pipeline.py: D = 2
    (["--pp", "4", "--n-layer", "8", "--global-batch", "16", "--zero", "3"], 8),
    # interleaved ZeRO-3: each stage's action list regathers its chunks a different number of times (its
    # all-gathers differ), so every stage is its own shape and built
    (["--pp", "4", "--n-layer", "8", "--pp-schedule", "interleaved", "--global-batch", "16", "--zero", "3"], 8),
]


@pytest.mark.parametrize("argv,world", CASES, ids=[" ".join(c[0][:6]) for c in CASES])
def test_a_reused_stage_has_the_figures_of_its_own_build(argv, world):
    settings = time_model.plan_settings(flags.validate(flags.build_parser().parse_args([*TINY, *argv]), world,
                                                       axes=train.AXES))
    reused, built = plan.plan_roles(settings), plan.plan_roles(settings, reuse=False)
    assert [r.rank for r in reused] == [r.rank for r in built]
    for a, b in zip(reused, built):
        assert a == b, a.rank
    shapes = {plan.stage_shape(settings, p) for p in range(settings.shape.pp)}
    every_stage_differs = settings.args.zero == 3 and settings.args.pp_schedule == "interleaved"
    assert len(shapes) < settings.shape.pp or every_stage_differs  # some stage was derived, not built
