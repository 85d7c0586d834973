"""Time a paired bootstrap of 5,000 right/wrong questions x 10,000 resamples: the multinomial counts
path against the general index-resampling path on the same data, and print their ratio.

Aim: the counts path under 50 ms.

    .venv/bin/python perf/bootstrap_speed.py
"""

from __future__ import annotations

import time

import numpy as np

from rigctl.stats import paired_bootstrap

QUESTIONS = 5_000
RESAMPLES = 10_000
REPEATS = 5


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    a = (rng.random(QUESTIONS) < 0.55).astype(float)
    b = (rng.random(QUESTIONS) < 0.62).astype(float)
    counts = best_of(lambda: paired_bootstrap(a, b, resamples=RESAMPLES, method="counts"), REPEATS)
    indices = best_of(lambda: paired_bootstrap(a, b, resamples=RESAMPLES, method="indices"), 2)
    ci_c = paired_bootstrap(a, b, resamples=RESAMPLES, method="counts")
    ci_i = paired_bootstrap(a, b, resamples=RESAMPLES, method="indices")
    print(f"paired bootstrap, {QUESTIONS} questions x {RESAMPLES} resamples (best of runs)")
    print(f"  counts (multinomial):  {counts * 1e3:8.1f} ms   interval [{ci_c.low:+.4f}, {ci_c.high:+.4f}]")
    print(f"  indices (general):     {indices * 1e3:8.1f} ms   interval [{ci_i.low:+.4f}, {ci_i.high:+.4f}]")
    print(f"  indices / counts:      {indices / counts:8.1f}x")
    print(f"  aim: counts < 50 ms -> {'met' if counts < 0.050 else 'NOT met'}")


if __name__ == "__main__":
    main()
