"""Run by tests/test_vllm_engine.py in its own process: a vLLM engine whose core and worker run in other
processes (VLLM_ENABLE_V1_MULTIPROCESSING=1) syncs new weights through files; prints one JSON line with
the max |log mu - log pi| of fresh samples against float32 transformers forwards of the new and old weights."""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(preset: str) -> None:
    import torch

    from trainers.config import ModelConfig, RolloutConfig
    from trainers.engines import build_engine
    from trainers.models import build_model, save_model_dir
    from trainers.scoring import response_logprobs
    from trainers.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    old = build_model(ModelConfig(preset=preset), len(tok), seed=0)
    new = build_model(ModelConfig(preset=preset), len(tok), seed=1)
    prompts = [[10, 20, 30], [40, 50, 60, 70, 80], [90]]
    with tempfile.TemporaryDirectory() as tmp:
        save_model_dir(old, tok, tmp)
        engine = build_engine(RolloutConfig(engine="vllm", max_new_tokens=8), old, tmp, eos_id=tok.eos_token_id,
                              pad_id=tok.pad_token_id)
        try:
            assert not engine.in_process
            engine.load_weights(new.state_dict(), version=1)
            rollout = engine.generate(prompts, seed=3)
        finally:
            engine.close()
    mask_BT = rollout.response_mask_BT.bool()
    diff = {}
    for name, model in (("new", new), ("old", old)):
        with torch.no_grad():
            logp_BT, _ = response_logprobs(model, rollout.input_ids_BS, rollout.attention_mask_BS,
                                           rollout.num_prompt_positions, temperature=1.0, fp32_lm_head=True)
        diff[name] = (logp_BT - rollout.rollout_logp_BT)[mask_BT].abs().max().item()
    print(json.dumps({"max_abs_diff_new": diff["new"], "max_abs_diff_old": diff["old"], "tokens": int(mask_BT.sum()),
                      "version": engine.version}))


if __name__ == "__main__":
    main(sys.argv[1])
