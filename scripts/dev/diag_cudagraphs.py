import torch, torch._dynamo, torch._inductor.config as ic
ic.triton.cudagraph_trees_history_recording = True
import sys; sys.argv = ["x"]
import pytest
rc = pytest.main(["-q", "-p", "no:logging", "tests/gpu", "-s", "-k", "cuda_graphs and fa3", "-x"])
from torch._dynamo.utils import counters
print("GRAPH BREAKS", dict(counters["graph_break"]))
