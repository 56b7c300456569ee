"""The fault suite behind ``tests/reliability/fault_suite.py``: a real ``kiln serve`` subprocess and the
probes that attack it (misrouting, bad input, overload, disconnects, SIGTERM, soak, security).

It lives with the tests, not in ``src/modelkiln``: it checks the product rather than being part of
it, and it needs test-only packages (hypothesis) and the test suite's error table
(``tests/error_cases.py``) and fuzzing strategies, which the installed package must not depend on.

- ``harness``: the server process, a raw HTTP/1.1 client (lying headers and stalls need bytes on a
  socket, not a client library that corrects them), /metrics reading, the reference answers.
- ``load``: probes that are about many good clients (misrouting, overload, SIGTERM, soak).
- ``hostile``: probes that are about bad clients (bad input, fuzzing, disconnects, security).
- ``generation_load``, ``generation_hostile``: the same probes for a text-generation model (the
  generation mode): greedy streamed answers through kiln loadtest's streaming client.
"""
