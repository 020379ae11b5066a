"""The exchange format (docs/design.md, "Exchange format"): bundles written and read back, and every bad bundle refused in one line."""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from precision_lab import bundle
from precision_lab.candidates.static import BundleCandidate
from precision_lab.bundle import BundleError, read_bundle, write_request, write_static
from precision_lab.candidates import CandidateError, get_builtin, resolve
from precision_lab.errors import LabInputError
from precision_lab.layout import to_layout
from precision_lab.problem import make_problem
from precision_lab.compute import forward_backward
from precision_lab.model import seed_network

SEED = seed_network()
PARAM_NAMES, WEIGHT_NAMES, BIAS_NAMES = SEED.parameter_names, SEED.weight_names, SEED.bias_names

SIZE = 16  # small: every test here reads and writes whole bundles


@pytest.fixture(scope="module")
def problem():
    return make_problem(SIZE, 2, seed=3)


@pytest.fixture(scope="module")
def result(problem):
    return forward_backward(problem, "float32")


def _static(tmp_path, problem, result, **kwargs):
    return write_static(problem, result, tmp_path / "static", **kwargs)


def _rewrite_npz(directory, change):
    """Load arrays.npz, let `change` edit the dict, write it back."""
    with np.load(directory / "arrays.npz") as data:
        arrays = dict(data)
    change(arrays)
    np.savez(directory / "arrays.npz", **arrays)


def _rewrite_manifest(directory, change):
    manifest = json.loads((directory / "bundle.json").read_text())
    change(manifest)
    (directory / "bundle.json").write_text(json.dumps(manifest))


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("layout", ["OIHW", "HWIO", "IOWH"])
@pytest.mark.parametrize("raw", [False, True])
def test_request_round_trip_restores_the_problem(tmp_path, problem, layout, raw):
    write_request(problem, tmp_path / "req", "float32", layout, raw=raw)
    read = read_bundle(tmp_path / "req", ("request",))
    assert read.weight_layout == layout
    assert read.arrays["conv2.weight"].shape == to_layout(problem.params["conv2.weight"], layout).shape
    back = bundle.problem_from_bundle(read)
    np.testing.assert_array_equal(back.input, problem.input)
    np.testing.assert_array_equal(back.target, problem.target)
    for name in PARAM_NAMES:
        np.testing.assert_array_equal(back.params[name], problem.params[name])


def test_raw_request_is_column_major_with_the_declared_shape(tmp_path, problem):
    write_request(problem, tmp_path / "req", "float32", "HWIO", raw=True)
    manifest = json.loads((tmp_path / "req" / "bundle.json").read_text())
    entry = manifest["arrays"]["conv2.weight"]
    assert entry == {"file": "conv2.weight.bin", "dtype": "float32", "shape": [3, 3, 16, 16], "order": "F"}
    flat = np.fromfile(tmp_path / "req" / "conv2.weight.bin", np.float32)
    hwio = to_layout(problem.params["conv2.weight"], "HWIO")
    np.testing.assert_array_equal(flat, hwio.ravel(order="F"))  # (kh, kw, in, out) with kh fastest


def test_raw_bundle_in_c_order_reads_too(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result, raw=True)
    manifest = json.loads((directory / "bundle.json").read_text())
    for name, entry in manifest["arrays"].items():  # rewrite every file in C order
        value = np.fromfile(directory / entry["file"], entry["dtype"]).reshape(entry["shape"], order="F")
        value.ravel(order="C").tofile(directory / entry["file"])
        entry["order"] = "C"
    (directory / "bundle.json").write_text(json.dumps(manifest))
    got = BundleCandidate.from_dir(directory).compute(problem)
    for name in PARAM_NAMES:
        np.testing.assert_array_equal(got.grads[name], result.grads[name])


@pytest.mark.parametrize("precision", ["float32", "float64", "tf32"])
def test_static_bundle_is_a_candidate_with_its_own_problem(tmp_path, problem, result, precision):
    directory = _static(tmp_path, problem, result, precision=precision, weight_layout="HWIO")
    candidate = resolve(str(directory))
    assert isinstance(candidate, BundleCandidate)
    assert (candidate.family, candidate.claimed_precision, candidate.weight_layout) == ("bundle", precision, "HWIO")
    assert candidate.has_float64 is False
    np.testing.assert_array_equal(candidate.problem.input, problem.input)
    got = candidate.compute(candidate.problem)
    assert got.loss == pytest.approx(result.loss, rel=1e-7)
    np.testing.assert_array_equal(got.output, result.output.astype(got.output.dtype))
    for name in PARAM_NAMES:  # stored in HWIO, returned in OIHW
        np.testing.assert_array_equal(got.grads[name], result.grads[name].astype(got.grads[name].dtype))
    with pytest.raises(CandidateError, match="no float64 build"):
        candidate.compute(candidate.problem, "float64")


def test_static_bundle_refuses_another_problem(tmp_path, problem, result):
    candidate = BundleCandidate.from_dir(_static(tmp_path, problem, result))
    with pytest.raises(CandidateError, match="its own problem"):
        candidate.compute(make_problem(SIZE, 2, seed=4))


def test_layout_slip_survives_the_bundle(tmp_path, problem):
    """The motivating case's flip is stored as the program stored it: the bundle must not repair it."""
    slipped = get_builtin("fortran-replay-flip").compute(problem)
    candidate = BundleCandidate.from_dir(write_static(problem, slipped, tmp_path / "flip", weight_layout="HWIO"))
    got = candidate.compute(candidate.problem)
    right = forward_backward(problem, "float32")
    np.testing.assert_array_equal(got.grads["conv2.weight"], slipped.grads["conv2.weight"])
    flipped_back = got.grads["conv2.weight"][:, :, ::-1, ::-1]
    assert np.max(np.abs(flipped_back - right.grads["conv2.weight"])) < 1e-6 < np.max(
        np.abs(got.grads["conv2.weight"] - right.grads["conv2.weight"]))


# ---------------------------------------------------------------------------------------------
# bad bundles: one line naming the file, the key and what was expected


def _expect_error(directory, pattern, kinds=("static",)):
    with pytest.raises(BundleError, match=pattern) as info:
        read_bundle(directory, kinds)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, LabInputError)
    return message


def test_missing_array_names_file_key_shape_and_layout(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result)
    _rewrite_npz(directory, lambda a: a.pop("conv2.weight.grad"))
    message = _expect_error(directory, "has no")
    assert message.endswith("arrays.npz has no 'conv2.weight.grad' (expected shape (16, 16, 3, 3) in layout OIHW)")


def test_wrong_shape_names_the_expected_one(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result, weight_layout="HWIO")
    _rewrite_npz(directory, lambda a: a.update({"conv1.weight.grad": np.zeros((16, 1, 3, 3), np.float32)}))
    _expect_error(directory, r"'conv1.weight.grad' has shape \(16, 1, 3, 3\), expected shape \(3, 3, 1, 16\) in layout HWIO")


def test_target_shape_must_match_the_input(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result)
    _rewrite_npz(directory, lambda a: a.update(target=a["target"][:, :, :-1]))
    _expect_error(directory, r"'target' has shape \(2, 1, 15, 16\), expected shape \(2, 1, 16, 16\)")


def test_wrong_dtype_for_the_precision(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result)
    _rewrite_npz(directory, lambda a: a.update(loss=a["loss"].astype(np.float64)))
    _expect_error(directory, "'loss' has dtype float64, expected float32")


def test_pickled_arrays_are_refused(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result)
    objects = np.empty(3, dtype=object)
    objects[:] = [1, "two", None]
    _rewrite_npz(directory, lambda a: a.update({"conv1.bias": objects}))
    _expect_error(directory, "holds Python objects .*allow_pickle=False")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_values_are_refused(tmp_path, problem, result, bad):
    directory = _static(tmp_path, problem, result)

    def poison(arrays):
        arrays["conv3.weight.grad"] = arrays["conv3.weight.grad"].copy()
        arrays["conv3.weight.grad"][0, 5, 1, 2] = bad
    _rewrite_npz(directory, poison)
    _expect_error(directory, r"'conv3.weight.grad' holds 1 NaN or infinite values \(first at index \(0, 5, 1, 2\)\)")


def test_not_a_zip(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result)
    (directory / "arrays.npz").write_bytes(b"not a zip file")
    _expect_error(directory, r"arrays.npz: not a valid .npz")


def _replace_members(directory, members):
    """Rewrite arrays.npz with some members replaced by raw .npy bytes (headers that lie)."""
    with np.load(directory / "arrays.npz") as data:
        arrays = dict(data)
    with zipfile.ZipFile(directory / "arrays.npz", "w") as archive:
        for name, value in arrays.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, value)
            archive.writestr(f"{name}.npy", members.get(name, member.getvalue()))


def test_truncated_npz_member(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result)
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, problem.input)
    _replace_members(directory, {"input": buffer.getvalue()[:300]})
    _expect_error(directory, r"arrays.npz: cannot read array 'input'")


def test_a_manifest_claiming_a_trillion_elements_is_refused_before_allocation(tmp_path, problem):
    directory = write_request(problem, tmp_path / "req")
    header = io.BytesIO()  # a .npy header only: (2, 1, 10⁶, 5·10⁵) float32 = 10¹² elements, no data
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (2, 1, 10**6, 5 * 10**5)})
    _replace_members(directory, {"input": header.getvalue(), "target": header.getvalue()})
    _expect_error(directory, r"arrays declare .* GiB \(largest 'input' .*\); refusing more than 25%", ("request",))


def test_memory_check_uses_the_available_memory(tmp_path, problem, result, monkeypatch):
    directory = _static(tmp_path, problem, result)
    monkeypatch.setattr(bundle, "available_memory", lambda: 1000)  # 1000 bytes: a 16² bundle is ~6 kB
    _expect_error(directory, "refusing more than 25% of the")


def test_raw_file_size_must_match_its_declared_shape(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result, raw=True)
    _rewrite_manifest(directory, lambda m: m["arrays"]["input"].update(shape=[2, 1, 10**6, 5 * 10**5]))
    _expect_error(directory, r"input.bin: holds 2048 bytes but 'arrays.input' declares shape \(2, 1, 1000000, 500000\)")


def test_raw_file_must_stay_inside_the_bundle(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result, raw=True)
    _rewrite_manifest(directory, lambda m: m["arrays"]["input"].update(file="../../etc/passwd"))
    _expect_error(directory, "'arrays.input.file' is '../../etc/passwd': files must lie inside the bundle folder")


@pytest.mark.parametrize("key,value,pattern", [
    ("dtype", "int32", r"'arrays.target.dtype' is 'int32', expected one of"),
    ("order", "K", r"'arrays.target.order' is 'K', expected \"C\" or \"F\""),
    ("shape", [2, -1], r"'arrays.target.shape' is \[2, -1\], expected a list of non-negative integers"),
    ("file", "missing.bin", r"'arrays.target.file': .*missing.bin does not exist"),
])
def test_raw_entries_are_checked(tmp_path, problem, result, key, value, pattern):
    directory = _static(tmp_path, problem, result, raw=True)
    _rewrite_manifest(directory, lambda m: m["arrays"]["target"].update({key: value}))
    _expect_error(directory, pattern)


def test_raw_and_npz_together_are_ambiguous(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result, raw=True)
    (directory / "arrays.npz").write_bytes(b"")
    _expect_error(directory, "lists raw binaries but .*arrays.npz exists too")


@pytest.mark.parametrize("change,pattern", [
    (lambda m: m.update(format="precision-lab/bundle-2"), r"bundle.json: key 'format' is 'precision-lab/bundle-2', expected 'precision-lab/bundle-1'"),
    (lambda m: m.update(kind="response"), r"key 'kind' is 'response', expected 'static'"),
    (lambda m: m.update(precision="float8"), r"key 'precision': unknown precision 'float8': expected one of float64, float32"),
    (lambda m: m.update(weight_layout="OIHWX"), r"key 'weight_layout': unknown weight layout 'OIHWX'"),
    (lambda m: m["model"].update(channels=[1, 32, 32, 1]), r"'conv1.weight' has shape \(16, 1, 3, 3\), expected shape \(32, 1, 3, 3\)"),
    (lambda m: m["model"].update(activation="swish"), r"key 'model': key 'activation' is 'swish': expected one of relu"),
    (lambda m: m.pop("model"), r"key 'model' missing"),
])
def test_manifest_fields_are_checked(tmp_path, problem, result, change, pattern):
    directory = _static(tmp_path, problem, result)
    _rewrite_manifest(directory, change)
    _expect_error(directory, pattern)


def test_missing_or_unreadable_manifest(tmp_path, problem, result):
    _expect_error(tmp_path / "nowhere", "no such bundle directory")
    directory = _static(tmp_path, problem, result)
    (directory / "bundle.json").write_text("{not json")
    _expect_error(directory, "bundle.json: not valid JSON")
    (directory / "bundle.json").write_text("[1, 2]")
    _expect_error(directory, "expected a JSON object, got list")
    (directory / "bundle.json").unlink()
    _expect_error(directory, "bundle.json: missing")


def test_missing_arrays_npz(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result)
    (directory / "arrays.npz").unlink()
    _expect_error(directory, "arrays.npz: missing")


def test_float64_values_beyond_float32_are_refused_as_a_problem(tmp_path, problem, result):
    directory = _static(tmp_path, problem, result, precision="float64")
    _rewrite_npz(directory, lambda a: a.update(input=a["input"] + 1e-12))
    with pytest.raises(BundleError, match="'input' holds float64 values that float32 cannot represent exactly"):
        BundleCandidate.from_dir(directory)


def test_weights_are_read_through_the_declared_layout(tmp_path, problem, result):
    """A bundle that says HWIO but stores OIHW-shaped conv2 weights is refused, not silently transposed."""
    directory = _static(tmp_path, problem, result, weight_layout="HWIO")
    _rewrite_npz(directory, lambda a: a.update({"conv2.weight": problem.params["conv2.weight"]}))
    message = _expect_error(directory, "'conv2.weight' has shape")
    assert "expected shape (3, 3, 16, 16) in layout HWIO" in message
    assert set(WEIGHT_NAMES) <= set(bundle.expected_shapes("request", "HWIO", (2, 1, SIZE, SIZE)))
