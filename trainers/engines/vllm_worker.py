"""Methods dcmdp adds to vLLM's workers (``LLM(worker_extension_cls=...)``), for engines whose workers run
in other processes (multiprocess engine core, tensor parallelism): only strings cross the process boundary.

Imported by vLLM inside each worker process, never by ``import trainers``.
"""

from __future__ import annotations


class DcmdpWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def dcmdp_reload_weights(self, weights_path: str) -> int:
        """Reload every weight in place from the safetensors files in ``weights_path`` (checkpoint names;
        each tensor-parallel worker reads the full tensors and keeps its shard), then redo the CPU MoE
        kernel's prepacking that vLLM's reload skips. Returns the MoE layers whose prepacking was redone."""
        from vllm.platforms import current_platform

        from trainers.engines.vllm_engine import _prepack_cpu_moe_experts

        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return _prepack_cpu_moe_experts(self.model_runner.model) if current_platform.is_cpu() else 0
