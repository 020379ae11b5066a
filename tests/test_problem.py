import itertools

import mrcfile
import numpy as np
import pytest

from precision_lab import layout
from precision_lab.problem import ProblemError, load_micrograph, make_problem
from precision_lab.compute import autograd_forward_backward, forward_backward
from precision_lab.model import seed_network

SEED = seed_network()
PARAM_NAMES, WEIGHT_NAMES, BIAS_NAMES = SEED.parameter_names, SEED.weight_names, SEED.bias_names


def test_problem_is_reproducible_from_its_seed():
    a, b, c = make_problem(32, 2, seed=3), make_problem(32, 2, seed=3), make_problem(32, 2, seed=4)
    assert np.array_equal(a.input, b.input) and np.array_equal(a.target, b.target)
    assert all(np.array_equal(a.params[k], b.params[k]) for k in PARAM_NAMES)
    assert not np.array_equal(a.input, c.input)
    assert a.input.shape == (2, 1, 32, 32) and a.input.dtype == np.float32
    assert abs(float(a.input.mean())) < 1e-5 and abs(float(a.input.std()) - 1) < 1e-4
    assert not np.array_equal(a.input[0], a.input[1])  # batch elements are different micrographs


def test_weights_follow_pytorch_default_init_bounds():
    params = make_problem(16, 1, seed=0).params
    for name in PARAM_NAMES:
        assert params[name].shape == SEED.param_shapes[name]
        fan_in = int(np.prod(SEED.param_shapes[name.replace("bias", "weight")][1:]))
        assert np.abs(params[name]).max() <= 1 / np.sqrt(fan_in)


def test_manual_backward_equals_autograd_in_float64(small_problem):
    manual = forward_backward(small_problem, "float64")
    auto = autograd_forward_backward(small_problem, "float64")
    assert abs(manual.loss - auto.loss) <= 1e-14 * abs(auto.loss)
    for name in PARAM_NAMES:
        scale = np.abs(auto.grads[name]).max()
        assert np.abs(manual.grads[name] - auto.grads[name]).max() <= 1e-12 * scale, name


def test_float32_gradients_differ_from_float64_only_by_rounding(small_problem, small_reference):
    result = forward_backward(small_problem, "float32")
    for name in PARAM_NAMES:
        err = np.abs(result.grads[name] - small_reference.grads[name]).max()
        scale = np.abs(small_reference.grads[name]).max()
        assert 0 < err <= 1e-5 * scale, name  # float32 differs, but by rounding-sized amounts


def test_layout_roundtrip_for_every_permutation():
    w = np.arange(16 * 8 * 3 * 3, dtype=np.float32).reshape(16, 8, 3, 3)
    for letters in itertools.permutations("OIHW"):
        name = "".join(letters)
        stored = layout.to_layout(w, name)
        assert stored.shape == layout.shape_in_layout(w.shape, name)
        assert np.array_equal(layout.from_layout(stored, name), w)
    assert layout.to_layout(w, "HWIO")[2, 1, 5, 7] == w[7, 5, 2, 1]
    with pytest.raises(ValueError, match="permutation of the letters"):
        layout.check_layout("OIHX")


def test_real_micrographs_load_from_npy_and_mrc(tmp_path):
    image = np.random.default_rng(0).normal(size=(80, 90)).astype(np.float32)
    np.save(tmp_path / "m.npy", image)
    with mrcfile.new(tmp_path / "m.mrc") as mrc:
        mrc.set_data(image)
    for name in ("m.npy", "m.mrc"):
        crop = load_micrograph(tmp_path / name, size=64)
        assert np.array_equal(crop, image[8:72, 13:77])
    problem = make_problem(64, 2, 0, image=tmp_path / "m.mrc")
    assert problem.input.shape == (2, 1, 64, 64) and problem.source.endswith("m.mrc")


@pytest.mark.parametrize("content, message", [
    (None, "no such image file"),
    ("text", "unknown image type"),
    (np.zeros((4, 4, 4, 4)), "expected a 2-D numeric image"),
    (np.full((70, 70), np.nan), "NaN or infinite"),
    (np.zeros((20, 20)), "smaller than the requested size"),
])
def test_bad_images_give_one_clear_error(tmp_path, content, message):
    path = tmp_path / ("image.txt" if isinstance(content, str) else "image.npy")
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        np.save(path, content)
    with pytest.raises(ProblemError, match=message) as info:
        load_micrograph(path, size=64)
    assert str(path) in str(info.value)
