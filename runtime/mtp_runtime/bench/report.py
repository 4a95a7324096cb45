"""Benchmark output: a Markdown table, a JSON document and a PNG plot.

`runs` maps a server label ("baseline", "mtp", or "server" for --url mode)
to its LevelResults in concurrency order. With both "baseline" and "mtp" the
table puts them side by side with the MTP/baseline output-throughput ratio.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .runner import LevelResult


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def throughput_ratios(runs: dict[str, list[LevelResult]]) -> dict[int, float]:
    """MTP / baseline output tokens/s per concurrency."""
    if "baseline" not in runs or "mtp" not in runs:
        return {}
    base = {r.concurrency: r.output_tokens_per_s for r in runs["baseline"]}
    return {r.concurrency: r.output_tokens_per_s / base[r.concurrency]
            for r in runs["mtp"] if base.get(r.concurrency)}


def markdown_table(runs: dict[str, list[LevelResult]]) -> str:
    if "baseline" in runs and "mtp" in runs:
        return _comparison_table(runs)
    lines = []
    for label, levels in runs.items():
        lines += [f"**{label}**", "",
                  "| Concurrency | Mean TTFT (ms) | Mean TPOT (ms) | Output tokens/s | Total tokens/s "
                  "| Acceptance rate | Failed |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in levels:
            lines.append(f"| {r.concurrency} | {_fmt(r.mean_ttft_ms)} | {_fmt(r.mean_tpot_ms, 2)} | "
                         f"{_fmt(r.output_tokens_per_s)} | {_fmt(r.total_tokens_per_s)} | "
                         f"{_fmt(r.acceptance_rate, 3)} | {r.failed} |")
        lines.append("")
    return "\n".join(lines)


def _comparison_table(runs: dict[str, list[LevelResult]]) -> str:
    ratios = throughput_ratios(runs)
    base = {r.concurrency: r for r in runs["baseline"]}
    lines = ["| Concurrency | Mean TTFT (ms) base / MTP | Mean TPOT (ms) base / MTP | Output tokens/s base / MTP "
             "| Total tokens/s base / MTP | MTP/base output tokens/s | Acceptance rate | Failed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in runs["mtp"]:
        b = base.get(m.concurrency)
        if b is None:
            continue
        lines.append(
            f"| {m.concurrency} | {_fmt(b.mean_ttft_ms)} / {_fmt(m.mean_ttft_ms)} | "
            f"{_fmt(b.mean_tpot_ms, 2)} / {_fmt(m.mean_tpot_ms, 2)} | "
            f"{_fmt(b.output_tokens_per_s)} / {_fmt(m.output_tokens_per_s)} | "
            f"{_fmt(b.total_tokens_per_s)} / {_fmt(m.total_tokens_per_s)} | "
            f"{_fmt(ratios.get(m.concurrency), 2)}x | {_fmt(m.acceptance_rate, 3)} | {b.failed + m.failed} |")
    return "\n".join(lines) + "\n"


def report_json(runs: dict[str, list[LevelResult]], config: dict) -> dict:
    return {"config": config,
            "runs": {label: [r.to_json() for r in levels] for label, levels in runs.items()},
            "mtp_over_baseline_output_tokens_per_s": {str(c): v for c, v in throughput_ratios(runs).items()}}


def plot_png(runs: dict[str, list[LevelResult]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(f"the PNG plot needs matplotlib ({exc}); pip install matplotlib or pass --no-plot") from None
    from matplotlib.ticker import ScalarFormatter

    fig, (ax_tput, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels_seen = sorted({r.concurrency for levels in runs.values() for r in levels})
    for label, levels in runs.items():
        conc = [r.concurrency for r in levels]
        ax_tput.plot(conc, [r.output_tokens_per_s for r in levels], marker="o", label=label)
        ax_tpot.plot(conc, [r.mean_tpot_ms for r in levels], marker="o", label=label)
    for ax, title, ylabel in ((ax_tput, "Output throughput", "output tokens/s"),
                              (ax_tpot, "Time per output token", "mean TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels_seen)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(runs: dict[str, list[LevelResult]], config: dict, out_dir: Path, plot: bool = True) -> dict:
    """Write bench.md, bench.json (and bench.png); returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "bench.md", "json": out_dir / "bench.json"}
    paths["markdown"].write_text(markdown_table(runs))
    paths["json"].write_text(json.dumps(report_json(runs, config), indent=2))
    if plot:
        paths["png"] = out_dir / "bench.png"
        plot_png(runs, paths["png"])
    return paths
