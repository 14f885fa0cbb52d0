"""The experiment runner behind ``benchmarks/run.py`` (its docstring, in ``cli``, says what a run and a page are):

- ``experiment``: the experiment files (levels, methods, profiles, the ``compare`` block and its bar);
- ``workers``: the worker processes that train the missing runs, and the cold starts warmed first;
- ``records``: a run read from its folder or from the page's record, and the collapse rule;
- ``statistics``: the runs aggregated per cell, the tests, comparisons, bar, compute and throughput, with tables;
- ``figures``: the page's figures, and ``redraw``, which draws them again from the page's record;
- ``page``: the page itself (markdown, CSV, record, figures);
- ``cli``: the command line, one invocation from the experiment file to the page.
"""

from benchmarks.runner.cli import main, results_prefix, run
from benchmarks.runner.experiment import (EXPERIMENTS, ROOT, Bar, Compare, Experiment, ExperimentError,
                                          load_experiment, page_compare)
from benchmarks.runner.figures import accuracy_figure, redraw
from benchmarks.runner.records import (MACHINE_FILE, Run, collapse_check, read_record, record_path, run_from_record,
                                       write_record)
from benchmarks.runner.statistics import (aggregate, bar_across, bar_across_lines, bar_rows, bar_table, compare_rows,
                                          compare_table, compute_rows, extreme_share, met_on_line, paired, placebo_rows,
                                          placebo_table, reading, welch_p)

__all__ = ["EXPERIMENTS", "MACHINE_FILE", "ROOT", "Bar", "Compare", "Experiment", "ExperimentError", "Run",
           "accuracy_figure", "aggregate", "bar_across", "bar_across_lines", "bar_rows", "bar_table", "collapse_check",
           "compare_rows", "compare_table", "compute_rows", "extreme_share", "load_experiment", "main", "met_on_line",
           "page_compare", "paired", "placebo_rows", "placebo_table", "read_record", "reading", "record_path", "redraw",
           "results_prefix", "run", "run_from_record", "welch_p", "write_record"]
