"""Campaigns: a grid of diagnoses on Dask, one Parquet table, a campaign report (docs/campaigns.md).

The parts, by concern:

* `spec`: the campaign spec (YAML) read and checked key by key; the grid's cells and their keys;
* `cell`: one cell diagnosed on a worker, and the rows it adds to the table;
* `store`: the table's schema, one Parquet part per finished cell, the consolidated table;
* `run`: the cells not finished yet, on a local Dask cluster, a scheduler, or in-process;
* `report`: the campaign report, one self-contained HTML page from the table;
* `cli`: `precision-lab campaign SPEC.yaml` (configure and main, as precision_lab.cli expects).

Importing the package loads none of Dask, pyarrow, pandas or torch: each part imports them where
it uses them.
"""
from .run import Outcome, run_campaign
from .spec import CampaignSpecError, Spec, load_spec
from .store import VARYING_COLUMNS, read_table

__all__ = ["CampaignSpecError", "Outcome", "Spec", "VARYING_COLUMNS", "load_spec", "read_table", "run_campaign"]
