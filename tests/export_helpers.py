"""A figure's tidy CSV table, checked the way a download would read it (shared by the CSV tests), and the records a
page's figures export."""

from __future__ import annotations

import csv
import io
from typing import Any

from app.export import data_csv, table_registry, table_rows


def tidy_rows(data: Any, name: str) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """(the figure's table rows, its CSV read back): the figure has a TABLES entry, every cell is a plain value
    (no dict, list or tuple), and the CSV download parses back into exactly those rows."""
    assert name in table_registry(), f"{name} has no TABLES entry"
    rows = table_rows(data, name)
    for row in rows:
        for key, value in row.items():
            assert not isinstance(value, (dict, list, tuple, set)), f"{name}: cell {key} holds {value!r}"
    parsed = list(csv.DictReader(io.StringIO(data_csv(data, name))))
    assert len(parsed) == len(rows)
    for row, back in zip(rows, parsed):
        assert back == {k: "" if v is None else str(v) for k, v in row.items()}
    return rows, parsed


def capture_records(monkeypatch: Any) -> dict[str, Any]:
    """{figure name: the provenance record its exports carry, as the download buttons read it}, filled as pages
    draw (`app.export.export_buttons` wrapped for the test)."""
    from app import export

    records: dict[str, Any] = {}
    original = export.export_buttons

    def record(fig, data, name, provenance=None, figure=None):
        records[name] = export.record_of(data, provenance)
        return original(fig, data, name, provenance, figure)

    monkeypatch.setattr(export, "export_buttons", record)
    return records
