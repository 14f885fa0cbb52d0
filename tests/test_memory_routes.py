"""Memory of the route handling, measured on the CPU: the ranks' rollout digest (``_rollout_digest``) and the route
mismatch measures hold temporaries of a fixed chunk, whatever the routes' length (the 30B recipe's routes are
~1.7e9 int8 elements: a whole-field int64 copy is 14 GB, each further temporary as much).

The peak is torch's profiler's (every CPU allocation and free inside the window, in time order), above what was
alive before (``tests.test_memory_learner.peak_bytes``)."""

import torch

from dcmdp import distributed
from tests.test_memory_learner import peak_bytes
from trainers.batch import Rollout

CHUNK = 1 << 14  # elements per digest chunk in these tests: 128 KiB per int64 temporary
L, K, E = 4, 8, 128  # MoE layers, experts per token, experts


def _rollout(rows: int, seq: int, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompt, response = 4, seq - 4
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows * seq * L)])
    return Rollout(prompt_ids_BP=torch.randint(5, 100, (rows, prompt), generator=g),
                   prompt_mask_BP=torch.ones(rows, prompt, dtype=torch.bool),
                   response_ids_BT=torch.randint(5, 100, (rows, response), generator=g),
                   response_mask_BT=torch.ones(rows, response, dtype=torch.bool),
                   rollout_logp_BT=-torch.rand(rows, response, generator=g),
                   rollout_experts_BSLK=experts.reshape(rows, seq, L, K).to(torch.int8))


def widened_checksum(value: torch.Tensor, device: torch.device, chunk: int) -> torch.Tensor:
    """The digest's checksum as it was, the whole field widened to int64 at once (``chunk`` ignored): the reference
    value, and the memory a chunked checksum must not come back to."""
    x = value.to(device).reshape(-1)
    if x.is_floating_point():
        x = x.float().view(torch.int32)
    i = torch.arange(x.numel(), device=device, dtype=torch.int64)
    w = (i * 2654435761 + 97) % 65521 + 1
    return torch.stack([torch.tensor(x.numel(), device=device), (x.to(torch.int64) * w).sum()])


def _digest(rollout: Rollout) -> torch.Tensor:
    return distributed._rollout_digest(rollout, torch.device("cpu"))


def test_digest_is_the_whole_field_checksum_and_sees_one_changed_route_or_token(monkeypatch):
    monkeypatch.setattr(distributed, "DIGEST_CHUNK", CHUNK)
    rollout = _rollout(3, 700)  # the routes are 67200 elements: 5 chunks, the last one partial
    digest = _digest(rollout)
    assert torch.equal(digest, _digest(_rollout(3, 700)))
    monkeypatch.setattr(distributed, "field_checksum", widened_checksum)
    assert torch.equal(digest, _digest(rollout))  # chunking changes no bit of it
    monkeypatch.undo()
    monkeypatch.setattr(distributed, "DIGEST_CHUNK", CHUNK)
    for field, index, value in (("rollout_experts_BSLK", (2, 650, 3, 7), 127), ("response_ids_BT", (0, 1), 3),
                                ("rollout_logp_BT", (1, 0), -0.5)):
        changed = _rollout(3, 700)
        getattr(changed, field)[index] = value
        assert not torch.equal(digest, _digest(changed)), field
    # two routes swapped within a top-k: the same set, another order, another rollout as the engine returned it
    swapped = _rollout(3, 700)
    swapped.rollout_experts_BSLK[1, 5, 2, [0, 1]] = swapped.rollout_experts_BSLK[1, 5, 2, [1, 0]]
    assert not torch.equal(digest, _digest(swapped))


def test_memory_digest_peak_is_a_few_chunks_whatever_the_routes_length(monkeypatch):
    # routes of 1.6e5 and 6.6e5 int8 elements (160 and 640 KiB): the peak stays within 4 int64 chunks (512 KiB;
    # measured 256 KiB for both); the whole-field widening held 32x the routes (measured 20 MiB for the longer)
    monkeypatch.setattr(distributed, "DIGEST_CHUNK", CHUNK)
    bound = 4 * 8 * CHUNK
    short, long = _rollout(4, 1280), _rollout(16, 1280)
    peaks = [peak_bytes(lambda r=r: _digest(r)) for r in (short, long)]
    assert max(peaks) <= bound, (peaks, bound)
    monkeypatch.setattr(distributed, "field_checksum", widened_checksum)
    widened = peak_bytes(lambda: _digest(long))
    assert widened > 20 * long.rollout_experts_BSLK.numel(), widened
