"""Planning beyond this machine: a pipeline simulator calibrated with measured per-stage costs.

orders.py     per-rank action orders (torch's own `pipeline_order` where torch runs it)
simulate.py   dependency-driven event simulation of one step over those orders
calibrate.py  per-block costs, overheads, transfer and memory fitted to measured timelines
planner.py    predictions for any stages / micro-batches / schedules / data-parallel size, ranked
accuracy.py   predicted against measured for every point a sweep ran, beside the noise floor
quick.py      the quick sweep strategy (simulator-ranked search over the grid)
config.py     PlanConfig: the plan's options, validated, bounded where the simulation would not answer
api.py        entry points over saved profiles (the only module that imports torch, lazily)

Everything but api.py is pure: no torch import.
"""
