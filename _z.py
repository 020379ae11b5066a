import sys
sys.path.insert(0, "tests")
import test_normalisation as T
from precision_lab.calibration import judge_zoo
from precision_lab.problem import make_problem
import pandas as pd
pd.set_option("display.width", 250)
for mode in sys.argv[1:]:
    net = T._gn_network() if mode == "gn" else T._dncnn(mode)
    table = judge_zoo(make_problem(24, 2, 1, network=net), "cpu")
    print(mode, len(table))
    print(table[["candidate", "expected", "verdict", "correct", "worst_ratio"]].to_string())
