

# ---------------------------------------------------------------------------------------------
# the batch's coupling in the error model


def test_a_training_batch_norm_couples_the_errors_of_every_later_quantity():
    """Training-mode statistics share their errors among the samples: every field after the batch norm, and every
    gradient field of the backward, is marked coupled; evaluation mode with float32 statistics and group norm are not."""
    from precision_lab import errmodel
    from precision_lab.ops import Field

    seen = []
    original = errmodel._combine

    def spy(contributions, g, ctx):
        seen.extend(c.coupled for c in contributions)
        return original(contributions, g, ctx)

    for network, coupled in ((_dncnn("train"), True), (_dncnn("eval"), False), (_gn_network(), False)):
        seen.clear()
        problem = make_problem(16, 2, 0, network=network)
        errmodel._combine = spy
        try:
            errmodel.error_bounds(reference(problem), "float32")
        finally:
            errmodel._combine = original
        assert seen and all(c == coupled for c in seen), (network.name, seen)
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    field = OPS["batch_norm2d"].forward_error(OPS["batch_norm2d"].normalise({"channels": 4}),
                                              [Field(x, torch.full_like(x, 1e-6), 1)], x, {}, _context())
    assert field.coupled and field.radius is None


def _context():
    from precision_lab.errmodel import bound_kernels
    from precision_lab.ops import BoundContext

    return BoundContext("float32", 2.0 ** -24, 7.0, bound_kernels(torch.device("cpu")))


def test_coupled_errors_are_summed_as_fully_dependent():
    """Hoeffding's side with χ* = n is never below the deterministic sum (Cauchy–Schwarz): coupled errors get it."""
    from precision_lab import roundoff

    assert roundoff.dependency_count(None, 64, coupled_terms=128) == 128
    assert roundoff.dependency_count(None, 64) == 64 and roundoff.dependency_count(1, 64) == 25
    c, e = torch.rand(128, dtype=torch.float64), torch.rand(128, dtype=torch.float64)
    deterministic, squares = (c * e).sum(), (c * c * e * e).sum()
    assert float(roundoff.sum_of_errors(deterministic, squares, 128, 7.0)) == float(deterministic)
    assert float(roundoff.sum_of_errors(deterministic, squares, 25, 7.0)) < float(deterministic) * 7.0 * 25 ** 0.5 / 128 ** 0.5 * 1.5
