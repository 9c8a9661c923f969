"""Simulation of fthsdp at scales this machine cannot run.

Pure models over plain data, no processes and no sockets:

* `ett` — effective training time (ETT) of a job as a function of GPU count,
  failure rate and the stall of each recovery step, for synchronous training,
  FT-HSDP as its paper measured it, and fthsdp from our measured stalls; both
  as a closed form and as a seeded discrete-event simulation of weeks of
  failures.

Later: the twin of the control plane (an emulation of many ranks in one
process) belongs here too, so that everything that stands in for a real
cluster lives in one labelled package.
"""
