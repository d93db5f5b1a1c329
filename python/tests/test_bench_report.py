"""The report arithmetic of tests/gpu/vllm_bench.py (run on the GPU machine; its
figures go to BENCHMARKS.md): the paired ratio of two request kinds measured one
right after the other, its bootstrap interval, and the verdict on the 1.05 target."""
import importlib.util
import math
import os
import random
import statistics

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu", "vllm_bench.py")
_spec = importlib.util.spec_from_file_location("vllm_bench", _PATH)
vb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vb)


def test_a_constant_ratio_has_a_point_interval():
    a = [10.0 + i % 7 for i in range(40)]
    med, lo, hi = vb.paired_ratio(a, [1.1 * x for x in a])
    assert med == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)


def test_a_drift_of_the_machine_cancels_in_the_pairs():
    # the machine moves between 10 and 16 ms in stretches, both kinds of a pair with
    # it; the second kind 5% slower (times e^N(0, 0.01)): the paired median is the
    # median of the pairs' ratios, its interval narrow around 1.05 although the times
    # spread by 60%
    rnd = random.Random(3)
    a = [10.0] * 14 + [16.0] * 26
    b = [x * 1.05 * math.exp(rnd.gauss(0, 0.01)) for x in a]
    med, lo, hi = vb.paired_ratio(a, b)
    assert med == pytest.approx(statistics.median(y / x for x, y in zip(a, b)))
    assert lo <= 1.05 <= hi and hi - lo < 0.02
    assert lo <= med <= hi


def test_the_interval_covers_the_true_ratio_in_most_trials():
    # 95% percentile intervals of the median of 40 log-normal ratios: cover the true
    # median in at least 85 of 100 independent trials
    covered = 0
    for t in range(100):
        rnd = random.Random(100 + t)
        a = [rnd.uniform(9, 13) for _ in range(40)]
        b = [x * 1.03 * math.exp(rnd.gauss(0, 0.03)) for x in a]
        _, lo, hi = vb.paired_ratio(a, b, boots=1000)
        covered += lo <= 1.03 <= hi
    assert covered >= 85, covered


def test_missing_and_zero_times_are_skipped_and_few_pairs_give_none():
    assert vb.paired_ratio([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]) is None
    assert vb.paired_ratio(None, [1.0]) is None
    med, _, _ = vb.paired_ratio([1, 2, 0, 4, 5, 6, None], [2, 4, 9, 8, 10, 12, 3])
    assert med == 2.0


def test_the_verdict_needs_every_interval_below_the_target_and_fails_on_one_above():
    ok, span, above = (1.02, 1.01, 1.04), (1.04, 1.02, 1.06), (1.07, 1.06, 1.09)
    assert vb.paired_verdict([ok, ok]) is True
    assert vb.paired_verdict([ok, span]) is None
    assert vb.paired_verdict([ok, span, above]) is False
    assert vb.paired_verdict([ok, None]) is None
    assert vb.paired_verdict([]) is None
