"""Results of an output root as records: what `nnpd.py report`, the tests and notebooks read.

    import results
    records = results.read_runs("outputs/default")
    results.lookup(records[0].metrics, "coverage.0.68.joint")
    results.write_csv(records, "results.csv")

A record is one run folder: its configuration (baseline, or the knob it changes and the
value), its cohort member, the resolved training settings, the training and analysis
states, the metrics of its complete analysis (None otherwise) and its model's training
history (`report` says under its table how each training ended: trainer.training_outcome).
`comparison_figure` draws what `report --plot` writes.
"""

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import store
import trainer
from settings import is_number

__all__ = [
    "read_runs",
    "lookup",
    "flatten",
    "write_csv",
    "report_text",
    "round_lines",
    "member_style",
    "comparison_figure",
    "comparison_png",
]


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
    history: dict | None = None  # the trained model's history (history.json of its model artifact)
    dropped: dict | None = None  # invalid simulations dropped per split (data.invalid = "drop"), from run.json

    @property
    def prior(self):
        """The member's prior (or its name, for experiments whose members have no prior)."""
        return self.member.get("prior", self.member.get("name"))

    @property
    def replica(self):
        """The member's replica (None for members without one)."""
        return self.member.get("replica")

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
    folders = (
        [root / run for run in runs] if runs is not None else sorted(p.parent for p in root.glob("runs/*/*/run.json"))
    )
    records = []
    for folder in folders:
        run = _read(folder / "run.json")
        if not run:
            continue
        analysis, metrics = analysis_and_metrics(root, folder)
        records.append(
            RunRecord(
                run=str(folder.relative_to(root)),
                configuration=run.get("configuration", folder.parent.name),
                knob=run.get("knob"),
                value=run.get("value"),
                member=run.get("member") or {},
                settings=run.get("settings") or {},
                status=_read(folder / "status.json").get("state", "none"),
                analysis=analysis,
                metrics=metrics,
                history=model_history(root, folder),
                dropped=run.get("dropped_simulations") if isinstance(run.get("dropped_simulations"), dict) else None,
            )
        )
    return records


def model_history(root, folder):
    """The training history of a run's model (None when the run records no model artifact)."""
    model = _read(folder / "artifacts.json").get("model")
    return (_read(Path(root) / str(model) / "history.json") or None) if model else None


def training_columns(history):
    """selected_epoch, final_validation_loss (the last epoch's validation BCE) and stopped_epoch (where patience
    ended training, or None) of a history."""
    history = history or {}
    validation = history.get("validation") or [{}]
    final = validation[-1].get("bce") if isinstance(validation[-1], dict) else None
    return {
        "selected_epoch": history.get("selected_epoch"),
        "final_validation_loss": final,
        "stopped_epoch": history.get("stopped_epoch"),
    }


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
    if (
        analysis.get("checksum") != store.record_checksum(analysis)
        or store.digest(metrics) != analysis.get("metrics")
        or not all((Path(root) / str(path) / store.MANIFEST).is_file() for path in references)
    ):
        return "damaged", None
    return state, metrics


def lookup(mapping, path, default=None):
    """The value at a dotted path; keys may themselves hold dots (levels such as "0.68")."""
    if path == "":
        return mapping
    if not isinstance(mapping, dict):
        return default
    for key in sorted(mapping, key=len, reverse=True):  # the longest key that fits first
        if path == key or path.startswith(key + "."):
            return lookup(mapping[key], path[len(key) + 1 :], default)
    return default


def flatten(value, prefix=""):
    """{dotted path: scalar} of every number, string, bool or null below value (lists by index)."""
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix: value}
    flat = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def swept_knobs(records):
    """The knobs the records' configurations change, sorted."""
    return sorted({record.knob for record in records if record.knob is not None})


def setting_text(value):
    """A setting's value in a CSV cell: strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def rows(records):
    """One flat dict per analysed run: its identity, every swept knob's value, its training, every scalar metric.

    knob and value name what the configuration changes ("baseline" and "" for the baseline);
    a column per swept knob holds that knob's value in every row, the baseline's included.
    """
    records = [record for record in records if record.metrics is not None]
    knobs = swept_knobs(records)
    found = []
    for record in records:
        found.append(
            {
                "run": record.run,
                "configuration": record.configuration,
                "prior": record.prior,
                "member": record.member.get("name"),
                "replica": record.replica,
                "knob": record.knob or "baseline",
                "value": setting_text(record.value) if record.knob else "",
                **{knob: setting_text(swept_value(record, knob)) for knob in knobs},
                **training_columns(record.history),
                **{f"dropped_{split}": count for split, count in (record.dropped or {}).items()},
                **flatten(record.metrics),
            }
        )
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
    return str(value) if isinstance(value, int) else f"{value:.3f}"  # counts as counts


def table(records, columns=()):
    """A compact text table of the analysed runs: configuration, prior and the study's headline metrics.

    `columns` are (heading, metric path) pairs, the analysis class's REPORT_COLUMNS (levels
    are keys such as "0.68"); a column no analysed run has a value for is left out (the exact
    likelihood's coverage of a study without one, say), a value some runs lack is `-`.
    """
    analysed = [record.metrics for record in records if record.metrics is not None]
    if not analysed:
        return "no analysed runs yet"
    columns = [(heading, path) for heading, path in columns if any(_cell(metrics, path) != "-" for metrics in analysed)]
    lines = [["configuration", "prior", *(heading for heading, _ in columns)]]
    for record in records:
        if record.metrics is not None:
            lines.append([record.swept, str(record.prior), *(_cell(record.metrics, path) for _, path in columns)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines)


def report_text(records, columns=(), warning_paths=()):
    """The table, then one line per warning of the analysed runs: what `run` and `report` print."""
    return "\n".join(
        [
            table(records, columns),
            *training_lines(records),
            *warning_lines(records, warning_paths),
            *dropped_lines(records),
            *round_lines(records),
        ]
    )


def training_lines(records):
    """One line per analysed run trained by the bundled trainer: how its training ended and the epoch it kept."""
    outcomes = [(record, trainer.training_outcome(record.history)) for record in records if record.metrics is not None]
    return [f"training: {record.swept} {record.prior}: {outcome}" for record, outcome in outcomes if outcome]


def round_lines(records):
    """One row per round of each run trained in rounds (its member's `history`, docs/rounds.md): the box,
    its share of the prior's volume and mass, the simulations (and whether half followed the previous posterior), the
    posterior mass near each cut face."""
    lines = []
    for record in records:
        for row in record.member.get("history") or ():
            edge = row.get("edge_mass")
            near = row.get("proposal") == "posterior"
            box = ", ".join(f"[{low:.4g}, {high:.4g}]" for low, high in zip(*row["box"]))
            lines.append(
                f"round {row['round']}: {record.swept} {record.prior}: box {box}, "
                f"{100 * row['volume']:.3g}% of the prior's volume, {100 * row['prior_mass']:.3g}% of its "
                f"mass, {row['simulations']:,} simulations"
                + (f" ({row['reused']:,} of earlier rounds)" if row.get("reused") else "")
                + (", half of train and validation near the previous posterior" if near else "")
                + ("" if edge is None else ", mass near cut faces " + " ".join(f"{m:.2g}" for m in edge))
            )
    return lines


def warning_lines(records, paths=()):
    """One line per analysed run and warning found at a metric path (the analysis class's REPORT_WARNINGS)."""
    return [
        f"{'note' if path.endswith('note') else 'warning'}: {record.swept} {record.prior}: "
        f"{lookup(record.metrics, path)}"
        for record in records
        if record.metrics is not None
        for path in paths
        if isinstance(lookup(record.metrics, path), str)
    ]


def dropped_lines(records):
    """One line per analysed run trained without some invalid simulations (data.invalid = "drop")."""
    lines = []
    for record in records:
        counts = {split: count for split, count in (record.dropped or {}).items() if is_number(count) and count > 0}
        if record.metrics is not None and counts:
            splits = ", ".join(f"{split} {count:,}" for split, count in counts.items())
            lines.append(
                f"note: {record.swept} {record.prior}: {sum(counts.values()):,} invalid simulations "
                f'dropped ({splits}; data.invalid = "drop")'
            )
    return lines


def knob_value(settings, knob):
    """The value a dotted knob path has in resolved settings (the baseline's value for a swept knob)."""
    node = settings
    for key in knob.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def swept_value(record, knob):
    """A record's value of a swept knob: the one its configuration sets, else its settings' (the baseline's)."""
    return record.value if record.knob == knob else knob_value(record.settings, knob)


def panel_point(metrics, path):
    """(value, Wilson interval or None, nominal level or None) of a figure panel's metric, or None if undefined.

    A path to a coverage level (a dict with `joint`) gives its joint coverage, its interval and its nominal level.
    """
    value = lookup(metrics, path)
    interval = nominal = None
    if isinstance(value, dict):
        level: dict = value
        value, interval, nominal = level.get("joint"), level.get("interval"), level.get("nominal")
    if not is_number(value):
        return None
    if not (isinstance(interval, list) and len(interval) == 2 and all(map(is_number, interval))):
        interval = None
    return value, interval, nominal if is_number(nominal) else None


def series(records, knob, path):
    """{member: (prior, replica, [(knob value, metric, interval or None)])} along one knob, the baseline included."""
    found: dict[str, Any] = {}
    for record in records:
        point = None if record.metrics is None else panel_point(record.metrics, path)
        if point is not None and record.knob in (None, knob):
            name = str(record.member.get("name", record.prior))
            points = found.setdefault(name, (record.prior, record.replica, []))[2]
            points.append((swept_value(record, knob), *point[:2]))
    return found


def knob_axis(records, knob):
    """(x position of a knob value, tick positions, tick labels): numeric values as they are, others as categories."""
    values = [swept_value(record, knob) for record in records if record.knob in (None, knob)]
    if all(is_number(value) for value in values):
        ticks = sorted(set(values))
        return (lambda value: value), ticks, [setting_text(tick) for tick in ticks]
    labels = list(dict.fromkeys(setting_text(value) for value in values))
    return (lambda value: labels.index(setting_text(value))), list(range(len(labels))), labels


MARKERS = ("o", "s", "^", "D", "v", "P")
LINESTYLES = ("-", "--", "-.", ":")


def member_style(priors, prior, replica):
    """Colour by prior; marker and line style by replica."""
    k = replica if isinstance(replica, int) else 0
    return f"C{priors.index(str(prior)) % 10}", MARKERS[k % len(MARKERS)], LINESTYLES[k % len(LINESTYLES)]


def nominal_lines(ax, records, path):
    """A dotted line at each nominal level the panel's metric has (coverage levels)."""
    points = [panel_point(record.metrics, path) for record in records]
    for nominal in sorted({point[2] for point in points if point and point[2] is not None}):
        ax.axhline(nominal, color="grey", linestyle=":", linewidth=1, label=f"nominal level {nominal:g}")


def error_bars(point, interval):
    """matplotlib's yerr of one point with its interval (None without)."""
    return None if interval is None else [[max(0.0, point - interval[0])], [max(0.0, interval[1] - point)]]


def wilson_entry(ax):
    """A legend entry saying what the error bars are."""
    ax.errorbar(
        [float("nan")],
        [float("nan")],
        yerr=[[0.0], [0.0]],
        color="grey",
        capsize=3,
        linestyle="none",
        label="bars: 95% Wilson interval",
    )


def draw_knob_panel(ax, records, knob, panel, priors):
    """One metric against one knob's value: a line per member, Wilson intervals as bars, the baseline marked."""
    title, path = panel
    position, ticks, labels = knob_axis(records, knob)
    found = series(records, knob, path)
    spacing = min([b - a for a, b in zip(ticks, ticks[1:])] or [1.0])
    wilson = False
    for k, (name, (prior, replica, points)) in enumerate(found.items()):
        shift = (k - (len(found) - 1) / 2) * 0.2 * spacing / len(found)  # members side by side at each value
        points = sorted(points, key=lambda point: position(point[0]))
        x = [position(point[0]) + shift for point in points]
        colour, marker, style = member_style(priors, prior, replica)
        ax.plot(x, [point[1] for point in points], marker=marker, linestyle=style, color=colour, label=name)
        for x_k, (_, value, interval) in zip(x, points):
            if interval is not None:
                ax.errorbar([x_k], [value], yerr=error_bars(value, interval), color=colour, capsize=3, linewidth=1)
                wilson = True
    baseline = [knob_value(record.settings, knob) for record in records if record.knob is None]
    if baseline:
        ax.axvline(
            position(baseline[0]),
            color="black",
            linestyle=(0, (1, 3)),
            linewidth=1,
            label=f"baseline: {knob} = {setting_text(baseline[0])}",
        )
    nominal_lines(ax, records, path)
    if len(ticks) <= 12:
        ax.set_xticks(ticks, labels)
    if wilson:
        wilson_entry(ax)
    ax.set(title=f"{title} against {knob}", xlabel=knob, ylabel=title)


def draw_prior_panel(ax, records, panel, priors):
    """One metric per prior, side by side: a point per member, with its Wilson interval where it has one."""
    title, path = panel
    wilson = False
    for i, prior in enumerate(priors):
        members = [record for record in records if str(record.prior) == prior]
        for k, record in enumerate(members):
            point = panel_point(record.metrics, path)
            if point is None:
                continue
            value, interval, _ = point
            colour, marker, _ = member_style(priors, prior, record.replica)
            ax.errorbar(
                [i + (k - (len(members) - 1) / 2) * 0.5 / len(members)],
                [value],
                yerr=error_bars(value, interval),
                fmt=marker,
                color=colour,
                capsize=4,
                label=str(record.member.get("name", prior)),
            )
            wilson |= interval is not None
    nominal_lines(ax, records, path)
    ax.set_xticks(range(len(priors)), priors)
    ax.set_xlim(-0.5, len(priors) - 0.5)
    if wilson:
        wilson_entry(ax)
    ax.set(title=f"{title} per prior", xlabel="prior", ylabel=title)


def row_legend(row):
    """One legend for a row of panels, right of its last panel: every line and marker of the row, once."""
    entries: dict[str, Any] = {}
    for ax in row:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        row[-1].legend(entries.values(), entries.keys(), loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")


def drawable_panels(records, panels):
    """The panels some analysed record has a value for."""
    return [
        panel
        for panel in panels
        if any(record.metrics is not None and panel_point(record.metrics, panel[1]) for record in records)
    ]


def draw_comparison(records, figure, panels):
    """The comparison figure's panels; returns how many panels a row has (0: nothing to draw).

    `panels` are (title, metric path) pairs, the analysis class's FIGURE_METRICS. With swept knobs,
    one row per knob: each metric against the knob's value, a line per member, the baseline included.
    Without, one row: each metric per prior, side by side.
    """
    records = [record for record in records if record.metrics is not None]
    panels = drawable_panels(records, panels)
    if not panels:
        return 0
    knobs = swept_knobs(records)
    priors = list(dict.fromkeys(str(record.prior) for record in records))
    axes = figure.subplots(max(1, len(knobs)), len(panels), squeeze=False)
    for row, knob in zip(axes, knobs or [None]):
        for ax, panel in zip(row, panels):
            if knob is None:
                draw_prior_panel(ax, records, panel, priors)
            else:
                draw_knob_panel(ax, records, knob, panel, priors)
        row_legend(row)
    return len(panels)


def comparison_figure(records, panels, title):
    """`report --plot`'s figure (a matplotlib Figure, titled), or None when there is nothing to draw."""
    count = len(drawable_panels(records, panels))
    if not count:
        return None
    from matplotlib.figure import Figure  # optional extra, imported only when drawing

    rows = max(1, len(swept_knobs([record for record in records if record.metrics is not None])))
    figure = Figure(figsize=(4.2 * count + 2.2, 3.6 * rows + 0.6), layout="constrained")
    draw_comparison(records, figure, panels)
    figure.suptitle(title)
    return figure


def comparison_png(records, panels, title, dpi=120):
    """The comparison figure as PNG bytes, or None when there is nothing to draw."""
    figure = comparison_figure(records, panels, title)
    if figure is None:
        return None
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
