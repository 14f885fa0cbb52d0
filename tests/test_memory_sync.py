"""The weight sync streams: ``GatheredStateDict`` gathers and casts one tensor when the engine reads it, so a sync
holds about one tensor in the engine's dtype beside the weights, not a second copy of the model. Measured on the
CPU with the torch engine's in-place load (the same reads vLLM's loader makes, tensor by tensor)."""

import torch

from dcmdp.distributed import GatheredStateDict, sync_dtype
from tests.test_memory_learner import peak_bytes
from trainers.config import ModelConfig, RolloutConfig
from trainers.engines.torch_engine import TorchEngine
from trainers.models import build_model

torch.set_num_threads(1)


def test_memory_weight_sync_holds_one_tensor_at_a_time():
    model = build_model(ModelConfig(preset="small-dense"), 101, seed=0)
    rollout_cfg = RolloutConfig(precision="bf16")
    engine = TorchEngine(rollout_cfg, model, eos_id=1, pad_id=0)
    dtype = sync_dtype(rollout_cfg)
    assert dtype == torch.bfloat16
    state = model.state_dict()
    largest = max(t.numel() for t in state.values()) * dtype.itemsize
    whole = sum(t.numel() for t in state.values()) * dtype.itemsize
    assert whole > 20 * largest  # a model of many tensors: one of them is far below the whole
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # new weights to sync
    streamed = peak_bytes(lambda: engine.load_weights(GatheredStateDict(model.state_dict(), dtype), version=1))
    assert streamed <= 3 * largest, (streamed, largest)
    for name, t in engine.model.state_dict().items():  # every tensor arrived (the trainer's views hold the new values)
        torch.testing.assert_close(t.float(), state[name].to(t.dtype).float(), rtol=0, atol=0)
    # what a gathered dict costs instead: the whole model in the engine's dtype at once
    whole_dict = peak_bytes(lambda: engine.load_weights({k: v.to(dtype) for k, v in model.state_dict().items()},
                                                        version=2))
    assert whole_dict >= 0.9 * whole


def test_memory_quantised_rollouts_sync_at_full_precision():
    # int8 and the others re-quantise from the trainer's values: those travel as trained
    assert sync_dtype(RolloutConfig(precision="int8")) is None
    assert sync_dtype(RolloutConfig(precision="fp32")) == torch.float32
