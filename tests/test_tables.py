"""Tables for people (precision_lab.tables): number formats, worded headers, escaping, no cut cells."""
import math
import re

import numpy as np
import pandas as pd
import pytest

from precision_lab import tables
from precision_lab.tables import format_cosine, format_number, format_percent, format_range


@pytest.mark.parametrize("value, text", [
    (0.00602, "0.00602"), (1.0, "1.00"), (0.5, "0.500"), (38.204, "38.2"), (7503.2, "7500"),
    (2.59e7, "2.59×10⁷"), (1.99e-6, "1.99×10⁻⁶"), (-3.2e-5, "−3.20×10⁻⁵"), (0.0, "0"),
    (9.9951e-4, "0.00100"),  # rounds up across the scientific threshold: fixed notation, 3 digits
    (9.9996e3, "1.00×10⁴"),  # rounds up into scientific notation: mantissa stays below 10
    (0.0009994, "9.99×10⁻⁴"), (math.inf, "∞"), (math.nan, "—"), (None, "—"),
])
def test_numbers_have_three_significant_digits_and_scientific_notation_at_the_ends(value, text):
    assert format_number(value) == text


def test_integers_stay_whole_and_large_counts_are_grouped():
    assert format_number(1024) == "1024"
    assert format_number(np.int64(2097152)) == "2\u202f097\u202f152"
    assert format_number(True) == "yes"


@pytest.mark.parametrize("fraction, text", [(1.0, "100%"), (0.639, "63.9%"), (0.0, "0%"), (0.9996, "99.96%"),
                                            (0.999999, "99.9999%"), (0.0026814, "0.268%")])
def test_percentages_never_round_to_one_hundred_unless_exact(fraction, text):
    assert format_percent(fraction) == text


def test_cosine_near_one_shows_its_distance_from_one():
    assert format_cosine(1.0) == "1"
    assert format_cosine(1 - 2e-7) == "1 − 2.00×10⁻⁷"
    assert format_cosine(0.72684) == "0.727"


def test_ranges_say_identical_when_both_ends_are_zero():
    assert format_range(0.049, 0.29) == "0.0490–0.290"
    assert format_range(0.0, 0.0) == "0 (identical)"
    assert format_range(2.79e-9, 2.79e-9) == "2.79×10⁻⁹"


def test_known_columns_have_worded_headers_with_units():
    assert tables.column("grad_rel_err").label == "gradient error (relative, ∞-norm)"
    assert tables.column("seconds").label.endswith("(s)")
    assert tables.column("fortran-replay-flip_max_abs").label == "fortran-replay-flip − PyTorch: max |difference|"
    assert tables.column("some_new_thing").label == "some new thing"  # unknown: words, never snake_case
    experiment_columns = ["sgd_stored_update_rel_err", "adam_sign_only_fraction", "weights_hide_by", "err_over_uS",
                          "alpha_vs_S", "max_distance_over_envelope", "worst_bound_ratio", "time_vs_native"]
    for name in experiment_columns:
        assert "_" not in tables.column(name).label, name


def _cells(html: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", html)]


def test_table_has_no_index_column_no_cut_cells_and_escapes_user_text():
    long_text = "layout (flip HW): worst conv2.weight error ÷ bound = 7.50×10³; " * 6
    frame = pd.DataFrame({"candidate": ["<script>alert(1)</script>", "native"], "verdict": ["layout", "roundoff"],
                          "headline": [long_text, "fine"], "grad_rel_err": [0.8126, 1.99e-6]}, index=[7, 8])
    html = tables.table_html(frame)
    assert "<script>" not in html and "&lt;script&gt;" in html
    cells = _cells(html)
    assert cells[:4] == ["candidate", "verdict", "headline", "gradient error (relative, ∞-norm)"]  # no index header
    assert "7" not in cells and "8" not in cells  # the frame's index is not shown
    assert long_text.strip() in html  # the whole text, never cut
    assert "..." not in html and "…" not in html
    assert "0.813" in cells and "1.99×10⁻⁶" in cells
    assert 'class="verdict verdict-layout"' in html and 'class="verdict verdict-roundoff"' in html
    assert 'class="lab-legend"' in html and "a transpose and/or flip" in html  # the legend names each verdict
    assert "defect" not in html.split('class="lab-legend"')[1]  # only the verdicts shown


def test_a_pivot_keeps_its_row_labels_as_the_first_column():
    floor = pd.DataFrame({"member": ["a", "a", "b", "b"], "quantity": ["x", "y", "x", "y"], "bound_ratio": [0.1, 0.2, 0.3, 0.4]})
    html = tables.table_html(floor.pivot(index="member", columns="quantity", values="bound_ratio"))
    assert _cells(html)[:3] == ["implementation", "x", "y"]


def test_show_prints_plain_text_for_text_frontends_and_html_for_jupyter():
    block = tables.show(pd.DataFrame({"candidate": ["native"], "ratio": [2.14e-10]}))
    assert "err64 ÷ err32" in str(block) and "2.14×10⁻¹⁰" in str(block)
    assert block._repr_html_().startswith("<style>")  # interactive Jupyter gets the stylesheet with the table


def test_context_is_a_definition_table_not_a_printed_dict(small_problem):
    block = tables.context("cpu" if False else __import__("torch").device("cpu"), small_problem,
                           extra=[("not run", "native-tf32: needs cuda")])
    html = block._repr_html_()
    assert "{'" not in html and "lab-context" in html
    text = str(block)
    assert "problem size: 64 × 64 pixels" in text and "batch: 2" in text and "seed: 0" in text
    assert "image source: synthetic micrographs" in text and "cuDNN: not used (CPU run)" in text


def test_reported_figures_keep_the_digits_they_were_given():
    assert [tables.format_reported(v) for v in (0.049, 0.29, 1e-6, 2.2e-5, 0.168)] == \
        ["0.049", "0.29", "1×10⁻⁶", "2.2×10⁻⁵", "0.168"]
    assert tables.column("seed_max_abs").kind == "reported"
