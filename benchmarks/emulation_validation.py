"""The pass-time model (cascade.emulation) against published decode measurements: prints a markdown table.

Each published figure is ``batch`` prompts of ``input`` tokens, each generating ``output`` tokens, reported as output
tokens/s: a vLLM ``benchmark_latency`` run (a static batch) or a ``vllm bench serve`` run at ``batch`` concurrent
requests of fixed lengths (``--ignore-eos``). The model's figure is the same run through the roofline: one prefill
pass over every prompt, then ``output - 1`` decode passes over contexts growing by one.

    python benchmarks/emulation_validation.py
"""

from __future__ import annotations

from cascade.emulation import Row, device, model, pass_seconds

# (source, device, model, gpus, dtype, batch, input, output, published output tokens/s)
PUBLISHED = [
    ("Oracle OCI blog, Llama 3.1 405B FP8 on BM.GPU.MI300X.8, vLLM benchmark_latency", "mi300x", "llama-3.1-405b", 8,
     "fp8", 1, 128, 128, 36.0),
    ("(same)", "mi300x", "llama-3.1-405b", 8, "fp8", 16, 128, 128, 468.0),
    ("(same)", "mi300x", "llama-3.1-405b", 8, "fp8", 64, 128, 128, 1184.0),
    ("(same)", "mi300x", "llama-3.1-405b", 8, "fp8", 256, 128, 128, 1846.0),
    # "about 75 tokens/sec" at one request and "a 6.6x gain" at eight (so ~495), 1024-token prompts, 128 out
    ("John Musgrave, vLLM throughput-latency sweep on NVIDIA A100 (vLLM 0.23.0, vllm bench serve, BF16)", "a100-40gb",
     "llama-3.1-8b", 1, "bf16", 1, 1024, 128, 75.0),
    ("(same; 6.6x the rate at one request)", "a100-40gb", "llama-3.1-8b", 1, "bf16", 8, 1024, 128, 6.6 * 75.0),
]


def modelled_rate(dev: str, name: str, gpus: int, dtype: str, batch: int, prompt: int, output: int) -> float:
    shape, profile = model(name), device(dev)
    seconds = pass_seconds(shape, profile, [Row(prompt, 0, 1)] * batch, gpus=gpus, dtype=dtype)
    for j in range(1, output):
        seconds += pass_seconds(shape, profile, [Row(1, prompt + j - 1, 1)] * batch, gpus=gpus, dtype=dtype)
    return batch * output / seconds


def main() -> None:
    print("| source | device | model | GPUs | dtype | batch | in/out | published tok/s | model tok/s | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for source, dev, name, gpus, dtype, batch, prompt, output, published in PUBLISHED:
        rate = modelled_rate(dev, name, gpus, dtype, batch, prompt, output)
        print(f"| {source} | {dev} | {name} | {gpus} | {dtype} | {batch} | {prompt}/{output} | {published:.0f} | "
              f"{rate:.0f} | {100 * (rate / published - 1):+.0f}% |")


if __name__ == "__main__":
    main()
