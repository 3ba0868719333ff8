"""Microbenchmarks of the machine a run trains on (`zaya bench ...`).

`collectives` times all-gather, reduce-scatter, all-reduce, all-to-all and a ring permute over
each axis of a real mesh and reports bus bandwidths in the records `zaya mesh --collectives`
reads; `command` is its command line.
"""
