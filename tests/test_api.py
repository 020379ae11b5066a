"""The package's public surface: a few names, importable from `precision_lab`, without loading torch first."""
import subprocess
import sys

import precision_lab


def test_importing_the_package_loads_no_torch():
    code = "import sys, precision_lab; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"


def test_every_public_name_is_what_its_module_defines():
    from precision_lab import decision, diagnosis, gradcheck, model, modules, problem

    homes = {"diagnose": diagnosis, "Diagnosis": decision, "check_gradients": gradcheck, "GradCheck": gradcheck,
             "load_model": model, "from_module": modules, "Network": model, "ModelSpecError": model,
             "make_problem": problem, "Problem": problem}
    assert sorted(homes) == precision_lab.__all__
    for name, module in homes.items():
        assert getattr(precision_lab, name) is getattr(module, name), name


def test_a_diagnosis_through_the_public_names():
    from precision_lab import diagnose, load_model, make_problem
    from precision_lab.candidates import resolve

    problem = make_problem(24, batch=2, seed=0, network=load_model(None))
    diagnosis = diagnose(resolve("builtin:native"), problem, probes=[])
    assert diagnosis.verdict == "roundoff"
    assert diagnose(resolve("builtin:fortran-replay-flip"), problem, probes=[]).verdict == "layout"
