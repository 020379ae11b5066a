"""Shared fixtures: small seed problems and their float64 references (computed once per session)."""
import pytest

from precision_lab.problem import make_problem
from precision_lab.reference import reference


@pytest.fixture(scope="session")
def small_problem():
    return make_problem(size=64, batch=2, seed=0)


@pytest.fixture(scope="session")
def small_reference(small_problem):
    return reference(small_problem)
