"""How often the suite's statistical checks may fail a correct implementation: FALSE_ALARM.

A statistical check passes a correct sampler when its p-value is above a threshold (or a sample
mean within a tolerance). Every such check in the suite draws with fixed seeds, so given the code
its outcome is deterministic: a rerun repeats the same p-values and cannot flip it. Chance comes
back only with fresh seeds: a change that redraws them (another seed, another number or order of
draws) makes the check fail a correct sampler with probability equal to its threshold, since
p-values are uniform under the null hypothesis.

FALSE_ALARM is that threshold, per check. The suite makes 39 such checks: in tests/unit,
test_exactness 8, test_loop 6, test_coupled 5 (3 chi-square, the noise's mean and spread),
test_rng 3, test_tree_sampling 2, test_translated 2, test_playground_logic 2, and one each in
test_constrained_exactness, test_dialect and test_parallel; tests/playground/test_api.py 1;
tests/integration/test_sampling.py 5 and test_feature_draft.py 2. With every seed fresh at once,
the chance that any of them fails a correct implementation is below 39 x 1e-6 < 1e-4 per CI run.

The controls, wrong samplers that must fail the same checks, keep the tests able to fail on a
defect: each control's statistic is far beyond the threshold's critical value (each file says by
how much), so a fresh seed leaves it failing too.
"""
from __future__ import annotations

FALSE_ALARM = 1e-6
