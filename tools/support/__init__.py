"""What the commands under ``tools/`` and the tests share: a typed library, no commands.

- ``procs``: the one process harness (start a command with its output in a log file,
  wait for a line of its log, check it is alive, stop it: a grace, then SIGKILL).
- ``benchlib``: process CPU, percentiles, free ports: what the benchmarks measure with.
- ``llama``: a real llama-server found, started and watched (its ``/slots``).
- ``tinymodel``, ``slowmodel``: the GGUF test models the suite and the benchmarks run.
- ``catalogs``: the tiny model's catalog, and catalogs of a given size; ``fleetapi``: what
  a running fleet's admin API and router say (``tools/fleet``, the lab, the tests).
- ``lab``, ``labwire``: the lab (a fleet of network namespaces on one machine) and the
  userspace wire that impairs a node's link; ``faults``: the traffic and the checks that
  the lab's fault benchmark and tests share.

The commands people run stay in ``tools/`` (``python -m tools.NAME`` from the checkout,
or the shell scripts); nothing here imports them, nor the tests. This package imports
only the standard library at import time where a benchmark's child process imports it
from another virtualenv (``procs``, ``benchlib``).
"""
