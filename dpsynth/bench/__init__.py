"""``dpsynth bench SUITE``: every method at each ε of a suite, one resumable command, one comparison table.

* :mod:`dpsynth.bench.suite`: the suite schema (pydantic) and the packaged suites in ``suites/``;
* :mod:`dpsynth.bench.cells`: each run as a ``dpsynth run`` subprocess, its record, resuming, budgets;
* :mod:`dpsynth.bench.readout`: the figures read off a run's own outputs (never recomputed);
* :mod:`dpsynth.bench.table`: ``experiments/results/SUITE.json``, the Markdown table and the plot;
* :mod:`dpsynth.bench.runs`: selecting, running and resuming a suite's runs, :func:`~dpsynth.bench.runs.bench`.

The command line is :mod:`dpsynth.cli.bench`. This layer runs ``dpsynth`` subprocesses and imports
neither the runner nor the API; it sits below :mod:`dpsynth.cli` (docs/architecture.md).
"""

from dpsynth.bench.runs import BenchOptions, bench
from dpsynth.bench.suite import available_suites, load_suite

__all__ = ["BenchOptions", "available_suites", "bench", "load_suite"]
