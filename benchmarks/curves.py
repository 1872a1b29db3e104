"""Curves of `benchmarks/learning.py` results: training return against wall time and against env
steps, one line per system, one PNG per results file (matplotlib's Agg canvas, as `stepbus
plot` draws).

    python benchmarks/curves.py RESULTS.json [...]      # writes RESULTS.png beside each
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def draw(results: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    fig, (by_time, by_steps) = plt.subplots(1, 2, figsize=(11, 4))
    for result in data["results"]:
        curve = [point for point in result.get("curve", []) if point[2] is not None]
        if not curve:
            continue
        label = (f"{result['system']} (eval {result.get('eval_return')} "
                 f"± {result.get('eval_std')})")
        by_time.plot([p[0] for p in curve], [p[2] for p in curve], label=label)
        by_steps.plot([p[1] for p in curve], [p[2] for p in curve], label=label)
    for axes, xlabel in ((by_time, "wall time, s"), (by_steps, "env steps")):
        axes.set_xlabel(xlabel)
        axes.set_ylabel("training return (mean of recent episodes)")
        axes.grid(alpha=0.3)
        axes.legend()
    fig.suptitle(f"{data['env']}: {data['minutes']:g} min each, seed {data['seed']}")
    fig.tight_layout()
    out = results.with_suffix(".png")
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> int:
    for name in sys.argv[1:]:
        print(draw(Path(name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
