"""What the tests share: no test module imports another, they import these.

- wait: `wait_until` (the one polling loop) and `wait_health`.
- stack: `Stack`, an executor server and a scheduler server in-process (one background event loop).
- processes: real processes (`ServerProcess`, `serve`, `ServerProcesses`), each port read from the
  server's own "listening on" line.
- generation: clients driving a server (`generate_all`, `run_batch` over `PROMPTS`).
- kustomize: the Kubernetes overlays as `kubectl kustomize` renders them (the deploy tests).
- triton_interpreter: the Triton interpreter patched for numpy >= 2.4 (the CPU kernel tests).
- scheduler, worker, checkpoints: scheduler plans with `FakeExecutor`, the real Worker under the
  Scheduler, modified model folders.
"""
