"""Reference-free gradient check: is a program's gradient the derivative of its own loss? (see check.py)"""
from .check import (ALPHA, SEGMENT_MAX, Calls, Evaluation, FunctionOracle, GradCheck, GradCheckError, Region, Segment,
                    _dot, _point, check_evaluation, check_gradients, default_budget, exact_cast, half_aligned,
                    homogeneous_groups, measure_noise, on_grid, scaling_step, segment_step, storage_dtype, t_critical,
                    t_two_sided_p, tensor_scales, tensor_step)
