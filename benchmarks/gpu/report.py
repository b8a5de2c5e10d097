"""One part's results, written to disk after every row (a part cut off by its time budget
still says what it measured), and the markdown table of all parts."""

from __future__ import annotations

import json
import os
import time


class Unavailable(RuntimeError):
    """The part cannot run in this environment (e.g. torch not installed): reported, not a crash."""


class Report:
    """Rows of one part: (metric, value, unit, note), saved to `path` as each one arrives."""

    def __init__(self, part: str, path: str):
        self.path = path
        self.data = dict(part=part, status="running", seconds=0.0, error=None, rows=[])
        self._t0 = time.perf_counter()
        self._save()

    def add(self, metric: str, value, unit: str = "", note: str = "") -> None:
        if isinstance(value, float):
            value = float(f"{value:.4g}")
        self.data["rows"].append(dict(metric=metric, value=value, unit=unit, note=note))
        print(f"  {metric}: {value} {unit} {note}".rstrip(), flush=True)
        self._save()

    def finish(self, status: str, error: str | None = None) -> None:
        self.data.update(status=status, error=error)
        self._save()

    def _save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self._t0, 1)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def rows_of(results_dir: str, part: str) -> dict:
    """metric -> value of a part already run (the peer reads the thinker's decode times)."""
    data = read(os.path.join(results_dir, f"{part}.json")) or {}
    return {r["metric"]: r["value"] for r in data.get("rows", [])}


def _cell(x) -> str:
    return str(x if x is not None else "").replace("|", "\\|").replace("\n", " ")


def markdown(header: dict, parts: list[dict]) -> str:
    """A summary table (one line per part), then every part's rows."""
    lines = [f"# GPU check ({header['size']})", "", " ".join(f"{k}: {v};" for k, v in header.items()), "",
             "| part | status | seconds | budget | error |", "| --- | --- | --- | --- | --- |"]
    for p in parts:
        lines.append(f"| {p['part']} | {p['status']} | {p['seconds']} | {p.get('budget', '')} | "
                     f"{_cell((p.get('error') or '')[:300])} |")
    lines += ["", "| part | metric | value | unit | note |", "| --- | --- | --- | --- | --- |"]
    for p in parts:
        for r in p.get("rows", []):
            lines.append(f"| {p['part']} | {_cell(r['metric'])} | {_cell(r['value'])} | {_cell(r['unit'])} | "
                         f"{_cell(r['note'])} |")
    return "\n".join(lines) + "\n"
