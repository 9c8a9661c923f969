"""Observability of an fthsdp job: Prometheus metrics, a live dashboard, JSON logs.

The observability plane is kept apart from the control plane on purpose: it
only *reads* what the control plane already produces (the Manager's per-step
`StepRecord`, the lighthouse's public Status RPC), so a bug or a slow scrape
here can never stall a quorum or an all-reduce.

* :mod:`fthsdp.observe.lighthouse_view` polls a lighthouse's Status RPC into
  plain dataclasses and keeps the history (membership timeline, failures) that
  a single Status answer does not carry.
* :mod:`fthsdp.observe.metrics` turns step records and lighthouse views into
  Prometheus metrics, serves them over HTTP and writes scrape target lists.
* :mod:`fthsdp.observe.dashboard` serves a self-contained live web page
  (`fthsdp dashboard`), every byte of it shipped in ``observe/static``.
* :mod:`fthsdp.observe.phase` is where a replica process is (computing, in
  FTAR waiting on a neighbour, fetching, ...), sent with its heartbeats; set
  at phase boundaries with one assignment, so the step never waits on it.
* :mod:`fthsdp.observe.root_cause` is the pure analysis the lighthouse runs
  over those reports: the root of the job's wait-for graph (dead, frozen,
  slow, a slow link) and the evidence.
"""
