"""The `vllm bench serve` options kvpush bench passes are accepted by the installed vLLM's own parser."""
from __future__ import annotations


from kvpush.bench.client import LoadSpec, bench_serve_argv


def _load(tmp_path) -> LoadSpec:
    return LoadSpec(base_url="http://127.0.0.1:15000", served_model="tiny", tokenizer="/models/tiny", rate=2.0,
                    num_prompts=8, input_len=1024, output_len=32, seed=2000, result_dir=str(tmp_path),
                    result_filename="kvpush-rate2.json")


def test_the_real_vllm_cli_accepts_these_options(tmp_path):
    """Parse (not run) our argv with vLLM's own argument parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(bench_serve_argv(_load(tmp_path), command=["vllm"])[3:])
    assert (args.seed, args.request_rate, args.ignore_eos, args.random_prefix_len) == (2000, 2.0, True, 0)
    assert args.ready_check_timeout_sec == 0
