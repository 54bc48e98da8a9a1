"""`GET /`: the monitor's page, one self-contained HTML document (inline CSS and SVG, no script,
no external asset) rendered from /status. It reloads itself every 10 seconds.

It shows the run's progress (step, total, tokens/s over the last 50 steps, ETA, counts of
warnings, rollbacks applied and restarts), the loss and the gradient norm of the last judged steps
against their bands (the shaded area runs from the robust level to the threshold; orange marks are
warnings, red marks rollbacks), each rank's forward time per step over the last straggler window
(stragglers marked), the hosts of a job over ssh (in use, spares, excluded and why), and the list
of events: every rollback decided, applied and cancelled, every restart and straggler, and the
newest warnings. The line is the timeline that went on; the
value judged at a step that was rolled back is a red mark labelled "VALUE (rolled back)" — at the
chart's top edge when it is above the normal range, as a spike usually is, so that the rest of the
chart keeps its scale.
"""

from __future__ import annotations

import datetime
import html
import math

WIDTH, HEIGHT, PAD = 640, 180, 36
CHARTS = (
    ("loss", "loss (shaded: its band, from the median to the threshold)"),
    ("grad_norm", "gradient norm (shaded: its band; orange: warning, red: rollback)"),
)
# Instability precursors (monitoring.protocol.PRECURSORS), drawn once a run reports them.
PRECURSOR_CHARTS = (
    ("attn_logit_max", "largest attention logit, over layers (a precursor)"),
    ("logit_lse_max", "largest log Z of the output logits (a precursor)"),
    ("logit_abs_max", "largest |output logit| (a precursor)"),
    ("update_ratio_max", "largest update / weight RMS, over layer groups (a precursor)"),
)


def _number(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _rolled_back(point: dict, name: str, x, y, lo: float, hi: float) -> str:
    """A red mark for the value judged at a step that was rolled back (no longer in the series),
    labelled with that value: a dot where it lies within the axis, else an arrow at the edge it is
    beyond (a spike is often 30x the normal range, which would flatten the rest of the chart)."""
    raw, value = point.get(name), _number(point.get(name))
    text = f"{value:.4g}" if value is not None else str(raw)
    px = x(point["step"])
    anchor, dx = ("end", -7) if px > WIDTH - 130 else ("start", 7)  # the label fits on its side
    if value is not None and lo <= value <= hi:
        mark, ty = f'<circle cx="{px:.1f}" cy="{y(value):.1f}" r="3.5"/>', y(value) - 5
    elif value is not None and value < lo:
        mark, ty = f'<path d="M{px:.1f},{HEIGHT - PAD / 2 + 10} l-5,-9 h10 z"/>', HEIGHT - PAD / 2 + 9
    else:  # above the axis, or not a number (NaN, Inf)
        mark, ty = f'<path d="M{px:.1f},3 l-5,9 h10 z"/>', 12
    return (
        f'<g class="rolled-back"><title>step {point["step"]}: {html.escape(name)} {html.escape(text)} judged, '
        f'rolled back</title>{mark}<text x="{px + dx:.1f}" y="{ty:.0f}" text-anchor="{anchor}">'
        f"{html.escape(text)} (rolled back)</text></g>"
    )


def chart(
    series: list[dict], name: str, title: str, rollbacks: list[int] = (), rolled_back: list[dict] = ()
) -> str:
    """An SVG line chart of `name` over the judged steps, with its band, marks at warnings and at
    the steps rollbacks were decided at, and the values judged at the steps that were rolled back
    (`rolled_back`: points of abandoned timelines, outside the axis' range when they are spikes)."""
    points = [(r["step"], _number(r.get(name))) for r in series]
    values = [v for _, v in points if v is not None]
    bands = [
        (r["step"], _number(r.get(f"{name}_level")), _number(r.get(f"{name}_threshold"))) for r in series
    ]
    values += [t for _, _, t in bands if t is not None]
    if not values:
        return f'<figure><figcaption>{html.escape(title)}</figcaption><p class="empty">no values yet</p></figure>'
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    steps = [s for s, _ in points]
    first = min(steps)
    rollbacks = [s for s in rollbacks if s >= first]  # (decided on a timeline that went on past the chart's)
    rolled_back = [p for p in rolled_back if p.get("step") is not None and p["step"] >= first]
    last = max(max(steps), *rollbacks, *(p["step"] for p in rolled_back), first + 1)

    def x(step: float) -> float:
        return PAD + (step - first) / (last - first) * (WIDTH - 2 * PAD)

    def y(value: float) -> float:
        return HEIGHT - PAD / 2 - (value - lo) / (hi - lo) * (HEIGHT - PAD)

    parts = [f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{html.escape(title)}">']
    band = [(s, lv, th) for s, lv, th in bands if lv is not None and th is not None]
    if band:
        upper = " ".join(f"{x(s):.1f},{y(th):.1f}" for s, _, th in band)
        lower = " ".join(f"{x(s):.1f},{y(lv):.1f}" for s, lv, _ in reversed(band))
        parts.append(f'<polygon class="band" points="{upper} {lower}"/>')
        parts.append(f'<polyline class="threshold" points="{upper}"/>')
    line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points if v is not None)
    parts.append(f'<polyline class="value" points="{line}"/>')
    marks = [(r["step"], "warn") for r in series if r.get("level") == "warn"]
    marks += [(step, "rollback") for step in rollbacks]
    for step, cls in marks:
        parts.append(
            f'<line class="{cls}" x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{PAD / 2}" '
            f'y2="{HEIGHT - PAD / 2}"><title>step {step}: {cls}</title></line>'
        )
    parts += [_rolled_back(point, name, x, y, lo, hi) for point in rolled_back]
    parts.append(
        f'<text x="2" y="{y(hi) + 4:.0f}">{hi:.4g}</text><text x="2" y="{y(lo):.0f}">{lo:.4g}</text>'
    )
    parts.append(f'<text x="{PAD}" y="{HEIGHT - 2}">step {first}</text>')
    parts.append(f'<text x="{WIDTH - PAD}" y="{HEIGHT - 2}" text-anchor="end">step {last}</text></svg>')
    return f"<figure><figcaption>{html.escape(title)}</figcaption>{''.join(parts)}</figure>"


WARNINGS_LISTED = 50  # the newest; every rollback and restart is listed


def _events(status: dict) -> list[tuple[int, str, str]]:
    """The table's rows, newest step first: every rollback (decided, applied, cancelled) and
    restart of the run, and the newest warnings (a run may warn often; it rolls back rarely)."""
    warnings = sorted(
        ((w.get("step") or 0, "warning", w.get("reason") or "") for w in status.get("warnings_recent") or []),
        reverse=True,
    )
    rows = warnings[:WARNINGS_LISTED]
    for d in status.get("rollbacks_decided") or []:
        rows.append(
            (
                d["step"],
                "rollback decided",
                f"{d.get('reason')} → {d.get('target')} (decision {d.get('decision')})" + _repeat(d),
            )
        )
    for a in status.get("rollbacks") or []:
        rows.append(
            (a.get("applied_at") or 0, "rollback applied", f"decision {a.get('decision')} → {a.get('tag')}")
        )
    for c in status.get("rollbacks_cancelled") or []:
        rows.append(
            (c.get("step") or 0, "rollback cancelled", f"decision {c.get('decision')}: {c.get('reason')}")
        )
    for r in status.get("restarts") or []:
        rows.append((r.get("step") or 0, "restart", str(r.get("reason", ""))))
    for s in status.get("stragglers") or []:
        factor = _number(s.get("factor"))
        times = f": {factor:.2f}x the median rank's forward time" if factor is not None else ""
        rows.append((s.get("step") or 0, "straggler", f"rank {s.get('rank')} on {s.get('host')}{times}"))
    order = ("warning", "rollback decided", "rollback applied", "rollback cancelled", "restart", "straggler")
    return sorted(rows, key=lambda row: (row[0], order.index(row[1])), reverse=True)


def _repeat(decided: dict) -> str:
    """What a repeated rollback added (monitor.on_repeat), e.g. ", repeat 2: windows quarantined,
    lr x0.5 for 100 steps"; empty for a plain rollback."""
    if not decided.get("repeat"):
        return ""
    measures = ["windows quarantined"] if decided.get("quarantine") else []
    if decided.get("lr_factor") is not None:
        measures.append(f"lr x{decided['lr_factor']:g} for {decided.get('lr_factor_steps')} steps")
    return f", repeat {decided['repeat']}: {', '.join(measures) or decided.get('stage')}"


def _ranks(status: dict) -> str:
    """The per-rank table: each rank's host, forward seconds per step (the median over the
    straggler window that ended at `ranks_step`) and its factor over the other ranks' median."""
    ranks = status.get("ranks") or []
    if not ranks:
        return ""
    named = {(s.get("rank"), s.get("host")) for s in status.get("stragglers") or []}
    rows = []
    for r in ranks:
        seconds, factor = _number(r.get("step_seconds")), _number(r.get("factor"))
        slow = (r.get("rank"), r.get("host")) in named
        cells = [
            str(r.get("rank")),
            str(r.get("host")),
            f"{seconds:.4f}" if seconds is not None else "–",
            (f"{factor:.2f}" if factor is not None else "–") + (" (straggler)" if slow else ""),
        ]
        row = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
        rows.append(f'<tr class="tripped">{row}</tr>' if slow else f"<tr>{row}</tr>")
    return (
        f'<h2>Ranks</h2><p class="sub">forward seconds per step, median over the straggler window to step '
        f"{html.escape(str(status.get('ranks_step')))}; × median: over the other ranks' median</p>"
        "<table><tr><th>rank</th><th>host</th><th>s/step</th><th>× median</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _hosts(status: dict) -> str:
    """The job's hosts over ssh (`status["job"]["hosts"]`): in use, spares, excluded and why."""
    hosts = (status.get("job") or {}).get("hosts")
    if not isinstance(hosts, dict):
        return ""
    rows = [(host, "in use", "") for host in hosts.get("in_use") or []] + [
        (host, "spare", "") for host in hosts.get("spares") or []
    ]
    rows += [(host, "excluded", str(why)) for host, why in (hosts.get("excluded") or {}).items()]
    cells = "".join(
        f"<tr><td>{html.escape(str(h))}</td><td>{role}</td><td>{html.escape(why)}</td></tr>"
        for h, role, why in rows
    )
    return f"<h2>Hosts</h2><table><tr><th>host</th><th>role</th><th>why</th></tr>{cells}</table>"


STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 700px; }
h1 { font-size: 1.3em; margin-bottom: 0.2em; } .sub { color: #666; margin-top: 0; }
.progress { background: #eee; height: 10px; border-radius: 5px; overflow: hidden; }
.progress div { background: #3b7dd8; height: 100%; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dt { color: #666; } dd { margin: 0; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figcaption { font-weight: 600; }
svg { width: 100%; height: auto; border: 1px solid #ddd; background: #fff; }
svg text { font-size: 10px; fill: #666; }
.band { fill: #3b7dd8; fill-opacity: 0.12; stroke: none; }
.threshold { fill: none; stroke: #3b7dd8; stroke-dasharray: 4 3; stroke-width: 1; }
.value { fill: none; stroke: #222; stroke-width: 1.3; }
.warn { stroke: #e69500; stroke-width: 2; } .rollback { stroke: #d62728; stroke-width: 2; }
.rolled-back { fill: #d62728; } svg .rolled-back text { fill: #d62728; font-weight: 600; }
table { border-collapse: collapse; width: 100%; } td, th { text-align: left; padding: 2px 8px 2px 0; }
th { color: #666; font-weight: normal; border-bottom: 1px solid #ddd; }
.tripped { color: #d62728; font-weight: 600; } .empty { color: #888; }
"""


def render_page(status: dict) -> str:
    step, total = status.get("step"), status.get("total_steps")
    done = 100 * step / total if step is not None and total else 0
    tps = status.get("tokens_per_second_last_50_steps")
    rows = (
        "".join(
            f"<tr><td>{s}</td><td>{html.escape(kind)}</td><td>{html.escape(text)}</td></tr>"
            for s, kind, text in _events(status)
        )
        or '<tr><td colspan="3" class="empty">no warnings or rollbacks</td></tr>'
    )
    pending = status.get("rollback_pending")
    facts = [
        ("step", f"{step if step is not None else '–'} / {total or '?'}"),
        ("tokens/s, last 50 steps", f"{tps:,.0f}" if tps else "–"),
        ("ETA", _duration(status.get("eta_seconds"))),
        ("warnings", str(status.get("warnings", 0))),
        ("updates skipped", str(status.get("updates_skipped", 0))),
        ("rollbacks applied", str(len(status.get("rollbacks") or []))),
        ("restarts", str(len(status.get("restarts") or []))),
        (
            "rollback pending",
            f"decision {pending['decision']} (step {pending['step']})" if pending else "none",
        ),
        ("checkpoint pinned", status.get("pinned") or "none"),
    ]
    breaker = (
        '<p class="tripped">circuit breaker tripped: the job was stopped</p>'
        if status.get("circuit_breaker")
        else ""
    )
    stopped = (status.get("escalation") or {}).get("stopped")
    if stopped:  # monitor.on_repeat's last stage: the diagnosis
        breaker = f'<p class="tripped">stopped: {html.escape(stopped)}</p>'

    series = status.get("series") or []
    rollbacks = [d["step"] for d in status.get("rollbacks_decided") or []]
    rolled_back = status.get("series_rolled_back") or []
    shown = [*CHARTS, *((n, t) for n, t in PRECURSOR_CHARTS if any(n in point for point in series))]
    charts = "\n".join(chart(series, name, title, rollbacks, rolled_back) for name, title in shown)
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="10">
<title>monitor: step {step if step is not None else "–"}</title><style>{STYLE}</style></head>
<body>
<h1>Training monitor</h1>
<p class="sub">{html.escape(str(status.get("run_dir", "")))} · updated {now}</p>
<div class="progress" title="{done:.1f}%"><div style="width: {done:.1f}%"></div></div>
{breaker}
<dl>{"".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in facts)}</dl>
{charts}
{_ranks(status)}
{_hosts(status)}
<h2>Events</h2>
<table><tr><th>step</th><th>event</th><th>detail</th></tr>{rows}</table>
<p class="sub">JSON: <a href="/status">/status</a> · Prometheus: <a href="/metrics">/metrics</a></p>
</body></html>
"""
