"""Power of study v2 (PREREG_v2.md), computed from study v1's paired spread (results.json).

    python benchmarks/learning/power.py

For each v1 app and endpoint: the paired differences d_s = metric(agent, s) - metric(episode_global, s) over
the 5 seeds, their standard deviation sd_d, and the part of it that evaluation sampling alone explains
(sd_eval: a run's final avg@4 is a mean over its evaluation episodes; with success rate p on N episodes its
variance is about p(1-p)/N, so a paired difference carries 2 p(1-p)/N). v2 evaluates 48 tasks x 4 = 192
episodes per run instead of 96, so its spread is projected as sd_v2 = sqrt(sd_d^2 - 2p(1-p)/96 + 2p(1-p)/192)
(the training-to-training part kept as measured). Then the two-sided paired t test at alpha = 0.05 with n
pairs: the power at effects delta (Monte Carlo, 20,000 studies of n pairs d ~ Normal(delta, sd), seeded) and
the smallest effect found with 80% power (MDE, on a 0.005 grid).

Assumption, said once: v2's contrast is agent vs step_global on another app; we borrow v1's run-to-run spread
(agent vs episode_global) as the best estimate we have. The binomial eval term treats episodes as independent
(the 4 samples of a task are correlated, so it is a lower bound on the eval part when tasks differ in
difficulty, an upper bound when they do not); with only 5 seeds sd_d itself is uncertain by a factor of
about 0.6 to 2.9 (the 95% chi-square interval for 4 df), which the scenarios below bracket.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
T975 = {4: 2.776, 9: 2.262, 11: 2.201, 15: 2.131, 19: 2.093}
"""Two-sided 95% Student-t quantiles by degrees of freedom."""
SIMULATIONS = 20_000


def paired(runs: list[dict], app: str, metric) -> list[float]:
    by = {(r["estimator"], r["seed"]): metric(r) for r in runs if r["app"] == app}
    return [by[("agent", s)] - by[("episode_global", s)] for e, s in sorted(by) if e == "agent"]


def power(delta: float, sd: float, n: int, rng: np.random.Generator) -> float:
    """Share of simulated studies of n pairs d ~ N(delta, sd) whose 95% t interval excludes 0 on delta's side."""
    d = rng.normal(delta, sd, size=(SIMULATIONS, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return float((t > T975[n - 1]).mean())


def mde(sd: float, n: int, rng: np.random.Generator) -> float:
    for k in range(1, 400):
        delta = 0.005 * k
        if power(delta, sd, n, rng) >= 0.8:
            return delta
    return math.nan


def main() -> None:
    runs = json.loads((HERE / "results.json").read_text())["runs"]
    rng = np.random.default_rng(0)
    final_avg = lambda r: r["eval"][-1]["avg@k"]  # noqa: E731
    scenarios = []
    for app in ("verified_math", "lookup"):
        d = paired(runs, app, final_avg)
        p = statistics.fmean(final_avg(r) for r in runs if r["app"] == app)
        sd = statistics.stdev(d)
        eval_var = 2 * p * (1 - p) / 96
        sd_v2 = math.sqrt(max(sd**2 - eval_var + 2 * p * (1 - p) / 192, 0.0))
        print(f"v1 {app}: final avg@4 d = {', '.join(f'{x:+.3f}' for x in d)}; sd_d = {sd:.3f}; mean p = {p:.3f}; "
              f"sd_eval (96 episodes) = {math.sqrt(eval_var):.3f}; projected v2 sd (192 episodes) = {sd_v2:.3f}")
        scenarios.append((f"{app} (all 5 seeds)", sd_v2))
        if app == "verified_math":
            kept = [x for x, s in zip(d, sorted({r['seed'] for r in runs})) if s != 3]
            sd_k = statistics.stdev(kept)
            sd_k2 = math.sqrt(max(sd_k**2 - eval_var + 2 * p * (1 - p) / 192, 0.0))
            print(f"v1 {app} without seed 3 (the collapsed episode_global run): sd_d = {sd_k:.3f}; projected v2 sd = "
                  f"{sd_k2:.3f}")
            scenarios.append((f"{app} without the collapse", sd_k2))
    bal = lambda r: (r["eval"][-1]["rates"]["verifier_tpr"] + r["eval"][-1]["rates"]["verifier_tnr"]) / 2  # noqa: E731
    d = paired(runs, "verified_math", bal)
    sd = statistics.stdev(d)
    print(f"v1 verified_math: final held-out verifier balanced accuracy d = {', '.join(f'{x:+.3f}' for x in d)}; "
          f"sd_d = {sd:.3f}: degenerate (the v1 verifiers judged nothing, every run sits at ~0.5), not used below")
    print("\npaired t test, two-sided alpha 0.05; power at delta (Monte Carlo, 20,000 studies); MDE = smallest delta "
          "with power >= 0.8")
    print("| scenario (sd of d) | n pairs | power at 0.05 | power at 0.10 | power at 0.15 | MDE (80%) |")
    print("|---|---|---|---|---|---|")
    for name, sd in scenarios:
        for n in (10, 16, 20):
            row = [power(x, sd, n, rng) for x in (0.05, 0.10, 0.15)]
            print(f"| {name} ({sd:.3f}) | {n} | " + " | ".join(f"{x:.2f}" for x in row) + f" | {mde(sd, n, rng):.3f} |")


if __name__ == "__main__":
    main()
