"""Results of an output root as records: what `nnpd.py report`, the tests and notebooks read.

    import results
    records = results.read_runs("outputs/default")
    results.lookup(records[0].metrics, "coverage.0.68.joint")
    results.write_csv(records, "results.csv")

A record is one run folder: its configuration (baseline, or the knob it changes and the
value), its cohort member, the resolved training settings, the training and analysis
states, and the metrics of its complete analysis (None otherwise).
"""
import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import store

# The table's columns: heading and the metric path (levels are keys such as "0.68").
COLUMNS = (("cov68", "coverage.0.68.joint"), ("cov95", "coverage.0.95.joint"),
           ("width68", "width.0.68.mean"), ("bias rmse", "bias.rmse"), ("test AUC", "classification.auc"))
# The comparison figure's panels.
FIGURE_METRICS = (("joint 68% coverage", "coverage.0.68"), ("68% width", "width.0.68.mean"),
                  ("bias RMSE", "bias.rmse"))


@dataclass
class RunRecord:
    """One run folder of an output root."""
    run: str
    configuration: str
    knob: object
    value: object
    member: dict
    settings: dict
    status: str
    analysis: str
    metrics: dict | None

    @property
    def prior(self):
        """The member's prior (or its name, for experiments whose members have no prior)."""
        return self.member.get("prior", self.member.get("name"))

    @property
    def swept(self):
        """'knob=value' of the configuration, or 'baseline'."""
        return "baseline" if self.knob is None else f"{self.knob}={json.dumps(self.value)}"


def _read(path):
    """A JSON object, or {} when missing or unreadable."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_runs(root, runs=None):
    """Records of the root's run folders (or of the given relative run paths), sorted by path."""
    root = Path(root)
    folders = [root / run for run in runs] if runs is not None else sorted(p.parent for p in root.glob("runs/*/*/run.json"))
    records = []
    for folder in folders:
        run = _read(folder / "run.json")
        if not run:
            continue
        analysis, metrics = analysis_and_metrics(root, folder)
        records.append(RunRecord(
            run=str(folder.relative_to(root)), configuration=run.get("configuration", folder.parent.name),
            knob=run.get("knob"), value=run.get("value"), member=run.get("member") or {},
            settings=run.get("settings") or {}, status=_read(folder / "status.json").get("state", "none"),
            analysis=analysis, metrics=metrics))
    return records


def analysis_and_metrics(root, folder):
    """A run's analysis state and its metrics (None unless complete and intact).

    A complete analysis whose records disagree with their checksums, or whose products are
    gone from the store, reads as "damaged": the next `run` or `analyze` redoes it.
    """
    analysis = _read(folder / "analysis.json")
    state = analysis.get("state", "none")
    if state != "complete":
        return state, None
    metrics = _read(folder / "metrics.json")
    references = _read(folder / "artifacts.json").values()
    if (analysis.get("checksum") != store.record_checksum(analysis) or store.digest(metrics) != analysis.get("metrics")
            or not all((Path(root) / str(path) / store.MANIFEST).is_file() for path in references)):
        return "damaged", None
    return state, metrics


def lookup(mapping, path, default=None):
    """The value at a dotted path; keys may themselves hold dots (levels such as "0.68")."""
    if path == "":
        return mapping
    if not isinstance(mapping, dict):
        return default
    for key in sorted(mapping, key=len, reverse=True):      # the longest key that fits first
        if path == key or path.startswith(key + "."):
            return lookup(mapping[key], path[len(key) + 1:], default)
    return default


def flatten(value, prefix=""):
    """{dotted path: scalar} of every number, string, bool or null below value (lists by index)."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix: value}
    flat = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def rows(records):
    """One flat dict per analysed run: run, prior, member, knob, value, then every scalar metric."""
    found = []
    for record in records:
        if record.metrics is None:
            continue
        found.append({"run": record.run, "configuration": record.configuration, "prior": record.prior,
                      "member": record.member.get("name"), "knob": record.knob or "baseline",
                      "value": json.dumps(record.value) if record.knob else "",
                      **flatten(record.metrics)})
    return found


def write_csv(records, path):
    """Write one CSV row per analysed run; returns the number of rows."""
    table = rows(records)
    columns = list(dict.fromkeys(column for row in table for column in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows(table)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(buffer.getvalue(), encoding="utf-8")
    return len(table)


def _cell(metrics, path):
    """A table cell: the value, with its interval when the metric has one."""
    value = lookup(metrics, path)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    interval = lookup(metrics, path.rsplit(".", 1)[0] + ".interval")
    if path.endswith(".joint") and isinstance(interval, list) and len(interval) == 2:
        return f"{value:.3f} [{interval[0]:.2f}, {interval[1]:.2f}]"
    return f"{value:.3f}"


def table(records):
    """A compact text table of the analysed runs: configuration, prior and the headline metrics."""
    lines = [["configuration", "prior", *(heading for heading, _ in COLUMNS)]]
    for record in records:
        if record.metrics is not None:
            lines.append([record.swept, str(record.prior), *(_cell(record.metrics, path) for _, path in COLUMNS)])
    if len(lines) == 1:
        return "no analysed runs yet"
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def knob_value(settings, knob):
    """The value a dotted knob path has in resolved settings (the baseline's value for a swept knob)."""
    node = settings
    for key in knob.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def series(records, knob, path):
    """{prior: [(value, metric, interval or None)]} along one knob, the baseline included, in run order."""
    found = {}
    for record in records:
        if record.metrics is None or record.knob not in (None, knob):
            continue
        value = record.value if record.knob == knob else knob_value(record.settings, knob)
        metric = lookup(record.metrics, path + ".joint" if path.startswith("coverage") else path)
        interval = lookup(record.metrics, path + ".interval") if path.startswith("coverage") else None
        if isinstance(metric, (int, float)):
            found.setdefault(record.prior, []).append((value, metric, interval))
    return found


def positions(points):
    """x positions of a series' values: the values themselves when numeric, else category indices."""
    values = [point[0] for point in points]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return values, None
    labels = list(dict.fromkeys(json.dumps(v) for v in values))
    return [labels.index(json.dumps(v)) for v in values], labels


def draw_comparison(records, figure):
    """One row of panels per swept knob: each headline metric against the knob's value, a line per prior."""
    knobs = sorted({record.knob for record in records if record.knob is not None})
    axes = figure.subplots(max(1, len(knobs)), len(FIGURE_METRICS), squeeze=False)
    for row, knob in enumerate(knobs):
        for column, (title, path) in enumerate(FIGURE_METRICS):
            ax = axes[row][column]
            for prior, points in series(records, knob, path).items():
                x, labels = positions(points)
                order = sorted(range(len(x)), key=x.__getitem__)
                x, points = [x[i] for i in order], [points[i] for i in order]
                line, = ax.plot(x, [p[1] for p in points], marker="o", label=str(prior))
                bands = [p[2] for p in points]
                if all(isinstance(band, list) and len(band) == 2 for band in bands):
                    ax.fill_between(x, [b[0] for b in bands], [b[1] for b in bands], color=line.get_color(),
                                    alpha=0.15)
                if labels:
                    ax.set_xticks(range(len(labels)), labels)
            if path.startswith("coverage."):
                ax.axhline(float(path.split(".", 1)[1]), color="grey", linestyle=":", linewidth=1)  # nominal
            ax.set_xlabel(knob)
            ax.set_title(title)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend()
    return len(knobs)
