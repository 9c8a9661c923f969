"""The jitted step and what it is built from: the functional step, the quorum as arrays, FSDP
sharding, learning-rate intervention, and single-replica training."""
