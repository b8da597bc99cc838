"""`mbtune serve`: tune dynamic batching for inference under a latency budget, measured on real requests.

batcher.py (the dynamic batcher's rules, pure), traffic.py (Poisson arrivals, percentiles, stable windows,
pure), simulate.py (the queueing simulator over the batcher's rules), records.py (what was measured),
config.py (ServeConfig), infer.py (the model process's spec, the service-time curve; torch; the model in
inference mode is mbtune/probing/inference.py's),
server.py (the server and load-generator processes; torch), run.py (the whole run).
"""
