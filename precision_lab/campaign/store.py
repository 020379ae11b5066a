"""The campaign's table: one Parquet part per finished cell, consolidated into one file.

`OUT/cells/<key>.parquet` holds one finished cell (written to a temporary name and renamed, so a
killed campaign keeps every finished cell and never a half-written one); `OUT/campaign.parquet`
holds all cells of the spec, rewritten atomically at the end of every run; one row per cell and
quantity (docs/campaigns.md, "The table").
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .spec import Cell

#: columns that describe how a run went, not what it found (excluded when two runs are compared)
VARYING_COLUMNS = ("seconds", "problem_seconds", "diagnose_seconds", "started", "worker", "torch_threads")
#: evidence columns per quantity (precision_lab.compare.QuantityVerdict), numbers then words
QUANTITY_NUMBERS = ("max_abs_err", "mean_abs_err", "max_rel_err", "bound_ratio", "bound_max", "ulps", "cosine",
                    "sign_agreement", "exceeding", "second_ratio", "n_terms", "relu_flips")
QUANTITY_TEXTS = ("layout_fix", "format", "cause", "evidence")


def schema():
    import pyarrow as pa

    text, integer, number = pa.string(), pa.int64(), pa.float64()
    columns = [
        ("campaign", text), ("key", text), ("status", text), ("error", text),
        ("candidate", text), ("candidate_name", text), ("ran_as", text), ("family", text), ("expected", text),
        ("candidate_sha256", text), ("image", text), ("image_label", text), ("seed", integer), ("height", integer),
        ("width", integer), ("batch", integer), ("flags", text), ("flags_applied", text), ("probes", text),
        ("model", text), ("device", text), ("device_name", text),
        ("verdict", text), ("claimed_precision", text), ("decided_by", text), ("detail", text),
        ("worst_quantity", text), ("worst_bound_ratio", number),
        ("quantity", text), ("problem", text), ("quantity_verdict", text),
        *[(name, integer if name in ("exceeding", "n_terms", "relu_flips") else number) for name in QUANTITY_NUMBERS],
        ("elements", integer), *[(name, text) for name in QUANTITY_TEXTS],
        ("command", text), ("seconds", number), ("problem_seconds", number), ("diagnose_seconds", number),
        ("started", text), ("worker", text), ("torch_threads", integer),
        ("precision_lab_version", text), ("torch_version", text), ("numpy_version", text),
    ]
    return pa.schema(columns)


def write_part(rows: list[dict], folder: Path) -> Path:
    """One cell's rows as `folder/<key>.parquet`: a temporary file renamed into place (atomic on POSIX)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sch = schema()
    table = pa.Table.from_pylist([{name: row.get(name) for name in sch.names} for row in rows], schema=sch)
    final = folder / f"{rows[0]['key']}.parquet"
    temporary = folder / f".{final.name}.{os.getpid()}.tmp"
    pq.write_table(table, temporary)
    os.replace(temporary, final)
    return final


def finished_keys(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.parquet")} if folder.is_dir() else set()


def failed_keys(folder: Path, keys) -> set[str]:
    import pyarrow.parquet as pq

    failed = set()
    for key in keys:
        status = pq.read_table(folder / f"{key}.parquet", columns=["status"]).column("status").to_pylist()
        if "failed" in status:
            failed.add(key)
    return failed


def consolidate(cells: list[Cell], folder: Path, out_file: Path):
    """Every finished cell of the spec, in grid order, as one table written atomically; returns it (pandas)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = [folder / f"{c.key}.parquet" for c in cells if (folder / f"{c.key}.parquet").exists()]
    table = pa.concat_tables([pq.read_table(p, schema=schema()) for p in parts]) if parts else schema().empty_table()
    temporary = out_file.with_name(f".{out_file.name}.{os.getpid()}.tmp")
    pq.write_table(table, temporary)
    os.replace(temporary, out_file)
    return table.to_pandas()


def read_table(out: str | Path):
    """The consolidated table of a campaign folder (pandas)."""
    import pandas as pd

    return pd.read_parquet(Path(out) / "campaign.parquet")

