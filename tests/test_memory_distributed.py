"""Micro-batches under FSDP2 (CPU, gloo, 2 ranks): each rank back-propagates its rows one token-budget micro-batch at
a time, as many micro-batches on every rank (``learner.micro_batches``), and the run matches the single process
within the tolerances of tests/test_distributed.py."""

import pytest

from tests.test_distributed import (CONSTRAINT, MOE_EXTRA, STEPS, _assert_close, _history, _overrides,
                                    _single_process, _torchrun)

# a budget of 24 padded positions cuts each rank's rows of a mini-batch into micro-batches of one or a few rows
BUDGET = ("algo.micro_batch_tokens=24", "algo.minibatches=2")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("algo.minibatches=1", "algo.routing_replay=r3")])
def test_memory_micro_batches_under_fsdp_match_one_process(tmp_path, extra):
    (tmp_path / "config.yaml").write_text(CONSTRAINT)
    overrides = (*MOE_EXTRA, *BUDGET, *extra)
    _torchrun(2, tmp_path / "config.yaml", _overrides("tiny-moe", tmp_path / "two", tmp_path / "cache", STEPS,
                                                       *overrides))
    one = _single_process("tiny-moe", tmp_path / "config.yaml", tmp_path / "one", tmp_path / "cache", *overrides)
    _assert_close(one, _history(tmp_path / "two"))

