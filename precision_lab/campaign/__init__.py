"""Campaigns: a grid of diagnoses on Dask, one Parquet table, a campaign report."""
from .spec import CampaignSpecError, VARYING_COLUMNS, configure, load_spec, main, read_table, run_campaign

__all__ = ["CampaignSpecError", "VARYING_COLUMNS", "configure", "load_spec", "main", "read_table", "run_campaign"]
