"""The sweep's wing: real pipelined steps over a grid of schedules and batch splits, ranked; and tune."""
