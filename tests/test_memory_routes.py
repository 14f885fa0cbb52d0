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


# ------------------------------------------------------------------------------------------ route mismatch


def _sorted_mismatch(train_BSLK, rollout_BSLK, mask_BS=None):
    """The measures as they were (whole-tensor sorts), in float64: (share, per-position share (B, S))."""
    valid_BSL = (train_BSLK >= 0).all(-1) & (rollout_BSLK >= 0).all(-1)
    differ_BSL = (train_BSLK.sort(-1).values != rollout_BSLK.sort(-1).values).any(-1) & valid_BSL
    per_BS = differ_BSL.sum(-1).double() / valid_BSL.sum(-1).clamp_min(1).double()
    if mask_BS is not None:
        valid_BSL = valid_BSL & mask_BS.bool()[:, :, None]
    return (differ_BSL & valid_BSL).sum().double() / valid_BSL.sum().clamp_min(1), per_BS


def _routes_pair(rows: int, seq: int, flip: float = 0.1, seed: int = 0):
    """The routes of ``_rollout`` and a copy with ``flip`` of the (position, layer) sets changed, some only
    reordered (the same set), and -1 in a few positions of either."""
    g = torch.Generator().manual_seed(seed)
    rollout = _rollout(rows, seq, seed).rollout_experts_BSLK
    train = rollout.clone()
    changed_BSL = torch.rand(train.shape[:3], generator=g) < flip
    train[changed_BSL] = torch.randint(0, E, (int(changed_BSL.sum()), K), generator=g).to(torch.int8)
    reordered_BSL = torch.rand(train.shape[:3], generator=g) < flip
    train[reordered_BSL] = train[reordered_BSL].flip(-1)
    train[:, -1] = -1  # the last position has no route on one side
    rollout[0, :2, 1] = -1
    mask_BS = torch.rand(rows, seq, generator=g) < 0.8
    return train, rollout, mask_BS


def test_route_mismatch_in_chunks_is_the_whole_sort_and_same_tensor_is_zero_without_work(monkeypatch):
    from constraints import measures
    from constraints.sources import routing_flips

    monkeypatch.setattr(measures, "ROUTE_CHUNK", 100)  # 3 positions of 32 elements a chunk: 14 chunks, one partial
    train, rollout, mask_BS = _routes_pair(3, 13)
    share, per_BS = _sorted_mismatch(train, rollout, mask_BS)
    assert 0.05 < share < 0.5  # the case is informative
    assert measures.routing_mismatch(train, rollout, mask_BS).item() == share.item()
    assert torch.allclose(measures.routing_mismatch_per_token(train, rollout).double(), per_BS, rtol=0, atol=1e-7)
    assert routing_flips(rollout, train, None, mask_BS) == {"router": share.item(), "replayed": share.item()}
    # one tensor on both sides (R3): 0 by construction, and no sort, comparison or count runs
    ops = _ops(lambda: (measures.routing_mismatch(rollout, rollout, mask_BS),
                        measures.routing_mismatch_per_token(rollout, rollout),
                        routing_flips(rollout, None, rollout, mask_BS)))
    assert not {"sort", "ne", "ge", "sum"} & ops, ops
    assert measures.routing_mismatch(rollout, rollout, mask_BS).item() == 0.0
    assert not measures.routing_mismatch_per_token(rollout, rollout).any()
    assert routing_flips(rollout, None, rollout, mask_BS)["replayed"] == 0.0
    # an equal copy is compared, and found equal
    assert measures.routing_mismatch(rollout, rollout.clone(), mask_BS).item() == 0.0


def _ops(fn) -> set[str]:
    """Names of the aten operators ``fn`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record() as mode:
        fn()
    return mode.names


def test_memory_route_mismatch_peak_is_a_few_chunks_whatever_the_routes_length(monkeypatch):
    # routes of 1.6e5 and 6.6e5 int8 elements: a chunk of 16384 elements holds two sorts' int64 indices (256 KiB);
    # the whole-tensor sorts held ~18x the routes (11 MiB for the longer)
    from constraints import measures

    monkeypatch.setattr(measures, "ROUTE_CHUNK", CHUNK)
    peaks = []
    for rows in (4, 16):
        train, rollout, mask_BS = _routes_pair(rows, 1280)
        peaks.append(peak_bytes(lambda: (measures.routing_mismatch(train, rollout, mask_BS),
                                         measures.routing_mismatch_per_token(train, rollout))))
        positions = rows * 1280
    # beside the chunk's temporaries: the (B, S) int32 counts and per-token shares (a few bytes per position)
    bound = 3 * 8 * CHUNK + 16 * positions
    assert max(peaks) <= bound, (peaks, bound)
    whole = peak_bytes(lambda: _sorted_mismatch(train, rollout, mask_BS))
    assert whole > 10 * train.numel() and whole > 4 * bound, (whole, bound)


def test_dropped_rows_keep_r3s_routes_one_tensor():
    """Masking rows out of an R3 batch leaves one routes tensor (the masked rollout's) for both engines: no copy, and
    the route measures take their 0-by-construction shortcut."""
    from trainers.learner import ScoredBatch, drop_rows

    rollout = _rollout(3, 20)
    routes = rollout.rollout_experts_BSLK
    batch = ScoredBatch(rollout, torch.zeros(3, 16), torch.zeros(3, 16), routes, routes)
    kept = drop_rows(batch, torch.tensor([True, False, True]))
    assert kept.train_experts_BSLK is kept.replay_experts_BSLK is kept.rollout.rollout_experts_BSLK
    assert (kept.train_experts_BSLK[1, 4:] == -1).all() and torch.equal(kept.train_experts_BSLK[0], routes[0])
