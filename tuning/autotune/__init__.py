"""The offline autotuner: `python -m tuning.autotune` measures launch configs (and which tier
runs each direction) on this GPU and writes the device's tuned-config file. Nothing here runs
at a user's trace time except `measure`, which runtime autotune (`autotune="fast"`) calls.

- `cli`: the command line (`__main__` runs it).
- `tasks`: which (kernel, problem) pairs to tune and the entries they become (plain Python).
- `sched`: runs the tasks on the executors, writes the file as results arrive, resumes.
- `workers`: worker processes (one per GPU), in-process and Ray executors.
- `measure`: compiles, checks and times the candidates of one kernel on one problem.
- `search_space`: the candidates of each kernel (from its descriptor in `pallas_kernels`).
- `tiers`: times both tiers of each direction and records the faster in the file.

Importing this package imports none of them (the worker processes and the CLI's parent must
stay light).
"""
