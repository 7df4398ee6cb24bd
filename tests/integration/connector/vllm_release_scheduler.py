"""Run in a subprocess whose PYTHONPATH puts another vLLM release first (see
test_vllm_release_scheduler.py): that release's real Scheduler, with kvpush's connector as its KV
connector (producer role), schedules a chunked prefill and a short one; every push the connector
puts in a step's metadata must name exactly the blocks that release's KVCacheManager holds for the
request. Prints one JSON line."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import vllm
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

platforms._current_platform = CpuPlatform()  # a CUDA build imported on a machine without a GPU

from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvpush.common.deployment_secret import TRANSFER_PARAMS, derive_key, new_secret, secret_file_text  # noqa: E402
from kvpush.common.kv_params import PushParams  # noqa: E402


def main(model_dir: str) -> None:
    secret = os.path.join(tempfile.mkdtemp(), "secret")
    deployment_secret = new_secret()
    signing_key = derive_key(deployment_secret, TRANSFER_PARAMS)  # the connector refuses unsigned legs
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, secret_file_text(deployment_secret).encode())
    os.close(fd)
    kv = {"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.connector", "kv_role": "kv_producer",
          "engine_id": "t.prefill", "kv_buffer_device": "cpu",
          "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": 5999,
                                        "allowed_engines": ["t.decode"], "secret_file": secret}}
    config = EngineArgs(model=model_dir, kv_transfer_config=kv, max_model_len=2048, max_num_batched_tokens=256,
                        enable_prefix_caching=False).create_engine_config()
    block_size = config.cache_config.block_size
    config.cache_config.num_gpu_blocks = 400
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    sched = Scheduler(vllm_config=config, kv_cache_config=KVCacheConfig(num_blocks=400, kv_cache_tensors=[],
                                                                        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]),
                      structured_output_manager=StructuredOutputManager(config), block_size=block_size, log_stats=True)

    def request(i: int, n: int) -> Request:
        prompt = list(range(1000 + i, 1000 + i + n))
        params = PushParams("producer", f"t{i}", "t.decode", "127.0.0.1", 5999)
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=1), None)
        r.kv_transfer_params = params.signed(signing_key, "t.prefill", int(time.time()) + 600, prompt).to_dict()
        return r

    sched.add_request(request(0, 2 * block_size + 200))  # a prefill in chunks of 256 tokens
    sched.add_request(request(1, 40))
    pushes = []
    for _ in range(8):
        out = sched.schedule()
        for send in out.kv_connector_metadata.sends:
            pushes.append({"req": send.req_id, "blocks": list(send.block_ids),
                           "manager": list(sched.kv_cache_manager.get_block_ids(send.req_id)[0])})
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        done = [sched.requests[i].num_computed_tokens >= sched.requests[i].num_prompt_tokens for i in ids]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)},
                                                        sampled_token_ids=[[5] if d else [] for d in done]))
    print(json.dumps({"vllm": vllm.__version__, "blocks_view": type(sched.connector._scheduler.kv_cache_manager).__name__,
                      "pushes": pushes}))


if __name__ == "__main__":
    main(sys.argv[1])
