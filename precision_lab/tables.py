"""Tables for people: headers in words with units, numbers to three significant digits, verdicts
coloured with a legend, run context as a small definition table. The index, every notebook report
and a diagnosis page use the same pieces and the same stylesheet (templates/report.css).

A notebook shows a table with ``tables.show(frame)``: an HTML block (escaped text, CSS classes
only, no inline styles: the report sanitizer keeps classes) with no index column and no cell
ever cut short. Columns are named in the problem's words through COLUMNS; a column the table
does not know is shown with its name in words (underscores become spaces).
"""
from __future__ import annotations

import html
import math
import numbers
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STYLESHEET = Path(__file__).resolve().parent / "templates" / "report.css"

#: what each verdict means, as the legend under a verdict column says it (docs/design.md, "Verdicts")
VERDICT_MEANINGS = {
    "roundoff": "within the rounding bound of the claimed precision",
    "reduced-precision": "beyond it, but a coarser format (TF32, bfloat16, float16) explains it",
    "layout": "a transpose and/or flip of the weight axes makes it match",
    "defect": "nothing above explains it: a bug",
    "inconclusive": "within a bound too large against the quantity to tell rounding from a lost gradient",
}

#: below this magnitude (and from SCIENTIFIC_ABOVE up) a number is written as m.mm×10ᵉ
SCIENTIFIC_BELOW, SCIENTIFIC_ABOVE = 1e-3, 1e4
SIGNIFICANT = 3
_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")
#: a narrow no-break space groups the digits of large counts (SI style: 2 097 152)
_THIN = "\u202f"


@dataclass(frozen=True)
class Column:
    """How a column is shown: its header in words (with units) and the kind of its values."""

    label: str
    kind: str = "number"  # number | reported | percent | factor | count | cosine | text | verdict | bool


_REL = "(relative, ∞-norm)"
#: every column the experiments' tables carry, in words; the kind decides the number format
COLUMNS: dict[str, Column] = {
    # who and what
    "candidate": Column("candidate", "text"), "member": Column("implementation", "text"),
    "algorithm": Column("algorithm", "text"), "experiment": Column("experiment", "text"),
    "parameter": Column("parameter", "text"), "quantity": Column("quantity", "text"),
    "verdict": Column("verdict", "verdict"), "overall": Column("overall verdict", "verdict"),
    "overall_verdict": Column("overall verdict", "verdict"), "headline": Column("headline", "text"),
    "finding": Column("finding", "text"), "signature": Column("scaling signature", "text"),
    "layout_fix": Column("transform that matches", "text"), "format": Column("format that explains it", "text"),
    "evidence": Column("evidence", "text"), "action": Column("what to do", "text"),
    "setting": Column("setting", "text"), "kernel": Column("kernel", "text"), "role": Column("role", "text"),
    "claimed_precision": Column("claimed precision", "text"),
    # 01 optimizer step
    "grad_rel_err": Column(f"gradient error {_REL}"),
    "sgd_update_rel_err": Column(f"SGD update lr·g error {_REL}"),
    "sgd_weight_rel_err": Column(f"weights after SGD, error {_REL}"),
    "sgd_stored_update_rel_err": Column(f"stored update w′ − w, error {_REL}"),
    "weights_hide_by": Column("weights hide the gradient error by", "factor"),
    "masking_factor": Column("masking factor lr·‖g‖∞ ÷ ‖w′‖∞"),
    "error_visible_in_weights": Column("elements where the error changes the float32 weights", "percent"),
    "adam_update_rel_err": Column(f"Adam first update, error {_REL}"),
    "adam_identical_fraction": Column("Adam steps equal to float64's (within 0.1% of lr)", "percent"),
    "adam_sign_only_fraction": Column("float64 Adam steps equal to lr·sign(g)", "percent"),
    "sign_agreement": Column("gradient signs agreeing", "percent"),
    "final_weight_distance": Column("final weight distance ‖w − w₆₄‖₂ ÷ ‖w₆₄‖₂"),
    "final_envelope_distance": Column("final envelope edge (same norm)"),
    "max_distance_over_envelope": Column("weight distance ÷ envelope edge, worst step", "factor"),
    "inside_envelope": Column("inside the envelope (×10 margin)", "bool"),
    "update_rel_err": Column(f"SGD update error {_REL}"), "weight_rel_err": Column(f"weights after SGD, error {_REL}"),
    # 02 float64 recompilation
    "err32": Column("float32 build, max |error|"), "err64": Column("float64 build, max |error|"),
    "ratio": Column("err64 ÷ err32"), "expected_ratio_if_rounding": Column("err64 ÷ err32 if rounding (u₆₄ ÷ u₃₂)"),
    "worst_ratio": Column("worst err64 ÷ err32"),
    # 03 size sweep
    "size": Column("image size (pixels per side)", "count"), "n": Column("terms per sum n = batch·H·W", "count"),
    "n_terms": Column("terms per sum n", "count"), "batch": Column("batch", "count"),
    "err_over_uS": Column("max |error| ÷ (u₃₂·S)"), "err_over_grad": Column("max |error| ÷ max |g|"),
    "alpha_vs_S": Column("exponent α of error ÷ (u·S) ∝ nᵅ"), "beta_vs_grad": Column("exponent β of error ÷ |g| ∝ nᵝ"),
    "min_err_over_grad": Column("smallest max |error| ÷ max |g| over sizes"),
    "max_bound_ratio": Column("largest error ÷ bound over sizes"),
    "sqrt_n": Column("√n"), "log2_n": Column("log₂ n"),
    # evidence of a judgement (precision_lab.verdict.QuantityVerdict)
    "max_abs_err": Column("max |error|"), "mean_abs_err": Column("mean |error|"),
    "max_rel_err": Column("max relative error"), "bound_ratio": Column("max error ÷ bound (≤ 1: rounding)"),
    "worst_bound_ratio": Column("worst error ÷ bound (≤ 1: rounding)"),
    "ulps": Column("max error (ulps)"), "cosine": Column("cosine similarity", "cosine"),
    "exceeding": Column("elements beyond the bound", "count"), "bound_max": Column("largest bound (max over elements)"),
    "second_ratio": Column("second-largest error ÷ bound"), "relu_flips": Column("ReLU masks flipped", "count"),
    # 04 motivating case
    "seed_max_abs": Column("seed's report: max |difference|", "reported"),
    "seed_mean_abs": Column("seed's report: mean |difference|", "reported"),
    "gradient_scale": Column("max |value| (float64)"),
    "log10_replay_over_seed": Column("log₁₀(replay ÷ seed), max differences"),
    # probes (precision_lab.decision.Diagnosis.probe_rows)
    "probe": Column("probe (what ran)", "text"), "image": Column("image (H × W)", "text"), "seed": Column("seed", "count"), "targets": Column("targets", "text"),
    "named": Column("what names it", "text"), "worst_quantity": Column("worst quantity", "text"),
    "probes": Column("probes", "text"), "probed": Column("probed", "bool"),
    # 05 convolution algorithms
    "seconds": Column("forward + backward time (s)"), "time_vs_native": Column("time ÷ native", "factor"),
    "seconds_at_largest": Column("time at the largest size (s)"),
    "time_vs_native_at_largest": Column("time ÷ native at the largest size", "factor"),
}

#: columns named after a candidate: `<candidate>_max_abs` and `<candidate>_mean_abs` (04)
_PER_CANDIDATE = re.compile(r"^(?P<who>.+)_(?P<what>max_abs|mean_abs)$")


def column(name: str) -> Column:
    """The column's header and kind; an unknown column keeps its name, in words."""
    if name in COLUMNS:
        return COLUMNS[name]
    match = _PER_CANDIDATE.match(str(name))
    if match:
        what = "max" if match["what"] == "max_abs" else "mean"
        return Column(f"{match['who']} − PyTorch: {what} |difference|")
    return Column(str(name).replace("_", " "), "number")


# ---------------------------------------------------------------------------------------------
# numbers


def _missing(value) -> bool:
    """None, NaN (float or numpy) or pandas' NA."""
    if value is None or type(value).__name__ in ("NAType", "NaTType"):
        return True
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return math.isnan(float(value))
    return False


def format_number(value, significant: int = SIGNIFICANT) -> str:
    """`value` to `significant` digits; m.mm×10ᵉ below 10⁻³ and from 10⁴ up; '—' when missing.

    Trailing zeros are kept (3 significant digits read as such: 1.00, 0.500); integers are
    written whole (1024), large ones grouped (2 097 152).
    """
    if _missing(value):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return _group(int(value))
    value = float(value)
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    if value == 0:
        return "0"
    rounded = float(f"{value:.{significant - 1}e}")
    exponent = math.floor(math.log10(abs(rounded)))
    if abs(rounded) < SCIENTIFIC_BELOW or abs(rounded) >= SCIENTIFIC_ABOVE:
        mantissa = rounded / 10 ** exponent
        if abs(mantissa) >= 10:  # 9.995e-4 rounds up to 1.00e-3
            mantissa, exponent = mantissa / 10, exponent + 1
        sign = "−" if mantissa < 0 else ""
        return f"{sign}{abs(mantissa):.{significant - 1}f}×10{str(exponent).translate(_SUPERSCRIPT)}"
    decimals = max(0, significant - 1 - exponent)
    text = f"{abs(rounded):.{decimals}f}"
    return ("−" if rounded < 0 else "") + text


def _group(n: int) -> str:
    text = str(abs(n))
    if abs(n) >= 10_000:
        text = f"{abs(n):,}".replace(",", _THIN)
    return ("−" if n < 0 else "") + text


def format_percent(fraction) -> str:
    """A fraction as a percentage to 3 significant digits; never rounds to 100% unless exact."""
    if _missing(fraction):
        return "—"
    percent = 100.0 * float(fraction)
    if percent in (0.0, 100.0):
        return f"{percent:.0f}%"
    text = format_number(percent)
    if percent < 100 and "×" not in text and float(text) >= 100:  # 99.996% must not read as 100%
        decimals = 1
        while float(f"{percent:.{decimals}f}") >= 100:
            decimals += 1
        text = f"{percent:.{decimals}f}"
    return f"{text}%"


def format_factor(value) -> str:
    """A ratio read as 'so many times': 38.2×, 1.23×10³×."""
    return "—" if _missing(value) else f"{format_number(value)}×"


def format_cosine(value) -> str:
    """Cosine similarity close to 1 written as 1 − δ, so 0.9999999 does not read as 1.00."""
    if _missing(value):
        return "—"
    value = float(value)
    if value == 1.0:
        return "1"
    if 0.999 < value < 1.0:
        return f"1 − {format_number(1.0 - value)}"
    return format_number(value)


def format_range(low, high) -> str:
    """'0.0490–0.290'; one value when both agree; 'none (identical)' when both are exactly 0."""
    if _missing(low) or _missing(high):
        return "—"
    if float(low) == 0 and float(high) == 0:
        return "0 (identical)"
    first, second = format_number(low), format_number(high)
    return first if first == second else f"{first}–{second}"


def format_reported(value) -> str:
    """A figure someone else reported, with the digits they gave (0.049, 2.2×10⁻⁵, 1×10⁻⁶): never padded."""
    if _missing(value):
        return "—"
    mantissa = np.format_float_scientific(float(value), unique=True).split("e")[0]
    digits = len(mantissa.replace(".", "").replace("-", "").rstrip("0")) or 1
    return format_number(value, significant=digits)


def format_value(value, kind: str = "number") -> str:
    """One cell's text for a column of `kind` (Column.kind)."""
    if kind == "reported":
        return format_reported(value)
    if kind == "percent":
        return format_percent(value)
    if kind == "factor":
        return format_factor(value)
    if kind == "cosine":
        return format_cosine(value)
    if kind == "bool":
        return "—" if _missing(value) else ("yes" if bool(value) else "no")
    if kind in ("text", "verdict"):
        return "—" if _missing(value) else str(value)
    if kind == "count" and not _missing(value) and float(value) == int(float(value)):
        return _group(int(float(value)))
    if isinstance(value, str):
        return value
    return format_number(value)


# ---------------------------------------------------------------------------------------------
# HTML


class HtmlBlock:
    """HTML that a notebook displays (Jupyter calls _repr_html_) and prints as plain text.

    The HTML carries the stylesheet in a <style> block for interactive Jupyter; the report
    sanitizer drops that block and the report template supplies the same sheet once per page.
    """

    def __init__(self, body: str, text: str = ""):
        self.body, self.text = body, text

    def _repr_html_(self) -> str:
        return f"<style>{stylesheet()}</style>{self.body}"

    def __str__(self) -> str:
        return self.text or re.sub(r"<[^>]+>", "", self.body)

    __repr__ = __str__


def stylesheet() -> str:
    return STYLESHEET.read_text(encoding="utf-8")


def page(heading: str, body: str, max_width: str = "75em") -> str:
    """A self-contained HTML page (the lab's stylesheet inline, nothing fetched) with `heading` as h1."""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<title>{escape(heading)}</title>
<style>
{stylesheet()}
 body {{ font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: {max_width}; color: #222; padding: 0 1em; }}
 h1 {{ font-size: 1.6em; margin-bottom: .3em; }} h2 {{ margin-top: 1.4em; border-bottom: 1px solid #ddd; }}
</style>
</head>
<body>
<h1>{escape(heading)}</h1>
{body}
</body>
</html>
"""


def escape(text) -> str:
    return html.escape(str(text), quote=True)


def verdict_class(verdict) -> str:
    """CSS class of a verdict chip: verdict-roundoff, verdict-layout … (verdict-none otherwise)."""
    return "verdict-" + (re.sub(r"[^a-z0-9-]", "", str(verdict).lower()) or "none")


def verdict_chip(text, verdict=None) -> str:
    """A coloured verdict label; `text` may add its detail ('layout (flip HW)'), `verdict` picks the colour."""
    return f'<span class="verdict {verdict_class(verdict if verdict is not None else text)}">{escape(text)}</span>'


def verdict_legend(verdicts=None) -> str:
    """A line of coloured chips with what each verdict means (all four when `verdicts` is None)."""
    shown = [v for v in VERDICT_MEANINGS if verdicts is None or v in set(verdicts)]
    items = "".join(f'<span class="lab-legend-item">{verdict_chip(v)}{escape(VERDICT_MEANINGS[v])}</span>' for v in shown)
    return f'<div class="lab-legend">Verdicts: {items}</div>' if items else ""


def _labelled_rows_as_column(frame):
    """A named index (a pivot's or a groupby's rows) becomes the first column; pandas' positional one is dropped."""
    import pandas as pd

    if isinstance(frame.index, pd.MultiIndex) or frame.index.name is not None:
        return frame.reset_index()
    return frame


def table_html(frame, columns=None, labels: dict | None = None, caption: str | None = None,
               table_id: str | None = None, legend: bool = True) -> str:
    """`frame` as an escaped HTML table for people (no index column, no cut cells); a legend follows
    when a verdict column is shown. A named index (a pivot's rows) becomes the first column."""
    frame = _labelled_rows_as_column(frame)
    columns = list(frame.columns) if columns is None else list(columns)
    specs = {name: column(name) for name in columns}
    if labels:
        specs.update({name: Column(label, specs[name].kind) for name, label in labels.items() if name in specs})
    head = "".join(f"<th>{escape(specs[c].label)}</th>" for c in columns)
    rows, verdicts = [], []
    for record in frame[columns].itertuples(index=False, name=None):
        cells = []
        for name, value in zip(columns, record):
            kind = specs[name].kind
            text = format_value(value, kind)
            if kind == "verdict" and text != "—":
                verdicts.append(text)
                cells.append(f'<td class="verdict-cell">{verdict_chip(text)}</td>')
            else:
                numeric = kind not in ("text",) and not isinstance(value, str)
                cells.append(f'<td class="{"num" if numeric else "text"}">{escape(text)}</td>')
        rows.append(f"<tr>{''.join(cells)}</tr>")
    ident = f' id="{escape(table_id)}"' if table_id else ""
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    out = (f'<table class="lab-table"{ident}>{cap}<thead><tr>{head}</tr></thead>'
           f'<tbody>{"".join(rows)}</tbody></table>')
    return out + (verdict_legend(verdicts) if legend and verdicts else "")


def table_text(frame, columns=None) -> str:
    """The same table as aligned plain text (for print and text-only frontends)."""
    import pandas as pd

    frame = _labelled_rows_as_column(frame)
    columns = list(frame.columns) if columns is None else list(columns)
    shown = pd.DataFrame({column(c).label: [format_value(v, column(c).kind) for v in frame[c]] for c in columns})
    return shown.to_string(index=False, max_colwidth=None)


def show(frame, columns=None, labels: dict | None = None, caption: str | None = None,
         table_id: str | None = None) -> HtmlBlock:
    """What a notebook displays for a table: ``tables.show(frame)`` as the cell's last line."""
    return HtmlBlock(table_html(frame, columns, labels, caption, table_id), table_text(frame, columns))


def notes(lines, label: str = "") -> HtmlBlock:
    """Sentences shown as notes under a table or figure (escaped prose, not program output)."""
    lines = [str(line) for line in lines]
    prefix = f"{escape(label)} " if label else ""
    body = "".join(f'<p class="lab-note">{prefix}{escape(line)}</p>' for line in lines)
    return HtmlBlock(body, "\n".join(f"{label} {line}".strip() for line in lines))


def definition_table(rows, table_id: str | None = None) -> str:
    """Name → value pairs as a small two-column table (escaped)."""
    body = "".join(f"<tr><th>{escape(name)}</th><td>{escape(value)}</td></tr>" for name, value in rows)
    ident = f' id="{escape(table_id)}"' if table_id else ""
    return f'<table class="lab-context"{ident}><tbody>{body}</tbody></table>'


# ---------------------------------------------------------------------------------------------
# run context


def describe_device_in_words(info: dict) -> str:
    """'cpu (x86_64, 2 threads, oneDNN)' or 'cuda:0 (NVIDIA H100, CUDA 12.4, compute capability 9.0)'."""
    where = str(info.get("device", "?"))
    details = [str(info["name"])] if info.get("name") else []
    if where.startswith("cuda"):
        details += [f"CUDA {info['cuda']}"] if info.get("cuda") else []
        details += [f"compute capability {info['capability']}"] if info.get("capability") else []
    else:
        details += [f"{info['threads']} threads"] if info.get("threads") else []
        details += ["oneDNN available" if info.get("mkldnn") else "no oneDNN"] if "mkldnn" in info else []
    return f"{where} ({', '.join(details)})" if details else where


def _image_size(problem) -> str:
    height, width = problem.input.shape[-2:]
    return f"{height} × {width} pixels"


def image_source_in_words(source: str, seed: int | None = None) -> str:
    if source == "synthetic":
        return ("synthetic micrographs (precision_lab.problem.synthetic_micrograph"
                + (f", seed {seed})" if seed is not None else ")"))
    return f"micrograph file {source}"


def context_rows(device_info: dict, problem=None, batch=None, seed=None, image=None, extra=()) -> list[tuple[str, str]]:
    """The run context of a notebook: device, torch, cuDNN, problem size, batch, seed, image source."""
    rows = [("device", describe_device_in_words(device_info)), ("torch", str(device_info.get("torch", "?")))]
    if str(device_info.get("device", "")).startswith("cuda"):
        rows.append(("cuDNN", str(device_info.get("cudnn") or "not available")))
    else:
        rows.append(("cuDNN", "not used (CPU run)"))
    if problem is not None:
        rows += [("problem size", _image_size(problem)), ("batch", str(problem.batch)), ("seed", str(problem.seed)),
                 ("image source", image_source_in_words(problem.source, problem.seed))]
    else:
        rows += [(name, str(value)) for name, value in (("batch", batch), ("seed", seed)) if value is not None]
        rows.append(("image source", image_source_in_words("synthetic" if image is None else str(image), seed)))
    return rows + [(str(name), str(value)) for name, value in extra]


def context(device, problem=None, batch=None, seed=None, image=None, extra=()) -> HtmlBlock:
    """What a notebook shows first: where and on what it ran, as a definition table."""
    from .device import describe_device

    rows = context_rows(describe_device(device), problem, batch, seed, image, extra)
    text = "\n".join(f"{name}: {value}" for name, value in rows)
    return HtmlBlock(definition_table(rows, "run-context"), text)


__all__ = ["COLUMNS", "Column", "VERDICT_MEANINGS", "HtmlBlock", "column", "context", "context_rows",
           "definition_table", "format_cosine", "format_factor", "format_number", "format_percent", "format_range", "format_reported",
           "format_value", "notes", "show", "stylesheet", "table_html", "table_text", "verdict_chip", "verdict_legend"]
