"""Start-up time: `LLM()` to the first token of a one-token request, and `petrel serve` to its first 200 on /health.

python benchmarks/startup.py
"""

import resource
import socket
import subprocess
import sys
import time

import httpx

t0 = time.perf_counter()
from petrel import LLM, SamplingParams  # noqa: E402 - timed: the import is part of start-up

llm = LLM()
out = llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
t1 = time.perf_counter()
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"LLM() import+load+first token: {t1 - t0:.2f} s, peak RSS {peak_mib:.0f} MiB")
llm.shutdown()
s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
t0 = time.perf_counter()
p = subprocess.Popen(
    [sys.executable, "-m", "petrel.cli", "serve", "--port", str(port), "--log-level", "warning"],
    stderr=subprocess.DEVNULL,
)
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.05)
print(f"petrel serve -> /health 200: {time.perf_counter() - t0:.2f} s")
p.terminate()
p.wait()
