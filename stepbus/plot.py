"""`stepbus plot RUN_DIR`: one PNG of how a run went, from the learner's metrics.jsonl.

Four panels, readable at a glance: mean return against env steps and against wall time (with
an evaluator's greedy return as a dashed line, where the records have one), throughput, and
policy lag. Each policy's learner (RUN_DIR/policy-NAME) is its own line. Drawn
with matplotlib's Agg canvas, so it needs no display and touches no global backend state.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WIDTH_PX, HEIGHT_PX, DPI = 1200, 800, 100
RATE_BINS = 60  # throughput is averaged over this many stretches of the run's wall time


class NoMetrics(Exception):
    """RUN_DIR has no metrics to plot (the message says what was looked for)."""


@dataclass
class Series:
    """One learner's records as arrays (NaN where a record lacks a figure)."""

    policy: str
    records: list[dict[str, Any]]

    def column(self, key: str) -> np.ndarray:
        return np.array([_float(r.get(key)) for r in self.records], dtype=float)


def _float(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else math.nan


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a last line still being written is left out."""
    text = path.read_text()
    if not text.endswith("\n"):
        text = text.rpartition("\n")[0]
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "env_steps" in record and "time" in record:
            records.append(record)
    return records


def load(run_dir: Path) -> list[Series]:
    """Every learner's metrics in a run directory: the default policy's in RUN_DIR, others'
    in RUN_DIR/policy-NAME."""
    if not run_dir.is_dir():
        raise NoMetrics(f"{run_dir} is not a directory")
    paths = {"default": run_dir / "metrics.jsonl"}
    paths.update({d.name.removeprefix("policy-"): d / "metrics.jsonl"
                  for d in sorted(run_dir.glob("policy-*")) if d.is_dir()})
    series = [Series(policy, records) for policy, path in paths.items()
              if path.is_file() and (records := read_metrics(path))]
    if not series:
        raise NoMetrics(f"no metrics in {run_dir}: expected {run_dir / 'metrics.jsonl'}, which "
                        "the learner writes after its first policy update")
    return series


def _rate(times: np.ndarray, steps: np.ndarray, start: float) -> tuple[np.ndarray, np.ndarray]:
    """Env steps per second over RATE_BINS equal stretches of wall time (at least 1 s each):
    the slope of the step count, smoother than per-update rates and true across restarts."""
    span = times[-1] - times[0]
    if len(times) < 2 or span <= 0:
        return np.array([]), np.array([])
    bins = max(1, min(RATE_BINS, int(span)))  # whole bins inside the run: none extrapolated
    width = span / bins
    edges = times[0] + width * np.arange(bins + 1)
    at = np.interp(edges, times, steps)
    return (edges[:-1] + width / 2) - start, np.diff(at) / width


@dataclass(frozen=True)
class TimeAxis:
    """Where wall time starts and the unit it is shown in (minutes for runs over 10 min)."""

    start: float
    span: float
    unit: str
    scale: float

    @classmethod
    def of(cls, series: list[Series]) -> TimeAxis:
        start = min(s.column("time")[0] for s in series)
        span = max(np.nanmax(s.column("time")) for s in series) - start
        unit, scale = ("min", 60.0) if span > 600 else ("s", 1.0)
        return cls(start, span, unit, scale)


def plot(run_dir: Path, output: Path | None = None) -> Path:
    """Draw RUN_DIR's metrics into a PNG (default RUN_DIR/progress.png); returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = load(run_dir)
    output = output or run_dir / "progress.png"
    axis = TimeAxis.of(series)
    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    (ret_steps, ret_time), (rate_ax, lag_ax) = fig.subplots(2, 2)
    several = len(series) > 1
    for s in series:
        _draw(s, axis, several, ret_steps, ret_time, rate_ax, lag_ax)
    _label(series, axis, ret_steps, ret_time, rate_ax, lag_ax)
    if several or any("eval_return" in r for s in series for r in s.records):
        ret_steps.legend(loc="lower right")
    last = series[0].records[-1]
    final = last.get("mean_return")
    fig.suptitle(f"{run_dir.resolve().name}: {sum(len(s.records) for s in series)} updates, "
                 f"{int(last['env_steps']):,} env steps in {axis.span / axis.scale:.1f} "
                 f"{axis.unit}"
                 + (f", mean return {final:.1f}" if isinstance(final, (int, float)) else "")
                 + _last_eval(series[0]))
    fig.savefig(output, dpi=DPI, format="png")
    return output


def _last_eval(s: Series) -> str:
    """The title's word on the newest eval return ("" if there is none)."""
    found = [r for r in s.records if isinstance(r.get("eval_return"), (int, float))]
    if not found:
        return ""
    return f", eval return {found[-1]['eval_return']:.1f} (version {found[-1].get('eval_version')})"


def _draw(s: Series, axis: TimeAxis, several: bool, ret_steps: Any, ret_time: Any,
          rate_ax: Any, lag_ax: Any) -> None:
    """One learner's lines in the four panels (labelled by policy when there are several)."""
    label = f"policy {s.policy}" if several else None
    steps, times = s.column("env_steps"), s.column("time") - axis.start
    returns = s.column("mean_return")
    ret_steps.plot(steps, returns, label=label)
    ret_time.plot(times / axis.scale, returns, label=label)
    evaluated = s.column("eval_return")
    if not np.isnan(evaluated).all():  # an evaluator's greedy returns, where records have one
        at = ~np.isnan(evaluated)
        name = f"{s.policy} eval (greedy)" if several else "eval (greedy)"
        ret_steps.plot(steps[at], evaluated[at], marker=".", linestyle="--", label=name)
        ret_time.plot(times[at] / axis.scale, evaluated[at], marker=".", linestyle="--",
                      label=name)
    x, rate = _rate(s.column("time"), steps, axis.start)
    rate_ax.plot(x / axis.scale, rate, label=label)
    p50, p99 = s.column("policy_lag_p50"), s.column("policy_lag_p99")
    prefix = f"{s.policy} " if several else ""
    lag_ax.plot(steps, p99, linewidth=0.8, alpha=0.7, label=f"{prefix}p99")
    lag_ax.plot(steps, p50, linewidth=1.5, label=f"{prefix}p50")


def _label(series: list[Series], axis: TimeAxis, ret_steps: Any, ret_time: Any, rate_ax: Any,
           lag_ax: Any) -> None:
    """Titles, units, grids and limits of the four panels."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    ret_steps.set(title="Mean return vs env steps", xlabel="env steps",
                  ylabel="mean return (recent episodes)")
    ret_time.set(title="Mean return vs wall time", xlabel=f"wall time ({axis.unit})",
                 ylabel="mean return (recent episodes)")
    rate_ax.set(title="Throughput", xlabel=f"wall time ({axis.unit})",
                ylabel="env steps/s (taken in by the learner)")
    lag_ax.set(title="Policy lag of the data learned from", xlabel="env steps",
               ylabel="versions behind the updated policy")
    if all(np.isnan(s.column("policy_lag_p99")).all() for s in series):
        lag_ax.text(0.5, 0.5, "no policy lag in these metrics", ha="center", va="center",
                    transform=lag_ax.transAxes)
    else:
        lag_ax.legend(loc="upper left")
    for ax in (ret_steps, ret_time, rate_ax, lag_ax):
        ax.grid(alpha=0.3)
    for ax in (ret_steps, lag_ax):  # 250k, 1.5M: env step counts at a glance
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    rate_ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    # from zero, so a small wobble does not look like a collapse
    rate_ax.set_ylim(0, max(1.0, *(line.get_ydata().max(initial=0) for line in rate_ax.lines))
                     * 1.1)
    lag_ax.set_ylim(bottom=-0.3)  # a lag of 0 stays visible above the axis
    lag_ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # versions are whole
