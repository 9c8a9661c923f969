"""Simulation of fthsdp at scales this machine cannot run.

Pure models over plain data, no processes and no sockets:

* `twin` — the numerical twin: N replicas of FT-HSDP in one process through the
  same jitted step code, for the LR-intervention study.

* `schedules` — failure schedules in the paper's grammar, scaled to this machine.

* `ett` — effective training time (ETT) of a job as a function of GPU count,
  failure rate and the stall of each recovery step, for synchronous training,
  FT-HSDP as its paper measured it, and fthsdp from our measured stalls; both
  as a closed form and as a seeded discrete-event simulation of weeks of
  failures.

* `emulation` (with `mock_plane` and `aio_client`) — **the only place in
  fthsdp where mocks are allowed**: the real lighthouse process, the real
  quorum decision and the replica step machine (`fthsdp.replica.fsm`) run for
  R replicas x G ranks (up to 100,000 ranks on one machine), with the model's
  compute replaced by its shapes and timings and FTAR's data plane by a mock
  with configurable latency and bandwidth; faults are injected and the
  invariants of the real tests checked on every rank
  (experiments/scale.py, tests/test_emulation.py); `shards` splits its
  replicas over several emulator processes for fault-free measurements.

Everything that stands in for a real cluster lives in this one labelled
package; nothing outside it imports it.
"""
