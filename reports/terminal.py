"""The compact summary printed at the end of `splitaudit run`."""
from __future__ import annotations

from tabulate import tabulate


def terminal_summary(result: dict) -> str:
    bounds = result.get("bounds", {})
    lines = [f"van Trees bound MSE: {bounds.get('van_trees_mse')}   "
             f"Cramér-Rao bound MSE: {bounds.get('cramer_rao_mse')}"]
    rows = []
    for name, attack in result.get("attacks", {}).items():
        if attack["status"] != "ok":
            rows.append([name, attack["status"], "", "", attack.get("reason", "")])
            continue
        metric = attack["primary_metric"]
        rows.append([name, "ok", f"{metric} {attack['metrics'][metric]:.4g}",
                     f"{attack['baseline'][metric]:.4g}", f"{attack['advantage']:+.3f}"])
    if rows:
        lines.append(tabulate(rows, headers=["attack", "status", "result", "baseline", "advantage"]))
    gate = result["gate"]
    lines.append("gate: " + ("passed" if gate["passed"] else "FAILED: " + "; ".join(gate["reasons"])))
    return "\n".join(lines)
