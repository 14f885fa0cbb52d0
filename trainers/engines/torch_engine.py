"""The embedded rollout engine: batched sampling with a KV cache on the engine's own copy of the model.

It departs from the trainer only where the user asks it to: the copy runs in ``rollout.precision``
(fp32 | bf16 | fp16 casts; int8, fp8_weight, int4 weight-only and fp8 W8A8 fake quantisation, see
``trainers.quant``), and its LM head runs in that precision (logits are upcast to float32 before the
softmax, as serving engines do). In fp32 every log-prob it reports equals
``trainers.scoring.response_logprobs`` of the trainer's model to float rounding, because both compute
``log softmax(logits / temperature)`` of the same network at the same positions
(``scoring.position_ids`` over the full left-padded sequence).

Decoding: one prefill over the left-padded prompts, then one token per step for the rows still
decoding. Each row stops at EOS (kept in the response and its mask); the loop stops when every row has
stopped or after ``max_new_tokens``. The returned T is the longest response of the batch, not
necessarily ``max_new_tokens``. With ``rollout.torch.drop_finished`` (default) finished rows leave the decode
batch: once at least ``COMPACT_FRACTION`` of the rows in it have stopped (a row stops the step after
its EOS, which is fed and routed as before), the batch, its attention mask
and every layer's KV cache are cut down to the live rows, so long responses of uneven length cost no
compute after EOS (verl and vLLM schedule per sequence for the same reason). Off, finished rows keep being
fed padding, masked out. Sampling is the same in both: every step draws its random numbers for all B
rows (the exponential race ``argmax p / q``, q ~ Exp(1), which is ``torch.multinomial``'s own one-sample
path) and the live rows take theirs, so a seed gives the same tokens whichever rows are still decoding;
log mu agrees to float rounding (matmuls over a smaller batch may round differently, tests/test_engine.py).

Decode attention (``rollout.torch.gqa_decode``, default on): a decode step's single query attends to the KV cache
through ``scaled_dot_product_attention(..., enable_gqa=True)``, which reads each shared KV head in place, where
transformers' ``sdpa`` path copies the whole cache once per query head sharing it (``repeat_kv``) whenever a mask
is given. The same kernel on the same values: the output is bitwise that of the copying path
(tests/test_torch_engine.py), so the trainer, which keeps ``sdpa``, still scores the engine's tokens to float
rounding. The prefill goes through transformers' ``sdpa`` unchanged.

KV cache (``rollout.torch.kv_cache``): ``dynamic`` (default) appends each step's keys and values, so the cache and
the mask grow by one column per step; ``static`` allocates P + max_new_tokens positions (rounded up to
``STATIC_CACHE_ROUND``) at the prefill, writes each step in place and masks the positions not yet fed: the same keys
and values reach every softmax, so the same tokens from the same seed and log mu to float rounding
(tests/test_torch_engine.py). Its fixed shapes let a decode step be captured once and replayed as a CUDA graph
(``rollout.torch.decode_graphs``: ``torch.compile(mode="reduce-overhead")`` of the decoder, CUDA and dense models
only; finished rows are then fed padding rather than compacted, which leaves the tokens unchanged as above).

Logit noise (``rollout.logit_noise = sigma > 0``): a stress knob, not a deployment format. Each decode
step adds ``sigma * N(0, 1)`` noise, drawn from the engine's generator seeded by ``generate``'s ``seed``
(so a rollout stays reproducible from its seed), to the float32 logits after the LM head, before
temperature and top-p: the token is sampled from ``softmax((z + sigma eps) / T)`` (top-p renormalised)
and ``rollout_logp`` is its log-probability under that noised distribution, so mu is the distribution
that actually sampled it. Per step the draws are the (B, V) noise first, then the token. The noise is
input-independent: no weight change removes its discrepancy (docs/design.md §"What the dual can and cannot fix").

Top-p: ``rollout_logp`` is the log-probability under the renormalised nucleus distribution that was
actually sampled from, while the trainer scores the full tempered distribution. With ``top_p < 1``
the importance ratios pi_old / mu are then biased (tokens in the nucleus look under-weighted): keep
``top_p = 1`` for an unbiased training-inference correction.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from trainers import routing
from trainers.attention import sdpa_gqa
from trainers.batch import Rollout, left_pad_prompts
from trainers.config import RolloutConfig
from trainers.quant import PRECISION_DTYPES, QUANTIZED_PRECISIONS, cast_for_precision, quantize_weights_
from trainers.scoring import lm_head_logits, position_ids, tempered_logp

# drop_finished: compact the decode batch once this share of its rows has stopped (a compaction copies the KV
# cache once, as every decode step's cache append already does).
COMPACT_FRACTION = 0.125

GQA_DECODE_ATTENTION = "dcmdp_sdpa_gqa_decode"

# rollout.torch.kv_cache=static: the cache length P + max_new_tokens rounded up to a multiple of this, so that batches
# of similar prompt lengths share one cache shape (one captured decode graph per shape).
STATIC_CACHE_ROUND = 64

# rollout.torch.kv_tokens=0 on CUDA: the share of the free device memory a rollout's KV cache may take (the rest
# holds the decode step's activations and logits).
KV_FREE_FRACTION = 0.8


def sdpa_gqa_decode(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                    **kwargs):
    """transformers' ``sdpa`` attention, except that a one-query step with a mask and grouped KV heads passes
    ``enable_gqa=True`` instead of materialising the repeated heads. query (B, H, 1, D), key/value (B, H_kv, S, D)."""
    attend = sdpa_gqa if query.shape[2] == 1 else sdpa_attention_forward  # trainers.attention: the in-place path
    return attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                  **kwargs)


AttentionInterface.register(GQA_DECODE_ATTENTION, sdpa_gqa_decode)
ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_DECODE_ATTENTION, sdpa_mask)


def nucleus_logp(logp_BV: Tensor, top_p: float) -> Tensor:
    """(B, V) log-probs renormalised over the smallest set of top tokens with mass >= ``top_p``.

    Holtzman et al. 2020 (arXiv 1904.09751). A token is kept when the mass of the tokens strictly more
    likely than it is below ``top_p`` (so the most likely token is always kept); the rest get -inf.
    """
    if top_p >= 1.0:
        return logp_BV
    sorted_logp, order = logp_BV.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = logp_BV.masked_fill(~keep, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def _select_rows(cache, keep_A: Tensor) -> None:
    """Keep rows ``keep_A`` of every layer of a dynamic or static KV cache (in place)."""
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys[keep_A], layer.values[keep_A]
                layer.batch_size = len(keep_A)
        return
    for layer in cache.layers:
        layer.batch_select_indices(keep_A)


class TorchEngine:
    name = "torch"

    def __init__(self, cfg: RolloutConfig, model: torch.nn.Module, *, eos_id: int, pad_id: int):
        cfg.check()
        self.cfg = cfg
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        # With a precision schedule the engine keeps the weights it was given at full precision, so that a switch
        # quantises them afresh (a quantised copy cannot be re-quantised to another grid without compounding).
        self._master = cast_for_precision(model, "fp32") if cfg.precision_schedule else None
        self.precision = cfg.precision
        self._set_model(model)
        self.is_moe = routing.is_moe(self.model)
        # Decoding runs where the model lives; the returned Rollout is always on the CPU.
        self.device = next(self.model.parameters()).device
        self.version = 0

    def _set_model(self, model: torch.nn.Module) -> None:
        """The engine's own frozen copy of ``model`` in ``self.precision``: the trainer's parameters are never
        touched or aliased; with ``rollout.torch.share_weights`` the trainer's model itself, read in eval mode
        under inference mode (the config check makes sure its dtype is the rollout precision's)."""
        cfg = self.cfg
        self.dtype = PRECISION_DTYPES[self.precision]
        if cfg.torch.share_weights:
            self.model = model
            return
        self.model = cast_for_precision(model, self.precision, int4_group_size=cfg.torch.int4_group_size,
                                        quantize_lm_head=cfg.torch.quantize_lm_head)
        if cfg.torch.gqa_decode:
            self.model.set_attn_implementation(GQA_DECODE_ATTENTION)

    def set_precision(self, precision: str) -> None:
        """Run the next rollouts in ``precision`` (``rollout.precision_schedule``): a new engine copy of the
        full-precision weights of the last ``load_weights``, cast and quantised as at start. A no-op when
        ``precision`` is already in effect."""
        if precision == self.precision:
            return
        if self._master is None:
            raise ValueError("set_precision needs rollout.precision_schedule: without it the engine keeps no "
                             "full-precision weights to quantise afresh")
        self.precision = precision
        self._set_model(self._master)

    def generate(self, prompts: list[list[int]], seed: int) -> Rollout:
        """Sample one response per prompt; identical ``seed`` and weights give identical rollouts."""
        training = self.model.training  # a shared model is the trainer's: back to its mode afterwards
        self.model.eval()
        try:
            return self._generate(prompts, seed)
        finally:
            self.model.train(training)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], seed: int) -> Rollout:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        B, P, T = len(prompts), max(len(p) for p in prompts), self.cfg.max_new_tokens
        dev = self.device
        prompt_ids_BP, prompt_mask_BP = left_pad_prompts(prompts, self.pad_id)
        prompt_ids_BP, prompt_mask_BP = prompt_ids_BP.to(dev), prompt_mask_BP.to(dev)
        rows = self.kv_rows(P + T)
        parts = [self._decode(prompt_ids_BP[r0:r0 + rows], prompt_mask_BP[r0:r0 + rows], r0, B, seed)
                 for r0 in range(0, B, rows)]
        steps = max(part[0].shape[1] for part in parts)

        def cat(i: int, fill, width: int) -> Tensor:
            """Field ``i`` of every sub-batch, stacked over rows and padded with ``fill`` to ``width`` columns."""
            first = parts[0][i]
            out = first.new_full((B, width, *first.shape[2:]), fill)
            r0 = 0
            for part in parts:
                out[r0:r0 + len(part[i]), :part[i].shape[1]] = part[i]
                r0 += len(part[i])
            return out

        response_ids_BT = cat(0, self.pad_id, steps)
        response_mask_BT = cat(1, False, steps)
        rollout_logp_BT = cat(2, 0.0, steps)
        experts_BSLK = cat(3, -1, P + steps) if self.is_moe else None
        return Rollout(prompt_ids_BP=prompt_ids_BP.cpu(), prompt_mask_BP=prompt_mask_BP.cpu(),
                       response_ids_BT=response_ids_BT.cpu(), response_mask_BT=response_mask_BT.cpu(),
                       rollout_logp_BT=rollout_logp_BT.cpu(),
                       rollout_experts_BSLK=None if experts_BSLK is None else experts_BSLK.cpu(),
                       version_B=torch.full((B,), self.version, dtype=torch.long))

    def kv_rows(self, positions: int) -> int:
        """Rows decoded at once: those whose KV cache of ``positions`` positions fits ``rollout.torch.kv_tokens``, or
        when it is 0, ``KV_FREE_FRACTION`` of the free device memory on CUDA (every row at once on the CPU); at
        least one."""
        budget = self.cfg.torch.kv_tokens
        if budget <= 0 and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            c = self.model.config
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * self.dtype.itemsize
            budget = int(KV_FREE_FRACTION * free // per_token)
        if budget <= 0:
            return 1 << 62
        return max(budget // positions, 1)

    def _decode(self, prompt_ids_BP: Tensor, prompt_mask_BP: Tensor, first: int, total: int, seed: int
                ) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
        """Decode rows ``first .. first + B - 1`` of a rollout of ``total`` rows: (response_ids_BT, response_mask_BT,
        rollout_logp_BT, experts_BSLK or None), T the steps this sub-batch took. The generator restarts from
        ``seed`` and every step draws for all ``total`` rows (``_sample``), so each row gets the tokens it gets in
        one batch of all the rows."""
        B, P, T = prompt_ids_BP.shape[0], prompt_ids_BP.shape[1], self.cfg.max_new_tokens
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(int(seed))
        response_ids_BT = torch.full((B, T), self.pad_id, dtype=torch.long, device=dev)
        response_mask_BT = torch.zeros((B, T), dtype=torch.bool, device=dev)
        rollout_logp_BT = torch.zeros((B, T), dtype=torch.float32, device=dev)
        # The decode batch: A rows, row a is row rows_A[a] of the batch; live_A: not yet stopped.
        rows_A = torch.arange(B, device=dev)
        live_A = torch.ones(B, dtype=torch.bool, device=dev)
        # Mask over every position fed so far (decode batch rows); grows by one column per decode step.
        # With a static cache it has the cache's L columns from the start, False where nothing was fed yet.
        static = self.cfg.torch.kv_cache == "static"
        graphs = static and self._decode_graphs()
        if static:
            L = -(-(P + T) // STATIC_CACHE_ROUND) * STATIC_CACHE_ROUND
            cache = self._static_cache(B, L, reuse=graphs)
            mask_AS = torch.zeros((B, L), dtype=torch.bool, device=dev)
            mask_AS[:, :P] = prompt_mask_BP
        else:
            cache = DynamicCache(config=self.model.config)
            mask_AS = prompt_mask_BP.clone()
        next_pos_A = prompt_mask_BP.sum(dim=-1)  # position of the first response token
        fed_rows = []  # rows_A of every decode forward, for the routes
        base = self.model.model
        decode = self._graph_step(base) if graphs else base

        with routing.capture_routes(self.model) if self.is_moe else contextlib.nullcontext() as capture:
            out = base(input_ids=prompt_ids_BP, attention_mask=mask_AS, position_ids=position_ids(prompt_mask_BP),
                       past_key_values=cache, use_cache=True)
            hidden_AH = out.last_hidden_state[:, -1]
            steps = 0
            for t in range(T):
                token_A, logp_A = self._sample(hidden_AH, gen, rows_A + first, total)
                fed_A = live_A  # token t is a real position of these rows (EOS included)
                response_ids_BT[rows_A, t] = torch.where(fed_A, token_A, self.pad_id)
                response_mask_BT[rows_A, t] = fed_A
                rollout_logp_BT[rows_A, t] = torch.where(fed_A, logp_A, 0.0)
                live_A = fed_A & (token_A != self.eos_id)
                steps = t + 1
                if t == T - 1 or not bool(live_A.any()):
                    break
                # A row leaves the decode batch the step after its EOS, which is still fed so that its routes
                # are recorded as without compaction.
                # (A captured decode graph has a fixed batch: finished rows are fed padding instead.)
                if (self.cfg.torch.drop_finished and not graphs
                        and int((~fed_A).sum()) >= COMPACT_FRACTION * len(fed_A)):
                    keep_A = fed_A.nonzero().squeeze(-1)
                    _select_rows(cache, keep_A)
                    rows_A, mask_AS, next_pos_A = rows_A[keep_A], mask_AS[keep_A], next_pos_A[keep_A]
                    fed_A, live_A = fed_A[keep_A], live_A[keep_A]
                # Feed token t back at its position in the full sequence (scoring.position_ids); in rows
                # already finished (drop_finished off, or not compacted yet) it is padding, masked out of
                # every later query.
                if static:
                    mask_AS[:, P + t] = fed_A
                else:
                    mask_AS = torch.cat([mask_AS, fed_A[:, None]], dim=1)
                fed_rows.append(rows_A)
                if graphs:  # the last step's outputs were read (sampled from): the graph may overwrite them
                    torch.compiler.cudagraph_mark_step_begin()
                out = decode(input_ids=response_ids_BT[rows_A, t:t + 1], attention_mask=mask_AS,
                             position_ids=(next_pos_A + t)[:, None], past_key_values=cache, use_cache=True)
                hidden_AH = out.last_hidden_state[:, -1]

        response_ids_BT = response_ids_BT[:, :steps].contiguous()
        response_mask_BT = response_mask_BT[:, :steps].contiguous()
        rollout_logp_BT = rollout_logp_BT[:, :steps].contiguous()
        experts_BSLK = None
        if self.is_moe:
            experts_BSLK = self._assemble_routes(capture, prompt_mask_BP, response_mask_BT, fed_rows)
        return response_ids_BT, response_mask_BT, rollout_logp_BT, experts_BSLK

    def _sample(self, hidden_AH: Tensor, gen: torch.Generator, rows_A: Tensor, B: int) -> tuple[Tensor, Tensor]:
        """Sample one token per decode-batch row from the tempered (top-p) distribution; returns (token_A, logp_A).

        The random numbers are drawn for all B rows of the batch and row ``rows_A[a]``'s are used, so a row's
        token does not depend on which rows are still in the decode batch. The token is the exponential race
        argmax_v p_v / q_v with q ~ Exp(1), the algorithm ``torch.multinomial`` runs for one sample (same draws,
        same tokens).
        """
        logits_AV = lm_head_logits(self.model, hidden_AH, fp32_lm_head=False).float()
        V = logits_AV.shape[-1]
        if self.cfg.logit_noise > 0:
            noise_BV = torch.randn((B, V), generator=gen, device=logits_AV.device)
            logits_AV = logits_AV + self.cfg.logit_noise * noise_BV[rows_A]
        logp_AV = nucleus_logp(tempered_logp(logits_AV, self.cfg.temperature), self.cfg.top_p)
        race_BV = torch.empty((B, V), dtype=logp_AV.dtype, device=logp_AV.device).exponential_(1, generator=gen)
        token_A = (logp_AV.exp() / race_BV[rows_A]).argmax(dim=-1)
        return token_A, logp_AV.gather(-1, token_A[:, None]).squeeze(-1)

    def _static_cache(self, B: int, L: int, *, reuse: bool) -> StaticCache:
        """A static cache of B rows and L positions, allocated at its first write. ``reuse`` (decode graphs, which
        never compact it): the one of the last rollout of the same shape, reset, so that its tensors keep the
        addresses a captured graph reads."""
        held = getattr(self, "_static", None)
        if reuse and held is not None and held[0] == (B, L):
            held[1].reset()
            return held[1]
        cache = StaticCache(config=self.model.config, max_cache_len=L)
        self._static = ((B, L), cache) if reuse else None
        return cache

    def _decode_graphs(self) -> bool:
        """Whether decode steps run as captured CUDA graphs (``rollout.torch.decode_graphs``): on CUDA, for dense
        models only (an MoE's route capture records every router call in Python, which a graph would skip)."""
        return self.cfg.torch.decode_graphs and self.device.type == "cuda" and not self.is_moe

    def _graph_step(self, base: torch.nn.Module):
        """The decoder's forward compiled with ``mode="reduce-overhead"``: inductor kernels replayed as CUDA graphs,
        one per (batch, cache length); compiled once per engine model."""
        step = getattr(self, "_compiled", None)
        if step is None or step[0] is not base:
            step = (base, torch.compile(base, mode="reduce-overhead", fullgraph=False, dynamic=False))
            self._compiled = step
        return step[1]

    def _assemble_routes(self, capture: routing.RouteCapture, prompt_mask_BP: Tensor, response_mask_BT: Tensor,
                         fed_rows: list[Tensor]) -> Tensor:
        """(B, S, L, K) experts per fed position: router call 0 is the prefill over the P prompt
        positions, call t >= 1 fed response token t-1 at position P + t - 1 for the rows ``fed_rows[t-1]``.
        -1 where nothing real was routed (padding, rows no longer decoding) and at the last response
        column, which is never fed back."""
        B, P = prompt_mask_BP.shape
        T = response_mask_BT.shape[1]
        L, K = capture.num_layers, capture.top_k
        experts_BSLK = torch.full((B, P + T, L, K), -1, dtype=routing.model_route_dtype(self.model),
                                  device=prompt_mask_BP.device)
        for layer in range(L):
            calls = capture.calls(layer)
            experts_BSLK[:, :P, layer] = calls[0].reshape(B, P, K)
            for t, (rows_A, experts) in enumerate(zip(fed_rows, calls[1:])):
                experts_BSLK[rows_A, P + t, layer] = experts.reshape(len(rows_A), K)
        fed_BS = torch.cat([prompt_mask_BP, response_mask_BT[:, :-1], torch.zeros_like(response_mask_BT[:, :1])], dim=1)
        return experts_BSLK.masked_fill(~fed_BS[:, :, None, None], -1)

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> None:
        """Copy the trainer's weights into the engine's tensors in place (cast; re-quantised for the quantised
        precisions, from the trainer's values). A no-op on shared weights: they are the trainer's."""
        if self.cfg.torch.share_weights:
            self.version = int(version)
            return
        if self._master is not None:
            self._load_into(self._master, state_dict)
        self._load_into(self.model, state_dict)
        if self.precision in QUANTIZED_PRECISIONS:
            quantize_weights_(self.model, self.precision, int4_group_size=self.cfg.torch.int4_group_size,
                              lm_head=self.cfg.torch.quantize_lm_head)
        self.version = int(version)

    @staticmethod
    def _load_into(model: torch.nn.Module, state_dict: dict[str, Tensor]) -> None:
        own = model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise KeyError(f"load_weights: state dict lacks {len(missing)} engine tensors, e.g. {missing[:3]}")
        for name, tensor in own.items():
            src = state_dict[name]
            if src.shape != tensor.shape:
                raise ValueError(f"load_weights: {name} has shape {tuple(src.shape)}, engine expects "
                                 f"{tuple(tensor.shape)}")
            tensor.copy_(src.detach().to(device=tensor.device, dtype=tensor.dtype))

    def close(self) -> None:
        self.model = None
        self._master = None



def build(cfg: RolloutConfig, model: torch.nn.Module, model_dir: str | None, *, eos_id: int, pad_id: int,
          every_rank: bool = False) -> TorchEngine:
    """The registry's builder (``trainers.engines.ENGINES``): the engine copies ``model``; ``model_dir`` is unused."""
    if every_rank:
        raise ValueError("the torch engine runs on rank 0 only (weight_sync rank0); it has no per-rank part")
    return TorchEngine(cfg, model, eos_id=eos_id, pad_id=pad_id)
