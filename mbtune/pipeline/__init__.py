"""Pipeline parallelism: split a workload into stages, run torch.distributed.pipelining schedules, time them.

point.py (one point of a grid: what a pipeline runs), point_spec.py (PipelineSpec.for_point: the one conversion of a
point into what every rank receives), split.py, theory.py (closed forms, schedule rules) and timeline.py are
pure; launch.py starts the ranks of one point on this host, torchrun.py (with nodes.py, pure, and agent.py)
under torch.distributed.run across hosts; runner.py and schedules.py import torch and run inside the rank
processes. schedules.py is the only importer of torch.distributed.pipelining.
"""
