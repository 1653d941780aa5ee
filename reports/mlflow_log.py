"""--mlflow: the audit as an MLflow run. The headline numbers become metrics, the options params, the
provenance fingerprint and verdict tags, and the written report files artifacts, in the tracking URI
given (--mlflow-uri) or else MLflow's active one (MLFLOW_TRACKING_URI). Read from the result alone,
like every renderer; mlflow (pip install "splitaudit[mlflow]") is imported only here.
"""

from __future__ import annotations

import math
from pathlib import Path

from splitaudit.core.errors import InputError
from splitaudit.core.registries import BOUNDS

INSTALL_HINT = 'pip install "splitaudit[mlflow]"'
MAX_PARAM_CHARS = 500  # MLflow refuses longer values on some stores (6000 on most); options are short


def require_mlflow(tracking_uri: str | None):
    """mlflow, with the tracking store reachable, before any computation: bad input otherwise (exit 2)."""
    try:
        import mlflow
    except ImportError as exc:
        raise InputError(f"--mlflow needs MLflow, which is not installed: {INSTALL_HINT}") from exc
    try:
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
        mlflow.MlflowClient().search_experiments(max_results=1)
    except Exception as exc:  # a store that cannot be opened fails in many library-specific ways
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"--mlflow: the tracking store {mlflow.get_tracking_uri()} cannot be used: {first}") from exc
    return mlflow


def headline_metrics(result: dict) -> dict[str, float]:
    """The numbers a run is compared by: bounds, mean dFIL, each attack's advantage and primary metric,
    utility, and the gate (1 passed, 0 failed). Non-finite numbers are left out (MLflow stores finite ones)."""
    bounds, attacks = result.get("bounds") or {}, result.get("attacks") or {}
    metrics = {key: bounds.get(key) for key in BOUNDS}
    metrics["dfil_mean"] = (result.get("dfil") or {}).get("mean")
    metrics["noise_sigma"] = result.get("noise_sigma")
    for name, attack in attacks.items():
        if attack.get("status") == "ok":
            metrics[f"{name}.advantage"] = attack.get("advantage")
            metric = attack.get("primary_metric")
            metrics[f"{name}.{metric}"] = (attack.get("metrics") or {}).get(metric)
    metrics["utility_accuracy"] = (result.get("utility") or {}).get("accuracy")
    metrics["gate_passed"] = 1.0 if (result.get("gate") or {}).get("passed") else 0.0
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def run_params(result: dict) -> dict[str, str]:
    """The options the audit ran with (from its provenance), as MLflow params."""
    options = (result.get("provenance") or {}).get("options") or {}
    params = {}
    for key, value in options.items():
        if value is None or value in ({}, []):
            continue
        shown = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        params[key] = shown[:MAX_PARAM_CHARS]
    return params


def log_run(result: dict, written: list[Path], tracking_uri: str | None) -> str:
    """One MLflow run holding the audit; returns its run id."""
    from splitaudit.reports.view_verdict import headline

    mlflow = require_mlflow(tracking_uri)
    provenance = result.get("provenance") or {}
    name = f"{Path(str((result.get('model') or {}).get('path', 'model'))).name} sigma={result.get('noise_sigma')}"
    with mlflow.start_run(run_name=name) as run:
        mlflow.log_params(run_params(result))
        mlflow.log_metrics(headline_metrics(result))
        mlflow.set_tags(
            {
                "splitaudit.version": str((result.get("tool") or {}).get("version")),
                "splitaudit.fingerprint": str(provenance.get("fingerprint", "")),
                "splitaudit.verdict": headline(result)[:MAX_PARAM_CHARS],
            }
        )
        for path in written:
            mlflow.log_artifact(str(path))
            figures = path.parent / f"{path.stem}_images"
            if path.suffix == ".md" and figures.is_dir():
                mlflow.log_artifacts(str(figures), figures.name)
        return run.info.run_id
