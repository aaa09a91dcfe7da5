"""`gpufeed bench`: the questions every slow training loop asks, answered on this machine.

Each experiment (transfer, dtype, decoders, loaders, training) measures and returns figures;
`plots.plot` draws them from results.json alone.
"""

from gpufeed.bench.plots import plot
from gpufeed.bench.runner import EXPERIMENTS, run_bench

__all__ = ["EXPERIMENTS", "plot", "run_bench"]
