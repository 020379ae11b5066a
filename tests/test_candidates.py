import numpy as np
import pytest

from precision_lab.candidates import CandidateError, registry, resolve
from precision_lab.problem import make_problem
from precision_lab.model import seed_network

SEED = seed_network()
PARAM_NAMES, WEIGHT_NAMES, BIAS_NAMES = SEED.parameter_names, SEED.weight_names, SEED.bias_names


def test_resolve_names_and_prefix():
    assert resolve("builtin:native") is resolve("native")
    with pytest.raises(CandidateError, match="unknown built-in candidate 'nope': choose from"):
        resolve("builtin:nope")


def test_registry_has_the_motivating_case_and_native():
    names = set(registry())
    assert {"native", "native-tf32", "tf32-emulated", "fortran-replay", "fortran-replay-flip"} <= names


def test_replay_reproduces_the_seed_table_magnitudes():
    """The slip gives weight-gradient differences of 1e-2 while loss and bias gradients agree to 1e-6/1e-5."""
    problem = make_problem(128, 2, 0)
    right = resolve("fortran-replay").compute(problem)
    slip = resolve("fortran-replay-flip").compute(problem)
    native = resolve("native").compute(problem)
    assert abs(slip.loss - native.loss) <= 1e-6
    for name in BIAS_NAMES:
        assert np.abs(slip.grads[name] - native.grads[name]).max() <= 1e-5
    for name in WEIGHT_NAMES:
        assert np.abs(slip.grads[name] - native.grads[name]).max() >= 1e-3
        # the slip is exactly a spatial flip of the right gradient
        assert np.array_equal(slip.grads[name], right.grads[name][:, :, ::-1, ::-1])


def test_tf32_emulation_changes_gradients_by_about_tf32_roundoff(small_problem, small_reference):
    result = resolve("tf32-emulated").compute(small_problem)
    rel = max(np.abs(result.grads[n] - small_reference.grads[n]).max() / np.abs(small_reference.grads[n]).max()
              for n in WEIGHT_NAMES)
    assert 1e-5 < rel < 1e-1  # far above float32 (~1e-7), the order of TF32's 2^-11 with cancellation
