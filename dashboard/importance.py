"""Parameter importances of one study, from its measured points only, or why there are none.

Optuna's own study is not used: how an invalid point is told to it (0 TFLOP/s, or a failed trial)
changes what its importances say. Here an in-memory study holds the ok rows' TFLOP/s, and the
importances are kept only where they mean something: enough points, more than one value of a
parameter, and no warning from the evaluator (PED-ANOVA says when its quantiles cannot tell
parameters apart; the importances it then returns are all equal and say nothing).
"""

from __future__ import annotations

import warnings

import pandas as pd

MIN_POINTS = 10
# The best quarter against all: a study holds tens of points, and Optuna's default (the best tenth)
# leaves a handful, too few to tell one parameter's values from another's.
TARGET_QUANTILE = 0.25


def importances(ok: pd.DataFrame, params: list[str]) -> tuple[dict[str, float] | None, str | None]:
    """({param: importance}, None), largest first, or (None, why not) in one line."""
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.exceptions import ExperimentalWarning
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances
    from optuna.trial import create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    varied = [p for p in params if ok[p].dropna().nunique() > 1]
    if len(ok) < MIN_POINTS:
        return None, f"{len(ok)} measured points; importances need at least {MIN_POINTS}"
    if not varied:
        return None, "no parameter took more than one value among the measured points"
    if ok["tflops"].nunique() == 1:
        return None, "every measured point has the same TFLOP/s"
    rows = ok.dropna(subset=varied)
    dists = {p: CategoricalDistribution(sorted(rows[p].unique().tolist(), key=str)) for p in varied}
    study = optuna.create_study(direction="maximize", storage=optuna.storages.InMemoryStorage())
    study.add_trials([create_trial(params={p: r[p] for p in varied}, distributions=dists, value=float(r["tflops"]))
                      for r in rows.to_dict("records")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=ExperimentalWarning)
        result = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(target_quantile=TARGET_QUANTILE))
    if caught:
        return None, str(caught[0].message).splitlines()[0]
    if len(set(round(v, 9) for v in result.values())) == 1 and len(result) > 1:
        return None, "every parameter came out equally important, which says nothing"
    return {k.removeprefix("p_"): v for k, v in result.items()}, None
